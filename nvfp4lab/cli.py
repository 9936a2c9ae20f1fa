"""The ``nvfp4lab`` command line: ``nvfp4lab info | bench | report | audit | convert | study``.

Each subcommand is one entry of :data:`COMMANDS`: a function that adds its arguments to a
subparser and a handler ``(args) -> exit code``. Handlers import what they need lazily, so
``nvfp4lab --help`` stays fast. To add a subcommand, write ``_add_<name>`` / ``_run_<name>`` (or
import them from another module inside the handler) and register them in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvfp4lab import cli_start
from nvfp4lab.cli_study import add_study, run_study_command
from nvfp4lab.cli_support import INPUT_ERRORS as _INPUT_ERRORS
from nvfp4lab.cli_support import as_flag as _as_flag
from nvfp4lab.cli_support import error_line as _error
from nvfp4lab.cli_support import path_text

__all__ = ["COMMANDS", "INTERRUPTED_EXIT", "Command", "build_parser", "main", "parse_assignment"]


@dataclass(frozen=True)
class Command:
    """One subcommand: ``configure`` adds arguments; ``run`` returns the exit code.
    ``interrupted``: the one line printed (after ``nvfp4lab <name>: ``) when Ctrl-C stops it."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    interrupted: str = "interrupted"


#: Exit status of a command stopped by Ctrl-C (SIGINT), as shells report it: 128 + 2 (also
#: while the command line starts: :mod:`nvfp4lab.cli_start`).
INTERRUPTED_EXIT = cli_start.INTERRUPTED_EXIT


def parse_assignment(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` -> ``(NAME, value)``; VALUE is a Python literal when it parses as one
    (``64``, ``True``, ``1e-3``, ``'x'``, ``[1, 2]``), else the raw string."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with a Python name, got {text!r}")
    try:
        value: Any = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return name, value


# -- info ------------------------------------------------------------------------------------


def _add_info(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="torch device to describe (default: auto)")


def _run_info(args: argparse.Namespace) -> int:
    """Print :func:`~nvfp4lab.execution.dispatch.info_report`; exit 2 on a bad environment value."""
    import torch

    from nvfp4lab.execution.dispatch import info_report, select_backend

    if args.device is not None:
        try:
            torch.device(args.device)
        except (RuntimeError, ValueError) as exc:
            print(f"nvfp4lab info: --device {args.device!r} is not a torch device ({exc}); "
                  "use --device cpu or --device cuda[:N]", file=sys.stderr)
            return 2
    print(info_report(device=args.device))
    try:
        select_backend(args.device)
    except ValueError:
        return 2
    return 0


# -- bench -----------------------------------------------------------------------------------


def _add_bench(parser: argparse.ArgumentParser) -> None:
    from nvfp4lab.bench.command import add_arguments

    add_arguments(parser)


def _run_bench(args: argparse.Namespace) -> int:
    from nvfp4lab.bench.command import run_cli

    return int(run_cli(args))


# -- report ----------------------------------------------------------------------------------


def _add_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="run with SMOKE=True (fast, small)")
    parser.add_argument(
        "-p", "--parameter", dest="parameters", action="append", type=parse_assignment,
        default=[], metavar="NAME=VALUE",
        help="set a notebook parameter (repeatable); the name must exist in the notebook and "
        "the value be of its default's kind (True/False, a number, 'a string')",
    )
    parser.add_argument(
        "--only", action="append", default=None, metavar="NAME",
        help="run only this notebook (name, stem or number prefix like 01; repeatable)",
    )
    parser.add_argument("--out", default="reports", type=path_text,
                        help="output folder (default: reports)")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace files in --out that an earlier report run did not write (its own pages "
        "are always replaced)",
    )
    parser.add_argument("--notebook-dir", default=None, type=path_text,
                        help="folder of NN_*.ipynb notebooks")
    parser.add_argument("--kernel", default=None,
                        help="Jupyter kernel name (default: this Python interpreter)")
    parser.add_argument(
        "--jobs", type=int, default=None, metavar="N",
        help="notebooks run side by side, longest first, each kernel with the cores no other "
        "running notebook uses (NVFP4LAB_THREADS set: that many each; default: one per core)",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS",
        help="wall-clock limit per notebook; a notebook past it fails and the next one runs "
        "(default: 1800)",
    )


def _run_report(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from nvfp4lab.report.runner import run_reports
    from nvfp4lab.report.talk import Progress

    start = time.monotonic()
    with Progress(sys.stdout) as progress:
        try:
            results = run_reports(
                notebooks=args.only,
                out_dir=args.out,
                parameters=dict(args.parameters),
                smoke=args.smoke,
                kernel_name=args.kernel,
                notebook_dir=args.notebook_dir,
                jobs=args.jobs,
                overwrite=args.overwrite,
                progress=progress,
                **({} if args.timeout is None else {"timeout_s": args.timeout}),
            )
        except (ValueError, FileNotFoundError) as exc:
            print(f"nvfp4lab report: {exc}", file=sys.stderr)
            return 2
        for r in results:  # each was printed as it ended; any the listener did not see
            if r.name not in progress.reported:
                progress.finished(r)
    failed = [r.name for r in results if not r.ok]
    minutes, seconds = divmod(round(time.monotonic() - start), 60)
    print(f"{len(results) - len(failed)} of {len(results)} notebooks ok in "
          f"{minutes} min {seconds:02d} s; index: {Path(args.out) / 'index.html'}")
    if failed:
        print(f"nvfp4lab report: failed notebooks: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


# -- audit and convert -------------------------------------------------------------------------


def _add_where(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="local worker processes, each with its share of the cores (default 0: "
                             "run in this process)")
    parser.add_argument("--dask", default=None, metavar="ADDRESS",
                        help="run the tasks on the Dask cluster at this scheduler address")


def _format_titles() -> str:
    """The checkpoint formats as help texts name them: ``a, b or c``."""
    from nvfp4lab.checkpoint.formats import FORMATS

    titles = [spec.title for spec in FORMATS.values()]
    return " or ".join(titles) if len(titles) < 3 else ", ".join(titles[:-1]) + " or " + titles[-1]


def _add_audit(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=path_text, help=f"checkpoint folder, or the file of a "
                        f"one-file format ({_format_titles()})")
    parser.add_argument("--reference", default=None, metavar="FLOAT_DIR", type=path_text,
                        help="float checkpoint folder: adds each layer's weight SQNR")
    parser.add_argument("--out", default=None, metavar="DIR", type=path_text,
                        help="write DIR/audit.csv and DIR/audit.html (the rendered report)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace audit.csv / audit.html already in --out")
    parser.add_argument("--gpu", action="append", default=None, metavar="NAME",
                        help="GPU whose vLLM kernel is reported (repeatable; default: A100, "
                        "H100, B200, RTX 5090)")
    parser.add_argument("--vllm", default=None, metavar="RELEASE",
                        help="vLLM release whose kernel rules apply (default: latest modelled)")
    _add_source_format(parser, "--format")
    _add_where(parser)


def _add_source_format(parser: argparse.ArgumentParser, flag: str) -> None:
    from nvfp4lab.checkpoint.formats import FORMATS

    parser.add_argument(flag, dest="source_format", default=None,
                        choices=[fmt.value for fmt in FORMATS],
                        help="format to read the checkpoint as (default: detected; needed for a "
                        "folder that holds several, e.g. compressed-tensors and a .gguf file)")


def _audit_out(args: argparse.Namespace) -> Path | None:
    """The checked --out folder (created), or None; raises ValueError / FileExistsError."""
    from nvfp4lab.report.outputs import check_out_dir

    if args.out is None:
        return None
    out = Path(args.out)
    if out.resolve().is_relative_to(Path(args.path).resolve()):
        raise ValueError(f"--out {args.out!r} lies inside the checkpoint folder; pick a folder "
                         "outside it")
    out = check_out_dir(out)
    folders = [n for n in ("audit.csv", "audit.html") if (out / n).is_dir()]
    if folders:  # never replaced, even with --overwrite
        raise ValueError(f"--out {args.out!r}: {', '.join(folders)} is a folder where audit "
                         "writes a file; move it or pass another folder")
    taken = [n for n in ("audit.csv", "audit.html") if (out / n).exists()]
    if taken and not args.overwrite:
        raise FileExistsError(f"--out {args.out!r} already holds {', '.join(taken)}; pass "
                              "--overwrite to replace them")
    return out


def _render_audit(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    import shutil
    import tempfile

    from nvfp4lab.checkpoint.auditing import write_csv
    from nvfp4lab.report.runner import run_reports
    from nvfp4lab.studies.audit import TEMPLATE

    csv = write_csv(rows, out / "audit.csv").resolve()
    # the runner also writes the executed notebook: render in a scratch folder, keep the page
    try:
        with tempfile.TemporaryDirectory(prefix="nvfp4lab-audit-") as scratch:
            (result,) = run_reports(notebooks=[TEMPLATE], out_dir=scratch, index=False,
                                    parameters={"AUDIT_CSV": str(csv), "TITLE": title})
            if not result.ok:
                raise ValueError(f"rendering {out / 'audit.html'} failed: {result.error}")
            shutil.move(result.html_path or Path(scratch) / "audit.html", out / "audit.html")
    except KeyboardInterrupt:  # no table without its page (the runner leaves no partial one)
        csv.unlink(missing_ok=True)
        raise


def _run_audit(args: argparse.Namespace) -> int:
    """Print the flagged layers; exit 1 when a layer is flagged, 2 on bad input."""
    from nvfp4lab.checkpoint.auditing import DEFAULT_GPUS, audit_rows
    from nvfp4lab.execution.dispatch import select_backend

    made = args.out is not None and not Path(args.out).exists()
    out = None
    try:
        gpus = tuple(args.gpu or DEFAULT_GPUS)
        for gpu in gpus:
            select_backend(gpu=gpu, vllm=args.vllm, env={})
        out = _audit_out(args)
        rows = audit_rows(args.path, reference=args.reference, gpus=gpus, vllm=args.vllm,
                          workers=args.workers, dask=args.dask, progress=True,
                          format=args.source_format)
        if out is not None:
            _render_audit(rows, out, str(args.path))
    except _INPUT_ERRORS as exc:
        return _error("audit", _as_flag(exc, "format", "--format"))
    except KeyboardInterrupt:  # the --out folder this run made goes too when nothing is in it
        if made and out is not None and not any(out.iterdir()):
            out.rmdir()
        raise
    flagged = [r for r in rows if r["issues"]]
    print(f"{args.path}: {len(rows)} quantized layers, {len(flagged)} flagged")
    for row in flagged:
        print(f"  {row['layer']}: {row['issues']}")
    if out is not None:
        print(f"wrote {out / 'audit.csv'} and {out / 'audit.html'}")
    return 1 if flagged else 0


def _add_convert(parser: argparse.ArgumentParser) -> None:
    from nvfp4lab.checkpoint.formats import FORMATS

    parser.add_argument("src", type=path_text, help="NVFP4 checkpoint folder (or one-file "
                        "checkpoint) to convert")
    parser.add_argument("dst", type=path_text, help="new checkpoint folder")
    parser.add_argument("--format", required=True, choices=[fmt.value for fmt in FORMATS],
                        help="format of DST")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace DST when it holds only checkpoint files")
    _add_source_format(parser, "--from")
    _add_where(parser)


def _run_convert(args: argparse.Namespace) -> int:
    from nvfp4lab.checkpoint.conversion import convert

    try:
        report = convert(args.src, args.dst, format=args.format, overwrite=args.overwrite,
                         source_format=args.source_format, workers=args.workers, dask=args.dask,
                         progress=True)
    except _INPUT_ERRORS as exc:
        if isinstance(exc, FileExistsError):  # the library's keyword, said as the flag
            exc = FileExistsError(str(exc).replace("overwrite=True", "--overwrite"))
        return _error("convert", _as_flag(exc, "source_format", "--from"))
    print(report.summary())
    for key in report.not_round_trip:
        print(f"  not round-tripping: {key}")
    return 0


COMMANDS: dict[str, Command] = {
    "info": Command("describe this machine and the backend nvfp4lab would pick", _add_info,
                    _run_info),
    "bench": Command("run benchmarks and append results to results/", _add_bench, _run_bench),
    "report": Command("execute the notebooks into reports/*.html", _add_report, _run_report,
                      "interrupted; pages finished before kept, the notebook that was running "
                      "keeps its previous page (index.html says which)"),
    "audit": Command("check every quantized layer of an NVFP4 checkpoint (streamed)", _add_audit,
                     _run_audit, "interrupted; nothing was written"),
    "convert": Command("convert an NVFP4 checkpoint to another checkpoint format", _add_convert,
                       _run_convert, "interrupted; nothing was written"),
    "study": Command("what NVFP4 does to your model on your text: perplexity, KL divergence and "
                     "top-1 per configuration, with a verdict", add_study, run_study_command,
                     "interrupted; nothing was written"),
}


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with one subparser per entry of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(prog="nvfp4lab", description="NVFP4 research workbench")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=command.help, description=command.help)
        command.configure(sub_parser)
        sub_parser.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nvfp4lab`` console script; returns the exit code.

    Ctrl-C (SIGINT) ends a command with one line on stderr, ``nvfp4lab <command>: interrupted...``
    (its :attr:`Command.interrupted`), and exit status :data:`INTERRUPTED_EXIT` (130), after the
    command's own cleanup ran; no traceback. Before the command starts (imports, parsing) the
    handler of :mod:`nvfp4lab.cli_start` says the same in one line. A bad ``NVFP4LAB_THREADS``
    or ``NVFP4LAB_NATIVE_ISA`` is refused (one line, exit 2) before any command starts.
    """
    from nvfp4lab.settings import native_isa, torch_threads

    args = build_parser().parse_args(argv)
    try:
        cli_start.release()  # Ctrl-C from here on: the command's own handling
        try:
            torch_threads()
            native_isa()
        except ValueError as exc:
            code = _error(args.command, exc)
        else:
            code = int(args._run(args))
    except KeyboardInterrupt:
        print(f"nvfp4lab {args.command}: {COMMANDS[args.command].interrupted}", file=sys.stderr)
        code = INTERRUPTED_EXIT
    cli_start.finished(code)  # a Ctrl-C while Python exits keeps this status
    return code
