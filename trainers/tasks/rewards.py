"""Built-in verifiable rewards, chosen by name (``task.reward_fn: math | exact_match | format``).

Each takes the response text (decoded by the task's tokenizer, special tokens skipped) and the
record's ground truth (``task.answer_key``; a string, or a number written as a string) and
returns 1.0 or 0.0.

*Final answer* of a response: the content of its last complete ``\\boxed{...}`` (braces
balanced) if it has one, else the rest of the line after its last ``####`` (GSM8K). A ground
truth is read the same way when it is a whole solution (GSM8K's ``answer`` column ``... ####
72``, MATH's ``solution`` with a ``\\boxed{}``), else taken whole (verl's
``reward_model.ground_truth``).

- ``math``: the final answer is mathematically equal to the ground truth, decided by Hugging
  Face's ``math-verify`` (numbers with thousands separators, ``-3``, ``\\frac{1}{2}`` = ``0.5``,
  ``3/4``, ``2\\sqrt{2}`` = ``\\sqrt{8}``, ``x = 5`` = ``5``, ``\\frac{x}{2}`` = ``x/2``). A
  ``####`` line and a bare number are read as plain text, anything with a letter, a backslash
  or a brace as LaTeX. No final answer, or one that does not parse: 0.
- ``exact_match``: the final answer (or, when there is none, the whole stripped response) equals
  the stripped ground truth character for character (``1,000`` ≠ ``1000``).
- ``format``: the response has a final answer at all (ground truth unused).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Callable


def last_boxed(text: str) -> str | None:
  """The content of the last ``\\boxed{...}`` whose braces close, else None."""
  start = text.rfind("\\boxed")
  while start >= 0:
    i = start + len("\\boxed")
    while i < len(text) and text[i].isspace():
      i += 1
    if i < len(text) and text[i] == "{":
      depth = 0
      for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
          return text[i + 1 : j]
    start = text.rfind("\\boxed", 0, start)
  return None


def final_answer(text: str) -> tuple[str, str] | None:
  """``(answer, form)`` with form ``"boxed"`` or ``"####"``; None when the text has neither
  (or the answer is empty)."""
  boxed = last_boxed(text)
  if boxed is not None:
    return (boxed.strip(), "boxed") if boxed.strip() else None
  at = text.rfind("####")
  if at >= 0:
    answer = text[at + 4 :].split("\n", 1)[0].strip()
    return (answer, "####") if answer else None
  return None


def _ground_truth_answer(ground_truth: str) -> tuple[str, str]:
  found = final_answer(ground_truth) if ("####" in ground_truth or "\\boxed" in ground_truth) else None
  return found if found is not None else (ground_truth.strip(), "whole")


def _timeout() -> int | None:
  # math-verify's timeout uses signal.alarm, which only the main thread may set.
  return 5 if threading.current_thread() is threading.main_thread() else None


def _parse(answer: str, form: str):
  from math_verify import parse  # imported only when the math reward is used

  # A #### line (GSM8K: "1,234", "18 dollars") and a number ("-3", "3/4", "12.") are plain text;
  # anything with a letter, a backslash or a brace is LaTeX ("x/2", "\\frac{1}{2}"), parsed in
  # math mode. Plain text also parses about 5x faster (every ground truth is parsed at load).
  plain = form == "####" or not any(c.isalpha() or c in "\\{}" for c in answer)
  return parse(answer if plain else f"${answer}$", parsing_timeout=_timeout())


@functools.lru_cache(maxsize=65536)
def _parsed_ground_truth(ground_truth: str):
  return _parse(*_ground_truth_answer(ground_truth))


def math_reward(response: str, ground_truth: str) -> float:
  found = final_answer(response)
  if found is None:
    return 0.0
  gold = _parsed_ground_truth(ground_truth)
  answer = _parse(*found)
  if not gold or not answer:
    return 0.0
  from math_verify import verify

  return float(verify(gold, answer, timeout_seconds=_timeout()))


def math_ground_truth_problem(ground_truth: str) -> str | None:
  if not _parsed_ground_truth(ground_truth):
    return f"math-verify cannot read the ground truth {ground_truth!r} as a math answer"
  return None


def exact_match_reward(response: str, ground_truth: str) -> float:
  found = final_answer(response)
  answer = found[0] if found is not None else response.strip()
  return float(answer == _ground_truth_answer(ground_truth)[0])


def format_reward(response: str, ground_truth: str | None = None) -> float:
  return float(final_answer(response) is not None)


@dataclasses.dataclass(frozen=True)
class BuiltinReward:
  fn: Callable[[str, str | None], float]
  needs_ground_truth: bool
  # What is wrong with a ground truth (checked when the dataset loads), else None.
  ground_truth_problem: Callable[[str], str | None] | None = None


REWARDS: dict[str, BuiltinReward] = {
  "math": BuiltinReward(math_reward, True, math_ground_truth_problem),
  "exact_match": BuiltinReward(exact_match_reward, True),
  "format": BuiltinReward(format_reward, False),
}


def ground_truth_text(value) -> str | None:
  """A ground truth as text: strings as they are, ints and floats written out; None for
  anything else (lists, nulls, booleans)."""
  if isinstance(value, str):
    return value
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)
  return None
