"""Colocated rollouts (`rollout.placement.mode: colocated`): the engine inside the trainer's process,
on the trainer's devices, its weights handed over in memory after each step.

`LocalEngine` is an `Engine` (`trainers.rollout.engines`) answered by an engine in this process
(no HTTP, no JSON): `generate` hands the very `/generate` body to the engine's `generate_body`,
which decodes and normalises it as its server does, so log-probs, sampling masks, routed experts
and `weight_version` spans are the server's. `update_weights` takes the trainer's parameters
(`weight_sync.MemorySync` casts them to `rollout.sync.weight_dtype`, as the disk path would write
them); the engine casts them to the served dtype (quantised as `rollout.placement.server_quantize` says)
and moves them to its devices. Two engines: `EmbeddedLocal` (ours, `GenerationEngine`) and
`SGLangJaxLocal` (sglang-jax's `Engine` in its single-process mode).

Memory: the embedded engine holds one copy of the weights in the served dtype, on the first
device of the mesh (`rollout.placement.colocated_devices: first`) or laid out over the whole mesh as the
trainer's are (`mesh`), and its KV cache lives only inside a generation call. In the synchronous
loop that copy is freed once the step's rollouts are generated (the training step has the
devices to itself) and the push after the step brings the new weights.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from trainers.models.hf_io import hf_named
from trainers.serving.embedded.generation import GenerationEngine
from trainers.runtime import parallel
from trainers.rollout.samples import ServerError


def arithmetic(cfg) -> str:
  """The embedded engine's arithmetic for `cfg`: batch-invariant in exact mode (`rollout.placement.exact`)."""
  return "batch_invariant" if cfg.rollout.placement.exact else "default"


class LocalEngine:
  """An `Engine` in this process. `inner`: a `GenerationEngine`, or sglang-jax's
  (`sglang_jax.routes.InProcessEngine`); its request errors are SGLang's 400s."""

  url = "colocated://engine"
  releases_weights = True  # it can free its weights between a step's rollouts and the push

  def __init__(self, inner):
    self.inner = inner

  def _call(self, route: str, fn, *args):
    try:
      return fn(*args)
    except ValueError as e:  # the engine's request errors (SGLang's 400s)
      raise ServerError(f"the colocated engine rejected {route}: {e}", status=getattr(e, "status_code", 400)) from None
    except TimeoutError as e:
      raise ServerError(f"the colocated engine timed out on {route}: {e}") from None

  def generate(self, body: dict):
    return self._call("/generate", self.inner.generate_body, body)

  def pause(self, mode: str) -> None:
    self._call("/pause_generation", self.inner.pause, mode)

  def resume(self) -> None:
    self._call("/continue_generation", self.inner.resume)

  def flush_cache(self) -> None:
    return None  # its KV lives only inside a call, or is flushed by the engine at each update

  def update_weights_from_disk(self, body: dict):
    raise ServerError("the colocated engine has no route POST /update_weights_from_disk", status=404)

  def model_info(self) -> dict:
    return self._call("/model_info", self.inner.model_info)

  def server_info(self) -> dict:
    return self._call("/server_info", self.inner.server_info, "colocated", 0)

  def is_healthy(self, timeout_s: float = 5.0) -> bool:
    return True

  def wait_until_healthy(self, **_) -> None:
    return None  # the engine is built before the client

  def has_weight_update_route(self) -> bool:
    return True  # its weights are handed over in memory

  def update_weights(self, params, version: str) -> tuple[bool, str]:
    """The trainer's parameters (cast to `rollout.sync.weight_dtype`) as weights `version`."""
    return self.inner.update_weights(params, version)

  def release_weights(self) -> None:
    self.inner.release_weights()

  def close(self) -> None:
    self.inner.close()


class EmbeddedLocal(LocalEngine):
  """The embedded engine (`GenerationEngine`) in this process."""

  @classmethod
  def start(cls, cfg, *, start_dir: str, model_config, mesh=None) -> "EmbeddedLocal":
    r = cfg.rollout
    engine = cls(
      GenerationEngine(
        start_dir,
        dtype=r.placement.server_dtype,
        seed=cfg.seed,
        quantize=r.placement.server_quantize,
        weight_version="0",
        enable_return_routed_experts=True,
        layer_loop=cfg.model.layer_loop,
        arithmetic=arithmetic(cfg),
      )
    )
    if r.placement.colocated_devices == "mesh":
      engine._spread(mesh, model_config)
    return engine

  def _spread(self, mesh, model_config) -> None:
    """`rollout.placement.colocated_devices: mesh`: the engine's weights in the trainer's layout on its mesh
    (every later handover lands there too), each batch's rows split over the data axes."""
    sampler = self.inner.sampler
    rows = NamedSharding(mesh, P(parallel.BATCH_AXES))
    sampler.shard(parallel.param_shardings(sampler.params, mesh, model_config.family), rows)


class SGLangJaxLocal(LocalEngine):
  """`rollout.placement.engine: sglang-jax` colocated: sglang-jax's `Engine` in this process (its
  single-process mode; this process must run in its venv, Python >= 3.12), its log-probs and
  routed experts as its server returns them, the trainer's weights swapped into its model runner
  in memory as HF-named arrays placed by its own weight map (`InProcessEngine.update_weights`).
  Its weights and preallocated KV pool stay resident between steps."""

  releases_weights = False

  def __init__(self, inner, model_config):
    super().__init__(inner)
    # The trainer's state as HF-named arrays (each stacked layer sliced, kernels transposed), in
    # one compiled program rather than op by op.
    self._hf_named = jax.jit(lambda params: hf_named(params, model_config))

  @classmethod
  def start(cls, cfg, *, start_dir: str, model_config, mesh=None) -> "SGLangJaxLocal":
    from trainers.serving.sglang_jax import launcher as sglang_jax
    from trainers.serving.sglang_jax.routes import InProcessEngine  # in sglang-jax's venv only (checks.py)

    args = sglang_jax.engine_args(
      start_dir,
      dtype=cfg.rollout.placement.server_dtype,
      enable_return_routed_experts=model_config.is_moe,
      extra=("--random-seed", str(cfg.seed), "--device-indexes", "0"),
    )
    return cls(InProcessEngine(args, weight_version="0", timeout_s=cfg.rollout.transport.timeout_s), model_config)

  def update_weights(self, params, version: str) -> tuple[bool, str]:
    return self.inner.update_weights(self._hf_named(params), version)
