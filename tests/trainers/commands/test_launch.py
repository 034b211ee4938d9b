"""`mis-jax launch` and the recipes that call it (deploy/): the SLURM recipe run by bash with a
recording `srun` (the steps it starts, on which nodes, with which roles, ports and process
counts), the JobSet recipe parsed as YAML, the local demo's roles, the process group a trainer
process gets from SLURM's environment (jax's SLURM detection), and the SLURM recipe's trainer
command run on this machine as SLURM runs it: 2 processes == 1 process after 3 steps."""

import json
import os
import pathlib
import re
import stat
import subprocess
import sys

import numpy as np
import pytest
import yaml

from helpers import cpu_process_env, free_port
from test_train import BASE
from trainers.commands import launch

ROOT = pathlib.Path(__file__).resolve().parents[3]
SBATCH = ROOT / "deploy" / "slurm" / "fleet.sbatch"
JOBSET = ROOT / "deploy" / "k8s" / "fleet-jobset.yaml"
JOBSET_HTTP = ROOT / "deploy" / "k8s" / "fleet-jobset-http.yaml"
DEMO = ROOT / "deploy" / "local" / "fleet_demo.sh"

# A stand-in for `srun` (no SLURM here): it records its arguments and the variables a step reads.
# The recipe starts the workers' steps in the background and SIGTERMs them at its exit: a shell
# that ignores SIGTERM first (the disposition survives `exec`) lets a recorder that starts late on
# a loaded machine still write its line.
_SRUN_SHELL = """#!/usr/bin/env bash
trap '' TERM
exec {python} {recorder} "$@"
"""
_SRUN = """
import json, os, sys
keys = ("JAX_COORDINATOR_PORT", "JAX_LOCAL_DEVICE_IDS", "MIS_JAX_ROUTER")
with open(os.environ["SRUN_LOG"], "a") as f:
  f.write(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}) + "\\n")
"""
_SCONTROL = "#!/usr/bin/env bash\n[ \"$1 $2\" = 'show hostnames' ] && printf '%s\\n' $FAKE_NODES\n"


def run_sbatch(tmp_path, nodes, **env) -> tuple[subprocess.CompletedProcess, list[dict]]:
  """fleet.sbatch run by bash as the batch step of a job on `nodes`, with `srun` and `scontrol`
  replaced by recorders; returns bash's result and the `srun` calls (argv, env) in order."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(parents=True, exist_ok=True)
  recorder = tmp_path / "srun_recorder.py"
  recorder.write_text(_SRUN)
  for name, text in (("srun", _SRUN_SHELL.format(python=sys.executable, recorder=recorder)), ("scontrol", _SCONTROL)):
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(stat.S_IRWXU)
  log = tmp_path / "srun.jsonl"
  full = {
    "PATH": f"{bin_dir}:{os.environ['PATH']}",
    "SRUN_LOG": str(log),
    "FAKE_NODES": " ".join(nodes),
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": ",".join(nodes),
    "SLURM_JOB_NUM_NODES": str(len(nodes)),
    "MODEL": "/shared/model",
    "RUN_DIR": str(tmp_path / "run"),
    **env,
  }
  result = subprocess.run(["bash", str(SBATCH)], env=full, capture_output=True, text=True, timeout=60)
  calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
  return result, calls


def split_srun(argv: list[str]) -> tuple[dict, list[str]]:
  """`srun`'s own options ({name: value}) and the command it runs."""
  options, i = {}, 0
  while argv[i].startswith("--"):
    name, _, value = argv[i][2:].partition("=")
    options[name] = value
    i += 1
  return options, argv[i:]


def role_of(command: list[str]) -> str:
  return command[command.index("--role") + 1]


def flag(command: list[str], name: str) -> str:
  return command[command.index(name) + 1]


def sbatch_directives() -> dict[str, str]:
  return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SBATCH.read_text(), re.M))


def test_slurm_recipe_starts_each_role_on_its_nodes(tmp_path):
  nodes = ["node1", "node2", "node3", "node4"]
  result, calls = run_sbatch(tmp_path, nodes, MIS_JAX="mis-jax")
  assert result.returncode == 0, result.stderr
  steps = {}
  for call in calls:
    options, command = split_srun(call["argv"])
    assert command[:2] == ["mis-jax", "launch"], command  # the local demo's entry point
    steps.setdefault(role_of(command), []).append((options, command, call["env"]))
  assert sorted(steps) == ["router", "trainer", "worker"] and len(steps["router"]) == len(steps["trainer"]) == 1

  directives = sbatch_directives()
  assert int(directives["nodes"]) == len(nodes) and directives["ntasks-per-node"] == "1"
  ((router_opts, router, _),) = steps["router"]
  ((trainer_opts, trainer, trainer_env),) = steps["trainer"]
  # Trainer: one process per node on the first TRAINER_NODES (2) nodes; jax.distributed's process
  # count is the step's task count, its coordinator the step's first node at COORDINATOR_PORT.
  assert trainer_opts["nodelist"] == "node1,node2"
  assert trainer_opts["nodes"] == trainer_opts["ntasks"] == "2" and trainer_opts["ntasks-per-node"] == "1"
  assert trainer_env["JAX_COORDINATOR_PORT"] == "30090" and trainer_env["JAX_LOCAL_DEVICE_IDS"] == "0,1,2,3,4,5,6,7"
  assert f"coordinator node1:{trainer_env['JAX_COORDINATOR_PORT']}" in result.stdout
  # The router beside trainer process 0, with no GPU; its port is the one every other role is given.
  assert router_opts["nodelist"] == "node1" and router_opts["gres"] == "none" and router_opts["ntasks"] == "1"
  router_url = f"http://node1:{flag(router, '--port')}"
  assert flag(router, "--host") == "0.0.0.0" and flag(trainer, "--router") == router_url
  # One worker per remaining node, on every interface, at one port, registered with that router.
  workers = steps["worker"]
  assert sorted(o["nodelist"] for o, _, _ in workers) == ["node3", "node4"]  # started in the background
  for options, command, _ in workers:
    assert options["nodes"] == options["ntasks"] == "1"
    assert flag(command, "--router") == router_url and flag(command, "--host") == "0.0.0.0"
    assert flag(command, "--port") == "30000" and flag(command, "--model-path") == "/shared/model"
    assert flag(command, "--engine") == "sglang" and command[command.index("--") + 1 :] == ["--tp-size", "8"]
  # The trainer waits for all of them and trains the model they serve.
  assert flag(trainer, "--wait-workers") == str(len(workers))
  assert "model.path=/shared/model" in trainer and flag(trainer, "--run-dir") == str(tmp_path / "run")
  # Every flag the recipe passes is one `mis-jax launch` knows.
  for _, command, _ in [*steps["router"], *steps["worker"], *steps["trainer"]]:
    ours = command[2 : command.index("--")] if "--" in command else command[2:]
    launch.parser().parse_args(ours)


def test_slurm_recipe_refuses_a_job_with_no_worker_node(tmp_path):
  result, calls = run_sbatch(tmp_path, ["node1", "node2"], MIS_JAX="mis-jax")
  assert result.returncode == 2 and "leave no worker after TRAINER_NODES=2" in result.stderr and calls == []


def test_local_demo_uses_the_same_roles():
  roles = re.findall(r"trainers\.cli launch --role (\w+)", DEMO.read_text())
  assert sorted(set(roles)) == ["router", "trainer", "worker"]
  assert set(re.findall(r"\$MIS_JAX launch --role (\w+)", SBATCH.read_text())) == set(roles)


def _jobs(doc) -> dict:
  return {job["name"]: job for job in doc["spec"]["replicatedJobs"]}


def _container(job) -> dict:
  (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
  return container


def test_jobset_recipe():
  service, jobset = yaml.safe_load_all(JOBSET.read_text())
  assert service["kind"] == "Service" and jobset["kind"] == "JobSet"
  assert jobset["apiVersion"].startswith("jobset.x-k8s.io/")
  jobs = _jobs(jobset)
  assert sorted(jobs) == ["router", "trainer", "workers"]
  commands = {name: _container(job)["command"] for name, job in jobs.items()}
  for name, role in (("router", "router"), ("workers", "worker"), ("trainer", "trainer")):
    assert commands[name][:2] == ["mis-jax", "launch"] and role_of(commands[name]) == role
  # The router's Service selects the router's pods and serves its port; the others use it.
  router_port = int(flag(commands["router"], "--port"))
  assert service["spec"]["selector"] == {
    "jobset.sigs.k8s.io/jobset-name": jobset["metadata"]["name"],
    "jobset.sigs.k8s.io/replicatedjob-name": "router",
  }
  (port,) = service["spec"]["ports"]
  assert port["port"] == port["targetPort"] == router_port
  assert _container(jobs["router"])["ports"] == [{"containerPort": router_port}]
  router_url = f"http://{service['metadata']['name']}:{router_port}"
  assert flag(commands["workers"], "--router") == flag(commands["trainer"], "--router") == router_url
  # Workers: sglang-jax on a 2x2 v5e host (4 chips: --tp-size 4), advertised by pod IP, one per replica.
  worker = _container(jobs["workers"])
  assert (
    flag(commands["workers"], "--engine") == "sglang-jax" and flag(commands["workers"], "--advertise") == "$(POD_IP)"
  )
  assert worker["ports"] == [{"containerPort": int(flag(commands["workers"], "--port"))}]
  assert flag(commands["workers"], "--tp-size") == str(worker["resources"]["limits"]["google.com/tpu"]) == "4"
  assert flag(commands["trainer"], "--wait-workers") == str(jobs["workers"]["replicas"])
  # Trainer: one process per TPU host of its slice (jax's TPU detection gives num_processes = hosts).
  spec = jobs["trainer"]["template"]["spec"]
  pod = spec["template"]["spec"]
  chips = np.prod([int(d) for d in pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"].split("x")])
  hosts = chips // _container(jobs["trainer"])["resources"]["limits"]["google.com/tpu"]
  assert jobs["trainer"]["replicas"] == 1 and spec["parallelism"] == spec["completions"] == hosts == 4
  assert spec["completionMode"] == "Indexed"
  assert _container(jobs["trainer"])["ports"] == [{"containerPort": 8476}]  # jax's TPU coordinator port
  assert "MIS_JAX_COORDINATOR" not in json.dumps(jobset)  # the coordinator is jax's to find
  # The run directory and the model on the volume every trainer and worker mounts.
  for name in ("trainer", "workers"):
    pod = jobs[name]["template"]["spec"]["template"]["spec"]
    assert _container(jobs[name])["volumeMounts"] == [{"name": "shared", "mountPath": "/shared"}]
    assert pod["volumes"] == [{"name": "shared", "persistentVolumeClaim": {"claimName": "mis-jax-shared"}}]
  assert flag(commands["workers"], "--model-path") == "/shared/model"
  assert "model.path=/shared/model" in commands["trainer"] and flag(commands["trainer"], "--run-dir").startswith(
    "/shared/"
  )
  for command in commands.values():
    launch.parser().parse_args(command[2 : command.index("--")] if "--" in command else command[2:])


def test_jobset_recipe_over_http_needs_no_shared_volume():
  """The same fleet with the weights streamed over HTTP: no PersistentVolumeClaim at all, the
  workers mount nothing, the trainer and the workers start from the same model path (in the
  image), the trainer's overrides are valid settings, and only its run directory (checkpoints) is
  on storage its hosts share."""
  service, jobset = yaml.safe_load_all(JOBSET_HTTP.read_text())
  _, plain = yaml.safe_load_all(JOBSET.read_text())
  assert "persistentVolumeClaim" not in json.dumps(jobset) and "ReadWriteMany" not in json.dumps(jobset)
  jobs, same = _jobs(jobset), _jobs(plain)
  assert sorted(jobs) == sorted(same)
  for name in jobs:  # the roles, pods and counts are those of the shared-volume recipe
    assert jobs[name]["replicas"] == same[name]["replicas"]
    assert _container(jobs[name]).get("resources") == _container(same[name]).get("resources")
  assert "volumes" not in jobs["workers"]["template"]["spec"]["template"]["spec"]
  assert "volumeMounts" not in _container(jobs["workers"])
  commands = {name: _container(job)["command"] for name, job in jobs.items()}
  trainer = commands["trainer"]
  sets = [trainer[i + 1] for i, a in enumerate(trainer) if a == "--set"]
  assert {"rollout.sync.via=http", "rollout.sync.delta=true"} <= set(sets)
  assert f"model.path={flag(commands['workers'], '--model-path')}" in sets
  from mis_jax.config import load_yaml
  from trainers import config as config_lib
  from trainers.commands.train import train_parser

  args = train_parser().parse_args(trainer[trainer.index("--") + 1 :])
  raw = load_yaml(str(ROOT / args.config), "trainer config")
  for assignment in args.set:
    config_lib.set_override(raw, assignment)
  cfg = config_lib.TrainConfig.from_dict(raw)
  assert cfg.rollout.sync.via == "http" and cfg.rollout.sync.delta and cfg.model.path == "/models/model"
  pod = jobs["trainer"]["template"]["spec"]["template"]["spec"]
  (volume,) = pod["volumes"]
  assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
  assert _container(jobs["trainer"])["volumeMounts"] == [{"name": volume["name"], "mountPath": "/runs"}]
  assert flag(trainer, "--run-dir").startswith("/runs/")
  router_url = f"http://{service['metadata']['name']}:{int(flag(commands['router'], '--port'))}"
  assert flag(commands["workers"], "--router") == flag(trainer, "--router") == router_url
  for command in commands.values():
    launch.parser().parse_args(command[2 : command.index("--")] if "--" in command else command[2:])


SLURM_STEP = {
  "SLURM_JOB_ID": "4242",
  "SLURM_STEP_NODELIST": "gpu[017-018]",
  "SLURM_NTASKS": "2",
  "SLURM_PROCID": "1",
  "SLURM_LOCALID": "0",
}


def _scheduler_env(monkeypatch, **env):
  for key in [
    *SLURM_STEP,
    "JAX_PROCESS_ID",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_COORDINATOR_PORT",
    "MIS_JAX_COORDINATOR",
    "MIS_JAX_NUM_PROCESSES",
    "JOB_COMPLETION_INDEX",
    "TPU_WORKER_HOSTNAMES",
  ]:
    monkeypatch.delenv(key, raising=False)
  for key, value in env.items():
    monkeypatch.setenv(key, value)


def test_slurm_environment_gives_the_process_group(monkeypatch):
  from trainers.runtime import distributed

  _scheduler_env(monkeypatch, **SLURM_STEP, JAX_COORDINATOR_PORT="30090")
  group = launch.trainer_env()
  assert group == {"JAX_PROCESS_ID": "1", "JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "gpu017:30090"}
  monkeypatch.setattr(os, "environ", {**os.environ, **group})  # what `mis-jax train` then reads
  assert distributed.settings_from(object()) == {
    "coordinator_address": "gpu017:30090",
    "num_processes": 2,
    "process_id": 1,
  }
  _scheduler_env(monkeypatch, **SLURM_STEP)  # no port given: jax's, from the job id
  assert launch.trainer_env()["JAX_COORDINATOR_ADDRESS"] == f"gpu017:{4242 % 4096 + 65536 - 4096}"
  _scheduler_env(monkeypatch, **SLURM_STEP, MIS_JAX_COORDINATOR="login1:1234")  # given: it wins
  assert launch.trainer_env()["JAX_COORDINATOR_ADDRESS"] == "login1:1234"
  _scheduler_env(monkeypatch, **dict(SLURM_STEP, SLURM_NTASKS="1", SLURM_PROCID="0"))  # one process
  assert launch.trainer_env() == {}
  _scheduler_env(monkeypatch, **SLURM_STEP, JAX_PROCESS_ID="0")  # set by hand: left alone
  assert launch.trainer_env() == {}
  _scheduler_env(monkeypatch, JOB_COMPLETION_INDEX="3", MIS_JAX_NUM_PROCESSES="4")
  with pytest.raises(ValueError, match="set MIS_JAX_COORDINATOR"):
    launch.trainer_env()


def test_worker_command_and_address():
  args = launch.parser().parse_args(
    [
      "--role",
      "worker",
      "--engine",
      "sglang-jax",
      "--model-path",
      "/m",
      "--host",
      "0.0.0.0",
      "--port",
      "31000",
      "--python",
      "/venv/bin/python",
      "--",
      "--device",
      "tpu",
    ]
  )
  from trainers.serving.sglang_jax import launcher as sglang_jax  # its routes: the weight-update route sglang-jax lacks

  assert launch.worker_command(args) == [
    "/venv/bin/python",
    "-P",
    sglang_jax.ROUTES,
    "--model-path",
    "/m",
    "--host",
    "0.0.0.0",
    "--port",
    "31000",
    "--dtype",
    "bfloat16",
    "--device",
    "tpu",
  ]
  import socket

  assert launch.advertised_url(args, "http://127.0.0.1:31000") == f"http://{socket.gethostname()}:31000"
  args.advertise = "10.0.0.7"
  assert launch.advertised_url(args, "http://127.0.0.1:31000") == "http://10.0.0.7:31000"
  local = launch.parser().parse_args(["--role", "worker", "--model-path", "/m"])
  assert launch.advertised_url(local, "http://127.0.0.1:5") == "http://127.0.0.1:5"


def test_launch_errors_before_anything_starts(capsys, monkeypatch):
  monkeypatch.delenv("MIS_JAX_ROUTER", raising=False)
  assert launch.main(["--role", "trainer", "--wait-workers", "2", "--", "--config", "configs/demo.yaml"]) == 2
  assert "--wait-workers needs --router" in capsys.readouterr().err
  assert launch.main(["--role", "worker", "--model-path", "/m"]) == 2
  assert "needs --model-path and --router" in capsys.readouterr().err
  assert launch.main(["--role", "worker", "--model-path", "/m", "--router", "http://r:1", "--host", "0.0.0.0"]) == 2
  assert "binds loopback only, not --host 0.0.0.0" in capsys.readouterr().err


# ---- the recipe's trainer command, run as SLURM runs it ------------------------------------


@pytest.mark.slow
@pytest.mark.multihost
def test_slurm_trainer_two_processes_equal_one(tmp_path):
  """The SLURM recipe's trainer step (from the recording srun) run here against a router and a
  float32 `mis-jax serve` worker: 2 processes with the variables srun gives each task (the
  step's node list, here this machine twice) x 4 CPU devices, then 1 process x 8; the weights after 3 steps agree."""
  from trainers.models import init_checkpoint, read_hf_tensors
  from trainers.serving import router as router_lib
  from trainers.serving.embedded.server import EmbeddedServer

  model = tmp_path / "init"
  init_checkpoint(model, preset="tiny-qwen3", seed=1)
  raw = json.loads(json.dumps(BASE))
  raw["train"].update(steps=3, adam_eps=1e-4)  # as test_scale's 2-process test
  raw["rollout"]["placement"] = {"server_dtype": "float32"}
  raw["rollout"]["transport"].update(health_attempts=20)
  raw["parallel"] = {"data": 2, "fsdp": 4}
  config = tmp_path / "cfg.yaml"
  config.write_text(json.dumps(raw))
  with (
    EmbeddedServer(str(model), dtype="float32", seed=0) as worker,
    router_lib.RouterProcess([worker.url], policy="round_robin") as router,
  ):
    router_port = router.url.rsplit(":", 1)[1]
    runs = {}
    for name, tasks in (("two", 2), ("one", 1)):
      _, calls = run_sbatch(
        tmp_path / name,
        ["127.0.0.1"] * 3,
        MIS_JAX=f"{sys.executable} -m trainers.cli",
        MODEL=str(model),
        CONFIG=str(config),
        GPUS_PER_NODE="1",
        ROUTER_PORT=router_port,
        COORDINATOR_PORT=str(free_port()),
        RUN_DIR=str(tmp_path / name / "run"),
      )
      ((options, command, env),) = [(*split_srun(c["argv"]), c["env"]) for c in calls if "trainer" in c["argv"]]
      assert flag(command, "--router") == router.url
      procs = []
      for task in range(tasks):
        slurm = {
          "SLURM_JOB_ID": "4242",
          "SLURM_STEP_NODELIST": options["nodelist"],
          "SLURM_NTASKS": str(tasks),
          "SLURM_PROCID": str(task),
          "SLURM_LOCALID": str(task),
        }
        procs.append(
          subprocess.Popen(
            command,
            cwd=ROOT,
            env={**cpu_process_env(8 // tasks), **env, **slurm},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
          )
        )
      logs = [p.communicate(timeout=900)[0] for p in procs]
      for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
      assert f"in {tasks} process(es)" in logs[0]
      runs[name] = read_hf_tensors(tmp_path / name / "run" / "weights" / "step_3")
  assert sorted(runs["one"]) == sorted(runs["two"])
  for k, want in runs["one"].items():
    np.testing.assert_allclose(runs["two"][k], want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=k)
  assert not any(
    np.array_equal(runs["one"][k], a) for k, a in read_hf_tensors(model).items() if k in runs["one"] and a.size > 64
  )  # the 3 steps moved every large weight
