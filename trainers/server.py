"""`mis-jax serve`: an HTTP server speaking SGLang's native protocol (SPEC §11).

The trainer cannot tell it from `python -m sglang.launch_server`: same routes, same request and
response JSON, same error statuses. It serves a Hugging Face checkpoint directory with the
jitted KV-cache sampler of `trainers.sampler`, in bfloat16 (default, like a real inference
engine) or float32.

Routes: POST /generate, POST /update_weights_from_disk, GET /model_info (/get_model_info),
GET /server_info (/get_server_info), POST|GET /flush_cache, POST /pause_generation,
POST /continue_generation, POST /abort_request, GET /health, GET /health_generate.

Concurrency: HTTP requests run on threads; one lock serialises generation and weight updates,
so weights never change under a running batch. `pause_generation` holds new and queued
requests until `continue_generation`; with `mode: "abort"` every request already in flight
ends with `finish_reason: {"type": "abort"}` (a batch already running on the device finishes
its computation, and keeps its tokens, but is reported aborted).

Run: `mis-jax serve --model-path DIR --port 30000` or `python -m trainers.server ...`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jax.numpy as jnp
from flax import nnx

from trainers.models import (ModelConfig, checkpoint_dir_problem, load_hf_checkpoint, read_hf_tensors,
                             state_from_hf_tensors)
from trainers.sampler import Completion, Sampler, SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
_LOOPBACK = ("127.0.0.1", "localhost")

# SGLang sampling_params keys, split by how this engine treats them.
_HONOURED = {"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop_token_ids", "n",
             "ignore_eos", "sampling_seed"}
# Output-formatting keys: the stop token is always kept in output_ids (as `no_stop_trim`), and
# `text` (only with a tokenizer.json) is decoded with special tokens kept.
_IGNORED = {"no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "stream_interval"}
# Accepted only at their no-op value; anything else asks for a feature not implemented here.
_NOOP_VALUES = {"stop": (None,), "stop_regex": (None,), "min_new_tokens": (0, None),
                "frequency_penalty": (0, None), "presence_penalty": (0, None),
                "repetition_penalty": (1, None), "json_schema": (None,), "regex": (None,),
                "ebnf": (None,), "structural_tag": (None,), "logit_bias": (None,),
                "custom_params": (None,)}
# Top-level /generate keys: honoured, or harmless at their default.
_TOP_LEVEL = {"input_ids", "text", "sampling_params", "return_logprob", "rid", "seed",
              "return_text_in_logprobs", "logprob_start_len"}
_TOP_LEVEL_NOOP = {"stream": (False, None), "top_logprobs_num": (0, None),
                   "token_ids_logprob": (None,), "lora_path": (None,),
                   "custom_logit_processor": (None,), "return_hidden_states": (False, None),
                   "image_data": (None,), "audio_data": (None,), "video_data": (None,),
                   "input_embeds": (None,), "data_parallel_rank": (None,), "priority": (None,)}
_UPDATE_KEYS = {"model_path", "weight_version", "load_format", "abort_all_requests", "is_async",
                "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache"}


class BadRequest(ValueError):
  """A request the server rejects with HTTP 400; the message names the offending field."""


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _noop_value(value, allowed) -> bool:
  """Whether `value` is one of the no-op values `allowed` (an empty list/str/dict counts as None)."""
  if isinstance(value, (list, tuple, dict, str)) and not value:
    value = None
  return any(value is a if a is None or isinstance(a, bool)
             else not isinstance(value, bool) and value == a for a in allowed)


def parse_sampling_params(d, *, where: str = "sampling_params") -> SamplingParams:
  """SGLang `sampling_params` dict → `SamplingParams`; raises `BadRequest` naming the key."""
  if d is None:
    d = {}
  if not isinstance(d, dict):
    raise BadRequest(f"{where} must be an object")
  for key, value in d.items():
    if key in _HONOURED or key in _IGNORED:
      continue
    if key in _NOOP_VALUES:
      if not _noop_value(value, _NOOP_VALUES[key]):
        raise BadRequest(f"{where}.{key}={value!r} is not supported by this server")
      continue
    raise BadRequest(f"Unknown sampling parameter in {where}: {key!r}")
  stop_ids = d.get("stop_token_ids") or []
  if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
    raise BadRequest(f"{where}.stop_token_ids must be a list of ints")
  top_k = d.get("top_k", -1)
  max_new = d.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
  n, seed = d.get("n", 1), d.get("sampling_seed")
  for key, value in (("top_k", top_k), ("max_new_tokens", max_new), ("n", n)):
    if not _is_int(value):
      raise BadRequest(f"{where}.{key} must be an int, got {value!r}")
  if seed is not None and not _is_int(seed):
    raise BadRequest(f"{where}.sampling_seed must be an int, got {seed!r}")
  for key in ("temperature", "top_p", "min_p"):
    if key in d and (isinstance(d[key], bool) or not isinstance(d[key], (int, float))):
      raise BadRequest(f"{where}.{key} must be a number, got {d[key]!r}")
  if not isinstance(d.get("ignore_eos", False), bool):
    raise BadRequest(f"{where}.ignore_eos must be a boolean, got {d['ignore_eos']!r}")
  try:
    return SamplingParams(
        temperature=float(d.get("temperature", 1.0)), top_p=float(d.get("top_p", 1.0)),
        top_k=top_k, min_p=float(d.get("min_p", 0.0)), max_new_tokens=max_new,
        stop_token_ids=tuple(stop_ids), ignore_eos=d.get("ignore_eos", False), n=n, seed=seed)
  except ValueError as e:
    raise BadRequest(f"{where}: {e}") from None


@dataclasses.dataclass
class GenerateRequest:
  prompts: list[list[int]]
  params: list[SamplingParams]
  batched: bool  # a list of prompts was sent (the response is then always a list)
  return_logprob: bool
  return_text_in_logprobs: bool
  rids: list[str] | None


def parse_generate(body, config: ModelConfig, tokenizer=None) -> GenerateRequest:
  """Validates a /generate body (SGLang's `GenerateReqInput` subset); raises `BadRequest`."""
  if not isinstance(body, dict):
    raise BadRequest("request body must be a JSON object")
  for key, value in body.items():
    if key in _TOP_LEVEL:
      continue
    if key in _TOP_LEVEL_NOOP:
      if not _noop_value(value, _TOP_LEVEL_NOOP[key]):
        raise BadRequest(f"{key}={value!r} is not supported by this server")
      continue
    raise BadRequest(f"Unknown field in /generate request: {key!r}")
  ids = body.get("input_ids")
  if ids is not None and body.get("text") is not None:
    raise BadRequest("send either text or input_ids, not both")
  if ids is None and body.get("text") is not None:
    if tokenizer is None:
      raise BadRequest("'text' needs a tokenizer and this checkpoint has none; send 'input_ids'")
    text = body["text"]
    ids = [tokenizer.encode(t).ids for t in text] if isinstance(text, list) else tokenizer.encode(text).ids
  if ids is None:
    raise BadRequest("input_ids is required")
  if not isinstance(ids, list) or not ids:
    raise BadRequest("input_ids must be a non-empty list of token ids or of lists of token ids")
  batched = isinstance(ids[0], list)
  prompts = ids if batched else [ids]
  vocab, context = config.vocab_size, config.max_position_embeddings
  for i, p in enumerate(prompts):
    name = f"input_ids[{i}]" if batched else "input_ids"
    if not isinstance(p, list) or not p:
      raise BadRequest(f"{name} must be a non-empty list of token ids")
    if not all(_is_int(t) for t in p):
      raise BadRequest(f"{name} must contain only ints")
    bad = [t for t in p if not 0 <= t < vocab]
    if bad:
      raise BadRequest(f"{name} has token id {bad[0]} outside the vocabulary [0, {vocab})")
  sp = body.get("sampling_params")
  if isinstance(sp, list):
    if len(sp) != len(prompts):
      raise BadRequest(f"sampling_params has {len(sp)} entries for {len(prompts)} prompts")
    params = [parse_sampling_params(d, where=f"sampling_params[{i}]") for i, d in enumerate(sp)]
  else:
    params = [parse_sampling_params(sp)] * len(prompts)
  seed = body.get("seed")
  if seed is not None:
    if not _is_int(seed):
      raise BadRequest(f"seed must be an int, got {seed!r}")
    params = [p if p.seed is not None else dataclasses.replace(p, seed=seed) for p in params]
  for i, (p, prompt) in enumerate(zip(params, prompts)):
    if len(prompt) + p.max_new_tokens > context:
      raise BadRequest(
          f"Requested token count exceeds the model's maximum context length of {context} tokens: "
          f"{len(prompt)} input tokens + max_new_tokens {p.max_new_tokens} (prompt {i})")
  rid = body.get("rid")
  if rid is not None:
    rids = rid if isinstance(rid, list) else [rid]
    if len(rids) != len(prompts) or not all(isinstance(r, str) for r in rids):
      raise BadRequest("rid must be a string (or a list of strings, one per prompt)")
  for key in ("return_logprob", "return_text_in_logprobs"):
    if not isinstance(body.get(key, False), bool):
      raise BadRequest(f"{key} must be a boolean")
  return GenerateRequest(prompts, params, batched, bool(body.get("return_logprob", False)),
                         bool(body.get("return_text_in_logprobs", False)),
                         rids if rid is not None else None)


def _finite(x: float):
  return x if math.isfinite(x) else None  # SGLang sends NaN / -inf log-probs as null


class _InFlight:
  def __init__(self):
    self.aborted = False


class Engine:
  """Model, sampler and serving state (weight version, pause, in-flight requests)."""

  def __init__(self, model_path: str, *, dtype: str = "bfloat16", seed: int = 0,
               max_batch_size: int = 64, weight_version: str = "default"):
    self.model_path = os.path.abspath(model_path)
    self.dtype = dtype
    jdtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[dtype]
    model = load_hf_checkpoint(model_path, dtype=jdtype, param_dtype=jdtype)
    self.config = model.config
    self.sampler = Sampler(model, max_batch_size=max_batch_size, seed=seed)
    self.weight_version = weight_version
    self.tokenizer = _load_tokenizer(model_path)
    self._lock = threading.Lock()  # serialises generation and weight updates
    self._cv = threading.Condition()  # guards pause state and the in-flight registry
    self._paused = False
    self._inflight: dict[str, _InFlight] = {}

  @property
  def paused(self) -> bool:
    return self._paused

  # ---- generation -------------------------------------------------------------------------
  def generate(self, req: GenerateRequest):
    start = time.perf_counter()
    keys = req.rids or [uuid.uuid4().hex for _ in req.prompts]
    with self._cv:
      dup = [k for k in keys if k in self._inflight]
      if dup or len(set(keys)) != len(keys):
        raise BadRequest(f"Duplicate request ID: {dup[0] if dup else keys}")
      record = _InFlight()
      self._inflight.update({k: record for k in keys})
    try:
      completions, version = self._run(req, record)
    finally:
      with self._cv:
        for k in keys:
          self._inflight.pop(k, None)
    latency = time.perf_counter() - start
    out = [self._format(req, c, keys, record.aborted, version, latency) for c in completions]
    return out if (req.batched or len(out) > 1) else out[0]

  def _run(self, req: GenerateRequest, record: _InFlight):
    while True:
      with self._cv:
        while self._paused and not record.aborted:
          self._cv.wait()
        if record.aborted:
          return self._aborted(req), self.weight_version
      with self._lock:
        with self._cv:
          if self._paused or record.aborted:  # paused while we queued for the lock
            continue
        return self.sampler.generate(req.prompts, req.params), self.weight_version

  @staticmethod
  def _aborted(req: GenerateRequest) -> list[Completion]:
    return [Completion(i, j, len(prompt), [], [], ("abort", 0))
            for i, (prompt, p) in enumerate(zip(req.prompts, req.params)) for j in range(p.n)]

  def _format(self, req, c: Completion, keys, aborted, version, latency) -> dict:
    kind, value = c.finish_reason
    if aborted:
      finish = {"type": "abort", "message": "Abort in waiting queue" if kind == "abort"
                else "Aborted by pause_generation or abort_request"}
    elif kind == "stop":
      finish = {"type": "stop", "matched": value}
    else:
      finish = {"type": "length", "length": value}
    n = req.params[c.prompt_index].n
    meta = {"id": keys[c.prompt_index] if n == 1 else f"{keys[c.prompt_index]}-{c.sample_index}",
            "finish_reason": finish, "prompt_tokens": c.prompt_tokens,
            "completion_tokens": len(c.output_ids), "cached_tokens": 0,
            "weight_version": version, "e2e_latency": latency}
    if req.return_logprob:
      meta["output_token_logprobs"] = [
          [_finite(lp), t, self._decode([t]) if req.return_text_in_logprobs else None]
          for lp, t in zip(c.logprobs, c.output_ids)]
    return {"text": self._decode(c.output_ids), "output_ids": c.output_ids, "meta_info": meta}

  def _decode(self, ids: list[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else ""

  # ---- control ----------------------------------------------------------------------------
  def pause(self, mode: str) -> None:
    with self._cv:
      self._paused = True
      if mode == "abort":
        for record in self._inflight.values():
          record.aborted = True
      self._cv.notify_all()

  def resume(self) -> None:
    with self._cv:
      self._paused = False
      self._cv.notify_all()

  def abort(self, rid: str | None, abort_all: bool) -> None:
    with self._cv:
      for k, record in self._inflight.items():
        if abort_all or k == rid:
          record.aborted = True
      self._cv.notify_all()

  def update_weights_from_disk(self, path: str, weight_version: str | None) -> tuple[bool, str]:
    """Loads `path` (HF safetensors) in place of the current weights, all or nothing."""
    try:
      new_config = ModelConfig.from_pretrained(path)
      ignore = ("initializer_range", "bos_token_id", "eos_token_id")
      diff = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ignore
              and getattr(new_config, f.name) != getattr(self.config, f.name)]
      if diff:
        raise ValueError(f"config.json differs from the served model in {', '.join(diff)}")
      tensors = read_hf_tensors(path)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
      return False, f"Failed to load weights from {path!r}: {e}"
    with self._lock:
      try:
        model = nnx.merge(self.sampler.graphdef, self.sampler.params)
        self.sampler.set_params(state_from_hf_tensors(model, tensors))
      except ValueError as e:
        return False, f"Failed to load weights from {path!r}: {e}"
      if weight_version is not None:
        self.weight_version = weight_version
      self.model_path = os.path.abspath(path)
    return True, "Succeeded to update model weights."

  def health_generate(self) -> None:
    with self._lock:
      self.sampler.generate([[self.config.bos_token_id or 0]],
                            SamplingParams(max_new_tokens=1, temperature=0.0))

  def model_info(self) -> dict:
    return {"model_path": self.model_path, "tokenizer_path": self.model_path,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.weight_version, "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": self.config.model_type,
            "architectures": self.config.to_hf_dict()["architectures"]}


def _load_tokenizer(path: str):
  """`tokenizer.json` via the `tokenizers` library when both exist; otherwise none (text is "")."""
  file = os.path.join(path, "tokenizer.json")
  if not os.path.exists(file):
    return None
  try:
    from tokenizers import Tokenizer
  except ImportError:
    return None
  return Tokenizer.from_file(file)


def make_handler(engine: Engine, *, verbose: bool = False):

  class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
      if verbose:
        super().log_message(fmt, *args)

    def _send(self, status: int, payload, *, text: bool = False):
      body = (payload if text else json.dumps(payload, allow_nan=False)).encode()
      self.send_response(status)
      self.send_header("Content-Type", "text/plain" if text else "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def _error(self, status: int, message: str):
      self._send(status, {"error": {"message": message, "code": status}})

    def _body(self):
      length = int(self.headers.get("Content-Length") or 0)
      raw = self.rfile.read(length) if length else b""
      if not raw.strip():
        return {}
      try:
        return json.loads(raw)
      except json.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None

    def do_GET(self):
      self._dispatch("GET")

    def do_POST(self):
      self._dispatch("POST")

    def _dispatch(self, method: str):
      route = self.path.split("?")[0].rstrip("/") or "/"
      handler = _ROUTES.get((method, route))
      if handler is None:
        return self._error(HTTPStatus.NOT_FOUND, f"no route {method} {route}")
      try:
        body = self._body() if method == "POST" else {}
        handler(self, body)
      except BadRequest as e:
        self._error(HTTPStatus.BAD_REQUEST, str(e))
      except Exception as e:  # a bug must cost one request, not the server
        self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")

    def generate(self, body):
      req = parse_generate(body, engine.config, engine.tokenizer)
      self._send(HTTPStatus.OK, engine.generate(req))

    def update_weights_from_disk(self, body):
      unknown = sorted(set(body) - _UPDATE_KEYS)
      if unknown or not isinstance(body.get("model_path"), str):
        message = (f"Unknown field in /update_weights_from_disk request: {unknown[0]!r}" if unknown
                   else "model_path (a string) is required")
        return self._send(HTTPStatus.BAD_REQUEST, {"success": False, "message": message})
      version = body.get("weight_version")
      if body.get("abort_all_requests"):
        engine.abort(None, abort_all=True)
      ok, message = engine.update_weights_from_disk(
          body["model_path"], None if version is None else str(version))
      self._send(HTTPStatus.OK if ok else HTTPStatus.BAD_REQUEST,
                 {"success": ok, "message": message, "num_paused_requests": 0})

    def model_info(self, body):
      self._send(HTTPStatus.OK, engine.model_info())

    def server_info(self, body):
      host, port = self.server.server_address[:2]
      self._send(HTTPStatus.OK, {
          "model_path": engine.model_path, "host": host, "port": port, "dtype": engine.dtype,
          "context_length": engine.config.max_position_embeddings,
          "max_batch_size": engine.sampler.max_batch_size, "weight_version": engine.weight_version,
          "paused": engine.paused, "version": "mis-jax"})

    def flush_cache(self, body):
      # No prefix cache survives a request here, so there is nothing to drop.
      self._send(HTTPStatus.OK, "Cache flushed.\nPlease check backend logs for more details. "
                 "(When there are running or waiting requests, the operation will not be performed.)\n",
                 text=True)

    def pause_generation(self, body):
      mode = body.get("mode", "abort")
      if mode not in ("abort", "retract", "in_place"):
        raise BadRequest(f"mode must be one of 'abort', 'retract', 'in_place', got {mode!r}")
      engine.pause(mode)
      self._send(HTTPStatus.OK, {"message": "Generation paused successfully.", "status": "ok"})

    def continue_generation(self, body):
      engine.resume()
      self._send(HTTPStatus.OK, {"message": "Generation continued successfully.", "status": "ok"})

    def abort_request(self, body):
      engine.abort(body.get("rid"), bool(body.get("abort_all", False)))
      self._send(HTTPStatus.OK, {"success": True})

    def health(self, body):
      self._send(HTTPStatus.OK, "", text=True)

    def health_generate(self, body):
      try:
        engine.health_generate()
      except Exception as e:
        return self._error(HTTPStatus.SERVICE_UNAVAILABLE, f"generation failed: {e}")
      self._send(HTTPStatus.OK, "", text=True)

  _ROUTES = {
      ("POST", "/generate"): Handler.generate,
      ("POST", "/update_weights_from_disk"): Handler.update_weights_from_disk,
      ("GET", "/model_info"): Handler.model_info,
      ("GET", "/get_model_info"): Handler.model_info,
      ("GET", "/server_info"): Handler.server_info,
      ("GET", "/get_server_info"): Handler.server_info,
      ("GET", "/flush_cache"): Handler.flush_cache,
      ("POST", "/flush_cache"): Handler.flush_cache,
      ("POST", "/pause_generation"): Handler.pause_generation,
      ("POST", "/continue_generation"): Handler.continue_generation,
      ("POST", "/abort_request"): Handler.abort_request,
      ("GET", "/health"): Handler.health,
      ("GET", "/health_generate"): Handler.health_generate,
  }
  return Handler


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="mis-jax serve", description="Serve a Hugging Face Qwen2/Qwen3 checkpoint over "
      "SGLang's native HTTP API (/generate, /update_weights_from_disk, ...).",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--model-path", required=True, help="HF checkpoint dir (config.json + *.safetensors)")
  parser.add_argument("--host", default="127.0.0.1", choices=_LOOPBACK,
                      help="loopback only: the server has no authentication")
  parser.add_argument("--port", type=int, default=30000, help="0 picks a free port")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                      help="inference precision (parameters and compute; log-softmax is float32)")
  parser.add_argument("--seed", type=int, default=0, help="seeds requests that bring no seed")
  parser.add_argument("--max-batch-size", type=int, default=64, help="rows per compiled batch")
  parser.add_argument("--weight-version", default="default")
  parser.add_argument("--verbose", action="store_true", help="log every HTTP request")
  return parser


def check_args(args) -> str | None:
  """The first problem with the parsed arguments, as one line naming the option, or None."""
  problem = checkpoint_dir_problem(args.model_path)
  if problem:
    return f"--model-path {args.model_path!r}: {problem}"
  if not 0 <= args.port <= 65535:
    return f"--port {args.port} must be in 0..65535 (0 picks a free port)"
  if args.max_batch_size < 1:
    return f"--max-batch-size {args.max_batch_size} must be >= 1"
  if args.seed < 0:
    return f"--seed {args.seed} must be >= 0"
  if not args.weight_version:
    return "--weight-version must be a non-empty string"
  return None


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  problem = check_args(args)
  if problem:
    print(f"mis-jax serve: {problem}", file=sys.stderr)
    return 2
  try:
    engine = Engine(args.model_path, dtype=args.dtype, seed=args.seed,
                    max_batch_size=args.max_batch_size, weight_version=args.weight_version)
  except ValueError as e:  # a config.json or checkpoint this server cannot load
    print(f"mis-jax serve: --model-path {args.model_path!r}: {e}", file=sys.stderr)
    return 2
  try:
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine, verbose=args.verbose))
  except OSError as e:
    print(f"mis-jax serve: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
    return 2
  server.daemon_threads = True
  host, port = server.server_address[:2]
  print(f"mis-jax serve: {engine.config.model_type} from {engine.model_path} ({args.dtype}) "
        f"on http://{host}:{port}", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
  return 0


class EmbeddedServer:
  """`mis-jax serve` in a subprocess, for a trainer (or a test) that has no SGLang server.

  Use as a context manager, or call `close()`: `with EmbeddedServer(dir) as server: server.url`.
  The port defaults to 0 (a free one, read back from the server's first line, no race).
  """

  def __init__(self, model_path: str, *, dtype: str = "bfloat16", seed: int = 0, port: int = 0,
               max_batch_size: int = 64, timeout: float = 300.0, extra_args: tuple[str, ...] = ()):
    self.process = subprocess.Popen(
        [sys.executable, "-m", "trainers.cli", "serve", "--model-path", str(model_path), "--dtype", dtype,
         "--seed", str(seed), "--port", str(port), "--max-batch-size", str(max_batch_size),
         *extra_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.log: collections.deque[str] = collections.deque(maxlen=200)  # the server's last lines
    self._url: list[str] = []
    threading.Thread(target=self._drain, daemon=True).start()  # a full pipe would block it
    deadline = time.monotonic() + timeout
    try:
      while not self._healthy():
        if self.process.poll() is not None:
          raise RuntimeError(f"mis-jax serve exited with {self.process.returncode}:\n"
                             + "".join(self.log))
        if time.monotonic() > deadline:
          raise TimeoutError(f"mis-jax serve not healthy after {timeout} s:\n" + "".join(self.log))
        time.sleep(0.2)
    except BaseException:
      self.close()
      raise
    self.url = self._url[0]

  def _drain(self):
    for line in self.process.stdout:
      match = re.search(r" on (http://\S+)$", line.rstrip())
      if match and not self._url:
        self._url.append(match.group(1))
      self.log.append(line)

  def _healthy(self) -> bool:
    if not self._url:
      return False
    try:
      with urllib.request.urlopen(self._url[0] + "/health", timeout=5) as r:
        return r.status == 200
    except OSError:
      return False

  def close(self) -> None:
    if self.process.poll() is None:
      self.process.terminate()
      try:
        self.process.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()

  def __enter__(self) -> "EmbeddedServer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


if __name__ == "__main__":
  sys.exit(main())
