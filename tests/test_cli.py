"""``nvfp4lab audit`` and ``nvfp4lab convert``: exit codes, one-line errors, the --out report, and
nothing written outside the folders asked for."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from nvfp4lab import checkpoint, cli
from tests.checkpoint.builders import saved_checkpoint, tiny_llama


@pytest.fixture(scope="module")
def unshared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_checkpoint(tmp_path_factory.mktemp("cli") / "ckpt", seed=6,
                            share_global_scale=None)


@pytest.fixture(scope="module")
def nvfp4lab_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_checkpoint(tmp_path_factory.mktemp("clean") / "ckpt", seed=7)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_audit_out_writes_csv_and_html_only_there(unshared: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    before = _snapshot(unshared)
    code, out, err = _run(["audit", str(unshared), "--out", "report", "--workers", "0"], capsys)
    assert code == 1, err  # flagged layers
    assert "unshared tensor scales" in out and "4 flagged" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]
    # issue 19 (audit --out): exactly what the README promises, no executed notebook
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["audit.csv", "audit.html"]
    with open(tmp_path / "report" / "audit.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 14 and {"layer", "scale_form", "issues"} <= set(rows[0])
    assert "convention" not in rows[0]  # issue 33: the scale's ENCODE/DECODE form, renamed
    flagged = [r["layer"] for r in rows if r["issues"]]
    assert "model.layers.0.self_attn.q_proj" in flagged or "model.layers.0.self_attn.k_proj" in (
        flagged)
    page = (tmp_path / "report" / "audit.html").read_text()
    assert "Checkpoint audit" in page and "data:image/png" in page
    assert "<th>scale_form</th>" in page and "<th>convention</th>" not in page
    assert page.index(flagged[0]) < page.index("model.layers.0.self_attn.o_proj")
    assert _snapshot(unshared) == before
    code, _, err = _run(["audit", str(unshared), "--out", "report", "--workers", "0"], capsys)
    assert code == 2 and "--overwrite" in err


def test_audit_clean_checkpoint_exits_0(nvfp4lab_like: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["audit", str(nvfp4lab_like), "--workers", "0", "--gpu", "b200"], capsys)
    assert code == 0 and "0 flagged" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["audit", "{tmp}/nope"], "does not exist"),
        (["audit", "{tmp}/float"], "not a quantized checkpoint"),
        (["audit", "{ckpt}", "--out", "{tmp}/file.txt"], "is a file"),
        (["audit", "{ckpt}", "--out", "{ckpt}/report"], "inside the checkpoint folder"),
        (["audit", "{ckpt}", "--gpu", "X100"], "unknown GPU 'X100'"),
        (["audit", "{ckpt}", "--out", "{tmp}", "--overwrite"],
         "audit.csv is a folder where audit writes a file"),
        (["audit", "{ckpt}", "--vllm", "9.9.9"], "9.9.9"),
        (["audit", "{ckpt}", "--reference", "{tmp}/nope"], "reference folder"),
        (["audit", "{ckpt}", "--reference", "{tmp}/file.txt"], "file.txt is a file, not a folder"),
        (["report", "--notebook-dir", "{tmp}/file.txt"], "file.txt is a file, not a folder"),
        (["audit", "{ckpt}", "--workers", "-1"], "workers must be"),
        (["convert", "{ckpt}", "{ckpt}", "--format", "modelopt"], "overlaps the source"),
        (["convert", "{ckpt}", "{tmp}/x", "--format", "compressed-tensors"], "already a"),
        (["convert", "{tmp}/nope", "{tmp}/y", "--format", "modelopt"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2(nvfp4lab_like: Path, tmp_path: Path, argv: list[str],
                                      message: str, capsys: pytest.CaptureFixture[str]) -> None:
    tiny_llama().save_pretrained(tmp_path / "float")
    (tmp_path / "file.txt").write_text("mine")
    (tmp_path / "audit.csv").mkdir()  # a folder where audit --out would write its table
    args = [a.format(tmp=tmp_path, ckpt=nvfp4lab_like) for a in argv]
    capsys.readouterr()  # transformers' own progress output while saving the float model
    code, _, err = _run(args, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"nvfp4lab {argv[0]}: "), err
    assert message in lines[0]
    assert "Traceback" not in err
    assert (tmp_path / "file.txt").read_text() == "mine"


def test_convert_round_trip_and_overwrite(nvfp4lab_like: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["convert", str(nvfp4lab_like), str(tmp_path / "mo"), "--format",
                         "modelopt", "--workers", "0"], capsys)
    assert code == 0 and "tensor scales converted" in out
    assert checkpoint.detect_format(tmp_path / "mo") == "modelopt"
    code, _, err = _run(["convert", str(nvfp4lab_like), str(tmp_path / "mo"), "--format",
                         "modelopt"], capsys)
    assert code == 2 and "pass --overwrite" in err
    code, _, _ = _run(["convert", str(nvfp4lab_like), str(tmp_path / "mo"), "--format",
                       "modelopt", "--overwrite", "--workers", "0"], capsys)
    assert code == 0
    assert sorted(os.listdir(tmp_path)) == ["mo"]


# --------------------------------------------------------------------------------------------
# Issue 19, case C: Ctrl-C used to print 25 to 72 lines of traceback (and, with --workers, one
# per worker). Now: one line naming the command, exit 130, nothing left behind. A real SIGINT:
# to the command alone (audit, in this process, while it reads the checkpoint), and to its whole
# process group as a terminal sends it (convert --workers 2: the workers get it too).


@pytest.fixture(scope="module")
def busy(unshared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests import processes

    return processes.busy_checkpoint(unshared, tmp_path_factory.mktemp("busy") / "ckpt")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("command", ["audit", "convert"])
def test_ctrl_c_is_one_line_exit_130_and_leaves_nothing(command: str, busy: Path,
                                                        tmp_path: Path) -> None:
    import signal

    from tests import processes

    if command == "audit":
        argv = ["audit", str(busy), "--out", "report", "--workers", "0"]
    else:
        argv = ["convert", str(busy), "out", "--format", "modelopt", "--workers", "2"]
    proc = processes.cli(argv, tmp_path, start_new_session=True)
    family: list = []
    try:
        if command == "audit":
            processes.wait_for(lambda: processes.maps_file(proc.pid, busy),
                               "audit reading the checkpoint")
            family = processes.descendants(proc.pid)
            proc.send_signal(signal.SIGINT)
        else:
            processes.wait_for(lambda: len(processes.pool_workers(proc.pid)) == 2,
                               "two pool workers")
            assert any(tmp_path.iterdir()), "convert writes into a temporary folder first"
            family = processes.descendants(proc.pid)
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        processes.kill_all(family)
        processes.stop(proc)
    assert proc.returncode == 130, err
    assert err.splitlines() == [f"nvfp4lab {command}: interrupted; nothing was written"], err
    assert list(tmp_path.iterdir()) == []  # no report folder, no output or temporary folder
    processes.wait_for(lambda: not processes.alive(family), "its processes to end", timeout=10)


@pytest.mark.parametrize("argv", [["audit", ""], ["convert", "x", " ", "--format", "gguf"],
                                  ["report", "--out", ""], ["audit", "x", "--reference", ""]])
def test_an_empty_path_is_refused(argv: list[str], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`audit ""` used to audit the current folder (Path("") is ".")."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "an empty path; pass a folder or file" in err, err
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# Issue 32, case 8: NVFP4LAB_THREADS=1000000000 aborted in libgomp (a 216 GB allocation) and
# 100000 segfaulted a pool worker; `report` checked it once per notebook. Now every command
# refuses a count outside 1..os.cpu_count() in one line, exit 2, before it starts anything.


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "threads"),
    [
        (["info"], "1000000000"),
        (["audit", "{ckpt}", "--workers", "2"], "100000"),
        (["convert", "{ckpt}", "{tmp}/out", "--format", "modelopt", "--workers", "0"],
         "1000000000"),
        (["report", "--smoke", "--only", "01", "--out", "{tmp}/reports"], "100000"),
        (["info"], "0"),
    ],
)
def test_threads_beyond_the_machine_are_one_line_exit_2_before_anything(
    argv: list[str], threads: str, nvfp4lab_like: Path, tmp_path: Path
) -> None:
    import subprocess
    import sys

    from tests import processes

    args = [a.format(tmp=tmp_path, ckpt=nvfp4lab_like) for a in argv]
    env = {**processes.child_env(), "NVFP4LAB_THREADS": threads}
    done = subprocess.run([sys.executable, "-m", "nvfp4lab", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    limit = os.cpu_count()
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        f"nvfp4lab {argv[0]}: NVFP4LAB_THREADS must be a whole number from 1 to {limit} (torch "
        f"CPU threads per process; {limit} = this machine's logical CPUs), got '{threads}'; "
        "unset it for the default (1)"
    ], done.stderr[-3000:]
    assert done.stdout == "" and list(tmp_path.iterdir()) == []  # nothing started or written


def test_a_bad_native_isa_is_one_line_exit_2_before_anything(tmp_path: Path) -> None:
    """NVFP4LAB_NATIVE_ISA=avx1024 used to pass the command's start and raise at the first C++
    kernel call (only where the library is built); now refused up front like the thread count."""
    import subprocess
    import sys

    from tests import processes

    env = {**processes.child_env(), "NVFP4LAB_NATIVE_ISA": "avx1024"}
    done = subprocess.run([sys.executable, "-m", "nvfp4lab", "info"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvfp4lab info: unknown NVFP4LAB_NATIVE_ISA "
                                                   "value 'avx1024'; accepted values: "), lines


# --------------------------------------------------------------------------------------------
# Issue 32: Ctrl-C in the first ~1.5 s of a command (while it imports torch) printed a 13-42
# line KeyboardInterrupt traceback; the one line and exit 130 of issue 19 only held once the
# command ran. A real SIGINT to both entry points (the console script, python -m nvfp4lab), sent
# at delays across the import window, counted from the first import of nvfp4lab's own (or of
# torch, which nvfp4lab imports first) that completes (its import time on stderr,
# PYTHONPROFILEIMPORTTIME: nvfp4lab.cli_start, which guards from then on). A SIGINT before that,
# during the interpreter's own start (measured: 20-50 ms), cannot be caught by any package.

_IMPORT_TIME = "import time:"


def _interrupt_at(command: list[str], delay: float, cwd: Path) -> tuple[int, list[str]]:
    """Start ``command`` with import times on stderr, send SIGINT ``delay`` seconds after its
    first module of nvfp4lab or torch is imported; (exit status, stderr lines other than import
    times)."""
    import signal
    import subprocess
    import threading
    import time

    from tests import processes

    env = {**processes.child_env(), "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:  # drain stderr (thousands of import lines) as it comes
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            module = line.split("|")[-1].strip()
            if line.startswith(_IMPORT_TIME) and module.startswith(("nvfp4lab.", "torch")):
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(60), "nothing of nvfp4lab was imported:\n" + "\n".join(lines)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        processes.stop(proc)
    reader.join(10)
    return proc.returncode, [line for line in lines if not line.startswith(_IMPORT_TIME)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("entry", ["console script", "python -m"])
@pytest.mark.parametrize("command", ["info", "audit"])
def test_ctrl_c_while_starting_is_one_line_exit_130(entry: str, command: str,
                                                    nvfp4lab_like: Path, tmp_path: Path) -> None:
    import sys

    script = Path(sys.executable).with_name("nvfp4lab")
    if entry == "console script" and not script.exists():
        pytest.skip(f"no console script {script} (pip install -e .)")
    start = [str(script)] if entry == "console script" else [sys.executable, "-m", "nvfp4lab"]
    argv = ["info"] if command == "info" else ["audit", str(nvfp4lab_like), "--workers", "0"]
    own = {"info": "interrupted", "audit": "interrupted; nothing was written"}[command]
    accepted = {f"nvfp4lab {command}: interrupted while starting; nothing was done",
                f"nvfp4lab {command}: {own}"}
    outcomes = []
    for delay in (0.0, 0.05, 0.2, 0.5, 1.0, 2.0):
        code, err = _interrupt_at(start + argv, delay, tmp_path)
        outcomes.append(code)
        if code == 130:  # stopped: one line, no traceback
            assert len(err) == 1 and err[0] in accepted, (delay, err)
        else:  # it finished first (audit: no layer flagged): nothing on stderr
            assert code == 0 and err == [], (delay, code, err)
    assert outcomes[:3] == [130] * 3, outcomes  # the first 0.2 s are always inside the imports
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "orig_argv", "expected"),
    [
        (["/v/bin/nvfp4lab", "info"], ["/v/bin/python", "/v/bin/nvfp4lab", "info"], True),
        (["/v/bin/nvfp4lab", "info"], ["/v/bin/python", "-E", "/v/bin/nvfp4lab", "info"], True),
        (["-m", "audit", "x"], ["python", "-m", "nvfp4lab", "audit", "x"], True),
        (["-m", "info"], ["python", "-X", "importtime", "-mnvfp4lab", "info"], True),
        (["-m", "info"], ["python", "-m", "nvfp4lab.cli", "info"], False),
        (["-m", "info"], ["python", "-m", "mytool", "info"], False),
        (["-c"], ["python", "-c", "import nvfp4lab"], False),
        (["/home/me/nvfp4lab.py"], ["python", "/home/me/nvfp4lab.py"], False),  # a user script
        (["/v/bin/pytest", "tests"], ["python", "/v/bin/pytest", "tests"], False),
        # a spawned pool worker of `nvfp4lab convert`: its parent's argv, its own orig_argv
        (["/v/bin/nvfp4lab", "convert", "a", "b"],
         ["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()",
          "--multiprocessing-fork"], False),
        (["/v/bin/nvfp4lab", "info"],
         ["python", "-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"],
         False),
        ([], [], False),
    ],
)
def test_only_the_command_line_process_guards_its_start(argv: list[str], orig_argv: list[str],
                                                        expected: bool) -> None:
    from nvfp4lab import cli_start

    assert cli_start.is_command_line(argv, orig_argv) is expected


def test_import_nvfp4lab_elsewhere_leaves_sigint_alone(tmp_path: Path) -> None:
    """A script, a notebook or a worker importing nvfp4lab keeps Python's own Ctrl-C."""
    import subprocess
    import sys

    from tests import processes

    code = ("import signal, nvfp4lab\n"
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=processes.child_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


_PYRUN_INTERRUPT = '''
import ctypes, sys
sys.argv, sys.orig_argv = ["-m", "audit"], [sys.executable, "-m", "nvfp4lab", "audit"]
from nvfp4lab import cli_start
cli_start.guard()  # as in `python -m nvfp4lab audit`
cli_start.release()
api = ctypes.pythonapi
api.PyRun_String.restype = ctypes.py_object
api.PyRun_String.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
try:  # a Ctrl-C while an extension module runs Python code through PyRun_String
    api.PyRun_String(b"raise KeyboardInterrupt", 257, {}, {})
except KeyboardInterrupt:
    print("nvfp4lab audit: interrupted; nothing was written", file=sys.stderr)
cli_start.finished(130)
sys.exit(130)
'''


def test_a_handled_interrupt_exits_130_under_python_m(tmp_path: Path) -> None:
    """CPython marks a KeyboardInterrupt that passed through a nested PyRun_* call as unhandled
    and, at the end of `python -m`, killed the process with SIGINT (status -2) although the
    command had handled it (seen once in ~100 real interrupts of `python -m nvfp4lab audit`)."""
    import subprocess
    import sys

    from tests import processes

    (tmp_path / "pyrun_interrupt.py").write_text(_PYRUN_INTERRUPT)
    env = processes.child_env()
    env["PYTHONPATH"] = os.pathsep.join((str(tmp_path), env["PYTHONPATH"]))
    done = subprocess.run([sys.executable, "-m", "pyrun_interrupt"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 130, done.stderr
    assert done.stderr.splitlines() == ["nvfp4lab audit: interrupted; nothing was written"]
