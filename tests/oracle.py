"""An independent NumPy oracle of contract §2–8: plain Python loops over a list of sequences.

Nothing here imports mis_jax. Every sequence is a dict of 1-D float64 arrays
(``o``, ``q``, ``m``, ``adv``, ``lp``, optional ``ref``, ``ent``). Configs are plain dicts.
"""

import math

import numpy as np

B = 20.0


def sexp(x):
  return np.exp(np.clip(x, -B, B))


def reduce(values, masks, mode):
  """R_mask of contract §8 over lists of per-sequence arrays: per token under the token modes,
  per sequence under the seq-mean ones."""
  if mode in ("token-mean", "token-sum"):
    num = sum(float(np.sum(np.where(m, x, 0.0))) for x, m in zip(values, masks))
    den = sum(float(np.sum(m)) for m in masks)
    return num / max(den, 1.0)
  means = [float(np.mean(x[m])) for x, m in zip(values, masks) if m.any()]
  return sum(means) / len(means) if means else 0.0


def level_log(r, m, level):
  if level == "token":
    return r.copy()
  s = float(np.sum(r[m]))
  if level == "sequence":
    return np.full_like(r, s)
  return np.full_like(r, s / max(int(m.sum()), 1))


def mismatch(seqs, mode):
  out = {}
  per = {
    k: []
    for k in [
      "mis_training_log_ppl",
      "mis_training_ppl",
      "mis_rollout_log_ppl",
      "mis_rollout_ppl",
      "mis_kl",
      "mis_k3_kl",
      "mis_log_ppl_diff",
      "mis_log_ppl_abs_diff",
      "mis_ppl_ratio",
      "mis_chi2_token",
      "mis_chi2_seq",
      "train_rollout_logprob_abs_diff",
    ]
  }
  masks = []
  for s in seqs:
    m = s["m"]
    masks.append(m)
    n = len(m)
    o = np.where(m, s["o"], 0.0)
    q = np.where(m, s["q"], 0.0)
    r = o - q
    mo = float(np.mean(o[m])) if m.any() else 0.0
    mq = float(np.mean(q[m])) if m.any() else 0.0
    full = lambda v: np.full(n, v)
    per["mis_training_log_ppl"].append(full(-mo))
    per["mis_training_ppl"].append(full(float(sexp(-mo))))  # contract §8.1: exp clips
    per["mis_rollout_log_ppl"].append(full(-mq))
    per["mis_rollout_ppl"].append(full(float(sexp(-mq))))
    per["mis_kl"].append(q - o)
    rc = np.clip(r, -B, B)
    per["mis_k3_kl"].append(np.exp(rc) - rc - 1)
    per["mis_log_ppl_diff"].append(full(mq - mo))
    per["mis_log_ppl_abs_diff"].append(full(abs(mq - mo)))
    per["mis_ppl_ratio"].append(full(float(sexp(mq - mo))))
    chi = float(np.mean(np.exp(rc[m]) ** 2)) - 1 if m.any() else -1.0
    per["mis_chi2_token"].append(full(chi))
    per["mis_chi2_seq"].append(full(math.exp(2 * float(np.clip(np.sum(r[m]), -B, B))) - 1))
    per["train_rollout_logprob_abs_diff"].append(np.abs(r))
  for k, v in per.items():
    out[k] = reduce(v, masks, mode)
  return out


def bernoulli_kl(p, q, eps=1e-6):
  """KL(Bernoulli(p) || Bernoulli(q)), both clamped to [eps, 1 - eps] (KPop, prime-rl PR #3283)."""
  p, q = min(max(p, eps), 1 - eps), min(max(q, eps), 1 - eps)
  return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def trust_region_keep(s, m, train_key, cfg):
  """contract §4.3, token by token: DPPO-Binary-TV (``dppo_tv_delta``, sign-conditioned on the
  advantage or symmetric) and KPop (``kpop_phi``) on p = exp(o), p_q = exp(q). Returns the keep
  mask and the per-token metric rows (to be averaged over m)."""
  n = len(m)
  keep = np.ones(n, bool)
  rows = {}
  delta, phi = cfg.get("dppo_tv_delta"), cfg.get("kpop_phi")
  if delta is not None:
    low = cfg.get("dppo_tv_delta_low")
    low = delta if low is None else low
    masked, high_row, low_row, absd = (np.zeros(n) for _ in range(4))
    for t in range(n):
      if not m[t]:
        continue
      d = math.exp(s[train_key][t]) - math.exp(s["q"][t])
      if cfg.get("dppo_tv_symmetric", False):
        out = abs(d) > delta
      elif s["adv"][t] > 0:
        out = d > delta
      else:
        out = d < -low
      masked[t], high_row[t], low_row[t], absd[t] = out, out and d > 0, out and d < 0, abs(d)
      keep[t] &= not out
    rows.update(
      mis_dppo_tv_masked_fraction=masked,
      mis_dppo_tv_masked_fraction_high=high_row,
      mis_dppo_tv_masked_fraction_low=low_row,
      mis_dppo_tv_prob_abs_diff=absd,
    )
  if phi is not None:
    masked, value = np.zeros(n), np.zeros(n)
    for t in range(n):
      if not m[t]:
        continue
      p, pq = math.exp(s[train_key][t]), math.exp(s["q"][t])
      value[t] = max(bernoulli_kl(p, pq), bernoulli_kl(pq, p))
      masked[t] = value[t] > phi
      keep[t] &= not masked[t]
    rows.update(mis_kpop_masked_fraction=masked, mis_kpop_binary_kl=value)
  return keep, rows


def mis(seqs, cfg, mode, train_key="o"):
  """The mis correction. Returns (weights list, kept list, metrics) with the §8.2 metrics."""
  U = cfg.get("tis_upper_bound", 2.0)
  Lo = cfg.get("tis_lower_bound")
  Lo = 1.0 / U if Lo is None else Lo
  level = cfg.get("tis_level", "token")
  rs_level = cfg.get("rs_level") or level
  rs_lo = cfg.get("rs_lower_bound")
  rs_lo = Lo if rs_lo is None else rs_lo
  rs_hi = cfg.get("rs_upper_bound")
  rs_hi = U if rs_hi is None else rs_hi
  tis_mode = cfg.get("tis_mode", "truncate")
  veto = cfg.get("rs_veto_threshold")
  metrics = {}
  masks = [s["m"] for s in seqs]
  W, K, RAW, RS, CAT, KEEP_IS = [], [], [], [], [], []
  vetoed_seqs = 0
  live_seqs = 0
  CRIT = {}
  TR = {}
  for s in seqs:
    m = s["m"]
    r = np.where(m, s[train_key] - s["q"], 0.0)
    w_raw = sexp(level_log(r, m, level))
    keep_is = np.ones(len(m), bool)
    if tis_mode == "truncate":
      w = np.minimum(w_raw, U)
    elif tis_mode == "clip":
      w = np.clip(w_raw, Lo, U)
    elif tis_mode == "mask":
      w = w_raw.copy()
      keep_is = (w_raw >= Lo) & (w_raw <= U)
    else:
      w = np.ones_like(w_raw)
    keep_rs = np.ones(len(m), bool)
    if cfg.get("use_rs", False):
      w_rs = sexp(level_log(r, m, rs_level))
      RS.append(w_rs)
      keep_rs = (w_rs >= rs_lo) & (w_rs <= rs_hi)
    for c in cfg.get("rs_criteria", []):
      rr = np.where(m, r, 0.0)
      d = {"k1": -rr, "k2": rr * rr / 2, "k3": np.exp(np.clip(rr, -B, B)) - 1 - np.clip(rr, -B, B)}[c["metric"]]
      d = np.where(m, d, 0.0)
      if c["agg"] == "token":
        v = d
      elif not m.any():
        v = np.zeros(len(m))
      elif c["agg"] == "seq_sum":
        v = np.full(len(m), d[m].sum())
      elif c["agg"] == "seq_mean":
        v = np.full(len(m), d[m].mean())
      else:
        v = np.full(len(m), d[m].max())
      if c["metric"] == "k1":
        v = -v
      keep = np.ones(len(m), bool)
      if c.get("lower") is not None:
        keep &= v >= c["lower"]
      if c.get("upper") is not None:
        keep &= v <= c["upper"]
      keep_rs = keep_rs & keep
      CRIT.setdefault(c["metric"] + "_" + c["agg"], []).append((v, keep))
    if cfg.get("dppo_tv_delta") is not None or cfg.get("kpop_phi") is not None:
      keep_tr, TR_SEQ = trust_region_keep(s, m, train_key, cfg)
      keep_rs = keep_rs & keep_tr
      for name, x in TR_SEQ.items():
        TR.setdefault(name, []).append(x)
    vet = False
    if veto is not None:
      cat = m & (r < math.log(veto))
      CAT.append(cat)
      vet = bool(cat.any())
    if m.any():
      live_seqs += 1
      vetoed_seqs += int(vet)
    kept = m & keep_is & keep_rs & (not vet)
    W.append(np.where(m, w, 0.0))
    K.append(kept)
    RAW.append(w_raw)
    KEEP_IS.append(keep_is)
  metrics["mis_tis_weight_before_bound"] = reduce(RAW, masks, mode)
  pred = lambda f, vals: reduce([f(v).astype(float) for v in vals], masks, mode)
  if tis_mode == "truncate":
    metrics["mis_tis_truncate_fraction"] = pred(lambda v: v > U, RAW)
  elif tis_mode in ("clip", "mask"):
    metrics[f"mis_tis_{tis_mode}_fraction_low"] = pred(lambda v: v < Lo, RAW)
    metrics[f"mis_tis_{tis_mode}_fraction_high"] = pred(lambda v: v > U, RAW)
  metrics["mis_tis_weight_after_bound"] = reduce(W, [m & k for m, k in zip(masks, KEEP_IS)], mode)
  if cfg.get("use_rs", False):
    metrics["mis_rs_mask_fraction_low"] = pred(lambda v: v < rs_lo, RS)
    metrics["mis_rs_mask_fraction_high"] = pred(lambda v: v > rs_hi, RS)
  for name, vals in CRIT.items():
    metrics[f"mis_rs_{name}_masked_fraction"] = reduce([(~k).astype(float) for _, k in vals], masks, mode)
    metrics[f"mis_rs_{name}_mean"] = reduce([v for v, _ in vals], masks, mode)
    live = [v[m] for (v, _), m in zip(vals, masks) if m.any()]
    metrics[f"mis_rs_{name}_max"] = float(np.concatenate(live).max()) if live else 0.0
  metrics.update({name: reduce(vals, masks, mode) for name, vals in TR.items()})
  if veto is not None:
    metrics["mis_rs_catastrophic_token_fraction"] = pred(lambda v: v, CAT)
    metrics["mis_rs_catastrophic_seq_fraction"] = vetoed_seqs / max(live_seqs, 1)
  metrics["mis_is_ratio_mean_after_tis_rs"] = reduce(W, K, mode)
  factor = 1.0
  if cfg.get("tis_batch_normalize", False):
    if level == "token":
      num = sum(float(np.sum(w[k])) for w, k in zip(W, K))
      den = sum(float(np.sum(k)) for k in K)
      mu = num / max(den, 1.0)
    else:
      seq_w = [float(w[k][0]) for w, k in zip(W, K) if k.any()]
      mu = sum(seq_w) / len(seq_w) if seq_w else 0.0
    if mu > 1e-8:
      factor = mu
  W = [w / factor for w in W]
  metrics["mis_batch_norm_factor"] = factor
  metrics["mis_is_ratio_mean_final"] = reduce(W, K, mode)
  kept_vals = np.concatenate([w[k] for w, k in zip(W, K)] + [np.zeros(0)])
  metrics["mis_is_ratio_min_final"] = float(kept_vals.min()) if kept_vals.size else 0.0
  metrics["mis_is_ratio_max_final"] = float(kept_vals.max()) if kept_vals.size else 0.0
  n_kept = float(kept_vals.size)
  metrics["mis_ess_ratio"] = float(kept_vals.sum()) ** 2 / (n_kept * float(np.sum(kept_vals**2))) if n_kept else 0.0
  metrics["mis_kept_token_fraction"] = n_kept / max(sum(float(m.sum()) for m in masks), 1.0)
  metrics["mis_kept_seq_fraction"] = sum(int(k.any()) for k in K) / max(live_seqs, 1)
  metrics["mis_masked_whole_batch"] = 1.0 if n_kept == 0 else 0.0
  return W, K, {**metrics, **nonfinite(seqs)}


def nonfinite(seqs):
  """contract §8.4's counts: trained tokens whose rollout log-prob is NaN or ±inf (the oracle's
  batches have finite ones; tests/mis_jax/test_nonfinite_rollout.py covers the rest)."""
  bad = sum(int(np.sum(s["m"] & ~np.isfinite(s["q"]))) for s in seqs)
  trained = sum(int(np.sum(s["m"])) for s in seqs)
  return {
    "mis_nonfinite_rollout_logprob_count": float(bad),
    "mis_nonfinite_rollout_logprob_fraction": bad / max(trained, 1),
  }


def vanilla(seqs, clip_hi, clip_lo, mode, train_key="o"):
  W, ratios, masks = [], [], []
  for s in seqs:
    m = s["m"]
    ratio = sexp(np.where(m, s[train_key] - s["q"], 0.0))
    W.append(np.where(m, np.clip(ratio, clip_lo, clip_hi), 0.0))
    ratios.append(ratio)
    masks.append(m)
  metrics = {
    "tis": reduce(ratios, masks, mode),
    "tis_clipfrac": reduce([(np.clip(x, clip_lo, clip_hi) != x).astype(float) for x in ratios], masks, mode),
    "tis_abs": reduce([np.abs(x - 1) for x in ratios], masks, mode),
  }
  return W, [m.copy() for m in masks], {**metrics, **nonfinite(seqs)}


def kl_term(lp, ref, kl_type):
  d = lp - ref
  if kl_type == "k1":
    return d
  if kl_type == "k2":
    return d * d / 2
  if kl_type == "k3":
    return np.exp(np.clip(-d, -B, B)) + d - 1
  dc = np.clip(d, -B, B)
  return np.clip(np.exp(-dc) + dc - 1, -10, 10)


def aggregate(vals, kept, dmasks, mode, scale_factor=None):
  """contract §7 aggregation with D given per sequence."""
  if mode == "token-mean":
    return sum(float(np.sum(v[k])) for v, k in zip(vals, kept)) / max(sum(float(d.sum()) for d in dmasks), 1.0)
  if mode == "token-sum":
    return sum(float(np.sum(v[k])) for v, k in zip(vals, kept))
  total, n = 0.0, 0
  for v, k, d in zip(vals, kept, dmasks):
    if d.sum() == 0:
      continue
    n += 1
    s = float(np.sum(v[k]))
    total += s / max(float(d.sum()), 1.0) if mode == "seq-mean-token-mean" else s
  total /= max(n, 1)
  return total / scale_factor if mode == "seq-mean-token-sum-norm" else total


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def form_loss(form, s, a, A, k, w, sel, lc):
  """One sequence's per-token loss of a verl policy-loss form (contract §6.2), written from the
  papers' formulas: ``lp`` carries the gradient, ``lp_sg`` is its stop-gradient value, ``a`` the
  anchor, ``k`` the kept mask, ``w`` the IS weights (None: unweighted). Returns
  ``(loss, {metric row: per-token values})``."""
  lp, lp_sg = np.where(k, s["lp"], 0.0), np.where(k, s["lp_sg"], 0.0)
  lo = lc.get("eps_clip", 0.2)
  hi = lc.get("eps_clip_high") or lo
  c = lc.get("eps_clip_c")
  rows = {}
  if form == "vanilla":
    ratio = sexp(lp - a)
    l1, l2 = -A * ratio, -A * np.clip(ratio, 1 - lo, 1 + hi)
    loss = np.maximum(l1, l2)
    rows["pg_clipfrac"] = (l2 > l1).astype(float)
    if c is not None:
      loss = np.where(A < 0, np.minimum(loss, -c * A), loss)
  elif form in ("dppo_tv", "dppo_kl"):
    c = 20.0 if c is None else c
    ratio = sexp(lp_sg - a)
    p, pa = np.exp(lp_sg), np.exp(a)
    if form == "dppo_tv":
      ok = np.where(A > 0, p - pa <= hi, p - pa >= -lo)
    else:
      bkl = pa * np.log(pa / p) + (1 - pa) * np.log((1 - pa + 1e-8) / (1 - p + 1e-8))
      ok = np.where(A > 0, (bkl <= hi) | (p <= pa), (bkl <= lo) | (p >= pa))
    loss = np.where(ok, -A * np.minimum(ratio, c) * lp, 0.0)
    rows["pg_clipfrac"] = (~ok).astype(float)
    rows["pg_clipfrac_lower"] = (ok & (ratio > c)).astype(float)
  elif form == "gspo":
    n = max(k.sum(), 1)
    log_s = np.sum((lp_sg - a)[k]) / n + lp - lp_sg
    ratio = np.exp(np.clip(log_s, -B, 10.0))
    l1, l2 = -A * ratio, -A * np.clip(ratio, 1 - lo, 1 + hi)
    loss = np.maximum(l1, l2)
    rows["pg_clipfrac"] = (l2 > l1).astype(float)
  elif form == "sapo":
    tau = np.where(A > 0, lc.get("tau_pos", 1.0), lc.get("tau_neg", 1.05))
    loss = -A * _sigmoid(tau * (sexp(lp - a) - 1)) * 4 / tau
  elif form == "gpg":
    loss = -A * lp
  elif form == "clip_cov":
    ratio = sexp(lp - a)
    loss = np.where(sel, 0.0, np.maximum(-A * ratio, -A * np.clip(ratio, 1 - lo, 1 + hi)))
    rows["pg_clipfrac"] = sel.astype(float)
    rows["cov_selected_fraction"] = sel.astype(float)
  elif form == "kl_cov":
    loss = -A * sexp(lp - a) + np.where(sel, lc.get("ppo_kl_coef", 0.1) * np.abs(lp - a), 0.0)
    rows["cov_selected_fraction"] = sel.astype(float)
    rows["ppo_kl_abs"] = np.abs(lp_sg - a)
  elif form == "geo_mean":
    n = max(k.sum(), 1)
    d = lp - a
    sgn = np.sign(A)
    dmin = sgn * np.minimum(sgn * d, sgn * np.clip(d, -lo, hi))
    seq = -(np.sum(A[k]) / n) * sexp(np.sum(dmin[k]) / n)
    if w is not None:
      seq *= sexp(np.sum(np.log(w[k] + 1e-10)) / n)
    loss = np.full(len(lp), seq)
    clipped = d != np.clip(d, -lo, hi)
    rows["pg_clipfrac"] = (clipped & (A > 0)).astype(float)
    rows["pg_clipfrac_lower"] = (clipped & (A < 0)).astype(float)
    w = None
  elif form == "dro":
    loss = -(A * lp - 0.5 * lc["dro_beta"] * (lp - a) ** 2)
  elif form == "cispo":
    ratio = sexp(lp_sg - a)
    clipped = np.clip(ratio, 1 - lo, 1 + hi)
    loss = -clipped * A * lp
    rows["pg_clipfrac"] = (clipped != ratio).astype(float)
  else:
    raise ValueError(form)
  rows.setdefault("pg_clipfrac", np.zeros(len(lp)))
  return (loss if w is None else w * loss), rows


def cov_selection(seqs, anchors, K, lc):
  """kl_cov's tokens: the max(floor(ratio·n), 1) kept tokens of the step with the largest
  (A - mean A)(a - mean a), means over the kept tokens."""
  flat = [(i, t) for i, k in enumerate(K) for t in np.flatnonzero(k)]
  A = np.array([seqs[i]["adv"][t] for i, t in flat])
  a = np.array([anchors[i][t] for i, t in flat])
  cov = (A - A.mean()) * (a - a.mean())
  n = max(int(np.floor(lc.get("kl_cov_ratio", 0.0002) * len(flat))), 1)
  sel = [np.zeros(len(k), bool) for k in K]
  for j in np.argsort(-cov, kind="stable")[:n]:
    sel[flat[j][0]][flat[j][1]] = True
  return sel


def flat_loss_keys(lc):
  """A dict loss config with the form's own keys beside ``policy_loss`` (its name): ``LossConfig.to_dict``
  writes the form as ``{name, <its keys>}``."""
  form = lc.get("policy_loss", "vanilla")
  if not isinstance(form, dict):
    return lc
  return {**lc, **{k: v for k, v in form.items() if k != "name"}, "policy_loss": form["name"]}


def policy_loss(seqs, lc):
  """Loss and metrics of contract §6–8 for a dict loss config ``lc`` (flat keys, or the form nested as
  ``LossConfig.to_dict`` writes it). clip_cov's random selection comes in as ``lc["cov_selected"]`` (a
  list of per-sequence bool arrays)."""
  lc = flat_loss_keys(lc)
  agg_mode = lc.get("loss_agg_mode", "seq-mean-token-mean")
  mode = "token-mean" if agg_mode in ("token-mean", "token-sum") else "seq-mean-token-mean"
  form = lc.get("policy_loss", "vanilla")
  use_tis, use_roll = lc.get("use_tis", False), lc.get("use_rollout_logprobs", False)
  metrics = {}
  masks = [s["m"] for s in seqs]
  seqs = [dict(s, lp_sg=s.get("lp_sg", s["lp"])) for s in seqs]
  trainer_lp = [s["o"] if "o" in s else s["lp"] for s in seqs]  # what mismatch monitoring reads
  if lc.get("proximal") == "loglinear":  # AReaL's approximate proximal policy, token by token
    seqs = [
      dict(s, o=np.array([qt + st / (st + 1.0) * (lt - qt) for qt, st, lt in zip(s["q"], s["stale"], s["lp_sg"])]))
      for s in seqs
    ]
  W = [np.ones(len(s["m"])) for s in seqs]
  K = [m.copy() for m in masks]
  algo = {(False, False): "ppo", (True, False): "bypass", (False, True): "decoupled", (True, True): "reinforce"}[
    (use_roll, use_tis)
  ]
  if use_tis:
    train_key = "o" if algo == "decoupled" else "lp_sg"
    if lc.get("mis") is not None:
      W, K, m2 = mis(seqs, lc["mis"], mode, train_key)
    else:
      W, K, m2 = vanilla(seqs, lc.get("tis_clip", 2.0), lc.get("tis_clip_low", 0.0), mode, train_key)
    metrics.update(m2)
  if "q" in seqs[0]:
    metrics.update(mismatch([dict(s, o=o) for s, o in zip(seqs, trainer_lp)], mode))
  pg, clip, anch, rows = [], [], [], {}
  anchors = [np.where(m, s["q"] if algo in ("bypass", "reinforce") else s["o"], 0.0) for s, m in zip(seqs, masks)]
  if form == "clip_cov":
    selected = lc["cov_selected"]
  elif form == "kl_cov":
    selected = cov_selection(seqs, anchors, K, lc)
  else:
    selected = [None] * len(seqs)
  for s, w, m, k, anchor, sel in zip(seqs, W, masks, K, anchors, selected):
    lp = np.where(m, s["lp"], 0.0)
    A = np.where(m, s["adv"], 0.0)
    if algo == "reinforce":
      pg.append(-w * A * lp)
      clip.append(np.zeros(len(m)))
    else:
      loss_k, r = form_loss(form, s, anchor, A, k, w if algo == "decoupled" else None, sel, lc)
      pg.append(loss_k)
      clip.append(r.pop("pg_clipfrac"))
      for name, x in r.items():
        rows.setdefault(name, []).append(x)
    anch.append(anchor - np.where(m, s["lp_sg"], 0.0))
  if algo == "decoupled":
    metrics["ois"] = reduce([sexp(np.where(m, s["lp"] - s["o"], 0.0)) for s, m in zip(seqs, masks)], masks, mode)
  dmasks = K if lc.get("denominator", "kept") == "kept" else masks
  agg = lambda vals: aggregate(vals, K, dmasks, agg_mode, lc.get("loss_scale_factor"))
  pg_loss = agg(pg)
  loss = pg_loss
  if "ent" in seqs[0]:
    ent_loss = agg([np.where(m, s["ent"], 0.0) for s, m in zip(seqs, masks)])
    loss -= lc.get("entropy_coef", 0.0) * ent_loss
    metrics["entropy_loss"] = ent_loss
  if "ref" in seqs[0]:
    kl = [
      np.where(m, kl_term(np.where(m, s["lp"], 0.0), np.where(m, s["ref"], 0.0), lc.get("kl_type", "k3")), 0.0)
      for s, m in zip(seqs, masks)
    ]
    kl_loss = agg(kl)
    loss += lc.get("kl_coef", 0.0) * kl_loss
    metrics["kl_loss"] = kl_loss
  if lc.get("sq_kl_coef", 0.0) > 0:  # contract §6.4: τ·(lp - q)² over m or m'
    over = masks if lc.get("sq_kl_tokens", "trainable") == "trainable" else K
    sq = [np.where(m, (np.where(m, s["lp"], 0.0) - np.where(m, s["q"], 0.0)) ** 2, 0.0) for s, m in zip(seqs, masks)]
    sq_loss = aggregate(sq, over, dmasks, agg_mode, lc.get("loss_scale_factor"))
    loss += lc["sq_kl_coef"] * sq_loss
    metrics["sq_kl_loss"] = sq_loss
  metrics.update(loss=loss, pg_loss=pg_loss, pg_clipfrac=reduce(clip, K, mode), ppo_kl=reduce(anch, K, mode))
  metrics.update({name: reduce(x, K, mode) for name, x in rows.items()})
  if "q" in seqs[0]:
    metrics.update(nonfinite(seqs))
  return loss, metrics, W, K


# --- contract §6.6: score centering ------------------------------------------------------------

P_TAIL_MIN = 1e-6


def log_softmax(z):
  z = z - z.max(axis=-1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def sampler_estimate(z, ids, q_topk):
  """One token: the trainer's logits ``z [V]``, the sampler's top-k ``ids [k]`` and their log-probs
  ``q_topk [k]`` → ``(q̂ [V], ‖q̂ - p‖₁, q_tail)``: q on the top-k, the tail mass spread in proportion
  to p over the rest (over everything where the trainer's tail is below P_TAIL_MIN)."""
  p = np.exp(log_softmax(z))
  q_k = np.where(np.isfinite(q_topk), np.exp(np.clip(np.nan_to_num(q_topk), -B, 0.0)), 0.0)
  q_tail = max(1.0 - q_k.sum(), 0.0)
  in_k = np.zeros(len(p), bool)
  in_k[ids] = True
  p_tail = max(1.0 - p[ids].sum(), 0.0)
  if p_tail >= P_TAIL_MIN:
    q_hat = np.where(in_k, 0.0, q_tail * p / p_tail)
  else:  # the tail term carries no gradient: E_p[∇log p] = 0, so q_tail is spread over all of p
    q_hat = q_tail * p
  np.add.at(q_hat, ids, q_k)
  drift = sum(abs(a - b) for a, b in zip(q_k, p[ids])) + abs(q_tail - p_tail)
  return q_hat, drift, q_tail


def token_scales(K, dmasks, mode, scale_factor=None):
  """Per sequence, each kept token's factor in the contract §7 aggregate (``∂ loss / ∂ ℓ_t``)."""
  if mode == "token-mean":
    den = max(sum(float(d.sum()) for d in dmasks), 1.0)
    return [k / den for k in K]
  if mode == "token-sum":
    return [k.astype(float) for k in K]
  n = max(sum(1 for d in dmasks if d.sum() > 0), 1)
  out = []
  for k, d in zip(K, dmasks):
    per = 1.0 / n if d.sum() > 0 else 0.0
    if mode == "seq-mean-token-mean":
      per /= max(float(d.sum()), 1.0)
    elif mode == "seq-mean-token-sum-norm":
      per /= scale_factor
    out.append(k * per)
  return out


def pg_lp_coefficients(seqs, lc, W, K):
  """``∂ pg_loss / ∂ lp_t`` per sequence for REINFORCE + IS (``-w A``) and the vanilla form
  (``-A ρ`` where the unclipped branch counts, times decoupled PPO's weights), aggregated."""
  lc = flat_loss_keys(lc)
  use_tis, use_roll = lc.get("use_tis", False), lc.get("use_rollout_logprobs", False)
  lo = lc.get("eps_clip", 0.2)
  hi = lc.get("eps_clip_high") or lo
  mode = lc.get("loss_agg_mode", "seq-mean-token-mean")
  dmasks = K if lc.get("denominator", "kept") == "kept" else [s["m"] for s in seqs]
  scales = token_scales(K, dmasks, mode, lc.get("loss_scale_factor"))
  out = []
  for s, w, k, scale in zip(seqs, W, K, scales):
    A = np.where(s["m"], s["adv"], 0.0)
    if use_roll and use_tis:
      g = -w * A
    else:
      a = s["q"] if use_roll else s["o"]
      ratio = sexp(np.where(s["m"], s["lp"] - a, 0.0))
      counts = ((ratio >= 1 - lo) & (ratio <= 1 + hi)) | (-A * ratio > -A * np.clip(ratio, 1 - lo, 1 + hi))
      g = np.where(counts, -A * ratio, 0.0) * (w if use_tis else 1.0)
    out.append(np.where(k, g * scale, 0.0))
  return out


def centring_metrics(seqs, lc, W, K, mode):
  """The contract §6.6 metrics: TV and tail mass over m; drift and residual bound over m'."""
  use_w = lc.get("use_tis", False)
  masks = [s["m"] for s in seqs]
  tv, tail, drift, resid = [], [], [], []
  for s, w, m in zip(seqs, W, masks):
    est = [sampler_estimate(s["z"][t], s["ids"][t], s["qk"][t]) if m[t] else (None, 0.0, 0.0) for t in range(len(m))]
    d = np.array([e[1] for e in est])
    qt = np.array([e[2] for e in est])
    c = np.abs(np.where(m, s["adv"], 0.0)) * (w if use_w else 1.0)
    tv.append(0.5 * d)
    tail.append(qt)
    drift.append(c * d)
    resid.append(c * 2 * qt)
  return {
    "score_centering_tv": reduce(tv, masks, mode),
    "score_centering_tail_mass": reduce(tail, masks, mode),
    "score_centering_drift": reduce(drift, K, mode),
    "score_centering_residual_bound": reduce(resid, K, mode),
  }


def centred_logit_grads(seqs, coefficients):
  """``∂ loss / ∂ z_t = g_t (e_{y_t} - q̂_t)`` per token: the centred score on the logits (its
  uncentred twin is ``g_t (e_y - p_t)``)."""
  out = []
  for s, g in zip(seqs, coefficients):
    grads = np.zeros_like(s["z"])
    for t in range(len(g)):
      if g[t] != 0.0:
        q_hat, _, _ = sampler_estimate(s["z"][t], s["ids"][t], s["qk"][t])
        e = np.zeros(len(q_hat))
        e[int(s["y"][t])] = 1.0
        grads[t] = g[t] * (e - q_hat)
    out.append(grads)
  return out
