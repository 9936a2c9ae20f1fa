"""The page of ``nvfp4lab study --out``: a saved study read back for the template notebook
``nvfp4lab/studies/llm_study.ipynb`` (package data) and its figure. The study itself is
:mod:`nvfp4lab.studies.llm_study`; this module runs no model."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvfp4lab.studies.llm_study import DEFAULTS, EVALUATION, RESULTS_CSV, RESULTS_JSON

__all__ = ["TEMPLATE", "SavedStudy", "load_saved", "plot_domain"]

#: The parameterised notebook that renders a saved study (``nvfp4lab study --out``).
TEMPLATE = Path(__file__).with_name("llm_study.ipynb")


@dataclass(frozen=True)
class SavedStudy:
    """A study as :meth:`StudyResult.save` wrote it: ``rows`` (``study.csv``, one row per text
    and configuration) and ``facts`` (``study.json``: ``plan``, ``reference_perplexity``,
    ``verdict`` markdown, ``families``, ``comparisons``, ``domain``, ``seconds``)."""

    rows: list[dict[str, Any]]
    facts: dict[str, Any]

    def evaluation_rows(self) -> list[dict[str, Any]]:
        """The rows of the evaluation part."""
        return [r for r in self.rows if r["text"] == EVALUATION]

    def header(self) -> str:
        """Markdown: what was studied, on what, how."""
        p = self.facts["plan"]
        ppl = self.facts["reference_perplexity"]
        second = p["domain_text"]
        how = "block by block from its safetensors" if p["streamed"] else "in memory"
        calibration = (f"{p['calibration_samples']} windows of {DEFAULTS['length']} tokens of "
                       "the calibration part" if p["calibration_samples"]
                       else "none (no configuration run needs it)")
        return (
            f"**Model** `{p['model']}` ({p['model_type']}, {p['parameters']:,} parameters, run "
            f"in {p['dtype']}, {how}). **Text** {p['text']}: {p['split_rule'].rstrip('.')}. "
            f"**Scored** {p['evaluation_windows']} evaluation windows and "
            f"{p['domain_windows']} windows of a second text ({second}), {p['context']} "
            f"tokens each; reference perplexity {ppl[EVALUATION]:.3f} on the evaluation part, "
            f"{ppl[second]:.3f} on the second text. **Calibration** {calibration}. "
            f"{len(p['configurations'])} configurations in {self.facts['seconds']:.0f} s."
        )


def load_saved(folder: str | os.PathLike[str]) -> SavedStudy:
    """The study saved in ``folder`` (``study.csv`` and ``study.json``)."""
    import pandas as pd

    folder = Path(folder)
    rows = pd.read_csv(folder / RESULTS_CSV).to_dict("records")
    facts = json.loads((folder / RESULTS_JSON).read_text())
    return SavedStudy(rows, facts)


def plot_domain(domain: Sequence[dict[str, Any]], second: str) -> Any:
    """Mean KLD per configuration on the evaluation part and on the second text, with 95 %
    intervals: how far the calibration carries to text of another genre."""
    from nvfp4lab.plots import new_figure

    fig, ax = new_figure("Mean KL divergence on the evaluation part and on a second text",
                         "mean KL(reference ‖ quantized), nats per token (log scale)",
                         "configuration", figsize=(9.0, 0.55 * len(domain) + 1.8), xscale="log")
    for offset, key, name in ((-0.18, "kld_evaluation", "evaluation part"),
                              (0.18, "kld_second", second)):
        means = [max(r[key], 1e-9) for r in domain]
        lo = [m - max(r[f"{key}_lo"], 1e-9) for m, r in zip(means, domain, strict=True)]
        hi = [max(r[f"{key}_hi"], 1e-9) - m for m, r in zip(means, domain, strict=True)]
        ax.barh([i + offset for i in range(len(domain))], means, height=0.34,
                xerr=[lo, hi], capsize=2, label=name)
    ax.set_yticks(range(len(domain)), [r["label"] for r in domain], fontsize=8)
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=7, framealpha=0.9)
    return fig
