"""mis_jax: rollout correction (TIS/MIS, rejection sampling, veto, decoupled PPO) in pure JAX.

Pure, jittable functions over packed sequences. Docstrings cite the behaviour contract as
``contract §N``: section N of ``docs/contract.md`` (the docs site's "Behaviour contract" page).
"""

from mis_jax._advantages import (ESTIMATORS, SEQUENCE_ESTIMATORS, compute_advantages, optimal_token_baseline,
                                 sequence_to_tokens)
from mis_jax._config import (AGGREGATIONS, ALGORITHMS, DENOMINATORS, DIVERGENCES, KL_TYPES, LEVELS, LOSS_AGG_MODES,
                             POLICY_LOSS_KEYS, POLICY_LOSSES, TIS_MODES, ConfigError, RSCriterion,
                             LossConfig, MISConfig, resolve_correction_fn)
from mis_jax._logprobs import LM_HEAD_LAYOUTS, token_logprobs
from mis_jax._losses import (Denominators, aggregate, kl_penalty, loss_denominators, policy_loss,
                             ppo_token_loss, prepare_step)
from mis_jax._packing import PackedBatch, Packing, plan_packing, split_microbatches
from mis_jax._prepared import Correction
from mis_jax._presets import PRESET_NAMES, PRESETS, Preset


def preset(name: str, **overrides) -> LossConfig:
  """The named preset (``PRESETS``: ``tis``, ``icepop``, ``seq-mask-tis``, ``trl:<mode>``,
  ``ms-swift:<mode>``; docs/reference/presets.md) as a :class:`LossConfig`, with ``overrides``
  over it (LossConfig keys, or MIS keys that go into its ``mis``). Same as
  :meth:`LossConfig.from_preset`."""
  return LossConfig.from_preset(name, **overrides)


from mis_jax._engine import PassOptions, pass_options
from mis_jax._metrics import MICROBATCH_REDUCTIONS, microbatch_reduction
from mis_jax._sampling import sampling_metrics
from mis_jax._segments import LOG_BOUND, MaskStats, Segments
from mis_jax._weights import compute_mis_weights, vanilla_tis_weights

__version__ = "0.1.0"

__all__ = [
    "AGGREGATIONS", "ALGORITHMS", "ConfigError", "Correction", "DENOMINATORS", "DIVERGENCES", "RSCriterion", "Denominators", "ESTIMATORS", "KL_TYPES", "LEVELS",
    "LOG_BOUND", "LOSS_AGG_MODES", "POLICY_LOSS_KEYS", "POLICY_LOSSES", "LossConfig", "MISConfig", "PackedBatch", "Packing",
    "Segments", "TIS_MODES", "aggregate", "compute_advantages",
    "compute_mis_weights", "kl_penalty", "loss_denominators",
    "plan_packing", "policy_loss", "ppo_token_loss", "prepare_step", "resolve_correction_fn",
    "sequence_to_tokens", "SEQUENCE_ESTIMATORS", "optimal_token_baseline", "split_microbatches", "vanilla_tis_weights", "LM_HEAD_LAYOUTS", "token_logprobs",
    "MaskStats", "PassOptions", "pass_options", "sampling_metrics",
    "MICROBATCH_REDUCTIONS", "microbatch_reduction", "PRESETS", "PRESET_NAMES", "Preset", "preset",
]

from mis_jax._sharding import batch_partition_spec, shard_batch, sharded_policy_loss  # noqa: E402

__all__ += ["batch_partition_spec", "shard_batch", "sharded_policy_loss"]

from mis_jax import config  # noqa: E402  (config plumbing: flags, YAML, declarative keys)

# Config plumbing moved to `mis_jax.config`; the old top-level names resolve there, with a warning.
_MOVED_TO_CONFIG = frozenset(config.__all__)


def __getattr__(name):
  if name in _MOVED_TO_CONFIG:
    import warnings
    warnings.warn(f"mis_jax.{name} moved to mis_jax.config.{name}", DeprecationWarning, stacklevel=2)
    return getattr(config, name)
  raise AttributeError(f"module 'mis_jax' has no attribute {name!r}")
