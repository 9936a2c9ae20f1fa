"""The report index page: one row per notebook with its status, duration, headline numbers,
parameters and error (``<out>/index.html``, written by :func:`write_index`)."""

from __future__ import annotations

import html
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["write_index"]

_INDEX_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
table { border-collapse: collapse; } th, td { padding: .35rem .8rem; border-bottom: 1px solid #ddd;
  text-align: left; vertical-align: top; } th { background: #f4f4f4; }
.ok { color: #08660f; font-weight: bold; } .num { font-variant-numeric: tabular-nums; }
.failed, .interrupted, .not { color: #b00020; font-weight: bold; }
.err { font-family: monospace; font-size: .9em; }
"""


def write_index(results: Sequence[Any], path: str | Path) -> Path:
    """Write the index page for ``results`` (:class:`~nvfp4lab.report.runner.ReportResult`:
    status, duration, headline numbers, errors)."""
    esc = html.escape
    rows = []
    for r in results:
        link = (
            f'<a href="{esc(r.html_path.name)}">{esc(r.name)}</a>' if r.html_path else esc(r.name)
        )
        heads = "<br>".join(f"{esc(h.name)}: <b>{esc(h.text())}</b>" for h in r.headlines.values())
        params = ", ".join(f"{esc(k)}={esc(repr(v))}" for k, v in r.parameters.items())
        rows.append(
            f'<tr><td>{link}</td><td class="{esc(r.status)}">{esc(r.status)}</td>'
            f'<td class="num">{r.duration_s:.1f} s</td><td>{heads or "—"}</td>'
            f"<td>{params or '—'}</td>"
            f'<td class="err">{esc(r.error) if r.error else ""}</td></tr>'
        )
    failed = [r.name for r in results if not r.ok]
    summary = (
        f"{len(results) - len(failed)} of {len(results)} notebooks ran"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>nvfp4lab reports</title>
<style>{_INDEX_CSS}</style></head>
<body><h1>nvfp4lab reports</h1>
<p>{esc(summary)}. Generated {stamp} with Python {esc(sys.version.split()[0])}.</p>
<table><thead><tr><th>notebook</th><th>status</th><th>duration</th><th>headline numbers</th>
<th>parameters</th><th>error</th></tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table></body></html>
"""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)  # a reader never sees half a page
    return out
