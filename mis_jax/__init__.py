"""mis_jax: rollout correction (TIS/MIS, rejection sampling, veto, decoupled PPO) in pure JAX.

Pure, jittable functions over packed sequences. Docstrings cite the behaviour contract as
``contract §N``: section N of ``docs/contract.md`` (the docs site's "Behaviour contract" page).

The top level is what a user composes: the configs, the losses, the weights, the advantages, the
packed batches and the log-probs. The public submodules hold the rest: :mod:`mis_jax.forms` (the
policy-loss forms: their registry, configs and how to add one), :mod:`mis_jax.estimators` (the
advantage estimators, likewise), :mod:`mis_jax.config` (the names each key accepts, the presets, the
flags and YAML plumbing) and :mod:`mis_jax.engine` (how the passes run, for tuning).
"""

import warnings as _warnings

from mis_jax._advantages import compute_advantages, optimal_token_baseline, sequence_to_tokens
from mis_jax._config import ConfigError, LossConfig, MISConfig, RSCriterion, resolve_correction_fn
from mis_jax._logprobs import token_logprobs
from mis_jax._losses import aggregate, kl_penalty, loss_denominators, policy_loss, prepare_step
from mis_jax._metrics import microbatch_reduction
from mis_jax._packing import PackedBatch, Packing, plan_packing, split_microbatches
from mis_jax._policy_losses import ppo_token_loss
from mis_jax._prepared import Correction, Denominators
from mis_jax._sampling import sampling_metrics
from mis_jax._sharding import batch_partition_spec, shard_batch, sharded_policy_loss
from mis_jax._weights import compute_mis_weights, vanilla_tis_weights
from mis_jax import config, engine, estimators, forms


def preset(name: str, **overrides) -> LossConfig:
  """The named preset (``mis_jax.config.PRESETS``: ``tis``, ``icepop``, ``seq-mask-tis``, ``trl:<mode>``,
  ``ms-swift:<mode>``; docs/reference/presets.md) as a :class:`LossConfig`, with ``overrides``
  over it (LossConfig keys, or MIS keys that go into its ``mis``). Same as
  :meth:`LossConfig.from_preset`."""
  return LossConfig.from_preset(name, **overrides)


__version__ = "0.1.0"

__all__ = [
  # configs
  "ConfigError",
  "LossConfig",
  "MISConfig",
  "RSCriterion",
  "preset",
  "resolve_correction_fn",
  # the loss of a step
  "policy_loss",
  "prepare_step",
  "Correction",
  "Denominators",
  "loss_denominators",
  "ppo_token_loss",
  "kl_penalty",
  "aggregate",
  "microbatch_reduction",
  # IS weights, advantages
  "compute_mis_weights",
  "vanilla_tis_weights",
  "compute_advantages",
  "optimal_token_baseline",
  "sequence_to_tokens",
  # packed batches, log-probs, sharding
  "PackedBatch",
  "Packing",
  "plan_packing",
  "split_microbatches",
  "token_logprobs",
  "sampling_metrics",
  "sharded_policy_loss",
  "shard_batch",
  "batch_partition_spec",
]

# Names that moved to a submodule: the old top-level spelling resolves there for one release, with a
# DeprecationWarning naming the new place.
_MOVED = {
  **{
    name: config
    for name in (
      "LOSS_FLAG_KEYS",
      "add_loss_flags",
      "config_fields",
      "config_key",
      "load_yaml",
      "loss_config_from_args",
      "parse_config_value",
      "same_value",
      "AGGREGATIONS",
      "ALGORITHMS",
      "DENOMINATORS",
      "DIVERGENCES",
      "KL_TYPES",
      "LEVELS",
      "LOSS_AGG_MODES",
      "TIS_MODES",
      "PRESETS",
      "PRESET_NAMES",
      "Preset",
    )
  },
  **{
    name: engine
    for name in (
      "PassOptions",
      "pass_options",
      "Segments",
      "MaskStats",
      "LOG_BOUND",
      "LM_HEAD_LAYOUTS",
      "MICROBATCH_REDUCTIONS",
    )
  },
  **{name: forms for name in ("POLICY_LOSSES", "POLICY_LOSS_KEYS")},
  **{name: estimators for name in ("ESTIMATORS", "SEQUENCE_ESTIMATORS")},
}


def __getattr__(name):
  module = _MOVED.get(name)
  if module is None:
    raise AttributeError(f"module 'mis_jax' has no attribute {name!r}")
  _warnings.warn(f"mis_jax.{name} moved to {module.__name__}.{name}", DeprecationWarning, stacklevel=2)
  return getattr(module, name)
