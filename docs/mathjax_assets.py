"""An MkDocs hook: the docs site's formulas are typeset by MathJax served from the site itself.

MathJax 3 comes from the installed Python package ``django-static-mathjax`` (the ``docs`` extra;
its import name is ``mathjax``), not from a CDN and not from files committed here: after each
build this copies its TeX-to-CommonHTML component and the woff-v2 fonts it loads into
``site/assets/mathjax/``, where ``mkdocs.yml``'s ``extra_javascript`` points. A reader's browser
then makes no request outside the site. The formulas themselves are ``$...$`` / ``$$...$$`` in the
Markdown, which ``pymdownx.arithmatex`` (generic mode) wraps for MathJax.
"""

from __future__ import annotations

import importlib.resources
import pathlib
import shutil

COMPONENT = "tex-chtml.js"  # TeX input, CommonHTML output, the menu; no further component loads
FONTS = "output/chtml/fonts/woff-v2"  # where the component looks for its fonts, relative to itself
SITE_FOLDER = "assets/mathjax"


def mathjax_es5() -> pathlib.Path:
  """The folder of MathJax's prebuilt components inside the installed package."""
  try:
    root = importlib.resources.files("mathjax")
  except ModuleNotFoundError as e:
    raise RuntimeError(
      "the docs need MathJax from the `docs` extra: pip install -e '.[docs]' (package django-static-mathjax)"
    ) from e
  es5 = pathlib.Path(str(root)) / "static" / "mathjax" / "es5"
  if not (es5 / COMPONENT).is_file():
    raise RuntimeError(f"{es5 / COMPONENT} is missing: reinstall django-static-mathjax")
  return es5


def on_post_build(config, **kwargs) -> None:
  es5 = mathjax_es5()
  target = pathlib.Path(config["site_dir"]) / SITE_FOLDER
  (target / FONTS).mkdir(parents=True, exist_ok=True)
  shutil.copy2(es5 / COMPONENT, target / COMPONENT)
  for font in (es5 / FONTS).glob("*.woff"):
    shutil.copy2(font, target / FONTS / font.name)
