"""docs/llm.md's table of the study, generated from a report run's executed notebook 07 (so
the docs quote the page's own numbers, never numbers typed apart).

    python benchmarks/docs_study_table.py reports/07_llm_study.ipynb

Reads the configuration table the notebook displays (the DataFrame with ``kld_mean``) from the
executed notebook's HTML output and prints it as a markdown table: perplexity, ratio with its
interval, mean KLD with its interval, KLD p99, top-1 with its interval, windows, build seconds.
"""

from __future__ import annotations

import argparse
import html
import json
import re
from pathlib import Path

COLUMNS = ("kld_mean", "kld_lo", "kld_hi", "kld_p99", "perplexity_ratio", "perplexity_ratio_lo",
           "perplexity_ratio_hi", "top1_agreement", "top1_lo", "top1_hi", "perplexity",
           "windows", "build_seconds")


def _cells(row: str) -> list[str]:
    return [html.unescape(re.sub(r"<.*?>", "", c)).strip()
            for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)]


def study_table(notebook: Path) -> list[dict[str, str]]:
    """The rows of the configuration table in the executed ``notebook`` (label -> columns)."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            page = "".join(output.get("data", {}).get("text/html", ""))
            if "kld_mean" not in page or "build_seconds" not in page:
                continue
            rows = [_cells(r) for r in re.findall(r"<tr[^>]*>(.*?)</tr>", page, re.S)]
            header = next(r for r in rows if "kld_mean" in r)
            names = header[1:] if header[0] == "" else header
            out = []
            for r in rows:
                if len(r) == len(names) + 1 and r[0] and r[0] not in ("label",):
                    out.append({"label": r[0], **dict(zip(names, r[1:], strict=True))})
            return out
    raise SystemExit(f"{notebook}: no configuration table (kld_mean, build_seconds) in its outputs")


def markdown(rows: list[dict[str, str]]) -> str:
    lines = ["| configuration | perplexity | ratio [95 %] | mean KLD (nats) [95 %] | KLD p99 | "
             "top-1 [95 %] | windows | build (s) |", "|---|---:|---|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['perplexity']} | {r['perplexity_ratio']} "
            f"[{r['perplexity_ratio_lo']}, {r['perplexity_ratio_hi']}] | {r['kld_mean']} "
            f"[{r['kld_lo']}, {r['kld_hi']}] | {r['kld_p99']} | {r['top1_agreement']} "
            f"[{r['top1_lo']}, {r['top1_hi']}] | {r['windows']} | {r['build_seconds']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebook", type=Path)
    print(markdown(study_table(parser.parse_args().notebook)))


if __name__ == "__main__":
    main()
