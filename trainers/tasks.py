"""Prompts and verifiable rewards: a built-in toy task and JSONL datasets.

A task yields :class:`Prompt` s deterministically from ``(seed, step)`` (so a resumed run
sees the same prompts) and scores a response with a float reward.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from mis_jax import resolve_correction_fn


@dataclasses.dataclass(frozen=True)
class Prompt:
  ids: tuple[int, ...]
  answer: Any = None
  record: Any = None


class Task(Protocol):
  stop_token_ids: tuple[int, ...]

  def prompts(self, seed: int, step: int, count: int) -> list[Prompt]:
    ...

  def reward(self, prompt: Prompt, response_ids: Sequence[int], text: str) -> float:
    ...


class CopyDigitsTask:
  """Toy task: repeat the prompt's digits, then stop.

  Prompt ``[BOS, d1 … dk, SEP]``, expected response ``d1 … dk EOS`` with digits as token ids
  ``digit_offset + d``. Reward: the share of the k positions holding the right digit, 0.2 of
  that credit for a wrong digit (so a random policy gets a gradient towards digits), plus a
  bonus of ``1/(k+1)`` for EOS right after the digits; the maximum is ``1 + 1/(k+1)``. A tiny
  model learns it from random initialisation in a few hundred steps on a CPU.
  """

  def __init__(self, *, num_digits: int = 3, bos: int = 1, eos: int = 2, sep: int = 13,
               digit_offset: int = 3, vocab_size: int = 64):
    if digit_offset + 10 > vocab_size or sep >= vocab_size:
      raise ValueError(f"vocab_size={vocab_size} too small for digits at {digit_offset}..{digit_offset + 9}")
    self.num_digits, self.bos, self.eos, self.sep, self.offset = num_digits, bos, eos, sep, digit_offset
    self.stop_token_ids = (eos,)
    self.max_new_tokens = num_digits + 1
    self.max_prompt_len = num_digits + 2

  def prompts(self, seed: int, step: int, count: int) -> list[Prompt]:
    rng = np.random.default_rng([seed, step])
    digits = rng.integers(0, 10, (count, self.num_digits))
    return [Prompt(ids=(self.bos, *[self.offset + int(d) for d in row], self.sep), answer=tuple(int(d) for d in row))
            for row in digits]

  def reward(self, prompt: Prompt, response_ids: Sequence[int], text: str = "") -> float:
    k = self.num_digits
    score = 0.0
    for i, want in enumerate(prompt.answer):
      if i < len(response_ids):
        tok = response_ids[i]
        if tok == self.offset + want:
          score += 1.0
        elif self.offset <= tok < self.offset + 10:
          score += 0.2
    score /= k
    if len(response_ids) > k and response_ids[k] == self.eos:
      score += 1.0 / (k + 1)
    return score


class JsonlTask:
  """Prompts from a JSONL file, rewards from a user function.

  Each line is ``{"prompt_ids": [...], ...}`` (token ids) or ``{"prompt": "text", ...}``
  (tokenised with the model directory's Hugging Face tokenizer, loaded offline). The reward
  function, given by import path (``package.module.function`` or ``package.module:function``),
  is called as ``reward_fn(record, response_ids, response_text) -> float``.
  """

  def __init__(self, path: str, reward_fn: str | Callable, *, tokenizer_path: str | None = None,
               stop_token_ids: Sequence[int] = (), max_new_tokens: int | None = None):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"task dataset not found: {path}")
    self.reward_fn = resolve_correction_fn(reward_fn)
    self.stop_token_ids = tuple(stop_token_ids)
    self.max_new_tokens = max_new_tokens
    tokenizer = None
    self.records: list[Prompt] = []
    with open(path) as f:
      for lineno, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          rec = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from None
        if "prompt_ids" in rec:
          ids = rec["prompt_ids"]
          if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{path}:{lineno}: 'prompt_ids' must be a non-empty list of ints")
        elif "prompt" in rec:
          if tokenizer is None:
            tokenizer = _load_tokenizer(tokenizer_path, path)
          ids = tokenizer.encode(rec["prompt"])
        else:
          raise ValueError(f"{path}:{lineno}: a record needs 'prompt_ids' or 'prompt'")
        self.records.append(Prompt(ids=tuple(ids), answer=rec.get("answer"), record=rec))
    if not self.records:
      raise ValueError(f"{path}: no records")
    self.max_prompt_len = max(len(r.ids) for r in self.records)

  def prompts(self, seed: int, step: int, count: int) -> list[Prompt]:
    # Epoch-wise shuffles: step s reads positions [s*count, (s+1)*count) of the stream.
    out = []
    for pos in range(step * count, (step + 1) * count):
      epoch, i = divmod(pos, len(self.records))
      out.append(self.records[np.random.default_rng([seed, epoch]).permutation(len(self.records))[i]])
    return out

  def reward(self, prompt: Prompt, response_ids: Sequence[int], text: str) -> float:
    value = float(self.reward_fn(prompt.record, list(response_ids), text))
    if not np.isfinite(value):
      raise ValueError(f"reward function returned {value} for record {prompt.record!r}")
    return value


def _load_tokenizer(tokenizer_path, dataset_path):
  if tokenizer_path is None:
    raise ValueError(f"{dataset_path}: records with 'prompt' text need a tokenizer; give 'prompt_ids' "
                     "or a model directory holding a tokenizer")
  from transformers import AutoTokenizer  # optional dependency, only for text prompts
  return AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)


def make_task(cfg: dict, *, vocab_size: int, model_path: str | None = None):
  cfg = dict(cfg)
  name = cfg.pop("name", "copy_digits")
  if name == "copy_digits":
    return CopyDigitsTask(vocab_size=vocab_size, **cfg)
  if name == "jsonl":
    if "path" not in cfg or "reward_fn" not in cfg:
      raise ValueError("task 'jsonl' needs 'path' and 'reward_fn'")
    return JsonlTask(cfg.pop("path"), cfg.pop("reward_fn"), tokenizer_path=model_path, **cfg)
  raise ValueError(f"unknown task {name!r}; choose 'copy_digits' or 'jsonl'")
