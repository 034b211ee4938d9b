"""`mis-jax launch --role trainer|worker|router`: one entry point that starts a role of a fleet
from the environment a scheduler gives it (docs/guides/fleet.md). The local demo
(deploy/local/fleet_demo.sh), the SLURM recipe (deploy/slurm/) and the JobSet recipe (deploy/k8s/)
all start their processes with it.

- `router`: sglang-router on `--port` (`MIS_JAX_ROUTER_PORT`), `--policy` (cache_aware), over
  `--worker-url`s if any (workers may register later);
- `worker`: a rollout server of `--model-path` on `--port` (`--engine`: `embedded`, `mis-jax serve`
  on loopback; `sglang`, its own `launch_server` on `--host`; `sglang-jax`, its HTTP server with the
  weight-update routes it lacks (`trainers/serving/sglang_jax/routes.py`) on `--host`; the arguments
  after `--` passed on), paused, then registered with `--router` (`MIS_JAX_ROUTER`) under the address
  the others reach it at: it holds the router's requests until the trainer's push gives it the current
  weights; deregistered when it is stopped (SIGTERM / SIGINT);
- `trainer`: `mis-jax train` with the arguments after `--`, its process group (`trainer_env`) from
  the flags, else `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`, else the
  scheduler's, and `--router` (`MIS_JAX_ROUTER`) passed on.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading

from trainers.serving.sglang_jax import launcher as sglang_jax_launcher  # the standard library only

ROLES = ("trainer", "worker", "router")
ENGINES = ("embedded", "sglang", "sglang-jax")
# What `--python` runs for each engine: SGLang's own server; sglang-jax's own server started by
# routes.py (stdlib + sgl_jax only), which adds `/update_weights_from_disk`, `/model_info` and
# `weight_version` (sglang-jax 0.1.0rc0's `sgl_jax.launch_server` cannot take the trainer's weights).
SERVER_ENTRY = {"sglang": ("-m", "sglang.launch_server"), "sglang-jax": ("-P", sglang_jax_launcher.ROUTES)}


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="mis-jax launch", description="Start one role of a fleet (docs/guides/fleet.md).")
  p.add_argument("--role", required=True, choices=ROLES)
  p.add_argument(
    "--router",
    default=os.environ.get("MIS_JAX_ROUTER"),
    metavar="URL",
    help="the router's URL (worker: where it registers; trainer: rollout.transport.router)",
  )
  p.add_argument("--host", default="127.0.0.1", help="router, worker: the address to bind (0.0.0.0: every interface)")
  p.add_argument("--port", type=int, default=None, help="router (MIS_JAX_ROUTER_PORT, 30080), worker (0: a free one)")
  p.add_argument("--policy", default="cache_aware", help="router: its routing policy")
  p.add_argument("--worker-url", action="append", default=[], help="router: workers it starts with (repeatable)")
  p.add_argument(
    "--engine",
    default="embedded",
    choices=ENGINES,
    help="worker: `mis-jax serve` (embedded, loopback only), SGLang or sglang-jax (their HTTP servers)",
  )
  p.add_argument("--python", default=sys.executable, help="worker (sglang, sglang-jax): the interpreter that has it")
  p.add_argument(
    "--advertise",
    default=None,
    metavar="HOST",
    help="worker: the address the router and the trainer reach it at (default: --host, or this "
    "machine's hostname when --host is 0.0.0.0)",
  )
  p.add_argument("--model-path", default=None, help="worker: the HF checkpoint it serves")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="worker: its precision")
  p.add_argument("--seed", type=int, default=0, help="worker (embedded): seeds requests that bring none")
  p.add_argument(
    "--start-timeout",
    type=float,
    default=900.0,
    help="worker: seconds until its server is healthy; trainer: until --wait-workers are registered",
  )
  p.add_argument(
    "--wait-workers",
    type=int,
    default=0,
    metavar="N",
    help="trainer: start once the router lists N workers (they load their model first)",
  )
  p.add_argument(
    "rest",
    nargs=argparse.REMAINDER,
    help="trainer: `-- <mis-jax train arguments>`; worker (sglang, sglang-jax): `-- <server arguments>`",
  )
  return p


def _jax_cluster(name: str):
  """jax's own cluster detection (`jax.distributed.initialize()` with no arguments runs the same
  classes; jax has no public API for them): `slurm` or `gketpu`."""
  from jax._src import clusters

  return next(c for c in clusters.ClusterEnv._cluster_types if c.name == name)


def trainer_env() -> dict[str, str]:
  """The `JAX_*` process-group variables of this trainer process from its scheduler's environment
  (`os.environ`; {} when `JAX_PROCESS_ID` is already set, or for one process):

  - SLURM (an `srun` step: `SLURM_JOB_ID`, `SLURM_STEP_NODELIST`, `SLURM_NTASKS`, `SLURM_PROCID`,
    `SLURM_LOCALID`): jax's SLURM detection — process `SLURM_PROCID` of `SLURM_NTASKS`, the
    coordinator on the step's first node at `JAX_COORDINATOR_PORT` (else a port derived from the
    job id);
  - a Kubernetes JobSet on a TPU slice (GKE's `TPU_WORKER_HOSTNAMES`, `TPU_WORKER_ID`): jax's GKE TPU
    detection — one process per TPU host, the coordinator on the first;
  - another JobSet (`JOB_COMPLETION_INDEX`, with `MIS_JAX_NUM_PROCESSES`): process
    `JOB_COMPLETION_INDEX`; the coordinator must be given.

  `MIS_JAX_COORDINATOR` (or `JAX_COORDINATOR_ADDRESS`), when set, is the coordinator in every case.
  Raises `ValueError` when several processes have no coordinator."""
  env = os.environ
  if "JAX_PROCESS_ID" in env:
    return {}
  given = env.get("JAX_COORDINATOR_ADDRESS") or env.get("MIS_JAX_COORDINATOR")
  slurm, tpu = _jax_cluster("slurm"), _jax_cluster("gketpu")
  port = env.get("JAX_COORDINATOR_PORT")
  if slurm.is_env_present() and slurm.get_process_count() > 1:
    pid, num = slurm.get_process_id(), slurm.get_process_count()
    coordinator = given or slurm.get_coordinator_address(timeout_secs=None, override_coordinator_port=port)
  elif tpu.is_env_present() and tpu.get_process_count() > 1:
    pid, num = tpu.get_process_id(), tpu.get_process_count()
    coordinator = given or tpu.get_coordinator_address(timeout_secs=300, override_coordinator_port=port)
  elif "JOB_COMPLETION_INDEX" in env and int(env.get("MIS_JAX_NUM_PROCESSES", "1")) > 1:
    pid, num = int(env["JOB_COMPLETION_INDEX"]), int(env["MIS_JAX_NUM_PROCESSES"])
    coordinator = given
  else:
    return {}
  if not coordinator:
    raise ValueError(
      "several trainer processes need the coordinator's HOST:PORT: set MIS_JAX_COORDINATOR (or JAX_COORDINATOR_ADDRESS)"
    )
  return {"JAX_PROCESS_ID": str(pid), "JAX_NUM_PROCESSES": str(num), "JAX_COORDINATOR_ADDRESS": coordinator}


def _router(args) -> int:
  from trainers.serving import router as router_lib

  port = args.port or int(os.environ.get("MIS_JAX_ROUTER_PORT", "30080"))
  cmd = router_lib.router_command(host=args.host, port=port, worker_urls=args.worker_url, policy=args.policy)
  print(f"router on http://{args.host}:{port} ({args.policy})", flush=True)
  os.execv(cmd[0], cmd)  # the scheduler's signals reach the router itself


def worker_command(args) -> list[str]:
  """The command line of an `sglang` or `sglang-jax` worker: its HTTP server on `--host:--port`."""
  rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
  return [
    args.python,
    *SERVER_ENTRY[args.engine],
    "--model-path",
    args.model_path,
    "--host",
    args.host,
    "--port",
    str(args.port or 30000),
    "--dtype",
    args.dtype,
    *rest,
  ]


def advertised_url(args, url: str) -> str:
  """The URL the router and the trainer reach a worker at: `url` with its host replaced by
  `--advertise` (or this machine's hostname when it binds every interface)."""
  host = args.advertise or (socket.gethostname() if args.host in ("0.0.0.0", "::") else None)
  if host is None:
    return url
  return f"http://{host}:{url.rsplit(':', 1)[1]}"


@contextlib.contextmanager
def _server(args):
  """(url, process) of the worker's server while it runs; stopped on exit."""
  from trainers.serving import router as router_lib
  from trainers.serving.embedded.server import EmbeddedServer

  if args.engine == "embedded":
    with EmbeddedServer(
      args.model_path, dtype=args.dtype, seed=args.seed, port=args.port or 0, timeout=args.start_timeout
    ) as server:
      yield server.url, server.process
    return
  process = subprocess.Popen(worker_command(args), preexec_fn=router_lib.die_with_parent)
  try:
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port or 30000}"
    router_lib.wait_healthy(url, args.start_timeout, process=process)
    yield url, process
  finally:
    if process.poll() is None:
      process.terminate()
      try:
        process.wait(timeout=30)
      except subprocess.TimeoutExpired:
        process.kill()


def _worker(args) -> int:
  from trainers.serving import router as router_lib

  if not args.model_path or not args.router:
    print("mis-jax launch --role worker needs --model-path and --router (or MIS_JAX_ROUTER)", file=sys.stderr)
    return 2
  if args.engine == "embedded" and args.host not in ("127.0.0.1", "localhost"):
    print(
      f"mis-jax launch --role worker: --engine embedded (mis-jax serve) binds loopback only, not --host "
      f"{args.host}; off one machine use --engine sglang or sglang-jax",
      file=sys.stderr,
    )
    return 2
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  with _server(args) as (local_url, process):
    url = advertised_url(args, local_url)
    router_lib.pause_worker(local_url)  # holds the router's requests until the trainer's push
    router_lib.wait_healthy(args.router, 300)
    router_lib.register(args.router, url)
    print(f"worker {url} registered with {args.router} (paused until the trainer pushes its weights)", flush=True)
    while not stop.wait(1.0):
      if process.poll() is not None:
        return 1
    try:
      router_lib.deregister(args.router, url)
    except Exception:  # the router may be gone first
      pass
  return 0


def _trainer(args) -> int:
  rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
  try:
    os.environ.update(trainer_env())
  except ValueError as e:
    print(f"mis-jax launch: {e}", file=sys.stderr)
    return 2
  if args.wait_workers:
    if not args.router:
      print("mis-jax launch: --wait-workers needs --router (or MIS_JAX_ROUTER)", file=sys.stderr)
      return 2
    try:
      wait_for_workers(args.router, args.wait_workers, args.start_timeout)
    except TimeoutError as e:
      print(f"mis-jax launch: {e}", file=sys.stderr)
      return 1
  if args.router and "--router" not in rest:
    rest = ["--router", args.router, *rest]
  # `mis-jax train` in this process's place: the scheduler's signals reach the trainer itself.
  os.execv(sys.executable, [sys.executable, "-m", "trainers.cli", "train", *rest])


def wait_for_workers(router_url: str, count: int, timeout: float) -> None:
  """Returns once the router lists `count` workers (`TimeoutError` after `timeout` s)."""
  import time

  import httpx

  from trainers.serving import router as router_lib

  deadline = time.monotonic() + timeout
  router_lib.wait_healthy(router_url, timeout)
  listed = []
  while time.monotonic() < deadline:
    try:
      listed = router_lib.workers(router_url)
    except httpx.HTTPError:
      listed = []
    if len(listed) >= count:
      return
    time.sleep(1.0)
  raise TimeoutError(
    f"router {router_url} lists {len(listed)} worker(s) after {timeout:.0f} s, not the {count} of --wait-workers"
  )


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  return {"router": _router, "worker": _worker, "trainer": _trainer}[args.role](args)


if __name__ == "__main__":
  sys.exit(main())
