"""Where the trainer talks to the SGLang server(s): generation and weight sync (contract §11).

Only the configured URLs are ever contacted. Transient faults (connection errors, timeouts,
HTTP 5xx) are retried a bounded number of times with exponential backoff; HTTP 4xx is not
retried and the server's message is shown. Every sample is validated before the trainer sees
it: malformed samples are rejected and counted, aborted ones dropped and counted, and never
trained on.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import httpx
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


class SGLangClient:
  """HTTP client for one or more SGLang servers (or a router), over the native API.

  Args:
    urls: base URLs (``http://host:port``); requests round-robin over them.
    timeout_s: per-request timeout.
    max_retries: retries of a transient failure (connection error, timeout, 5xx).
    backoff_s: first backoff; doubles every retry.
    max_concurrency: requests in flight at once (a bounded thread pool and connection pool).
    prompts_per_request: prompts batched into one ``/generate`` call.
    cache_salt: every ``/generate`` carries SGLang's ``extra_key`` (its prefix-cache namespace),
      naming the weights the request starts under; each weight update begun moves new requests
      to a fresh one (:meth:`begin_weights`), so no engine can match a prefix computed under
      other weights for them.
  """

  def __init__(self, urls: Sequence[str], *, timeout_s: float = 120.0, max_retries: int = 3,
               backoff_s: float = 0.5, max_concurrency: int = 4, prompts_per_request: int = 8,
               cache_salt: bool = True):
    if not urls:
      raise ValueError("at least one SGLang URL is needed")
    self.urls = [u.rstrip("/") for u in urls]
    for u in self.urls:
      if not u.startswith(("http://", "https://")):
        raise ValueError(f"SGLang URL {u!r} must start with http:// or https://")
    self._http = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=max_concurrency,
                                                                     max_keepalive_connections=max_concurrency))
    self._init_requests(max_retries=max_retries, backoff_s=backoff_s, max_concurrency=max_concurrency,
                        prompts_per_request=prompts_per_request, cache_salt=cache_salt)

  def _init_requests(self, *, max_retries: int, backoff_s: float, max_concurrency: int, prompts_per_request: int,
                     cache_salt: bool = True):
    """What every transport shares: retries, the request pool, round-robin, the down set and the
    cache salt."""
    # The salt: this client's own token, the updates it has begun and the version they load.
    self._salt_prefix = f"mis-jax:{uuid.uuid4().hex[:8]}" if cache_salt else None
    self._updates_begun = 0
    self.cache_salt: str | None = None
    self.begin_weights("start", first=True)
    self.max_retries, self.backoff_s = max_retries, backoff_s
    self.prompts_per_request = prompts_per_request
    self._pool = ThreadPoolExecutor(max_workers=max_concurrency)
    self._next = itertools.count()
    self._down: set[str] = set()  # servers that failed past their retries, until readmitted
    self._lock = threading.Lock()

  def begin_weights(self, version: str, *, first: bool = False) -> None:
    """Requests sent from now on go to the prefix-cache namespace of weights `version`: called
    before every pause for an update (so a request held by the pause and started under the new
    weights never shares the old namespace). A fresh namespace at every update, even of the same
    version: a restarted or re-pushed server may have held other weights in between."""
    if self._salt_prefix is not None:
      self._updates_begun += 0 if first else 1
      self.cache_salt = f"{self._salt_prefix}:{self._updates_begun}:w{version}"

  # --- which servers are up ------------------------------------------------------------
  def live_urls(self) -> list[str]:
    with self._lock:
      return [u for u in self.urls if u not in self._down]

  def down_urls(self) -> list[str]:
    with self._lock:
      return [u for u in self.urls if u in self._down]

  def mark_down(self, url: str) -> None:
    with self._lock:
      self._down.add(url)

  def readmit(self, url: str) -> None:
    with self._lock:
      self._down.discard(url)

  def is_healthy(self, url: str, timeout_s: float = 5.0) -> bool:
    """One `/health` poll: 200 within `timeout_s`."""
    try:
      return self._http.get(url + "/health", timeout=timeout_s).status_code == 200
    except httpx.TransportError:
      return False

  def _pick(self) -> str:
    live = self.live_urls()
    if not live:
      raise ServerUnavailable(f"every server is down ({', '.join(self.urls)})")
    return live[next(self._next) % len(live)]

  def close(self):
    self._pool.shutdown(wait=True)
    self._http.close()

  # --- plumbing ------------------------------------------------------------------------
  def _request(self, method: str, url: str, path: str, body=None):
    delay, last = self.backoff_s, None
    for attempt in range(self.max_retries + 1):
      try:
        resp = self._http.request(method, url + path, json=body)
      except httpx.TransportError as e:  # connection refused/reset, timeouts
        last = f"{type(e).__name__}: {e}"
      else:
        if resp.status_code < 400:
          try:
            return resp.json() if resp.content else None
          except ValueError:
            return resp.text
        if resp.status_code < 500:
          raise ServerError(f"{url}{path} rejected the request (HTTP {resp.status_code}): {_message(resp)}",
                            status=resp.status_code)
        last = f"HTTP {resp.status_code}: {_message(resp)}"
      if attempt < self.max_retries:
        time.sleep(delay)
        delay *= 2
    raise ServerUnavailable(f"{url}{path} failed after {self.max_retries + 1} attempts: {last}")

  # --- health --------------------------------------------------------------------------
  def wait_until_healthy(self, *, attempts: int = 30, backoff_s: float = 0.5, max_backoff_s: float = 5.0):
    """Polls ``/health`` on every URL with bounded retries and backoff."""
    for url in self.urls:
      delay, last = backoff_s, None
      for _ in range(attempts):
        try:
          if self._http.get(url + "/health").status_code == 200:
            break
          last = "not healthy yet"
        except httpx.TransportError as e:
          last = f"{type(e).__name__}: {e}"
        time.sleep(delay)
        delay = min(delay * 2, max_backoff_s)
      else:
        raise ServerError(f"SGLang server at {url} is unreachable after {attempts} attempts ({last})")

  def model_info(self, url: str | None = None) -> dict:
    """`GET /model_info`, or `/get_model_info` where the first is missing (HTTP 404: older SGLang
    releases and sglang-jax have only the second, without `weight_version`)."""
    return self._get_either(url or self.urls[0], "/model_info", "/get_model_info")

  def server_info(self, url: str | None = None) -> dict:
    """`GET /server_info` (or `/get_server_info`): the server's arguments (`dtype`, ...)."""
    return self._get_either(url or self.urls[0], "/server_info", "/get_server_info")

  def _get_either(self, url: str, path: str, fallback: str) -> dict:
    try:
      out = self._request("GET", url, path)
    except ServerError as e:
      if e.status not in (404, 405):
        raise
      out = self._request("GET", url, fallback)
    return out if isinstance(out, dict) else {}

  def has_weight_update_route(self, url: str) -> bool:
    """Whether `url` has `POST /update_weights_from_disk`, asked with an empty body (a request
    that route rejects as malformed, HTTP 4xx other than 404/405, without loading anything)."""
    try:
      self._request("POST", url, "/update_weights_from_disk", {})
    except ServerError as e:
      if e.status in (404, 405):
        return False
      if e.status is None:
        raise
    return True

  def check_routed_experts(self, routing: RoutingSpec) -> None:
    """Asks every server for one token with ``return_routed_experts``; raises
    :class:`NoRoutedExperts` (naming the URL and the flag) if one returns none or ones that
    do not fit the model."""
    for url in self.urls:
      body = protocol.generate_body([[0]], {"max_new_tokens": 1, "temperature": 0.0}, return_routed_experts=True)
      reply = self._request("POST", url, "/generate", body)
      reply = reply[0] if isinstance(reply, list) and reply else reply
      try:
        result = protocol.parse_generate_result(reply)
        decode_sample_routing(result.meta_info, 1 + len(result.output_ids or []), routing)
      except protocol.ContractError as e:
        raise NoRoutedExperts(f"{url}/generate: malformed reply to a routed-experts probe: {e}") from None
      except NoRoutedExperts as e:
        raise NoRoutedExperts(f"{url}/generate: {e}") from None

  def check_sampling_masks(self, sampling_params: dict, support_width: int) -> None:
    """Asks every server for one token with ``return_sampling_mask`` under the run's sampling
    params; raises :class:`NoSamplingMask` (naming the URL and `rollout.sampling_replay: off`)
    if one returns no masks, before any step."""
    params = {**sampling_params, "max_new_tokens": 1}
    for url in self.urls:
      body = protocol.generate_body([[0]], params, return_sampling_mask=True)
      reply = self._request("POST", url, "/generate", body)
      reply = reply[0] if isinstance(reply, list) and reply else reply
      try:
        error, _ = validate_sample(reply, support_width=support_width, prompt_len=1)
      except NoSamplingMask as e:
        raise NoSamplingMask(f"{url}/generate: {e}") from None
      if error is not None:
        raise NoSamplingMask(f"{url}/generate: malformed reply to a sampling-mask probe: {error}")

  # --- generation ----------------------------------------------------------------------
  def generate(self, prompts: Sequence[Sequence[int]], sampling_params: dict, *, n: int = 1,
               seed: int | None = None, support_width: int = 0, routing: RoutingSpec | None = None) -> RolloutResult:
    """``n`` samples for every prompt; results come back prompt-major (contract §11). With
    ``seed``, sample ``k`` (prompt-major) is sent with ``sampling_seed = sample_seeds(seed)[k]``.
    With ``support_width > 0`` the servers are asked for sampling masks (``return_sampling_mask``)
    and each sample carries its supports and behaviour log-probs (:func:`validate_sample`).
    With ``routing`` they are asked for routed experts (``return_routed_experts``), which each
    sample carries."""
    chunks = [list(range(i, min(i + self.prompts_per_request, len(prompts))))
              for i in range(0, len(prompts), self.prompts_per_request)]

    protocol.generate_body([], sampling_params, n=n)  # a bad key fails here, before any request

    def call(idx):
      seeds = None if seed is None else sample_seeds(seed, len(idx), n, offset=idx[0] * n)
      body = protocol.generate_body([prompts[i] for i in idx], sampling_params, n=n, seeds=seeds,
                                    return_sampling_mask=support_width > 0,
                                    return_routed_experts=routing is not None, extra_key=self.cache_salt)
      while True:  # a server down past its retries: the chunk goes to a live one
        url = self._pick()
        try:
          return idx, url, self._request("POST", url, "/generate", body)
        except ServerUnavailable as e:
          self.mark_down(url)
          if not self.live_urls():
            raise ServerUnavailable(f"{e} (no other server is up)") from None

    result = RolloutResult(samples=[], num_requested=len(prompts) * n)
    for idx, url, out in self._pool.map(call, chunks):
      if not isinstance(out, list) or len(out) != len(idx) * n:
        got = len(out) if isinstance(out, list) else type(out).__name__
        result.num_rejected += len(idx) * n
        result.rejection_reasons.append(f"expected {len(idx) * n} results, got {got}")
        continue
      for j, item in enumerate(out):
        p = idx[j // n]
        try:
          error, parsed = validate_sample(item, support_width=support_width, routing=routing,
                                          prompt_len=len(prompts[p]))
        except (NoSamplingMask, NoRoutedExperts) as e:
          raise type(e)(f"{url}/generate: {e}") from None
        if error is not None:
          result.num_rejected += 1
          result.rejection_reasons.append(error)
        elif parsed["aborted"]:
          result.num_aborted += 1
        else:
          result.samples.append(Sample(prompt_index=p, prompt_ids=tuple(prompts[p]), response_ids=parsed["ids"],
                                       rollout_logprobs=parsed["logprobs"], finish_reason=parsed["finish"],
                                       text=parsed["text"], weight_version=parsed["weight_version"],
                                       weight_versions=parsed["weight_versions"],
                                       sampling_mask=parsed["sampling_mask"],
                                       routed_experts=parsed["routed_experts"]))
    return result

  # --- weight sync ---------------------------------------------------------------------
  def update_weights_from_disk(self, model_path: str, weight_version: str, *, attempts: int = 3,
                               pause_mode: str = "abort", urls: Sequence[str] | None = None) -> dict[str, float]:
    """contract §11 sequence on every server, all servers concurrently: pause (``pause_mode``:
    ``abort`` ends in-flight requests, ``retract`` keeps them for after the update), flush,
    update, verify, continue.

    ``urls``: those servers only (default: every live one, or every one when none is up). Retries the update a bounded number
    of times; raises :class:`ServerError` if a server keeps answering ``success: false`` or its
    ``weight_version`` does not change, so training never goes on against unknown weights. A
    server that fails past its retries is marked down (it gets the weights when readmitted);
    :class:`ServerUnavailable` when none took them. Returns ``{"server_load_s": slowest update
    call, "servers_paused_s": slowest pause-to-continue}``.
    """
    targets = list(urls) if urls is not None else (self.live_urls() or self.urls)  # none up: try them all
    self.begin_weights(weight_version)

    def update(url):
      try:
        loaded = self._update_one(url, model_path, weight_version, attempts, pause_mode)
      except ServerUnavailable as e:
        self.mark_down(url)
        return e
      self.readmit(url)  # it holds the weights pushed to every live server
      return loaded
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
      outcomes = list(pool.map(update, targets))
    times = [t for t in outcomes if not isinstance(t, ServerUnavailable)]
    if not times:
      raise outcomes[0]
    return {"server_load_s": max(t[0] for t in times), "servers_paused_s": max(t[1] for t in times)}

  def _update_one(self, url, model_path, weight_version, attempts, pause_mode) -> tuple[float, float]:
    t_pause = time.perf_counter()
    self._request("POST", url, "/pause_generation", {"mode": pause_mode})
    try:
      try:
        self._request("POST", url, "/flush_cache", {})
      except ServerError as e:  # SGLang refuses while retracted requests wait; the update flushes itself
        if e.status != 400:
          raise
      last = None
      t_load = time.perf_counter()
      for _ in range(attempts):
        try:  # SGLang answers a failed update with success: false (HTTP 400): retry it
          reply = self._request("POST", url, "/update_weights_from_disk",
                                {"model_path": model_path, "weight_version": weight_version, "flush_cache": True})
        except ServerError as e:
          last = str(e)
          continue
        if isinstance(reply, dict) and reply.get("success"):
          info = self.model_info(url)
          if str(info.get("weight_version")) == weight_version or "weight_version" not in info:
            break  # confirmed (a server whose model info has no weight_version: its success reply)
          last = f"weight_version is {info.get('weight_version')!r} after the update, expected {weight_version!r}"
        else:
          last = reply.get("message") if isinstance(reply, dict) else repr(reply)
      else:
        raise ServerError(f"weight sync to {url} failed after {attempts} attempts: {last}")
      load = time.perf_counter() - t_load
    finally:
      self._request("POST", url, "/continue_generation", {})
    return load, time.perf_counter() - t_pause


def _message(resp: httpx.Response) -> str:
  try:
    body = resp.json()
  except ValueError:
    return resp.text[:500]
  return protocol.error_message(body)
