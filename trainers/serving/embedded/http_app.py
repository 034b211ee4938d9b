"""The HTTP side of `mis-jax serve`: a FastAPI app (the stack SGLang's own server uses) over an
`generation.GenerationEngine`, with SGLang 0.5.23's routes, status codes and error bodies (`protocol`).

Handlers are `async`; generation and weight loading run in worker threads, so `/health`,
`/model_info`, `/pause_generation`, `/abort_request` are answered while a batch runs.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from trainers.serving import protocol
from trainers.serving.embedded.generation import GenerationEngine, StageConflict, StageError

# A bucket's bytes are handed to the stage (in a worker thread) in pieces of about this size.
STAGE_FEED_BYTES = 8 << 20

FLUSH_MESSAGE = (
  "Cache flushed.\nPlease check backend logs for more details. (When there are "
  "running or waiting requests, the operation will not be performed.)\n"
)


class _BadBody(Exception):
  """A body that does not parse as the route's JSON object: SGLang's 400 `ErrorResponse`."""


async def _json_body(request: Request, *, empty_ok: bool = True) -> Any:
  raw = await request.body()
  if not raw.strip():
    if empty_ok:
      return {}
    raise _BadBody("request body is empty; send a JSON object")
  try:
    return json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise _BadBody(f"JSON decode error: {e}") from None


def _model(body: Any, model: type):
  if not isinstance(body, dict):
    raise _BadBody(f"Input should be a valid dictionary, got {type(body).__name__}")
  return protocol.convert(body, model, error=_BadBody)


async def _bad_body(request, exc):
  return JSONResponse(protocol.json_error_body(str(exc)), status_code=400)


async def _contract(request, exc):
  return JSONResponse(protocol.contract_error_body(str(exc)), status_code=400)


async def _request_error(request, exc):
  return JSONResponse(protocol.request_error_body(str(exc)), status_code=exc.status_code)


async def _http(request, exc):  # unknown routes and methods: FastAPI's own body, as SGLang
  return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)


async def _bug(request, exc):  # a bug costs one request, not the server
  return JSONResponse(protocol.request_error_body(f"{type(exc).__name__}: {exc}"), status_code=500)


# SGLang's status codes and error bodies, by exception.
ERROR_HANDLERS = (
  (_BadBody, _bad_body),
  (RequestValidationError, _bad_body),
  (protocol.ContractError, _contract),
  (protocol.RequestError, _request_error),
  (StarletteHTTPException, _http),
  (Exception, _bug),
)


class Routes:
  """SGLang's routes over one engine, each an `async` method (`ROUTES` maps paths and methods to
  them); `address`: the server's (host, port), for `/server_info`."""

  def __init__(self, engine: GenerationEngine, address: tuple[str, int]):
    self.engine, self.address = engine, address

  async def generate(self, request: Request):
    body = await _json_body(request, empty_ok=False)
    if not isinstance(body, dict):
      raise _BadBody(f"Input should be a valid dictionary or object to extract fields from, got {type(body).__name__}")
    job = self.engine.submit_body(body)
    return JSONResponse(await run_in_threadpool(self.engine.wait, job))

  async def update_weights_from_disk(self, request: Request):
    obj = _model(await _json_body(request, empty_ok=False), protocol.UpdateWeightsFromDiskRequest)
    if obj.abort_all_requests:
      self.engine.abort(abort_all=True)
    ok, message = await run_in_threadpool(self.engine.update_weights_from_disk, obj.model_path, obj.weight_version)
    return JSONResponse({"success": ok, "message": message, "num_paused_requests": 0}, status_code=200 if ok else 400)

  async def stage_weights(self, request: Request):
    """`protocol.WEIGHTS_STAGE_ROUTE`: one bucket, staged as its bytes arrive."""
    q = request.query_params
    push, bucket = q.get("push"), q.get("bucket", "")
    if not push or not bucket.isdigit():
      raise _BadBody(f"query needs push (a name) and bucket (an index), got push={push!r} bucket={bucket!r}")
    try:
      sink = await run_in_threadpool(
        self.engine.stage_bucket, push=push, version=q.get("weight_version"), bucket=int(bucket), base=q.get("base")
      )
    except StageConflict as e:
      return JSONResponse(protocol.request_error_body(str(e)), status_code=409)
    except StageError as e:
      raise _BadBody(str(e)) from None
    pending, size = [], 0

    def feed(pieces):
      for piece in pieces:
        sink.feed(piece)

    try:
      async for chunk in request.stream():
        pending.append(chunk)
        size += len(chunk)
        if size >= STAGE_FEED_BYTES:
          await run_in_threadpool(feed, pending)
          pending, size = [], 0
      await run_in_threadpool(feed, pending)
      await run_in_threadpool(sink.close)
    except ValueError as e:  # (StageError included) the stage was discarded
      raise _BadBody(f"bucket {bucket} of push {push!r}: {e}") from None
    except BaseException:
      sink.abandon()  # the client went away mid-bucket
      raise
    return {"success": True, "push": push, "bucket": int(bucket), "tensors": sink.tensors}

  async def commit_weights(self, request: Request):
    """`protocol.WEIGHTS_COMMIT_ROUTE`: the staged push in place of the served weights (SGLang's
    update reply)."""
    body = await _json_body(request, empty_ok=False)
    if (
      not isinstance(body, dict)
      or not isinstance(body.get("push"), str)
      or not isinstance(body.get("num_buckets"), int)
    ):
      raise _BadBody("commit needs push (a string) and num_buckets (an integer)")
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
      raise _BadBody("weight_version: Input should be a valid string")
    if body.get("abort_all_requests"):
      self.engine.abort(abort_all=True)
    ok, message = await run_in_threadpool(self.engine.commit_weights, body["push"], version, body["num_buckets"])
    return JSONResponse({"success": ok, "message": message, "num_paused_requests": 0}, status_code=200 if ok else 400)

  async def discard_weights(self, request: Request):
    body = await _json_body(request)
    push = body.get("push") if isinstance(body, dict) else None
    return {"discarded": self.engine.discard_weights(push if isinstance(push, str) else None)}

  async def weights_digest(self):
    return await run_in_threadpool(self.engine.weights_digest)

  async def model_info(self):
    return self.engine.model_info()

  async def server_info(self):
    return self.engine.server_info(*self.address)

  async def weight_version(self):
    return {"weight_version": self.engine.weight_version}

  async def flush_cache(self):
    return PlainTextResponse(FLUSH_MESSAGE)  # no prefix cache survives a request here

  async def pause_generation(self, request: Request):
    obj = _model(await _json_body(request), protocol.PauseGenerationRequest)
    await run_in_threadpool(self.engine.pause, obj.mode)  # "abort" waits for the running batch
    return {"message": "Generation paused successfully.", "status": "ok"}

  async def continue_generation(self, request: Request):
    _model(await _json_body(request), protocol.ContinueGenerationRequest)
    self.engine.resume()
    return {"message": "Generation continued successfully.", "status": "ok"}

  async def abort_request(self, request: Request):
    obj = _model(await _json_body(request), protocol.AbortRequest)
    self.engine.abort(obj.rid, obj.abort_all)
    return Response(status_code=200)

  async def read_probe(self, request: Request):
    body = await _json_body(request, empty_ok=False)
    status, reply = protocol.read_probe(body.get("path") if isinstance(body, dict) else None)
    return JSONResponse(reply, status_code=status)

  async def health(self):
    return Response(status_code=200)

  async def health_generate(self):
    try:
      await run_in_threadpool(self.engine.health_generate)
    except Exception:
      return Response(status_code=503)
    return Response(status_code=200)


# (paths, methods, `Routes` method): SGLang 0.5.23's routes, their aliases, the read probe and
# the streamed weights' routes.
ROUTES = (
  (("/generate",), ("POST", "PUT"), "generate"),
  (("/update_weights_from_disk",), ("POST",), "update_weights_from_disk"),
  (("/get_model_info", "/model_info"), ("GET",), "model_info"),
  (("/get_server_info", "/server_info"), ("GET",), "server_info"),
  (("/weight_version", "/get_weight_version"), ("GET",), "weight_version"),
  (("/flush_cache",), ("GET", "POST"), "flush_cache"),
  (("/pause_generation",), ("POST",), "pause_generation"),
  (("/continue_generation",), ("POST",), "continue_generation"),
  (("/abort_request",), ("POST",), "abort_request"),
  ((protocol.READ_PROBE_ROUTE,), ("POST",), "read_probe"),
  ((protocol.WEIGHTS_STAGE_ROUTE,), ("POST",), "stage_weights"),
  ((protocol.WEIGHTS_COMMIT_ROUTE,), ("POST",), "commit_weights"),
  ((protocol.WEIGHTS_DISCARD_ROUTE,), ("POST",), "discard_weights"),
  ((protocol.WEIGHTS_DIGEST_ROUTE,), ("GET",), "weights_digest"),
  (("/health",), ("GET",), "health"),
  (("/health_generate",), ("GET",), "health_generate"),
)


def create_app(engine: GenerationEngine, *, host: str = "127.0.0.1", port: int = 0) -> FastAPI:
  """The FastAPI app of `engine`: `ROUTES` over a `Routes`, SGLang's error bodies (`ERROR_HANDLERS`)."""
  app = FastAPI(
    title="mis-jax serve", version=protocol.PROTOCOL_VERSION, docs_url=None, redoc_url=None, openapi_url=None
  )
  app.state.address = (host, port)
  for exc, handler in ERROR_HANDLERS:
    app.add_exception_handler(exc, handler)
  routes = Routes(engine, app.state.address)
  for paths, methods, name in ROUTES:
    for path in paths:
      app.add_api_route(path, getattr(routes, name), methods=list(methods))
  return app
