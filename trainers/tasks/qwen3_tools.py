"""Qwen3's chat-template conventions for tools: the real template, `<tool_call>` parsing, and the
token ids of tool responses as the template renders them.

- `QWEN3_CHAT_TEMPLATE`: the chat template of Qwen3's ``tokenizer_config.json`` (the hybrid
  thinking models, Qwen/Qwen3-0.6B … Qwen3-235B-A22B), verbatim.
- `parse_tool_calls`: the ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks of
  a model turn's text, each parsed or carrying a clear error (never an exception).
- `ToolResponseEncoder`: the token ids an environment appends after the model's turn — the
  template's ``\\n`` after the turn's ``<|im_end|>``, the tool messages (Qwen3 renders them inside
  one user turn: ``<|im_start|>user\\n<tool_response>\\n…\\n</tool_response><|im_end|>\\n``,
  consecutive tool messages merged), then the generation prompt ``<|im_start|>assistant\\n`` (and
  ``<think>\\n\\n</think>\\n\\n`` with ``enable_thinking: false``). Computed once per observation, as verl
  and slime do: a fixed base conversation is rendered with and without the tool messages and the
  ids are the difference (the base must be a prefix, else an error). Earlier turns are never
  re-rendered or re-tokenized: the trajectory keeps the ids the engine sampled.

Qwen3's template is not append-only: on re-render it drops the ``<think>`` block of an assistant
turn that comes before the last user query, and the empty ``<think>\\n\\n</think>\\n\\n`` that the
generation prompt adds with ``enable_thinking: false`` is not rendered for an earlier assistant turn
without reasoning. Tool messages do not count as a user query, so a tool-calling trajectory's
turns keep their thinking; either way the trajectory is built token in, token out.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from typing import Any, Mapping, Sequence

# The `chat_template` of Qwen3's tokenizer_config.json (e.g. huggingface.co/Qwen/Qwen3-8B,
# tokenizer_config.json at revision 895c8d171bc03c30e113cd7a28c02494b5e068b7), copied verbatim as
# data from huggingface/trl's `trl/chat_templates/qwen3.jinja` (commit
# f44cf20bd8c9e43954c7e2f72b01e8070fbc38d1, "Original Qwen3 chat template", which TRL compares byte
# for byte against `tokenizer.chat_template` to recognise Qwen3). sha256 of its UTF-8 bytes:
# a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8 (checked by the tests).
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
QWEN3_CHAT_TEMPLATE_SHA256 = "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
THINK_END = "</think>"
END_OF_TURN = "<|im_end|>"

_TOOL_CALL = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(" + re.escape(TOOL_CALL_END) + r"|\Z)", re.DOTALL)
_SPECIAL_TAIL = re.compile(r"(<\|im_end\|>|<\|endoftext\|>)\s*$")


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One ``<tool_call>`` block of a model turn: its ``name`` and ``arguments`` when it parsed
  (``error`` None), else ``error`` says what is wrong with it (``name`` may then be None).
  ``raw`` is the block's text between the tags."""

  name: str | None
  arguments: Mapping[str, Any]
  raw: str
  error: str | None = None

  @property
  def ok(self) -> bool:
    return self.error is None


def answer_text(text: str) -> str:
  """A turn's text after its reasoning: what follows the last ``</think>`` (the whole text when it
  has none; the template reads a turn the same way), without a trailing ``<|im_end|>`` /
  ``<|endoftext|>``."""
  if THINK_END in text:
    text = text.rsplit(THINK_END, 1)[1]
  return _SPECIAL_TAIL.sub("", text)


def parse_tool_calls(text: str) -> list[ToolCall]:
  """The ``<tool_call>`` blocks of a model turn's text, in order (empty: the turn calls no tool).

  Only the text after the turn's reasoning is read (`answer_text`): a ``<tool_call>`` inside
  ``<think>…</think>`` is thought, not a call. Each block's content must be one JSON object with a
  string ``name`` and an object ``arguments`` (absent: ``{}``; a string holding a JSON object is
  accepted, as some models write it); anything else — bad JSON, no name, a block that never
  closes — is a `ToolCall` whose ``error`` says why."""
  calls = []
  for match in _TOOL_CALL.finditer(answer_text(text)):
    raw, closed = match.group(1), bool(match.group(2))
    calls.append(_parse_one(raw.strip(), closed))
  return calls


def _parse_one(raw: str, closed: bool) -> ToolCall:
  def bad(why: str, name: str | None = None) -> ToolCall:
    return ToolCall(name=name, arguments={}, raw=raw, error=why)

  if not closed:
    return bad(f"{TOOL_CALL_START} without {TOOL_CALL_END}")
  if not raw:
    return bad("empty tool call")
  try:
    value = json.loads(raw)
  except json.JSONDecodeError as e:
    return bad(f"tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})")
  if not isinstance(value, dict):
    return bad(f"tool call must be a JSON object, got {type(value).__name__}")
  name = value.get("name")
  if not isinstance(name, str) or not name:
    return bad('tool call has no "name" (a non-empty string)')
  arguments = value.get("arguments", {})
  if arguments is None:
    arguments = {}
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
      return bad(f'tool call {name!r}: "arguments" is a string that is not a JSON object', name)
  if not isinstance(arguments, dict):
    return bad(f'tool call {name!r}: "arguments" must be a JSON object, got {type(arguments).__name__}', name)
  return ToolCall(name=name, arguments=arguments, raw=raw)


class TemplateNotPrefixError(ValueError):
  """The chat template renders the base conversation differently once tool messages follow it,
  so the tool responses' ids cannot be taken as a difference."""


class ToolResponseEncoder:
  """Token ids of tool responses as ``tokenizer``'s chat template renders them after an assistant
  turn that ended with its end-of-turn token (`end_id`, Qwen3's ``<|im_end|>``): the ids that
  follow that token, through the next generation prompt.

  ``encoder(["4", "9"])`` renders a fixed base conversation (a user message, then an assistant
  turn with reasoning and a tool call) with and without the tool messages (``add_generation_prompt``
  and ``template_kwargs`` on the second) and returns the ids after the base's last end-of-turn
  token; a `TemplateNotPrefixError` when the base's ids are not a prefix of the longer rendering.
  The base's reasoning keeps Qwen3's rendering of it the same in both (an assistant turn after the
  last user query keeps its ``<think>`` block only when it is the last message or has reasoning).
  Thread-safe: renderings hold `lock` (the environments of a batch share the tokenizer; a task
  rendering prompts with it meanwhile takes the same lock).
  """

  def __init__(self, tokenizer, template_kwargs: Mapping[str, Any] | None = None, *, tool_name: str = "tool"):
    self.tokenizer = tokenizer
    self.template_kwargs = dict(template_kwargs or {})
    self.tool_name = tool_name
    self.lock = threading.Lock()  # also held by a task rendering prompts with the same tokenizer
    self.base = [
      {"role": "user", "content": "base"},
      {
        "role": "assistant",
        "content": "",
        "reasoning_content": "base",
        "tool_calls": [{"type": "function", "function": {"name": tool_name, "arguments": {}}}],
      },
    ]
    self.base_ids = self._render(self.base, add_generation_prompt=False)
    self.end_id = end_of_turn_id(tokenizer)
    ends = [i for i, t in enumerate(self.base_ids) if t == self.end_id]
    if not ends:
      raise TemplateNotPrefixError(
        f"the chat template writes no end-of-turn token ({self.end_id}) after an assistant turn"
      )
    self.cut = ends[-1] + 1  # the base's ids through the assistant turn's end-of-turn token

  def _render(self, messages, *, add_generation_prompt: bool) -> list[int]:
    with self.lock:
      ids = self.tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **self.template_kwargs
      )
    return [int(t) for t in ids]

  def __call__(self, contents: Sequence[str]) -> tuple[int, ...]:
    """The ids of one observation: ``contents`` (one string per tool call, in order) as tool
    messages, then the generation prompt."""
    if not contents:
      raise ValueError("an observation needs at least one tool response")
    tools = [{"role": "tool", "name": self.tool_name, "content": str(c)} for c in contents]
    full = self._render(self.base + tools, add_generation_prompt=True)
    if full[: len(self.base_ids)] != self.base_ids:
      at = next((i for i, (a, b) in enumerate(zip(full, self.base_ids)) if a != b), min(len(full), len(self.base_ids)))
      raise TemplateNotPrefixError(
        f"the chat template is not append-only for tool messages: the base conversation's ids differ from its "
        f"rendering with tool messages at position {at} (base {self.tokenizer.decode(self.base_ids[at : at + 8])!r}, "
        f"with tools {self.tokenizer.decode(full[at : at + 8])!r})"
      )
    return tuple(full[self.cut :])


def end_of_turn_id(tokenizer) -> int:
  """Qwen3's ``<|im_end|>`` when the tokenizer has it, else the template's end of turn
  (`trainers.tasks.chat.end_of_turn_id`); a `ValueError` when there is none."""
  from trainers.tasks import chat

  vocab = tokenizer.get_vocab()
  if END_OF_TURN in vocab:
    return int(vocab[END_OF_TURN])
  found = chat.end_of_turn_id(tokenizer)
  if found is None:
    raise ValueError("the tokenizer has no <|im_end|> and its chat template no end-of-turn token")
  return int(found)


def tool_response_ids(
  tokenizer, contents: Sequence[str], template_kwargs: Mapping[str, Any] | None = None
) -> tuple[int, ...]:
  """`ToolResponseEncoder` for one call (an environment keeps one encoder: its base is rendered once)."""
  return ToolResponseEncoder(tokenizer, template_kwargs)(contents)
