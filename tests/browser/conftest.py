"""What the browser tests share: the system's headless Chromium through Playwright."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless Chromium: ``$CHROMIUM`` or ``chromium`` / ``chromium-browser`` on PATH (never a
    download; skipped without one, or without Playwright's Python driver)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="make test-browser installs it")
    exe = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which(
        "chromium-browser")
    if exe is None:
        pytest.skip("no Chromium on PATH (apt-get install chromium), nor $CHROMIUM")
    with sync_api.sync_playwright() as pw:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        chromium = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        yield chromium
        chromium.close()
