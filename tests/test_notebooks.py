"""Every real notebook of ``notebooks/`` runs in smoke mode through ``nvfp4lab.report`` (a
kernel each, as ``nvfp4lab report --smoke`` runs it). Its own file, so that pytest-xdist gives
these two minutes of kernels one worker while the other runs the rest (tests/conftest.py
schedules this file first)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvfp4lab import report

ROOT = Path(__file__).resolve().parent.parent
REAL_NOTEBOOKS = report.discover_notebooks(ROOT / "notebooks")


@pytest.mark.slow
@pytest.mark.parametrize("path", REAL_NOTEBOOKS, ids=[p.stem for p in REAL_NOTEBOOKS])
def test_every_notebook_runs_in_smoke_mode(path: Path, tmp_path: Path) -> None:
    (result,) = report.run_reports([path], out_dir=tmp_path, smoke=True)
    assert result.ok, result.error
    assert result.html_path is not None and (tmp_path / "index.html").is_file()
    if path.stem == "01_format_tour":
        sqnr = result.headlines["SQNR, N(0,1) matrix"]
        assert sqnr.unit == "dB" and 19.0 < sqnr.value < 22.0  # published anchor ≈ 20.4 dB
        assert result.html_path.read_text().count("data:image/png;base64,") >= 4
