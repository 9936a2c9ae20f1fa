"""The mixed-precision search's recipe on SmolLM2, end to end (issue 36's target: a mix at <= 5.0
effective bits per weight whose mean KLD is at most half the best uniform NVFP4 recipe's):
sensitivity, search, the chosen mix built, scored, saved as a compressed-tensors checkpoint,
validated by compressed-tensors, reloaded by nvfp4lab and scored again from the reload.

    python benchmarks/mixed_recipe.py [--bits 5.0] [--formats nvfp4-mr-gptq,fp8-w8a16,bf16]
        [--sensitivity FILE.csv] [--dtype bfloat16] [--out DIR] [--keep] [--no-uniform]

``--sensitivity``: a table saved before (``SensitivityTable.save_csv``, the study's
sensitivity.csv) holding every layer in the measured formats, else it is measured here on the
study's 256 calibration tokens (minutes). The uniform W4A16 GPTQ and MR-GPTQ rows are built and
scored in the same run (unless ``--no-uniform``), so "half the best uniform" uses this run's
numbers. Also tried: saving the same mix as ModelOpt and GGUF (each prints what it refuses,
in one line, or that it saved). With ``--dtype bfloat16`` (transformers runs compressed-tensors
checkpoints in bfloat16 only) transformers also loads the checkpoint through compressed-tensors
and its logits on the first evaluation window are compared with nvfp4lab's. Reported: the mix,
bits, build seconds, checkpoint size, the
checks (torch.equal on every tensor and on the logits), mean KLD with 95 % intervals on the
evaluation text and the second text. Not a test: minutes.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from saved_checks import same_tensors, save_checked

from nvfp4lab import checkpoint
from nvfp4lab.studies import llm, llm_configs, llm_search, llm_study
from nvfp4lab.studies.llm_sensitivity import SensitivityTable, sensitivity
from nvfp4lab.vocab import LayerFormat

DEFAULT_FORMATS = "nvfp4-mr-gptq,fp8-w8a16,bf16"
UNIFORM = ("W4A16 GPTQ", "W4A16 MR-GPTQ")


def _line(name: str, part: llm.TokenFidelity) -> str:
    lo, hi = part.kld_ci95
    return (f"{name}: mean KLD {part.kld_mean:.4f} [{lo:.4f}, {hi:.4f}], perplexity ratio "
            f"{part.perplexity_ratio:.4f}, top-1 {part.top1_agreement:.4f}, {part.windows} windows")


def _table(reference: torch.nn.Module, batches: list, formats: list[str],
           file: Path | None) -> SensitivityTable:
    if file is not None:
        return SensitivityTable.read_csv(file)
    ids = torch.cat([b["input_ids"].reshape(-1) for b in batches])[:llm_search.SENSITIVITY_TOKENS]
    context = min(int(batches[0]["input_ids"].shape[-1]), ids.numel())
    run = llm.reference_run(reference, ids, context=context, progress=False)
    measured = [f for f in formats if f != LayerFormat.BF16]
    return sensitivity(reference, run, formats=measured, calibration=batches, progress=True)


def _transformers_line(path: Path, ours: torch.nn.Module, ids: torch.Tensor) -> str:
    """transformers (through compressed-tensors) against nvfp4lab on ``ids``, as loaded and with
    the checkpoint's input rotations applied (``checkpoint.transformers_input_rotations``): mean
    KL of the next-token distributions, top-1 agreement."""
    from transformers import AutoModelForCausalLM

    said = []
    for rotate in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
            layers = checkpoint.transformers_input_rotations(theirs, path) if rotate else 0
            with torch.no_grad():
                a = theirs.eval()(ids).logits.float().log_softmax(-1)
                b = ours(ids).logits.float().log_softmax(-1)
        kl = float((b.exp() * (b - a)).sum(-1).mean())
        top1 = float((a.argmax(-1) == b.argmax(-1)).float().mean())
        how = f"with {layers} input rotations applied" if rotate else "as loaded"
        said.append(f"{how}: KL(nvfp4lab || transformers) {kl:.2e} nats/token, top-1 "
                    f"agreement {top1:.4f}")
    return f"transformers + compressed-tensors on {ids.numel()} tokens, " + "; ".join(said)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", type=float, default=5.0)
    parser.add_argument("--formats", default=DEFAULT_FORMATS)
    parser.add_argument("--sensitivity", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--no-uniform", dest="uniform", action="store_false")
    parser.add_argument("--dtype", default=None, help="the model's dtype (default float32)")
    args = parser.parse_args()
    formats = [f.strip() for f in args.formats.split(",")]
    plan = llm_study.plan_study(configs=list(UNIFORM), dtype=args.dtype)
    run, reference = llm_study._reference(plan, progress=True)
    table = _table(reference, list(plan.batches), formats, args.sensitivity)
    mix = llm_search.best_mix(table, reference, args.bits, formats=formats)
    print(f"search under {args.bits} bits over {', '.join(formats)}: {mix.describe()}")
    best_uniform = None
    if args.uniform:
        for config in plan.configs:
            built, seconds = llm_configs.build(reference, config, plan.batches)
            evaluation, _ = llm_study._split(llm.token_fidelity(run, built, progress=False),
                                             plan.eval_windows)
            del built
            print(_line(f"uniform {config.label} (built in {seconds:.0f} s), evaluation text",
                        evaluation))
            if best_uniform is None or evaluation.kld_mean < best_uniform:
                best_uniform = evaluation.kld_mean
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, seconds = llm_search.build_mix(reference, mix, plan.batches)
    root = args.out or Path(tempfile.mkdtemp(prefix="nvfp4lab-mixed-"))
    try:
        path, size, valid = save_checked(model, root / "smollm2-mixed")
        for fmt in ("modelopt", "gguf"):
            try:
                checkpoint.save_pretrained(model, root / f"smollm2-mixed-{fmt}", format=fmt)
                print(f"  {fmt}: saved")
            except ValueError as err:
                print(f"  {fmt}: refused: {err}")
        loaded = checkpoint.load(path).eval()
        ids = run.input_ids(0)
        with torch.no_grad():
            same_logits = torch.equal(model(ids).logits, loaded(ids).logits)
        same = same_tensors(model, loaded)
        del model
        evaluation, domain = llm_study._split(llm.token_fidelity(run, loaded, progress=True),
                                              plan.eval_windows)
        print(f"mix built in {seconds:.0f} s; checkpoint {size / 1e6:.1f} MB (compressed-tensors), "
              f"config valid for compressed-tensors: {valid}; every tensor equal after reload: "
              f"{same}, logits equal: {same_logits}")
        if plan.dtype == torch.bfloat16:
            print("  " + _transformers_line(path, loaded, ids))
        print("  " + _line("reloaded, evaluation text", evaluation))
        print("  " + _line(f"reloaded, {plan.domain_name}", domain))
        bases = (("W4A16 GPTQ as filed", 0.099), ("best uniform, this run", best_uniform))
        for what, base in bases:
            if base is not None:
                verdict = "met" if evaluation.kld_mean <= base / 2 else "NOT met"
                print(f"  target half of {what} ({base:.4f}): <= {base / 2:.4f}: {verdict}")
    finally:
        if args.keep:
            print(f"checkpoints kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
