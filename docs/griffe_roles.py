"""A griffe extension for the API pages: the docstrings' Sphinx roles (:class:`X`, :func:`x`,
:mod:`m`, ...) become links to the API page where ``X`` is a public ``mis_jax`` name, and inline
code otherwise, and each ``contract §N`` becomes a link to that section of the contract page (an
autorefs link to the heading id ``sN``: a section that does not exist fails the strict build).
``help()`` shows the docstrings as written."""

from __future__ import annotations

import re

import griffe

import mis_jax

CITATION = re.compile(r"contract §(\d+(?:\.\d+)?)((?:\s*[–-]\s*\d+(?:\.\d+)?)?)")
ROLE = re.compile(r":(?:class|func|mod|data|meth|attr|obj|exc):`~?([^`]+)`")
PUBLIC = set(mis_jax.__all__)


def _replace(match: re.Match) -> str:
  name = match.group(1)
  short = name.removeprefix("mis_jax.")
  if short in PUBLIC:
    return f"[`{short}`][mis_jax.{short}]"
  return f"`{name}`"


class SphinxRoles(griffe.Extension):
  def on_instance(self, *, node, obj, agent, **kwargs) -> None:
    if obj.docstring is not None:
      text = ROLE.sub(_replace, obj.docstring.value)
      obj.docstring.value = CITATION.sub(lambda m: f"[contract §{m.group(1)}{m.group(2)}][s{m.group(1)}]", text)
