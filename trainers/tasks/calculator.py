"""A calculator tool and an arithmetic task that uses it, in Qwen3's tool format (a multi-turn agent task).

- `Calculator`: the tool (`trainers.tasks.env.Tool`): ``calculator(expression="12*(3+4)")`` →
  ``"84"``. `evaluate` reads the expression with `ast` and computes only numbers, parentheses,
  unary ``+ -`` and ``+ - * / // % **`` — nothing else is evaluated (names, calls, attributes,
  strings: an error). Bounds: expressions of at most `MAX_EXPRESSION_CHARS` characters, every
  intermediate result at most `MAX_ABS` in magnitude, exponents at most `MAX_EXPONENT`. Integers
  stay exact; ``/`` gives a float, written as an integer when it is one (``8/2`` → ``4``) and with
  12 significant digits otherwise. Errors raise `CalculatorError` (a `ValueError`).
- `CalculatorEnvironment` (`trainers.tasks.env.Environment`): a turn with ``<tool_call>`` blocks
  (`trainers.tasks.qwen3_tools.parse_tool_calls`) runs each call (`trainers.tasks.env.call_tool`, with
  a time limit) and answers with the results as Qwen3's tool messages
  (`trainers.tasks.qwen3_tools.ToolResponseEncoder`), reward 0, not done. A malformed call (bad JSON,
  no name, arguments not an object, an unknown tool, past `max_calls_per_turn`) is answered with an
  ``Error: …`` text and counted ``malformed_calls``; a call that raises or times out with an
  ``Error: …`` text, counted ``tool_errors``; every ``<tool_call>`` block counts in ``tool_calls``.
  A turn without tool calls is the answer: done, reward 1.0 when its final answer equals the
  ground truth, else 0.0. A turn cut by the token limit (``finish_reason: length``) also ends the
  trajectory, scored as an answer (its calls are not run: its context has no end of turn).
- `CalculatorTask` (`trainers.tasks.env.AgentTask`): arithmetic problems (``num_operands``
  integers of up to ``max_digits`` digits joined by ``+ - *``, precedence as usual), drawn
  deterministically from ``(seed, step)``, as one user message rendered by the tokenizer's chat
  template with ``tools=[CALCULATOR_SCHEMA]`` and the generation prompt.

*Final answer* of an answer turn (`final_answer`): read after its reasoning (after the last
``</think>``), the content of its last ``\\boxed{…}`` when it has one — which must then be a number
(``1,234``, ``-5``, ``3.5``, ``$42$``) — else the last number in the text. Equal means the same
rational number (``408`` = ``408.0``).
"""

from __future__ import annotations

import ast
import math
import operator
import os
import re
from fractions import Fraction
from typing import Any, Mapping, Sequence

import numpy as np

from trainers.tasks import qwen3_tools as qwen3
from trainers.tasks.env import Observation, Tool, ToolError, Turn, call_tool
from trainers.tasks import chat
from trainers.tasks.base import Prompt
from trainers.tasks.rewards import last_boxed

MAX_EXPRESSION_CHARS = 200
MAX_ABS = 10**15
MAX_EXPONENT = 64

CALCULATOR_SCHEMA = {
  "type": "function",
  "function": {
    "name": "calculator",
    "description": (
      "Evaluate an arithmetic expression: numbers, parentheses and + - * / // % ** (exact for integers)."
    ),
    "parameters": {
      "type": "object",
      "properties": {"expression": {"type": "string", "description": 'The expression, e.g. "12*(3+4)".'}},
      "required": ["expression"],
    },
  },
}

INSTRUCTION = "Use the calculator tool to compute it, then give the final answer as \\boxed{N}."


class CalculatorError(ValueError):
  """An expression the calculator does not evaluate (not arithmetic, out of bounds, division by zero)."""


_BINARY = {
  ast.Add: operator.add,
  ast.Sub: operator.sub,
  ast.Mult: operator.mul,
  ast.Div: operator.truediv,
  ast.FloorDiv: operator.floordiv,
  ast.Mod: operator.mod,
  ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOL = {
  ast.BitXor: "^ (write powers as **)",
  ast.BitAnd: "&",
  ast.BitOr: "|",
  ast.LShift: "<<",
  ast.RShift: ">>",
  ast.MatMult: "@",
  ast.Invert: "~",
  ast.Not: "not",
}


def evaluate(expression: str) -> int | float:
  """The value of an arithmetic expression (see the module doc); `CalculatorError` otherwise."""
  if not isinstance(expression, str):
    raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
  text = expression.strip()
  if not text:
    raise CalculatorError("empty expression")
  if len(text) > MAX_EXPRESSION_CHARS:
    raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
  try:
    tree = ast.parse(text, mode="eval")
  except SyntaxError:
    raise CalculatorError(f"not an arithmetic expression: {text!r}") from None
  return _value(tree.body)


def _value(node: ast.AST) -> int | float:
  if isinstance(node, ast.Constant):
    v = node.value
    if isinstance(v, bool) or not isinstance(v, (int, float)):
      raise CalculatorError(f"only numbers are allowed, got {v!r}")
    return _bounded(v)
  if isinstance(node, ast.UnaryOp):
    if type(node.op) not in _UNARY:
      raise CalculatorError(f"unsupported operator {_SYMBOL.get(type(node.op), type(node.op).__name__)}")
    return _bounded(_UNARY[type(node.op)](_value(node.operand)))
  if isinstance(node, ast.BinOp):
    if type(node.op) not in _BINARY:
      raise CalculatorError(f"unsupported operator {_SYMBOL.get(type(node.op), type(node.op).__name__)}")
    left, right = _value(node.left), _value(node.right)
    if isinstance(node.op, ast.Pow):
      _check_power(left, right)
    try:
      result = _BINARY[type(node.op)](left, right)
    except ZeroDivisionError:
      raise CalculatorError("division by zero") from None
    except OverflowError:
      raise CalculatorError(f"result larger than {MAX_ABS:.0e}") from None
    return _bounded(result)
  what = type(node).__name__
  if isinstance(node, ast.Name):
    what = f"name {node.id!r}"
  elif isinstance(node, ast.Call):
    what = "function call"
  raise CalculatorError(f"only numbers, parentheses and + - * / // % ** are allowed, got {what}")


def _check_power(base, exponent) -> None:
  if abs(exponent) > MAX_EXPONENT:
    raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
  if base == 0 and exponent < 0:
    raise CalculatorError("division by zero")
  if base < 0 and not float(exponent).is_integer():
    raise CalculatorError("fractional power of a negative number")
  if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(MAX_ABS) + 1e-9:
    raise CalculatorError(f"result larger than {MAX_ABS:.0e}")


def _bounded(value):
  if isinstance(value, complex):
    raise CalculatorError("complex result")
  if isinstance(value, float) and not math.isfinite(value):
    raise CalculatorError("result is not a finite number")
  if abs(value) > MAX_ABS:
    raise CalculatorError(f"result larger than {MAX_ABS:.0e}")
  return value


def format_number(value: int | float) -> str:
  """An integer as it is; a float as an integer when it is one, else with 12 significant digits."""
  if isinstance(value, float):
    if value.is_integer():
      return str(int(value))
    return format(value, ".12g")
  return str(value)


class Calculator:
  """The calculator tool: ``calculator(expression=...)`` → the value as text (`evaluate`)."""

  name = "calculator"
  schema = CALCULATOR_SCHEMA

  def __call__(self, expression: str = None, **unexpected: Any) -> str:  # type: ignore[assignment]
    if unexpected:
      raise TypeError(f"unexpected arguments {', '.join(sorted(unexpected))} (the calculator takes 'expression')")
    if expression is None:
      raise TypeError("missing argument 'expression'")
    return format_number(evaluate(expression))


_NUMBER = re.compile(r"(?:(?<![\w.)])-)?\d+(?:,\d{3})*(?:\.\d+)?")  # "12-4": 12 and 4, not -4


def _number(text: str) -> Fraction | None:
  try:
    return Fraction(text.replace(",", ""))
  except (ValueError, ZeroDivisionError):
    return None


def final_answer(text: str) -> Fraction | None:
  """An answer turn's final answer (see the module doc), or None when it has none."""
  text = qwen3.answer_text(text)
  boxed = last_boxed(text)
  if boxed is not None:
    inner = boxed.strip().strip("$").replace(" ", "")
    return _number(inner) if _NUMBER.fullmatch(inner) else None
  numbers = _NUMBER.findall(text)
  return _number(numbers[-1]) if numbers else None


def score_answer(text: str, ground_truth) -> float:
  """1.0 when the turn's final answer equals ``ground_truth`` (a number or its text), else 0.0."""
  got = final_answer(text)
  want = ground_truth if isinstance(ground_truth, Fraction) else _number(str(ground_truth).strip())
  return 1.0 if got is not None and want is not None and got == want else 0.0


class CalculatorEnvironment:
  """One trajectory of a calculator task (see the module doc): runs the turn's tool calls, or scores
  its answer against ``answer``. ``encoder`` turns the tool responses into ids (shared by the task's
  environments); ``tools`` are the callable tools (by default the calculator)."""

  def __init__(
    self,
    answer,
    *,
    encoder: qwen3.ToolResponseEncoder,
    tools: Sequence[Tool] | Mapping[str, Tool] = (),
    timeout_s: float = 5.0,
    max_calls_per_turn: int = 8,
  ):
    self.answer, self.encoder, self.timeout_s, self.max_calls_per_turn = answer, encoder, timeout_s, max_calls_per_turn
    tools = tools or (Calculator(),)
    self.tools = dict(tools) if isinstance(tools, Mapping) else {t.name: t for t in tools}

  def step(self, turn: Turn) -> Observation:
    calls = qwen3.parse_tool_calls(turn.text)
    if not calls or turn.finish_reason == "length":
      return Observation(reward=score_answer(turn.text, self.answer), done=True)
    responses, malformed, errors = [], 0, 0
    for i, call in enumerate(calls):
      if i >= self.max_calls_per_turn:
        responses.append(f"Error: more than {self.max_calls_per_turn} tool calls in one turn; this one was not run")
        malformed += 1
      elif not call.ok:
        responses.append(f"Error: malformed tool call: {call.error}")
        malformed += 1
      elif call.name not in self.tools:
        responses.append(f"Error: unknown tool {call.name!r} (tools: {', '.join(sorted(self.tools))})")
        malformed += 1
      else:
        try:
          responses.append(call_tool(self.tools, call.name, call.arguments, timeout_s=self.timeout_s))
        except ToolError as e:
          responses.append(f"Error: {e}")
          errors += 1
    ids = self.encoder(responses)
    if turn.ids and turn.ids[-1] != self.encoder.end_id:
      ids = (self.encoder.end_id, *ids)  # a turn that stopped on another token (EOS): close it as the template does
    return Observation(ids=ids, counts={"tool_calls": len(calls), "tool_errors": errors, "malformed_calls": malformed})


class CalculatorTask:
  """Arithmetic with a calculator tool, for a Qwen3-style chat template (see the module doc).

  ``tokenizer``: a Hugging Face tokenizer directory (or a loaded tokenizer; None: ``model_path``'s)
  whose chat template renders ``tools`` and Qwen3's tool messages (Qwen3's own:
  `trainers.tasks.qwen3_tools`).
  ``chat_template_kwargs`` (e.g. ``{enable_thinking: false}``) go to every rendering, the
  prompts' and the tool responses'. Stop tokens: ``stop_token_ids``, else ``<|im_end|>`` (the
  template's end of turn), the tokenizer's EOS and ``<|endoftext|>`` (each once). Problems with the
  tokenizer or its template are a `ValueError` raised here, before any server starts.
  """

  def __init__(
    self,
    tokenizer: Any = None,
    *,
    model_path: str | None = None,
    num_operands: int = 3,
    max_digits: int = 3,
    max_new_tokens: int | None = 512,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    system_prompt: str | None = None,
    timeout_s: float = 5.0,
    max_calls_per_turn: int = 8,
    stop_token_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
  ):
    if num_operands < 2 or max_digits < 1:
      raise ValueError(f"calculator task: num_operands >= 2 and max_digits >= 1, got {num_operands}, {max_digits}")
    tokenizer = tokenizer if tokenizer is not None else model_path
    if tokenizer is None:
      raise ValueError("calculator task: no tokenizer (set task.tokenizer, or a model path with one)")
    self.tokenizer = chat.load_tokenizer(str(tokenizer)) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    if not chat.has_chat_template(self.tokenizer):
      raise ValueError("calculator task: the tokenizer has no chat template")
    if vocab_size is not None and len(self.tokenizer) > vocab_size:
      raise ValueError(
        f"calculator task: the tokenizer has {len(self.tokenizer)} tokens but the model's vocabulary only {vocab_size}"
      )
    self.template_kwargs = dict(chat_template_kwargs or {})
    chat.check_template_kwargs(self.tokenizer, self.template_kwargs)
    self.num_operands, self.max_digits, self.max_new_tokens = num_operands, max_digits, max_new_tokens
    self.system_prompt, self.timeout_s, self.max_calls_per_turn = system_prompt, timeout_s, max_calls_per_turn
    self.calculator = Calculator()
    self.tools = [CALCULATOR_SCHEMA]

    probe = self.messages("What is 1 + 1?")
    with_tools = self.tokenizer.apply_chat_template(
      probe, tools=self.tools, add_generation_prompt=True, tokenize=False, **self.template_kwargs
    )
    without = self.tokenizer.apply_chat_template(
      probe, add_generation_prompt=True, tokenize=False, **self.template_kwargs
    )
    if with_tools == without:
      raise ValueError("calculator task: the tokenizer's chat template does not render tools")
    self.encoder = qwen3.ToolResponseEncoder(self.tokenizer, self.template_kwargs, tool_name=Calculator.name)
    self.encoder(["0"])  # a template that cannot render tool responses fails here, not mid-run

    if stop_token_ids is not None:
      self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
    else:
      vocab = self.tokenizer.get_vocab()
      found = [self.encoder.end_id, self.tokenizer.eos_token_id, vocab.get("<|endoftext|>")]
      self.stop_token_ids = tuple(dict.fromkeys(int(t) for t in found if t is not None))
    for t in self.stop_token_ids:
      if vocab_size is not None and not 0 <= t < vocab_size:
        raise ValueError(f"calculator task: stop token {t} is not a token id of the model's vocabulary")

    widest = " * ".join(["9" * max_digits] * num_operands)  # the longest question: every operand of max_digits
    self.max_prompt_len = len(self.render(self.question(widest)))
    self.summary = (
      f"calculator ({num_operands} operands of up to {max_digits} digits, tool calculator, "
      f"Qwen3 tool format{f' {self.template_kwargs}' if self.template_kwargs else ''}), "
      f"stop tokens {list(self.stop_token_ids)}"
    )

  @staticmethod
  def question(expression: str) -> str:
    return f"What is {expression}? {INSTRUCTION}"

  def messages(self, question: str) -> list[dict]:
    system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
    return system + [{"role": "user", "content": question}]

  def render(self, question: str) -> tuple[int, ...]:
    """A prompt's ids: the question rendered with the tools and the generation prompt."""
    with self.encoder.lock:
      ids = self.tokenizer.apply_chat_template(
        self.messages(question),
        tools=self.tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **self.template_kwargs,
      )
    return tuple(int(t) for t in ids)

  def problems(self, seed: int, step: int, count: int) -> list[tuple[str, int]]:
    """``(expression, value)`` pairs, deterministic in ``(seed, step)``."""
    rng = np.random.default_rng([seed, step, 23])
    out = []
    for _ in range(count):
      digits = rng.integers(1, self.max_digits + 1, self.num_operands)
      operands = [int(rng.integers(2 if d == 1 else 10 ** (d - 1), 10**d)) for d in digits]
      ops = rng.choice(["+", "-", "*"], self.num_operands - 1)
      expression = str(operands[0]) + "".join(f" {op} {x}" for op, x in zip(ops, operands[1:]))
      out.append((expression, int(evaluate(expression))))
    return out

  def prompts(self, seed: int, step: int, count: int) -> list[Prompt]:
    prompts = []
    for expression, value in self.problems(seed, step, count):
      q = self.question(expression)
      prompts.append(
        Prompt(ids=self.render(q), answer=value, record={"question": q, "expression": expression, "answer": value})
      )
    return prompts

  def environment(self, prompt: Prompt) -> CalculatorEnvironment:
    return CalculatorEnvironment(
      prompt.answer,
      encoder=self.encoder,
      tools=(self.calculator,),
      timeout_s=self.timeout_s,
      max_calls_per_turn=self.max_calls_per_turn,
    )
