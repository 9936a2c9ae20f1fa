"""The notebooks' live explorers in a real JupyterLab, driven through headless Chromium.

``make test-browser`` runs this file with ``test_pages.py`` (the ``browser`` marker). One
JupyterLab server (a subprocess on a free 127.0.0.1 port, a random token, its own config,
settings, workspace and runtime folders, news and update checks off) serves a temporary copy of
``notebooks/`` whose parameters cells say ``SMOKE = True``; the server and its kernels import this
checkout's nvfp4lab (``PYTHONPATH``) with ``NVFP4LAB_THREADS=1``.

For each notebook, on its own page: run the parameters and setup cells (the first two code cells)
and the explorer cell (the last code cell, ``if INTERACTIVE:``), as each notebook's "Explore"
section tells a reader to, each with Ctrl+Enter in the cell's editor; then check that no widget
label or slider readout is truncated (``scrollWidth <= clientWidth``) and that every dropdown
option fits its dropdown (measured in the dropdown's font), that no cell shows a traceback or an
exception, that the explorer's output area holds its text or table, that every output in it names
what it shows (a bold title, ``nvfp4lab-output-title``) and that no printed text in it may break
inside a word or number (computed ``word-break`` not ``break-all``), and that moving a control
(another option of the first dropdown, else a slider nudged one step with the keyboard) changes
that output, with everything still untruncated. Where the explorer has a configuration dropdown
(05, 07: a configuration is built on first pick, seconds to a minute), picking another one must
clear the old result and show the busy sign (``explorer.BUSY_TEXT``) until the new one is there.
No console error in the page; any request it
makes off 127.0.0.1 is aborted and fails the test. Kernels are shut down after each notebook;
the server's process group gets SIGTERM (then SIGKILL), and any kernel left from its runtime
folder SIGKILL. About 75-105 s for notebooks 01-06 on two cores, and 07's (SmolLM2, its
first render computes the layer rows and a configuration) about a minute or two more.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("0[1-7]_*.ipynb"))
HOST = "127.0.0.1"
SERVER_START_S = 90
CELL_S = 180  # one cell: 05's setup cell loads MiniLM
CHANGE_S = 120  # the explorer's output after a control moves (05, 07 compute on demand)
CONFIG_LABELS = ("configuration", "config")  # the dropdowns whose pick builds a model
# Each output in an explorer's Output area, and the titled ones; printed text that may break
# inside a word (JupyterLab's `pre` CSS says break-all; explorer.text_output overrides it).
OUTPUTS_JS = """e => ({
    outputs: e.querySelectorAll('.jp-OutputArea-output').length,
    titled: e.querySelectorAll('.jp-OutputArea-output .nvfp4lab-output-title').length,
    breakAll: [...e.querySelectorAll('pre')].filter(p => getComputedStyle(p).wordBreak ===
        'break-all').map(p => p.textContent.slice(0, 80))})"""
# What a label or readout must not do: hide part of its text.
TRUNCATED_JS = """els => els.map(e => ({
    cls: e.className, text: e.textContent, scroll: e.scrollWidth, client: e.clientWidth,
    shown: e.getClientRects().length > 0}))"""
# A dropdown's options: each must fit the <select>'s content box (its width less the padding
# that holds the arrow), measured in the select's own font.
OPTIONS_JS = """els => els.flatMap(e => {
    const st = getComputedStyle(e), ctx = document.createElement("canvas").getContext("2d");
    ctx.font = `${st.fontStyle} ${st.fontWeight} ${st.fontSize} ${st.fontFamily}`;
    const room = e.clientWidth - parseFloat(st.paddingLeft) - parseFloat(st.paddingRight);
    return [...e.options].map(o => ({
        text: o.text, need: Math.ceil(ctx.measureText(o.text).width), room}));
})"""
EXCEPTION = re.compile(r"Traceback|\b\w*(Error|Exception)\b")


@dataclass(frozen=True)
class Lab:
    url: str
    token: str
    root: Path

    def api(self, method: str, path: str) -> Any:
        req = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """Stop every session and kernel of the server (a page closing stops none)."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}")


def _smoke_copy(src: Path, dst: Path) -> None:
    """``src``'s notebooks into ``dst`` with ``SMOKE = True`` in each parameters cell."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for name in NOTEBOOKS:
        nb = json.loads((dst / name).read_text(encoding="utf-8"))
        cell = next(c for c in nb["cells"]
                    if "parameters" in c.get("metadata", {}).get("tags", []))
        source = "".join(cell["source"])
        source, n = re.subn(r"^SMOKE = False\b", "SMOKE = True", source, flags=re.M)
        assert n == 1, f"{name}: no `SMOKE = False` line in the parameters cell"
        cell["source"] = source
        (dst / name).write_text(json.dumps(nb, indent=1, ensure_ascii=False), encoding="utf-8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _processes_mentioning(marker: str) -> list[int]:
    """Pids whose command line names ``marker`` (the kernels, via their connection file)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


def _stop(proc: subprocess.Popen[bytes], runtime_dir: Path) -> None:
    """The server's process group, then any kernel still running from ``runtime_dir``
    (kernels run in sessions of their own)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)  # the server stops its kernels on SIGTERM
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if Path("/proc").is_dir():
        for pid in _processes_mentioning(str(runtime_dir)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    base = tmp_path_factory.mktemp("lab")
    root = base / "notebooks"
    _smoke_copy(ROOT / "notebooks", root)
    dirs = {name: base / name for name in ("config", "data", "runtime", "settings", "workspaces",
                                           "ipython")}
    for d in dirs.values():
        d.mkdir()
    # Belt and braces with --LabApp.news_url=None: the frontend never asks for news or updates.
    notification = dirs["settings"] / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}), encoding="utf-8")
    env = {
        **os.environ,
        # the server and the kernels it starts import this checkout's nvfp4lab
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]),
        "NVFP4LAB_THREADS": "1",
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        "JUPYTER_DATA_DIR": str(dirs["data"]),  # no user kernelspec shadows the venv's python3
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
        "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
        "IPYTHONDIR": str(dirs["ipython"]),
    }
    found = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('nvfp4lab').origin)"],
        env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found).is_relative_to(ROOT), f"kernels would import nvfp4lab from {found}"
    port, token = _free_port(), secrets.token_hex(16)
    log_path = base / "server.log"
    cmd = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}",
        "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
        f"--ServerApp.ip={HOST}", f"--ServerApp.root_dir={root}",
        # nothing from the internet: no news feed, no update check, no PyPI extension listing
        "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        # CI runs as root, where jupyter server refuses to start without this
        *(["--allow-root"] if os.geteuid() == 0 else []),
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        server = Lab(f"http://{HOST}:{port}", token, root)
        deadline = time.monotonic() + SERVER_START_S
        while True:
            assert proc.poll() is None, f"jupyter lab exited:\n{log_path.read_text()[-3000:]}"
            try:
                server.api("GET", "/api/status")
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, (
                    f"jupyter lab not up in {SERVER_START_S} s:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.25)
        yield server
        server.shutdown_kernels()
    finally:
        _stop(proc, dirs["runtime"])


def _run_cell(page: Any, cell: Any) -> None:
    """Ctrl+Enter in ``cell``'s editor (run in place), then wait for its execution count."""
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Control+Enter")
    prompt = cell.locator(".jp-InputArea-prompt")
    deadline = time.monotonic() + CELL_S
    while not re.fullmatch(r"\[\d+\]:", prompt.inner_text().strip()):
        assert time.monotonic() < deadline, f"cell still running after {CELL_S} s"
        page.wait_for_timeout(200)


def _wait_for(page: Any, check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} (waited {timeout_s} s)"
        page.wait_for_timeout(200)
    return value


def _truncated(scope: Any) -> tuple[list[str], int]:
    """The truncated labels, readouts and dropdown options in ``scope``, and how many labels
    and readouts are shown with text."""
    # descriptions (.widget-label, in each control's .widget-inline-hbox) and slider readouts
    items = scope.locator(".widget-label, .widget-readout").evaluate_all(TRUNCATED_JS)
    shown = [i for i in items if i["shown"] and i["text"].strip()]
    cut = [f"{i['text']!r} ({i['cls']}: scrollWidth {i['scroll']} > clientWidth {i['client']})"
           for i in shown if i["scroll"] > i["client"]]
    options = scope.locator(".widget-dropdown select").evaluate_all(OPTIONS_JS)
    cut += [f"option {o['text']!r} ({o['need']} px in a {o['room']} px dropdown)"
            for o in options if o["need"] > o["room"]]
    return cut, len(shown)


def _errors(page: Any) -> list[str]:
    stderr = page.locator(
        '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'
    ).all_inner_texts()
    texts = page.locator(".jp-RenderedText").all_inner_texts()
    return [t[-600:] for t in [*stderr, *texts] if EXCEPTION.search(t)]


def _move_a_control(explorer: Any) -> str:
    """Another option of the first dropdown, else the first slider one step right."""
    dropdowns = explorer.locator(".widget-dropdown select")
    if dropdowns.count():
        select = dropdowns.first
        current = select.evaluate("e => e.selectedIndex")
        index = 1 if current != 1 else 0
        select.select_option(index=index)
        return f"dropdown option {index}"
    handle = explorer.locator(".widget-slider .noUi-handle").first
    handle.focus()
    handle.press("ArrowRight")
    return "slider one step right"


def _check_outputs(out: Any, name: str) -> None:
    """Every output in the explorer's Output area is titled; no printed text breaks anywhere."""
    found = out.evaluate(OUTPUTS_JS)
    assert found["outputs"] >= 1 and found["titled"] == found["outputs"], (
        f"{name}: {found['titled']} of {found['outputs']} explorer outputs name what they show")
    assert found["breakAll"] == [], f"{name}: text that may break mid-number: {found['breakAll']}"


def _check_busy_sign(page: Any, explorer: Any, out: Any, name: str) -> None:
    """Pick another configuration (built on first pick): the old result is cleared and the busy
    sign shown until the new result is there."""
    from nvfp4lab.studies.explorer import BUSY_TEXT

    described = explorer.locator(".widget-dropdown").filter(
        has=page.locator(".widget-label", has_text=re.compile(rf"^({'|'.join(CONFIG_LABELS)})$")))
    if not described.count():
        return
    select = described.first.locator("select")
    before = out.inner_text().strip()
    index = select.evaluate("e => e.options.length - 1")  # the last: not computed by the cells
    select.select_option(index=index)
    # A render over 0.5 s clears the old result and shows the busy sign; a quicker one (04's
    # formats) may show the new result at once. Either is right; the old result left on screen
    # with no busy sign is not (the wait fails after 30 s).
    _wait_for(page, lambda: BUSY_TEXT in out.inner_text()
              or (out.inner_text().strip() and out.inner_text().strip() != before), 30,
              f"{name}: no busy sign and no new result after picking configuration {index}")
    if BUSY_TEXT in out.inner_text():
        assert before not in out.inner_text(), f"{name}: the old result stays on screen while busy"
    _wait_for(page, lambda: BUSY_TEXT not in out.inner_text() and out.inner_text().strip(),
              CHANGE_S, f"{name}: configuration {index} never shown")
    assert _errors(page) == [], f"{name}: after picking configuration {index}: {_errors(page)}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_explorer(browser: Any, lab: Lab, name: str) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    off_host: list[str] = []
    page_errors: list[str] = []  # uncaught exceptions and console errors

    def route(r: Any) -> None:
        url = r.request.url
        if url.startswith(("data:", "blob:", "about:")) or urlsplit(url).hostname == HOST:
            r.continue_()
        else:
            off_host.append(url)
            r.abort()

    context.route("**/*", route)
    page = context.new_page()
    page.on("websocket", lambda ws: None if urlsplit(ws.url).hostname == HOST
            else off_host.append(ws.url))
    page.on("pageerror", lambda exc: page_errors.append(f"uncaught: {exc}"))
    page.on("console", lambda m: page_errors.append(m.text) if m.type == "error" else None)
    try:
        workspace = re.sub(r"\W", "-", Path(name).stem)  # a fresh workspace: no tabs restored
        page.goto(f"{lab.url}/lab/workspaces/{workspace}/tree/{name}?token={lab.token}",
                  timeout=CELL_S * 1000)
        panel = page.locator(".jp-NotebookPanel:visible")
        # The kernel item of the status bar: "No Kernel | Initializing", then "Python 3
        # (ipykernel) | Starting, Connecting... | Idle" once the kernel answers (the toolbar's
        # execution indicator says "idle" before a kernel exists: cells run then are lost).
        kernel = page.locator(f'.jp-StatusBar-TextItem[title="Change kernel for {name}"]')
        _wait_for(page, lambda: re.fullmatch(r"Python 3.* \| Idle", kernel.inner_text().strip()),
                  CELL_S, f"{name}: no idle Python kernel")
        nb = json.loads((lab.root / name).read_text(encoding="utf-8"))
        code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
        n = len(code)
        assert code[-1].startswith("if INTERACTIVE:"), f"{name}: last code cell is {code[-1]!r}"
        cells = panel.locator(".jp-Notebook .jp-CodeCell")
        _wait_for(page, lambda: cells.count() == n, CELL_S, f"{name}: not all {n} code cells shown")
        explorer_cell = cells.nth(n - 1)
        for i in (0, 1, n - 1):
            _run_cell(page, cells.nth(i))
            assert _errors(page) == [], f"{name}: code cell {i} failed: {_errors(page)}"

        explorer = explorer_cell.locator(".jp-OutputArea .widget-vbox").first
        explorer.wait_for(timeout=CELL_S * 1000)
        out = explorer.locator(".widget-output")
        text = _wait_for(page, lambda: out.inner_text().strip(), CELL_S,
                         f"{name}: the explorer shows no output")
        # the explorer writes stderr only for an exception of its render function
        assert out.locator('[data-mime-type="application/vnd.jupyter.stderr"]').count() == 0, (
            f"{name}: the explorer failed: {text}")
        cut, shown = _truncated(explorer)
        assert shown >= 2, f"{name}: {shown} widget labels shown"
        assert cut == [], f"{name}: truncated: {cut}"
        _check_outputs(out, name)

        moved = _move_a_control(explorer)
        _wait_for(page, lambda: out.inner_text().strip() not in ("", text), CHANGE_S,
                  f"{name}: the explorer's output did not change after the {moved}")
        cut, _ = _truncated(explorer)
        assert cut == [], f"{name}: truncated after the {moved}: {cut}"
        assert _errors(page) == [], f"{name}: after the {moved}: {_errors(page)}"
        _check_busy_sign(page, explorer, out, name)
        _check_outputs(out, name)
        assert page_errors == [], f"{name}: errors in the page: {page_errors}"
        assert off_host == [], f"{name}: requests off {HOST}: {off_host}"
    finally:
        context.close()
        with contextlib.suppress(OSError):  # the module's teardown stops whatever is left
            lab.shutdown_kernels()
