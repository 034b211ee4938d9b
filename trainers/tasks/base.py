"""What a task is: prompts from ``(seed, step)``, a reward for a response."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class Prompt:
  ids: tuple[int, ...]
  answer: Any = None  # the ground truth (a dataset's `task.answer_key`), or the toy task's digits
  record: Any = None  # the dataset record, as read


class Task(Protocol):
  stop_token_ids: tuple[int, ...]
  max_new_tokens: int | None
  max_prompt_len: int
  summary: str  # one line for the run's log

  def prompts(self, seed: int, step: int, count: int) -> list[Prompt]: ...

  def reward(self, prompt: Prompt, response_ids: Sequence[int], text: str) -> float: ...
