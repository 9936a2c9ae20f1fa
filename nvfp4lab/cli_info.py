"""``nvfp4lab info``: the text of :func:`nvfp4lab.dispatch.info_report`, printed."""

from __future__ import annotations

import argparse

from nvfp4lab.dispatch import info_report, select_backend

__all__ = ["run_info"]


def run_info(args: argparse.Namespace) -> int:
    """Print the report; exit code 2 when an environment variable has a bad value, else 0."""
    device = getattr(args, "device", None)
    print(info_report(device=device))
    try:
        select_backend(device)
    except ValueError:
        return 2
    return 0
