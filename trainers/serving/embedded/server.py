"""`mis-jax serve`: an HTTP server speaking SGLang 0.5.23's native protocol (contract §11).

The trainer cannot tell it from `python -m sglang.launch_server`: same routes, same request and
response JSON, same status codes and error bodies. It serves a Hugging Face checkpoint directory
with the jitted KV-cache sampler of `trainers.serving.embedded.sampler`, in bfloat16 (default, like a real
inference engine) or float32, optionally with weight-only int8 / fp8 Linear kernels
(`--quantize`, `trainers.models.quantize`).

By reason to change: `trainers.serving.protocol` (the request/response schemas, shared with the
client), `trainers.serving.embedded.generation` (model, sampler, scheduler thread, weights, pause/abort),
`trainers.serving.embedded.http_app` (the FastAPI app: routes, error bodies) and this module (the command line,
uvicorn, and the `EmbeddedServer` launcher).

Run: `mis-jax serve --model-path DIR --port 30000` or `python -m trainers.serving.embedded.server ...`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import uvicorn

from trainers.models import checkpoint_dir_problem
from trainers.models.decoder import LAYER_LOOPS, UNROLL_MAX_LAYERS
from trainers.models.invariant import ARITHMETICS
from trainers.models.quantize import QUANTIZATIONS

_LOOPBACK = ("127.0.0.1", "localhost")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="mis-jax serve",
    description="Serve a Hugging Face Qwen2, Qwen3, Qwen3-MoE or Llama checkpoint over "
    "SGLang's native HTTP API (/generate, /update_weights_from_disk, ...).",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--engine",
    default="embedded",
    choices=("embedded", "sglang-jax"),
    help="embedded: this package's engine; sglang-jax: sglang-jax's own server (single-process "
    "mode, from its Python >= 3.12 venv, created once) with the SGLang routes it lacks added "
    "(weight updates, /model_info, weight_version); its own flags go after `--`",
  )
  parser.add_argument("--model-path", required=True, help="HF checkpoint dir (config.json + *.safetensors)")
  parser.add_argument(
    "--host", default="127.0.0.1", choices=_LOOPBACK, help="loopback only: the server has no authentication"
  )
  parser.add_argument("--port", type=int, default=30000, help="0 picks a free port")
  parser.add_argument(
    "--dtype",
    default="bfloat16",
    choices=("bfloat16", "float32"),
    help="inference precision (parameters and compute; log-softmax is float32)",
  )
  parser.add_argument(
    "--quantize",
    default="none",
    choices=QUANTIZATIONS,
    help="weight-only quantised Linear kernels (per-output-channel scales; fp8 is "
    "float8_e4m3fn), dequantised to --dtype; re-applied at every weight update",
  )
  parser.add_argument(
    "--layer-loop",
    default="auto",
    choices=("auto", *LAYER_LOOPS),
    help="the decoding step's layers as one scan or unrolled; auto: unrolled up to "
    f"{UNROLL_MAX_LAYERS} layers (each layer's weights read in place), else scan",
  )
  parser.add_argument(
    "--arithmetic",
    default="default",
    choices=ARITHMETICS,
    help="batch_invariant: exact mode (docs/contract.md §13): every float sum in one fixed "
    "order, so a sample's log-probs do not depend on its batch and equal, bit for bit, a "
    "trainer's teacher-forced pass in the same arithmetic on the same weights (slower)",
  )
  parser.add_argument("--seed", type=int, default=0, help="seeds requests that bring no seed")
  parser.add_argument("--max-batch-size", type=int, default=64, help="rows per compiled batch")
  parser.add_argument("--weight-version", default="default")
  parser.add_argument(
    "--sampling-mask-max-tokens",
    type=int,
    default=4096,
    help="largest sampling support a request may ask for with return_sampling_mask "
    "(its top_k must not exceed it), as SGLang",
  )
  parser.add_argument(
    "--enable-return-routed-experts",
    action="store_true",
    help="a mixture-of-experts model returns each position's experts per layer to requests "
    "with return_routed_experts (SGLang's flag; needed for routing replay, R3)",
  )
  parser.add_argument("--verbose", action="store_true", help="log every HTTP request (sglang-jax: show its log)")
  parser.add_argument(
    "--exit-with-parent",
    action="store_true",
    help="shut down once the process that started this one is gone, however it ended (the "
    "trainer's embedded server; sglang-jax always does)",
  )
  return parser


_EMBEDDED_ONLY = ("quantize", "max_batch_size", "sampling_mask_max_tokens", "layer_loop", "arithmetic")


def check_args(args, extra: tuple[str, ...] = ()) -> str | None:
  """The first problem with the parsed arguments, as one line naming the option, or None."""
  parser = build_parser()
  if args.engine == "embedded" and extra:
    return f"arguments after `--` ({' '.join(extra)}) are for --engine sglang-jax"
  if args.engine == "sglang-jax":
    given = [k for k in _EMBEDDED_ONLY if getattr(args, k) != parser.get_default(k)]
    if given:
      flag = "--" + given[0].replace("_", "-")
      return (
        f"{flag} is an option of the embedded engine; sglang-jax takes its own flags after `--` "
        "(e.g. -- --quantization ...)"
      )
  if args.arithmetic == "batch_invariant" and args.quantize != "none":
    return (
      f"--arithmetic batch_invariant serves unquantised weights (--quantize {args.quantize}: the "
      "quantised kernels are XLA's products)"
    )
  if not 0 <= args.port <= 65535:
    return f"--port {args.port} must be in 0..65535 (0 picks a free port)"
  if args.max_batch_size < 1:
    return f"--max-batch-size {args.max_batch_size} must be >= 1"
  if args.seed < 0:
    return f"--seed {args.seed} must be >= 0"
  if not args.weight_version:
    return "--weight-version must be a non-empty string"
  if args.sampling_mask_max_tokens < 1:
    return f"--sampling-mask-max-tokens {args.sampling_mask_max_tokens} must be positive"
  problem = checkpoint_dir_problem(args.model_path)  # last: the cheap arguments are reported first
  if problem:
    return f"--model-path {args.model_path!r}: {problem}"
  return None


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  extra = tuple(argv[argv.index("--") + 1 :]) if "--" in argv else ()
  args = build_parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
  problem = check_args(args, extra)
  if problem:
    print(f"mis-jax serve: {problem}", file=sys.stderr)
    return 2
  if args.engine == "sglang-jax":
    from trainers.serving.sglang_jax import launcher as sglang_jax

    return sglang_jax.serve(args, extra + ("--random-seed", str(args.seed)) if args.seed else extra)
  try:  # bind first: a busy port is a one-line error before the model loads
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
  except OSError as e:
    print(f"mis-jax serve: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
    return 2
  from trainers.serving.embedded.generation import GenerationEngine
  from trainers.serving.embedded.http_app import create_app

  try:
    engine = GenerationEngine(
      args.model_path,
      dtype=args.dtype,
      seed=args.seed,
      quantize=args.quantize,
      max_batch_size=args.max_batch_size,
      weight_version=args.weight_version,
      sampling_mask_max_tokens=args.sampling_mask_max_tokens,
      enable_return_routed_experts=args.enable_return_routed_experts,
      layer_loop=args.layer_loop,
      arithmetic=args.arithmetic,
    )
  except ValueError as e:  # a config.json or checkpoint this server cannot load
    print(f"mis-jax serve: --model-path {args.model_path!r}: {e}", file=sys.stderr)
    return 2
  host, port = sock.getsockname()[:2]
  app = create_app(engine, host=host, port=port)
  server = _Server(
    uvicorn.Config(
      app, log_level="info" if args.verbose else "warning", access_log=args.verbose, timeout_graceful_shutdown=5
    )
  )
  precision = args.dtype if args.quantize == "none" else f"{args.quantize} weights, {args.dtype}"
  if args.arithmetic != "default":
    precision += f", {args.arithmetic} arithmetic"
  loop, why = engine.layer_loop
  print(
    f"mis-jax serve: {engine.config.model_type} from {engine.model_path} ({precision}, layers {loop}: {why}, "
    f"SGLang {_protocol_version()} protocol) on http://{host}:{port}",
    flush=True,
  )
  if args.exit_with_parent:
    _exit_with_parent(server)
  try:
    server.run(sockets=[sock])  # SIGINT / SIGTERM: graceful shutdown
  finally:
    engine.close()
    sock.close()
  return 0


def _exit_with_parent(server: "_Server", grace_s: float = 10.0) -> None:
  """A thread that shuts the server down once this process is re-parented (its parent died, even
  by SIGKILL or an abort that ran no cleanup), and ends the process if that takes over `grace_s`."""
  import os

  parent = os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(0.5)
    server.handle_exit(signal.SIGTERM, None)
    time.sleep(grace_s)
    os._exit(1)

  threading.Thread(target=watch, daemon=True, name="mis-jax-parent-watch").start()


class _Server(uvicorn.Server):
  """uvicorn's server whose SIGINT / SIGTERM end in a graceful shutdown and exit status 0
  (uvicorn re-raises the signal after shutting down, which would end the process with it)."""

  @contextlib.contextmanager
  def capture_signals(self):
    previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
      yield
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)


def _protocol_version() -> str:
  from trainers.serving.protocol import PROTOCOL_VERSION

  return PROTOCOL_VERSION


class EmbeddedServer:
  """`mis-jax serve` in a subprocess, for a trainer (or a test) that has no SGLang server.

  Use as a context manager, or call `close()`: `with EmbeddedServer(dir) as server: server.url`.
  The port defaults to 0 (a free one, read back from the server's first line, no race). The server
  never outlives this process: it shuts itself down when it is re-parented (`--exit-with-parent`).
  """

  def __init__(
    self,
    model_path: str,
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    port: int = 0,
    max_batch_size: int = 64,
    timeout: float = 300.0,
    quantize: str = "none",
    layer_loop: str = "auto",
    arithmetic: str = "default",
    extra_args: tuple[str, ...] = (),
  ):
    if quantize not in QUANTIZATIONS:  # before a process starts
      raise ValueError(f"quantize must be one of {', '.join(QUANTIZATIONS)}, got {quantize!r}")
    self.process = subprocess.Popen(
      [
        sys.executable,
        "-m",
        "trainers.cli",
        "serve",
        "--model-path",
        str(model_path),
        "--dtype",
        dtype,
        "--seed",
        str(seed),
        "--port",
        str(port),
        "--max-batch-size",
        str(max_batch_size),
        "--quantize",
        quantize,
        "--layer-loop",
        layer_loop,
        "--arithmetic",
        arithmetic,
        "--exit-with-parent",
        *extra_args,
      ],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    self.log: collections.deque[str] = collections.deque(maxlen=200)  # the server's last lines
    self._url: list[str] = []
    threading.Thread(target=self._drain, daemon=True).start()  # a full pipe would block it
    deadline = time.monotonic() + timeout
    try:
      while not self._healthy():
        if self.process.poll() is not None:
          raise RuntimeError(f"mis-jax serve exited with {self.process.returncode}:\n" + "".join(self.log))
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
