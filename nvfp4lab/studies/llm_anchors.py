"""Published NVFP4 results beside notebook 07's measurements, compared in direction only.

``llm_anchors.csv`` holds each anchor (model, metric, baseline and quantized values, whether
higher is better, its source); :func:`anchor_rows` puts the comparable measurement of the study's
rows (:func:`nvfp4lab.studies.llm_configs.config_rows`) beside it.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["ANCHORS_PATH", "anchor_rows", "published_anchors", "row_by_label"]

#: The published results the study compares with, in direction (verified from their sources).
ANCHORS_PATH: Path = Path(__file__).with_name("llm_anchors.csv")


def published_anchors(path: str | Path = ANCHORS_PATH) -> list[dict[str, Any]]:
    """The published anchors (``llm_anchors.csv``), numbers as floats."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["baseline"], row["quantized"] = float(row["baseline"]), float(row["quantized"])
    return rows


def row_by_label(rows: Sequence[dict[str, Any]], label: str) -> dict[str, Any] | None:
    """The first of ``rows`` whose ``"label"`` is ``label``, or None."""
    return next((r for r in rows if r["label"] == label), None)


def anchor_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each published anchor beside the comparable measurement here, compared in direction
    only (a 135M model on pydoc text is not Llama-3.1-8B on wikitext): ``agrees`` says whether
    the effect goes the same way. Anchors whose configurations were not run are left out."""
    out = []
    for anchor in published_anchors():
        better = anchor["higher_is_better"] == "yes"
        published = "improves" if (anchor["quantized"] > anchor["baseline"]) == better else \
            "worsens"
        name = anchor["anchor"]
        if name == "w4a4_perplexity":
            mine = row_by_label(rows, "W4A4 RTN, dynamic")
            pair = (None if mine is None else (1.0, mine["perplexity_ratio"]),
                    "perplexity / reference's")
        elif name == "gptq_recovery":
            a, b = row_by_label(rows, "W4A16 RTN"), row_by_label(rows, "W4A16 GPTQ")
            pair = (None if a is None or b is None else (a["kld_mean"], b["kld_mean"]),
                    "mean KLD, RTN → GPTQ")
        elif name == "kv_4over6":
            a, b = row_by_label(rows, "KV nvfp4"), row_by_label(rows, "KV nvfp4_4over6")
            pair = (None if a is None or b is None else (a["kld_mean"], b["kld_mean"]),
                    "mean KLD, nvfp4 → nvfp4_4over6 KV")
        else:
            continue
        values, what = pair
        if values is None:
            continue
        ours = "improves" if values[1] < values[0] else "worsens"  # lower is better here
        out.append({"anchor": f"{anchor['model']}: {anchor['metric']}",
                    "published": f"{anchor['baseline_label']} {anchor['baseline']:g} → "
                                 f"{anchor['quantized_label']} {anchor['quantized']:g}",
                    "published_effect": published, "here": f"{what}: {values[0]:.4g} → "
                    f"{values[1]:.4g}", "here_effect": ours, "agrees": ours == published,
                    "source": anchor["source"]})
    return out
