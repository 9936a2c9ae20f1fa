"""Peer libraries as oracles (``make test-peers``): vLLM 0.33.0, torchao 0.18, ModelOpt 0.47 and
llama-cpp-python 0.3.36 (its ggml libraries through ctypes), from the ``--target`` directories the
Makefile installs them into (on ``PYTHONPATH``), never copied.

Every test here is marked ``peers`` and excluded from ``make test`` (``-m "not peers"`` in
pyproject.toml); a peer that cannot be imported skips its tests with the reason.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/peers/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.peers)
