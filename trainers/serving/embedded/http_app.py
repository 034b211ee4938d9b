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
from trainers.serving.embedded.generation import GenerationEngine

FLUSH_MESSAGE = ("Cache flushed.\nPlease check backend logs for more details. (When there are "
                 "running or waiting requests, the operation will not be performed.)\n")


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


def create_app(engine: GenerationEngine, *, host: str = "127.0.0.1", port: int = 0) -> FastAPI:
  app = FastAPI(title="mis-jax serve", version=protocol.PROTOCOL_VERSION,
                docs_url=None, redoc_url=None, openapi_url=None)
  app.state.address = (host, port)

  @app.exception_handler(_BadBody)
  async def _bad_body(request, exc):
    return JSONResponse(protocol.json_error_body(str(exc)), status_code=400)

  @app.exception_handler(RequestValidationError)
  async def _validation(request, exc):
    return JSONResponse(protocol.json_error_body(str(exc)), status_code=400)

  @app.exception_handler(protocol.ContractError)
  async def _contract(request, exc):
    return JSONResponse(protocol.contract_error_body(str(exc)), status_code=400)

  @app.exception_handler(protocol.RequestError)
  async def _request_error(request, exc):
    return JSONResponse(protocol.request_error_body(str(exc)), status_code=exc.status_code)

  @app.exception_handler(StarletteHTTPException)
  async def _http(request, exc):  # unknown routes and methods: FastAPI's own body, as SGLang
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)

  @app.exception_handler(Exception)
  async def _bug(request, exc):  # a bug costs one request, not the server
    return JSONResponse(protocol.request_error_body(f"{type(exc).__name__}: {exc}"), status_code=500)

  @app.api_route("/generate", methods=["POST", "PUT"])
  async def generate(request: Request):
    body = await _json_body(request, empty_ok=False)
    if not isinstance(body, dict):
      raise _BadBody(f"Input should be a valid dictionary or object to extract fields from, "
                     f"got {type(body).__name__}")
    job = engine.submit_body(body)
    return JSONResponse(await run_in_threadpool(engine.wait, job))

  @app.post("/update_weights_from_disk")
  async def update_weights_from_disk(request: Request):
    obj = _model(await _json_body(request, empty_ok=False), protocol.UpdateWeightsFromDiskRequest)
    if obj.abort_all_requests:
      engine.abort(abort_all=True)
    ok, message = await run_in_threadpool(engine.update_weights_from_disk, obj.model_path,
                                          obj.weight_version)
    return JSONResponse({"success": ok, "message": message, "num_paused_requests": 0},
                        status_code=200 if ok else 400)

  @app.get("/model_info")
  @app.get("/get_model_info")
  async def model_info():
    return engine.model_info()

  @app.get("/server_info")
  @app.get("/get_server_info")
  async def server_info():
    return engine.server_info(*app.state.address)

  @app.get("/get_weight_version")
  @app.get("/weight_version")
  async def weight_version():
    return {"weight_version": engine.weight_version}

  @app.api_route("/flush_cache", methods=["GET", "POST"])
  async def flush_cache():
    return PlainTextResponse(FLUSH_MESSAGE)  # no prefix cache survives a request here

  @app.post("/pause_generation")
  async def pause_generation(request: Request):
    obj = _model(await _json_body(request), protocol.PauseGenerationRequest)
    await run_in_threadpool(engine.pause, obj.mode)  # "abort" waits for the running batch
    return {"message": "Generation paused successfully.", "status": "ok"}

  @app.post("/continue_generation")
  async def continue_generation(request: Request):
    _model(await _json_body(request), protocol.ContinueGenerationRequest)
    engine.resume()
    return {"message": "Generation continued successfully.", "status": "ok"}

  @app.post("/abort_request")
  async def abort_request(request: Request):
    obj = _model(await _json_body(request), protocol.AbortRequest)
    engine.abort(obj.rid, obj.abort_all)
    return Response(status_code=200)

  @app.post(protocol.READ_PROBE_ROUTE)
  async def read_probe(request: Request):
    body = await _json_body(request, empty_ok=False)
    status, reply = protocol.read_probe(body.get("path") if isinstance(body, dict) else None)
    return JSONResponse(reply, status_code=status)

  @app.get("/health")
  async def health():
    return Response(status_code=200)

  @app.get("/health_generate")
  async def health_generate():
    try:
      await run_in_threadpool(engine.health_generate)
    except Exception:
      return Response(status_code=503)
    return Response(status_code=200)

  return app
