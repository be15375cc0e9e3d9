"""The built book as a reader's browser shows it: every chapter and lab in headless Chromium, offline.

Runs on the HTML that ``jupyter-book build`` wrote, named by ``NVFP4LAB_BOOK_HTML`` (``.ci/run`` sets
it after building the book; without it these tests skip, since there is nothing to look at). Each
page listed in ``_toc.yml`` is served from 127.0.0.1 and opened in Debian's Chromium through
Selenium, with every other host unreachable (``--host-resolver-rules``), as for a reader offline or
behind a firewall. A page fails on:

* a JavaScript error or a failed request that the console reports (level SEVERE);
* an image that did not load (a missing figure);
* a saved widget view that the ipywidgets html-manager did not render;
* mathematics that MathJax did not typeset.

``NVFP4LAB_REQUIRE_BROWSER=1`` (set by ``.ci/run``) turns a missing Chromium, chromedriver or Selenium
into a failure instead of a skip.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTML = os.environ.get("NVFP4LAB_BOOK_HTML")
REQUIRED = os.environ.get("NVFP4LAB_REQUIRE_BROWSER") == "1"
#: Console messages that are not the page's doing: the browser asks every server for a favicon.
IGNORED = ("/favicon.ico",)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
SETTLE_S = 20.0  # longest wait for the widgets of one page to render

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(HTML is None, reason="set NVFP4LAB_BOOK_HTML to a built book (_build/html) to render it"),
]


def _need(what: str, ok: bool) -> None:
    if not ok:
        (pytest.fail if REQUIRED else pytest.skip)(f"{what} is needed to render the book", pytrace=False)


def toc_pages() -> list[str]:
    """The HTML pages of every chapter and lab, in the order of ``_toc.yml``."""
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    pages = [toc["root"]]
    for part in toc["parts"]:
        for entry in part["chapters"]:
            if "file" in entry:
                pages.append(entry["file"])
            else:
                pages += sorted(str(p.relative_to(ROOT).with_suffix("")) for p in ROOT.glob(entry["glob"] + ".ipynb"))
    return [p + ".html" for p in pages]


@pytest.fixture(scope="module")
def server():
    root = Path(HTML)
    _need(f"a built book at {root} (index.html)", (root / "index.html").is_file())

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _need("selenium (pip install selenium)", False)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    _need("Chromium (Debian package chromium)", chromium is not None)
    _need("chromedriver (Debian package chromium-driver)", driver_path is not None)
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1", "--window-size=1280,2000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    yield driver
    driver.quit()


PAGE_STATE = f"""
const views = Array.from(document.querySelectorAll('script[type="{WIDGET_VIEW}"]'));
return {{
  ready: document.readyState,
  views: views.length,
  rendered: views.filter(s => s.parentElement.querySelector('.jupyter-widgets')).length,
  widget_errors: Array.from(document.querySelectorAll('.jupyter-widgets'))
      .filter(e => e.textContent.includes('Error displaying widget')).length,
  broken_images: Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0))
      .map(i => i.getAttribute('src').slice(0, 80)),
  untypeset: Array.from(document.querySelectorAll('.math')).filter(e => !e.querySelector('mjx-container')).length,
  math: document.querySelectorAll('.math').length,
  title: document.title,
}};
"""


@pytest.mark.parametrize("page", toc_pages())
def test_page_renders_offline(page, server, browser):
    browser.get(f"{server}/{page}")
    deadline = time.monotonic() + SETTLE_S
    while True:
        state = browser.execute_script(PAGE_STATE)
        settled = state["ready"] == "complete" and state["rendered"] == state["views"] and not state["untypeset"]
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    errors = [entry["message"] for entry in browser.get_log("browser")
              if entry["level"] == "SEVERE" and not any(s in entry["message"] for s in IGNORED)]
    assert "404" not in state["title"], f"{page}: not found in the built book"
    assert not errors, f"{page}: JavaScript errors / failed requests:\n" + "\n".join(errors)
    assert not state["untypeset"], f"{page}: {state['untypeset']} of {state['math']} formulas not typeset by MathJax"
    assert not state["broken_images"], f"{page}: images that did not load: {state['broken_images']}"
    source = (ROOT / page).with_suffix(".ipynb")
    if source.is_file() and "ipywidgets" in source.read_text():
        assert state["views"] > 0, f"{page}: the notebook builds widgets but the page has no saved widget view"
    assert state["rendered"] == state["views"] and not state["widget_errors"], (
        f"{page}: {state['views']} saved widget views, {state['rendered']} rendered, "
        f"{state['widget_errors']} with 'Error displaying widget'")
