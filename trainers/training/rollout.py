"""What a rollout is to the trainer (contract §11): a validated `Sample` per completion, a
`RolloutResult` per batch, and the errors an engine raises.

Every sample is validated before the trainer sees it (`validate_sample`): malformed samples are
rejected and counted, aborted ones dropped and counted, and never trained on. The client that
asks the engines for them is `trainers.training.sglang_client.SGLangClient`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from trainers.serving import protocol


class ServerError(RuntimeError):
  """The server could not be used (unreachable, failing, or rejecting requests). `status`: the
  HTTP status of a rejected request (4xx), else None."""

  def __init__(self, message: str, status: int | None = None):
    super().__init__(message)
    self.status = status


class ServerUnavailable(ServerError):
  """A server failed past its retries (connection errors, timeouts, HTTP 5xx): down or restarting."""


class NoSamplingMask(ServerError):
  """Sampling masks were asked for and the server returned none: it cannot replay them."""


class NoRoutedExperts(ServerError):
  """Routed experts were asked for and the server returned none (or ones that do not fit the model)."""


@dataclasses.dataclass(frozen=True)
class RoutingSpec:
  """What routed experts must look like: `[rows, num_layers, top_k]` ids in `[0, num_experts)`."""
  num_layers: int
  top_k: int
  num_experts: int


@dataclasses.dataclass(frozen=True)
class Sample:
  """One validated completion of one prompt."""

  prompt_index: int
  prompt_ids: tuple[int, ...]
  response_ids: tuple[int, ...]
  rollout_logprobs: tuple[float, ...]
  finish_reason: str
  text: str
  weight_version: str | None  # the version of its last token
  weight_versions: tuple[tuple[str, int, int], ...] = ()  # SGLang's spans: (version, start, end)
  # With sampling-mask replay: each response token's support (kept ids); `rollout_logprobs`
  # are then the behaviour log-probs, renormalised over it.
  sampling_mask: tuple[tuple[int, ...], ...] | None = None
  # With routed experts (MoE, R3): int32 `[len(prompt) + len(response) - 1, layers, k]`, row i
  # the experts the server routed the token at position i to.
  routed_experts: np.ndarray | None = dataclasses.field(default=None, compare=False)

  @property
  def oldest_version(self) -> str | None:
    """The version of its first token (a sample that straddled an update spans two)."""
    return self.weight_versions[0][0] if self.weight_versions else self.weight_version


@dataclasses.dataclass
class RolloutResult:
  samples: list[Sample]
  num_requested: int
  num_aborted: int = 0
  num_rejected: int = 0
  rejection_reasons: list[str] = dataclasses.field(default_factory=list)
  rewards: list[float] | None = None  # recorded with the samples (a replay of rollout records)

  def to_json(self) -> dict:
    """A JSON-able copy (broadcast from process 0 to the other trainer processes)."""
    return {"samples": [tuple(getattr(s, f.name) for f in dataclasses.fields(Sample) if f.name != "routed_experts")
                        + (_routing_json(s.routed_experts),) for s in self.samples],
            "num_requested": self.num_requested,
            "num_aborted": self.num_aborted, "num_rejected": self.num_rejected,
            "rejection_reasons": self.rejection_reasons[:20]}

  @classmethod
  def from_json(cls, d: dict) -> "RolloutResult":
    samples = [Sample(p, tuple(ids), tuple(resp), tuple(lps), fin, text, ver, tuple(tuple(x) for x in spans),
                      None if masks is None else tuple(tuple(m) for m in masks), _routing_from_json(routed))
               for p, ids, resp, lps, fin, text, ver, spans, masks, routed in d["samples"]]
    return cls(samples, d["num_requested"], d["num_aborted"], d["num_rejected"], list(d["rejection_reasons"]))


def _routing_json(x):
  return None if x is None else [protocol.encode_routed_experts(x), *x.shape[1:]]


def _routing_from_json(x):
  return None if x is None else protocol.decode_routed_experts(x[0], x[1], x[2])


def decode_sample_routing(meta, num_tokens: int, routing: RoutingSpec) -> np.ndarray:
  """A reply's `routed_experts` → `[num_tokens - 1, layers, k]` int32; raises
  :class:`NoRoutedExperts` when there are none or they do not fit the model."""
  if meta.routed_experts is None:
    raise NoRoutedExperts("the reply has no meta_info.routed_experts although return_routed_experts was requested: "
                          "start the SGLang server with --enable-return-routed-experts (mis-jax serve takes the same "
                          "flag), or set rollout.routing_replay: none and rollout.record_routing: false")
  try:
    experts = protocol.decode_routed_experts(meta.routed_experts, routing.num_layers, routing.top_k,
                                             meta.routed_experts_dtype)
  except protocol.ContractError as e:
    raise NoRoutedExperts(f"routed experts do not fit the model (num_hidden_layers {routing.num_layers}, "
                          f"num_experts_per_tok {routing.top_k}): {e}") from None
  if experts.shape[0] != num_tokens - 1:
    raise NoRoutedExperts(f"routed experts have {experts.shape[0]} rows for a sequence of {num_tokens} tokens "
                          f"(expected {num_tokens - 1} rows of [num_hidden_layers {routing.num_layers}, "
                          f"num_experts_per_tok {routing.top_k}]): the server's model differs from the trainer's")
  if experts.size and (experts.min() < 0 or experts.max() >= routing.num_experts):
    raise NoRoutedExperts(f"routed experts hold ids outside [0, {routing.num_experts}) (min {experts.min()}, max "
                          f"{experts.max()}): the server's model differs from the trainer's")
  return experts


def validate_sample(item: Any, *, support_width: int = 0, routing: RoutingSpec | None = None,
                    prompt_len: int = 0) -> tuple[str | None, dict | None]:
  """Checks one SGLang ``/generate`` result; returns ``(error, parsed)`` (one of them None).

  Parsed with the shared protocol models (``trainers.serving.protocol``): every finish-reason form,
  aborts with or without partial tokens, ``weight_version`` and ``weight_versions`` spans.
  With ``support_width`` (sampling-mask replay), the reply must carry one support per token
  (raises :class:`NoSamplingMask` when it carries none), each holding its token and at most
  ``support_width`` ids; the parsed log-probs are then ``output_token_sampling_logprobs``.
  With ``routing`` (routed experts asked for), the reply must carry them for its
  ``prompt_len`` + response tokens (raises :class:`NoRoutedExperts` otherwise).
  """
  if not isinstance(item, dict):
    return f"sample is {type(item).__name__}, not an object", None
  try:
    result = protocol.parse_generate_result(item)
  except protocol.ContractError as e:
    return f"malformed sample: {e}", None
  ids, meta = result.output_ids, result.meta_info
  if ids is None:
    return "missing output_ids", None
  if meta is None:
    return "missing meta_info", None
  finish = meta.finish_reason
  kind = finish.type if finish is not None else None
  if kind not in ("stop", "length", "abort"):
    return f"unknown finish_reason {item['meta_info'].get('finish_reason')!r}", None
  if kind == "abort":
    return None, {"aborted": True, "message": finish.message}
  lps = meta.output_token_logprobs
  if lps is None:
    return "missing meta_info.output_token_logprobs", None
  if len(lps) != len(ids):
    return f"length mismatch: {len(ids)} output_ids but {len(lps)} output_token_logprobs", None
  values = []
  for i, (entry, tok) in enumerate(zip(lps, ids)):
    if not isinstance(entry, (list, tuple)) or len(entry) < 2:
      return f"output_token_logprobs[{i}] is not [logprob, token_id, ...]", None
    lp, entry_tok = entry[0], entry[1]
    if entry_tok != tok:
      return f"output_token_logprobs[{i}] is for token {entry_tok}, output_ids has {tok}", None
    if lp is None or isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 1e-4:
      return f"invalid log-prob {lp!r} at response token {i}", None
    values.append(float(lp))
  if not ids:
    return "empty response", None
  masks = None
  if support_width:
    masks = meta.output_token_sampling_mask
    if masks is None:
      raise NoSamplingMask("the reply has no meta_info.output_token_sampling_mask although return_sampling_mask "
                           "was requested: the server does not return sampling masks (SGLang >= 0.5.23 does); "
                           "set rollout.sampling_replay: off to train without them (the IS ratio is then "
                           "biased by the kept mass)")
    sampled = meta.output_token_sampling_logprobs
    if len(masks) != len(ids) or sampled is None or len(sampled) != len(ids):
      return (f"length mismatch: {len(ids)} output_ids but {len(masks)} output_token_sampling_mask and "
              f"{'no' if sampled is None else len(sampled)} output_token_sampling_logprobs"), None
    for i, (mask, tok, lp) in enumerate(zip(masks, ids, sampled)):
      if tok not in mask:
        return f"response token {i} ({tok}) is not in its sampling mask", None
      if len(mask) > support_width:
        return (f"sampling mask of {len(mask)} tokens at response token {i} exceeds the support width "
                f"{support_width} (rollout.top_k; ties at the cutoff can exceed it)"), None
      if lp is None or isinstance(lp, (bool, list)) or not isinstance(lp, (int, float)) or not math.isfinite(lp) \
          or lp > 1e-4:
        return f"invalid sampling log-prob {lp!r} at response token {i} (selected mode: one float per token)", None
    values = [float(v) for v in sampled]
    masks = tuple(tuple(m) for m in masks)
  # The version that generated the last token (SGLang reports spans when weights changed
  # mid-sample); `weight_version` alone otherwise.
  version = meta.weight_versions[-1].version if meta.weight_versions else meta.weight_version
  routed = None if routing is None else decode_sample_routing(meta, prompt_len + len(ids), routing)
  return None, {"routed_experts": routed,"aborted": False, "ids": tuple(ids), "logprobs": tuple(values), "finish": kind,
                "text": result.text if isinstance(result.text, str) else "",
                "weight_version": version,
                "weight_versions": tuple((s.version, s.start, s.end) for s in meta.weight_versions),
                "sampling_mask": masks}


def sample_seeds(seed: int, num_prompts: int, n: int, offset: int = 0) -> list[int]:
  """One ``sampling_seed`` per sample (prompt-major): SGLang copies a request's seed to all of
  its ``n`` samples, so a group sent with one seed would be ``n`` identical samples."""
  return [(seed * 1_000_003 + offset + k) % 2**31 for k in range(num_prompts * n)]
