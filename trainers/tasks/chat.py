"""Prompts rendered with the tokenizer's own chat template, and default stop tokens.

The tokenizer is a Hugging Face tokenizer directory (``tokenizer.json`` /
``tokenizer_config.json``, optionally ``chat_template.jinja``), loaded offline with
``transformers.AutoTokenizer``. Chat prompts are ``apply_chat_template(messages,
add_generation_prompt=True, tokenize=True)`` exactly, with the config's template variables
(e.g. Qwen3's ``enable_thinking``) passed through.
"""

from __future__ import annotations

from typing import Any, Sequence

_PROBE = "MISJAXENDOFTURNPROBE"  # an assistant reply whose end shows the template's end-of-turn


def load_tokenizer(path: str):
  """``AutoTokenizer.from_pretrained(path, local_files_only=True)``; a `ValueError` naming the
  path when that fails (never a download)."""
  import os

  if not os.path.isdir(path):
    raise ValueError(f"tokenizer {path!r}: no such directory")
  from transformers import AutoTokenizer  # imported only when a task needs a tokenizer

  try:
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
  except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad directory
    raise ValueError(
      f"tokenizer {path!r}: not a loadable Hugging Face tokenizer directory ({type(e).__name__}: {e})"
    ) from None


def has_chat_template(tokenizer) -> bool:
  return bool(getattr(tokenizer, "chat_template", None))


def template_variables(tokenizer) -> set[str] | None:
  """The variables the chat template reads (None when it cannot be analysed)."""
  template = getattr(tokenizer, "chat_template", None)
  if not isinstance(template, str):
    return None
  import jinja2
  from jinja2 import meta

  try:
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])  # the extension transformers enables
    return set(meta.find_undeclared_variables(env.parse(template)))
  except jinja2.TemplateError:
    return None


def check_template_kwargs(tokenizer, kwargs: dict) -> None:
  """Template variables the template never reads would be silently ignored by Jinja: an error."""
  if not kwargs:
    return
  if not has_chat_template(tokenizer):
    raise ValueError("task.chat_template_kwargs is set but the tokenizer has no chat template")
  used = template_variables(tokenizer)
  if used is None:
    return
  unused = sorted(set(kwargs) - used)
  if unused:
    raise ValueError(
      f"task.chat_template_kwargs: the tokenizer's chat template never reads {', '.join(unused)} "
      f"(it reads: {', '.join(sorted(used))})"
    )


def check_messages(messages: Any) -> str | None:
  """What is wrong with a chat prompt (a list of ``{role, content}`` with string values), else None."""
  if not isinstance(messages, list) or not messages:
    return "chat messages must be a non-empty list of {role, content}"
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
      return f"message {i} must be {{role: str, content: str}}, got {m!r}"
  return None


def render_chat(tokenizer, messages: Sequence[dict], template_kwargs: dict | None = None) -> list[int]:
  """Token ids of ``messages`` + the assistant generation prompt, by the tokenizer's template."""
  ids = tokenizer.apply_chat_template(
    list(messages), add_generation_prompt=True, tokenize=True, return_dict=False, **(template_kwargs or {})
  )
  return [int(t) for t in ids]


def end_of_turn_id(tokenizer, template_kwargs: dict | None = None) -> int | None:
  """The special token the template writes right after an assistant reply (Qwen's
  ``<|im_end|>``, Llama 3's ``<|eot_id|>``), found by rendering one; None if there is none."""
  if not has_chat_template(tokenizer):
    return None
  conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
  try:
    text = tokenizer.apply_chat_template(conversation, tokenize=False, **(template_kwargs or {}))
  except Exception:  # noqa: BLE001 - a template may refuse this conversation: no end of turn known
    return None
  at = text.rfind(_PROBE)
  if at < 0:
    return None
  rest = text[at + len(_PROBE) :].lstrip()
  special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
  matches = [s for s in special if rest.startswith(s)]
  return special[max(matches, key=len)] if matches else None


def default_stop_token_ids(tokenizer, template_kwargs: dict | None = None) -> tuple[int, ...]:
  """The template's end of turn, then the tokenizer's EOS (each once)."""
  ids = []
  for t in (end_of_turn_id(tokenizer, template_kwargs), tokenizer.eos_token_id):
    if t is not None and int(t) not in ids:
      ids.append(int(t))
  return tuple(ids)
