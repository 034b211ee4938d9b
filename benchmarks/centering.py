"""Score centering's cost (contract §6.6), side by side in one run: the loss pass (``policy_loss``
forward+backward, decoupled PPO with the reference MIS config, at `make bench`'s named shapes) and
the chunked log-prob pass (``token_logprobs`` forward+backward of an LM head) without and with the
sampler's top-k (``topk_logprobs`` in the loss; ``extra_ids`` gathered in the log-prob pass), best of
N, with their compiled peak (temp) memory.

    python -m benchmarks.centering [--quick] [--top-k 20] [--json benchmarks/results/centering.json]

`make bench` runs it after the forms (`benchmarks.forms`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

import mis_jax
from benchmarks.run import LOSS_CFG, make_data, save_json, temp_bytes, timeit, to_batch


def _with_topk(rng, batch, lp, k):
  """The batch with the sampler's top-k log-probs, and the trainer's of the same ids (rows of a
  random distribution whose head holds about half the mass)."""
  shape = np.shape(lp) + (k,)
  head = np.log(np.sort(rng.dirichlet(np.ones(k), shape[:-1]), axis=-1)[..., ::-1] * 0.5).astype(np.float32)
  trainer = head + rng.normal(0.0, 0.05, shape).astype(np.float32)
  return batch.replace(rollout_topk_logprobs=jax.device_put(head)), jax.device_put(trainer)


def bench_loss(rng, num_seqs, max_len, row_len, k) -> dict:
  seqs, packing = make_data(rng, num_seqs, max_len, row_len)
  batch, lp = to_batch(seqs, packing)
  centred_batch, topk = _with_topk(rng, batch, lp, k)
  centred_cfg = dataclasses.replace(LOSS_CFG, score_centering=True)
  correction, _ = jax.jit(lambda b: mis_jax.prepare_step(b, LOSS_CFG))(batch)
  plain = jax.jit(jax.value_and_grad(lambda lp, b, c: mis_jax.policy_loss(lp, b, LOSS_CFG, correction=c), has_aux=True))
  centred = jax.jit(
    jax.value_and_grad(
      lambda lp, t, b, c: mis_jax.policy_loss(lp, b, centred_cfg, correction=c, topk_logprobs=t),
      argnums=(0, 1),
      has_aux=True,
    )
  )
  row = {
    "num_seqs": num_seqs,
    "max_len": max_len,
    "tokens": int(sum(len(s["m"]) for s in seqs)),
    "top_k": k,
    "plain_s": timeit(plain, lp, batch, correction),
    "centred_s": timeit(centred, lp, topk, centred_batch, correction),
    "plain_temp_MB": temp_bytes(plain, lp, batch, correction) / 1e6,
    "centred_temp_MB": temp_bytes(centred, lp, topk, centred_batch, correction) / 1e6,
  }
  row["centred_over_plain"] = row["centred_s"] / row["plain_s"]
  return row


def bench_logprobs(rng, tokens, hidden, vocab, k, chunk=1024) -> dict:
  h = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(hidden, vocab)) / np.sqrt(hidden), jnp.bfloat16)
  y = jnp.asarray(rng.integers(0, vocab, tokens), jnp.int32)
  ids = jnp.asarray(rng.integers(0, vocab, (tokens, k)), jnp.int32)

  def plain(h, w):
    lp, ent = mis_jax.token_logprobs(h, w, y, chunk_size=chunk, return_entropy=True)
    return jnp.sum(lp) + jnp.sum(ent)

  def centred(h, w):
    lp, ent, extra = mis_jax.token_logprobs(h, w, y, chunk_size=chunk, return_entropy=True, extra_ids=ids)
    return jnp.sum(lp) + jnp.sum(ent) + jnp.sum(extra)

  fns = {name: jax.jit(jax.value_and_grad(f, argnums=(0, 1))) for name, f in (("plain", plain), ("centred", centred))}
  row = {"tokens": tokens, "hidden": hidden, "vocab": vocab, "top_k": k, "chunk_size": chunk}
  for name, fn in fns.items():
    row[f"{name}_s"] = timeit(fn, h, w, repeats=5)
    row[f"{name}_temp_MB"] = temp_bytes(fn, h, w) / 1e6
  row["centred_over_plain"] = row["centred_s"] / row["plain_s"]
  return row


def run(quick: bool = False, k: int = 20) -> dict:
  rng = np.random.default_rng(0)
  scale = 8 if quick else 1
  return {
    "loss": [bench_loss(rng, 512 // scale, 1024, 4096, k), bench_loss(rng, 4096 // scale, 256, 4096, k)],
    "logprobs": [bench_logprobs(rng, 4096 // scale, 256, 32768 // scale, k)],
  }


def print_table(out: dict) -> None:
  print("\nScore centering (contract §6.6), without vs with the top-k, forward+backward, best of N:")
  print("\nloss pass (decoupled PPO + reference MIS config)")
  print("seqs | tokens | k | plain ms | centred ms | × plain | plain temp MB | centred temp MB")
  for r in out["loss"]:
    print(
      f"{r['num_seqs']} | {r['tokens']} | {r['top_k']} | {1e3 * r['plain_s']:.2f} | {1e3 * r['centred_s']:.2f} | "
      f"{r['centred_over_plain']:.2f} | {r['plain_temp_MB']:.1f} | {r['centred_temp_MB']:.1f}"
    )
  print("\nchunked log-prob pass (bf16 LM head, log-probs + entropy; + the top-k ids' log-probs)")
  print("tokens | D | V | k | plain ms | centred ms | × plain | plain temp MB | centred temp MB")
  for r in out["logprobs"]:
    print(
      f"{r['tokens']} | {r['hidden']} | {r['vocab']} | {r['top_k']} | {1e3 * r['plain_s']:.1f} | "
      f"{1e3 * r['centred_s']:.1f} | {r['centred_over_plain']:.2f} | {r['plain_temp_MB']:.1f} | "
      f"{r['centred_temp_MB']:.1f}"
    )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="8x smaller shapes")
  parser.add_argument("--top-k", type=int, default=20)
  parser.add_argument("--json", default="benchmarks/results/centering.json")
  args = parser.parse_args(argv)
  out = {
    "machine": {
      "platform": platform.platform(),
      "cpus": os.cpu_count(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
    },
    **run(quick=args.quick, k=args.top_k),
  }
  print_table(out)
  return save_json(out, args.json)


if __name__ == "__main__":
  main()
