"""`make bench`: the loss path side by side, in one run, on this machine.

Compares, on the same data:
  - ours: jitted ``compute_mis_weights`` (weights + metrics pass) and ``policy_loss``
    forward+backward (decoupled PPO with the reference ``configs/mis.yaml``) over packed rows;
  - ours, padded layout (one sequence per row, padded to the longest);
  - a per-sequence reference in PyTorch eager that loops over a list of tensors the way
    list-of-tensors implementations (miles' ``mis.py``) do — the same weights, masks and
    metrics — forward+backward;
  - the roofline (`benchmarks.roofline`, measured first in the same run): both passes are
    memory-bound, so each is reported as the bytes it must move (its inputs read once, its
    outputs written once) per second, as a fraction of this machine's measured bandwidth.
Times are the best of several runs (this 2-core VM is noisy; every path is timed the same
way). Reports tokens/s, ratios and compiled peak (temp) memory; prints a table, writes JSON.

    python -m benchmarks.run [--quick] [--json benchmarks/results/loss_path.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time

import jax
import numpy as np

import mis_jax
from benchmarks import roofline

MIS = mis_jax.MISConfig(
  use_tis=True, use_rs=True, tis_lower_bound=0.5, tis_upper_bound=2.0, rs_veto_threshold=1e-4, tis_batch_normalize=True
)  # = configs/mis.yaml
LOSS_CFG = mis_jax.LossConfig(use_tis=True, mis=MIS)


def make_data(rng, num_seqs, max_len, row_len):
  lengths = rng.integers(max(1, max_len // 8), max_len + 1, num_seqs)
  seqs = []
  for n in lengths:
    q = -np.abs(rng.normal(0.5, 0.7, n)).astype(np.float32)
    r = rng.normal(0, 0.1, n).astype(np.float32)
    r[rng.random(n) < 1e-4] = -12.0
    o = q + r
    seqs.append(
      dict(
        m=np.arange(n) >= min(4, n - 1),
        q=q,
        o=o,
        lp=o + rng.normal(0, 0.05, n).astype(np.float32),
        adv=np.full(n, rng.normal(), np.float32),
      )
    )
  packing = mis_jax.plan_packing(lengths, row_len)
  return seqs, packing


def to_batch(seqs, packing):
  get = lambda k: packing.pack([s[k] for s in seqs], 0.0, np.float32)
  batch = mis_jax.PackedBatch(
    segment_ids=packing.segment_ids,
    loss_mask=packing.pack([s["m"] for s in seqs], False, bool),
    advantages=get("adv"),
    rollout_logprobs=get("q"),
    old_logprobs=get("o"),
    num_segments=len(seqs),
  )
  return jax.device_put(batch), jax.device_put(get("lp"))


def padded_packing(seqs):
  n = len(seqs)
  lengths = np.array([len(s["m"]) for s in seqs])
  return mis_jax.Packing(
    row_len=int(lengths.max()), num_rows=n, rows=np.arange(n), offsets=np.zeros(n, np.int64), lengths=lengths
  )


def timeit(fn, *args, repeats=15):
  """Best-of-``repeats`` wall time after a compile/warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return min(times)


def temp_bytes(fn, *args):
  analysis = fn.lower(*args).compile().memory_analysis()
  return int(getattr(analysis, "temp_size_in_bytes", 0)) if analysis is not None else -1


_weights = jax.jit(
  lambda b: mis_jax.compute_mis_weights(
    b.old_logprobs, b.rollout_logprobs, b.loss_mask, b.segment_ids, MIS, num_segments=b.num_segments
  )
)
_loss_grad = jax.jit(jax.value_and_grad(lambda lp, b: mis_jax.policy_loss(lp, b, LOSS_CFG), has_aux=True))


def moved_bytes(outputs, *inputs) -> int:
  """The least traffic of a program: every input byte read once, every output byte written once."""
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves((inputs, outputs)))


def torch_reference(seqs, repeats=1):
  """Per-sequence PyTorch eager loop over a list of tensors, the way list-of-tensors
  implementations (miles' ``mis.py``) do it: per sequence, the mismatch metrics, the reference
  config's weights, RS mask, veto and their metrics; batch normalisation; per-sequence PPO
  loss; ``sum_of_sample_mean`` reductions; backward."""
  import torch

  torch.set_num_threads(os.cpu_count() or 1)
  tensors = [{k: torch.from_numpy(np.asarray(v)) for k, v in s.items()} for s in seqs]
  U, Lo, C, B = 2.0, 0.5, 1e-4, 20.0

  def mmean(x, m):
    return (x * m).sum() / torch.clamp(m.sum(), min=1)

  def step():
    lps = [t["lp"].clone().requires_grad_(True) for t in tensors]
    metrics: dict[str, list] = {}
    add = lambda k, v: metrics.setdefault(k, []).append(v.detach())
    weights, masks = [], []
    for t in tensors:
      m = t["m"].float()
      o, q = t["o"], t["q"]
      r = (o - q) * m
      mo, mq = mmean(o, m), mmean(q, m)
      add("training_log_ppl", -mo)
      add("training_ppl", torch.exp(-mo))
      add("rollout_log_ppl", -mq)
      add("rollout_ppl", torch.exp(-mq))
      add("kl", mmean(q - o, m))
      rc = torch.clamp(r, -B, B)
      add("k3_kl", mmean(torch.exp(rc) - rc - 1, m))
      add("log_ppl_diff", mq - mo)
      add("log_ppl_abs_diff", (mq - mo).abs())
      add("ppl_ratio", torch.exp(mq - mo))
      add("chi2_token", mmean(torch.exp(rc) ** 2, m) - 1)
      add("chi2_seq", torch.exp(2 * torch.clamp(r.sum(), -B, B)) - 1)
      add("abs_diff", mmean((o - q).abs(), m))
      w_raw = torch.exp(rc)
      add("tis_weight_before_bound", mmean(w_raw, m))
      add("tis_truncate_fraction", mmean((w_raw > U).float(), m))
      w = torch.clamp(w_raw, 0, U) * m
      add("tis_weight_after_bound", mmean(w, m))
      keep = ((w_raw >= Lo) & (w_raw <= U)).float() * m
      add("rs_mask_fraction_low", mmean((w_raw < Lo).float(), m))
      add("rs_mask_fraction_high", mmean((w_raw > U).float(), m))
      cat = (r < np.log(C)) & t["m"]
      add("rs_catastrophic_token_fraction", mmean(cat.float(), m))
      add("rs_catastrophic_seq_fraction", cat.any().float())
      kept = keep * (0.0 if bool(cat.any()) else 1.0)
      add("is_ratio_mean_after_tis_rs", mmean(w, kept))
      masks.append(kept)
      weights.append(w)
    num = sum((w * km).sum() for w, km in zip(weights, masks))
    mu = num / torch.clamp(sum(km.sum() for km in masks), min=1)
    total, n = 0.0, 0
    for t, lp, w, km in zip(tensors, lps, weights, masks):
      w = w / mu
      add("is_ratio_mean_final", mmean(w, km))
      if km.sum() > 0:
        add("is_ratio_min_final", w[km.bool()].min())
        add("is_ratio_max_final", w[km.bool()].max())
      ratio = torch.exp(torch.clamp(lp - t["o"], -B, B))
      pg1, pg2 = -t["adv"] * ratio, -t["adv"] * torch.clamp(ratio, 0.8, 1.2)
      pg = torch.maximum(pg1, pg2) * w
      add("pg_clipfrac", mmean((pg2 > pg1).float(), km))
      add("ppo_kl", mmean(t["o"] - lp, km))
      if km.sum() > 0:
        total = total + (pg * km).sum() / km.sum()
        n += 1
    loss = total / max(n, 1)
    loss.backward()
    reduced = {k: torch.stack(v).mean().item() for k, v in metrics.items()}
    return float(loss.detach()), reduced

  step()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
  return min(times)


def bench_shape(rng, num_seqs, max_len, row_len, limits, *, reference=True, padded=True):
  seqs, packing = make_data(rng, num_seqs, max_len, row_len)
  batch, lp = to_batch(seqs, packing)
  tokens = int(sum(len(s["m"]) for s in seqs))
  row = {
    "num_seqs": num_seqs,
    "max_len": max_len,
    "tokens": tokens,
    "packed_shape": list(batch.shape),
    "pass_options": dataclasses.asdict(mis_jax.engine.pass_options(batch.segment_ids, batch.num_segments)),
  }
  row["weights_s"] = timeit(_weights, batch)
  row["loss_fwd_bwd_s"] = timeit(_loss_grad, lp, batch)
  weights_in = (batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, batch.segment_ids)
  row["weights_bytes"] = moved_bytes(_weights(batch), *weights_in)
  row["loss_bytes"] = moved_bytes(_loss_grad(lp, batch), lp, *weights_in, batch.advantages)
  row["weights_GBps"] = row["weights_bytes"] / row["weights_s"] / 1e9
  row["loss_GBps"] = row["loss_bytes"] / row["loss_fwd_bwd_s"] / 1e9
  row["weights_roofline_fraction"] = row["weights_GBps"] * 1e9 / limits.bandwidth
  row["loss_roofline_fraction"] = row["loss_GBps"] * 1e9 / limits.bandwidth
  row["tokens_per_s"] = tokens / row["loss_fwd_bwd_s"]
  row["loss_temp_MB"] = temp_bytes(_loss_grad, lp, batch) / 1e6
  if padded:
    pbatch, plp = to_batch(seqs, padded_packing(seqs))
    row["padded_shape"] = list(pbatch.shape)
    row["padded_loss_fwd_bwd_s"] = timeit(_loss_grad, plp, pbatch)
    row["padded_loss_temp_MB"] = temp_bytes(_loss_grad, plp, pbatch) / 1e6
    row["padded_over_packed"] = row["padded_loss_fwd_bwd_s"] / row["loss_fwd_bwd_s"]
  if reference:
    row["reference_s"] = torch_reference(seqs, repeats=3)
    row["speedup_vs_reference"] = row["reference_s"] / row["loss_fwd_bwd_s"]
  return row


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="small shapes, a minute or so")
  parser.add_argument("--json", default="benchmarks/results/loss_path.json")
  parser.add_argument("--skip-logprobs", action="store_true")
  args = parser.parse_args(argv)
  rng = np.random.default_rng(0)
  scale = 8 if args.quick else 1
  limits = roofline.measure()
  out = {
    "machine": {
      "platform": platform.platform(),
      "cpus": os.cpu_count(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": jax.device_count(),
      "pass_options": "mis_jax.engine.pass_options(segment_ids, num_segments) per shape",
      "roofline": limits.to_dict(),
    }
  }

  out["named_shapes"] = [
    bench_shape(rng, 512 // scale, 1024, 4096, limits),
    bench_shape(rng, 4096 // scale, 256, 4096, limits),
  ]
  sweep = []
  for total in [2**16, 2**18] if args.quick else [2**16, 2**18, 2**20, 2**22]:
    sweep.append(bench_shape(rng, max(total // 512, 1), 1024, 4096, limits, reference=False, padded=False))
  out["token_sweep"] = sweep
  seg_sweep = []
  fixed = 2**16 if args.quick else 2**20
  for max_len in (2048, 512, 128, 32):
    seg_sweep.append(
      bench_shape(rng, int(fixed / (max_len * 9 / 16)), max_len, 4096, limits, reference=False, padded=False)
    )
  out["segment_sweep"] = seg_sweep
  if not args.skip_logprobs:
    try:
      from benchmarks import logprobs

      out["logprobs"] = logprobs.run(quick=args.quick)
    except ImportError as e:  # the chunked log-probs benchmark is optional in this run
      out["logprobs"] = {"skipped": str(e)}

  print_table(out)
  return save_json(out, args.json)


def save_json(out: dict, path: str) -> dict:
  """Writes a benchmark's results to ``path`` (its folder made), says so, and returns them."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  print(f"\nwrote {path}")
  return out


def print_table(out):
  print(f"\nmachine: {out['machine']}")
  bandwidth = out["machine"]["roofline"]["bandwidth"]
  print(f"measured bandwidth {bandwidth / 1e9:.1f} GB/s: each pass's '% bw' is its bytes moved per second over it")
  print("\nNamed shapes (decoupled PPO + reference MIS config, forward+backward; best of N):")
  hdr = [
    "seqs",
    "max_len",
    "tokens",
    "ours ms",
    "tok/s",
    "padded ms",
    "pad/packed",
    "torch loop ms",
    "speedup",
    "weights ms",
    "weights % bw",
    "loss % bw",
    "temp MB",
  ]
  print(" | ".join(hdr))
  for r in out["named_shapes"]:
    print(
      " | ".join(
        [
          str(r["num_seqs"]),
          str(r["max_len"]),
          str(r["tokens"]),
          f"{1e3 * r['loss_fwd_bwd_s']:.2f}",
          f"{r['tokens_per_s']:.3g}",
          f"{1e3 * r['padded_loss_fwd_bwd_s']:.2f}",
          f"{r['padded_over_packed']:.2f}x",
          f"{1e3 * r['reference_s']:.0f}",
          f"{r['speedup_vs_reference']:.0f}x",
          f"{1e3 * r['weights_s']:.2f}",
          f"{100 * r['weights_roofline_fraction']:.1f}",
          f"{100 * r['loss_roofline_fraction']:.1f}",
          f"{r['loss_temp_MB']:.1f}",
        ]
      )
    )
  for name, title in (
    ("token_sweep", "Token sweep (time vs total tokens)"),
    ("segment_sweep", "Segment sweep (fixed tokens, more and shorter sequences)"),
  ):
    print(f"\n{title}:")
    print("seqs | tokens | ours ms | ns/token | weights ms | weights % bw | loss % bw | weights GB/s")
    for r in out[name]:
      print(
        f"{r['num_seqs']} | {r['tokens']} | {1e3 * r['loss_fwd_bwd_s']:.2f} | "
        f"{1e9 * r['loss_fwd_bwd_s'] / r['tokens']:.1f} | {1e3 * r['weights_s']:.2f} | "
        f"{100 * r['weights_roofline_fraction']:.1f} | {100 * r['loss_roofline_fraction']:.1f} | "
        f"{r['weights_GBps']:.1f}"
      )
  seg = out["segment_sweep"]
  per_tok = [r["loss_fwd_bwd_s"] / r["tokens"] for r in seg]
  print(
    f"\nsegment-count growth at fixed tokens: {max(per_tok) / min(per_tok):.2f}x "
    f"({seg[0]['num_seqs']} -> {seg[-1]['num_seqs']} sequences)"
  )
  sw = out["token_sweep"]
  print(
    f"token growth: {sw[0]['tokens']} -> {sw[-1]['tokens']} tokens ({sw[-1]['tokens'] / sw[0]['tokens']:.0f}x), "
    f"time {sw[-1]['loss_fwd_bwd_s'] / sw[0]['loss_fwd_bwd_s']:.1f}x"
  )
  print(f"pass options (named shapes): {[r['pass_options'] for r in out['named_shapes']]}")


if __name__ == "__main__":
  main()
