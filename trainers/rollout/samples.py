"""What a rollout is to the trainer (contract §11): a validated `Sample` per completion, a
`RolloutResult` per batch, and the errors an engine raises.

Every sample is validated before the trainer sees it (`validate_sample`): malformed samples are
rejected and counted, aborted ones dropped and counted, and never trained on. The client that
asks the engines for them is `trainers.rollout.client.SGLangClient`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from trainers.runtime.errors import ServerError, ServerUnavailable  # noqa: F401 - the engine errors, re-exported
from trainers.serving import protocol


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
  # The run's per-token extras (`trainers.rollout.extras`), by name: e.g. `sampling_mask` (each
  # response token's support; `rollout_logprobs` are then the behaviour log-probs, renormalised
  # over it) and `routed_experts` (int32 `[len(prompt) + len(response) - 1, layers, k]`).
  extras: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict, compare=False)
  # The environment's reward of a multi-turn trajectory (`trainers.agents`); None: the task scores it.
  reward: float | None = None

  @property
  def sampling_mask(self) -> tuple[tuple[int, ...], ...] | None:
    """Each response token's sampling support (kept ids), with sampling-mask replay."""
    mask = self.extras.get("sampling_mask")
    return None if mask is None else tuple(tuple(int(v) for v in row[row >= 0]) for row in mask)

  @property
  def routed_experts(self) -> np.ndarray | None:
    """The server's routed experts of every input position, with routed experts asked for."""
    return self.extras.get("routed_experts")

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
  # Per prompt index (n = 1) that has no sample: "aborted" or "rejected" (the episode driver's retries).
  lost: list[tuple[int, str]] = dataclasses.field(default_factory=list)
  metrics: dict = dataclasses.field(default_factory=dict)  # what generating it measured (multi-turn: agent/*)

  def to_json(self) -> dict:
    """A JSON-able copy (broadcast from process 0 to the other trainer processes)."""
    return {
      "samples": [
        tuple(getattr(s, f.name) for f in dataclasses.fields(Sample) if f.name != "extras") + (_extras_json(s.extras),)
        for s in self.samples
      ],
      "num_requested": self.num_requested,
      "num_aborted": self.num_aborted,
      "num_rejected": self.num_rejected,
      "rejection_reasons": self.rejection_reasons[:20],
      "metrics": self.metrics,
    }

  @classmethod
  def from_json(cls, d: dict) -> "RolloutResult":
    samples = [
      Sample(
        p,
        tuple(ids),
        tuple(resp),
        tuple(lps),
        fin,
        text,
        ver,
        tuple(tuple(x) for x in spans),
        _extras_from_json(extras),
        reward,
      )
      for p, ids, resp, lps, fin, text, ver, spans, reward, extras in d["samples"]
    ]
    return cls(
      samples,
      d["num_requested"],
      d["num_aborted"],
      d["num_rejected"],
      list(d["rejection_reasons"]),
      metrics=dict(d.get("metrics", {})),
    )


def _extras_json(values: Mapping[str, np.ndarray]) -> dict:
  return {k: [str(v.dtype), list(v.shape), v.reshape(-1).tolist()] for k, v in values.items()}


def _extras_from_json(d: Mapping[str, list]) -> dict[str, np.ndarray]:
  return {k: np.asarray(flat, dtype).reshape(shape) for k, (dtype, shape, flat) in d.items()}


def validate_sample(item: Any, *, extras: Sequence = (), prompt_len: int = 0) -> tuple[str | None, dict | None]:
  """Checks one SGLang ``/generate`` result; returns ``(error, parsed)`` (one of them None).

  Parsed with the shared protocol models (``trainers.serving.protocol``): every finish-reason form,
  aborts with or without partial tokens, ``weight_version`` and ``weight_versions`` spans.
  Each of the run's per-token ``extras`` (``trainers.rollout.extras.TokenExtra``) parses its part
  of the reply (the sample's ``prompt_len`` + response tokens) into ``parsed["extras"]``, or
  rejects the sample; one that cannot be returned at all raises its ``missing`` error. An extra
  may supply the behaviour log-probs (sampling-mask replay: ``output_token_sampling_logprobs``).
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
  reply = Reply(item["meta_info"], meta, tuple(ids), prompt_len)
  parsed_extras = {}
  for extra in extras:
    value = extra.parse(reply)
    if isinstance(value, str):
      return value, None
    parsed_extras[extra.name] = value
    behaviour = extra.logprobs(reply)
    if behaviour is not None:
      values = behaviour
  # The version that generated the last token (SGLang reports spans when weights changed
  # mid-sample); `weight_version` alone otherwise.
  version = meta.weight_versions[-1].version if meta.weight_versions else meta.weight_version
  return None, {
    "aborted": False,
    "ids": tuple(ids),
    "logprobs": tuple(values),
    "finish": kind,
    "text": result.text if isinstance(result.text, str) else "",
    "weight_version": version,
    "weight_versions": tuple((s.version, s.start, s.end) for s in meta.weight_versions),
    "extras": parsed_extras,
  }


@dataclasses.dataclass(frozen=True)
class Reply:
  """One `/generate` result as an extra's parser sees it (`trainers.rollout.extras.TokenExtra.parse`):
  the raw `meta_info` dict, the parsed one (`protocol.MetaInfo`), the response ids and the
  prompt's length."""

  meta: Mapping[str, Any]
  info: protocol.MetaInfo
  ids: tuple[int, ...]
  prompt_len: int


def sample_seeds(seed: int, num_prompts: int, n: int, offset: int = 0) -> list[int]:
  """One ``sampling_seed`` per sample (prompt-major): SGLang copies a request's seed to all of
  its ``n`` samples, so a group sent with one seed would be ``n`` identical samples."""
  return [(seed * 1_000_003 + offset + k) % 2**31 for k in range(num_prompts * n)]
