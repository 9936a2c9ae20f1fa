"""``nvfp4lab study``: the LLM study on a user's model and text, from the command line.

``nvfp4lab study [MODEL] [--text FILE] [--calibration FILE] [--configs NAME ...] [--tokens N]
[--context T] [--samples S] [--dtype D] [--streamed | --in-memory] [--out DIR] [--overwrite]
[--smoke] [--dask ADDRESS] [--search bits=B [--search-formats F,F,...]] [--trust-remote-code]``
runs :func:`nvfp4lab.studies.llm_study.study` with one progress line per configuration on stderr,
prints the verdict, and with ``--out`` writes ``DIR/study.csv``, ``DIR/study.json`` and
``DIR/study.html`` (the template notebook ``nvfp4lab/studies/llm_study.ipynb`` rendered by the
report runner: a self-contained page, no progress in it). Bad input is one line on stderr, exit
status 2; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["OUTPUTS", "add_study", "run_study_command"]

#: What ``--out`` receives.
OUTPUTS: tuple[str, ...] = ("study.csv", "study.json", "study.html")


def add_study(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``nvfp4lab study``."""
    from nvfp4lab.cli_support import path_text

    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="a model folder (config.json + safetensors, sharded or not; a "
                        "Hugging Face cache snapshot or models--org--name folder), org/name in "
                        "the local Hugging Face cache, or a .gguf file (default: SmolLM2, "
                        "shipped). Nothing is downloaded")
    parser.add_argument("--text", default=None, type=path_text, metavar="FILE",
                        help="your text: plain text, markdown or JSONL with a 'text' field, "
                        "split into calibration and evaluation parts (default: CPython's pydoc "
                        "topics)")
    parser.add_argument("--calibration", default=None, type=path_text, metavar="FILE",
                        help="a separate calibration text (then --text is the evaluation text)")
    parser.add_argument("--configs", nargs="+", default=None, metavar="NAME",
                        help="configurations to run (default: the study's table), by name, "
                        "e.g. w4a16-rtn w4a16-gptq w4a16-mr-gptq w4a4-rtn-dynamic kv-nvfp4 "
                        "kv-fp8, or recipes measured beside it (w4a4-rtn-awq, "
                        "w4a4-rtn-rotation-16, ...); 'all' runs every one (an unknown name "
                        "lists them all)")
    parser.add_argument("--tokens", type=int, default=None, metavar="N",
                        help="evaluation tokens per text (default 2048; --smoke 128)")
    parser.add_argument("--context", type=int, default=None, metavar="T",
                        help="tokens per evaluation window (default 256; --smoke 64)")
    parser.add_argument("--samples", type=int, default=None, metavar="S",
                        help="calibration windows of 256 tokens (default 32; --smoke 4)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="the dtype every model runs in (default float32)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--streamed", dest="streamed", action="store_const", const=True,
                       default=None, help="evaluate block by block from the safetensors "
                       "(default: when the model takes over a quarter of this machine's memory)")
    where.add_argument("--in-memory", dest="streamed", action="store_const", const=False,
                       help="load the whole model")
    parser.add_argument("--out", default=None, type=path_text, metavar="DIR",
                        help="write DIR/study.csv, DIR/study.json and DIR/study.html")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace study.csv / study.json / study.html already in --out")
    parser.add_argument("--smoke", action="store_true",
                        help="four configurations without GPTQ on few tokens (a quick check)")
    parser.add_argument("--dask", default=None, metavar="ADDRESS",
                        help="build and score the configurations on the Dask cluster at this "
                        "scheduler address (every worker must see MODEL at the same path)")
    parser.add_argument("--search", default=None, type=search_bits, metavar="bits=B",
                        help="also measure every Linear's sensitivity and search per-layer "
                        "formats (default NVFP4 MR-GPTQ / FP8 W8A16 / BF16) under B effective bits "
                        "per weight: "
                        "one more row, 'mixed (search, B bits)', and sensitivity.csv, "
                        "frontier.csv, mix.json in --out")
    parser.add_argument("--search-formats", default=None, type=format_list, metavar="F,F,...",
                        help="the formats --search chooses among (default "
                        "nvfp4-mr-gptq,fp8-w8a16,bf16; also nvfp4-rtn, nvfp4-gptq, fp8 (W8A8), "
                        "mxfp4)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a model whose config names its own Python code (auto_map)")


def search_bits(value: str) -> float:
    """``bits=5.0`` -> 5.0 (argparse type; a bad value is one line)."""
    key, _, number = value.partition("=")
    try:
        bits = float(number)
    except ValueError:
        bits = math.nan
    if key.strip() != "bits" or not 0 < bits < 64:
        raise argparse.ArgumentTypeError(f"--search {value!r}: write bits=B, B the effective "
                                         "bits per weight, e.g. bits=5.0")
    return bits


def format_list(value: str) -> list[str]:
    """``a,b,c`` -> ``["a", "b", "c"]`` (argparse type; checked by plan_study)."""
    return [f.strip() for f in value.split(",") if f.strip()]


def _out_dir(args: argparse.Namespace) -> Path | None:
    """The checked --out folder (created), or None; ValueError / FileExistsError otherwise."""
    from nvfp4lab.report.outputs import check_out_dir

    if args.out is None:
        return None
    out = check_out_dir(Path(args.out))
    folders = [n for n in OUTPUTS if (out / n).is_dir()]
    if folders:
        raise ValueError(f"--out {args.out!r}: {', '.join(folders)} is a folder where study "
                         "writes a file; move it or pass another folder")
    taken = [n for n in OUTPUTS if (out / n).exists()]
    if taken and not args.overwrite:
        raise FileExistsError(f"--out {args.out!r} already holds {', '.join(taken)}; pass "
                              "--overwrite to replace them")
    return out


def render_page(out: Path, title: str) -> Path:
    """Render ``out/study.html`` from ``out/study.csv`` / ``study.json`` (the template notebook
    through the report runner, in a scratch folder: only the page is kept)."""
    from nvfp4lab.report.runner import run_reports
    from nvfp4lab.studies.llm_study_page import TEMPLATE

    with tempfile.TemporaryDirectory(prefix="nvfp4lab-study-") as scratch:
        (result,) = run_reports(notebooks=[TEMPLATE], out_dir=scratch, index=False,
                                parameters={"STUDY_DIR": str(out.resolve()), "TITLE": title})
        if not result.ok:
            raise ValueError(f"rendering {out / 'study.html'} failed: {result.error}")
        page = out / "study.html"
        shutil.move(result.html_path or Path(scratch) / "llm_study.html", page)
    return page


def run_study_command(args: argparse.Namespace) -> int:
    """Run the study; exit 0, or 2 on bad input (one line)."""
    from nvfp4lab.cli_support import INPUT_ERRORS, error_line
    from nvfp4lab.studies.llm_study import RESULTS_CSV, RESULTS_JSON, plan_study, run_study

    made = args.out is not None and not Path(args.out).exists()
    out = None
    written: list[Path] = []
    try:
        out = _out_dir(args)
        plan = plan_study(args.model, text=args.text, calibration=args.calibration,
                          configs=args.configs, tokens=args.tokens, context=args.context,
                          samples=args.samples, smoke=args.smoke, dtype=args.dtype,
                          streamed=args.streamed, trust_remote_code=args.trust_remote_code,
                          search=args.search, search_formats=args.search_formats)
        result = run_study(plan, dask=args.dask, progress=True)
        if out is not None:
            written = list(result.save(out))
            written.append(render_page(out, f"NVFP4 on {plan.source.name}"))
    except INPUT_ERRORS as exc:
        _clean(out, made, written)
        return error_line("study", exc)
    except KeyboardInterrupt:
        _clean(out, made, written)
        raise
    print(result.verdict())
    if out is not None:
        print(f"wrote {out / RESULTS_CSV}, {out / RESULTS_JSON} and {out / 'study.html'}")
    print(f"nvfp4lab study: {len(plan.configs)} configurations in {result.seconds:.0f} s",
          file=sys.stderr)
    return 0


def _clean(out: Path | None, made: bool, written: list[Path]) -> None:
    """No table without its page: the files this run wrote go, and the --out folder it made
    when nothing else is in it."""
    for path in written:
        path.unlink(missing_ok=True)
    if made and out is not None and out.is_dir() and not any(out.iterdir()):
        out.rmdir()
