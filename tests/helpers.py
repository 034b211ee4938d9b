"""Random packed batches and their list-of-sequences twins for oracle comparisons; ports and
environments for the tests' subprocesses."""

import ast
import os
import socket

import numpy as np

import mis_jax


def random_seqs(
  rng,
  n_seqs=7,
  max_len=9,
  *,
  mismatch=0.3,
  catastrophic=0.05,
  nan_masked=True,
  with_ref=False,
  with_entropy=False,
  lp_noise=0.1,
):
  """Sequences with prompt (masked) tokens, an all-masked sequence, an empty one, rare
  catastrophic log-ratios and NaN in masked positions."""
  seqs = []
  for i in range(n_seqs):
    n = int(rng.integers(1, max_len + 1))
    if i == n_seqs - 1:
      n = 0  # an empty slot
    m = rng.random(n) < 0.8
    if n and rng.random() < 0.5:
      m[: int(rng.integers(0, n))] = False  # prompt tokens
    if i == 1:
      m[:] = False  # a sequence with no trained token
    q = rng.normal(-1.5, 0.7, n)
    r = rng.normal(0.0, mismatch, n)
    r[rng.random(n) < catastrophic] = -12.0
    o = q + r
    lp = o + rng.normal(0.0, lp_noise, n)
    adv = np.full(n, rng.normal())
    s = dict(o=o, q=q, m=m, lp=lp, adv=adv)
    if with_ref:
      s["ref"] = o + rng.normal(0.0, 0.2, n)
    if with_entropy:
      s["ent"] = rng.random(n) * 2
    if nan_masked:
      for k in s:
        if k != "m":
          s[k] = np.where(m, s[k], np.nan)
    seqs.append({k: (v if k == "m" else v.astype(np.float32).astype(np.float64)) for k, v in s.items()})
  return seqs


def pack(seqs, row_len=16, num_rows=None, num_segments=None, row_multiple=1):
  """Packs sequences into a PackedBatch (+ lp, entropy arrays); NaN at padding too."""
  packing = mis_jax.plan_packing([len(s["m"]) for s in seqs], row_len, num_rows=num_rows, row_multiple=row_multiple)
  get = lambda k, pad=np.nan: packing.pack([s[k].astype(np.float32) for s in seqs], pad, np.float32)
  batch = mis_jax.PackedBatch(
    segment_ids=packing.segment_ids,
    loss_mask=packing.pack([s["m"] for s in seqs], False, bool),
    advantages=get("adv"),
    rollout_logprobs=get("q"),
    old_logprobs=get("o"),
    ref_logprobs=get("ref") if "ref" in seqs[0] else None,
    num_segments=num_segments or len(seqs),
  )
  extra = {"lp": get("lp")}
  if "ent" in seqs[0]:
    extra["ent"] = get("ent")
  return batch, extra, packing


def pad_one_per_row(seqs, row_len=None):
  """The padded layout: one sequence per row."""
  row_len = row_len or max(max(len(s["m"]) for s in seqs), 1)
  packing = mis_jax.Packing(
    row_len=row_len,
    num_rows=len(seqs),
    rows=np.arange(len(seqs)),
    offsets=np.zeros(len(seqs), np.int64),
    lengths=np.array([len(s["m"]) for s in seqs]),
  )
  get = lambda k: packing.pack([s[k].astype(np.float32) for s in seqs], np.nan, np.float32)
  batch = mis_jax.PackedBatch(
    segment_ids=packing.segment_ids,
    loss_mask=packing.pack([s["m"] for s in seqs], False, bool),
    advantages=get("adv"),
    rollout_logprobs=get("q"),
    old_logprobs=get("o"),
    ref_logprobs=get("ref") if "ref" in seqs[0] else None,
    num_segments=len(seqs),
  )
  extra = {"lp": get("lp")}
  if "ent" in seqs[0]:
    extra["ent"] = get("ent")
  return batch, extra


def loss_keys(cfg: mis_jax.LossConfig) -> dict:
  """A LossConfig as the NumPy oracle's flat dict: its keys, the form's name and own keys beside them,
  the MIS config as its keys (a correction function left out)."""
  d = cfg.to_dict()
  d.pop("correction_fn")
  form = d.pop("policy_loss")
  return {**d, "policy_loss": form["name"], **{k: v for k, v in form.items() if k != "name"}}


def assert_metrics_close(got, want, rtol=2e-5, atol=2e-6):
  assert set(got) == set(want), f"key sets differ: extra {set(got) - set(want)}, missing {set(want) - set(got)}"
  for k in want:
    np.testing.assert_allclose(float(got[k]), want[k], rtol=rtol, atol=atol, err_msg=k)


def assert_weights_match_oracle(w, kept, metrics, seqs, packing, cfg, mode):
  """The weights, kept mask and metrics of a correction equal the NumPy oracle's, sequence by
  sequence (`seqs` packed by `packing`); returns the oracle's metrics."""
  import oracle

  W, K, want = oracle.mis(seqs, cfg.to_dict(), mode)
  want.update(oracle.mismatch(seqs, mode))
  assert_metrics_close(metrics, want)
  for i, (wj, kj) in enumerate(zip(packing.unpack(np.asarray(w)), packing.unpack(np.asarray(kept)))):
    np.testing.assert_allclose(wj, W[i], rtol=1e-5, atol=1e-7, err_msg=f"weights of sequence {i}")
    np.testing.assert_array_equal(kj, K[i], err_msg=f"kept mask of sequence {i}")
  return want


def prepare_step_on_mesh(batch, loss_cfg):
  """`mis_jax.prepare_step` on one device and under `shard_map` on a 2x4 mesh with sequence
  parallelism (segments split across devices): `((correction, metrics), (correction, metrics))`."""
  import jax
  from jax.sharding import AxisType, PartitionSpec

  one = jax.jit(lambda b: mis_jax.prepare_step(b, loss_cfg))(batch)
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
  spec = mis_jax.batch_partition_spec("data", "seq")
  # the correction's per-token arrays sharded like the batch, the step's denominators replicated
  correction_spec = jax.tree_util.tree_map(lambda _: spec, one[0].replace(denominators=None)).replace(
    denominators=None if one[0].denominators is None else PartitionSpec()
  )
  mapped = jax.shard_map(
    lambda b: mis_jax.prepare_step(b, loss_cfg, axis_name=("data", "seq")),
    mesh=mesh,
    in_specs=(jax.tree_util.tree_map(lambda _: spec, batch),),
    out_specs=(correction_spec, PartitionSpec()),
  )
  eight = jax.jit(mapped)(mis_jax.shard_batch(mesh, batch, seq_axis="seq"))
  return one, eight


def free_port() -> int:
  """A TCP port free on 127.0.0.1 now (for a coordinator or server a test starts)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def cpu_process_env(devices: int | None = None) -> dict:
  """This environment for a JAX subprocess on CPU, without the suite's device-count settings;
  with ``devices``, that many simulated CPU devices."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # the suite's (tests/conftest.py)
  if devices is not None:
    env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
  return env


def parse_source(text: str) -> ast.Module:
  """`ast.parse`, retried: CPython 3.11 before 3.11.8 keeps the AST converter's recursion-depth
  bookkeeping in state shared by every thread (gh-106905), so a parse that overlaps one in a
  background thread (a library's, left by an earlier test) can fail with "SystemError: AST
  constructor recursion depth mismatch" though the source is fine."""
  for _ in range(4):
    try:
      return ast.parse(text)
    except SystemError:
      continue
  return ast.parse(text)  # a fifth failure is raised
