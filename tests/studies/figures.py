"""Helpers for checking figures in tests: where a legend sits against the data, drawn."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("matplotlib")


def legend_hits(fig: Any) -> list[str]:
    """What the legends of ``fig`` cover once drawn: bars (patch extents) and line or scatter
    points (display coordinates) of any axes that fall inside a legend's box."""
    import numpy as np

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    hits: list[str] = []
    legends = [leg for ax in fig.axes if (leg := ax.get_legend()) is not None]
    legends += list(fig.legends)
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            for patch in ax.patches:
                if patch.get_width() and patch.get_window_extent(renderer).overlaps(box):
                    hits.append(f"bar {patch.get_label() or patch}")
            for line in ax.lines:
                xy = line.get_transform().transform(np.asarray(line.get_xydata(), float))
                if any(box.contains(x, y) for x, y in xy if np.isfinite([x, y]).all()):
                    hits.append(f"line {line.get_label()}")
            for coll in ax.collections:
                offsets = coll.get_offsets()
                if len(offsets):
                    xy = coll.get_offset_transform().transform(np.asarray(offsets, float))
                    if any(box.contains(x, y) for x, y in xy if np.isfinite([x, y]).all()):
                        hits.append(f"points {coll.get_label()}")
    return hits
