"""tunix's sglang-jax rollout, keeping sglang-jax's log-probs: the real engine's behaviour
log-probs for :class:`mis_jax.integrations.tunix.MISGRPOLearner`, with tunix's in-process
weight sync.

tunix 0.1.7's ``SglangJaxRollout`` runs sglang-jax's ``Engine`` in the trainer's process and
swaps the trainer's weights into its model runner after every step (``update_params``), but its
sampler never asks the engine for log-probs (``RolloutOutput.logprobs`` is None), so rollout
correction cannot use it. :class:`SglangJaxRollout` is that rollout with ``return_logprob`` on
every engine call and the log-probs kept, one per returned completion token::

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


def completion_logprobs(reply: dict) -> np.ndarray:
  """One float32 log-prob per token of ``reply["output_ids"]``, from its
  ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` entries).

  The entries are matched to the output tokens by id, in order: tunix asks sglang-jax to skip
  special tokens, which drops them from ``output_ids`` (the stop token) but not from the
  log-probs; and sglang-jax 0.1.0rc0 repeats a long completion's log-probs (every 50 tokens it
  resends them from the start), the last ``completion_tokens`` entries being the whole list.
  Raises ValueError when the output tokens are not found among the entries.
  """
  ids = list(reply.get("output_ids") or ())
  meta = reply.get("meta_info") or {}
  entries = list(meta.get("output_token_logprobs") or ())
  total = meta.get("completion_tokens")
  if isinstance(total, int) and 0 < total < len(entries):
    entries = entries[-total:]
  out, j = [], 0
  for entry in entries:
    if j < len(ids) and entry[1] == ids[j]:
      out.append(entry[0])
      j += 1
  if j != len(ids):
    raise ValueError(f"sglang-jax returned {len(entries)} log-prob entries in which the {len(ids)} output tokens "
                     f"are not found in order (matched {j}): request {meta.get('id')!r}")
  return np.asarray(out, np.float32)


class SglangJaxRollout(sglang_jax_rollout.SglangJaxRollout):
  """tunix's sglang-jax rollout whose ``generate`` returns the engine's log-probs.

  Constructed by tunix's ``RLCluster`` from ``ClusterConfig(rollout_engine=SglangJaxRollout)``
  (keyword ``rollout_actor``, as for any custom rollout); everything else, the weight sync
  included, is tunix's own.
  """

  # tunix builds a custom rollout with `rollout_actor=...` by keyword; the parent names that
  # argument differently, so this signature is tunix's contract, not a redundant override.
  def __init__(self, rollout_actor, tokenizer, mesh, rollout_config: base_rollout.RolloutConfig):
    super().__init__(rollout_actor, tokenizer, mesh, rollout_config)

  def generate(self, prompts, rollout_config, **kwargs) -> base_rollout.RolloutOutput:
    engine = self._sampler.engine
    replies = []

    async def async_generate(*args, **call_kwargs):  # the one engine call tunix's sampler makes
      call_kwargs["return_logprob"] = True
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
    logprobs = [completion_logprobs(r) for r in reply]
    for b, (lps, toks) in enumerate(zip(logprobs, output.tokens)):
      if len(lps) != len(toks):
        raise ValueError(f"completion {b}: {len(lps)} log-probs for {len(toks)} tokens")
    return dataclasses.replace(output, logprobs=logprobs)
