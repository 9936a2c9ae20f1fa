"""nvfp4lab.settings: the one reader of the environment, through monkeypatched variables."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvfp4lab import settings
from nvfp4lab.settings import FUSED_ENV, environ, fused_mode


def test_environ_is_the_live_environment_unless_a_mapping_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert environ() is os.environ
    monkeypatch.setenv(FUSED_ENV, "off")
    assert environ()[FUSED_ENV] == "off"  # read at call time, not cached at import
    given = {FUSED_ENV: "on"}
    assert environ(given) is given
    assert environ({}) == {}  # an empty mapping is used as is, not replaced by os.environ


@pytest.mark.parametrize(
    ("raw", "mode"),
    [("on", "on"), ("OFF", "off"), (" Auto\n", "auto"), ("", "auto"), ("   ", "auto")],
)
def test_fused_mode_parses_the_live_variable(
    monkeypatch: pytest.MonkeyPatch, raw: str, mode: str
) -> None:
    monkeypatch.setenv(FUSED_ENV, raw)
    assert fused_mode() == mode
    assert fused_mode({FUSED_ENV: "off" if mode != "off" else "on"}) != mode  # a mapping wins


def test_fused_mode_follows_changes_and_unset_is_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FUSED_ENV, raising=False)
    assert fused_mode() == "auto"
    monkeypatch.setenv(FUSED_ENV, "on")
    assert fused_mode() == "on"
    monkeypatch.setenv(FUSED_ENV, "off")
    assert fused_mode() == "off"


@pytest.mark.parametrize("raw", ["yes", "1", "true", "fused"])
def test_bad_fused_value_names_it(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(FUSED_ENV, raw)
    with pytest.raises(
        ValueError,
        match=rf"^unknown NVFP4LAB_FUSED value '{raw}'; accepted values: 'auto', 'on', 'off' "
        r"\(unset = auto\)$",
    ):
        fused_mode()


def test_variable_names() -> None:
    assert (settings.BACKEND_ENV, settings.FUSED_ENV, settings.CACHE_ENV) == (
        "NVFP4LAB_BACKEND", "NVFP4LAB_FUSED", "NVFP4LAB_CACHE")
    assert settings.VLLM_ENV_VARS == (
        "VLLM_USE_NVFP4_CT_EMULATIONS", "VLLM_NVFP4_GEMM_BACKEND", "VLLM_USE_FBGEMM",
        "VLLM_BATCH_INVARIANT", "VLLM_DISABLED_KERNELS")
    # every public *_ENV name is documented in the module docstring
    for name in settings.__all__:
        if name.endswith("_ENV"):
            assert f"``{getattr(settings, name)}``" in settings.__doc__, name


@pytest.mark.parametrize(("raw", "text"), [("", False), ("0", False), ("1", True), (" 2 ", True)])
def test_text_progress_picks_the_tqdm_class(raw: str, text: bool) -> None:
    from tqdm.auto import tqdm as auto_bar
    from tqdm.std import tqdm as std_bar

    env = {settings.TEXT_PROGRESS_ENV: raw}
    assert settings.text_progress(env) is text
    assert settings.tqdm_class(env) is (std_bar if text else auto_bar)
    assert settings.text_progress({}) is False  # unset: widgets where Jupyter offers them


def test_bad_text_progress_value_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.TEXT_PROGRESS_ENV, "yes")
    with pytest.raises(ValueError, match=r"^NVFP4LAB_TEXT_PROGRESS must be an integer .*'yes'$"):
        settings.tqdm_class()


def test_torch_threads_default_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert settings.torch_threads({}) == settings.DEFAULT_THREADS == 1
    assert settings.torch_threads({settings.THREADS_ENV: " 3 "}) == 3
    assert settings.torch_threads({settings.THREADS_ENV: "4"}) == 4  # every CPU
    assert settings.torch_threads({settings.THREADS_ENV: ""}) == 1


@pytest.mark.parametrize("raw", ["0", "-2", "two", "1.5", "5", "100000", "1000000000"])
def test_torch_threads_rejects_bad_values_naming_the_variable(
    raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32, case 8: a count above the machine's CPUs (1000000000 aborted in libgomp)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    with pytest.raises(ValueError, match=rf"^NVFP4LAB_THREADS must be a whole number from 1 to 4 "
                       rf"\(torch CPU threads per process; 4 = this machine's logical CPUs\), "
                       rf"got {raw!r}; unset it for the default \(1\)$"):
        settings.torch_threads({settings.THREADS_ENV: raw})


def test_run_reports_checks_threads_before_any_notebook(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The report runner used to find a bad NVFP4LAB_THREADS once per notebook, in the kernel's
    environment (every notebook failed); now once, before its output folder exists."""
    from nvfp4lab import report

    monkeypatch.setenv(settings.THREADS_ENV, "1000000000")
    with pytest.raises(ValueError, match=r"^NVFP4LAB_THREADS must be a whole number from 1 to"):
        report.run_reports(notebooks=["01"], out_dir=tmp_path / "out", smoke=True)
    assert list(tmp_path.iterdir()) == []


def test_thread_limit_is_the_machines_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings.thread_limit() == os.cpu_count()
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # unknown: one thread
    assert settings.thread_limit() == 1


def test_use_torch_threads_sets_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # 2 threads are allowed on any machine
    try:
        monkeypatch.setenv(settings.THREADS_ENV, "2")
        assert settings.use_torch_threads() == 2 and torch.get_num_threads() == 2
        assert settings.use_torch_threads({}) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_every_report_notebook_takes_its_threads_from_settings() -> None:
    """Thread counts are chosen in one place: each notebook's setup cell calls
    ``settings.use_torch_threads()``; none sets torch's threads itself."""
    import json
    notebooks = sorted((Path(__file__).parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert notebooks
    for path in notebooks:
        code = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                if c["cell_type"] == "code"]
        assert sum("settings.use_torch_threads()" in c for c in code) == 1, path.name
        assert not any("set_num_threads" in c for c in code), path.name


def test_cache_dir_precedence(tmp_path: Path) -> None:
    home = Path.home() / ".cache" / "nvfp4lab"
    assert settings.cache_dir({}) == home
    assert settings.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "nvfp4lab"
    both = {"XDG_CACHE_HOME": str(tmp_path), settings.CACHE_ENV: str(tmp_path / "own")}
    assert settings.cache_dir(both) == tmp_path / "own"  # NVFP4LAB_CACHE wins


def test_kernel_cache_dir_is_ours_unless_torchs_variable_is_set(
    tmp_path: Path,
) -> None:
    ours = {settings.CACHE_ENV: str(tmp_path)}
    inductor = tmp_path / "inductor" / settings.cpu_signature({})
    assert settings.kernel_cache_dir(ours) == (inductor, False)
    home = Path.home() / ".cache" / "nvfp4lab" / "inductor" / settings.cpu_signature({})
    assert settings.kernel_cache_dir({}) == (home, False)
    users = {**ours, settings.INDUCTOR_CACHE_ENV: str(tmp_path / "mine")}
    assert settings.kernel_cache_dir(users) == (tmp_path / "mine", True)  # the user's wins
    blank = {**ours, settings.INDUCTOR_CACHE_ENV: "  "}
    assert settings.kernel_cache_dir(blank) == (inductor, False)
    # torch writes its own default into the variable when anything touches its cache: unset
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = settings.torch_default_kernel_cache()
    assert default == Path(default_cache_dir())  # torch's own function as the oracle
    by_torch = {**ours, settings.INDUCTOR_CACHE_ENV: str(default)}
    assert settings.kernel_cache_dir(by_torch) == (inductor, False)


def test_cpu_signature_tells_instruction_sets_and_capabilities_apart(tmp_path: Path) -> None:
    """Another CPU (other flags) or another ATEN_CPU_CAPABILITY: another kernel cache folder;
    the same CPU and setting: the same one. A missing cpuinfo still gives a name."""
    avx512 = tmp_path / "avx512"
    avx512.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n\n"
                      "processor\t: 1\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n")
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    reordered = tmp_path / "reordered"
    reordered.write_text("flags : avx512bw avx512f avx2 sse2 fpu\n")
    sig = settings.cpu_signature
    assert sig({}, avx512) == sig({}, reordered) != sig({}, avx2)
    capped = {settings.CPU_CAPABILITY_ENV: "AVX2"}
    assert sig(capped, avx512) != sig({}, avx512) and "-avx2-" in sig(capped, avx512)
    assert sig({}, tmp_path / "absent")  # a name all the same
    assert "/" not in sig({settings.CPU_CAPABILITY_ENV: "../x"}, avx2)


def test_the_cpu_is_read_once_per_process(tmp_path: Path) -> None:
    """The ``auto`` rule asks for the kernel cache folder (so the CPU signature) on every
    eligible call: the flags file was read and hashed each time (~30 us). A process's CPU does
    not change under it; ATEN_CPU_CAPABILITY is still read at each call."""
    info = tmp_path / "cpuinfo"
    info.write_text("flags : fpu sse2 avx2\n")
    first = settings.cpu_signature({}, info)
    info.write_text("flags : fpu sse2 avx2 avx512f\n")
    assert settings.cpu_signature({}, info) == first
    capped = settings.cpu_signature({settings.CPU_CAPABILITY_ENV: "default"}, info)
    assert capped != first and capped.endswith(first.rsplit("-", 1)[1])


def test_use_kernel_cache_sets_the_variable_only_when_unset(tmp_path: Path) -> None:
    env = {settings.CACHE_ENV: str(tmp_path)}
    inductor = tmp_path / "inductor" / settings.cpu_signature({})
    assert settings.use_kernel_cache(env) == inductor
    assert env[settings.INDUCTOR_CACHE_ENV] == str(inductor)
    mine = {settings.CACHE_ENV: str(tmp_path), settings.INDUCTOR_CACHE_ENV: "/elsewhere"}
    assert settings.use_kernel_cache(mine) == Path("/elsewhere")
    assert mine[settings.INDUCTOR_CACHE_ENV] == "/elsewhere"  # never overridden
    by_torch = {settings.CACHE_ENV: str(tmp_path),
                settings.INDUCTOR_CACHE_ENV: str(settings.torch_default_kernel_cache())}
    assert settings.use_kernel_cache(by_torch) == inductor
    assert by_torch[settings.INDUCTOR_CACHE_ENV] == str(inductor)
    assert not (tmp_path / "inductor").exists()  # nothing is created
