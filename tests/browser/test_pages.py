"""Every report page in a real browser: headless Chromium (the system's, never a download)
through Playwright, with the network cut off, as a reader without internet would open them.

``make test-browser`` runs this file (the ``browser`` marker; ``make test`` leaves it out). The
pages are a smoke render made here (``nvfp4lab report --smoke`` into a temporary folder: about a
minute), or an existing report folder named by ``NVFP4LAB_BROWSER_PAGES`` (e.g. ``reports`` after
``make report``). Chromium is ``$CHROMIUM`` or ``chromium`` / ``chromium-browser`` on PATH.

Each page: every image loads (``naturalWidth > 0``) and has alt text (not nbconvert's "No
description has been provided" placeholder), no console error or uncaught exception, no request
leaves the file system, and the headline numbers are there (on the notebook's page as the
runner's ``headline: name = value`` line, on the index as ``name: value``). On a notebook's page,
in a 1280 px wide window: no stderr output box (a progress bar or warning in pink), no content
wider than its box unless that box scrolls (the first ancestor that does not let it spill must be
a scroll box: a table cut at the page's edge fails), the page itself no wider than the window,
and no table cut by pandas (``display.max_colwidth``: text ending in "..."; ``display.max_rows``
/ ``max_columns``: a row or column of "..."). The live
explorers, whose widgets the static pages do not hold, are checked in a real JupyterLab by
``test_lab.py``. Chromium comes from ``conftest.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from nvfp4lab.report import runner

pytestmark = pytest.mark.browser

PAGES_ENV = "NVFP4LAB_BROWSER_PAGES"
NOTEBOOKS = [p.stem for p in runner.discover_notebooks()]


@pytest.fixture(scope="module")
def pages_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get(PAGES_ENV)
    if given:
        folder = Path(given)
        assert (folder / "index.html").is_file(), f"{PAGES_ENV}={given}: no index.html there"
        return folder
    folder = tmp_path_factory.mktemp("pages")
    results = runner.run_reports(out_dir=folder, smoke=True)
    failed = {r.name: r.error for r in results if not r.ok}
    assert not failed, f"the smoke render failed: {failed}"
    return folder


#: nbconvert's alt text for an image that has none.
NO_ALT = "No description has been provided for this image"
# Layout problems on a notebook page: content wider than its box where the first ancestor that
# does not let it spill (overflow-x other than visible) is no scroll box or is outside the cell
# (then the page itself widens or the content is cut); text cells pandas cut; stderr boxes.
LAYOUT_JS = """() => {
  const scrolls = v => v === 'auto' || v === 'scroll';
  const name = e => `${e.tagName.toLowerCase()}.${String(e.className).trim().split(/\\s+/)
    .join('.')}`;
  const out = {wide: [], cut: [], stderr: []};
  const clipOf = e => {  // the first ancestor that does not let e spill, or null (the page)
    let box = e.parentElement;
    while (box && getComputedStyle(box).overflowX === 'visible') box = box.parentElement;
    return box;
  };
  for (const e of document.querySelectorAll('.jp-Cell *')) {
    if (!e.getClientRects().length || getComputedStyle(e).display === 'inline') continue;
    const own = getComputedStyle(e).overflowX;
    // its content spills out of it, and the first box holding the spill does not scroll
    if (e.scrollWidth > e.clientWidth + 1 && e.clientWidth > 0) {
      const box = own === 'visible' ? clipOf(e) : e;
      if (!box || !scrolls(getComputedStyle(box).overflowX) || !box.closest('.jp-Cell'))
        out.wide.push(`${name(e)} (content ${e.scrollWidth} > ${e.clientWidth} px, in ${box ?
          name(box) : 'the page'}): ${e.textContent.trim().slice(0, 60)}`);
    }
    // or it sticks out of a box that cuts it off (overflow hidden / clip)
    const clip = clipOf(e), r = e.getBoundingClientRect();
    if (clip && !scrolls(getComputedStyle(clip).overflowX)) {
      const c = clip.getBoundingClientRect();
      if (r.right > c.right + 1 || r.left < c.left - 1)
        out.wide.push(`${name(e)} (${Math.round(r.width)} px, cut by ${name(clip)} of ${
          Math.round(c.width)} px): ${e.textContent.trim().slice(0, 60)}`);
    }
  }
  for (const e of document.querySelectorAll('td, th')) {
    const t = e.textContent.trim();
    if (t.length > 3 && t.endsWith('...')) out.cut.push(t.slice(-60));
    // a row or column of '...': pandas cut the table (display.max_rows / max_columns)
    const shape = /\\d+ rows × \\d+ columns/;
    if (t === '...' || t === '…') out.cut.push('rows or columns cut by pandas: ' +
      (e.closest('table')?.parentElement?.textContent.match(shape) ?? [''])[0]);
  }
  for (const e of document.querySelectorAll(
      '[data-mime-type="application/vnd.jupyter.stderr"]')) out.stderr.push(
        e.textContent.trim().slice(0, 200));
  out.page = [document.documentElement.scrollWidth, window.innerWidth];
  return out;
}"""


def _open(browser: Any, path: Path) -> tuple[Any, Any, list[str], list[str]]:
    """The page at ``path`` loaded offline in a 1280 × 900 window, its context, console errors
    and network requests."""
    context = browser.new_context(offline=True, viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    network: list[str] = []

    def route(r: Any) -> None:
        url = r.request.url
        if url.startswith(("file:", "data:", "blob:", "about:")):
            r.continue_()
        else:
            network.append(url)
            r.abort()

    context.route("**/*", route)
    page = context.new_page()
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    page.goto(path.resolve().as_uri(), wait_until="load")
    page.wait_for_load_state("networkidle")
    return page, context, errors, network


def _check_common(page: Any, errors: list[str], network: list[str]) -> None:
    images = page.eval_on_selector_all(
        "img", "els => els.map(e => [e.currentSrc.slice(0, 60), e.complete, e.naturalWidth])")
    broken = [src for src, complete, width in images if not (complete and width > 0)]
    assert broken == [], f"images that did not load: {broken}"
    alts = page.eval_on_selector_all("img", "els => els.map(e => e.getAttribute('alt') || '')")
    no_alt = [i for i, alt in enumerate(alts) if not alt.strip() or alt == NO_ALT]
    assert no_alt == [], f"images {no_alt} of {len(alts)} have no alt text"
    assert errors == [], f"console errors: {errors}"
    assert network == [], f"requests off the file system: {network}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_page(browser: Any, pages_dir: Path, name: str) -> None:
    html_path, ipynb_path = pages_dir / f"{name}.html", pages_dir / f"{name}.ipynb"
    assert html_path.is_file(), f"{name}: no page in {pages_dir}"
    headlines = runner.extract_headlines(runner._read_notebook(ipynb_path))
    assert headlines, f"{name}: publishes no headline number"
    page, context, errors, network = _open(browser, html_path)
    try:
        _check_common(page, errors, network)
        assert page.eval_on_selector_all("img", "els => els.length") > 0, f"{name}: no figure"
        text = page.inner_text("body")
        missing = [h.name for h in headlines.values()
                   if f"headline: {h.name} = {h.text()}" not in text]
        assert missing == [], f"{name}: headline numbers not on the page: {missing}"
        layout = page.evaluate(LAYOUT_JS)
        assert layout["stderr"] == [], f"{name}: stderr output boxes: {layout['stderr']}"
        assert layout["wide"] == [], f"{name}: content wider than its box: {layout['wide']}"
        assert layout["cut"] == [], f"{name}: table cells cut by pandas: {layout['cut']}"
        width, window = layout["page"]
        assert width <= window, f"{name}: the page is {width} px wide in a {window} px window"
    finally:
        context.close()


def test_index_page(browser: Any, pages_dir: Path) -> None:
    page, context, errors, network = _open(browser, pages_dir / "index.html")
    try:
        _check_common(page, errors, network)
        text = page.inner_text("body")
        for name in NOTEBOOKS:
            row = page.locator("tr", has=page.locator(f'a[href="{name}.html"]'))
            assert row.count() == 1, f"index: no link to {name}.html"
            assert row.locator("td.ok").count() == 1, f"index: {name} is not ok"
            headlines = runner.extract_headlines(
                runner._read_notebook(pages_dir / f"{name}.ipynb"))
            missing = [h.name for h in headlines.values() if f"{h.name}: {h.text()}" not in text]
            assert missing == [], f"index: {name}'s headline numbers missing: {missing}"
    finally:
        context.close()
