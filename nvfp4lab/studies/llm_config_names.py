"""The study's configurations by name: :func:`config_names` (the command-line names of the table's
configurations and of the recipes measured beside it) and :func:`select_configs` (what
``nvfp4lab study --configs`` and ``study(configs=...)`` accept)."""

from __future__ import annotations

from collections.abc import Sequence

from nvfp4lab.studies.llm_configs import LLMConfig, configurations, more_configurations


def config_names(configs: Sequence[LLMConfig] | None = None) -> dict[str, LLMConfig]:
    """Each configuration by its command-line name: the label in lower case, words joined by
    ``-`` (``"W4A16 MR-GPTQ"`` -> ``w4a16-mr-gptq``, ``"W4A4 + KV nvfp4"`` -> ``w4a4-kv-nvfp4``)."""
    out = {}
    for config in [*configurations(), *more_configurations()] if configs is None else configs:
        words = config.label.lower().replace(",", " ").replace("+", " ").replace("/", "").split()
        out["-".join(words)] = config
    return out


def select_configs(names: Sequence[str] | None, *, smoke: bool = False) -> list[LLMConfig]:
    """The configurations ``names`` lists (command-line names of :func:`config_names` or
    labels, in the study's order; ``all``: the study's and :func:`~nvfp4lab.studies.
    llm_configs.more_configurations`), or the study's (``smoke``: its four without GPTQ); an
    unknown name is a ValueError listing the accepted ones."""
    if not names:
        return configurations(smoke=smoke)
    if [n.strip().lower() for n in names] == ["all"]:
        return list(config_names().values())
    by_name = config_names()
    by_label = {c.label.lower(): c for c in by_name.values()}
    chosen: list[LLMConfig] = []
    for name in names:
        config = by_name.get(name.strip().lower()) or by_label.get(name.strip().lower())
        if config is None:
            raise ValueError(f"unknown configuration {name!r}; accepted: {', '.join(by_name)}")
        if config not in chosen:
            chosen.append(config)
    order = list(by_name.values())
    return sorted(chosen, key=order.index)
