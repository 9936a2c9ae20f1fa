"""The W4A4 recipe that engines load, on SmolLM2, end to end: built, saved as a compressed-tensors
checkpoint, validated by compressed-tensors, reloaded by nvfp4lab and scored from the reloaded
model (issue 35's target: mean KLD <= 0.20 nats on the evaluation text, from W4A4 RTN's 0.40).

    python benchmarks/w4a4_recipe.py [--out DIR] [--keep]

The recipe ("W4A4 GPTQ + SmoothQuant 0.5, calibrated"): SmoothQuant scales with strength 0.5
folded into the norms and the preceding rows (``W4A4Options(smooth_alpha=0.5)``), GPTQ of every
Linear against the Hessian of its inputs as the quantized model feeds them, and static input
global scales calibrated on the same 32 x 256 calibration tokens (vLLM 0.33's NVFP4 W4A4 reads a
static ``input_global_scale`` from the checkpoint; a dynamic one has no place there). Reported:
the build seconds; the checkpoint's size; whether compressed-tensors' ``QuantizationConfig``
accepts its config; whether every reloaded tensor and the logits of the first evaluation batch
equal the built model's (torch.equal); the reloaded model's mean KLD with its 95 % interval on
the evaluation text and on the second text (the study's windows, float32). Not a test: minutes.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from saved_checks import same_tensors, save_checked

from nvfp4lab import checkpoint
from nvfp4lab.execution import W4A4Options
from nvfp4lab.studies import llm, llm_configs, llm_study
from nvfp4lab.studies.llm_configs import CALIBRATED, LLMConfig
from nvfp4lab.vocab import Backend, QuantMethod

RECIPE = LLMConfig("W4A4 GPTQ + SmoothQuant 0.5, calibrated", Backend.EMULATION, QuantMethod.GPTQ,
                   input_scales=CALIBRATED, w4a4=W4A4Options(smooth_alpha=0.5))
TARGET = 0.20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    plan = llm_study.plan_study(configs=[RECIPE])
    run, reference = llm_study._reference(plan, progress=True)
    model, seconds = llm_configs.build(reference, RECIPE, plan.batches)
    root = args.out or Path(tempfile.mkdtemp(prefix="nvfp4lab-w4a4-"))
    try:
        path, size, valid = save_checked(model, root / "smollm2-w4a4-recipe")
        start = time.perf_counter()
        loaded = checkpoint.load(path, backend="emulation").eval()
        load_seconds = time.perf_counter() - start
        ids = run.input_ids(0)
        with torch.no_grad():
            same_logits = torch.equal(model(ids).logits, loaded(ids).logits)
        same = same_tensors(model, loaded)
        del model
        fidelity = llm.token_fidelity(run, loaded, progress=True)
        evaluation, domain = llm_study._split(fidelity, plan.eval_windows)
        print(f"{RECIPE.label}: built in {seconds:.0f} s; checkpoint {size / 1e6:.1f} MB "
              f"(compressed-tensors), config valid for compressed-tensors: {valid}; reloaded in "
              f"{load_seconds:.1f} s, every tensor equal: {same}, logits equal: {same_logits}")
        for name, part in (("evaluation text", evaluation), (plan.domain_name, domain)):
            lo, hi = part.kld_ci95
            print(f"  reloaded, {name}: mean KLD {part.kld_mean:.4f} [{lo:.4f}, {hi:.4f}], "
                  f"perplexity ratio {part.perplexity_ratio:.4f}, top-1 "
                  f"{part.top1_agreement:.4f}, {part.windows} windows")
        print(f"  target: mean KLD <= {TARGET} on the evaluation text: "
              f"{'met' if evaluation.kld_mean <= TARGET else 'NOT met'}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
