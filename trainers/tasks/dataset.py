"""The ``dataset`` task: prompts from JSONL / Parquet records, rewards by name or import path.

Works unchanged on the layouts verl and TRL users have:

- verl (``examples/data_preprocess/gsm8k.py``): Parquet with ``prompt`` = a list of chat
  messages and ``reward_model.ground_truth``;
- TRL: ``prompt`` as text or as chat messages (or ``messages``), ground truth in a column such
  as ``answer`` or ``solution``, JSONL or Parquet;
- token ids: ``prompt_ids`` (a list of ints), no tokenizer needed.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import numpy as np

from mis_jax import ConfigError, resolve_correction_fn
from trainers.tasks import chat, dataset_files
from trainers.tasks.base import Prompt
from trainers.tasks.rewards import REWARDS, BuiltinReward, ground_truth_text

PROMPT_KEYS = ("prompt_ids", "messages", "prompt")  # task.prompt_key: null
ANSWER_KEYS = ("reward_model.ground_truth", "answer", "solution", "ground_truth")  # task.answer_key: null


class DatasetTask:
  """Prompts from dataset records (:mod:`trainers.tasks.dataset_files`), rewards by name or function.

  A record's prompt is the value under ``prompt_key`` (null: the first of ``prompt_ids``,
  ``messages``, ``prompt`` that the first record has):

  - a list of ints: token ids, used as they are;
  - a list of ``{role, content}``: the tokenizer's chat template with the generation prompt and
    ``chat_template_kwargs`` (:func:`trainers.tasks.chat.render_chat`);
  - a string: one user message rendered the same way when ``chat_template`` (null: when the
    tokenizer has a template), else ``tokenizer.encode(text)``.

  Its ground truth is the value under ``answer_key`` (null: the first of ``ANSWER_KEYS`` the
  first record has); every record must have it when the reward needs it.

  ``reward_fn``: a built-in name (:data:`trainers.tasks.rewards.REWARDS`), called as
  ``fn(text, ground_truth)``; or a function / import path (``pkg.mod:fn``) called as
  ``fn(record, response_ids, text) -> float``. ``text`` is the response decoded by the task's
  tokenizer with special tokens skipped, or the server's text when the task has no tokenizer.

  The tokenizer is ``tokenizer`` (a Hugging Face directory, or a loaded tokenizer) when given,
  else ``model_path``'s when anything needs one. Stop tokens: ``stop_token_ids``, else the
  template's end of turn and the tokenizer's EOS.
  Every problem with the files, a record (its file and row or line, the column) or the
  tokenizer is a `ValueError` / `FileNotFoundError` raised here, before any server starts.
  """

  def __init__(
    self,
    path: str,
    reward_fn: str | Callable,
    *,
    tokenizer: Any = None,
    model_path: str | None = None,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    chat_template: bool | None = None,
    chat_template_kwargs: dict | None = None,
    stop_token_ids: Sequence[int] | None = None,
    max_new_tokens: int | None = None,
    vocab_size: int | None = None,
  ):
    files = dataset_files.dataset_files(path)  # the files exist, then the reward imports, then the records
    self.builtin, self.reward_fn, reward_name = _resolve_reward(reward_fn)
    self.max_new_tokens = max_new_tokens
    self.template_kwargs = dict(chat_template_kwargs or {})
    rows = [r for f in files for r in dataset_files.read_file(f)]
    if not rows:
      raise ValueError(f"task.path {path!r}: no records")
    first = rows[0]
    self.prompt_key = prompt_key or _first_present(first, PROMPT_KEYS, "task.prompt_key", "prompt")
    needs_answer = self.builtin is not None and self.builtin.needs_ground_truth
    self.answer_key = answer_key
    if answer_key is None and (
      needs_answer or any(dataset_files.lookup(first.values, k) is not dataset_files.MISSING for k in ANSWER_KEYS)
    ):
      self.answer_key = _first_present(first, ANSWER_KEYS, "task.answer_key", "ground-truth")
    self.check_answers = needs_answer or answer_key is not None
    for row in rows:
      if dataset_files.lookup(row.values, self.prompt_key) in (dataset_files.MISSING, None):
        raise ValueError(_missing(row, self.prompt_key, "task.prompt_key"))

    # The tokenizer: `tokenizer` (a directory or an object) when given; else `model_path`'s when
    # anything needs one (text or chat prompts, decoding for a built-in reward, default stop tokens).
    needs_tokenizer = (
      self.builtin is not None
      or stop_token_ids is None
      or tokenizer is not None
      or any(not _is_token_ids(dataset_files.lookup(r.values, self.prompt_key)) for r in rows)
    )
    self.tokenizer = None
    if needs_tokenizer:
      tokenizer = tokenizer if tokenizer is not None else model_path
      if tokenizer is None:
        raise ValueError(_why_tokenizer(rows, self.prompt_key, self.builtin, stop_token_ids))
      self.tokenizer = chat.load_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
      if vocab_size is not None and len(self.tokenizer) > vocab_size:
        raise ValueError(
          f"task.tokenizer: the tokenizer has {len(self.tokenizer)} tokens but the model's vocabulary only {vocab_size}"
        )
      chat.check_template_kwargs(self.tokenizer, self.template_kwargs)
      if chat_template and not chat.has_chat_template(self.tokenizer):
        raise ValueError("task.chat_template is true but the tokenizer has no chat template")
    elif self.template_kwargs or chat_template:
      raise ValueError(
        "task.chat_template / chat_template_kwargs apply to text or chat prompts; this dataset "
        f"holds token ids ('{self.prompt_key}')"
      )
    if self.tokenizer is None:
      self.use_chat = False
    else:
      self.use_chat = chat.has_chat_template(self.tokenizer) if chat_template is None else chat_template

    self.records = [self._prompt(r, vocab_size) for r in rows]
    self.max_prompt_len = max(len(p.ids) for p in self.records)
    if stop_token_ids is not None:
      self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
    else:
      self.stop_token_ids = chat.default_stop_token_ids(self.tokenizer, self.template_kwargs)
      if not self.stop_token_ids:
        raise ValueError(
          "task.stop_token_ids: the tokenizer has no EOS token and no chat template end-of-turn; "
          "set task.stop_token_ids (or [] to always generate max_new_tokens)"
        )
    for t in self.stop_token_ids:
      if vocab_size is not None and not 0 <= t < vocab_size:
        raise ValueError(f"task.stop_token_ids: {t} is not a token id of the model's vocabulary (0..{vocab_size - 1})")
    kinds = sorted({_kind(dataset_files.lookup(r.values, self.prompt_key)) for r in rows[:1000]})
    self.summary = (
      f"dataset {path}: {len(self.records)} records, prompt '{self.prompt_key}' ({', '.join(kinds)}"
      f"{', chat template' if self.use_chat and 'token ids' not in kinds else ''}"
      f"{f' {self.template_kwargs}' if self.template_kwargs else ''}), answer "
      f"'{self.answer_key}', reward {reward_name}, stop tokens {list(self.stop_token_ids)}"
    )

  def _prompt(self, row: dataset_files.Record, vocab_size: int | None) -> Prompt:
    value = dataset_files.lookup(row.values, self.prompt_key)
    if _is_token_ids(value):
      ids = list(value)
    elif isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
      problem = chat.check_messages(value)
      if problem:
        raise ValueError(f"{row.where}: column '{self.prompt_key}': {problem}")
      if not self.use_chat:
        raise ValueError(
          f"{row.where}: column '{self.prompt_key}' holds chat messages but "
          + (
            "task.chat_template is false"
            if chat.has_chat_template(self.tokenizer)
            else "the tokenizer has no chat template"
          )
        )
      ids = chat.render_chat(self.tokenizer, value, self.template_kwargs)
    elif isinstance(value, str) and value:
      ids = (
        chat.render_chat(self.tokenizer, [{"role": "user", "content": value}], self.template_kwargs)
        if self.use_chat
        else list(self.tokenizer.encode(value))
      )
    else:
      raise ValueError(
        f"{row.where}: column '{self.prompt_key}' must be a non-empty list of token ids, a list of "
        f"chat messages or a string; got {type(value).__name__} {_short(value)}"
      )
    if not ids:
      raise ValueError(f"{row.where}: column '{self.prompt_key}' gives an empty prompt")
    if vocab_size is not None and not all(0 <= t < vocab_size for t in ids):
      bad = next(t for t in ids if not 0 <= t < vocab_size)
      raise ValueError(f"{row.where}: prompt token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")
    answer = None
    if self.answer_key is not None:
      raw = dataset_files.lookup(row.values, self.answer_key)
      if raw is dataset_files.MISSING or raw is None:
        if self.check_answers:
          raise ValueError(_missing(row, self.answer_key, "task.answer_key"))
      else:
        answer = ground_truth_text(raw)
        if answer is None and self.check_answers:
          raise ValueError(
            f"{row.where}: column '{self.answer_key}' must be a string or a number, got "
            f"{type(raw).__name__} {_short(raw)}"
          )
        problem = self.builtin and self.builtin.ground_truth_problem and self.builtin.ground_truth_problem(answer)
        if problem:
          raise ValueError(f"{row.where}: column '{self.answer_key}': {problem}")
    return Prompt(ids=tuple(int(t) for t in ids), answer=answer, record=row.values)

  def prompts(self, seed: int, step: int, count: int) -> list[Prompt]:
    # Epoch-wise shuffles: step s reads positions [s*count, (s+1)*count) of the stream.
    out, orders = [], {}
    for pos in range(step * count, (step + 1) * count):
      epoch, i = divmod(pos, len(self.records))
      if epoch not in orders:
        orders[epoch] = np.random.default_rng([seed, epoch]).permutation(len(self.records))
      out.append(self.records[orders[epoch][i]])
    return out

  def response_text(self, response_ids: Sequence[int], server_text: str) -> str:
    if self.tokenizer is None:
      return server_text
    return self.tokenizer.decode(list(response_ids), skip_special_tokens=True)

  def reward(self, prompt: Prompt, response_ids: Sequence[int], text: str = "") -> float:
    text = self.response_text(response_ids, text)
    if self.builtin is not None:
      value = self.builtin.fn(text, prompt.answer)
    else:
      value = float(self.reward_fn(prompt.record, list(response_ids), text))
    if not np.isfinite(value):
      raise ValueError(f"reward function returned {value} for record {prompt.record!r}")
    return value


def _resolve_reward(reward_fn) -> tuple[BuiltinReward | None, Callable | None, str]:
  if isinstance(reward_fn, str) and reward_fn in REWARDS:
    return REWARDS[reward_fn], None, reward_fn
  if isinstance(reward_fn, str) and not any(c in reward_fn for c in ".:"):
    raise ValueError(
      f"task.reward_fn: unknown reward {reward_fn!r}; built-in rewards: {', '.join(REWARDS)}, "
      "or an import path pkg.module:function"
    )
  try:
    fn = resolve_correction_fn(reward_fn)
  except ConfigError as e:
    raise ValueError(f"task.reward_fn: {e}") from None
  return None, fn, reward_fn if isinstance(reward_fn, str) else getattr(fn, "__name__", repr(fn))


def _is_token_ids(value) -> bool:
  return (
    isinstance(value, list)
    and bool(value)
    and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value)
  )


def _kind(value) -> str:
  if _is_token_ids(value):
    return "token ids"
  return "chat messages" if isinstance(value, list) else "text"


def _first_present(row: dataset_files.Record, keys, setting: str, what: str) -> str:
  for k in keys:
    if dataset_files.lookup(row.values, k) is not dataset_files.MISSING:
      return k
  raise ValueError(
    f"{row.where}: no {what} column ({' / '.join(keys)}); set {setting} to one of the record's "
    f"columns: {', '.join(dataset_files.columns(row.values))}"
  )


def _missing(row: dataset_files.Record, key: str, setting: str) -> str:
  return (
    f"{row.where}: no column '{key}' ({setting}); the record's columns: {', '.join(dataset_files.columns(row.values))}"
  )


def _why_tokenizer(rows, prompt_key, builtin, stop_token_ids) -> str:
  if builtin is not None:
    reason = "a built-in reward decodes responses with it"
  elif stop_token_ids is None:
    reason = "the default stop tokens come from it (or set task.stop_token_ids)"
  else:
    where = next(r.where for r in rows if not _is_token_ids(dataset_files.lookup(r.values, prompt_key)))
    reason = f"{where} has a text or chat prompt in '{prompt_key}'"
  return f"task.tokenizer: this dataset needs a tokenizer ({reason}); set task.tokenizer or model.path"


def _short(value, limit: int = 80) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."
