"""Reference implementations for tests/mis_jax/test_trust_regions.py, copied from the peers' code (torch):
the test compares mis_jax against them. Not part of the library.

- prime-rl, src/prime_rl/trainer/rl/loss.py at commit 559b44772e471d1538537b8805cc77f3824a5e64
  (PrimeIntellect-ai/prime-rl): ``default_loss_fn`` (DPPO-Binary-TV masking conditioned on the
  advantage's sign + the Kimi-K2.5 squared-log-ratio KL on all trainable tokens) and
  ``ipo_loss_fn`` (the symmetric band), their per-token loss and mask; the config objects are
  replaced by arguments, the metrics trimmed to the masks.
- verl, verl/trainer/ppo/core_algos.py at commit 1dda039b9c6311889a9c9a26040677e1254814f9
  (verl-project/verl), ``compute_policy_loss_dppo_kl``'s binary KL (the only binary KL in that
  verl: ``rollout_rs="binary_kl"``, verl PR #6800, is not merged there).
"""

import torch


def prime_rl_default_loss(
  trainer_logprobs, inference_logprobs, advantages, loss_mask, *, dppo_mask_high, dppo_mask_low, kl_tau, adv_tau=1.0
):
  """prime-rl's ``default_loss_fn`` (summed per-token loss and the mask ``is_masked``)."""
  log_importance_ratio = trainer_logprobs - inference_logprobs
  importance_ratio = torch.exp(log_importance_ratio)
  probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
  dppo_invalid_mask_high = probs_diff > dppo_mask_high
  dppo_invalid_mask_low = probs_diff < -dppo_mask_low
  positive_advantages = advantages > 0
  dppo_invalid_mask = torch.where(positive_advantages, dppo_invalid_mask_high, dppo_invalid_mask_low)
  is_masked = dppo_invalid_mask
  keep_mask = loss_mask & ~is_masked
  advantages = adv_tau * advantages
  pg_loss = keep_mask * advantages * importance_ratio
  kl_loss = loss_mask * log_importance_ratio**2
  per_token_loss = -pg_loss + kl_tau * kl_loss
  return per_token_loss.sum(), loss_mask & is_masked


def prime_rl_ipo_loss(
  trainer_logprobs, inference_logprobs, advantages, loss_mask, *, ipo_threshold, kl_tau, adv_tau=1.0
):
  """prime-rl's ``ipo_loss_fn``: the symmetric band ``|p - p_q| > ipo_threshold``."""
  log_importance_ratio = trainer_logprobs - inference_logprobs
  importance_ratio = torch.exp(log_importance_ratio)
  abs_probs_diff = torch.abs(torch.exp(trainer_logprobs) - torch.exp(inference_logprobs))
  is_masked = abs_probs_diff > ipo_threshold
  keep_mask = loss_mask & ~is_masked
  advantages = adv_tau * advantages
  pg_loss = keep_mask * advantages * importance_ratio
  kl_loss = loss_mask * log_importance_ratio**2
  per_token_loss = -pg_loss + kl_tau * kl_loss
  return per_token_loss.sum(), loss_mask & is_masked


def verl_binary_kl(log_prob, old_log_prob):
  """verl's binary KL of ``compute_policy_loss_dppo_kl``: ``D_B(p_old ‖ p)`` with 1e-8 in the
  complements (no clamp)."""
  prob = torch.exp(log_prob)
  old_prob = torch.exp(old_log_prob)
  return old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
    (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
  )
