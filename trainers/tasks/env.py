"""Environments and tools: the small named parts of a multi-turn rollout.

An environment is made per trajectory from a task's prompt (`AgentTask.environment(prompt)`). The
episode driver (`trainers.agents.episodes`) sends the context to the engine, hands the model's turn
to `Environment.step` and appends the `Observation`'s token ids — tokenized once by the
environment (with the model's chat template for the tool role, boundary tokens included), never
decoded and re-encoded from sampled ids. An observation's `reward` adds to the trajectory's; `done`
ends it (its ids are then not appended).

A tool is a named callable from keyword arguments to text. `call_tool` runs one with a time
limit: a tool that raises or times out gives an error text instead (the environment turns it into
an error observation, and counts it), never a crashed run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

if TYPE_CHECKING:  # (trainers.tasks imports this module: its tool task is an agent task)
  from trainers.tasks.base import Prompt


@dataclasses.dataclass(frozen=True)
class Turn:
  """The model's turn as the environment sees it: the ids the engine sampled (stop token
  included), the engine's own text of them (for parsing only), why it ended (`stop` / `length`)
  and its index (1 = the first turn)."""

  ids: tuple[int, ...]
  text: str
  finish_reason: str
  index: int


@dataclasses.dataclass(frozen=True)
class Observation:
  """What the environment answers a turn with: the token ids it appends (the tool's output in
  the template's tool role, boundaries included, then the next generation prompt), the step's
  reward, whether the trajectory is done, and counters for the run's metrics (`tool_calls`,
  `tool_errors`, `malformed_calls`: summed over the batch as `agent/<name>`)."""

  ids: tuple[int, ...] = ()
  reward: float = 0.0
  done: bool = False
  counts: Mapping[str, int] = dataclasses.field(default_factory=dict)


class Environment(Protocol):
  """One trajectory's environment (made by `AgentTask.environment`): `step` on each model turn."""

  def step(self, turn: Turn) -> Observation: ...


class Tool(Protocol):
  """A tool: `name`, and a call from keyword arguments to its output text (it may raise)."""

  name: str

  def __call__(self, **arguments: Any) -> str: ...


class AgentTask(Protocol):
  """A task whose prompts start trajectories (`trainers.tasks.base.Task` plus `environment`):
  the trajectory's reward is the sum of its observations' rewards."""

  stop_token_ids: tuple[int, ...]
  max_new_tokens: int | None
  max_prompt_len: int
  summary: str

  def prompts(self, seed: int, step: int, count: int) -> list[Prompt]: ...

  def environment(self, prompt: Prompt) -> Environment: ...


def is_agent_task(task) -> bool:
  """Whether `task` starts trajectories (has `environment`) rather than single responses."""
  return callable(getattr(task, "environment", None))


class ToolError(RuntimeError):
  """A tool call that could not run: unknown tool, bad arguments, an exception or a timeout."""


_TOOL_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tool")


def call_tool(
  tools: Mapping[str, Tool] | Sequence[Tool], name: str, arguments: Mapping[str, Any] | None, *, timeout_s: float = 10.0
) -> str:
  """`tools[name](**arguments)` within `timeout_s`; raises `ToolError` naming the tool and what went
  wrong (unknown tool, arguments not a mapping, the tool's exception, the time limit). A call
  past its limit keeps running in its thread, but its result is never used."""
  by_name = tools if isinstance(tools, Mapping) else {t.name: t for t in tools}
  if name not in by_name:
    raise ToolError(f"unknown tool {name!r} (tools: {', '.join(sorted(by_name)) or 'none'})")
  if arguments is None:
    arguments = {}
  if not isinstance(arguments, Mapping):
    raise ToolError(f"tool {name!r}: arguments must be an object, got {type(arguments).__name__}")
  future = _TOOL_POOL.submit(lambda: by_name[name](**arguments))
  try:
    out = future.result(timeout=timeout_s)
  except concurrent.futures.TimeoutError:
    raise ToolError(f"tool {name!r} timed out after {timeout_s:g} s") from None
  except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation
    raise ToolError(f"tool {name!r} failed: {type(e).__name__}: {e}") from None
  return str(out)
