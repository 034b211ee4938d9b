"""Named presets: the rollout-correction settings other frameworks call by name, as our keys.

Users arrive with NeMo-RL / OpenRLHF's ``tis`` / ``icepop`` / ``seq-mask-tis``, TRL's
``vllm_importance_sampling_mode`` and ms-swift's ``rollout_importance_sampling_mode``. Each name
here expands to :class:`mis_jax.LossConfig` keys (decoupled PPO: the weights come from
``r = o - q``, the trainer's old log-probs against the engine's, and multiply the PPO loss, as in
each of those frameworks) with the framework's default bounds. The table, each definition's source
and the tests that check each expansion against the framework's formula are in
``docs/reference/presets.md`` and ``tests/mis_jax/test_presets.py``.

TRL and ms-swift use the same four mode names with different definitions (TRL's sequence ratio is
the product of the token ratios and its cap C = 3; ms-swift's is their geometric mean and its
threshold 2; ms-swift's ``sequence_mask`` keeps the token ratios), so those names carry the
framework as a prefix: ``trl:sequence_mask``, ``ms-swift:sequence_mask``.

The masked modes of all of them zero a masked token's weight and keep it in the loss's
denominator: ``denominator: original`` (contract §7). The loss aggregation (``loss_agg_mode``)
is not part of a preset: each framework has its own loss types; set it beside the preset.

The table is data, key names and values: :meth:`mis_jax.LossConfig.from_preset` (and
``mis_jax._config.preset_values``) expand and validate it, so this module imports no config.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from mis_jax._keys import ConfigError, _closest

# A truncation bound that never binds: the raw weight is exp(clip(L, ±20)) <= e^20 < 1e9 (contract
# §2), so `truncate` with this bound keeps the raw token ratio, as the frameworks that gate by a
# sequence statistic and weight by the token ratio do (ms-swift's sequence_mask, OpenRLHF's
# seq-mask-tis).
UNBOUNDED = 1.0e9

_OPENRLHF = "https://github.com/OpenRLHF/OpenRLHF/blob/main/openrlhf/models/loss.py"
_NEMO_RL = "https://github.com/NVIDIA-NeMo/RL/blob/main/nemo_rl/algorithms/loss_functions.py"
_TRL_CONFIG = "https://github.com/huggingface/trl/blob/main/trl/trainer/grpo_config.py"
_TRL_TRAINER = "https://github.com/huggingface/trl/blob/main/trl/trainer/grpo_trainer.py"
_SWIFT_DOC = (
  "https://github.com/modelscope/ms-swift/blob/main/docs/source_en/Instruction/GRPO/AdvancedResearch/"
  "training_inference_mismatch.md"
)
_SWIFT_CODE = "https://github.com/modelscope/ms-swift/blob/main/swift/trainers/rlhf_trainer/grpo_trainer.py"


@dataclasses.dataclass(frozen=True)
class Preset:
  """A named preset: its :class:`LossConfig` keys (``mis`` as a mapping of MIS keys), the
  framework's formula in words and where the definition was read."""

  name: str
  framework: str
  formula: str
  sources: tuple[str, ...]
  loss: Mapping[str, Any]

  def loss_values(self) -> dict:
    """The preset's LossConfig keys (a fresh copy, ``mis`` a fresh dict)."""
    out = dict(self.loss)
    out["mis"] = dict(out["mis"])
    return out


def _decoupled(mis: dict) -> dict:
  return {"use_tis": True, "use_rollout_logprobs": False, "denominator": "original", "mis": mis}


_PRESETS = (
  # OpenRLHF's --vllm_is_correction_type (band [low, high], default [0.5, 5.0]); NeMo-RL's
  # truncated_importance_sampling_type takes the same three names, with bounds you set.
  Preset(
    "tis",
    "OpenRLHF / NeMo-RL",
    "w = clip(exp(o - q), 0.5, 5)",
    (_OPENRLHF, _NEMO_RL),
    _decoupled({"tis_level": "token", "tis_mode": "clip", "tis_lower_bound": 0.5, "tis_upper_bound": 5.0}),
  ),
  Preset(
    "icepop",
    "OpenRLHF / NeMo-RL",
    "w = exp(o - q) if 0.5 <= exp(o - q) <= 5, else 0",
    (_OPENRLHF, _NEMO_RL),
    _decoupled({"tis_level": "token", "tis_mode": "mask", "tis_lower_bound": 0.5, "tis_upper_bound": 5.0}),
  ),
  Preset(
    "seq-mask-tis",
    "OpenRLHF / NeMo-RL",
    "w_t = exp(o_t - q_t) on sequences whose geometric-mean ratio exp(mean(o - q)) is in [0.5, 5], else 0",
    (_OPENRLHF, _NEMO_RL),
    _decoupled(
      {
        "tis_level": "token",
        "tis_mode": "truncate",
        "tis_upper_bound": UNBOUNDED,
        "use_rs": True,
        "rs_level": "geometric",
        "rs_lower_bound": 0.5,
        "rs_upper_bound": 5.0,
      }
    ),
  ),
  # TRL's GRPOConfig.vllm_importance_sampling_mode (default sequence_mask) with
  # vllm_importance_sampling_clip_max (formerly _cap) C = 3 and no lower bound.
  Preset(
    "trl:token_truncate",
    "TRL",
    "w = min(exp(o - q), 3)",
    (_TRL_CONFIG, _TRL_TRAINER),
    _decoupled({"tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": 3.0}),
  ),
  Preset(
    "trl:token_mask",
    "TRL",
    "w = exp(o - q) if exp(o - q) <= 3, else 0",
    (_TRL_CONFIG, _TRL_TRAINER),
    _decoupled({"tis_level": "token", "tis_mode": "mask", "tis_lower_bound": 0.0, "tis_upper_bound": 3.0}),
  ),
  Preset(
    "trl:sequence_truncate",
    "TRL",
    "w_t = min(exp(Σ_s (o - q)), 3)",
    (_TRL_CONFIG, _TRL_TRAINER),
    _decoupled({"tis_level": "sequence", "tis_mode": "truncate", "tis_upper_bound": 3.0}),
  ),
  Preset(
    "trl:sequence_mask",
    "TRL (its default)",
    "w_t = exp(Σ_s (o - q)) if <= 3, else 0",
    (_TRL_CONFIG, _TRL_TRAINER),
    _decoupled({"tis_level": "sequence", "tis_mode": "mask", "tis_lower_bound": 0.0, "tis_upper_bound": 3.0}),
  ),
  # ms-swift's --rollout_importance_sampling_mode with --rollout_importance_sampling_threshold τ = 2.
  Preset(
    "ms-swift:token_truncate",
    "ms-swift",
    "w = min(exp(o - q), 2)",
    (_SWIFT_DOC, _SWIFT_CODE),
    _decoupled({"tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": 2.0}),
  ),
  Preset(
    "ms-swift:token_mask",
    "ms-swift",
    "w = exp(o - q) if exp(o - q) <= 2, else 0",
    (_SWIFT_DOC, _SWIFT_CODE),
    _decoupled({"tis_level": "token", "tis_mode": "mask", "tis_lower_bound": 0.0, "tis_upper_bound": 2.0}),
  ),
  Preset(
    "ms-swift:sequence_truncate",
    "ms-swift",
    "w_t = min(exp(mean_s(o - q)), 2)",
    (_SWIFT_DOC, _SWIFT_CODE),
    _decoupled({"tis_level": "geometric", "tis_mode": "truncate", "tis_upper_bound": 2.0}),
  ),
  Preset(
    "ms-swift:sequence_mask",
    "ms-swift",
    "w_t = exp(o_t - q_t) on sequences with exp(mean_s(o - q)) <= 2, else 0",
    (_SWIFT_DOC, _SWIFT_CODE),
    _decoupled(
      {
        "tis_level": "token",
        "tis_mode": "truncate",
        "tis_upper_bound": UNBOUNDED,
        "use_rs": True,
        "rs_level": "geometric",
        "rs_lower_bound": 0.0,
        "rs_upper_bound": 2.0,
      }
    ),
  ),
)

PRESETS: dict[str, Preset] = {p.name: p for p in _PRESETS}
PRESET_NAMES = tuple(PRESETS)

# The mode names TRL and ms-swift share, with different definitions: the prefix is required.
_SHARED_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def get(name: str) -> Preset:
  """The preset called ``name``; an unknown name is a :class:`ConfigError` listing the valid ones."""
  if not isinstance(name, str):
    raise ConfigError(f"a preset name must be a string, got {type(name).__name__} {name!r}")
  if name in PRESETS:
    return PRESETS[name]
  if name in _SHARED_MODES:
    raise ConfigError(
      f"preset '{name}' is ambiguous: TRL and ms-swift define it differently; write "
      f"'trl:{name}' (TRL's vllm_importance_sampling_mode) or 'ms-swift:{name}' (ms-swift's "
      "rollout_importance_sampling_mode)"
    )
  raise ConfigError(f"unknown preset '{name}'.{_closest(name, PRESET_NAMES)} Valid presets: {', '.join(PRESET_NAMES)}")
