"""The built-in rewards (`trainers.tasks.rewards`) on tables of answers: boxed, GSM8K `####`,
thousands separators, negative numbers, fractions, symbolic forms, malformed answers."""

import threading

import pytest

from trainers.tasks import rewards

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 48+24 = <<48+24=72>>72.\n#### 72"
MATH_SOLUTION = "Dividing both sides, $x = \\boxed{\\dfrac{1}{2}}$."

MATH = [  # (response, ground truth, reward)
  ("so the answer is \\boxed{72}.", "72", 1.0),
  ("48 + 24 = 72\n#### 72", "72", 1.0),
  ("#### 72.", "72", 1.0),
  ("#### $18", "18", 1.0),
  ("#### 1,000", "1000", 1.0),
  ("\\boxed{1,000}", "1000", 1.0),
  ("#### 1000", "1,000", 1.0),
  ("#### -3", "-3", 1.0),
  ("#### 3", "-3", 0.0),
  ("\\boxed{-5}", "5", 0.0),
  ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
  ("#### 3/4", "0.75", 1.0),
  ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
  ("\\boxed{\\frac{2}{3}}", "0.5", 0.0),
  ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
  ("\\boxed{x = 5}", "5", 1.0),
  ("\\boxed{12.}", "12", 1.0),
  ("\\boxed{\\frac{x}{2}}", "x/2", 1.0),  # symbolic, both sides
  ("\\boxed{x + 1}", "1 + x", 1.0),
  ("\\boxed{2x}", "2", 0.0),
  ("#### 18 dollars", "18", 1.0),
  ("\\boxed{5\\%}", "5%", 1.0),
  ("first \\boxed{3}, finally \\boxed{4}", "4", 1.0),  # the last box counts
  ("first \\boxed{4}, finally \\boxed{3}", "4", 0.0),
  ("#### 7, but really \\boxed{8}", "8", 1.0),  # a box wins over ####
  ("#### 72", GSM8K_SOLUTION, 1.0),  # a whole GSM8K solution as ground truth
  ("#### 71", GSM8K_SOLUTION, 0.0),
  ("\\boxed{0.5}", MATH_SOLUTION, 1.0),  # a whole MATH solution as ground truth
  ("72", "72", 0.0),  # no final answer
  ("\\boxed{72", "72", 0.0),  # unclosed box
  ("####", "72", 0.0),
  ("#### \n72", "72", 0.0),  # the answer must be on the #### line
  ("#### seventy-two", "72", 0.0),
  ("\\boxed{}", "72", 0.0),
  ("", "72", 0.0),
]

EXACT = [
  ("#### 72", "72", 1.0),
  ("\\boxed{72}", "72", 1.0),
  ("72", "72", 1.0),  # no final answer: the whole stripped response
  ("  72 \n", "72", 1.0),
  ("#### 72", GSM8K_SOLUTION, 1.0),
  ("#### -3", "-3", 1.0),
  ("#### 1,000", "1000", 0.0),  # exact means exact
  ("\\boxed{0.5}", "\\frac{1}{2}", 0.0),
  ("\\boxed{72", "72", 0.0),
  ("the answer is 72", "72", 0.0),
]

FORMAT = [
  ("#### 72", 1.0),
  ("\\boxed{x+1}", 1.0),
  ("a \\boxed{\\frac{1}{2}} b", 1.0),
  ("\\boxed{72", 0.0),
  ("\\boxed{}", 0.0),
  ("72", 0.0),
  ("####", 0.0),
  ("####   ", 0.0),
]


@pytest.mark.parametrize("response,ground_truth,want", MATH, ids=[f"{r!r}~{g[:12]!r}" for r, g, _ in MATH])
def test_math_reward(response, ground_truth, want):
  assert rewards.math_reward(response, ground_truth) == want
  assert rewards.REWARDS["math"].fn(response, ground_truth) == want


@pytest.mark.parametrize("response,ground_truth,want", EXACT, ids=[f"{r!r}~{g[:12]!r}" for r, g, _ in EXACT])
def test_exact_match_reward(response, ground_truth, want):
  assert rewards.exact_match_reward(response, ground_truth) == want


@pytest.mark.parametrize("response,want", FORMAT, ids=[repr(r) for r, _ in FORMAT])
def test_format_reward(response, want):
  assert rewards.format_reward(response) == want
  assert rewards.format_reward(response, "anything") == want


def test_final_answer_and_last_boxed():
  assert rewards.final_answer("x \\boxed{\\frac{a}{b}} y") == ("\\frac{a}{b}", "boxed")
  assert rewards.final_answer("#### 12 apples\nmore text") == ("12 apples", "####")
  assert rewards.final_answer("no answer") is None
  assert rewards.last_boxed("\\boxed {5} and \\boxed{6") == "5"  # the later box never closes


def test_math_ground_truth_problems_and_thread_safety():
  assert rewards.math_ground_truth_problem("72") is None
  assert rewards.math_ground_truth_problem(GSM8K_SOLUTION) is None
  assert "cannot read the ground truth ''" in rewards.math_ground_truth_problem("")
  assert rewards.ground_truth_text(72) == "72" and rewards.ground_truth_text(0.5) == "0.5"
  assert rewards.ground_truth_text(True) is None and rewards.ground_truth_text(["72"]) is None
  # math-verify's timeouts use signal.alarm (main thread only); other threads still get a reward.
  out = []
  thread = threading.Thread(target=lambda: out.append(rewards.math_reward("\\boxed{\\frac{1}{2}}", "0.5")))
  thread.start()
  thread.join()
  assert out == [1.0]
