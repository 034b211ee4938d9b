// MathJax 3 configuration for pymdownx.arithmatex's generic output (\( \) inline, \[ \] display):
// only the elements arithmatex marks are typeset. Loaded before assets/mathjax/tex-chtml.js, which
// the build copies from the installed MathJax package (docs/mathjax_assets.py). Each page load
// typesets once, at MathJax's startup (mkdocs.yml has no navigation.instant). Material's usual
// `document$.subscribe(() => MathJax.typesetPromise())` re-typeset raced that startup here and left
// every formula without its glyphs' CSS (zero width): tests/test_docs.py checks the widths.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
    packages: {"[-]": ["noundefined"]},  // an unknown macro is a TeX error (mjx-merror), never red text
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};
