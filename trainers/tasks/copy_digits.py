"""The built-in toy task: repeat the prompt's digits, then stop."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from trainers.tasks.base import Prompt


class CopyDigitsTask:
  """Toy task: repeat the prompt's digits, then stop.

  Prompt ``[BOS, d1 … dk, SEP]``, expected response ``d1 … dk EOS`` with digits as token ids
  ``digit_offset + d``. Reward: the share of the k positions holding the right digit, 0.2 of
  that credit for a wrong digit (so a random policy gets a gradient towards digits), plus a
  bonus of ``1/(k+1)`` for EOS right after the digits; the maximum is ``1 + 1/(k+1)``. A tiny
  model learns it from random initialisation in a few hundred steps on a CPU.
  """

  def __init__(
    self, *, num_digits: int = 3, bos: int = 1, eos: int = 2, sep: int = 13, digit_offset: int = 3, vocab_size: int = 64
  ):
    if digit_offset + 10 > vocab_size or sep >= vocab_size:
      raise ValueError(f"vocab_size={vocab_size} too small for digits at {digit_offset}..{digit_offset + 9}")
    self.num_digits, self.bos, self.eos, self.sep, self.offset = num_digits, bos, eos, sep, digit_offset
    self.stop_token_ids = (eos,)
    self.max_new_tokens = num_digits + 1
    self.max_prompt_len = num_digits + 2
    self.summary = f"copy_digits ({num_digits} digits)"

  def prompts(self, seed: int, step: int, count: int) -> list[Prompt]:
    rng = np.random.default_rng([seed, step])
    digits = rng.integers(0, 10, (count, self.num_digits))
    return [
      Prompt(ids=(self.bos, *[self.offset + int(d) for d in row], self.sep), answer=tuple(int(d) for d in row))
      for row in digits
    ]

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
