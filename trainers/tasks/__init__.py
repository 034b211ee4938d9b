"""Tasks: prompts and verifiable rewards.

A task yields :class:`Prompt` s deterministically from ``(seed, step)`` (so a resumed run sees
the same prompts) and scores a response with a float reward.

- ``copy_digits`` (`copy_digits.py`): the built-in toy task.
- ``lookup_digits`` (`lookup_digits.py`): the built-in multi-turn tool task (an agent task: its
  prompts start trajectories, `trainers.agents`).
- ``calculator`` (`trainers.tasks.calculator`): arithmetic with a calculator tool in Qwen3's
  ``<tool_call>`` format, for a Qwen3 tokenizer (an agent task).
- ``dataset`` (`dataset.py`): JSONL / Parquet records (`dataset_files.py`) in the verl and TRL
  layouts, prompts rendered with the tokenizer's chat template (`chat.py`), rewards by name
  (`rewards.py`: ``math``, ``exact_match``, ``format``) or by import path.
"""

from __future__ import annotations

from trainers.tasks.base import Prompt, Task
from trainers.tasks.copy_digits import CopyDigitsTask
from trainers.tasks.dataset import DatasetTask
from trainers.tasks.lookup_digits import LookupDigitsTask
from trainers.tasks.rewards import REWARDS

__all__ = ["Prompt", "Task", "CopyDigitsTask", "DatasetTask", "LookupDigitsTask", "REWARDS", "make_task"]


def make_task(section, *, vocab_size: int, model_path: str | None = None) -> Task:
  """The task of a config's ``task`` section (`trainers.config.TaskSection`); the tokenizer is
  ``task.tokenizer`` or, when that is null and the task needs one, ``model_path``'s."""
  if section.name == "copy_digits":
    return CopyDigitsTask(vocab_size=vocab_size, num_digits=section.num_digits or 3)
  if section.name == "lookup_digits":
    return LookupDigitsTask(
      vocab_size=vocab_size, num_digits=section.num_digits or 3, tool=True if section.tool is None else section.tool
    )
  if section.name == "calculator":
    from trainers.tasks.calculator import CalculatorTask

    return CalculatorTask(
      section.tokenizer,
      model_path=model_path,
      vocab_size=vocab_size,
      chat_template_kwargs=section.chat_template_kwargs,
      max_new_tokens=section.max_new_tokens or 512,
      stop_token_ids=section.stop_token_ids,
    )
  return DatasetTask(
    section.path,
    section.reward_fn,
    tokenizer=section.tokenizer,
    model_path=model_path,
    prompt_key=section.prompt_key,
    answer_key=section.answer_key,
    chat_template=section.chat_template,
    chat_template_kwargs=section.chat_template_kwargs,
    stop_token_ids=section.stop_token_ids,
    max_new_tokens=section.max_new_tokens,
    vocab_size=vocab_size,
  )
