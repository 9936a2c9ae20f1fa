"""The ``nvfp4lab`` command line: ``nvfp4lab info | bench | report``.

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
from typing import Any

__all__ = ["COMMANDS", "Command", "build_parser", "main", "parse_assignment"]


@dataclass(frozen=True)
class Command:
    """One subcommand: ``configure`` adds arguments; ``run`` returns the exit code."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


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
    from nvfp4lab.bench.cli import add_arguments

    add_arguments(parser)


def _run_bench(args: argparse.Namespace) -> int:
    from nvfp4lab.bench.cli import run_cli

    return int(run_cli(args))


# -- report ----------------------------------------------------------------------------------


def _add_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="run with SMOKE=True (fast, small)")
    parser.add_argument(
        "-p", "--parameter", dest="parameters", action="append", type=parse_assignment,
        default=[], metavar="NAME=VALUE",
        help="set a notebook parameter (repeatable); the name must exist in the notebook",
    )
    parser.add_argument(
        "--only", action="append", default=None, metavar="NAME",
        help="run only this notebook (name, stem or number prefix like 01; repeatable)",
    )
    parser.add_argument("--out", default="reports", help="output folder (default: reports)")
    parser.add_argument("--notebook-dir", default=None, help="folder of NN_*.ipynb notebooks")
    parser.add_argument("--kernel", default=None,
                        help="Jupyter kernel name (default: this Python interpreter)")
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS",
        help="wall-clock limit per notebook; a notebook past it fails and the next one runs "
        "(default: 1800)",
    )


def _run_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nvfp4lab.reports import run_reports

    try:
        results = run_reports(
            notebooks=args.only,
            out_dir=args.out,
            parameters=dict(args.parameters),
            smoke=args.smoke,
            kernel_name=args.kernel,
            notebook_dir=args.notebook_dir,
            **({} if args.timeout is None else {"timeout_s": args.timeout}),
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"nvfp4lab report: {exc}", file=sys.stderr)
        return 2
    for r in results:
        heads = "; ".join(f"{h.name} = {h.text()}" for h in r.headlines.values())
        line = f"{r.status:>6}  {r.name}  {r.duration_s:6.1f} s"
        print(line + (f"  [{heads}]" if heads else ""))
        if r.error:
            print(f"        {r.error}")
    print(f"index: {Path(args.out) / 'index.html'}")
    failed = [r.name for r in results if not r.ok]
    if failed:
        print(f"nvfp4lab report: failed notebooks: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


COMMANDS: dict[str, Command] = {
    "info": Command("describe this machine and the backend nvfp4lab would pick", _add_info,
                    _run_info),
    "bench": Command("run benchmarks and append results to results/", _add_bench, _run_bench),
    "report": Command("execute the notebooks into reports/*.html", _add_report, _run_report),
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
    """Entry point of the ``nvfp4lab`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return int(args._run(args))
