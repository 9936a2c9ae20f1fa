"""checkpoint.convert: lossless CT <-> ModelOpt conversion, streamed and atomic."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError, conversion, detect_format
from nvfp4lab.checkpoint.safetensors_files import read_header
from nvfp4lab.execution import quantize_model
from nvfp4lab.vocab import CheckpointFormat
from tests.checkpoint.builders import file_tensors, raw, tiny_llama, token_batches
from tests.checkpoint.hf_cache import LFS_POINTER, hf_cache_layout, sharded_checkpoint
from tests.processes import one_line_error

CT_TO_MO = {"weight_packed": "weight", "weight_scale": "weight_scale",
            "weight_global_scale": "weight_scale_2", "input_global_scale": "input_scale"}


def _mo_key(key: str) -> str:
    prefix, _, leaf = key.rpartition(".")
    return f"{prefix}.{CT_TO_MO[leaf]}" if leaf in CT_TO_MO else key


def _f32_reciprocal(x: float) -> float:
    return float(np.float32(1) / np.float32(x))


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_ct_to_modelopt_to_ct(ct_w4a4_checkpoint: Path, tmp_path: Path) -> None:
    original = file_tensors(ct_w4a4_checkpoint)
    to_mo = checkpoint.convert(ct_w4a4_checkpoint, tmp_path / "mo", format="modelopt", workers=0)
    mo = file_tensors(tmp_path / "mo")
    assert set(mo) == {_mo_key(k) for k in original}
    bad = []
    for key, value in original.items():
        new = mo[_mo_key(key)]
        if key.endswith("global_scale"):  # ENCODE [1] -> DECODE [] = fl32(1/x)
            assert new.shape == () and new.item() == _f32_reciprocal(value.item()), key
            if _f32_reciprocal(new.item()) != value.item():
                bad.append(_mo_key(key))
        else:
            assert new.dtype == value.dtype and torch.equal(raw(new), raw(value)), key
    assert sorted(to_mo.not_round_trip) == sorted(bad)
    assert to_mo.scales == sum(k.endswith("global_scale") for k in original) == 28
    back = checkpoint.convert(tmp_path / "mo", tmp_path / "ct", format="compressed-tensors",
                              workers=0)
    again = file_tensors(tmp_path / "ct")
    assert again.keys() == original.keys()
    changed = [k for k in original if not torch.equal(raw(again[k]), raw(original[k]))]
    assert sorted(_mo_key(k) for k in changed) == sorted(bad)  # only the reciprocal ones
    assert all(k.endswith("global_scale") for k in changed)
    assert back.not_round_trip == ()  # fl32(1/x) values always come back
    assert checkpoint.verify(tmp_path / "ct").model_class == "LlamaForCausalLM"


def test_converted_checkpoint_loads_with_the_same_codes(ct_w4a4_checkpoint: Path,
                                                        tmp_path: Path) -> None:
    checkpoint.convert(ct_w4a4_checkpoint, tmp_path / "mo", format="modelopt", workers=0)
    ct, mo = checkpoint.load(ct_w4a4_checkpoint), checkpoint.load(tmp_path / "mo")
    name = "model.layers.1.self_attn.v_proj"
    a, b = ct.get_submodule(name), mo.get_submodule(name)
    assert torch.equal(a.weight_packed, b.weight_packed)
    assert torch.equal(raw(a.weight_scale), raw(b.weight_scale))
    assert torch.equal(b.weight_decode_scale, torch.reciprocal(a.weight_global_scale))
    with torch.no_grad():
        ids = token_batches(1, seed=9)[0]
        la, lb = ct(ids).logits.float(), mo(ids).logits.float()
    assert torch.allclose(la, lb, rtol=0.02, atol=0.02)


def test_sharded_checkpoint_keeps_its_shards(tmp_path: Path) -> None:
    model = tiny_llama(seed=2)
    quantize_model(model, backend="w4a16", share_global_scale="llama")
    checkpoint.save_pretrained(model, tmp_path / "ct", max_shard_bytes=12_000)
    shards = sorted(p.name for p in (tmp_path / "ct").glob("*.safetensors"))
    assert len(shards) > 2
    checkpoint.convert(tmp_path / "ct", tmp_path / "mo", format="modelopt", workers=2)
    assert sorted(p.name for p in (tmp_path / "mo").glob("*.safetensors")) == shards
    index = json.loads((tmp_path / "mo" / "model.safetensors.index.json").read_text())
    src = json.loads((tmp_path / "ct" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {_mo_key(k): v for k, v in src["weight_map"].items()}
    assert index["metadata"]["total_size"] == src["metadata"]["total_size"]
    for shard in shards:
        keys = set(read_header(tmp_path / "mo" / shard)[1]) - {"__metadata__"}
        assert keys == {k for k, v in index["weight_map"].items() if v == shard}
    assert checkpoint.load(tmp_path / "mo") is not None


def test_same_bytes_in_process_pool_and_inline(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "a", format="modelopt", workers=0)
    checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "b", format="modelopt", workers=2)
    a, b = (tmp_path / "a" / "model.safetensors"), (tmp_path / "b" / "model.safetensors")
    assert a.read_bytes() == b.read_bytes()


def test_overwrite_rules(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    dst = tmp_path / "mo"
    checkpoint.convert(nvfp4lab_checkpoint, dst, format="modelopt", workers=0)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        checkpoint.convert(nvfp4lab_checkpoint, dst, format="modelopt", workers=0)
    checkpoint.convert(nvfp4lab_checkpoint, dst, format="modelopt", overwrite=True, workers=0)
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        checkpoint.convert(nvfp4lab_checkpoint, dst, format="modelopt", overwrite=True,
                           workers=0)
    assert (dst / "notes.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="overlaps the source"):
        checkpoint.convert(nvfp4lab_checkpoint, nvfp4lab_checkpoint / "x", format="modelopt")
    with pytest.raises(CheckpointError, match="already a compressed-tensors checkpoint"):
        checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "same", format="compressed-tensors")
    with pytest.raises(ValueError, match="unknown format"):
        checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "x", format="awq")
    with pytest.raises(FileNotFoundError):
        checkpoint.convert(tmp_path / "nope", tmp_path / "y", format="modelopt")
    assert _leftovers(tmp_path) == []


def test_a_failure_leaves_nothing(nvfp4lab_checkpoint: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> object:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(conversion, "_write_weights", broken)
    with pytest.raises(OSError, match="nothing was written"):
        checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "mo", format="modelopt", workers=0)
    assert list(tmp_path.iterdir()) == []


def _bad_task_options() -> list[tuple[str, dict, str]]:
    """(format, options, the error) for every format of the registry: a negative worker count
    for each; workers or a Dask address for each format written in this process."""
    from nvfp4lab.checkpoint.formats import FORMATS

    cases = [(fmt.value, {"workers": -3},
              "workers must be an int >= 0 (0 = in this process), got -3") for fmt in FORMATS]
    for fmt, spec in FORMATS.items():
        if not spec.writes_in_tasks:
            said = f"{spec.title} is written in this process: workers and dask"
            cases += [(fmt.value, {"workers": 2}, said), (fmt.value, {"dask": "nohost:9"}, said)]
    return cases


@pytest.mark.parametrize(("fmt", "options", "expected"), _bad_task_options())
def test_workers_and_dask_are_checked_before_anything_is_read(
    nvfp4lab_checkpoint: Path, ct_w4a4_checkpoint: Path, tmp_path: Path, fmt: str,
    options: dict, expected: str
) -> None:
    """A probe found `convert --format gguf --workers -3` (or `--dask nohost:9`) exiting 0: the
    values were only checked by the task runner, which GGUF output never uses."""
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        conversion.convert(nvfp4lab_checkpoint, tmp_path / "out", format=fmt, **options)
    assert not (tmp_path / "out").exists()
    # FP-Quant holds W4A4 only: the W4A4 checkpoint for it
    source = ct_w4a4_checkpoint if fmt == CheckpointFormat.FP_QUANT else nvfp4lab_checkpoint
    if detect_format(source) != fmt:  # and the same call without them converts
        conversion.convert(source, tmp_path / "ok", format=fmt, workers=0)


def test_the_bad_task_options_cover_an_in_process_format() -> None:
    """The cases above are drawn from the registry: GGUF, written in this process, is among
    them with workers and with a Dask address."""
    cases = {(fmt, tuple(options)) for fmt, options, _ in _bad_task_options()}
    assert {("gguf", ("workers",)), ("gguf", ("dask",)), ("modelopt", ("workers",))} <= cases


def test_every_format_says_whether_it_writes_in_tasks() -> None:
    from nvfp4lab.checkpoint.formats import FORMATS

    assert all(isinstance(spec.writes_in_tasks, bool) for spec in FORMATS.values())
    known = {"compressed-tensors": True, "modelopt": True, "gguf": False}
    assert {f: FORMATS[CheckpointFormat(f)].writes_in_tasks for f in known} == known


def test_reciprocal_round_trip_rate() -> None:
    """The fraction the reports quote: about 14% of float32 values (log-uniform over many
    binades) do not survive 1/(1/x); the counter agrees with numpy's float32 arithmetic."""
    rng = np.random.default_rng(0)
    values = (2.0 ** rng.uniform(-20, -5, 20_000)).astype(np.float32)
    fails = sum(not conversion.reciprocal_round_trips(float(v)) for v in values)
    exact = np.float32(1) / (np.float32(1) / values) != values
    assert fails == int(exact.sum())
    assert 0.12 < fails / len(values) < 0.16


# --------------------------------------------------------------------------------------------
# issue 19: what the convert write path must never lose, run as users run it (a subprocess)

ROOT = Path(__file__).resolve().parents[2]

#: Runs ``python -m nvfp4lab`` (runpy, the same entry) after ``PATCH``; argv: patch, args...
_RUN = ("import runpy, sys\n"
        "exec(sys.argv[1])\n"
        "sys.argv = ['nvfp4lab', *sys.argv[2:]]\n"
        "runpy.run_module('nvfp4lab', run_name='__main__', alter_sys=True)\n")


def _convert_cli(*args: object, patch: str = "", prefix: tuple[str, ...] = ()
                 ) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "nvfp4lab"] if not patch else [sys.executable, "-c", _RUN, patch]
    return subprocess.run([*prefix, *argv, "convert", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _convert_here(capfd: pytest.CaptureFixture[str], *args: object
                  ) -> subprocess.CompletedProcess[str]:
    """``nvfp4lab convert ARGS`` in this process (:func:`tests.processes.cli_here`)."""
    from tests import processes

    return processes.cli_here(["convert", *map(str, args)], capfd)


@pytest.mark.parametrize("overwrite", [False, True])
def test_issue19_case1_a_file_created_while_converting_survives(
        nvfp4lab_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        overwrite: bool) -> None:
    """issue 19 case 1: DST/notes.txt appears between the start's check and the final swap."""
    dst = tmp_path / "mo"
    if overwrite:  # an old checkpoint there, which --overwrite may replace, and nothing else
        checkpoint.convert(nvfp4lab_checkpoint, dst, format="modelopt", workers=0)
    before = {p.name: p.read_bytes() for p in dst.iterdir()} if overwrite else {}
    real = conversion._copy_side_files

    def meanwhile(*args: object) -> None:
        real(*args)
        dst.mkdir(exist_ok=True)
        (dst / "notes.txt").write_text("mine")

    monkeypatch.setattr(conversion, "_copy_side_files", meanwhile)
    with pytest.raises(FileExistsError, match=r"changed while .*notes\.txt.*left as it is"):
        checkpoint.convert(nvfp4lab_checkpoint, dst, format="modelopt", overwrite=overwrite,
                           workers=0)
    assert (dst / "notes.txt").read_text() == "mine"
    after = {p.name: p.read_bytes() for p in dst.iterdir() if p.name != "notes.txt"}
    assert after == before  # the old checkpoint is back untouched (or there was none)
    assert _leftovers(tmp_path) == []


def test_issue19_case1_the_cli_refuses_in_one_line(nvfp4lab_checkpoint: Path,
                                                    tmp_path: Path) -> None:
    """issue 19 case 1, through the command line: exit 2, one line, the file kept."""
    dst = tmp_path / "mo"
    patch = ("from pathlib import Path\n"
             "from nvfp4lab.checkpoint import conversion\n"
             "real = conversion._copy_side_files\n"
             "def meanwhile(*a):\n"
             "    real(*a)\n"
             f"    Path({str(dst)!r}).mkdir()\n"
             f"    Path({str(dst)!r}, 'notes.txt').write_text('mine')\n"
             "conversion._copy_side_files = meanwhile\n")
    done = _convert_cli(nvfp4lab_checkpoint, dst, "--format", "modelopt", patch=patch)
    one_line_error(done, str(dst), "changed while", "notes.txt")
    assert (dst / "notes.txt").read_text() == "mine" and len(list(dst.iterdir())) == 1
    assert _leftovers(tmp_path) == []


def test_issue19_case2_overwrite_lists_symlinks_and_empty_folders(nvfp4lab_checkpoint: Path,
                                                                  tmp_path: Path) -> None:
    """issue 19 case 2: --overwrite must not delete a symlink or an empty folder unlisted."""
    dst = tmp_path / "mo"
    checkpoint.convert(nvfp4lab_checkpoint, dst, format="modelopt", workers=0)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "data.csv").write_text("1,2\n")
    (dst / "mydata").symlink_to(tmp_path / "elsewhere")
    (dst / "runs").mkdir()
    done = _convert_cli(nvfp4lab_checkpoint, dst, "--format", "modelopt", "--overwrite")
    one_line_error(done, "mydata (symlink)", "runs (empty folder)", "move them away")
    assert (dst / "mydata").is_symlink() and (dst / "runs").is_dir()
    assert (tmp_path / "elsewhere" / "data.csv").read_text() == "1,2\n"


def test_issue19_case3_two_converts_to_one_folder(nvfp4lab_checkpoint: Path,
                                                  tmp_path: Path) -> None:
    """issue 19 case 3: two converts to the same new DST at once; both pass the start's check
    (a barrier holds each after it until both got there), so only the swap can tell."""
    dst = tmp_path / "mo"
    barrier = ("import time\n"
               "from pathlib import Path\n"
               "from nvfp4lab.checkpoint import conversion\n"
               "real = conversion.inventory\n"
               "def held(*a, **k):\n"
               f"    Path({str(tmp_path)!r}, 'ready-' + {{}}).touch()\n"
               f"    while len(list(Path({str(tmp_path)!r}).glob('ready-*'))) < 2:\n"
               "        time.sleep(0.01)\n"
               "    return real(*a, **k)\n"
               "conversion.inventory = held\n")
    procs = [subprocess.Popen([sys.executable, "-c", _RUN, barrier.format(repr(str(i))),
                               "convert", str(nvfp4lab_checkpoint), str(dst), "--format",
                               "modelopt"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    done = [subprocess.CompletedProcess(p.args, p.wait(timeout=300), *p.communicate())
            for p in procs]
    codes = sorted(d.returncode for d in done)
    assert codes == [0, 2], [(d.returncode, d.stderr) for d in done]
    one_line_error(next(d for d in done if d.returncode), str(dst), "changed while")
    assert checkpoint.load(dst) is not None  # the winner's checkpoint, whole
    assert _leftovers(tmp_path) == []


def test_issue19_case7_convert_copies_everything_that_is_not_a_weight(
        nvfp4lab_checkpoint: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """issue 19 case 7: README, auto_map code, processor config, sub-folders come along (the
    first convert as a command, the others through cli.main in this process)."""
    src = tmp_path / "src"
    shutil.copytree(nvfp4lab_checkpoint, src)
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}
    (src / "config.json").write_text(json.dumps(config))
    extra = {"README.md": b"# my model\n", "modeling_tiny.py": b"class TinyForCausalLM: ...\n",
             "preprocessor_config.json": b"{}", "1_Pooling/config.json": b'{"mean": true}',
             "deep/er/blob.bin": bytes(range(256)), ".gitattributes": b"*.bin lfs\n"}
    for rel, data in extra.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    (src / "2_Normalize").mkdir()
    (src / "licenses").mkdir()
    (src / "licenses" / "MIT.txt").write_bytes(b"licence text")
    (src / "LICENSE").symlink_to("licenses/MIT.txt")  # a link inside the folder: its file
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref")
    mo = tmp_path / "mo"
    done = _convert_cli(src, mo, "--format", "modelopt")
    assert done.returncode == 0, done.stderr
    # the extras, 2_Normalize/, LICENSE, licenses/MIT.txt and the source's generation_config.json
    assert f"{len(extra) + 4} other files copied byte for byte" in done.stdout
    for rel, data in {**extra, "LICENSE": b"licence text"}.items():
        assert (mo / rel).read_bytes() == data, rel
    assert (mo / "2_Normalize").is_dir() and not (mo / "LICENSE").is_symlink()
    assert not (mo / ".git").exists()
    assert json.loads((mo / "config.json").read_text())["auto_map"] == config["auto_map"]
    back = tmp_path / "ct"  # the way back leaves ModelOpt's own config behind
    assert _convert_here(capfd, mo, back, "--format", "compressed-tensors").returncode == 0
    assert not (back / "hf_quant_config.json").exists() and (back / "README.md").is_file()
    again = _convert_here(capfd, mo, back, "--format", "compressed-tensors", "--overwrite")
    assert again.returncode == 0, again.stderr  # what convert copied is part of the checkpoint
    (src / "linked").symlink_to(tmp_path)
    one_line_error(_convert_here(capfd, src, tmp_path / "x", "--format", "modelopt"),
                   f"linked -> {tmp_path} (outside the checkpoint folder; a folder)")


def test_issue19_write_path_messages(nvfp4lab_checkpoint: Path, tmp_path: Path,
                                     capfd: pytest.CaptureFixture[str]) -> None:
    """issue 19, write path: a parent that is a file is named, no '[Errno 17]'."""
    (tmp_path / "afile").write_text("data")
    done = _convert_here(capfd, nvfp4lab_checkpoint, tmp_path / "afile" / "dst", "--format",
                         "modelopt")
    line = one_line_error(done, f"{tmp_path / 'afile'} is a file")
    assert "Errno" not in line and (tmp_path / "afile").read_text() == "data"


def _as_user() -> tuple[str, ...]:
    """A prefix that makes permissions count (root without its override capabilities)."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: permissions cannot be tested")
    return ("setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner")


def test_issue19_permission_problems_are_named(nvfp4lab_checkpoint: Path,
                                               tmp_path: Path) -> None:
    """issue 19, write path: permission problems say so and name the path; an unreadable DST
    is not taken for an empty one."""
    prefix = _as_user()
    closed = tmp_path / "closed"
    closed.mkdir()
    closed.chmod(0o555)
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "notes.txt").write_text("mine")
    locked.chmod(0)
    try:
        line = one_line_error(_convert_cli(nvfp4lab_checkpoint, closed / "dst", "--format",
                                           "modelopt", prefix=prefix), "permission denied",
                              f"in {closed}")
        assert ".tmp-" not in line
        one_line_error(_convert_cli(nvfp4lab_checkpoint, locked, "--format", "modelopt",
                                    prefix=prefix), f"{locked}: permission denied")
    finally:
        closed.chmod(0o755)
        locked.chmod(0o755)
    assert [p.name for p in locked.iterdir()] == ["notes.txt"]
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------
# issue 32: source folders from strangers (links out of the folder, devices, FIFOs, the Hugging
# Face cache layout, a folder holding two formats), run as users run them (a subprocess)


def _bounded_cli(*args: object) -> subprocess.CompletedProcess[str]:
    """``nvfp4lab convert ARGS`` in a subprocess that may write no file over 64 MiB (a copy of
    ``/dev/zero`` ends in SIGXFSZ instead of filling the disk)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))

    return subprocess.run([sys.executable, "-m", "nvfp4lab", "convert", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          preexec_fn=limit)


@pytest.fixture(scope="module")
def modelopt_checkpoint(nvfp4lab_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                        ) -> Path:
    out = tmp_path_factory.mktemp("mo") / "mo"
    checkpoint.convert(nvfp4lab_checkpoint, out, format="modelopt", workers=0)
    return out


@pytest.mark.parametrize("target", [f.value for f in CheckpointFormat])
def test_issue32_case1_links_out_of_the_source_are_refused_before_writing(
        nvfp4lab_checkpoint: Path, modelopt_checkpoint: Path, tmp_path: Path,
        target: str) -> None:
    """issue 32 case 1: README.md -> /etc/hostname, sub/notes.txt -> /etc/passwd and a relative
    ../../../secret were copied into DST; every one is listed and nothing is written."""
    same = detect_format(nvfp4lab_checkpoint) == target  # convert needs another format
    base = modelopt_checkpoint if same else nvfp4lab_checkpoint
    src = tmp_path / "src"
    shutil.copytree(base, src)
    (tmp_path / "secret").write_text("my private key")
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "README.md").symlink_to("/etc/hostname")
    (src / "sub" / "notes.txt").symlink_to("/etc/passwd")
    (src / "sub" / "deeper" / "secret").symlink_to("../../../secret")
    dst = tmp_path / "dst"
    line = one_line_error(_bounded_cli(src, dst, "--format", target), f"{src}: 3 entries",
                          "README.md -> /etc/hostname (outside the checkpoint folder)",
                          "sub/notes.txt -> /etc/passwd (outside the checkpoint folder)",
                          f"sub/deeper/secret -> ../../../secret = {tmp_path / 'secret'} (outside")
    assert "replace each with a regular file" in line
    assert not dst.exists() and _leftovers(tmp_path) == []


def test_issue32_case2_devices_fifos_and_loops_are_refused(nvfp4lab_checkpoint: Path,
                                                          tmp_path: Path) -> None:
    """issue 32 case 2: a link to /dev/zero was copied until the disk was full; a FIFO, a link
    loop and a device are refused by the same rule, before anything is written."""
    src = tmp_path / "src"
    shutil.copytree(nvfp4lab_checkpoint, src)
    (src / "zero").symlink_to("/dev/zero")
    os.mkfifo(src / "pipe")
    (src / "sub").mkdir()
    (src / "sub" / "loop").symlink_to("loop")
    dst = tmp_path / "dst"
    one_line_error(_bounded_cli(src, dst, "--format", "modelopt"), f"{src}: 3 entries",
                   "pipe (a named pipe)", "sub/loop -> loop (a symlink loop)",
                   "zero -> /dev/zero (outside the checkpoint folder; a character device)")
    assert not dst.exists() and _leftovers(tmp_path) == []


def test_issue32_case14_a_hugging_face_cache_snapshot_converts_to_real_files(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """issue 32 case 14: the snapshot of a sharded checkpoint in the Hugging Face cache layout
    (every file a link ../../blobs/<hash>) converts as the plain folder does, into real files;
    the models--* folder itself reads at refs/main's snapshot."""
    plain = sharded_checkpoint(tmp_path / "plain", seed=4)
    (plain / "README.md").write_text("# tiny\n")
    snapshot = hf_cache_layout(plain, tmp_path / "hub")
    done = _convert_cli(snapshot, tmp_path / "mo", "--format", "modelopt")
    assert done.returncode == 0, done.stderr
    checkpoint.convert(plain, tmp_path / "want", format="modelopt", workers=0)
    got = {p.relative_to(tmp_path / "mo"): p for p in (tmp_path / "mo").rglob("*")}
    assert not any(p.is_symlink() for p in got.values())
    want = {p.relative_to(tmp_path / "want"): p.read_bytes()
            for p in (tmp_path / "want").rglob("*")}
    assert {rel: p.read_bytes() for rel, p in got.items()} == want
    assert (tmp_path / "mo" / "README.md").read_text() == "# tiny\n"
    repo = snapshot.parent.parent
    assert _convert_here(capfd, repo, tmp_path / "gg", "--format", "gguf").returncode == 0
    checkpoint.convert(plain, tmp_path / "gg-want", format="gguf")
    assert not (tmp_path / "gg" / "model.gguf").is_symlink()
    assert ((tmp_path / "gg" / "model.gguf").read_bytes()
            == (tmp_path / "gg-want" / "model.gguf").read_bytes())


def test_issue32_a_compressed_tensors_folder_with_a_gguf_file(
        nvfp4lab_checkpoint: Path, unshared_checkpoint: Path, tmp_path: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    """issue 32: a compressed-tensors folder that also holds a .gguf file (or an un-fetched
    git-LFS pointer named so) was unreadable; --from picks the format and the error says so."""
    both = tmp_path / "both"
    shutil.copytree(nvfp4lab_checkpoint, both)
    checkpoint.convert(unshared_checkpoint, tmp_path / "other", format="gguf")  # other bytes
    shutil.copy(tmp_path / "other" / "model.gguf", both / "model.gguf")
    one_line_error(_convert_cli(both, tmp_path / "x", "--format", "modelopt"),
                   f"{both} looks like several checkpoint formats at once (compressed-tensors and "
                   "gguf)", "--from compressed-tensors or --from gguf")
    done = _convert_here(capfd, both, tmp_path / "gg", "--format", "gguf", "--from",
                         "compressed-tensors")
    assert done.returncode == 0, done.stderr
    checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "want", format="gguf")
    assert ((tmp_path / "gg" / "model.gguf").read_bytes()  # written, not the stale file
            == (tmp_path / "want" / "model.gguf").read_bytes())
    done = _convert_here(capfd, both, tmp_path / "ct", "--format", "compressed-tensors",
                         "--from", "gguf")
    assert done.returncode == 0, done.stderr
    (both / "model.gguf").write_bytes(LFS_POINTER)
    pointer = f"{both / 'model.gguf'} is an un-fetched git-LFS pointer"
    one_line_error(_convert_here(capfd, both, tmp_path / "y", "--format", "modelopt"),
                   "several checkpoint formats at once", pointer, "run git lfs pull",
                   "--from compressed-tensors or --from gguf")
    one_line_error(_convert_here(capfd, both, tmp_path / "y", "--format", "modelopt", "--from",
                                 "gguf"), pointer)
    report = checkpoint.convert(both, tmp_path / "y", format="modelopt",
                                source_format="compressed-tensors")
    assert "model.gguf" not in report.copied and not (tmp_path / "y" / "model.gguf").exists()
    with pytest.raises(CheckpointError, match="source_format='compressed-tensors' or "
                                              "source_format='gguf'"):
        checkpoint.convert(both, tmp_path / "z", format="modelopt")


def test_issue32_a_gguf_file_of_any_name_beside_the_source_is_not_copied(
        nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    """issue 32: a compressed-tensors folder read with source_format= that also holds a .gguf
    file not named model.gguf (tiny-Q4.GGUF) gave an output folder holding two formats again,
    which load refused ("several checkpoint formats at once"); top-level .gguf files are
    weights of another format, left out as the source's other weight files are."""
    src = tmp_path / "src"
    shutil.copytree(nvfp4lab_checkpoint, src)
    checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "gg", format="gguf")
    shutil.copy(tmp_path / "gg" / "model.gguf", src / "tiny-Q4.GGUF")
    (src / "notes").mkdir()
    shutil.copy(tmp_path / "gg" / "model.gguf", src / "notes" / "kept.gguf")  # not top-level
    report = checkpoint.convert(src, tmp_path / "mo", format="modelopt",
                                source_format="compressed-tensors")
    assert "tiny-Q4.GGUF" not in report.copied and "notes/kept.gguf" in report.copied
    assert not (tmp_path / "mo" / "tiny-Q4.GGUF").exists()
    assert checkpoint.load(tmp_path / "mo") is not None  # one format: detected, no format=
