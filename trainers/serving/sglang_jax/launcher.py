"""`mis-jax serve --engine sglang-jax`: sglang-jax (SGLang's JAX port) as a rollout engine the
trainer can push weights into.

sglang-jax needs Python >= 3.12 and pins its own jax/flax/transformers, so it runs from a venv
of its own: `$MIS_JAX_SGLANG_JAX_VENV`, else `<cache>/sglang-jax-<version>` (cache:
`$MIS_JAX_CACHE`, default `~/.cache/mis_jax`), created once under a file lock with the pinned
release when missing. Its interpreter is found the way machines have it: `$MIS_JAX_PYTHON312`,
a `python3.12`/`python3.13` on PATH that actually runs (a pyenv shim with no version activated
does not), or `$(pyenv root)/versions/3.1[2-9]*`.

The server is sglang-jax's own HTTP server in its single-process mode, started with
`trainers/serving/sglang_jax/routes.py`, which adds the SGLang routes it lacks
(`/update_weights_from_disk`, `/model_info`, `/get_weight_version`, `weight_version` in
`meta_info`) over its own loader and model runner.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

PIN = "sglang-jax[cpu]==0.1.0rc0"
VERSION = "0.1.0rc0"
ROUTES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "routes.py")

# Defaults that make sglang-jax correct and light on a CPU; any of them can be overridden by
# passing the flag after `--`. Why each: its overlap scheduler garbles some instances'
# multi-sequence batches (--disable-overlap-schedule); `sampling_seed` is ignored without
# --enable-deterministic-sampling; precompilation and warm-up compile shapes a CPU run never
# uses; the native attention backend is the one that runs on CPU.
CPU_DEFAULTS = {
  "--device": "cpu",
  "--attention-backend": "native",
  "--grammar-backend": "none",
  "--random-seed": "0",
  "--max-total-tokens": "4096",
  "--max-running-requests": "64",
  "--mem-fraction-static": "0.05",
  "--watchdog-timeout": "3600",  # its default 300 s: a CPU's first compile of a 28-layer model takes longer
}
CPU_SWITCHES = (
  "--disable-precompile",
  "--skip-server-warmup",
  "--disable-overlap-schedule",
  "--enable-deterministic-sampling",
)


class EngineUnavailable(RuntimeError):
  """sglang-jax's venv cannot be found or created here (the message says what is missing)."""


def cache_dir() -> str:
  return os.environ.get("MIS_JAX_CACHE", os.path.expanduser("~/.cache/mis_jax"))


def venv_dir() -> str:
  return os.environ.get("MIS_JAX_SGLANG_JAX_VENV") or os.path.join(cache_dir(), f"sglang-jax-{VERSION}")


def _runs(python: str) -> bool:
  try:
    return (
      subprocess.run(
        [python, "-c", "import sys; assert sys.version_info >= (3, 12)"], capture_output=True, timeout=60
      ).returncode
      == 0
    )
  except (OSError, subprocess.TimeoutExpired):
    return False


def _pyenv_root() -> str:
  if os.environ.get("PYENV_ROOT"):
    return os.environ["PYENV_ROOT"]
  with contextlib.suppress(OSError, subprocess.SubprocessError):
    out = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30)
    if out.returncode == 0 and out.stdout.strip():
      return out.stdout.strip()
  return os.path.expanduser("~/.pyenv")


def find_python312() -> tuple[str | None, list[str]]:
  """`(interpreter, what was tried)`: a Python >= 3.12 that runs."""
  tried = []
  candidates = [os.environ.get("MIS_JAX_PYTHON312")] + [shutil.which(n) for n in ("python3.12", "python3.13")]
  versions = sorted(glob.glob(os.path.join(_pyenv_root(), "versions", "3.1[2-9]*", "bin", "python3")))
  for python in [c for c in candidates if c] + versions:
    if _runs(python):
      return python, tried
    tried.append(python)
  return None, tried


def venv_python(*, install: bool = True, extra: tuple[str, ...] = ()) -> str:
  """The sglang-jax venv's interpreter with `sgl_jax` (and the `extra` requirements) importable;
  created (once, under a file lock) when missing and `install`. Raises EngineUnavailable."""
  venv = venv_dir()
  python = os.path.join(venv, "bin", "python")
  modules = ["sgl_jax"] + [_module_of(r) for r in extra]

  def ok():
    return (
      os.path.exists(python)
      and subprocess.run([python, "-c", "import " + ", ".join(modules)], capture_output=True).returncode == 0
    )

  os.makedirs(cache_dir(), exist_ok=True)
  with open(os.path.join(cache_dir(), ".sglang-jax.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if ok():
      return python
    if not install:
      raise EngineUnavailable(
        f"no sglang-jax venv at {venv} (run `mis-jax serve --engine sglang-jax` once to "
        f"create it, or set MIS_JAX_SGLANG_JAX_VENV)"
      )
    steps = [[python, "-m", "pip", "install", "-q", PIN, *extra]]
    if not os.path.exists(python):
      base, tried = find_python312()
      if base is None:
        raise EngineUnavailable(
          f"sglang-jax needs Python >= 3.12; none runs here (tried {tried or 'nothing'}; set MIS_JAX_PYTHON312 to one)"
        )
      steps[:0] = [[base, "-m", "venv", venv], [python, "-m", "pip", "install", "-q", "--upgrade", "pip"]]
    for cmd in steps:
      print(f"mis-jax serve: {' '.join(cmd)}", file=sys.stderr, flush=True)
      done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
      if done.returncode != 0:
        raise EngineUnavailable(f"could not prepare {venv}: {' '.join(cmd)} failed: {done.stderr[-1500:]}")
    if not ok():
      raise EngineUnavailable(f"{PIN} installed in {venv}, yet `import {', '.join(modules)}` fails")
    return python


def _module_of(requirement: str) -> str:
  name = requirement.split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip()
  return {"google-tunix": "tunix", "orbax-checkpoint": "orbax.checkpoint", "pyyaml": "yaml"}.get(
    name, name.replace("-", "_")
  )


def has_tokenizer(model_path: str) -> bool:
  return any(
    os.path.isfile(os.path.join(model_path, f))
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
  )


def engine_args(
  model_path: str, *, dtype: str = "float32", enable_return_routed_experts: bool = False, extra: tuple[str, ...] = ()
) -> list[str]:
  """sglang-jax's flags: the CPU defaults unless `extra` sets the flag itself;
  `--skip-tokenizer-init` for a checkpoint without a tokenizer (then `input_ids` only)."""
  given = {a.split("=")[0] for a in extra if a.startswith("--")}
  args = ["--model-path", model_path, "--dtype", dtype]
  for flag, value in CPU_DEFAULTS.items():
    if flag not in given:
      args += [flag, value]
  args += [s for s in CPU_SWITCHES if s not in given]
  if not has_tokenizer(model_path) and "--skip-tokenizer-init" not in given:
    args.append("--skip-tokenizer-init")
  if enable_return_routed_experts:
    args.append("--enable-return-routed-experts")
  return [*args, *extra]


def command(
  python: str,
  model_path: str,
  *,
  port: int,
  dtype: str = "float32",
  weight_version: str = "default",
  enable_return_routed_experts: bool = False,
  extra: tuple[str, ...] = (),
) -> list[str]:
  """The command line of sglang-jax's HTTP server with our routes (`engine_args`' flags)."""
  return [
    python,
    "-P",
    ROUTES,
    "--weight-version",
    weight_version,
    "--host",
    "127.0.0.1",
    "--port",
    str(port),
    *engine_args(model_path, dtype=dtype, enable_return_routed_experts=enable_return_routed_experts, extra=extra),
  ]


def engine_env() -> dict:
  """The engine's environment: the CPU platform, no XLA flags of ours (simulated devices) but the
  LLVM optimisation level (the test suite compiles everything at 0), a persistent compilation cache
  of its own."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
  env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=os.path.join(cache_dir(), "jax-cache-sglang-jax"))
  level = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_backend_optimization_level")]
  if level:
    env["XLA_FLAGS"] = level[-1]
  return env


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class SGLangJaxServer:
  """sglang-jax with our routes in a process group of its own, healthy once constructed; stops
  (the whole group) on `close()` or on leaving the `with` block.

  `log_path`: where its output goes (else kept in memory, the last lines shown on failure).
  """

  def __init__(
    self,
    model_path: str,
    *,
    port: int = 0,
    dtype: str = "float32",
    weight_version: str = "default",
    enable_return_routed_experts: bool = False,
    extra: tuple[str, ...] = (),
    timeout: float = 300.0,
    log_path: str | None = None,
    python: str | None = None,
    echo: bool = False,
  ):
    python = python or venv_python()
    self.port = port or free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.command = command(
      python,
      os.path.abspath(model_path),
      port=self.port,
      dtype=dtype,
      weight_version=weight_version,
      enable_return_routed_experts=enable_return_routed_experts,
      extra=extra,
    )
    self.log: collections.deque[str] = collections.deque(maxlen=200)
    self._echo = echo
    self._log_file = open(log_path, "w") if log_path else None  # noqa: SIM115 - closed in close()
    self.process = subprocess.Popen(
      self.command,
      env=engine_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True,
    )
    threading.Thread(target=self._drain, daemon=True).start()
    try:
      self._wait_healthy(timeout)
    except BaseException:
      self.close()
      raise

  def _drain(self):
    for line in self.process.stdout:
      self.log.append(line)
      if self._echo:
        sys.stdout.write(line)
        sys.stdout.flush()
      if self._log_file is not None:
        self._log_file.write(line)
        self._log_file.flush()

  def _wait_healthy(self, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
      if self.process.poll() is not None:
        raise RuntimeError(f"sglang-jax exited with {self.process.returncode}:\n" + "".join(self.log))
      with contextlib.suppress(OSError):
        with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
          if r.status == 200:
            return
      if time.monotonic() > deadline:
        raise TimeoutError(f"sglang-jax not healthy after {timeout} s:\n" + "".join(self.log))
      time.sleep(0.3)

  def close(self) -> None:
    if self.process.poll() is None:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(self.process.pid, signal.SIGTERM)
      try:
        self.process.wait(timeout=30)
      except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
    with contextlib.suppress(ProcessLookupError):  # what its scheduler or detokenizer left behind
      os.killpg(self.process.pid, signal.SIGKILL)
    if self._log_file is not None:
      self._log_file.close()
      self._log_file = None

  def __enter__(self) -> "SGLangJaxServer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def serve(args, extra: tuple[str, ...]) -> int:
  """`mis-jax serve --engine sglang-jax`: starts the engine, prints its URL once healthy, and
  stops it with this process (SIGINT / SIGTERM: exit 0)."""
  stop = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: stop.set())
  if args.port:  # a busy port is a one-line error before the engine starts
    with socket.socket() as s:
      try:
        s.bind((args.host, args.port))
      except OSError as e:
        print(f"mis-jax serve: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 2
  try:
    server = SGLangJaxServer(
      args.model_path,
      port=args.port,
      dtype=args.dtype,
      weight_version=args.weight_version,
      enable_return_routed_experts=args.enable_return_routed_experts,
      extra=extra,
      echo=args.verbose,
    )
  except EngineUnavailable as e:
    print(f"mis-jax serve: --engine sglang-jax: {e}", file=sys.stderr)
    return 2
  except (RuntimeError, TimeoutError) as e:
    print(f"mis-jax serve: --engine sglang-jax did not start: {e}", file=sys.stderr)
    return 1
  with server:
    print(
      f"mis-jax serve: sglang-jax {VERSION} serving {os.path.abspath(args.model_path)} ({args.dtype}, "
      f"single process, weight version {args.weight_version!r}) on {server.url}",
      flush=True,
    )
    while not stop.wait(0.5):
      if server.process.poll() is not None:
        print(
          f"mis-jax serve: sglang-jax exited with {server.process.returncode}:\n" + "".join(server.log), file=sys.stderr
        )
        return 1
  return 0


TUNIX = "google-tunix==0.1.7"  # shares the venv with sglang-jax (tunix resolves with its flax 0.12.4)


def trainer_requirements() -> tuple[str, ...]:
  """What `mis-jax train` needs beside sglang-jax (colocated rollouts run the trainer in its venv):
  this package's own requirements and its `train` extra, as installed here."""
  import importlib.metadata

  try:
    requires = importlib.metadata.requires("mis_jax") or []
  except importlib.metadata.PackageNotFoundError as e:
    raise EngineUnavailable(
      "mis_jax is not installed here (`make venv`): its requirements are read from its metadata"
    ) from e
  return tuple(r.split(";")[0].strip() for r in requires if ";" not in r or 'extra == "train"' in r)


def main(argv: list[str] | None = None) -> int:
  """`python -m trainers.serving.sglang_jax --prepare [--tunix] [--trainer]`: creates the sglang-jax
  venv when missing (with tunix 0.1.7, and with the trainer's requirements, when asked), prints its
  interpreter; `make test` runs it first."""
  import argparse

  parser = argparse.ArgumentParser(prog="python -m trainers.serving.sglang_jax", description=main.__doc__)
  parser.add_argument("--prepare", action="store_true", required=True)
  parser.add_argument("--tunix", action="store_true", help=f"also {TUNIX} (the tunix + sglang-jax path)")
  parser.add_argument(
    "--trainer",
    action="store_true",
    help="also what `mis-jax train` needs (rollout.placement.mode colocated with rollout.placement.engine sglang-jax)",
  )
  args = parser.parse_args(argv)
  try:
    print(venv_python(extra=((TUNIX,) if args.tunix else ()) + (trainer_requirements() if args.trainer else ())))
  except EngineUnavailable as e:
    print(f"sglang-jax: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
