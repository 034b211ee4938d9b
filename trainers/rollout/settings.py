"""What the `rollout` section derives for a run, checked as it is derived: the support width of
sampling-mask replay, the routed experts asked for, a sample's response budget. The composition root
computes them once (`derive` → `RolloutSettings`); the per-token extras (`trainers.rollout.extras`)
activate from that value."""

from __future__ import annotations

import dataclasses
import warnings

import mis_jax
from trainers.models import ModelConfig
from trainers.rollout.samples import RoutingSpec


def sampling_replay_width(r) -> int:
  """The support width of sampling-mask replay for the `rollout` section (0: off), checked.

  Sampling is truncated when it is not greedy and top-k, top-p or min-p cuts the vocabulary.
  `auto` replays exactly then, `on` always (it needs truncated, non-greedy sampling), `off`
  never (with a warning when sampling is truncated: the IS ratio is then biased by the kept
  mass). SGLang returns masks only for a finite `top_k` no larger than its
  `--sampling-mask-max-tokens`: `top_k` is the static support width of every step."""
  s = r.sampling
  truncated = s.temperature > 0 and (s.top_p < 1 or s.top_k > 0 or s.min_p > 0)
  mode = s.sampling_replay
  if mode == "off" or (mode == "auto" and not truncated):
    if truncated:
      warnings.warn(
        "rollout.sampling.sampling_replay is off with truncated sampling (top_p < 1, top_k > 0 or "
        "min_p > 0): the server's log-probs are over the whole vocabulary while it samples from the truncated "
        "distribution, so the IS ratio is biased by the kept mass (contract §11)"
      )
    return 0
  if s.temperature == 0:
    raise mis_jax.ConfigError(
      "rollout.sampling.sampling_replay on with greedy sampling (rollout.sampling.temperature "
      "0): every renormalised log-prob is 0 and nothing is learned; use temperature > 0 or "
      "sampling_replay: off"
    )
  if s.top_k < 1:
    what = "untruncated sampling" if not truncated else f"rollout.sampling.top_p {s.top_p}, min_p {s.min_p}"
    raise mis_jax.ConfigError(
      f"rollout.sampling.sampling_replay {mode} ({what}) needs a finite rollout.sampling.top_k: SGLang returns "
      f"sampling masks only for 1 < top_k <= --sampling-mask-max-tokens, and top_k bounds the replayed support; "
      f"set e.g. "
      f"rollout.sampling.top_k: 50, or rollout.sampling.sampling_replay: off"
    )
  if s.top_k > s.sampling_mask_max_tokens:
    raise mis_jax.ConfigError(
      f"rollout.sampling.top_k {s.top_k} exceeds rollout.sampling.sampling_mask_max_tokens "
      f"{s.sampling_mask_max_tokens}: the replayed support would not fit; lower top_k or "
      "raise sampling_mask_max_tokens (and the server's --sampling-mask-max-tokens)"
    )
  return s.top_k


def max_new_tokens(rollout, task) -> int:
  """The response budget of a sample: `rollout.sampling.max_new_tokens`, else the task's, else 128."""
  return rollout.sampling.max_new_tokens or getattr(task, "max_new_tokens", None) or 128


def routing_setup(r, model_cfg: ModelConfig) -> tuple[str, RoutingSpec | None]:
  """`(routing_replay, spec)` of the `rollout` section for this model, checked: `spec` (what the
  server's routed experts must look like) when they are asked for — with `r3`, or with
  `record_routing` for the routing-mismatch metrics — else None."""
  record = records_routing(r)
  if r.sampling.routing_replay == "r3" and not record:
    raise mis_jax.ConfigError(
      "rollout.sampling.routing_replay r3 replays the server's routed experts: "
      "rollout.sampling.record_routing cannot be false with it"
    )
  if (r.sampling.routing_replay != "none" or record) and not model_cfg.is_moe:
    what = (
      f"rollout.sampling.routing_replay {r.sampling.routing_replay}"
      if r.sampling.routing_replay != "none"
      else "rollout.sampling.record_routing"
    )
    raise mis_jax.ConfigError(
      f"{what} needs a mixture-of-experts model; {model_cfg.model_type} is dense (set "
      "rollout.sampling.routing_replay: none, rollout.sampling.record_routing: null)"
    )
  spec = (
    RoutingSpec(model_cfg.num_hidden_layers, model_cfg.num_experts_per_tok, model_cfg.num_experts) if record else None
  )
  return r.sampling.routing_replay, spec


def records_routing(r) -> bool:
  """Whether the `rollout` section asks the server for the routed experts (`r3`, or `record_routing`)."""
  return r.sampling.routing_replay == "r3" if r.sampling.record_routing is None else bool(r.sampling.record_routing)


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """The `rollout` section (`section`) and what it derives for a model: the support width of
  sampling-mask replay (0: off), the routing replay (`none`, `r2`, `r3`) and the routed experts'
  shape when the server is asked for them (None: not asked)."""

  section: object
  sampling_replay_width: int = 0
  routing_replay: str = "none"
  routing_spec: RoutingSpec | None = None

  @property
  def sampling(self):
    return self.section.sampling


def derive(rollout, model_cfg: ModelConfig) -> RolloutSettings:
  """The `RolloutSettings` of the `rollout` section for `model_cfg`, checked (a `ConfigError` naming
  the key)."""
  replay, spec = routing_setup(rollout, model_cfg)
  return RolloutSettings(rollout, sampling_replay_width(rollout), replay, spec)
