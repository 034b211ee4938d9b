"""Colocated rollouts (`rollout.placement: colocated`): the embedded engine inside the trainer's
process, on the trainer's devices, its weights handed over in memory after each step.

`ColocatedEngine` is the servers' side of the loop (`trainers.training.servers.Servers`) with
two parts swapped: its client answers SGLang's native requests from an in-process
`GenerationEngine` (`EngineClient`: the same request bodies, replies and checks as over HTTP, so
log-probs, sampling masks, routed experts and `weight_version` spans are the server's), and its
weight push hands the trainer's parameters to the engine — cast to `rollout.weight_dtype` as the
disk path would write them, then to the served dtype (quantised as `rollout.server_quantize`
says), moved to the engine's devices — instead of writing safetensors for a server to read.

Memory: the engine holds one copy of the weights in the served dtype, on the first device of the
mesh (`rollout.colocated_devices: first`) or laid out over the whole mesh as the trainer's are
(`mesh`), and its KV cache lives only inside a generation call. In the synchronous loop that copy is
freed once the step's rollouts are generated (the training step has the devices to itself) and
the push after the step brings the new weights.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from trainers.models import DTYPES
from trainers.models.hf_io import hf_named
from trainers.serving.generation import GenerationEngine
from trainers.training import parallel
from trainers.training.rollout import RolloutResult, ServerError, SGLangClient
from trainers.training.servers import Servers


class EngineClient(SGLangClient):
  """An `SGLangClient` whose requests an engine in this process answers (no HTTP, no JSON):
  `engine.generate_body(body)` decodes and normalises a `/generate` body as its server does, so a
  sample is what the server would have returned. `engine`: a `GenerationEngine`, or sglang-jax's
  (`sglang_jax_routes.InProcessEngine`)."""

  URL = "colocated://engine"

  def __init__(self, engine, *, max_concurrency: int = 4, prompts_per_request: int = 8, cache_salt: bool = True):
    self.engine, self.urls = engine, [self.URL]
    self._init_requests(max_retries=0, backoff_s=0.0, max_concurrency=max_concurrency,
                        prompts_per_request=prompts_per_request, cache_salt=cache_salt)

  def _request(self, method: str, url: str, path: str, body=None):
    engine = self.engine
    try:
      if path == "/generate":
        return engine.generate_body(body)
      if path in ("/model_info", "/get_model_info"):
        return engine.model_info()
      if path in ("/server_info", "/get_server_info"):
        return engine.server_info("colocated", 0)
      if path == "/pause_generation":
        return engine.pause((body or {}).get("mode", "abort"))
      if path == "/continue_generation":
        return engine.resume()
      if path in ("/health", "/flush_cache"):
        return None
    except ValueError as e:  # the engine's request errors (SGLang's 400s)
      raise ServerError(f"the colocated engine rejected {path}: {e}", status=getattr(e, "status_code", 400)) from None
    except TimeoutError as e:
      raise ServerError(f"the colocated engine timed out on {path}: {e}") from None
    raise ServerError(f"the colocated engine has no route {method} {path}", status=404)

  def is_healthy(self, url: str, timeout_s: float = 5.0) -> bool:
    return True

  def wait_until_healthy(self, **_) -> None:
    return None  # the engine is built before the client

  def has_weight_update_route(self, url: str) -> bool:
    return True  # its weights are handed over in memory

  def close(self):
    self._pool.shutdown(wait=True)


class ColocatedEngine(Servers):
  """The servers' side of the loop, with the embedded engine in this process (see the module doc)."""

  RELEASES_WEIGHTS = True  # its engine can free its weights between a step's rollouts and the push

  def __init__(self, cfg, *, start_dir: str, model_config, sampling, mesh=None, log=print):
    self.engine = self._start_engine(cfg, start_dir, model_config)
    r = cfg.rollout
    if r.colocated_devices == "mesh":
      self._spread(mesh, model_config)
    client = EngineClient(self.engine, max_concurrency=r.max_concurrency, prompts_per_request=r.prompts_per_request,
                          cache_salt=r.cache_salt)
    super().__init__(cfg, urls=[EngineClient.URL], start_dir=start_dir, model_config=model_config, sampling=sampling,
                     log=log, client=client)
    # Free the engine's weights while the trainer trains: only where every step pushes new ones
    # and nothing generates during the step.
    self.release_between_steps = self.RELEASES_WEIGHTS and r.sync_every == 1 and r.max_staleness == 0

  @staticmethod
  def _start_engine(cfg, start_dir: str, model_config):
    r = cfg.rollout
    return GenerationEngine(start_dir, dtype=r.server_dtype, seed=cfg.seed, quantize=r.server_quantize,
                            weight_version="0", enable_return_routed_experts=True)

  def _handover(self, params, version: str) -> tuple[bool, str]:
    return self.engine.update_weights(params, version)

  def _spread(self, mesh, model_config) -> None:
    """`rollout.colocated_devices: mesh`: the engine's weights in the trainer's layout on its mesh
    (every later handover lands there too), each batch's rows split over the data axes."""
    sampler = self.engine.sampler
    rows = NamedSharding(mesh, P(parallel.BATCH_AXES))
    sampler.shard(parallel.param_shardings(sampler.params, mesh, model_config.family), rows)

  def generate(self, prompt_ids: list, batch: int) -> RolloutResult:
    result = super().generate(prompt_ids, batch)
    if self.release_between_steps:
      self.engine.release_weights()
    return result

  def push(self, params, step: int) -> dict:
    """The trainer's weights of `step` into the engine, in memory: cast on the trainer's devices to
    `weight_dtype` (what the disk path writes), then taken by the engine (served dtype,
    quantisation, its devices) while it is paused with `rollout.pause_mode`."""
    t0 = time.perf_counter()
    dtype = DTYPES[self.weight_dtype]
    state = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    t1 = time.perf_counter()
    self.client.begin_weights(str(step))
    self.engine.pause(self.rollout.pause_mode)
    t2 = time.perf_counter()
    try:
      ok, message = self._handover(state, str(step))
    finally:
      self.engine.resume()
    if not ok:
      raise ServerError(f"weight handover at step {step} failed: {message}")
    t3 = time.perf_counter()
    self.served_version, self.served_path = step, None
    return {"sync/handover_s": t3 - t2, "sync/servers_paused_s": t3 - t1, "sync/total_s": t3 - t0}

  def close(self) -> None:
    super().close()
    self.engine.close()


class SGLangJaxColocated(ColocatedEngine):
  """`rollout.engine: sglang-jax` colocated: sglang-jax's `Engine` in this process (its
  single-process mode; this process must run in its venv, Python >= 3.12), its log-probs and
  routed experts as its server returns them, the trainer's weights swapped into its model runner
  in memory as HF-named arrays placed by its own weight map (`InProcessEngine.update_weights`).
  Its weights and preallocated KV pool stay resident between steps."""

  RELEASES_WEIGHTS = False

  def __init__(self, cfg, **kwargs):
    super().__init__(cfg, **kwargs)
    # The trainer's state as HF-named arrays (each stacked layer sliced, kernels transposed), in
    # one compiled program rather than op by op.
    self._hf_named = jax.jit(lambda params: hf_named(params, self.model_config))

  @staticmethod
  def _start_engine(cfg, start_dir: str, model_config):
    from trainers.serving import sglang_jax
    from trainers.serving.sglang_jax_routes import InProcessEngine  # in sglang-jax's venv only (checks.py)
    args = sglang_jax.engine_args(start_dir, dtype=cfg.rollout.server_dtype,
                                  enable_return_routed_experts=model_config.is_moe,
                                  extra=("--random-seed", str(cfg.seed), "--device-indexes", "0"))
    return InProcessEngine(args, weight_version="0", timeout_s=cfg.rollout.timeout_s)

  def _handover(self, params, version: str) -> tuple[bool, str]:
    return self.engine.update_weights(self._hf_named(params), version)
