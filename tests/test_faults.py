"""Fault injection: every defect of the hostile-user review (issue 10), kept fixed.

Each test drives the package the way a user would hit the defect (a dying notebook kernel, a stale
shard copy, sixteen processes appending at once, a DECODE scale, a list as bias, ...) and checks
the behaviour that replaced the hang, the silent wrong result or the raw traceback.

The third round (issue 19) lives in the module tests; each names its case. Index:

=================================  ==============================================================
case                               tests
=================================  ==============================================================
1 file created in DST meanwhile    checkpoint/test_conversion.py ``test_issue19_case1_*``;
                                   checkpoint/test_folders.py ``test_replace_dir_refuses_*``
2 symlink / empty folder foreign   ``test_issue19_case2_*``; test_folders.py ``test_check_target_*``
3 two converts, one DST            ``test_issue19_case3_two_converts_to_one_folder``
4 GPTQ error, half-quantized       execution/test_gptq.py ``test_gptq_nan_hessian_at_layer_2_*``
5 audit passes what load refuses   checkpoint/test_validation.py ``test_audit_refuses_*``,
                                   ``test_disagreeing_*``, ``test_w4a4_config_without_*``,
                                   ``test_load_refuses_the_same_headers_*`` (nested metadata)
6 convert copies invalid tensors   ``test_header_defects_*``, ``test_header_problem_*``,
                                   ``test_invalid_layer_tensors_*``
7 convert drops non-weight files   ``test_issue19_case7_*``
8 degenerate Hessian zeroes layer  test_gptq.py ``test_all_zero_hessian_*``,
                                   ``test_quantize_model_zero_calibration_*``
9 computed scale underflows        test_codec.py ``test_capped_*`` (eager and fused)
10 fake_quantize drops autograd    test_codec.py ``test_fake_quantize_straight_through_*``
11 Ctrl-C during report            test_reports.py ``test_ctrl_c_keeps_the_previous_page_*``
Dask never ran                     checkpoint/test_stream.py
                                   ``test_audit_and_convert_commands_on_dask_*`` (real
                                   ``dask scheduler`` / ``dask worker`` processes)
SIGKILL leaves pool workers        test_stream.py ``test_sigkill_of_the_command_ends_*``
SIGINT tracebacks                  test_cli.py ``test_ctrl_c_is_one_line_exit_130_*``
raw tracebacks, unclear messages   test_validation.py ``test_header_defects_*``,
                                   ``test_config_problems_are_named``; test_conversion.py
                                   ``test_issue19_write_path_messages``,
                                   ``test_issue19_permission_problems_are_named``;
                                   checkpoint/test_verification.py (ModelOpt);
                                   execution/test_gemm.py (``NVFP4LAB_BACKEND``);
                                   bench/test_command.py (plain values);
                                   execution/test_whole_model.py (meta model, second call);
                                   checkpoint/test_files.py (a list as quantization_config)
audit --out writes only csv+html   test_cli.py ``test_audit_out_writes_csv_and_html_only_there``
=================================  ==============================================================

The fourth round (issue 32: any CPU, hostile files, a kernel cache that can break) lives in the
module tests too. ``make test-isa`` runs the CPU-sensitive files again under AVX2-only and
baseline x86-64 settings. Index:

=================================  ==============================================================
case                               tests
=================================  ==============================================================
red on an AMD CPU                  kernels/test_linear.py ``test_no_full_size_*``,
                                   ``test_later_calls_decode_at_most_the_verdicts_rows``,
                                   ``test_taller_tiles_*``; ``make test-isa`` (Makefile);
                                   kernels/test_cache.py ``test_kernels_cached_for_one_*``;
                                   kernels/test_native_isa.py (``NVFP4LAB_NATIVE_ISA``)
1 links out of SRC copied          checkpoint/test_conversion.py ``test_issue32_case1_*``;
                                   test_reader.py ``test_issue32_case1_*``; test_auditing.py
                                   ``test_issue32_cases_1_2_*``; test_writer.py
                                   ``test_issue32_side_files_*``
2 /dev/zero, FIFO, loops           test_conversion.py ``test_issue32_case2_*``; test_folders.py
                                   ``test_issue32_the_one_rule_*``
3 a 2**62-element GGUF array       checkpoint/formats/test_gguf_hostile.py
                                   ``test_a_metadata_array_of_2_62_*``, ``test_counts_the_bytes_*``
4 empty / misshaped tensors        test_gguf_hostile.py ``test_an_nvfp4_tensor_without_elements_*``;
                                   checkpoint/test_hostile_safetensors.py ``test_k_0_*``
5 a million layers                 both hostile files ``test_a_config_of_a_million_layers_*``;
                                   test_hostile_safetensors.py ``test_config_sizes_the_weights_*``
6 JSON 50,000 deep                 ``test_a_config_nested_50000_deep_*`` (GGUF),
                                   ``test_json_nested_50000_deep_*`` (config.json, header)
7 a broken C++ library cache       kernels/test_native_cache.py
8 NVFP4LAB_THREADS=1000000000      test_cli.py ``test_threads_beyond_the_machine_*``;
                                   test_settings.py ``test_torch_threads_rejects_*``,
                                   ``test_run_reports_checks_threads_*``
9 audit, load, convert disagree    test_gguf_hostile.py ``test_files_load_refuses_*``;
                                   checkpoint/test_validation.py ``test_block_scales_load_*``
10 denormal tensor scales          both hostile files ``test_scales_load_refuses_*``
11 a GGUF source that moved        checkpoint/formats/test_gguf_writing.py ``test_a_moved_*``
12 q/k rows of SmolLM3, Granite    test_gguf_writing.py ``test_qk_rows_*``,
                                   ``test_architectures_whose_llama_cpp_graph_*``;
                                   peers/test_llama_cpp_architectures.py (llama.cpp itself)
13 the KV cache dropped on save    checkpoint/test_writer.py ``test_a_quantized_kv_cache_*``
14 the Hugging Face cache layout   ``test_issue32_case14_*`` (conversion, reader, auditing);
                                   test_folders.py ``test_issue32_hf_*``
15 steps a kernel does not know    kernels/test_steps.py; test_blocks.py ``test_an_unknown_*``
Ctrl-C while starting              test_cli.py ``test_ctrl_c_while_starting_*``,
                                   ``test_a_handled_interrupt_exits_130_under_python_m``
the KV cache API                   execution/test_kv_cache.py ``test_zero_rows_*``,
                                   ``test_fp8_e4m3_*``, ``test_scales_whose_reciprocal_*``;
                                   execution/test_attention.py ``test_kv_scales_are_checked_*``
GGUF block-scale bytes, offsets    test_gguf_hostile.py ``test_bad_block_scale_bytes_*``,
                                   ``test_counts_the_bytes_*``
a CT folder that holds a .gguf     ``test_issue32_*format_picks_*`` (reader, auditing);
                                   test_conversion.py ``test_issue32_a_compressed_tensors_*``
token_fidelity's raw errors        studies/test_llm.py ``test_token_ids_beyond_*``,
                                   ``test_a_model_that_is_not_a_causal_lm_*``, ``test_bad_counts_*``
=================================  ==============================================================
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import nbformat
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import nvfp4lab
from nvfp4lab import checkpoint, cli
from nvfp4lab.bench import store
from nvfp4lab.checkpoint import CheckpointError
from nvfp4lab.codec import ScaleUnderflowWarning
from nvfp4lab.execution import NVFP4Linear, UnmatchedIgnoreWarning, quantize_model
from nvfp4lab.tensor import NVFP4Tensor
from tests.checkpoint.builders import copy_checkpoint, tiny_llama

ROOT = Path(__file__).resolve().parent.parent


def _cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> None:
    code, err = _cli(capsys, argv)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# --------------------------------------------------------------------------------------------
# 1. nvfp4lab report must not hang when a notebook's kernel dies; --timeout bounds a notebook


def _notebook(folder: Path, name: str, code: str) -> None:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("SEED = 0\nSMOKE = False\nINTERACTIVE = False")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {name}"), params, nbformat.v4.new_code_cell(code)]
    nbformat.write(nb, folder / f"{name}.ipynb")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dead_kernel_and_stuck_cell_fail_fast_and_the_report_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    _notebook(nbs, "01_sigkill", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    _notebook(nbs, "02_exit", "import os\nos._exit(3)")
    _notebook(nbs, "03_stuck", "import time\ntime.sleep(600)")
    _notebook(nbs, "04_fine", "x = 1")
    out = tmp_path / "out"
    code, err = _cli(
        capsys, ["report", "--notebook-dir", str(nbs), "--out", str(out), "--timeout", "10"]
    )
    assert code == 1 and "failed notebooks: 01_sigkill, 02_exit, 03_stuck" in err
    index = (out / "index.html").read_text()
    assert index.count("kernel died") >= 2 and "timed out" in index
    from nvfp4lab.report import run_reports

    results = {r.name: r for r in run_reports(["01_sigkill", "04_fine"], out, notebook_dir=nbs)}
    assert results["01_sigkill"].error.startswith("kernel died")
    assert results["01_sigkill"].duration_s < 30
    assert results["04_fine"].ok


def test_timeout_must_be_positive(tmp_path: Path) -> None:
    from nvfp4lab.report import run_reports

    with pytest.raises(ValueError, match="--timeout must be a positive"):
        run_reports(out_dir=tmp_path, timeout_s=0)


# --------------------------------------------------------------------------------------------
# 2. checkpoint.load follows the index's weight_map


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_llama()
    quantize_model(model, backend="w4a16", share_global_scale="llama")
    path = tmp_path_factory.mktemp("sharded") / "ckpt"
    checkpoint.save_pretrained(model, path, max_shard_bytes=40_000)
    assert (path / "model.safetensors.index.json").is_file()
    return path


def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def test_load_follows_the_weight_map_over_a_stale_copy(sharded: Path, tmp_path: Path) -> None:
    target = copy_checkpoint(sharded, tmp_path / "c")
    weight_map = _index(target)["weight_map"]
    other, owner = min(weight_map.values()), max(weight_map.values())
    key = next(k for k, f in weight_map.items() if f == owner and k.endswith(".weight_packed"))
    # a stale, all-zero copy of the tensor in a file that sorts before its owner: by file name
    # order (the old reader) the stale copy would win
    stale = load_file(str(target / other))
    stale[key] = torch.zeros_like(load_file(str(target / owner))[key])
    save_file(stale, str(target / other), metadata={"format": "pt"})
    model = checkpoint.load(target, backend="w4a16")
    got = model.get_submodule(key.removesuffix(".weight_packed")).weight_packed
    assert torch.equal(got, load_file(str(target / owner))[key])
    assert got.any()


def test_duplicate_key_without_index_names_both_files(sharded: Path, tmp_path: Path) -> None:
    target = copy_checkpoint(sharded, tmp_path / "c")
    files = sorted(set(_index(target)["weight_map"].values()))
    (target / "model.safetensors.index.json").unlink()
    first = load_file(str(target / files[0]))
    key = next(iter(first))
    second = load_file(str(target / files[1]))
    second[key] = first[key]
    save_file(second, str(target / files[1]), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{re.escape(key)}.*two weight files.*"
                       rf"{re.escape(files[0])}.*{re.escape(files[1])}"):
        checkpoint.load(target)


@pytest.mark.parametrize("escape", ["../outside.safetensors", "/etc/passwd.safetensors"])
def test_weight_map_may_not_leave_the_folder(sharded: Path, tmp_path: Path, escape: str) -> None:
    target = copy_checkpoint(sharded, tmp_path / "c")
    index = _index(target)
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = escape
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        checkpoint.load(target)


# --------------------------------------------------------------------------------------------
# 3. a partial load_state_dict keeps a calibrated input_global_scale


def test_partial_state_dict_keeps_and_reports_input_global_scale() -> None:
    layer = NVFP4Linear.from_linear(nn.Linear(32, 8), backend="emulation")
    layer.set_input_global_scale(123.0)
    x = torch.randn(4, 32)
    before = layer(x)
    state = {k: v for k, v in layer.state_dict().items() if k != "input_global_scale"}
    result = layer.load_state_dict(state, strict=False)
    assert float(layer.input_global_scale) == 123.0
    assert "input_global_scale" in result.missing_keys
    assert torch.equal(layer(x), before)


# --------------------------------------------------------------------------------------------
# 4. quantize_model(ignore="lm_head") ignores lm_head; unmatched entries are reported


def test_a_string_ignore_is_one_pattern() -> None:
    model = nn.Sequential()
    model.add_module("body", nn.Linear(32, 32))
    model.add_module("lm_head", nn.Linear(32, 16))
    report = quantize_model(model, ignore="lm_head", backend="w4a16")
    assert report.replaced_names == ["body"]
    assert isinstance(model.lm_head, nn.Linear) and report.unmatched_ignore == []
    with pytest.warns(UnmatchedIgnoreWarning, match="'lm_haed'"):
        other = quantize_model(nn.Sequential(nn.Linear(32, 32)), ignore=["lm_haed"])
    assert other.unmatched_ignore == ["lm_haed"] and "lm_haed" in str(other)


# --------------------------------------------------------------------------------------------
# 5. results shards: torn last lines, concurrent appends, a reader that names bad lines


def _row(i: int) -> dict[str, object]:
    return {c: "" for c in store.COLUMNS} | {"op": "matmul", "shape": f"{i}x1x16", "M": i,
                                             "N": 1, "K": 16, "median_s": "0.5"}


def test_a_torn_last_line_is_completed_or_refused(tmp_path: Path) -> None:
    shard = tmp_path / "s.csv"
    store.append_rows(shard, [_row(1)])
    whole = shard.read_text()
    shard.write_text(whole.rstrip("\n"))  # a complete row that lost its newline
    store.append_rows(shard, [_row(2)])
    rows = list(csv.DictReader(shard.open()))
    assert [r["M"] for r in rows] == ["1", "2"]
    shard.write_text(whole + "matmul,1x1x16,1,1")  # a row cut short by a crash
    fields = len(store.COLUMNS)
    with pytest.raises(ValueError, match=rf"line 3\) is cut short, 4 of {fields} fields"):
        store.append_rows(shard, [_row(3)])
    assert shard.read_text().endswith("matmul,1x1x16,1,1")  # left as it was


def _append_when_told(shard: Path, go: Path, m: int) -> None:
    """One writer process: wait for ``go``, then append five rows of size ``m``."""
    while not go.exists():
        time.sleep(0.001)
    row = dict.fromkeys(store.COLUMNS, "")
    row.update(op="matmul", M=str(m))
    store.append_rows(shard, [row] * 5)


@pytest.mark.slow
def test_sixteen_processes_appending_at_once(tmp_path: Path) -> None:
    """Sixteen OS processes (forked: each has the store imported already, so the test spends no
    16 interpreter start-ups) append to one new shard at the same moment."""
    import multiprocessing

    shard, go = tmp_path / "s.csv", tmp_path / "go"
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=_append_when_told, args=(shard, go, i)) for i in range(16)]
    for p in procs:
        p.start()
    go.touch()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 16
    lines = list(csv.reader(shard.open()))
    assert lines[0] == list(store.COLUMNS) and lines.count(list(store.COLUMNS)) == 1
    assert len(lines) == 1 + 16 * 5 and all(len(line) == len(store.COLUMNS) for line in lines)
    assert sorted(int(line[store.COLUMNS.index("M")]) for line in lines[1:]) == sorted(
        list(range(16)) * 5)


def test_reader_names_bad_lines_instead_of_crashing(tmp_path: Path) -> None:
    pytest.importorskip("pandas")
    shard = tmp_path / "s.csv"
    store.append_rows(shard, [_row(1), _row(2)])
    with shard.open("a") as fh:  # what the old bugs left: a glued row and a second header
        fh.write(",".join(store.COLUMNS) + "\n")
        fh.write(",".join(["x"] * 34) + "\n")
    with pytest.warns(store.ShardWarning, match=r"line 4 repeats the header.*line 5 has 34"):
        frame = store.read_shards(tmp_path)
    assert list(frame["M"]) == [1, 2]


# --------------------------------------------------------------------------------------------
# 6. save_pretrained never loses unrelated files; empty folders are fine; stale temps go


def test_overwrite_refuses_a_folder_with_other_files(sharded: Path, tmp_path: Path) -> None:
    target = copy_checkpoint(sharded, tmp_path / "c")
    (target / "notes.txt").write_text("mine")
    (target / "train_log.csv").write_text("step,loss\n")
    model = tiny_llama(seed=3)
    quantize_model(model, backend="w4a16")
    with pytest.raises(FileExistsError, match=r"notes\.txt, train_log\.csv.*would be lost"):
        checkpoint.save_pretrained(model, target, overwrite=True)
    assert (target / "notes.txt").read_text() == "mine"
    plain = tmp_path / "file"
    plain.write_text("data")
    with pytest.raises(FileExistsError, match="is a file, not a folder"):
        checkpoint.save_pretrained(model, plain, overwrite=True)
    assert plain.read_text() == "data"
    checkpoint.save_pretrained(model, sharded.parent / "again", overwrite=True)  # missing: ok
    (target / "notes.txt").unlink()
    (target / "train_log.csv").unlink()
    checkpoint.save_pretrained(model, target, overwrite=True)  # a checkpoint folder: replaced


def test_an_existing_empty_folder_needs_no_overwrite(tmp_path: Path) -> None:
    model = tiny_llama()
    quantize_model(model, backend="w4a16")
    import tempfile

    with tempfile.TemporaryDirectory(dir=tmp_path) as empty:
        checkpoint.save_pretrained(model, empty)
        assert (Path(empty) / "config.json").is_file()


def test_a_killed_save_leaves_a_temp_folder_the_next_save_removes(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    code = (
        "import os, sys, pathlib\n"
        "from nvfp4lab.checkpoint.folders import fresh_dir\n"
        "tmp = fresh_dir(pathlib.Path(sys.argv[1]), 'tmp')\n"
        "(tmp / 'model.safetensors').write_bytes(b'half')\n"
        "os._exit(9)\n"  # killed mid-save: no cleanup runs
    )
    subprocess.run([sys.executable, "-c", code, str(target)], cwd=ROOT, check=False)
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")]
    assert len(stale) == 1
    model = tiny_llama()
    quantize_model(model, backend="w4a16")
    checkpoint.save_pretrained(model, target)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert not (target / ".nvfp4lab-owner").exists()


def test_save_errors_name_the_target_not_the_temp_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nvfp4lab.checkpoint import safetensors_files

    model = tiny_llama()
    quantize_model(model, backend="w4a16")

    def broken(filename: object, tensors: object, metadata: object = None) -> None:
        raise OSError(28, f"No space left on device: '{filename}'")

    monkeypatch.setattr(safetensors_files, "write_safetensors", broken)
    target = tmp_path / "ckpt"
    with pytest.raises(OSError) as err:
        checkpoint.save_pretrained(model, target)
    text = str(err.value)
    assert f"saving {target} failed" in text and str(target) in text and ".tmp-" not in text


# --------------------------------------------------------------------------------------------
# 7. a DECODE-form global scale warns instead of silently zeroing everything


def test_decode_convention_scale_warns_and_names_the_fix() -> None:
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    with pytest.warns(ScaleUnderflowWarning, match="decode_to_encode_scale"):
        q = nvfp4lab.quantize(x, 1 / 788)
    assert not q.dequantize().any()  # what it warned about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nvfp4lab.quantize(x, nvfp4lab.decode_to_encode_scale(1 / 788))
        nvfp4lab.quantize(torch.zeros(4, 32), 1.0)  # zeros are fine with any scale


# --------------------------------------------------------------------------------------------
# 8. NaN and negative E4M3 block scales are refused at construction (opt-out for studies)


@pytest.mark.parametrize(("byte", "what"), [(0x7F, "1 NaN and 0 negative"),
                                            (0xB8, "0 NaN and 1 negative")])
def test_invalid_block_scales_are_refused(byte: int, what: str, tmp_path: Path) -> None:
    q = nvfp4lab.quantize(torch.randn(4, 32))
    raw = q.scales.view(torch.uint8).clone()
    raw[1, 1] = byte
    scales = raw.view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=rf"{what}.*index \(1, 1\).*check_scales=False"):
        NVFP4Tensor(packed=q.packed, scales=scales, global_scale=q.global_scale)
    broken = NVFP4Tensor(packed=q.packed, scales=scales, global_scale=q.global_scale,
                         check_scales=False)
    assert broken.dequantize().shape == (4, 32)
    model = tiny_llama()
    quantize_model(model, backend="w4a16")
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    with torch.no_grad():
        layer.weight_scale.view(torch.uint8)[0, 0] = byte
    with pytest.raises(CheckpointError, match="could not be read back"):
        checkpoint.save_pretrained(model, tmp_path / "c")
    assert not (tmp_path / "c").exists()


# --------------------------------------------------------------------------------------------
# 9. float32 checkpoints: warned at save time; verify() runs transformers on a folder


@pytest.mark.slow
def test_float32_checkpoint_warns_and_verify_explains(tmp_path: Path) -> None:
    model = tiny_llama().float()
    quantize_model(model, backend="w4a16")
    with pytest.warns(checkpoint.TransformersDtypeWarning, match=r"dtype=torch\.bfloat16"):
        path = checkpoint.save_pretrained(model, tmp_path / "fp32")
    with pytest.raises(CheckpointError, match=r"transformers cannot run.*dtype=torch\.bfloat16"):
        checkpoint.verify(path)
    ok = checkpoint.verify(path, dtype=torch.bfloat16)
    assert ok.model_class == "LlamaForCausalLM" and ok.output_shape == (1, 8, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("error", checkpoint.TransformersDtypeWarning)
        path16 = checkpoint.save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert checkpoint.verify(path16).dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------
# 10. one-line errors (exit code 2) from the command line


def test_report_out_problems_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _one_line_error(capsys, ["report", "--smoke", "--out", str(a_file)], "is a file")
    _one_line_error(capsys, ["report", "--smoke", "--out", str(a_file / "sub")],
                    "is a file, so no folder")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access",
                        lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    _one_line_error(capsys, ["report", "--smoke", "--out", str(locked)], "not writable")


def test_parameters_cell_syntax_error_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _notebook(tmp_path, "01_broken", "x = 1")
    nb = nbformat.read(tmp_path / "01_broken.ipynb", as_version=4)
    nb.cells[1].source = "SEED = 0\nSMOKE = ("
    nbformat.write(nb, tmp_path / "01_broken.ipynb")
    _one_line_error(capsys, ["report", "--notebook-dir", str(tmp_path), "--out",
                             str(tmp_path / "o")], "01_broken.ipynb", "not valid Python")


def test_bench_unwritable_out_is_refused_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from nvfp4lab.bench import runner

    measured: list[object] = []
    monkeypatch.setattr(runner, "time_fn", lambda *a, **k: measured.append(a))
    _one_line_error(capsys, ["bench", "--tiny", "--out", "/proc/nvfp4lab/x.csv"],
                    "cannot be written")
    monkeypatch.chdir(tmp_path)
    Path("results").write_text("not a folder")  # the default results/ cannot be made
    _one_line_error(capsys, ["bench", "--tiny"], "results", "is a file")
    assert measured == []


def test_info_with_a_bogus_device_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_error(capsys, ["info", "--device", "bogus"], "'bogus' is not a torch device")


def test_bench_refuses_a_shape_that_cannot_fit(capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_error(capsys, ["bench", "--shapes", "1048576x1048576x1048576", "--no-save"],
                    "1048576x1048576x1048576", "GB", "choose smaller --shapes")


# --------------------------------------------------------------------------------------------
# 11. messages that say what is wrong and what to do instead


def test_meta_dequantize_gives_the_shape() -> None:
    q = nvfp4lab.quantize(torch.empty(8, 32, device="meta"))
    out = q.dequantize(torch.bfloat16)
    assert out.device.type == "meta" and out.shape == (8, 32) and out.dtype == torch.bfloat16


def test_to_a_dtype_points_to_dequantize() -> None:
    q = nvfp4lab.quantize(torch.randn(4, 32))
    with pytest.raises(TypeError, match=r"moves the tensor between devices.*dequantize\("):
        q.to(torch.float16)


def test_a_list_bias_is_named() -> None:
    q = nvfp4lab.quantize(torch.randn(4, 32))
    with pytest.raises(TypeError, match=r"bias must be a torch.Tensor of shape \[4\].*got list"):
        nvfp4lab.linear(torch.randn(2, 32), q, [0.0] * 4, backend="w4a16")


def test_nvfp4_tensors_compare_exactly() -> None:
    x = torch.randn(4, 32)
    a, b = nvfp4lab.quantize(x), nvfp4lab.quantize(x)
    assert a == b
    assert not a != b  # noqa: SIM202  (both operators are defined)
    assert a != nvfp4lab.quantize(x * 2)
    assert a != nvfp4lab.quantize(x, hadamard=0)
    assert nvfp4lab.quantize(x, hadamard=1) != nvfp4lab.quantize(x, hadamard=2)
    with pytest.raises(TypeError, match="unhashable"):
        hash(a)


def test_a_finished_save_leaves_only_the_checkpoint(tmp_path: Path) -> None:
    model = tiny_llama()
    quantize_model(model, backend="w4a16")
    checkpoint.save_pretrained(model, tmp_path / "c")
    names = {p.name for p in tmp_path.rglob("*")}
    assert not any(n.startswith(".c.") or n == ".nvfp4lab-owner" for n in names)
