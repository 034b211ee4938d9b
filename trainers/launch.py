"""`mis-jax launch --role trainer|worker|router`: one entry point that starts a role of a fleet
from the environment a scheduler gives it (docs/guides/fleet.md).

- `router`: sglang-router on `--port` (`MIS_JAX_ROUTER_PORT`), `--policy` (cache_aware), over
  `--worker-url`s if any (workers may register later);
- `worker`: `mis-jax serve` of `--model-path` on `--port`, paused, then registered with `--router`
  (`MIS_JAX_ROUTER`): it holds the router's requests until the trainer's push gives it the
  current weights; deregistered when it is stopped (SIGTERM / SIGINT);
- `trainer`: `mis-jax train` with the arguments after `--`, its process group from the flags, else
  `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`, else SLURM's
  (`SLURM_PROCID`, `SLURM_NTASKS`, with `MIS_JAX_COORDINATOR` as the coordinator) or a Kubernetes
  JobSet's (`JOB_COMPLETION_INDEX`, with `MIS_JAX_NUM_PROCESSES` and `MIS_JAX_COORDINATOR`), and
  `--router` (`MIS_JAX_ROUTER`) passed on.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

ROLES = ("trainer", "worker", "router")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="mis-jax launch", description="Start one role of a fleet (docs/guides/fleet.md).")
  p.add_argument("--role", required=True, choices=ROLES)
  p.add_argument("--router", default=os.environ.get("MIS_JAX_ROUTER"), metavar="URL",
                 help="the router's URL (worker: where it registers; trainer: rollout.transport.router)")
  p.add_argument("--host", default="127.0.0.1", help="router, worker: the address to bind")
  p.add_argument("--port", type=int, default=None, help="router (MIS_JAX_ROUTER_PORT, 30080), worker (0: a free one)")
  p.add_argument("--policy", default="cache_aware", help="router: its routing policy")
  p.add_argument("--worker-url", action="append", default=[], help="router: workers it starts with (repeatable)")
  p.add_argument("--model-path", default=None, help="worker: the HF checkpoint it serves")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="worker: its precision")
  p.add_argument("--seed", type=int, default=0, help="worker: seeds requests that bring none")
  p.add_argument("rest", nargs=argparse.REMAINDER, help="trainer: `-- <mis-jax train arguments>`")
  return p


def trainer_env(environ=os.environ) -> dict[str, str]:
  """The `JAX_*` process-group variables a trainer process gets from its scheduler's environment
  (those already set win): SLURM's, else a JobSet's; {} for one process."""
  out = {}
  if "JAX_PROCESS_ID" in environ:
    return out
  if "SLURM_PROCID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1:
    out = {"JAX_PROCESS_ID": environ["SLURM_PROCID"], "JAX_NUM_PROCESSES": environ["SLURM_NTASKS"]}
  elif "JOB_COMPLETION_INDEX" in environ and int(environ.get("MIS_JAX_NUM_PROCESSES", "1")) > 1:
    out = {"JAX_PROCESS_ID": environ["JOB_COMPLETION_INDEX"], "JAX_NUM_PROCESSES": environ["MIS_JAX_NUM_PROCESSES"]}
  if out:
    if "JAX_COORDINATOR_ADDRESS" not in environ and "MIS_JAX_COORDINATOR" not in environ:
      raise ValueError("several trainer processes need the coordinator's HOST:PORT: set MIS_JAX_COORDINATOR "
                       "(or JAX_COORDINATOR_ADDRESS)")
    out["JAX_COORDINATOR_ADDRESS"] = environ.get("JAX_COORDINATOR_ADDRESS") or environ["MIS_JAX_COORDINATOR"]
  return out


def _router(args) -> int:
  from trainers.serving import router as router_lib
  port = args.port or int(os.environ.get("MIS_JAX_ROUTER_PORT", "30080"))
  cmd = router_lib.router_command(host=args.host, port=port, worker_urls=args.worker_url, policy=args.policy)
  print(f"router on http://{args.host}:{port} ({args.policy})", flush=True)
  os.execv(cmd[0], cmd)  # the scheduler's signals reach the router itself


def _worker(args) -> int:
  from trainers.serving import router as router_lib
  from trainers.serving.embedded.server import EmbeddedServer
  if not args.model_path or not args.router:
    print("mis-jax launch --role worker needs --model-path and --router (or MIS_JAX_ROUTER)", file=sys.stderr)
    return 2
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  with EmbeddedServer(args.model_path, dtype=args.dtype, seed=args.seed, port=args.port or 0) as server:
    router_lib.pause_worker(server.url)  # holds the router's requests until the trainer's push
    router_lib.wait_healthy(args.router, 300)
    router_lib.register(args.router, server.url)
    print(f"worker {server.url} registered with {args.router} (paused until the trainer pushes its weights)",
          flush=True)
    while not stop.wait(1.0):
      if server.process.poll() is not None:
        return 1
    try:
      router_lib.deregister(args.router, server.url)
    except Exception:  # the router may be gone first
      pass
  return 0


def _trainer(args) -> int:
  from trainers import cli
  rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
  try:
    os.environ.update(trainer_env())
  except ValueError as e:
    print(f"mis-jax launch: {e}", file=sys.stderr)
    return 2
  if args.router and "--router" not in rest:
    rest = ["--router", args.router, *rest]
  return cli._train(rest)


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  return {"router": _router, "worker": _worker, "trainer": _trainer}[args.role](args)


if __name__ == "__main__":
  sys.exit(main())
