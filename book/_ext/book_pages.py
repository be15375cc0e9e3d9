"""Sphinx extension: the rendered pages work offline and load without JavaScript errors.

1. **Scripts from the book, not from public CDNs.** By default the pages load MathJax 3 (Sphinx's
   ``mathjax_path``) and, on pages with widgets, RequireJS 2.3.4 and
   ``@jupyter-widgets/html-manager@1.0.6/dist/embed-amd.js`` (myst-nb's ``nb_ipywidgets_js``) from
   public CDNs, so a reader offline, behind a firewall or on a mirror sees raw LaTeX and no
   widgets. This extension fetches the same packages once per build folder with npm
   (``npm pack``), checks each tarball against the sha512 integrity pinned in :data:`PACKAGES`,
   copies what the pages need into the HTML output's ``_static/`` (``mathjax/``, ``widgets/``) and
   points both settings there. The html-manager bundle includes the standard controls (sliders,
   dropdowns, output areas), so no module is fetched when a page is viewed; its icon fonts are
   copied too, and ``widgets/require-config.js`` (loaded between the two scripts) tells RequireJS
   to resolve the bundle's assets from that folder rather than the page's. Licences: MathJax
   Apache-2.0 and html-manager BSD-3-Clause (their ``LICENSE`` files are copied), RequireJS MIT
   (its ``package.json`` is copied; the notice is also in ``require.js``'s header).

   The fetched files are cached in ``_build/.static-npm/`` (ignored by git). A tarball that does
   not match its integrity stops the build with an error naming the problem. On a machine without
   npm (the README's commands need only Python) the build goes on with the CDN scripts and says so;
   ``NVFP4LAB_OFFLINE_PAGES=1`` (set by ``.ci/run``) makes a missing npm an error instead.

2. **No doubled inline scripts.** sphinx-thebe 0.3.1 adds its inline configuration script
   (``const THEBE_JS_URL = ...``) on every ``env-before-read-docs`` event, and Jupyter Book's build
   emits that event more than once, so every page declared the constant twice and the browser
   raised ``SyntaxError: Identifier 'THEBE_JS_URL' has already been declared`` (other extensions'
   inline scripts were doubled too). Identical scripts are removed from each page's script list.

``tests/test_rendered_book.py`` checks the result in headless Chromium with no network.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util import logging

logger = logging.getLogger(__name__)

_FONTS = ("23f19bb08961f37aaf69.eot", "77206a6bb316fa0aded5.eot", "9bbb245e67a133f6e486.eot",
          "2f517e09eb2ca6650ff5.svg", "4689f52cc96215721344.svg", "7a8b4f130182d19a2d7c.svg",
          "491974d108fe4002b2aa.ttf", "527940b104eb2ea366c8.ttf", "be9ee23c0c6390141475.ttf",
          "2285773e6b4b172f07d9.woff", "bb58e57c48a3e911f15f.woff", "eeccf4f66002c6f2ba24.woff",
          "1551f4f60c37af51121f.woff2", "7a3337626410ca2f4071.woff2", "d878b0a6a1144760244f.woff2")

#: npm package -> (sha512 integrity of its tarball, {path in the tarball: path under _static/}).
#: A path ending in "/" copies that folder.
PACKAGES: dict[str, tuple[str, dict[str, str]]] = {
    "mathjax@3.2.2": (
        "sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw==",
        {"package/es5/": "mathjax/", "package/LICENSE": "mathjax/LICENSE"},
    ),
    "requirejs@2.3.4": (
        "sha512-qPD5gRrj6kGQ0ZySAJgqbArkaDqPMbQIT0zSZDkIv1mfA17w/tR2Faq5l2qqRf2CdQx6FWln9nUrgd2UDzb19A==",
        {"package/require.js": "widgets/require.js", "package/package.json": "widgets/requirejs.package.json"},
    ),
    "@jupyter-widgets/html-manager@1.0.6": (
        "sha512-+Mn+Ra8wyIHrYaUpfmf9A3dsLkt/NuwzPQN8sthdxBD35VV5cOJbpmgMhNR27n/rmP3mKyEe0PWCJrtZrXTXDQ==",
        {"package/dist/embed-amd.js": "widgets/embed-amd.js", "package/LICENSE": "widgets/html-manager.LICENSE",
         "package/dist/embed.js.LICENSE.txt": "widgets/embed-amd.js.LICENSE.txt",
         **{f"package/dist/{font}": f"widgets/{font}" for font in _FONTS}},
    ),
}
#: Loaded after require.js: the bundle's modules (``@jupyter-widgets/base``, ``controls``, its own
#: ``dist/libembed-amd``) resolve their assets (icon fonts) relative to their AMD module ids, which
#: RequireJS would otherwise place under the page's folder; and html-manager's MathJax 2 call is
#: given to MathJax 3 (without it, pages with both math and widgets raised ``TypeError: Cannot read
#: properties of undefined (reading 'Queue')``).
REQUIRE_CONFIG = """// nvfp4lab book: resolve the ipywidgets modules' assets (icon fonts) from this folder.
(function () {
  var here = document.currentScript.src.replace(/[?#].*$/, "").replace(/\\/[^\\/]*$/, "");
  require.config({paths: {"@jupyter-widgets": here, "@jupyter-widgets/html-manager/dist": here}});
})();
// html-manager 1.0.6 typesets output widgets with MathJax 2's API (MathJax.Hub.Queue); the book loads
// MathJax 3, which has no Hub. Once MathJax 3 is there, give it that one call, mapped to typesetPromise.
(function () {
  function shim() {
    var mj = window.MathJax;
    if (mj && mj.version && !mj.Hub) {
      mj.Hub = {Queue: function () { if (mj.typesetPromise) { mj.typesetPromise(); } }};
    }
  }
  shim();
  document.addEventListener("DOMContentLoaded", shim);
  window.addEventListener("load", shim);
})();
"""
#: What the pages load, relative to _static/ (the widget scripts in this order: embed-amd.js is an AMD module).
MATHJAX = "mathjax/tex-mml-chtml.js"
WIDGET_SCRIPTS = ("widgets/require.js", "widgets/require-config.js", "widgets/embed-amd.js")


def _integrity(path: Path) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


def _extract(tar: tarfile.TarFile, spec: str, files: dict[str, str], dest: Path) -> None:
    members = tar.getmembers()
    for src, dst in files.items():
        chosen = [m for m in members if m.isfile() and (m.name.startswith(src) if src.endswith("/") else m.name == src)]
        if not chosen:
            raise ExtensionError(f"book_pages: {src} missing from the npm package {spec}")
        for m in chosen:
            out = dest / (dst + m.name[len(src):] if src.endswith("/") else dst)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(m).read())


def fetch(cache: Path) -> Path | None:
    """Fetch and unpack :data:`PACKAGES` into ``cache`` once (a ``.complete`` marker).

    Returns:
        ``cache``, or ``None`` when npm is not installed and ``NVFP4LAB_OFFLINE_PAGES`` is not ``1``.

    Raises:
        ExtensionError: npm fails, a tarball's sha512 differs from the pinned one, a file is
            missing from a package, or npm is missing while ``NVFP4LAB_OFFLINE_PAGES=1``.
    """
    marker = cache / ".complete"
    if marker.is_file() and marker.read_text() == repr(sorted(PACKAGES)) + REQUIRE_CONFIG:
        return cache
    npm = shutil.which("npm")
    if npm is None:
        what = f"npm is needed to serve the pages' scripts ({', '.join(PACKAGES)}) from the book"
        if os.environ.get("NVFP4LAB_OFFLINE_PAGES") == "1":
            raise ExtensionError(f"book_pages: {what}; install Node.js and npm")
        logger.info(f"book_pages: {what}; without it the pages load them from public CDNs")
        return None
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        for spec, (integrity, files) in PACKAGES.items():
            r = subprocess.run([npm, "pack", spec, "--silent"], cwd=tmp, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise ExtensionError(f"book_pages: `npm pack {spec}` failed: {r.stderr.strip()[-500:]}")
            tarball = Path(tmp) / r.stdout.strip().splitlines()[-1]
            got = _integrity(tarball)
            if got != integrity:
                raise ExtensionError(f"book_pages: the {spec} tarball has integrity {got}, expected {integrity}")
            with tarfile.open(tarball) as tar:
                _extract(tar, spec, files, cache)
    (cache / "widgets" / "require-config.js").write_text(REQUIRE_CONFIG)
    marker.write_text(repr(sorted(PACKAGES)) + REQUIRE_CONFIG)
    return cache


def _config_inited(app: Sphinx, config) -> None:
    static = fetch(Path(app.outdir).parent / ".static-npm")
    if static is None:
        return
    config.html_static_path = list(config.html_static_path) + [str(static)]
    config.mathjax_path = MATHJAX
    config.nb_ipywidgets_js = {path: {} for path in WIDGET_SCRIPTS}


def _dedupe_scripts(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    kept: dict[tuple, object] = {}
    for js in scripts:  # an inline script's filename is None from one extension, "" from another
        key = (js.filename or "", js.priority, tuple(sorted(js.attributes.items())))
        kept.setdefault(key, js)
    scripts[:] = list(kept.values())


def setup(app: Sphinx) -> dict:
    # After the extensions that define mathjax_path and nb_ipywidgets_js (default priority 500).
    app.connect("config-inited", _config_inited, priority=900)
    # Early: html-page-context stops at the first handler that returns a template name.
    app.connect("html-page-context", _dedupe_scripts, priority=100)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
