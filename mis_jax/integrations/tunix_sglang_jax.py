"""tunix's sglang-jax rollout, keeping sglang-jax's log-probs: the real engine's behaviour
log-probs for :class:`mis_jax.integrations.tunix.MISGRPOLearner`, with tunix's in-process
weight sync.

tunix 0.1.7's ``SglangJaxRollout`` runs sglang-jax's ``Engine`` in the trainer's process and
swaps the trainer's weights into its model runner after every step (``update_params``), but its
sampler never asks the engine for log-probs (``RolloutOutput.logprobs`` is None), so rollout
correction cannot use it; and it asks the engine to skip special tokens, which in sglang-jax
0.1.0rc0 drops every special id the model sampled from ``output_ids`` (not only from the text),
so the trainer would see a sequence the engine never sampled. :class:`SglangJaxRollout` is that
rollout with ``return_logprob`` on every engine call, every sampled id requested
(``skip_special_tokens=False``, ``no_stop_trim=True``: the stop token too, so it is trained as
sampled) and taken as the completion tokens, and the engine's log-probs kept, one per token,
aligned by position. Where tunix's padding convention cannot train a
sampled id (a pad id followed by other tokens), :class:`MISGRPOLearner` keeps that completion
out of the loss and counts it (``completions/untrainable``)::

    from mis_jax.integrations import tunix as mis_tunix
    from mis_jax.integrations.tunix_sglang_jax import SglangJaxRollout

    cluster_config = rl_cluster_lib.ClusterConfig(..., rollout_engine=SglangJaxRollout,
        rollout_config=base_rollout.RolloutConfig(..., rollout_sglang_jax_model_version=HF_DIR,
                                                  rollout_sglang_jax_kwargs={...}))
    learner = mis_tunix.MISGRPOLearner(rl_cluster, mis_tunix.MISGRPOConfig(...), reward_fns)

Needs tunix 0.1.7 and sglang-jax 0.1.0rc0 in one environment (Python >= 3.12: sglang-jax's
requirement; both resolve together there, with sglang-jax's flax 0.12.4).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from tunix.rl.rollout import base_rollout, sglang_jax_rollout

from mis_jax import ConfigError
from mis_jax.integrations.tunix import rope_theta_computed


def completion_logprobs(reply: dict) -> np.ndarray:
  """One float32 log-prob per token of ``reply["output_ids"]``, from its
  ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` entries), by position.

  sglang-jax 0.1.0rc0 repeats a long completion's log-probs (every 50 tokens it resends them
  from the start), the last ``completion_tokens`` entries being the whole list; so the output
  ids must number ``completion_tokens`` and equal those entries' ids position by position.
  Raises ValueError otherwise (an id missing from ``output_ids``, as with
  ``skip_special_tokens``, would shift every later log-prob onto another token).
  """
  ids = [int(i) for i in reply.get("output_ids") or ()]
  meta = reply.get("meta_info") or {}
  entries = list(meta.get("output_token_logprobs") or ())
  total = meta.get("completion_tokens", len(entries))
  if total != len(ids) or len(entries) < total:
    raise ValueError(
      f"sglang-jax returned {len(ids)} output ids, {total} completion tokens and "
      f"{len(entries)} log-prob entries: request {meta.get('id')!r}"
    )
  entries = entries[len(entries) - total :]
  for position, (entry, token) in enumerate(zip(entries, ids)):
    if int(entry[1]) != token:
      raise ValueError(
        f"sglang-jax's output id {token} at position {position} has the log-prob entry of "
        f"token {entry[1]}: request {meta.get('id')!r}"
      )
  return np.asarray([entry[0] for entry in entries], np.float32)


def engine_rope_theta(model_version: str) -> float | None:
  """The RoPE theta the engine reads from ``model_version``'s config (transformers' reading of
  its ``config.json``: ``rope_theta``, or ``rope_parameters["rope_theta"]``)."""
  from transformers import AutoConfig

  config = AutoConfig.from_pretrained(model_version)
  theta = getattr(config, "rope_theta", None)
  if theta is None:
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
  return None if theta is None else float(theta)


class SglangJaxRollout(sglang_jax_rollout.SglangJaxRollout):
  """tunix's sglang-jax rollout whose ``generate`` returns exactly what the engine sampled, with
  the engine's log-probs.

  Constructed by tunix's ``RLCluster`` from ``ClusterConfig(rollout_engine=SglangJaxRollout)``
  (keyword ``rollout_actor``, as for any custom rollout); everything else, the weight sync
  included, is tunix's own. Raises :class:`mis_jax.ConfigError` at construction when the
  engine's config reads another RoPE theta than tunix's model computes with
  (:func:`mis_jax.integrations.tunix.rope_theta_computed`).
  """

  # tunix builds a custom rollout with `rollout_actor=...` by keyword; the parent names that
  # argument differently, so this signature is tunix's contract, not a redundant override.
  def __init__(self, rollout_actor, tokenizer, mesh, rollout_config: base_rollout.RolloutConfig):
    trained = rope_theta_computed(getattr(rollout_actor, "config", None))
    model_version = rollout_config.rollout_sglang_jax_model_version
    served = engine_rope_theta(model_version) if trained is not None else None
    if served is not None and served != trained:
      raise ConfigError(
        f"sglang-jax reads rope_theta={served:.10g} from {model_version}, but tunix's model "
        f"computes with {trained:.10g}: the engine would sample from another model than the one "
        f"trained. Write rope_theta={trained:.10g} in its config.json."
      )
    super().__init__(rollout_actor, tokenizer, mesh, rollout_config)

  def generate(self, prompts, rollout_config, **kwargs) -> base_rollout.RolloutOutput:
    engine = self._sampler.engine
    replies = []

    async def async_generate(*args, **call_kwargs):  # the one engine call tunix's sampler makes
      call_kwargs["return_logprob"] = True
      # Every sampled id: tunix asks to skip special tokens, which drops them from output_ids, and
      # sglang-jax trims the stop token from them unless told not to.
      raw = dict(skip_special_tokens=False, no_stop_trim=True)
      params = call_kwargs["sampling_params"]
      call_kwargs["sampling_params"] = (
        [dict(p, **raw) for p in params] if isinstance(params, list) else dict(params, **raw)
      )
      out = await type(engine).async_generate(engine, *args, **call_kwargs)
      replies.append(out)
      return out

    engine.async_generate = async_generate
    try:
      output = super().generate(prompts, rollout_config, **kwargs)
    finally:
      del engine.async_generate
    (reply,) = replies
    reply = reply if isinstance(reply, list) else [reply]
    if len(reply) != len(output.tokens):
      raise ValueError(f"sglang-jax returned {len(reply)} results for {len(output.tokens)} completions")
    tokens = [np.asarray(r["output_ids"], np.int32) for r in reply]
    # The text tunix's rewards see stays as tunix asked for it: special tokens skipped.
    tokenizer = getattr(engine.tokenizer_manager, "tokenizer", None)
    text = (
      output.text if tokenizer is None else [tokenizer.decode(t.tolist(), skip_special_tokens=True) for t in tokens]
    )
    return dataclasses.replace(output, text=text, tokens=tokens, logprobs=[completion_logprobs(r) for r in reply])
