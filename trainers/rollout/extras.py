"""Per-token extras: what the engine returns per token besides the token and its log-prob, and
the model may consume — each declared once, in the spirit of levanter's architecture registration.

A `TokenExtra` subclass says, in one place:

- `name`: the `Sample.extras` key, the record column and the `StepBatch.extras` key;
- `request`: the fields it adds to every `/generate` body (`probe_params`: the sampling params of
  the one-token probe that finds a server without it before step 1);
- `parse(reply)`: the engine's reply (`Reply`) → the sample's per-token array, or a message that
  rejects the sample (raising `missing`, a `ServerError`, when the server cannot return it at
  all); `logprobs(reply)`: the behaviour log-probs it supplies instead of
  `output_token_logprobs` (None: it supplies none);
- `record_type`, `to_record`, `from_record`: its Parquet column and the conversion both ways
  (`check_record`: a recorded value that does not fit the run);
- `span`, `fill`, `dtype`: its packing — one row per response token (`"response"`, at input
  positions `len(prompt) - 1 + j`) or per input position (`"sequence"`), `fill` elsewhere;
- `model_input`: the `ModelInputs` field it feeds (`support`, `routing`; another name lands in
  `ModelInputs.extra`), or None; `batch_field`: the `mis_jax.PackedBatch` field it fills (the
  loss's input, e.g. `rollout_topk_logprobs`), or None;
- `trainable(value)`: which response tokens the loss may train on (None: all) — a trajectory's
  `turn` (`trainers.agents.episodes.TurnIndex`) keeps the environment's tokens out.

`@register` adds a kind to the registry; `active(rollout, model_config)` asks every registered
kind once per run whether (and how) it is on (`activate`). The loop only ever handles the active
tuple: the client asks for and parses them (`sglang_client`), `validate_sample` puts them in
`Sample.extras`, the records write and read their columns (`rollout_records`, `sources`),
`build_step_batch` packs them and `model_inputs` feeds them to the model. Adding the next one is
one class here (or in any module that registers it); the Trainer never names it.

Staleness spans (`weight_versions`) are not an extra: they are per-sample spans every reply
carries (not asked for), the records keep only the last version, and they feed the loss
(`rollout_staleness`) and the async loop, not the model.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping

import numpy as np

from trainers.rollout import settings
from trainers.serving import protocol
from trainers.rollout.samples import NoRoutedExperts, NoSamplingMask, Reply, RoutingSpec, ServerError

__all__ = [
  "TokenExtra",
  "Reply",
  "register",
  "unregister",
  "registered",
  "active",
  "pack",
  "model_inputs",
  "trainable",
  "SamplingSupport",
  "RoutedExperts",
  "SamplerTopLogprobs",
  "SamplerTopIds",
  "decode_sample_routing",
]


class TokenExtra:
  """One per-token extra (see the module doc); an instance is the extra as one run uses it."""

  name: ClassVar[str]
  request: ClassVar[Mapping[str, Any]] = {}
  missing: ClassVar[type[ServerError]] = ServerError
  what: ClassVar[str] = ""  # in a probe's error: "malformed reply to a {what} probe"
  span: ClassVar[str] = "response"  # or "sequence"
  fill: ClassVar[Any] = 0
  dtype: ClassVar[Any] = np.float32
  model_input: str | None = None
  batch_field: ClassVar[str | None] = None
  missing_column: ClassVar[str] = ""  # why a replay needs the column (its record check's error)

  @classmethod
  def activate(cls, rollout: settings.RolloutSettings, model_config) -> "TokenExtra | None":
    """The extra as the run of `rollout` (the section and what it derives, `settings.derive`) on
    `model_config` uses it, or None."""
    raise NotImplementedError

  @staticmethod
  def record_type():
    """The pyarrow type of its record column."""
    raise NotImplementedError

  def probe_params(self, sampling_params: dict) -> dict:
    return {**sampling_params, "max_new_tokens": 1}

  def parse(self, reply: Reply) -> np.ndarray | str:
    raise NotImplementedError

  def logprobs(self, reply: Reply) -> list[float] | None:
    return None

  def to_record(self, value: np.ndarray):
    return np.asarray(value).tolist()

  def from_record(self, value, prompt_len: int, response_len: int) -> np.ndarray:
    return np.asarray(value, self.dtype)

  def check_record(self, value, prompt_len: int, response_len: int) -> str | None:
    """Why a recorded value cannot be replayed (None: it can)."""
    return None

  def describe(self) -> str | None:
    """What the loop says once before step 1 about it (None: nothing)."""
    return None

  def trainable(self, value) -> np.ndarray | None:
    """Which of a sample's response tokens the loss may train on, from its value (None: all; e.g.
    a trajectory's `turn`: the model's tokens, not the environment's)."""
    return None


_REGISTRY: dict[str, type[TokenExtra]] = {}


def register(cls: type[TokenExtra]) -> type[TokenExtra]:
  """Adds a kind of extra to the registry (a class decorator); its `name` must be new."""
  if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
    raise ValueError(f"a per-token extra named {cls.name!r} is already registered")
  _REGISTRY[cls.name] = cls
  return cls


def unregister(name: str) -> None:
  """Removes a kind from the registry (a test's toy extra)."""
  _REGISTRY.pop(name, None)


def registered() -> dict[str, type[TokenExtra]]:
  """Every registered kind, by name, in registration order (the record columns' order)."""
  return dict(_REGISTRY)


def active(rollout: settings.RolloutSettings, model_config) -> tuple[TokenExtra, ...]:
  """The extras a run uses, decided once from its rollout settings (`settings.derive`) and model."""
  return tuple(e for e in (cls.activate(rollout, model_config) for cls in _REGISTRY.values()) if e is not None)


def pack(extra: TokenExtra, samples, packing, shape: tuple[int, ...]) -> np.ndarray:
  """Every sample's `extras[extra.name]` placed at its input positions, packed like the tokens:
  `shape + value.shape[1:]`, `extra.fill` elsewhere."""
  per_seq = []
  for s in samples:
    value = np.asarray(s.extras[extra.name], extra.dtype)
    if extra.span == "response":
      rows = np.full((len(s.prompt_ids) + len(s.response_ids) - 1,) + value.shape[1:], extra.fill, extra.dtype)
      rows[len(s.prompt_ids) - 1 :] = value
      value = rows
    per_seq.append(value)
  trailing = per_seq[0].shape[1:] if per_seq else ()
  return packing.pack(per_seq, extra.fill, extra.dtype).reshape(tuple(shape) + trailing)


def trainable(extras: tuple[TokenExtra, ...], samples, trained=None) -> list[np.ndarray] | None:
  """Per sample, the response tokens the loss trains on: `trained`'s (None: all) that every extra's
  `trainable` keeps. None when no extra restricts them and `trained` is None."""
  masking = [e for e in extras if type(e).trainable is not TokenExtra.trainable]
  if not masking:
    return trained
  out = []
  for k, s in enumerate(samples):
    keep = np.ones(len(s.response_ids), bool) if trained is None else np.array(trained[k], bool)
    for e in masking:
      if e.name in s.extras:
        keep &= np.asarray(e.trainable(s.extras[e.name]), bool)
    out.append(keep)
  return out


def model_inputs(extras: tuple[TokenExtra, ...], packed: Mapping[str, Any], place=lambda x: x) -> dict:
  """The `ModelInputs` keyword arguments the active extras feed (`packed`: a step batch's
  `extras`, each `place`d): their named fields, and the others in `extra`."""
  out, other = {}, {}
  for e in extras:
    if e.model_input is None:
      continue
    if e.model_input in ("support", "routing"):
      out[e.model_input] = place(packed[e.name])
    else:
      other[e.model_input] = place(packed[e.name])
  if other:
    out["extra"] = other
  return out


def _bad_logprob(lp) -> bool:
  return (
    lp is None or isinstance(lp, (bool, list)) or not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 1e-4
  )


# --- the extras ----------------------------------------------------------------------------------
@register
class SamplingSupport(TokenExtra):
  """Sampling-mask replay (SGLang's `return_sampling_mask`): each response token's support (the
  kept ids, int32 `[response, width]`, `-1` padded); the behaviour log-probs are then SGLang's
  `output_token_sampling_logprobs`, renormalised over it. Fed as `ModelInputs.support`: every
  trainer log-prob is over the support."""

  name = "sampling_mask"
  request = {"return_sampling_mask": True}  # the behaviour log-prob of each token and its support (selected mode)
  missing = NoSamplingMask
  what = "sampling-mask"
  fill, dtype, model_input = -1, np.int32, "support"
  missing_column = "which sampling replay needs (set rollout.sampling.sampling_replay: off to replay without it)"

  def __init__(self, width: int, rollout=None):
    self.width, self.rollout = width, rollout

  @classmethod
  def activate(cls, rollout, model_config):
    width = rollout.sampling_replay_width
    return cls(width, rollout.section) if width else None

  @staticmethod
  def record_type():
    import pyarrow as pa

    return pa.list_(pa.list_(pa.int32()))

  def parse(self, reply: Reply):
    info, ids = reply.info, reply.ids
    masks = info.output_token_sampling_mask
    if masks is None:
      raise NoSamplingMask(
        "the reply has no meta_info.output_token_sampling_mask although return_sampling_mask "
        "was requested: the server does not return sampling masks (SGLang >= 0.5.23 does); "
        "set rollout.sampling.sampling_replay: off to train without them (the IS ratio is then "
        "biased by the kept mass)"
      )
    sampled = info.output_token_sampling_logprobs
    if len(masks) != len(ids) or sampled is None or len(sampled) != len(ids):
      return (
        f"length mismatch: {len(ids)} output_ids but {len(masks)} output_token_sampling_mask and "
        f"{'no' if sampled is None else len(sampled)} output_token_sampling_logprobs"
      )
    for i, (mask, tok, lp) in enumerate(zip(masks, ids, sampled)):
      if tok not in mask:
        return f"response token {i} ({tok}) is not in its sampling mask"
      if len(mask) > self.width:
        return (
          f"sampling mask of {len(mask)} tokens at response token {i} exceeds the support width "
          f"{self.width} (rollout.sampling.top_k; ties at the cutoff can exceed it)"
        )
      if _bad_logprob(lp):
        return f"invalid sampling log-prob {lp!r} at response token {i} (selected mode: one float per token)"
    return self.from_record(masks, reply.prompt_len, len(ids))

  def logprobs(self, reply: Reply):
    return [float(v) for v in reply.info.output_token_sampling_logprobs]

  def to_record(self, value):
    return [row[row >= 0].tolist() for row in np.asarray(value)]

  def from_record(self, value, prompt_len, response_len):
    out = np.full((len(value), self.width), -1, np.int32)
    for row, ids in zip(out, value):
      row[: len(ids)] = ids
    return out

  def describe(self):
    r = self.rollout
    return (
      None
      if r is None
      else f"sampling replay on (top_k {r.sampling.top_k}, top_p {r.sampling.top_p}, min_p {r.sampling.min_p}): "
      "behaviour log-probs from the "
      "server's sampling masks; log-probs, entropy and KL over each token's support"
    )


@register
class RoutedExperts(TokenExtra):
  """Routed experts of a mixture-of-experts model (SGLang's `return_routed_experts`, R3): int32
  `[prompt + response - 1, layers, k]`, row i the experts the server routed the token at input
  position i to; fed as `ModelInputs.routing` (replayed) with `rollout.sampling.routing_replay: r3`, recorded
  and compared with the trainer's routing otherwise (`record_routing`)."""

  name = "routed_experts"
  request = {"return_routed_experts": True}  # every position's experts, per layer (R3)
  missing = NoRoutedExperts
  what = "routed-experts"
  span, fill, dtype = "sequence", -1, np.int32
  missing_column = (
    "which routing replay r3 and record_routing need (set rollout.sampling.routing_replay: none, record_routing: null)"
  )

  def __init__(self, spec: RoutingSpec, replay: str = "r3"):
    self.spec, self.replay = spec, replay
    self.model_input = "routing" if replay == "r3" else None

  @classmethod
  def activate(cls, rollout, model_config):
    spec = rollout.routing_spec
    return None if spec is None else cls(spec, rollout.routing_replay)

  @staticmethod
  def record_type():
    import pyarrow as pa

    return pa.list_(pa.int32())

  def probe_params(self, sampling_params):
    return {"max_new_tokens": 1, "temperature": 0.0}

  def parse(self, reply: Reply):
    return decode_sample_routing(reply.info, reply.prompt_len + len(reply.ids), self.spec)

  def to_record(self, value):
    return np.asarray(value).reshape(-1).tolist()

  def from_record(self, value, prompt_len, response_len):
    return np.asarray(value, np.int32).reshape(-1, self.spec.num_layers, self.spec.top_k)

  def check_record(self, value, prompt_len, response_len):
    spec = self.spec
    want = (prompt_len + response_len - 1) * spec.num_layers * spec.top_k
    if value is None or len(value) != want or (want and not 0 <= min(value) <= max(value) < spec.num_experts):
      return (
        f"column 'routed_experts' has {0 if value is None else len(value)} ids, expected "
        f"{want} in [0, {spec.num_experts}) (tokens - 1 rows x num_hidden_layers {spec.num_layers} x "
        f"num_experts_per_tok {spec.top_k})"
      )
    return None

  def describe(self):
    what = {
      "r3": "replayed (R3) in the old-log-prob pass and every training forward",
      "r2": "compared with the trainer's; the trainer's old-pass routing is replayed (R2)",
      "none": "compared with the trainer's",
    }
    return f"routed experts from the server: {what[self.replay]}"


class _SamplerTopK(TokenExtra):
  """The sampler's top-k head per response token (SGLang's `top_logprobs_num` →
  `meta_info.output_top_logprobs`, `[[logprob, id, text|null], ...]` per output token): `k`
  columns of one part of it (`part`: 0 the log-probs, 1 the ids). Score centering (contract §6.6)
  reads both: the ids in the training forward's chunked pass, the log-probs in the loss."""

  part: ClassVar[int]
  what = "top-logprobs"
  missing_column = "which loss.score_centering needs (rollout.sampling.top_logprobs_num)"

  def __init__(self, k: int, vocab_size: int):
    self.k, self.vocab_size = k, vocab_size
    self.request = {"top_logprobs_num": k}

  @classmethod
  def activate(cls, rollout, model_config):
    k = rollout.sampling.top_logprobs_num
    return cls(k, model_config.vocab_size) if k > 0 else None

  @classmethod
  def record_type(cls):
    import pyarrow as pa

    return pa.list_(pa.list_(pa.float32() if cls.part == 0 else pa.int32()))

  def parse(self, reply: Reply):
    rows, n = reply.info.output_top_logprobs, len(reply.ids)
    if rows is None:
      raise ServerError(
        "the reply has no meta_info.output_top_logprobs although top_logprobs_num was requested: "
        "the server does not return the sampler's top-k log-probs; set "
        "rollout.sampling.top_logprobs_num: 0 and loss.score_centering: false"
      )
    if len(rows) != n:
      return f"length mismatch: {n} output_ids but {len(rows)} output_top_logprobs"
    out = np.zeros((n, self.k), self.dtype)
    for i, row in enumerate(rows):
      if not isinstance(row, list) or len(row) != self.k:
        return f"output_top_logprobs[{i}] has {len(row) if isinstance(row, list) else 'no'} entries, expected {self.k}"
      for j, entry in enumerate(row):
        if not (
          isinstance(entry, list) and len(entry) >= 2 and isinstance(entry[1], int) and 0 <= entry[1] < self.vocab_size
        ):
          return f"output_top_logprobs[{i}][{j}] is not [logprob, token_id in [0, {self.vocab_size}), ...]"
        if _bad_logprob(entry[0]):
          return f"invalid top log-prob {entry[0]!r} at output_top_logprobs[{i}][{j}]"
        out[i, j] = entry[self.part]
    return out

  def from_record(self, value, prompt_len, response_len):
    return np.asarray(value, self.dtype).reshape(-1, self.k)

  def check_record(self, value, prompt_len, response_len):
    if value is None or len(value) != response_len or any(len(row) != self.k for row in value):
      return (
        f"column '{self.name}' has {0 if value is None else len(value)} rows, expected {response_len} rows of "
        f"{self.k} (rollout.sampling.top_logprobs_num)"
      )
    return None


@register
class SamplerTopLogprobs(_SamplerTopK):
  """The sampler's top-k log-probs, float32 `[response, k]`: `PackedBatch.rollout_topk_logprobs`."""

  name, part, dtype, fill = "top_logprobs", 0, np.float32, 0.0
  batch_field = "rollout_topk_logprobs"

  def describe(self):
    return f"the sampler's top-{self.k} log-probs per token (score centering, contract §6.6)"


@register
class SamplerTopIds(_SamplerTopK):
  """The ids of the sampler's top-k, int32 `[response, k]`: `ModelInputs.extra["top_logprob_ids"]`,
  whose log-probs the training forward gathers in its chunked pass (`token_logprobs(extra_ids=)`)."""

  name, part, dtype, fill = "top_logprob_ids", 1, np.int32, 0
  model_input = "top_logprob_ids"


def decode_sample_routing(meta, num_tokens: int, routing: RoutingSpec) -> np.ndarray:
  """A reply's `routed_experts` → `[num_tokens - 1, layers, k]` int32; raises
  :class:`NoRoutedExperts` when there are none or they do not fit the model."""
  if meta.routed_experts is None:
    raise NoRoutedExperts(
      "the reply has no meta_info.routed_experts although return_routed_experts was requested: "
      "start the SGLang server with --enable-return-routed-experts (mis-jax serve takes the same "
      "flag), or set rollout.sampling.routing_replay: none and rollout.sampling.record_routing: false"
    )
  try:
    experts = protocol.decode_routed_experts(
      meta.routed_experts, routing.num_layers, routing.top_k, meta.routed_experts_dtype
    )
  except protocol.ContractError as e:
    raise NoRoutedExperts(
      f"routed experts do not fit the model (num_hidden_layers {routing.num_layers}, "
      f"num_experts_per_tok {routing.top_k}): {e}"
    ) from None
  if experts.shape[0] != num_tokens - 1:
    raise NoRoutedExperts(
      f"routed experts have {experts.shape[0]} rows for a sequence of {num_tokens} tokens "
      f"(expected {num_tokens - 1} rows of [num_hidden_layers {routing.num_layers}, "
      f"num_experts_per_tok {routing.top_k}]): the server's model differs from the trainer's"
    )
  if experts.size and (experts.min() < 0 or experts.max() >= routing.num_experts):
    raise NoRoutedExperts(
      f"routed experts hold ids outside [0, {routing.num_experts}) (min {experts.min()}, max "
      f"{experts.max()}): the server's model differs from the trainer's"
    )
  return experts
