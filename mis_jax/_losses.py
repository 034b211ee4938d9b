"""Policy losses of the contract §6 table, aggregation and global denominators (contract §6–8).

``policy_loss`` is differentiable in ``logprobs`` only (everything else is stop-gradient) and
jittable with the :class:`LossConfig` static. Global denominators computed once per step
(:func:`loss_denominators`) make k micro-batch losses sum to the full-batch loss.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mis_jax import _centering
from mis_jax import _correction as correction
from mis_jax import _metrics as metrics_lib
from mis_jax import _validation
from mis_jax._config import POLICY_LOSSES, LossConfig, resolve_correction_fn
from mis_jax._engine import PassOptions, psum
from mis_jax._packing import PackedBatch
from mis_jax._policy_losses import FormInputs
from mis_jax._prepared import Correction, Denominators
from mis_jax._segments import AxisName, Segments, masked_means, safe_exp
from mis_jax._vocabulary import ALGORITHMS
from mis_jax._weights import Corrected, correct, drop_nonfinite_rollout, mismatch_metrics, vanilla_core


# --- per-token losses ------------------------------------------------------------------


def kl_penalty(logprobs, ref_logprobs, kl_type: str):
  """Per-token KL estimators to a reference policy (contract §6): ``KL_ESTIMATORS[kl_type](lp - ref)``."""
  if kl_type not in correction.KL_ESTIMATORS:
    raise ValueError(f"unknown kl_type {kl_type!r}")
  return correction.KL_ESTIMATORS[kl_type](logprobs - ref_logprobs)


def sq_log_ratio_kl(lp, q, mask, kept, segs: Segments, cfg: LossConfig, dens: Denominators):
  """The squared log-ratio KL to the rollout policy (contract §6.4; Kimi-K2.5's, prime-rl's
  ``kl_tau · (log r)²``): ``(lp - q)²`` per token, gradient through ``lp``, never IS-weighted,
  summed over the trainable tokens ``m`` (``sq_kl_tokens: trainable``) or the kept ``m'``
  (``kept``) and aggregated by ``loss_agg_mode`` with the loss's denominators. In the seq-mean
  modes a segment with no denominator token (all rejected, ``denominator: kept``) is not among
  the ``N`` sequences and adds nothing."""
  over = mask if cfg.sq_kl_tokens == "trainable" else kept
  values = jnp.where(mask, jnp.square(lp - q), 0.0)
  if cfg.loss_agg_mode not in ("token-mean", "token-sum"):
    values = jnp.where(segs.broadcast(dens.seg_tokens) > 0, values, 0.0)
  return aggregate(values, over, segs, cfg.loss_agg_mode, dens, loss_scale_factor=cfg.loss_scale_factor)


def _anchor(cfg: LossConfig, old, rollout):
  """The anchor of ``cfg``'s algorithm (contract §6, ``ALGORITHMS``): the old log-probs or the rollout's."""
  return old if ALGORITHMS[cfg.algorithm].anchor == "old" else rollout


def loglinear_proximal(lp_sg, q, staleness):
  """AReaL's approximate proximal log-probs (contract §6.3): ``o = q + α (sg(lp) - q)`` with
  ``α = s / (s + 1)``, ``s`` the versions the token's behaviour policy lags the proximal one —
  log-linear between the behaviour (version ``v - s``) and the current policy (taken as
  ``v + 1``) at the proximal version ``v``. Fresh tokens (``s = 0``) get ``o = q``."""
  alpha = staleness / (staleness + 1.0)
  return q + alpha * (lp_sg - q)


def _form_of(cfg: LossConfig):
  """The form the per-token loss runs and its config: the configured one, or under REINFORCE + IS
  (no anchor; only ratio-free forms are allowed there) gpg's ``-w·A·lp`` (contract §6)."""
  if cfg.algorithm == "reinforce_is":
    gpg = POLICY_LOSSES["gpg"]
    return gpg, gpg.config()
  return cfg.form, cfg.policy_loss


def token_loss(cfg: LossConfig, lp, lp_sg, o, q, adv, weights, kept, segs: Segments, selected):
  """The per-token policy loss of ``cfg``'s algorithm (contract §6) and form (§6.2).

  Returns ``(pg, over_kept, over_mask)``: the weighted per-token loss, metric rows over the
  kept mask (``pg_clipfrac``, ``ppo_kl`` and the form's own) and over the original mask
  (decoupled PPO's ``ois``).
  """
  anchor = _anchor(cfg, o, q)
  form, form_cfg = _form_of(cfg)
  weighted = weights if ALGORITHMS[cfg.algorithm].weighted else None
  out = form.fn(FormInputs(lp, lp_sg, anchor, adv, kept, segs, weighted, selected, cfg), form_cfg)
  over_mask = {"ois": safe_exp(lp_sg - o)} if cfg.algorithm == "decoupled_ppo" else {}
  return out.pg, {"pg_clipfrac": out.clipfrac, "ppo_kl": anchor - lp_sg, **out.over_kept}, over_mask


# contract §8.3: the loss terms add over micro-batches (their denominators are the step's); the
# form's clip share and `ppo_kl` are means over the kept mask, decoupled PPO's `ois` over m.
metrics_lib.declare(
  {
    "loss": "sum",
    "pg_loss": "sum",
    "entropy_loss": "sum",
    "kl_loss": "sum",
    "sq_kl_loss": "sum",
    "pg_clipfrac": "kept",
    "ppo_kl": "kept",
    "ois": "mask",
  }
)


def aggregate(
  token_values, kept, segs: Segments, mode: str, dens: Denominators, *, loss_scale_factor: float | None = None
):
  """Aggregates per-token losses over the kept mask with global denominators (contract §7).

  ``token_values`` is ``[T]`` (returns a scalar), a list of K ``[T]`` arrays or ``[T, K]``
  (returns ``[K]``). Every mode is a weighted token sum: ``Σ_t x_t m'_t / D`` (token-mean,
  ``D = Σ D_t``), ``/ N`` (seq-mean-token-sum) or ``Σ_t x_t m'_t / n_{s(t)} / N``
  (seq-mean-token-mean, ``n_s`` the segment's denominator count), ``Σ_t x_t m'_t`` (token-sum)
  or ``/ (N · loss_scale_factor)`` (seq-mean-token-sum-norm), so no scatter is needed
  and the backward pass is elementwise. Sums run over this device's (micro-)batch only and
  are completed with one ``psum``, so micro-batch losses add up to the full-batch loss and
  gradients flow correctly through ``shard_map``.
  """
  many = isinstance(token_values, (list, tuple)) or token_values.ndim == 2
  cols = (
    list(token_values)
    if isinstance(token_values, (list, tuple))
    else [token_values[:, k] for k in range(token_values.shape[1])]
    if many
    else [token_values]
  )
  keep = kept & segs.valid
  if mode == "token-mean":
    scale = 1.0 / jnp.maximum(dens.num_tokens, 1.0)
  elif mode == "seq-mean-token-sum":
    scale = 1.0 / jnp.maximum(dens.num_seqs, 1.0)
  elif mode == "token-sum":
    scale = 1.0
  elif mode == "seq-mean-token-sum-norm":
    if loss_scale_factor is None:
      raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs loss_scale_factor")
    scale = 1.0 / (jnp.maximum(dens.num_seqs, 1.0) * loss_scale_factor)
  else:
    scale = segs.broadcast(1.0 / jnp.maximum(dens.seg_tokens, 1.0)) / jnp.maximum(dens.num_seqs, 1.0)
  local = jnp.stack([jnp.sum(jnp.where(keep, x, 0.0) * scale) for x in cols])
  out = psum(local, segs.axis_name)
  return out if many else out[0]


# --- validation ------------------------------------------------------------------------


def _check_topk(topk_logprobs, batch: PackedBatch, cfg: LossConfig) -> None:
  """Score centering's inputs (contract §6.6): ``[..., k]`` float arrays with the batch's shape in
  front, ``k >= 1``, given exactly when ``score_centering`` is on."""
  if not cfg.score_centering:
    if topk_logprobs is not None:
      raise ValueError(
        "topk_logprobs was given but score_centering is off: set LossConfig(score_centering=True) or drop the argument"
      )
    return
  inputs = {
    "topk_logprobs": (
      topk_logprobs,
      "the trainer's log-probs of the sampler's top-k ids (mis_jax.token_logprobs(..., extra_ids=))",
    ),
    "batch.rollout_topk_logprobs": (
      batch.rollout_topk_logprobs,
      "the sampler's top-k log-probs (SGLang's output_top_logprobs)",
    ),
  }
  for name, (x, what) in inputs.items():
    if x is None:
      raise ValueError(f"score_centering needs {name}: {what}, [..., k] with the batch's shape in front")
    x = _validation.as_array(name, x)
    lead = tuple(jnp.shape(batch.segment_ids))
    if x.ndim != len(lead) + 1 or tuple(x.shape[:-1]) != lead or x.shape[-1] < 1:
      raise ValueError(
        f"'{name}' has shape {tuple(x.shape)}, expected {lead + ('k',)} with k >= 1 (the batch's "
        "per-token shape, then the top-k axis)"
      )
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"'{name}' must be a floating-point array, got dtype {x.dtype}")
  if jnp.shape(topk_logprobs) != jnp.shape(batch.rollout_topk_logprobs):
    raise ValueError(
      f"'topk_logprobs' has shape {tuple(jnp.shape(topk_logprobs))} but "
      f"'batch.rollout_topk_logprobs' has {tuple(jnp.shape(batch.rollout_topk_logprobs))}: the "
      "trainer's and the sampler's log-probs of the same k ids"
    )


def _check_batch(
  logprobs,
  batch: PackedBatch,
  cfg: LossConfig,
  entropy,
  correction: Correction | None = None,
  denominators=None,
  topk_logprobs=None,
) -> dict:
  if not isinstance(batch, PackedBatch):
    raise TypeError(f"batch must be a mis_jax.PackedBatch, got {type(batch).__name__}")
  if not isinstance(cfg, LossConfig):
    raise TypeError(f"loss_cfg must be a mis_jax.LossConfig, got {type(cfg).__name__}")
  algo = cfg.algorithm
  if cfg.needs_old_logprobs and batch.old_logprobs is None:
    raise ValueError(f"algorithm {algo!r} (use_rollout_logprobs=False) needs batch.old_logprobs")
  if algo != "ppo" and batch.rollout_logprobs is None:
    raise ValueError(f"algorithm {algo!r} needs batch.rollout_logprobs")
  if cfg.get_mismatch_metrics and batch.rollout_logprobs is None:
    raise ValueError("get_mismatch_metrics=True needs batch.rollout_logprobs")
  if cfg.sq_kl_coef > 0 and batch.rollout_logprobs is None:
    raise ValueError(
      f"sq_kl_coef={cfg.sq_kl_coef} > 0 (the squared log-ratio KL to the rollout policy) needs batch.rollout_logprobs"
    )
  if cfg.kl_coef > 0 and batch.ref_logprobs is None:
    raise ValueError(f"kl_coef={cfg.kl_coef} > 0 needs batch.ref_logprobs")
  if cfg.entropy_coef > 0 and entropy is None:
    raise ValueError(f"entropy_coef={cfg.entropy_coef} > 0 needs the per-token entropy argument")
  _check_topk(topk_logprobs, batch, cfg)
  if cfg.proximal == "loglinear" and batch.rollout_staleness is None:
    raise ValueError(
      "proximal='loglinear' needs batch.rollout_staleness (the versions each token's behaviour "
      "policy lags the weights trained)"
    )
  if correction is None:
    correction = Correction()
  elif not isinstance(correction, Correction):
    raise TypeError(
      f"correction must be a mis_jax.Correction (from mis_jax.prepare_step), got {type(correction).__name__}"
    )
  if (correction.is_weights is None) != (correction.kept_mask is None):
    raise ValueError("correction.is_weights and correction.kept_mask must be given together")
  if correction.is_weights is not None and cfg.correction_in_loss:
    raise ValueError(
      "precomputed is_weights cannot be used with use_rollout_logprobs=True and use_tis=True, "
      "nor with proximal='loglinear': there the weights depend on the current log-probs"
    )
  if correction.is_weights is not None and not cfg.use_tis:
    raise ValueError("correction.is_weights is set but use_tis is false")
  if denominators is not None and correction.denominators is not None:
    raise ValueError("denominators given twice: as denominators= and in correction.denominators; pass one")
  denominators = correction.denominators if denominators is None else denominators
  if denominators is not None and not isinstance(denominators, Denominators):
    raise TypeError(f"denominators must be mis_jax.Denominators, got {type(denominators).__name__}")
  fields = {
    f: getattr(batch, f)
    for f in (
      "segment_ids",
      "loss_mask",
      "advantages",
      "rollout_logprobs",
      "old_logprobs",
      "ref_logprobs",
      "rollout_staleness",
    )
  }
  fields.update(correction.token_arrays())
  fields["logprobs"] = logprobs
  fields["entropy"] = entropy
  arrays = _validation.check_token_arrays(
    fields,
    float_keys=("logprobs", "advantages", "rollout_logprobs", "old_logprobs", "ref_logprobs", "is_weights", "entropy"),
  )
  _validation.check_segments(batch.segment_ids, batch.num_segments)
  if cfg.proximal == "loglinear":
    _validation.check_nonnegative("rollout_staleness", arrays["rollout_staleness"], arrays["loss_mask"])
  if denominators is not None and tuple(jnp.shape(denominators.seg_tokens)) != (batch.num_segments,):
    raise ValueError(
      f"denominators.seg_tokens has shape {jnp.shape(denominators.seg_tokens)}, expected ({batch.num_segments},)"
    )
  return arrays, denominators


# --- the correction stage --------------------------------------------------------------


def _run_correction(
  train_lp,
  q,
  mask,
  segs: Segments,
  cfg: LossConfig,
  segment_ids_shape,
  batch_norm_factor,
  *,
  mismatch: bool = False,
  adv=None,
) -> Corrected:
  """Runs the configured correction on flat arrays.

  ``mismatch``: also compute the §8.1 metrics of ``(train_lp, q)`` (in the same passes for
  the ``mis`` correction). The returned :class:`MaskStats` of the original mask come from a
  pass that counted it; those of the kept mask too where the correction counted it (``mis``),
  else (vanilla: ``m' = m``; a user function) they are counted here.
  """
  mode = cfg.metric_mode
  if cfg.correction == "mis":
    return correct(
      train_lp, q, mask, segs, cfg.mis, mode, batch_norm_factor=batch_norm_factor, mismatch=mismatch, adv=adv
    )
  if mismatch:
    extra, mask_stats = mismatch_metrics(train_lp, q, mask, segs, mode)
  else:
    extra, mask_stats = {}, segs.mask_stats(mask)
  if cfg.correction == "vanilla":
    w, values = vanilla_core(train_lp, q, mask, cfg.tis_clip, cfg.tis_clip_low)
    metrics = {**extra, **masked_means([(mask, mask_stats, values)], segs, mode)}
    return Corrected(w, mask, metrics, mask_stats, mask_stats)
  # A user correction function with the signature of compute_mis_weights.
  fn = resolve_correction_fn(cfg.correction_fn)
  shape = segment_ids_shape
  w, kept, metrics = fn(
    train_lp.reshape(shape),
    q.reshape(shape),
    mask.reshape(shape),
    segs.ids.reshape(shape),
    cfg.mis,
    num_segments=segs.num_segments,
    axis_name=segs.axis_name,
  )
  w = jax.lax.stop_gradient(jnp.reshape(w, (-1,)).astype(jnp.float32))
  kept = _validation.flat_mask(kept, mask)
  return Corrected(jnp.where(mask, w, 0.0), kept, {**extra, **dict(metrics)}, mask_stats, segs.mask_stats(kept))


def prepare_step(
  batch: PackedBatch,
  loss_cfg: LossConfig,
  *,
  axis_name: AxisName = None,
  pass_options: PassOptions | None = None,
  key: jax.Array | None = None,
):
  """Once-per-step work for micro-batching: IS weights, kept mask, the covariance forms' tokens
  and global denominators, as a :class:`Correction` for every micro-batch's :func:`policy_loss`.

  For standard/bypass PPO the kept mask is the loss mask. For decoupled PPO the correction
  depends only on ``o`` and ``q``, so it runs here once over the whole step (so batch
  normalisation is over the step) and its weights and kept mask are the returned correction's.
  For REINFORCE with rollout IS, and decoupled PPO with ``proximal: loglinear``, the weights
  depend on the current log-probs and are computed inside :func:`policy_loss`; denominators are
  returned only when they do not depend on them (``denominator: original``), else None (contract
  §7). clip_cov / kl_cov pick their tokens here, for the whole step (``cov_selected``; clip_cov
  draws them with ``key``).

  Returns:
    ``(correction, metrics)``: a :class:`Correction` (``is_weights`` / ``kept_mask`` /
    ``cov_selected`` set where computed, ``denominators`` or None) and the correction metrics
    computed here.
  """
  if not isinstance(loss_cfg, LossConfig):
    raise TypeError(f"loss_cfg must be a mis_jax.LossConfig, got {type(loss_cfg).__name__}")
  _check_key(loss_cfg, key, None)
  arrays = _validation.check_token_arrays(
    {
      "segment_ids": batch.segment_ids,
      "loss_mask": batch.loss_mask,
      "advantages": batch.advantages,
      "rollout_logprobs": batch.rollout_logprobs,
      "old_logprobs": batch.old_logprobs,
    },
    float_keys=("advantages", "rollout_logprobs", "old_logprobs"),
  )
  _validation.check_segments(batch.segment_ids, batch.num_segments)
  segs = Segments(batch.segment_ids, batch.num_segments, axis_name, pass_options)
  mask = _validation.flat_mask(arrays["loss_mask"], segs.valid)
  if batch.rollout_logprobs is not None:  # contract §8.4 (policy_loss reports the count)
    mask, _ = drop_nonfinite_rollout(_validation.flat_float(batch.rollout_logprobs), mask, axis_name)
  shape = jnp.shape(batch.segment_ids)
  out, metrics, kept = Correction(), {}, mask
  if loss_cfg.algorithm == "decoupled_ppo" and not loss_cfg.correction_in_loss:
    if batch.old_logprobs is None or batch.rollout_logprobs is None:
      raise ValueError("decoupled PPO needs batch.old_logprobs and batch.rollout_logprobs")
    o = _validation.flat_float(batch.old_logprobs)
    q = _validation.flat_float(batch.rollout_logprobs)
    result = _run_correction(
      o, q, mask, segs, loss_cfg, shape, None, adv=jnp.where(mask, _validation.flat_float(batch.advantages), 0.0)
    )
    stats = result.kept_stats if loss_cfg.denominator == "kept" else result.mask_stats
    out = Correction(
      is_weights=result.weights.reshape(shape),
      kept_mask=result.kept.reshape(shape),
      denominators=Denominators.from_stats(stats),
    )
    metrics, kept = result.metrics, result.kept
  elif not (loss_cfg.correction_in_loss and loss_cfg.denominator == "kept"):
    out = Correction(denominators=Denominators.from_stats(segs.mask_stats(mask)))
  if loss_cfg.uses_cov_selection:
    anchor = _anchor(loss_cfg, batch.old_logprobs, batch.rollout_logprobs)
    if anchor is None:
      raise ValueError(
        f"policy_loss '{loss_cfg.policy_loss.name}' selects tokens from the anchor log-probs: "
        f"algorithm '{loss_cfg.algorithm}' needs batch."
        f"{_anchor(loss_cfg, 'old_logprobs', 'rollout_logprobs')}"
      )
    anchor = jnp.where(mask, _validation.flat_float(anchor), 0.0)
    adv = jnp.where(mask, _validation.flat_float(batch.advantages), 0.0)
    selected = loss_cfg.form.select(anchor, adv, kept, segs, loss_cfg.policy_loss, key)
    out = out.replace(cov_selected=selected.reshape(shape))
  return out, metrics


def _check_key(cfg: LossConfig, key, selected) -> None:
  if cfg.form.select_needs_key and key is None and selected is None:
    raise ValueError(
      f"policy_loss '{cfg.policy_loss.name}' picks its tokens at random: pass key= (a jax.random "
      "key), or a correction whose cov_selected prepare_step set"
    )


def loss_denominators(
  batch: PackedBatch,
  loss_cfg: LossConfig,
  *,
  axis_name: AxisName = None,
  pass_options: PassOptions | None = None,
  key: jax.Array | None = None,
):
  """Global :class:`Denominators` of a full step's batch (see :func:`prepare_step`)."""
  return prepare_step(batch, loss_cfg, axis_name=axis_name, pass_options=pass_options, key=key)[0].denominators


# --- the loss --------------------------------------------------------------------------


def policy_loss(
  logprobs,
  batch: PackedBatch,
  loss_cfg: LossConfig,
  entropy=None,
  axis_name: AxisName = None,
  *,
  correction: Correction | None = None,
  denominators: Denominators | None = None,
  batch_norm_factor=None,
  pass_options: PassOptions | None = None,
  key: jax.Array | None = None,
  topk_logprobs=None,
):
  """Policy loss of the algorithm selected by ``use_rollout_logprobs`` × ``use_tis`` (contract §6)
  and the form ``policy_loss`` (contract §6.2; ``vanilla``: PPO's clipped surrogate).

  | use_rollout_logprobs | use_tis | algorithm        | per-token loss                          |
  |----------------------|---------|------------------|-----------------------------------------|
  | False                | False   | standard PPO     | ``ppo(exp(lp - o))``                    |
  | True                 | False   | bypass PPO       | ``ppo(exp(lp - q))``                    |
  | False                | True    | decoupled PPO    | ``w · ppo(exp(lp - o))``, w from o - q  |
  | True                 | True    | REINFORCE + IS   | ``-w · A · lp``, w from sg(lp) - q      |

  The per-token loss is aggregated over the kept mask ``m'`` by ``loss_agg_mode`` with the
  ``denominator`` of contract §7; ``loss = pg_loss - entropy_coef·entropy_loss + kl_coef·kl_loss``
  ``+ sq_kl_coef·sq_kl_loss`` (contract §6.4) where the extra terms are aggregated the same way and never weighted by
  IS. Other forms
  replace ``ppo(·)`` by theirs against the same anchor; REINFORCE + IS takes only the
  ratio-free forms (``vanilla``, ``gpg``).

  Args:
    logprobs: ``lp``, current per-token log-probs (carries the gradient; any float dtype).
    batch: the :class:`PackedBatch`.
    loss_cfg: a :class:`LossConfig` (static under jit).
    entropy: optional per-token entropy for the entropy bonus and ``entropy_loss`` metric.
    axis_name: mesh axis name(s) inside ``shard_map``; all sums become global.
    correction: the step's :class:`Correction` from :func:`prepare_step` (this micro-batch's
      rows of it: :func:`split_microbatches`): its weights, kept mask, selected tokens and
      denominators are used instead of computing them from this batch alone.
    denominators: global :class:`Denominators` for micro-batching where the correction has none
      (default: this batch's).
    batch_norm_factor: a step-wide batch-normalisation mean for the ``mis`` correction when
      it must run per micro-batch (REINFORCE with rollout IS).
    pass_options: how the token passes run (static); default :func:`mis_jax.engine.pass_options`
      of ``batch.segment_ids``.
    key: a ``jax.random`` key for clip_cov's random token selection when there is no
      ``correction.cov_selected`` from :func:`prepare_step`.
    topk_logprobs: with ``score_centering`` (contract §6.6), ``[..., k]``: the current log-probs
      of the sampler's top-k ids at each position (carries the gradient, like ``logprobs``);
      ``batch.rollout_topk_logprobs`` holds the sampler's. The policy-loss term then reads
      ``lp - C + sg(C)`` for ``lp``, ``C = Σ_K sg(q_v) log p_v + sg(q_tail) log p_tail``: the same
      value, the centred score as its gradient.

  Returns:
    ``(loss, metrics)``: a float32 scalar and a dict of float32 scalars (contract §8 names).
  """
  arrays, denominators = _check_batch(logprobs, batch, loss_cfg, entropy, correction, denominators, topk_logprobs)
  _check_key(loss_cfg, key, arrays.get("cov_selected"))
  segs = Segments(batch.segment_ids, batch.num_segments, axis_name, pass_options)
  x = _loss_inputs(logprobs, arrays, segs, loss_cfg, axis_name)
  corr = _corrected(x, arrays, segs, loss_cfg, jnp.shape(batch.segment_ids), batch_norm_factor)
  pg_tok, over_kept, over_mask = _policy_term(
    x, corr, arrays, segs, loss_cfg, key, topk_logprobs, batch.rollout_topk_logprobs
  )
  if denominators is None:
    denominators = Denominators.from_stats(corr.kept_stats if loss_cfg.denominator == "kept" else corr.mask_stats)
  loss, values = _loss_terms(x, corr.kept, pg_tok, entropy, segs, loss_cfg, denominators)
  sg = jax.lax.stop_gradient
  rows = [(x.mask, corr.mask_stats, over_mask), (corr.kept, corr.kept_stats, over_kept)]
  metrics = {**corr.metrics, **masked_means(rows, segs, loss_cfg.metric_mode)}
  metrics.update({k: sg(v) for k, v in values.items()})
  metrics.update(x.nonfinite)
  metrics["loss"] = sg(loss)
  return loss, metrics


class _LossInputs(NamedTuple):
  """The loss's flat ``[T]`` inputs: the trained mask ``m`` (rollout log-probs that are not finite
  dropped, their count in ``nonfinite``), ``lp`` (with the gradient) and the stop-gradient others, 0
  off ``m``; ``monitor`` the trainer log-probs mismatch monitoring reads."""

  mask: jax.Array
  nonfinite: dict
  lp: jax.Array
  lp_sg: jax.Array
  adv: jax.Array
  q: jax.Array | None
  o: jax.Array | None
  ref: jax.Array | None
  monitor: jax.Array


def _loss_inputs(logprobs, arrays: dict, segs: Segments, cfg: LossConfig, axis_name) -> _LossInputs:
  """The flat inputs; ``o`` is loglinear's approximation with ``proximal: loglinear`` (contract §6.3)."""
  mask = _validation.flat_mask(arrays["loss_mask"], segs.valid)
  nonfinite = {}
  if arrays.get("rollout_logprobs") is not None:  # contract §8.4: such tokens leave m, for every algorithm
    mask, nonfinite = drop_nonfinite_rollout(_validation.flat_float(arrays["rollout_logprobs"]), mask, axis_name)

  def flat(name):
    v = arrays.get(name)
    return None if v is None else jnp.where(mask, jax.lax.stop_gradient(_validation.flat_float(v)), 0.0)

  # Masked positions may hold NaN/inf: select (never multiply) before any arithmetic so
  # neither values nor gradients leak.
  lp = jnp.where(mask, _validation.flat_float(logprobs), 0.0)
  lp_sg = jax.lax.stop_gradient(lp)
  adv, q, o, ref = flat("advantages"), flat("rollout_logprobs"), flat("old_logprobs"), flat("ref_logprobs")
  # Mismatch monitoring reads the trainer's log-probs: o, or sg(lp) when there are none (or o is
  # only loglinear's approximation).
  monitor = lp_sg if o is None else o
  if cfg.proximal == "loglinear":
    o = loglinear_proximal(lp_sg, q, flat("rollout_staleness"))
  return _LossInputs(mask, nonfinite, lp, lp_sg, adv, q, o, ref, monitor)


def _corrected(x: _LossInputs, arrays: dict, segs: Segments, cfg: LossConfig, shape, batch_norm_factor) -> Corrected:
  """The correction stage: the weights and kept mask (the step's precomputed ones, or the correction run
  here), the mismatch monitoring whenever rollout log-probs are present (contract §8.1), and the
  :class:`MaskStats` of ``m`` and ``m'``. The correction reads ``o`` in decoupled PPO and ``sg(lp)`` in
  REINFORCE, so when those are the log-probs monitored the correction's own passes monitor too."""
  weights, kept, metrics = jnp.ones_like(x.lp), x.mask, {}
  mask_stats = kept_stats = None  # MaskStats of m and m', once counted
  mismatch_done = False
  if cfg.use_tis:
    if arrays.get("is_weights") is not None:
      weights = jnp.where(x.mask, jax.lax.stop_gradient(_validation.flat_float(arrays["is_weights"])), 0.0)
      kept = _validation.flat_mask(arrays["kept_mask"], x.mask)
    else:
      train_lp = x.o if cfg.algorithm == "decoupled_ppo" else x.lp_sg
      # The correction's passes monitor too when they read the monitored log-probs: o in decoupled
      # PPO (recomputed, not loglinear's approximation), sg(lp) in REINFORCE without o.
      mismatch_done = (
        x.q is not None and cfg.proximal == "recompute" and (cfg.algorithm == "decoupled_ppo" or x.o is None)
      )
      result = _run_correction(
        train_lp, x.q, x.mask, segs, cfg, shape, batch_norm_factor, mismatch=mismatch_done, adv=x.adv
      )
      weights, kept, metrics = result.weights, result.kept, result.metrics
      mask_stats, kept_stats = result.mask_stats, result.kept_stats
  if x.q is not None and not mismatch_done:
    mismatch, mask_stats = mismatch_metrics(x.monitor, x.q, x.mask, segs, cfg.metric_mode)
    metrics = {**mismatch, **metrics}
  if mask_stats is None:
    mask_stats = segs.mask_stats(x.mask)
  if kept_stats is None:  # without correction m' = m; precomputed kept masks are counted here
    kept_stats = mask_stats if not cfg.use_tis else segs.mask_stats(kept)
  return Corrected(weights, kept, metrics, mask_stats, kept_stats)


def _policy_term(
  x: _LossInputs,
  corr: Corrected,
  arrays: dict,
  segs: Segments,
  cfg: LossConfig,
  key,
  topk_logprobs,
  rollout_topk_logprobs,
):
  """The form's per-token loss (:func:`token_loss`) on the step's selected tokens (a form with a
  ``select`` function), its ``lp`` carrying the centred score with ``score_centering`` (contract §6.6).
  Returns ``(pg, over_kept, over_mask)`` with the centring's metric rows among them."""
  selected = None
  if cfg.uses_cov_selection:
    if arrays.get("cov_selected") is not None:
      selected = _validation.flat_mask(arrays["cov_selected"], corr.kept)
    else:
      selected = cfg.form.select(_anchor(cfg, x.o, x.q), x.adv, corr.kept, segs, cfg.policy_loss, key)
  lp_pg, centring_rows = x.lp, ({}, {})
  if cfg.score_centering:  # the form reads lp with the centred score as its gradient
    coefficient = jnp.abs(x.adv) * (corr.weights if ALGORITHMS[cfg.algorithm].weighted else 1.0)
    lp_pg, centring_rows = _centering.centre(x.lp, topk_logprobs, rollout_topk_logprobs, x.mask, coefficient)
  pg_tok, over_kept, over_mask = token_loss(
    cfg, lp_pg, x.lp_sg, x.o, x.q, x.adv, corr.weights, corr.kept, segs, selected
  )
  return pg_tok, {**over_kept, **centring_rows[1]}, {**over_mask, **centring_rows[0]}


def _loss_terms(x: _LossInputs, kept, pg_tok, entropy, segs: Segments, cfg: LossConfig, dens: Denominators):
  """``loss = pg_loss - entropy_coef·entropy_loss + kl_coef·kl_loss + sq_kl_coef·sq_kl_loss``, the terms
  aggregated over ``m'`` with the step's denominators (one stacked reduction; the squared KL over its
  own tokens, contract §6.4). Returns ``(loss, {term: value})``."""
  terms = {"pg_loss": pg_tok}
  if entropy is not None:
    terms["entropy_loss"] = jnp.where(x.mask, _validation.flat_float(entropy), 0.0)
  if x.ref is not None:
    terms["kl_loss"] = jnp.where(x.mask, kl_penalty(x.lp, x.ref, cfg.kl_type), 0.0)
  agg = aggregate(list(terms.values()), kept, segs, cfg.loss_agg_mode, dens, loss_scale_factor=cfg.loss_scale_factor)
  values = dict(zip(terms, (agg[i] for i in range(len(terms)))))
  loss = values["pg_loss"]
  if entropy is not None:
    loss = loss - cfg.entropy_coef * values["entropy_loss"]
  if x.ref is not None:
    loss = loss + cfg.kl_coef * values["kl_loss"]
  if cfg.sq_kl_coef > 0:
    values["sq_kl_loss"] = sq_log_ratio_kl(x.lp, x.q, x.mask, kept, segs, cfg, dens)
    loss = loss + cfg.sq_kl_coef * values["sq_kl_loss"]
  return loss, values
