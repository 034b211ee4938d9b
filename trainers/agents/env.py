"""Deprecated alias: the environment protocol (`Environment`, `Tool`, `Turn`, `Observation`, `call_tool`, …)
moved to `trainers.tasks.env` — tasks own it, agents drive it. This module goes in the next release."""

import warnings

from trainers.tasks.env import *  # noqa: F401,F403
from trainers.tasks.env import AgentTask, Environment, Observation, Tool, ToolError, Turn, call_tool, is_agent_task  # noqa: F401

warnings.warn("trainers.agents.env moved to trainers.tasks.env", DeprecationWarning, stacklevel=2)
