"""The jitted training step: micro-batched loss and gradient, Optax update, on a device mesh.

`StepFunctions` holds the jitted functions over a step's batch laid out as
`[micro_batches, rows, row_len]` (rows split over `data × fsdp × expert`):

- `forward(heads)(params, inputs, segment_ids)`: a teacher-forced pass (the old or reference
  policy's), one micro-batch at a time, yielding the `Heads` that `heads` (a `Forward`) names:
  log-probs, and with them `Σπ²` (`SUM_SQ`) or the native routed experts (`ROUTING`);
  `logprobs` is the plain pass (`LOGPROBS`);
- `prepare(batch, key)`: `mis_jax.prepare_step` — the step's `mis_jax.Correction` (IS weights,
  kept mask, the covariance forms' tokens, global denominators) and its metrics, once per step;
- `train(params, opt_state, inputs, batch, correction)`: a `lax.scan` over the micro-batches (of
  the batch and of the correction's per-token arrays; the step's denominators whole in each)
  accumulating float32 gradients (sharded like the parameters), then the Optax update, in one
  program; parameters and optimiser state are donated;
- `forward(EXACT)` / `forward(EXACT_ROUTING)` (exact mode, `rollout.placement.exact`): the old
  policy's log-probs as the engine computes them — the parameters cast as the weight handover casts
  them (`ExactPass.served`: to the pushed, then to the served dtype), the decoder in batch-invariant
  arithmetic (`trainers.models.invariant`) in the served dtype, the log-probs of the sampler's own
  `log_softmax(logits / T)` (over the replayed support, renormalised, with sampling replay): bit
  for bit the engine's for samples of these weights (contract §13);
- `train_fused(params, opt_state, inputs, batch, key)`: the same program for a step of one
  micro-batch whose old policy is the parameters being updated (one epoch): the old log-probs
  are the training forward's own, stop-gradient, and `prepare_step` runs inside the
  differentiated function on them (its outputs depend on stop-gradient values only, so the
  gradient is `train`'s); returns a `FusedStep` with the old log-probs. No separate pass.
  `train` and `train_fused` are one body (`update` over `loss_fn`) with two ways of giving a
  micro-batch its correction.

Every forward returns a `Heads` value (unset heads are None), never a tuple whose length depends
on flags. Log-probs never build `[T, V]` logits: the model stops at its final hidden states and
`mis_jax.token_logprobs` computes log-probs and entropy chunk by chunk, inside a `shard_map`
over the batch (each device's own tokens, the LM head all-gathered once).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import mis_jax
from trainers.runtime import parallel
from trainers.models import invariant
from trainers.models.hf_io import DTYPES, abstract_model


class ModelInputs(NamedTuple):
  """Model inputs of packed rows: `input_ids`, `positions`, `targets` (next tokens), int32, and
  with sampling-mask replay `support` (`[..., K]` ids of each target's sampling support, `-1`
  padded; an empty row is the whole vocabulary): every log-prob is then over the support; and
  with routing replay `routing` (`[..., num_hidden_layers, k]` experts of each input token of
  a mixture-of-experts model, `-1` where nothing is recorded: routed natively). These two come
  from the run's per-token extras (`trainers.rollout.extras.model_inputs`); an extra that feeds
  another input puts it in `extra` (by name; None when there is none)."""

  input_ids: jax.Array
  positions: jax.Array
  targets: jax.Array
  support: jax.Array | None = None
  routing: jax.Array | None = None
  extra: dict | None = None


class Heads(NamedTuple):
  """What a forward yields per token, float32 `[B, T]` unless said: `logprobs`; `entropy`;
  `kept_mass` (the kept log-mass of a sampling support); `sum_sq` (`Σ_v π_v²`); `routing`
  (the native routed experts `[B, T, num_hidden_layers, k]` int32 of a mixture-of-experts model);
  `router_aux_loss` (its load-balancing loss, a scalar); `topk_logprobs` (`[B, T, k]`, the log-probs of
  the sampler's top-k ids, `ModelInputs.extra["top_logprob_ids"]`: score centering's). A head not asked
  for is None."""

  logprobs: jax.Array
  entropy: jax.Array | None = None
  kept_mass: jax.Array | None = None
  sum_sq: jax.Array | None = None
  routing: jax.Array | None = None
  router_aux_loss: jax.Array | None = None
  topk_logprobs: jax.Array | None = None


class Forward(NamedTuple):
  """Which heads a jitted pass over a step's batch yields besides the log-probs (its program and
  its name in the trace counts); `exact`: exact mode's pass (the engine's arithmetic and weights)."""

  sum_sq: bool = False
  routing: bool = False
  exact: bool = False

  @property
  def name(self) -> str:
    return "logprobs" + "_sum_sq" * self.sum_sq + "_routing" * self.routing + "_exact" * self.exact


LOGPROBS, SUM_SQ, ROUTING = Forward(), Forward(sum_sq=True), Forward(routing=True)
EXACT, EXACT_ROUTING = Forward(exact=True), Forward(routing=True, exact=True)


class FusedStep(NamedTuple):
  """What `StepFunctions.train_fused` returns: the updated `params` and `opt_state`, the step's
  `metrics` (the correction's and the loss's) and the `old_logprobs` it trained with
  (`[1, rows, row_len]` float32, the training forward's own, stop-gradient)."""

  params: object
  opt_state: object
  metrics: dict
  old_logprobs: jax.Array


def make_optimizer(train_cfg) -> optax.GradientTransformation:
  t = train_cfg
  schedule = (
    optax.warmup_cosine_decay_schedule(0.0, t.learning_rate, max(t.warmup_steps, 1), t.steps)
    if t.schedule == "cosine"
    else optax.join_schedules(
      [optax.linear_schedule(0.0, t.learning_rate, t.warmup_steps), optax.constant_schedule(t.learning_rate)],
      [t.warmup_steps],
    )
  )
  return optax.chain(
    clip_by_global_norm(t.max_grad_norm), optax.adamw(schedule, eps=t.adam_eps, weight_decay=t.weight_decay)
  )


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm` with the scale applied as one multiplication, `g * (max_norm /
  ‖g‖)`, where Optax divides every value, `(g / ‖g‖) * max_norm`: XLA recomputes a multiplication
  inside each consumer (Adam's two moments) but materialises a division read twice, a second copy
  of the gradients (2.4 GB at Qwen3-0.6B in float32). Unclipped gradients pass unchanged (bitwise
  Optax's); clipped ones agree with Optax's to an ulp."""

  def update_fn(updates, state, params=None):
    del params
    g_norm = optax.tree.norm(updates)
    keep = jnp.squeeze(g_norm < max_norm)
    scale = max_norm / g_norm
    return jax.tree.map(lambda g: jax.lax.select(keep, g, g * scale.astype(g.dtype)), updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def model_logprobs(
  graphdef,
  params,
  inputs: ModelInputs,
  segment_ids,
  *,
  temperature: float,
  chunk_size: int,
  entropy: bool,
  mesh=None,
  kept_mass: bool = False,
  routing_out: bool = False,
  sum_sq: bool = False,
  topk: bool = False,
) -> Heads:
  """The `Heads` of a teacher-forced forward: per-token `log_softmax(logits / temperature)[targets]`
  (and with `entropy` the entropy), float32 `[B, T]`, from the model's final hidden states with
  `mis_jax.token_logprobs` (no `[T, V]` logits). With `inputs.support`, log-probs and entropy are
  over each token's sampling support and `kept_mass` adds the kept log-mass. A mixture-of-experts
  model replays `inputs.routing` when given; `routing_out` adds its native top-k per layer
  (`routing`) and the load-balancing loss (`router_aux_loss`); `sum_sq` adds `Σ_v π_v²` per token;
  `topk` the log-probs of `inputs.extra["top_logprob_ids"]` (`topk_logprobs`, from the same chunks).

  On a mesh the head runs in a `shard_map`: each device takes its own rows (and, when the row
  length divides, a `1/tensor` share of their tokens) against the LM head all-gathered in the
  compute dtype; the head's gradient is reduce-scattered back to its shards.
  """
  model = nnx.merge(graphdef, params)
  routing = None
  if model.config.is_moe:
    hidden, routing = model.hidden_states(
      inputs.input_ids, inputs.positions, segment_ids, routing=inputs.routing, return_routing=True
    )
  else:
    hidden = model.hidden_states(inputs.input_ids, inputs.positions, segment_ids, routing=inputs.routing)
  kept_mass = kept_mass and inputs.support is not None
  extra_ids = inputs.extra["top_logprob_ids"] if topk else None
  out = _head_logprobs(
    model,
    hidden,
    inputs,
    temperature=temperature,
    chunk_size=chunk_size,
    entropy=entropy,
    mesh=mesh,
    kept_mass=kept_mass,
    sum_sq=sum_sq,
    extra_ids=extra_ids,
  )
  # mis_jax.token_logprobs: (log-probs, [entropy], [kept log-mass], [Σπ²], [extra ids' log-probs]) in that order
  out = list(out) if isinstance(out, tuple) else [out]
  heads = Heads(
    out.pop(0),
    entropy=out.pop(0) if entropy else None,
    kept_mass=out.pop(0) if kept_mass else None,
    sum_sq=out.pop(0) if sum_sq else None,
    topk_logprobs=out.pop(0) if topk else None,
  )
  if not routing_out:
    return heads
  if routing is None:
    raise ValueError("routing_out needs a mixture-of-experts model")
  return heads._replace(routing=routing.native, router_aux_loss=routing.aux_loss)


def _head_logprobs(
  model, hidden, inputs: ModelInputs, *, temperature, chunk_size, entropy, mesh, kept_mass, sum_sq=False, extra_ids=None
):
  head, layout = model.head()
  head = head.astype(hidden.dtype)
  with_support, with_extra = inputs.support is not None, extra_ids is not None

  def fn(h, w, y, *ids):
    support, extra = (ids[0] if with_support else None), (ids[-1] if with_extra else None)
    return mis_jax.token_logprobs(
      h,
      w,
      y,
      temperature=temperature,
      chunk_size=chunk_size,
      return_entropy=entropy,
      lm_head_layout=layout,
      support_ids=support,
      return_kept_mass=kept_mass,
      return_sum_pi_squared=sum_sq,
      extra_ids=extra,
    )

  args = (inputs.targets,) + ((inputs.support,) if with_support else ()) + ((extra_ids,) if with_extra else ())
  if mesh is None or mesh.size == 1:
    return fn(hidden, head, *args)
  # The head enters in its own shards (in the compute dtype) and is all-gathered inside, so
  # its gradient leaves reduce-scattered (the transpose of all_gather), never replicated.
  head_spec = parallel.param_spec(
    ("embed_tokens", "embedding") if layout == "vd" else ("lm_head", "kernel"), head.shape, mesh, model.config.family
  )

  def local(h, w, *rest):
    for axis, names in enumerate(head_spec):
      if names is not None:
        w = jax.lax.all_gather(w, names, axis=axis, tiled=True)
    return fn(h, w, *rest)

  tokens = "tensor" if hidden.shape[1] % mesh.shape["tensor"] == 0 else None
  spec = P(parallel.BATCH_AXES, tokens)
  per_id = P(parallel.BATCH_AXES, tokens, None)  # [B, T, K] ids (and their log-probs)
  num_out = 1 + entropy + kept_mass + sum_sq
  out_specs = (spec,) * num_out + ((per_id,) if with_extra else ())
  out_specs = out_specs if len(out_specs) > 1 else spec
  in_specs = (
    (P(parallel.BATCH_AXES, tokens, None), head_spec, spec)
    + ((per_id,) if with_support else ())
    + ((per_id,) if with_extra else ())
  )
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(hidden, head, *args)


class ExactPass(NamedTuple):
  """Exact mode's old-log-prob pass (`rollout.placement.exact`): the engine's `served_dtype` and the
  `weight_dtype` the handover casts the parameters to first, and the batch-invariant decoder's
  graph in the served dtype."""

  served_dtype: str
  weight_dtype: str
  graphdef: object

  def served(self, params):
    """The parameters as the engine holds them: each float array rounded to `weight_dtype` (what the
    handover sends), then to `served_dtype` (what the engine casts to), stored in `served_dtype`.
    `lax.reduce_precision` rounds as a cast does (to nearest, ties to even) and, unlike a cast
    pair, is never folded away by XLA."""
    served = DTYPES[self.served_dtype]

    def cast(x):
      if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
      y = invariant.round_to(x.astype(jnp.float32), DTYPES[self.weight_dtype])
      return invariant.round_to(y, served).astype(served)

    return jax.tree.map(cast, params)


def exact_logprobs(model, hidden, targets, support, temperature, *, chunk_size: int):
  """Per-token log-probs as exact mode's sampler reports them (`trainers.serving.embedded.sampler`):
  `invariant.temperature_log_softmax(logits, T)[target]`, and with a replayed `support` (`[..., K]`
  ids, `-1` padded; an empty row is the whole vocabulary) renormalised over it:
  `lp[target] - invariant.logsumexp(lp restricted to the support)`. `hidden [B, T, D]` from a
  batch-invariant `model`; `chunk_size` tokens' logits at a time (the values do not depend on it)."""
  b, t, d = hidden.shape
  n = b * t
  size = min(chunk_size, n)
  pad = -n % size
  flat = lambda x, fill: jnp.pad(
    x.reshape((n,) + x.shape[2:]), ((0, pad),) + ((0, 0),) * (x.ndim - 2), constant_values=fill
  )
  chunks = lambda x: x.reshape(((n + pad) // size, size) + x.shape[1:])
  xs = (chunks(flat(hidden, 0.0)), chunks(flat(targets, 0))) + (
    (chunks(flat(support, -1)),) if support is not None else ()
  )

  def one(args):
    h, y = args[:2]
    lp = invariant.temperature_log_softmax(model.logits(h), temperature)
    picked = jnp.take_along_axis(lp, y[:, None], axis=-1)[:, 0]
    if support is None:
      return picked
    ids = args[2]
    vocab = lp.shape[-1]
    listed = jnp.any(ids[:, :, None] == jnp.arange(vocab, dtype=ids.dtype)[None, None, :], axis=1)  # [size, V]
    kept = listed | ~jnp.any(ids >= 0, axis=1, keepdims=True)
    return picked - invariant.logsumexp(jnp.where(kept, lp, -jnp.inf))

  return jax.lax.map(one, xs).reshape(-1)[:n].reshape(b, t)


def exact_pass(setup: "StepSetup", heads: Forward, served_params, inputs, segment_ids, temperature) -> Heads:
  """Exact mode's teacher-forced pass over the micro-batches (`served_params`: `ExactPass.served`'s;
  `temperature`: a float32 scalar, divided as the sampler divides): `Heads` of `[micro_batches, ...]`,
  the native routing with `heads.routing`."""

  def one(xs):
    mb, seg = xs
    model = nnx.merge(setup.exact.graphdef, served_params)
    routing = None
    if heads.routing:
      hidden, routing = model.hidden_states(mb.input_ids, mb.positions, seg, routing=mb.routing, return_routing=True)
    else:
      hidden = model.hidden_states(mb.input_ids, mb.positions, seg, routing=mb.routing)
    logp = exact_logprobs(model, hidden, mb.targets, mb.support, temperature, chunk_size=setup.chunk_size)
    return Heads(logp, routing=None if routing is None else routing.native)

  return jax.lax.map(one, (inputs, segment_ids))


def _micro_batch_weights(batch: mis_jax.PackedBatch, kept_mask, mode: str):
  """Per micro-batch weights of its metrics in the step's: the number of loss-mask and of
  kept tokens (token-mean) or live segments (seq-mean modes), and live segments always.
  `kept_mask`: the micro-batch's rows of the correction's (None: the loss mask)."""
  valid = batch.segment_ids >= 0
  mask = valid & batch.loss_mask.astype(bool)
  kept = mask if kept_mask is None else mask & kept_mask.astype(bool)
  ids = jnp.where(valid, batch.segment_ids, batch.num_segments).reshape(-1)

  def seqs(m):
    per = jax.ops.segment_sum(m.reshape(-1).astype(jnp.float32), ids, batch.num_segments + 1)
    return jnp.sum((per[:-1] > 0).astype(jnp.float32))

  live = seqs(mask)
  if mode == "token-mean":
    return {"mask": jnp.sum(mask.astype(jnp.float32)), "kept": jnp.sum(kept.astype(jnp.float32)), "seqs": live}
  return {"mask": live, "kept": seqs(kept), "seqs": live}


# The step's own micro-batch metrics, beside the library's: the MoE load-balancing loss, a mean
# over the micro-batches weighted by their loss-mask tokens (or sequences).
STEP_REDUCTIONS = {"router_aux_loss": "mask"}


def combine_metrics(stacked: dict, weights: dict, loss_cfg: mis_jax.LossConfig | None = None) -> dict:
  """`[k]` micro-batch metrics → step metrics, each by the reduction declared for it (the
  library's, `mis_jax.microbatch_reduction`, with `loss_cfg`'s correction function's; the step's
  own, `STEP_REDUCTIONS`; an undeclared metric is an error): loss terms add (their denominators
  are the step's), extremes take the min/max over micro-batches with tokens, means are weighted
  by their micro-batch denominators (loss-mask tokens or sequences; kept ones for means over the
  kept mask; sequences for sequence fractions)."""
  out = {}
  has = weights["mask"] > 0
  for name, v in stacked.items():
    how = STEP_REDUCTIONS[name] if name in STEP_REDUCTIONS else mis_jax.microbatch_reduction(name, loss_cfg)
    if how == "sum":
      out[name] = jnp.sum(v)
    elif how == "min":
      out[name] = jnp.where(jnp.any(has), jnp.min(jnp.where(has, v, jnp.inf)), 0.0)
    elif how == "max":
      out[name] = jnp.where(jnp.any(has), jnp.max(jnp.where(has, v, -jnp.inf)), 0.0)
    else:
      w = weights[how]
      out[name] = jnp.sum(jnp.where(w > 0, v * w, 0.0)) / jnp.maximum(jnp.sum(w), 1.0)
  return out


def _jit(fn, **kwargs):
  """`jax.jit`, the one place the step functions are compiled (the tests wrap it to count traces)."""
  return jax.jit(fn, **kwargs)


class StepSetup(NamedTuple):
  """What every jitted function of one (model, loss, optimiser, mesh) setup is bound to: the
  model's graph, the optimiser, the loss, the sampling temperature the log-probs use, the
  log-prob chunk, the mesh, the parameters' shardings, the MoE load-balancing coefficient and,
  in exact mode, the exact old-log-prob pass."""

  graphdef: object
  optimizer: optax.GradientTransformation
  loss_cfg: mis_jax.LossConfig
  temperature: float
  chunk_size: int
  mesh: object
  param_shardings: object
  router_aux_loss_coef: float = 0.0
  exact: ExactPass | None = None


def policy_heads(setup: StepSetup, params, inputs: ModelInputs, segment_ids, **heads) -> Heads:
  """`model_logprobs` of `setup`'s model at its temperature, chunk and mesh."""
  return model_logprobs(
    setup.graphdef,
    params,
    inputs,
    segment_ids,
    temperature=setup.temperature,
    chunk_size=setup.chunk_size,
    mesh=setup.mesh,
    **heads,
  )


def forward_pass(setup: StepSetup, heads: Forward, params, inputs, segment_ids) -> Heads:
  """A teacher-forced pass yielding `heads` over the micro-batches: `Heads` of `[micro_batches, ...]`."""

  def one(xs):
    out = policy_heads(setup, params, xs[0], xs[1], entropy=False, sum_sq=heads.sum_sq, routing_out=heads.routing)
    return out._replace(router_aux_loss=None)  # the training forward's, not a head of this pass

  return jax.lax.map(one, (inputs, segment_ids))


def micro_batch_loss(setup: StepSetup, p, mb_inputs, mb_batch, correction_of, num_tokens):
  """One micro-batch's loss and metrics from the training forward. `correction_of(logprobs,
  mb_batch) -> (mb_batch, correction, kept)`: the micro-batch and the step's correction for it,
  given the forward's own log-probs (stop-gradient), and what the step keeps of it (None:
  nothing); the aux is (metrics, kept mask, kept)."""
  loss_cfg, aux_coef = setup.loss_cfg, float(setup.router_aux_loss_coef)
  replay = mb_inputs.support is not None
  heads = policy_heads(
    setup,
    p,
    mb_inputs,
    mb_batch.segment_ids,
    entropy=True,
    kept_mass=replay,
    routing_out=aux_coef > 0,
    topk=loss_cfg.score_centering,
  )
  logp = heads.logprobs
  mb_batch, mb_correction, kept = correction_of(jax.lax.stop_gradient(logp), mb_batch)
  loss, metrics = mis_jax.policy_loss(
    logp, mb_batch, loss_cfg, entropy=heads.entropy, correction=mb_correction, topk_logprobs=heads.topk_logprobs
  )
  if aux_coef > 0:  # HF's load-balancing loss per micro-batch, token-weighted over the step
    aux = heads.router_aux_loss
    share = jnp.sum((mb_batch.segment_ids >= 0).astype(jnp.float32)) / num_tokens
    loss = loss + aux_coef * aux * share
    metrics["loss"] = metrics["loss"] + jax.lax.stop_gradient(aux_coef * aux * share)  # what is optimised
    metrics["router_aux_loss"] = jax.lax.stop_gradient(aux)
  if replay:  # kept mass and the ratio with / without renormalisation (first epoch: o = lp)
    metrics.update(
      mis_jax.sampling_metrics(
        jax.lax.stop_gradient(logp),
        jax.lax.stop_gradient(heads.kept_mass),
        mb_batch.rollout_logprobs,
        mb_batch.loss_mask,
        mb_batch.segment_ids,
        num_segments=mb_batch.num_segments,
        metric_reduction=loss_cfg.metric_mode,
      )
    )
  return loss, (metrics, mb_correction.kept_mask, kept)


def update(setup: StepSetup, params, opt_state, inputs, batch, per_micro_batch, correction_of):
  """The step's body: a `lax.scan` over the micro-batches (`inputs`, `batch` and
  `per_micro_batch`, each `correction_of`'s own) accumulating float32 gradients, then the
  Optax update. Returns (params, opt_state, metrics, what `correction_of` kept of each
  micro-batch, stacked)."""
  num_tokens = jnp.maximum(jnp.sum((batch.segment_ids >= 0).astype(jnp.float32)), 1.0)

  def body(acc, xs):
    mb_inputs, mb_batch, mb_own = xs
    of = functools.partial(correction_of, mb_own)
    (_, (metrics, kept_mask, kept)), g = jax.value_and_grad(
      lambda p: micro_batch_loss(setup, p, mb_inputs, mb_batch, of, num_tokens), has_aux=True
    )(params)
    acc = jax.tree.map(
      lambda a, x, s: jax.lax.with_sharding_constraint(a + x.astype(jnp.float32), s), acc, g, setup.param_shardings
    )
    return acc, (metrics, _micro_batch_weights(mb_batch, kept_mask, setup.loss_cfg.metric_mode), kept)

  zeros = jax.tree.map(
    lambda x, s: jax.lax.with_sharding_constraint(jnp.zeros(x.shape, jnp.float32), s), params, setup.param_shardings
  )
  grads, (mb_metrics, weights, kept) = jax.lax.scan(body, zeros, (inputs, batch, per_micro_batch))
  metrics = combine_metrics(mb_metrics, weights, setup.loss_cfg)
  metrics["grad_norm"] = optax.tree.norm(grads)
  # Optax mixes Python floats with int32 step counts: it needs standard promotion even when a
  # user (or the test suite) runs strict; the rest of the step promotes nothing implicitly.
  with jax.numpy_dtype_promotion("standard"):
    updates, opt_state = setup.optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params, opt_state, metrics, kept


def train(setup: StepSetup, params, opt_state, inputs, batch, correction):
  """The update with the step's correction prepared before it (`prepare`): its per-token arrays
  scanned with the batch, its denominators the step's, whole in every micro-batch."""

  def given(mb_correction, logprobs, mb_batch):
    return mb_batch, mb_correction.replace(denominators=correction.denominators), None

  per_token = correction.replace(denominators=None)
  return update(setup, params, opt_state, inputs, batch, per_token, given)[:3]


def prepare(setup: StepSetup, batch, key=None):
  """`mis_jax.prepare_step` of the step (`key`: clip_cov's draw) → (correction, metrics)."""
  return mis_jax.prepare_step(batch, setup.loss_cfg, key=key)


def train_fused(setup: StepSetup, params, opt_state, inputs, batch, key):
  """The update of a step of one micro-batch whose old policy is the parameters being updated:
  the old log-probs are the training forward's own, stop-gradient, and `prepare` runs on them
  inside the differentiated function. Returns a `FusedStep`."""
  if inputs.input_ids.shape[0] != 1:
    raise ValueError(
      f"train_fused takes a step of one micro-batch, got {inputs.input_ids.shape[0]} "
      "(a step of several takes the old-log-prob pass, then train)"
    )

  def own(_, logprobs, mb_batch):  # o = sg(lp): the parameters being updated are the old policy
    mb_batch = mb_batch.replace(old_logprobs=logprobs)
    correction, step_metrics = prepare(setup, mb_batch, key)
    return mb_batch, correction, (logprobs, step_metrics)

  params, opt_state, metrics, (old, step_metrics) = update(setup, params, opt_state, inputs, batch, None, own)
  return FusedStep(params, opt_state, {**metrics, **{k: v[0] for k, v in step_metrics.items()}}, old)


def _bound(fn, setup: StepSetup, *args, name: str | None = None):
  """`fn` with its setup (and leading static arguments) bound, under `fn`'s name or `name` (the
  compiled program's)."""
  bound = functools.partial(fn, setup, *args)
  bound.__name__ = name or fn.__name__
  return bound


class StepFunctions:
  """The jitted step functions of one setup (`StepSetup`); see the module doc."""

  def __init__(self, setup: StepSetup, *, opt_shardings, abstract_params=None):
    self.setup = setup
    self.mesh, self.loss_cfg, self.graphdef, self.abstract_params = (
      setup.mesh,
      setup.loss_cfg,
      setup.graphdef,
      abstract_params,
    )
    self.optimizer, self.param_shardings, self.opt_shardings = setup.optimizer, setup.param_shardings, opt_shardings
    replicated, batch_sh = NamedSharding(setup.mesh, P()), parallel.batch_sharding(setup.mesh)
    self._passes = {  # compiled when first called
      heads: _jit(
        _bound(forward_pass, setup, heads, name=heads.name),
        out_shardings=Heads(
          batch_sh,
          sum_sq=batch_sh if heads.sum_sq else None,
          routing=parallel.batch_sharding(setup.mesh, 5) if heads.routing else None,
        ),
      )
      for heads in (LOGPROBS, SUM_SQ, ROUTING)
    }
    if setup.exact is not None:  # the cast to the engine's copy, then its arithmetic (its compile options)
      served = _jit(setup.exact.served, out_shardings=setup.param_shardings)
      temperature = jnp.float32(setup.temperature)
      for heads in (EXACT, EXACT_ROUTING):
        run = _jit(
          _bound(exact_pass, setup, heads, name=heads.name),
          compiler_options=invariant.COMPILER_OPTIONS,
          out_shardings=Heads(batch_sh, routing=parallel.batch_sharding(setup.mesh, 5) if heads.routing else None),
        )
        self._passes[heads] = functools.partial(
          lambda run, params, inputs, segment_ids: run(served(params), inputs, segment_ids, temperature), run
        )
    self.logprobs = self._passes[LOGPROBS]
    self.prepare = _jit(_bound(prepare, setup))
    train_options = {"donate_argnums": (0, 1), "out_shardings": (setup.param_shardings, opt_shardings, replicated)}
    self.train = _jit(_bound(train, setup), **train_options)
    self.train_fused = _jit(
      _bound(train_fused, setup),
      donate_argnums=(0, 1),
      out_shardings=FusedStep(setup.param_shardings, opt_shardings, replicated, batch_sh),
    )
    # The memory probe (`trainers.learner.memory_plan`): the step lowered for abstract arguments,
    # apart from the run's jitted functions (their caches and trace counts are the run's own).
    self.lower_train = lambda *args: jax.jit(_bound(train, setup), **train_options).lower(*args)
    self.prepare_shapes = lambda batch, key: jax.eval_shape(_bound(prepare, setup), batch, key)
    self.init_opt_state = jax.jit(setup.optimizer.init, out_shardings=opt_shardings)

  def forward(self, heads: Forward):
    """The jitted pass yielding `heads`: `(params, inputs, segment_ids) -> Heads`."""
    return self._passes[heads]


def build_step_functions(
  model_cfg,
  mesh,
  loss_cfg: mis_jax.LossConfig,
  train_cfg,
  *,
  temperature: float = 1.0,
  logprob_chunk: int = 1024,
  exact: tuple[str, str] | None = None,
  **model_kwargs,
) -> StepFunctions:
  """`StepFunctions` for the registered architecture of `model_cfg` (`model_kwargs`: `dtype`, `param_dtype`,
  `attention`, `remat`) on `mesh`: the parameter shardings from the partition rules, the
  optimiser state's from them, and the residual stream constrained to the batch split. `exact`:
  exact mode's `(served_dtype, weight_dtype)` (the `EXACT` passes), or None."""
  if mesh.size > 1:
    model_kwargs.setdefault("activation_sharding", parallel.activation_sharding(mesh))
  graphdef, abstract = nnx.split(abstract_model(model_cfg, **model_kwargs))
  optimizer = make_optimizer(train_cfg)
  param_shardings = parallel.param_shardings(abstract, mesh, model_cfg.family)
  opt_shardings = parallel.state_shardings(jax.eval_shape(optimizer.init, abstract), abstract, param_shardings, mesh)
  exact_pass_ = None
  if exact is not None:
    served_dtype, weight_dtype = exact
    exact_graph, _ = nnx.split(
      abstract_model(
        model_cfg,
        dtype=DTYPES[served_dtype],
        param_dtype=DTYPES[served_dtype],
        arithmetic="batch_invariant",
        layer_loop=model_kwargs.get("layer_loop", "scan"),
      )
    )
    exact_pass_ = ExactPass(served_dtype, weight_dtype, exact_graph)
  setup = StepSetup(
    graphdef,
    optimizer,
    loss_cfg,
    temperature,
    logprob_chunk,
    mesh,
    param_shardings,
    getattr(train_cfg, "router_aux_loss_coef", 0.0) if model_cfg.is_moe else 0.0,
    exact_pass_,
  )
  return StepFunctions(setup, opt_shardings=opt_shardings, abstract_params=abstract)
