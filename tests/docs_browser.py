"""The docs site in a headless browser (Debian's Chromium driven by playwright): which formulas
MathJax typeset on a page, which TeX it refused, which delimiters were left as text, and every
request the pages made. Shared by tests/test_docs.py and `make docs-check`."""

from __future__ import annotations

import contextlib
import functools
import http.server
import pathlib
import threading

# Chromium as the machine allows it: root, no GPU, no background connections to the vendor.
CHROMIUM_ARGS = [
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
]

# Run in the page once MathJax has finished: what arithmatex marked, what MathJax made of it, and
# any text outside code that still holds a TeX delimiter.
_REPORT_JS = """async () => {
  await MathJax.startup.promise;
  await document.fonts.ready;
  const marked = document.querySelectorAll('.arithmatex');
  const typeset = [...marked].filter(e => e.querySelector('mjx-container')).length;
  // A formula whose glyphs got no CSS (or no font) lays out with no width: typeset, yet unseen.
  const invisible = [...document.querySelectorAll('mjx-container')]
      .filter(c => c.getBoundingClientRect().width <= 0)
      .map(c => c.querySelector('mjx-assistive-mml')?.textContent || c.outerHTML.slice(0, 80));
  const fonts = [...document.fonts].filter(f => f.family.startsWith('MJXTEX') && f.status === 'loaded').length;
  const errors = [...document.querySelectorAll('mjx-merror')].map(e =>
      (e.getAttribute('data-mjx-error') || '') + ' in ' +
      (e.closest('mjx-container')?.getAttribute('aria-label') || e.textContent));
  const leftover = [];
  const walker = document.createTreeWalker(document.querySelector('article') || document.body, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (n.parentElement.closest('code, pre, script, style, mjx-container, mjx-assistive-mml')) continue;
    if (/\\\\[()\\[\\]]|\\$/.test(n.textContent)) leftover.push(n.textContent.trim().slice(0, 120));
  }
  return {marked: marked.length, typeset, invisible, errors, leftover, fonts};
}"""


@contextlib.contextmanager
def serve_folder(folder: pathlib.Path):
  """An HTTP server on 127.0.0.1 (a free port) for `folder`, as a reader's would serve the site."""
  handler = functools.partial(_QuietHandler, directory=str(folder))
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}/"
  finally:
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
  def log_message(self, *args) -> None:
    pass


def typeset_report(executable: str, base: str, pages: list[str], *, timeout_ms: int = 60_000):
  """Open each page of the site at `base` in headless Chromium; return ({page: report}, the URLs
  of requests made outside `base`). Such requests are refused, so a page that needs the network
  shows it in its report too. A report: marked (formulas arithmatex wrapped), typeset (those
  MathJax rendered), invisible (rendered formulas with no width: glyphs without their CSS or
  font), errors (TeX errors), leftover (text outside code still holding a delimiter), fonts
  (MathJax's TeX font faces the page loaded, from the site: nothing else is reachable)."""
  from playwright.sync_api import sync_playwright

  reports, foreign = {}, []
  with sync_playwright() as pw:
    browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
    try:
      context = browser.new_context()

      def route(r):
        if r.request.url.startswith(base) or r.request.url.startswith("data:"):
          r.continue_()
        else:
          foreign.append(r.request.url)
          r.abort()

      context.route("**/*", route)
      for page_path in pages:
        page = context.new_page()
        page.goto(base + page_path, wait_until="load", timeout=timeout_ms)
        page.wait_for_function("window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=timeout_ms)
        reports[page_path] = page.evaluate(_REPORT_JS)
        page.close()
    finally:
      browser.close()
  return reports, foreign
