"""SGLang's native HTTP protocol, version 0.5.23, as typed models shared by client and server.

Followed field by field from SGLang 0.5.23 (`sglang/api/v1/api_types.py`, its machine-readable
JSON contract, and the Python server that applies it: `io_struct.GenerateReqInput`,
`tokenizer_manager`, `http_server`, `sampling_params`). A `/generate` body goes through three
stages, each with SGLang's status code and body shape:

1. JSON: a body that is not a JSON object → 400 `{"object": "error", "message", "type": "Bad
   Request", "param": null, "code": 400}` (FastAPI's validation error, re-coded to 400 by SGLang).
2. Contract (`decode_generate`): types of every known field; unknown *top-level* keys are
   ignored, unknown `sampling_params` keys rejected; `null` means "the default" → 400
   `{"error": "<message>"}`.
3. Normalisation (`normalize_generate`): batch / `n` / `rid` expansion exactly as
   `GenerateReqInput.normalize_batch_and_arguments`, then the per-request checks (context length,
   sampling ranges, `logprob_start_len`) → 400 `{"error": {"message": "<message>"}}`.

Responses are built by `meta_info(...)` with SGLang's keys in SGLang's order; the client reads
them with `parse_generate_response` and every error shape with `error_message`.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import os
import uuid
from typing import Annotated, Any, Literal, Sequence

import msgspec
import numpy as np

PROTOCOL_VERSION = "0.5.23"  # the SGLang release whose protocol this module follows
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
TOP_K_ALL = 1 << 30  # SGLang's "no top-k filter"
SAMPLING_EPS = 1e-6  # SGLang: temperatures below this are greedy
SAMPLING_MASK_MAX_TOKENS = 4096  # SGLang's --sampling-mask-max-tokens default
SAMPLING_LOGPROBS_MODES = ("selected", "support")


class ContractError(ValueError):
  """A JSON-contract violation (wrong type, unknown sampling key): 400 `{"error": message}`."""


class RequestError(ValueError):
  """A request SGLang's server rejects after decoding: `{"error": {"message": ...}}`."""

  def __init__(self, message: str, status_code: int = 400):
    super().__init__(message)
    self.status_code = status_code


# ---- request models --------------------------------------------------------------------------


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
  """`sampling_params` of `/generate` (unknown keys rejected, as SGLang)."""

  max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS  # null: up to the context length
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None
  stop_regex: str | list[str] | None = None
  temperature: float | None = 1.0
  top_p: float | None = 1.0
  top_k: int | None = TOP_K_ALL
  min_p: float | None = 0.0
  frequency_penalty: float | None = 0.0
  presence_penalty: float | None = 0.0
  repetition_penalty: float | None = 1.0
  min_new_tokens: int | None = 0
  n: int | None = 1
  json_schema: str | None = None
  regex: str | None = None
  ebnf: str | None = None
  structural_tag: str | None = None
  ignore_eos: bool | None = False
  skip_special_tokens: bool | None = True
  spaces_between_special_tokens: bool | None = True
  no_stop_trim: bool | None = False
  stream_interval: int | None = None
  logit_bias: dict[str, float] | None = None
  sampling_seed: int | None = None
  custom_params: Any = None
  beam_width: int | None = None
  watermark: dict[str, Any] | None = None
  choice: list[str] | None = None


# `null` means "SGLang's default" for these keys (the others keep `None`).
_NULL_IS_DEFAULT = {
  "temperature": 1.0,
  "top_p": 1.0,
  "top_k": TOP_K_ALL,
  "min_p": 0.0,
  "frequency_penalty": 0.0,
  "presence_penalty": 0.0,
  "repetition_penalty": 1.0,
  "min_new_tokens": 0,
  "n": 1,
  "ignore_eos": False,
  "skip_special_tokens": True,
  "spaces_between_special_tokens": True,
  "no_stop_trim": False,
}


class GenerateRequest(msgspec.Struct, kw_only=True):
  """`/generate` body (unknown top-level keys ignored, as SGLang). Token-id fields are checked
  by `decode_generate` (a list of ints or a list of lists)."""

  rid: str | list[str] | None = None
  text: str | list[str] | None = None
  input_ids: Any = None
  input_embeds: Any = None
  stream: bool | None = False
  sampling_params: SamplingParams | list[SamplingParams] | None = None
  return_logprob: bool | list[bool] | None = None
  logprob_start_len: int | list[int] | None = None
  top_logprobs_num: int | list[int] | None = None
  token_ids_logprob: Any = None
  return_hidden_states: bool | list[bool] | None = None
  return_text_in_logprobs: bool | None = None
  return_prompt_token_ids: bool = False
  image_data: Any = None
  video_data: Any = None
  audio_data: Any = None
  lora_path: str | list[str | None] | None = None
  custom_logit_processor: str | list[str | None] | None = None
  # Typed by SGLang's contract (a wrong type is a 400) but without effect here.
  bootstrap_host: str | list[str | None] | None = None
  bootstrap_port: int | list[int | None] | None = None
  bootstrap_room: int | list[int | None] | None = None
  bootstrap_pair_key: str | list[str | None] | None = None
  decode_tp_size: int | list[int | None] | None = None
  routed_dp_rank: int | None = None
  disagg_prefill_dp_rank: int | None = None
  mm_hashes: Any = None
  extra_key: str | list[str] | None = None
  priority: int | None = None
  cache_salt: str | list[str] | None = None
  require_reasoning: bool | None = None
  session_params: Any = None
  kv_hints: Any = None
  routing_key: str | None = None
  max_thinking_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
  session_id: str | None = None
  custom_labels: dict[str, str] | None = None
  images_config: Any = None
  routed_experts_start_len: int = 0
  return_sampling_mask: bool | list[bool] | None = None
  # Not in api_types.py either; GenerateReqInput reads it (one bool for the whole batch).
  return_routed_experts: bool = False
  # Not in api_types.py (its contract ignores the key); SGLang's GenerateReqInput reads it.
  sampling_logprobs_mode: str | list[str | None] | None = None
  modalities: list[str | None] | None = None


class UpdateWeightsFromDiskRequest(msgspec.Struct, kw_only=True):
  """`/update_weights_from_disk` body (`UpdateWeightFromDiskReqInput`; unknown keys ignored)."""

  model_path: str
  load_format: str | None = None
  abort_all_requests: bool = False
  weight_version: str | None = None
  is_async: bool = False
  torch_empty_cache: bool = False
  keep_pause: bool = False
  recapture_cuda_graph: bool = False
  token_step: int = 0
  flush_cache: bool = True
  manifest: dict[str, Any] | None = None


class PauseGenerationRequest(msgspec.Struct, kw_only=True):
  mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(msgspec.Struct, kw_only=True):
  torch_empty_cache: bool = True


class AbortRequest(msgspec.Struct, kw_only=True):
  rid: str = ""
  abort_all: bool = False


def convert(value: Any, model: type, *, error: type[Exception] = ContractError):
  """`value` (parsed JSON) as `model`, strictly typed; raises `error` with msgspec's message
  naming the offending path (e.g. "Expected `int`, got `str` - at `$.sampling_params.top_k`")."""
  try:
    return msgspec.convert(value, model, strict=True)
  except msgspec.ValidationError as e:
    raise error(str(e)) from None


def _token_ids(value, name: str) -> list[int] | list[list[int]]:
  """A list of ints or a list of lists of ints (SGLang's `TokenIdsOrList`)."""

  def ints(seq, where):
    if not isinstance(seq, list):
      raise ContractError(f"Expected `array`, got `{type(seq).__name__}` - at `{where}`")
    for i, t in enumerate(seq):
      if not isinstance(t, int) or isinstance(t, bool):
        raise ContractError(f"Expected `int`, got `{type(t).__name__}` - at `{where}[{i}]`")
    return seq

  if not isinstance(value, list):
    raise ContractError(f"Expected `array`, got `{type(value).__name__}` - at `$.{name}`")
  if value and isinstance(value[0], list):
    return [ints(v, f"$.{name}[{i}]") for i, v in enumerate(value)]
  return ints(value, f"$.{name}")


def decode_generate(body: Any) -> GenerateRequest:
  """Stage 2: the contract. `null` sampling values become SGLang's defaults."""
  if not isinstance(body, dict):
    raise ContractError(f"Expected `object`, got `{type(body).__name__}`")
  req = convert(body, GenerateRequest)
  if req.input_ids is not None:
    req.input_ids = _token_ids(req.input_ids, "input_ids")
  if req.token_ids_logprob is not None:
    req.token_ids_logprob = _token_ids(req.token_ids_logprob, "token_ids_logprob")
  if req.sampling_params is not None:
    sp = req.sampling_params
    req.sampling_params = [_defaults_for_null(s) for s in sp] if isinstance(sp, list) else _defaults_for_null(sp)
  return req


def _defaults_for_null(sp: SamplingParams) -> SamplingParams:
  nulls = {k: v for k, v in _NULL_IS_DEFAULT.items() if getattr(sp, k) is None}
  return msgspec.structs.replace(sp, **nulls) if nulls else sp


# ---- normalisation (GenerateReqInput.normalize_batch_and_arguments) --------------------------


@dataclasses.dataclass(frozen=True)
class Item:
  """One sample to generate, after batch / `n` expansion (SGLang's per-request object)."""

  rid: str
  prompt_index: int
  input_ids: list[int]
  sampling: SamplingParams
  return_logprob: bool
  logprob_start_len: int  # -1: output log-probs only
  return_text_in_logprobs: bool
  return_sampling_mask: bool = False
  sampling_logprobs_mode: str | None = None  # None: "selected"
  return_routed_experts: bool = False
  routed_experts_start_len: int = 0
  top_logprobs_num: int = 0  # with return_logprob: each output token's k most likely (output_top_logprobs)


@dataclasses.dataclass(frozen=True)
class NormalizedGenerate:
  items: list[Item]  # prompt-major: prompt 0's n samples, then prompt 1's, ...
  is_single: bool  # one prompt, n == 1: the response is an object, else a list
  stream: bool


_UNSUPPORTED = ("input_embeds", "image_data", "video_data", "audio_data", "lora_path", "custom_logit_processor")
_UNSUPPORTED_SAMPLING = {  # key: its no-op value(s) here
  "stop": (None, "", []),
  "stop_regex": (None, "", []),
  "json_schema": (None, ""),
  "regex": (None, ""),
  "ebnf": (None, ""),
  "structural_tag": (None, ""),
  "frequency_penalty": (0.0,),
  "presence_penalty": (0.0,),
  "repetition_penalty": (1.0,),
  "min_new_tokens": (0,),
  "logit_bias": (None, {}),
  "beam_width": (None, 1),
  "watermark": (None,),
  "choice": (None, []),
  "custom_params": (None, {}),
}


def _per_prompt(value, default, name: str, batch: int, n: int) -> list:
  """SGLang's `normalize_param`, one value per prompt: a scalar is shared; a list must have one
  entry per prompt and is not allowed with `n > 1`."""
  if value is None:
    return [default] * batch
  if not isinstance(value, list):
    return [value] * batch
  if n > 1:
    raise RequestError(f"Cannot use list {name} with parallel_sample_num > 1")
  if len(value) != batch:
    raise RequestError(f"The length of {name} ({len(value)}) should be equal to the batch size ({batch}).")
  return value


def normalize_generate(req: GenerateRequest, *, encode=None) -> NormalizedGenerate:
  """Stage 3: one `Item` per sample. `encode(text) -> ids` tokenises `text` prompts (None: the
  server has no tokenizer). Raises `RequestError` with SGLang's messages."""
  for key in _UNSUPPORTED:
    value = getattr(req, key)
    if value not in (None, [], ""):
      raise RequestError(
        f"{key} is not supported by this server (mis-jax serve is text-only, without LoRA or custom logit processors)"
      )
  if req.stream:
    raise RequestError("stream=true is not supported by this server; send stream=false")

  def values(v):
    return v if isinstance(v, list) else [v]

  if req.token_ids_logprob:
    raise RequestError("token_ids_logprob is not supported by this server")
  if any(values(req.return_hidden_states)):
    raise RequestError("The server is not configured to return hidden states.")

  if req.text is None and req.input_ids is None:
    raise RequestError("Either text, input_ids or input_embeds should be provided.")
  if req.text is not None:  # SGLang prefers text when both are sent
    if encode is None:
      raise RequestError(
        "this server has no tokenizer (no tokenizer.json in the model directory); send input_ids instead of text"
      )
    is_single = isinstance(req.text, str)
    prompts = [encode(req.text)] if is_single else [encode(t) for t in req.text]
  else:
    ids = req.input_ids
    if len(ids) == 0:
      raise RequestError("input_ids cannot be empty.")
    is_single = not isinstance(ids[0], list)
    prompts = [ids] if is_single else ids
  batch = len(prompts)
  for name in ("extra_key", "cache_salt"):  # prefix-cache namespaces: accepted and checked (no cache here)
    keys = getattr(req, name)
    if isinstance(keys, list) and len(keys) != batch:
      raise RequestError(f"{name} has {len(keys)} entries for a batch of {batch} prompts")

  sp = req.sampling_params
  if isinstance(sp, list):
    if not sp:
      raise RequestError("sampling_params must not be an empty list")
    n = sp[0].n
    if any(s.n != n for s in sp):
      raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")
  else:
    n = sp.n if sp is not None else 1
  if not isinstance(n, int) or n < 1:
    raise RequestError(f"n must be at least 1, got {n}.")
  if n > 1 and is_single:
    is_single = False
  if is_single and isinstance(sp, list):
    if len(sp) != 1:
      raise RequestError(f"sampling_params has {len(sp)} entries for a single prompt")
    sp = sp[0]

  # Per-prompt values (index by prompt), then the rids of the expanded samples.
  if sp is None:
    per_prompt_sp = [SamplingParams()] * batch
  elif isinstance(sp, list):
    if len(sp) != batch:
      raise RequestError(f"The length of sampling_params ({len(sp)}) should be equal to the batch size ({batch}).")
    per_prompt_sp = sp
  else:
    per_prompt_sp = [sp] * batch
  per_prompt = {
    name: _per_prompt(getattr(req, name), default, name, batch, n)
    for name, default in (
      ("return_logprob", False),
      ("logprob_start_len", -1),
      ("return_sampling_mask", False),
      ("sampling_logprobs_mode", None),
      ("top_logprobs_num", 0),
    )
  }

  rid = req.rid
  if is_single:
    if isinstance(rid, list):
      if len(rid) != 1:
        raise RequestError("The specified rids length mismatch with the batch_size for batch processing.")
      rid = rid[0]
    rids = [rid if rid is not None else uuid.uuid4().hex]
  elif rid is None:
    rids = [uuid.uuid4().hex for _ in range(batch * n)]
  elif isinstance(rid, str):
    rids = [f"{rid}_{i}" for i in range(batch * n)]
  else:
    if len(rid) != batch:
      raise RequestError("The specified rids length mismatch with the batch_size for batch processing.")
    if len(set(rid)) != len(rid):
      dup = sorted({r for r in rid if rid.count(r) > 1})
      raise RequestError(f"Duplicate request IDs detected within the request: {dup}")
    rids = list(rid)
  if n > 1:  # SGLang gives every parallel sample a fresh id
    rids = [uuid.uuid4().hex for _ in range(batch * n)]

  items = []
  for i, prompt in enumerate(prompts):
    s = per_prompt_sp[i]
    for j in range(n):
      items.append(
        Item(
          rid=rids[i * n + j],
          prompt_index=i,
          input_ids=list(prompt),
          sampling=s,
          return_logprob=bool(per_prompt["return_logprob"][i]),
          logprob_start_len=int(per_prompt["logprob_start_len"][i]),
          return_text_in_logprobs=bool(req.return_text_in_logprobs),
          return_sampling_mask=bool(per_prompt["return_sampling_mask"][i]),
          sampling_logprobs_mode=per_prompt["sampling_logprobs_mode"][i],
          return_routed_experts=bool(req.return_routed_experts),
          top_logprobs_num=int(per_prompt["top_logprobs_num"][i] or 0),
          routed_experts_start_len=int(req.routed_experts_start_len),
        )
      )
  return NormalizedGenerate(items=items, is_single=is_single, stream=bool(req.stream))


def validate_item(
  item: Item, *, vocab_size: int, context_length: int, sampling_mask_max_tokens: int = SAMPLING_MASK_MAX_TOKENS
) -> None:
  """SGLang's per-request checks (`_validate_one_request`, `SamplingParams.verify`, the
  scheduler's `logprob_start_len` and sampling-mask checks); raises `RequestError`."""
  s = item.sampling
  for key, allowed in _UNSUPPORTED_SAMPLING.items():
    value = getattr(s, key)
    if isinstance(value, float) and len(allowed) == 1 and isinstance(allowed[0], float):
      ok = math.isclose(value, allowed[0])
    else:
      ok = value in allowed
    if not ok:
      raise RequestError(
        f"sampling_params.{key}={value!r} is not supported by this server "
        "(mis-jax serve implements temperature, top_p, top_k, min_p, "
        "max_new_tokens, stop_token_ids, ignore_eos, n and sampling_seed)"
      )
  if not item.input_ids:
    raise RequestError(f"input_ids[{item.prompt_index}] cannot be empty.")
  bad = [t for t in item.input_ids if not 0 <= t < vocab_size]
  if bad:
    raise RequestError(f"input_ids contains out-of-vocabulary token id {bad[0]}; valid range is [0, {vocab_size}).")
  num_input = len(item.input_ids)
  if num_input >= context_length:
    raise RequestError(
      f"The input ({num_input} tokens) is longer than the model's context length ({context_length} tokens)."
    )
  if s.max_new_tokens is not None and s.max_new_tokens + num_input > context_length:
    total = s.max_new_tokens + num_input
    raise RequestError(
      f"Requested token count exceeds the model's maximum context length of {context_length} "
      f"tokens. You requested a total of {total} tokens: {num_input} tokens from the input "
      f"messages and {s.max_new_tokens} tokens for the completion. Please reduce the number of "
      "tokens in the input messages or the completion to fit within the limit."
    )
  if not math.isfinite(s.temperature) or s.temperature < 0.0:
    raise RequestError(f"temperature must be a non-negative finite number, got {s.temperature}.")
  if not 0.0 < s.top_p <= 1.0:
    raise RequestError(f"top_p must be in (0, 1], got {s.top_p}.")
  if not 0.0 <= s.min_p <= 1.0:
    raise RequestError(f"min_p must be in [0, 1], got {s.min_p}.")
  if s.top_k < 1 and s.top_k != -1:
    raise RequestError(f"top_k must be -1 (disable) or at least 1, got {s.top_k}.")
  if s.max_new_tokens is not None and s.max_new_tokens < 0:
    raise RequestError(f"max_new_tokens must be at least 0, got {s.max_new_tokens}.")
  if s.sampling_seed is not None and not -(2**63) <= s.sampling_seed <= 2**63 - 1:
    raise RequestError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {s.sampling_seed}.")
  if item.return_logprob and item.logprob_start_len > num_input:
    raise RequestError(
      f"req.logprob_start_len={item.logprob_start_len} is higher than the number of input tokens "
      f"len(req.origin_input_ids)={num_input}. Please use a smaller logprob_start_len."
    )
  if item.return_routed_experts:  # the scheduler's checks (SGLang aborts the request: HTTP 400)
    start = item.routed_experts_start_len
    if start < 0:
      raise RequestError(
        f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a non-negative "
        "routed_experts_start_len."
      )
    if start > num_input:
      raise RequestError(
        f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
        f"len(req.origin_input_ids)={num_input}. Please use a smaller routed_experts_start_len."
      )
  if item.top_logprobs_num < 0:
    raise RequestError(f"top_logprobs_num must be >= 0, got {item.top_logprobs_num}.")
  if item.sampling_logprobs_mode is not None and not item.return_sampling_mask:
    raise RequestError("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
  if item.sampling_logprobs_mode not in (None,) + SAMPLING_LOGPROBS_MODES:
    raise RequestError(
      f"sampling_logprobs_mode must be one of {', '.join(SAMPLING_LOGPROBS_MODES)}, got "
      f"{item.sampling_logprobs_mode!r}."
    )
  if item.return_sampling_mask:
    # SGLang's SamplingParams: greedy runs as top_k = 1; top_k = -1 means TOP_K_ALL.
    top_k = 1 if s.temperature < SAMPLING_EPS else (TOP_K_ALL if s.top_k == -1 else s.top_k)
    if top_k != 1 and not 1 < top_k <= sampling_mask_max_tokens:
      raise RequestError(
        f"return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= "
        f"{sampling_mask_max_tokens}; got top_k={top_k}. Lower top_k or increase "
        "--sampling-mask-max-tokens."
      )


# ---- responses -------------------------------------------------------------------------------


def finish_stop(matched) -> dict:
  return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict:
  return {"type": "length", "length": length}


def finish_abort(message: str = "Aborted", status_code: int | None = None, err_type: str | None = None) -> dict:
  """A running request aborted (`FINISH_ABORT.to_json`)."""
  return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


def finish_abort_waiting(message: str = "Abort in waiting queue") -> dict:
  """A request aborted before it ran (the tokenizer manager's two-key form)."""
  return {"type": "abort", "message": message}


def logprob_entries(values: Sequence[float | None], ids: Sequence[int], texts=None) -> list:
  """`[[logprob, token_id, text_or_null], ...]`; NaN / -inf log-probs become null (SGLang)."""
  texts = texts or [None] * len(ids)
  return [[None if v is None or not math.isfinite(v) else float(v), int(t), s] for v, t, s in zip(values, ids, texts)]


def meta_info(
  *,
  rid: str,
  finish_reason: dict,
  prompt_tokens: int | None,
  weight_version: str,
  completion_tokens: int,
  e2e_latency: float,
  sent_ts: float,
  logprobs: tuple[list, list] | None = None,
  running: bool = True,
  sampling_mask: tuple[list, list] | None = None,
  routed_experts: str | None = None,
  spans: list[dict] | None = None,
  top_logprobs: tuple[list, list] | None = None,
) -> dict:
  """`meta_info` with SGLang 0.5.23's keys in its order. `logprobs`: (input entries, output
  entries) when `return_logprob`. `sampling_mask`: (kept ids per output token, their
  `output_token_sampling_logprobs`) when `return_sampling_mask`. `running=False`: a request
  aborted in the waiting queue (no `prompt_tokens`, SGLang's shorter form). `top_logprobs`:
  (input, output) `[[logprob, id, text|null], ...]` per token when `top_logprobs_num > 0`, after the
  token log-probs as SGLang's tokenizer manager adds them. `routed_experts`:
  the base64 of the request's routed experts (`encode_routed_experts`), added after the rest
  as SGLang's tokenizer manager adds it. `spans`: the `weight_versions` of a response generated
  across weight updates (default: one span of `weight_version`)."""
  spans = spans or [{"version": weight_version, "start": 0, "end": completion_tokens}]
  if not running:
    meta = {
      "id": rid,
      "finish_reason": finish_reason,
      "weight_version": weight_version,
      "e2e_latency": e2e_latency,
      "weight_versions": spans,
    }
    if logprobs is not None:
      meta.update(
        input_token_logprobs=logprobs[0],
        output_token_logprobs=logprobs[1],
        output_token_logprobs_length=len(logprobs[1]),
      )
    meta.update(completion_tokens=completion_tokens, response_sent_to_client_ts=sent_ts)
    return meta
  meta = {
    "id": rid,
    "finish_reason": finish_reason,
    "prompt_tokens": prompt_tokens,
    "weight_version": weight_version,
    "num_retractions": 0,
  }
  if logprobs is not None:
    meta.update(
      input_token_logprobs=logprobs[0], output_token_logprobs=logprobs[1], output_token_logprobs_length=len(logprobs[1])
    )
  if top_logprobs is not None:
    meta.update(input_top_logprobs=top_logprobs[0], output_top_logprobs=top_logprobs[1])
  if sampling_mask is not None:
    meta.update(
      output_token_sampling_mask=sampling_mask[0],
      output_token_sampling_logprobs=sampling_mask[1],
      output_token_sampling_mask_length=len(sampling_mask[0]),
    )
  meta.update(
    reasoning_tokens=0,
    completion_tokens=completion_tokens,
    cached_tokens=0,
    weight_versions=spans,
    e2e_latency=e2e_latency,
    response_sent_to_client_ts=sent_ts,
  )
  if routed_experts is not None:
    meta["routed_experts"] = routed_experts
  return meta


def encode_routed_experts(experts) -> str:
  """`[rows, num_hidden_layers, num_experts_per_tok]` expert ids → SGLang's wire form: the
  base64 of their row-major int32 bytes."""
  return base64.b64encode(np.ascontiguousarray(experts, dtype="<i4").tobytes()).decode("ascii")


ROUTED_EXPERTS_DTYPES = {"int32": "<i4", "int16": "<i2", "int64": "<i8", "uint8": "u1", "int8": "i1"}


def decode_routed_experts(value: str, num_layers: int, top_k: int, dtype: str | None = None):
  """SGLang's `meta_info["routed_experts"]` → int32 `[rows, num_layers, top_k]`; `dtype`:
  `meta_info["routed_experts_dtype"]` when the server sends one (default int32). Raises
  `ContractError` when the bytes do not decode or do not fit the shape."""
  if dtype is not None and dtype not in ROUTED_EXPERTS_DTYPES:
    raise ContractError(f"routed_experts_dtype {dtype!r} is not one of {', '.join(ROUTED_EXPERTS_DTYPES)}")
  try:
    raw = base64.b64decode(value, validate=True)
  except (ValueError, TypeError) as e:
    raise ContractError(f"routed_experts is not base64: {e}") from None
  flat = np.frombuffer(raw, dtype=ROUTED_EXPERTS_DTYPES[dtype or "int32"])
  per_row = num_layers * top_k
  if flat.size % per_row:
    raise ContractError(
      f"routed_experts holds {flat.size} ids, not a multiple of num_hidden_layers x "
      f"num_experts_per_tok = {num_layers} x {top_k}"
    )
  return flat.astype(np.int32).reshape(-1, num_layers, top_k)


# Error bodies, by the stage that raises them (SGLang's http_server).
# mis-jax's own route (not SGLang's): can this server read a file the trainer wrote? The trainer
# writes a probe with a nonce into its weight directory before step 1 and asks every worker for it:
# the weights reach the workers through /update_weights_from_disk, so they must see that directory.
READ_PROBE_ROUTE = "/mis_jax/read_probe"
PROBE_PREFIX = ".mis-jax-probe-"


def read_probe(path: Any) -> tuple[int, dict]:
  """(status, body) of `READ_PROBE_ROUTE` for `{"path": path}`: 400 unless the file's name starts
  with `PROBE_PREFIX` (nothing else is read); else `{"readable": true, "content": <its first 256
  characters>}` or `{"readable": false, "error": ...}`."""
  if not isinstance(path, str) or not os.path.basename(path).startswith(PROBE_PREFIX):
    return 400, {"error": f"path must name a {PROBE_PREFIX}* file, got {path!r}"}
  try:
    with open(path, encoding="utf-8") as f:
      return 200, {"readable": True, "content": f.read(256)}
  except (OSError, UnicodeDecodeError) as e:
    return 200, {"readable": False, "error": f"{type(e).__name__}: {e}"}


# mis-jax's own routes (not SGLang's; contract §11): the weights of a step streamed over HTTP in
# buckets, for fleets without a shared filesystem. Each bucket is a safetensors stream (POST body,
# application/octet-stream; query `push`, `weight_version`, `bucket`, and `base` for a delta) whose
# metadata `format` is `WEIGHTS_FORMAT`; the engine stages it beside the served weights. A tensor
# comes whole under its HF name, or as a delta: `name` + `DELTA_INDEX_SUFFIX` (uint32 flat indices
# into the HF tensor) then `name` + `DELTA_VALUES_SUFFIX` (the values there), relative to the
# weights of push `base` — refused with HTTP 409 by an engine that does not serve exactly those.
# The commit (JSON `{"push", "weight_version", "num_buckets", "flush_cache"}`) swaps every staged
# tensor in at once and answers as /update_weights_from_disk does (`success`, `message`); the
# discard (`{"push"}`) drops a stage. No request ever runs on a half-updated model: until the
# commit the served weights are untouched, and the commit is one swap between two batches.
WEIGHTS_STAGE_ROUTE = "/mis_jax/weights/stage"
WEIGHTS_COMMIT_ROUTE = "/mis_jax/weights/commit"
WEIGHTS_DISCARD_ROUTE = "/mis_jax/weights/discard"
WEIGHTS_DIGEST_ROUTE = "/mis_jax/weights/digest"  # GET: sha256 of the served weights (`weights_digest`)
WEIGHTS_FORMAT = "mis_jax.weights.v1"
DELTA_INDEX_SUFFIX = ":delta_index"
DELTA_VALUES_SUFFIX = ":delta_values"


def json_error_body(message: str) -> dict:
  """A body that is not a JSON object of the route's shape (`ErrorResponse`, code 400)."""
  return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def contract_error_body(message: str) -> dict:
  return {"error": message}


def request_error_body(message: str) -> dict:
  return {"error": {"message": message}}


def http_error_body(status: int, message: str) -> dict:
  """An `HTTPException` (`ErrorResponse` with the status as its type)."""
  return {"object": "error", "message": message, "type": str(status), "param": None, "code": status}


# ---- client side -----------------------------------------------------------------------------


class FinishReason(msgspec.Struct, kw_only=True):
  type: str
  matched: int | str | list[int] | None = None
  length: int | None = None
  message: str | None = None
  status_code: int | None = None
  err_type: str | None = None


class WeightVersionSpan(msgspec.Struct, kw_only=True):
  version: str
  start: int = 0
  end: int = 0


class MetaInfo(msgspec.Struct, kw_only=True):
  """The parts of `meta_info` the trainer reads (unknown keys ignored)."""

  id: str = ""
  finish_reason: FinishReason | None = None
  prompt_tokens: int = 0
  completion_tokens: int = 0
  output_token_logprobs: list[Any] | None = None
  input_token_logprobs: list[Any] | None = None
  weight_version: str | None = None
  weight_versions: list[WeightVersionSpan] = []
  output_top_logprobs: list[Any] | None = None  # per output token [[logprob, id, text|null], ...] (top_logprobs_num)
  output_token_sampling_mask: list[list[int]] | None = None
  output_token_sampling_logprobs: list[Any] | None = None  # selected: floats; support: lists
  output_token_sampling_mask_length: int | None = None
  routed_experts: str | None = None  # base64 int32 [seqlen - 1 - start, layers, top_k]
  routed_experts_dtype: str | None = None


class GenerateResult(msgspec.Struct, kw_only=True):
  text: str | None = ""
  output_ids: list[int] | None = None
  meta_info: MetaInfo | None = None


def parse_generate_result(item: Any) -> GenerateResult:
  """One element of a `/generate` reply; raises `ContractError` naming what is malformed."""
  return convert(item, GenerateResult)


def generate_body(
  prompts: Sequence[Sequence[int]],
  sampling_params: dict,
  *,
  n: int = 1,
  seeds: Sequence[int] | None = None,
  return_logprob: bool = True,
  rid: str | None = None,
  return_sampling_mask: bool = False,
  return_routed_experts: bool = False,
  extra_key: str | None = None,
  extra_fields: dict | None = None,
) -> dict:
  """A `/generate` body for `n` samples of every prompt, valid for SGLang's contract.

  With `seeds` (one per sample, prompt-major), each sample is sent as its own batch entry with
  its own `sampling_seed`: SGLang copies a request's sampling params to all of its `n` samples,
  so one seed for a group would give `n` identical samples under deterministic inference.
  `extra_fields`: top-level fields added after `return_logprob` (the trainer's per-token extras'
  requests, e.g. `{"return_sampling_mask": True}`).
  """
  base = convert(dict(sampling_params), SamplingParams, error=ValueError)  # rejects unknown keys
  if base.n not in (None, 1):
    raise ValueError("pass n as the argument, not inside sampling_params")
  params = {k: v for k, v in sampling_params.items() if k != "n"}  # as given, every key kept
  body: dict[str, Any] = {"return_logprob": return_logprob}
  if return_sampling_mask:  # the behaviour log-prob of each token and its support (selected mode)
    body["return_sampling_mask"] = True
  if return_routed_experts:  # every position's experts, per layer (R3)
    body["return_routed_experts"] = True
  body.update(extra_fields or {})
  if seeds is None:
    body["input_ids"] = [list(map(int, p)) for p in prompts]
    body["sampling_params"] = dict(params, n=n)
  else:
    if len(seeds) != len(prompts) * n:
      raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts × n={n}")
    body["input_ids"] = [list(map(int, p)) for p in prompts for _ in range(n)]
    body["sampling_params"] = [dict(params, sampling_seed=int(s)) for s in seeds]
  if rid is not None:
    body["rid"] = rid
  if extra_key is not None:  # SGLang's prefix-cache namespace (the trainer's cache salt)
    body["extra_key"] = extra_key
  return body


def error_message(body: Any, fallback: str = "") -> str:
  """The message of any error body SGLang sends: `{"error": str}`, `{"error": {"message"}}`,
  `{"message": ...}` (ErrorResponse, weight updates), `{"detail": ...}` (FastAPI)."""
  if isinstance(body, dict):
    err = body.get("error")
    if isinstance(err, str):
      return err
    if isinstance(err, dict) and "message" in err:
      return str(err["message"])
    if isinstance(err, list):
      return "; ".join(map(str, err))
    if "message" in body:
      return str(body["message"])
    if "detail" in body:
      detail = body["detail"]
      if isinstance(detail, list):
        return "; ".join(str(d.get("msg", d)) if isinstance(d, dict) else str(d) for d in detail)
      return str(detail)
  return fallback or str(body)[:500]
