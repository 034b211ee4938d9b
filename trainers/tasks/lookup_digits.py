"""The built-in tool task: answer digits that only a lookup tool reveals (a multi-turn agent task).

Prompt ``[BOS, KEY, SEP]``: a record's key. Its ``k`` digits are drawn at random per prompt and are
nowhere in the prompt: the model must call the tool. A turn that starts with ``LOOKUP`` is a tool
call; the environment answers ``[RESULT, d1 … dk, SEP]`` (the tool's output, then the separator
that hands the turn back). A turn that does not is the answer: the share of the ``k`` positions
holding the right digit (``digit_credit`` of that credit for a wrong digit; 0 by default: a wrong
guess earns nothing), plus ``1/(k+1)`` for EOS right after the digits; the first successful call
earns ``tool_bonus`` (0.2). A ``LOOKUP`` anywhere but first is a malformed call (answered
``[ERROR, SEP]``, counted). With ``tool: false`` every call fails the same way: the digits are then
chance — with one digit, an expected reward of 0.6 against 1.7 for a model that calls and copies.

A tiny model learns it from random initialisation on a CPU (`configs/agent_demo.yaml`, one digit):
first to call the tool, then to copy its digit into the answer (docs/guides/agents.md).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from trainers.tasks.env import Observation, Turn
from trainers.tasks.base import Prompt


class LookupDigitsTask:
  """The tool task (see the module doc). Token ids: BOS 1, EOS 2, digits ``3 … 12``, SEP 13,
  ``LOOKUP`` 14, ``RESULT`` 15, ``ERROR`` 16, keys ``20 …`` (at most ``vocab_size``)."""

  bos, eos, sep, lookup, result, error, digit_offset, key_offset = 1, 2, 13, 14, 15, 16, 3, 20

  def __init__(
    self,
    *,
    num_digits: int = 3,
    tool: bool = True,
    tool_bonus: float = 0.2,
    vocab_size: int = 64,
    num_keys: int = 16,
    num_values: int = 10,
    digit_credit: float = 0.0,
  ):
    if self.key_offset + num_keys > vocab_size:
      raise ValueError(f"vocab_size={vocab_size} too small for {num_keys} keys at {self.key_offset}")
    if not 1 <= num_values <= 10:
      raise ValueError(f"num_values={num_values}: the digits are drawn from 0 .. num_values - 1 (at most 10)")
    self.num_digits, self.tool, self.tool_bonus, self.num_keys = num_digits, tool, tool_bonus, num_keys
    self.num_values, self.digit_credit = num_values, digit_credit
    self.stop_token_ids = (self.eos,)
    self.max_new_tokens = num_digits + 1
    self.max_prompt_len = 3
    self.summary = f"lookup_digits ({num_digits} digits, tool {'on' if tool else 'off'})"

  def prompts(self, seed: int, step: int, count: int) -> list[Prompt]:
    rng = np.random.default_rng([seed, step, 7])
    keys = rng.integers(0, self.num_keys, count)
    digits = rng.integers(0, self.num_values, (count, self.num_digits))
    return [
      Prompt(ids=(self.bos, self.key_offset + int(k), self.sep), answer=tuple(int(d) for d in row))
      for k, row in zip(keys, digits)
    ]

  def environment(self, prompt: Prompt) -> "LookupEnvironment":
    return LookupEnvironment(self, prompt.answer)

  def score(self, answer: Sequence[int], response_ids: Sequence[int]) -> float:
    """The answer turn's reward (copy-digits scoring)."""
    k, score = self.num_digits, 0.0
    for i, want in enumerate(answer):
      if i < len(response_ids):
        tok = response_ids[i]
        if tok == self.digit_offset + want:
          score += 1.0
        elif self.digit_offset <= tok < self.digit_offset + 10:
          score += self.digit_credit
    score /= k
    if len(response_ids) > k and response_ids[k] == self.eos:
      score += 1.0 / (k + 1)
    return score


class LookupEnvironment:
  """One trajectory of `LookupDigitsTask`: answers tool calls, scores the answer."""

  def __init__(self, task: LookupDigitsTask, digits: tuple[int, ...]):
    self.task, self.digits, self.called = task, digits, False

  def step(self, turn: Turn) -> Observation:
    t = self.task
    ids = list(turn.ids)
    if ids and ids[0] == t.lookup:
      if not t.tool:
        return Observation(ids=(t.error, t.sep), counts={"tool_calls": 1, "tool_errors": 1})
      bonus = 0.0 if self.called else t.tool_bonus
      self.called = True
      return Observation(
        ids=(t.result, *[t.digit_offset + d for d in self.digits], t.sep), reward=bonus, counts={"tool_calls": 1}
      )
    if t.lookup in ids:
      return Observation(ids=(t.error, t.sep), counts={"malformed_calls": 1})
    return Observation(reward=t.score(self.digits, ids), done=True)
