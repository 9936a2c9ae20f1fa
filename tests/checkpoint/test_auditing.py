"""checkpoint.audit: each check against an independent computation, on checkpoints made to have
(or not have) each defect; the same table inline, on a process pool and on a Dask cluster."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

import nvfp4lab
from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError, auditing
from nvfp4lab.execution.dispatch import select_backend
from nvfp4lab.execution.shared_scales import merge_error
from nvfp4lab.layout import swizzle_scales
from tests.checkpoint.builders import copy_checkpoint, file_tensors, tiny_llama
from tests.checkpoint.hf_cache import LFS_POINTER, hf_cache_layout, sharded_checkpoint
from tests.processes import ROOT, child_env, cli_here, one_line_error

Q = "model.layers.0.self_attn.q_proj"


def _row(df: pd.DataFrame, layer: str) -> pd.Series:
    return df.set_index("layer").loc[layer]


def _edit(path: Path, **tensors: torch.Tensor) -> None:
    stored = file_tensors(path)
    stored.update(tensors)
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})


def _single_layer(path: Path, weight: torch.Tensor, *, swizzle: bool = False) -> Path:
    """A one-layer compressed-tensors checkpoint ``layer`` holding ``weight`` quantized."""
    from compressed_tensors.compressors import ModelCompressor

    q = nvfp4lab.quantize(weight)
    scales = swizzle_scales(q.scales) if swizzle else q.scales
    path.mkdir()
    save_file({"layer.weight_packed": q.packed, "layer.weight_scale": scales,
               "layer.weight_global_scale": q.global_scale}, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    config = checkpoint.quantization_config("NVFP4A16")
    ModelCompressor(quantization_config=config).update_config(str(path))
    return path


def test_unshared_fused_scales_are_flagged_with_their_cost(unshared_checkpoint: Path) -> None:
    df = checkpoint.audit(unshared_checkpoint, workers=0)
    model = checkpoint.load(unshared_checkpoint)
    for parent, group in (("model.layers.0.self_attn", ("q_proj", "k_proj", "v_proj")),
                          ("model.layers.1.mlp", ("gate_proj", "up_proj"))):
        names = [f"{parent}.{m}" for m in group]
        shards = {n: model.get_submodule(n).weight_nvfp4() for n in names}
        for want in merge_error(shards, "compressed-tensors"):
            row = _row(df, want.shard)
            assert row["fused_group"] == "/".join(group) and not row["fused_shared"]
            assert row["merge_factor"] == pytest.approx(want.factor, rel=1e-12)
            assert row["merge_sqnr_db"] == pytest.approx(want.weight_sqnr_db, rel=1e-9)
            assert ("unshared tensor scales" in row["issues"]) == (want.factor != 1.0)
    assert df["issues"].str.contains("unshared").sum() >= 4


def test_a_shared_checkpoint_is_clean(nvfp4lab_checkpoint: Path) -> None:
    df = checkpoint.audit(nvfp4lab_checkpoint, workers=0)
    assert list(df["issues"]) == [""] * len(df) == [""] * 14
    fused = df.dropna(subset=["fused_group"])
    assert len(fused) == 10 and fused["fused_shared"].all()
    assert (df["scale_form"] == "encode").all() and (df["nan_scales"] == 0).all()


def test_backend_columns_are_select_backends(nvfp4lab_checkpoint: Path) -> None:
    df = checkpoint.audit(nvfp4lab_checkpoint, workers=0, gpus=("H100 SXM", "B200"))
    for gpu in ("H100 SXM", "B200"):
        c = select_backend(gpu=gpu, scheme="NVFP4A16", env={})
        assert set(df[f"vllm 0.33.0 on {gpu}"]) == {f"{c.numerics} ({c.kernel})"}


def test_a_scale_in_the_wrong_convention_is_flagged(nvfp4lab_checkpoint: Path,
                                                    tmp_path: Path) -> None:
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "ct")
    gs = file_tensors(path)[f"{Q}.weight_global_scale"]
    _edit(path, **{f"{Q}.weight_global_scale": torch.reciprocal(gs)})
    df = checkpoint.audit(path, workers=0)
    assert "looks like an DECODE scale stored where the ENCODE" in _row(df, Q)["issues"]
    assert (df["issues"] != "").sum() == 1
    mo = tmp_path / "mo"
    checkpoint.convert(nvfp4lab_checkpoint, mo, format="modelopt", workers=0)
    d = file_tensors(mo)[f"{Q}.weight_scale_2"]
    _edit(mo, **{f"{Q}.weight_scale_2": torch.reciprocal(d)})
    row = _row(checkpoint.audit(mo, workers=0), Q)
    assert "looks like an ENCODE scale stored where the DECODE" in row["issues"]


def test_reference_sqnr_and_convention(tmp_path: Path) -> None:
    from nvfp4lab.execution import quantize_model

    float_model, model = tiny_llama(seed=4), tiny_llama(seed=4)
    float_model.save_pretrained(tmp_path / "float")
    quantize_model(model, backend="w4a16")
    checkpoint.save_pretrained(model, tmp_path / "ct")
    df = checkpoint.audit(tmp_path / "ct", reference=tmp_path / "float", workers=0)
    for name in (Q, "model.layers.1.mlp.down_proj"):
        w = float_model.get_submodule(name).weight.detach().double()
        q = model.get_submodule(name).weight_nvfp4().dequantize(torch.float32).double()
        want = 10 * math.log10(float((w * w).sum()) / float(((w - q) ** 2).sum()))
        assert _row(df, name)["weight_sqnr_db"] == pytest.approx(want, rel=1e-12)
        assert _row(df, name)["reference_amax"] == float(w.abs().max())
    assert df["weight_sqnr_db"].between(18, 23).all() and (df["issues"] == "").all()
    gs = file_tensors(tmp_path / "ct")[f"{Q}.weight_global_scale"]
    _edit(tmp_path / "ct", **{f"{Q}.weight_global_scale": torch.reciprocal(gs)})
    issues = _row(checkpoint.audit(tmp_path / "ct", reference=tmp_path / "float", workers=0),
                  Q)["issues"]
    assert "matches it only in the other form" in issues and "weight SQNR" in issues


def test_swizzled_scales_are_detected(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = 2.0 ** (torch.rand(256, 1, generator=gen) * 6 - 3)
    cols = 2.0 ** (torch.rand(1, 512, generator=gen) * 4 - 2)
    structured = torch.randn(256, 512, generator=gen) * rows * cols
    plain = auditing.audit_rows(_single_layer(tmp_path / "plain", structured), workers=0)[0]
    assert plain["issues"] == "" and plain["layout_r2"] > 0.5
    swz = auditing.audit_rows(_single_layer(tmp_path / "swz", structured, swizzle=True),
                              workers=0)[0]
    assert "look swizzled" in swz["issues"]
    assert swz["layout_r2_unswizzled"] == pytest.approx(plain["layout_r2"])
    iid = torch.randn(256, 512, generator=gen)
    for name, flag in (("iid", False), ("iid_swz", True)):  # no structure: never flagged
        row = auditing.audit_rows(_single_layer(tmp_path / name, iid, swizzle=flag),
                                  workers=0)[0]
        assert row["issues"] == "", name


def test_bad_block_scales_are_counted(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "bad")
    scales = file_tensors(path)[f"{Q}.weight_scale"].clone()
    raw = scales.view(torch.uint8)
    raw[0, 0], raw[0, 1], raw[1, 0] = 0x7F, 0xB8, 0x00  # NaN, -1.0, zero over nonzero codes
    raw[2:40] = 0x7E  # 448 (saturated) on many rows
    _edit(path, **{f"{Q}.weight_scale": scales})
    row = _row(checkpoint.audit(path, workers=0), Q)
    n = scales.numel()
    assert (row["nan_scales"], row["negative_scales"], row["zero_scales"]) == (1, 1, 1)
    assert row["saturated_frac"] == int((raw == 0x7E).sum()) / n
    assert "1 NaN and 1 negative block scale(s)" in row["issues"]
    assert "scale 0 over nonzero codes" in row["issues"]
    assert "saturated at 448" in row["issues"]


def test_missing_tensor_is_a_row_issue(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "miss")
    stored = file_tensors(path)
    del stored[f"{Q}.weight_scale"]
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert "missing tensor(s) weight_scale" in _row(checkpoint.audit(path, workers=0), Q)["issues"]


def test_modelopt_checkpoint_is_clean(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "mo", format="modelopt", workers=0)
    df = checkpoint.audit(tmp_path / "mo", workers=0)
    assert (df["issues"] == "").all() and (df["scale_form"] == "decode").all()
    ct = checkpoint.audit(nvfp4lab_checkpoint, workers=0)
    assert (df["decoded_amax"] - ct["decoded_amax"]).abs().max() < 1e-6


def test_same_table_in_chunks_on_a_pool_and_on_dask(unshared_checkpoint: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from distributed import LocalCluster

    inline = checkpoint.audit(unshared_checkpoint, workers=0)
    pd.testing.assert_frame_equal(checkpoint.audit(unshared_checkpoint, workers=2), inline)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                               dashboard_address=None)
    with cluster:  # no Client here: the audit must not need a default client (issue 19, A)
        on_dask = checkpoint.audit(unshared_checkpoint, dask=cluster.scheduler_address)
    pd.testing.assert_frame_equal(on_dask, inline)
    monkeypatch.setattr(auditing, "CHUNK_ELEMENTS", 200)  # a few rows per chunk
    chunked = checkpoint.audit(unshared_checkpoint, workers=0)
    pd.testing.assert_frame_equal(chunked, inline, rtol=1e-12)


def test_bad_inputs(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        checkpoint.audit(tmp_path / "nope")
    tiny_llama().save_pretrained(tmp_path / "float")
    with pytest.raises(CheckpointError, match="not a quantized checkpoint"):
        checkpoint.audit(tmp_path / "float")
    with pytest.raises(FileNotFoundError, match="reference folder"):
        checkpoint.audit(nvfp4lab_checkpoint, reference=tmp_path / "nope", workers=0)
    with pytest.raises(ValueError, match="workers must be"):
        checkpoint.audit(nvfp4lab_checkpoint, workers=-1)
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "trunc")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint.audit(path, workers=0)


def test_csv_has_layer_and_issues(unshared_checkpoint: Path, tmp_path: Path) -> None:
    rows = auditing.audit_rows(unshared_checkpoint, workers=0)
    file = auditing.write_csv(rows, tmp_path / "audit.csv")
    back = pd.read_csv(file)
    assert list(back.columns[:1]) == ["layer"] and back.columns[-1] == "issues"
    assert list(back["layer"]) == [r["layer"] for r in rows]
    assert json.dumps(list(back.columns)) == json.dumps(list(rows[0]))


# --------------------------------------------------------------------------------------------
# issue 32: folders from strangers, audited as users audit them (``nvfp4lab audit``, a process)


def _audit_cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nvfp4lab", "audit", *map(str, args)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)


def test_issue32_cases_1_2_weights_linked_out_or_not_files_are_refused(
        nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    """issue 32 cases 1 and 2: audit read weights through a link out of the folder, and hung
    on a FIFO named model.safetensors; both are refused in one line."""
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "c")
    elsewhere = tmp_path / "elsewhere.safetensors"
    (path / "model.safetensors").rename(elsewhere)
    (path / "model.safetensors").symlink_to(elsewhere)
    one_line_error(_audit_cli(path), f"nvfp4lab audit: {path}: 1 entry nvfp4lab will not read "
              f"(model.safetensors -> {elsewhere} (outside the checkpoint folder))")
    (path / "model.safetensors").unlink()
    os.mkfifo(path / "model.safetensors")
    one_line_error(_audit_cli(path), "(model.safetensors (a named pipe))")


def test_issue32_case14_a_hugging_face_cache_snapshot_audits(tmp_path: Path,
                                                            capfd: pytest.CaptureFixture[str]
                                                            ) -> None:
    """issue 32 case 14: ``nvfp4lab audit`` of a sharded checkpoint's Hugging Face cache
    snapshot (every file a link ../../blobs/<hash>) and of its models--* folder gives the plain
    folder's table."""
    plain = sharded_checkpoint(tmp_path / "plain", seed=7)
    snapshot = hf_cache_layout(plain, tmp_path / "hub")
    want = auditing.audit_rows(plain, workers=0)
    done = _audit_cli(snapshot)
    assert done.returncode == 0, done.stderr
    assert f"{snapshot}: {len(want)} quantized layers, 0 flagged" in done.stdout
    assert auditing.audit_rows(snapshot, workers=0) == want
    repo = snapshot.parent.parent
    here = cli_here(["audit", str(repo)], capfd)
    assert here.returncode == 0 and f"{len(want)} quantized layers, 0 flagged" in here.stdout


def test_issue32_format_picks_one_of_two_formats(nvfp4lab_checkpoint: Path,
                                                unshared_checkpoint: Path, tmp_path: Path,
                                                capfd: pytest.CaptureFixture[str]) -> None:
    """issue 32: a compressed-tensors folder that also holds a .gguf file audits with
    --format (format=), and the refusal says so."""
    both = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "both")
    checkpoint.convert(unshared_checkpoint, tmp_path / "gg", format="gguf")
    shutil.copy(tmp_path / "gg" / "model.gguf", both / "model.gguf")
    one_line_error(_audit_cli(both), "several checkpoint formats at once (compressed-tensors and "
              "gguf); pass the one to read (--format compressed-tensors or --format gguf)")
    ct = cli_here(["audit", str(both), "--format", "compressed-tensors"], capfd)
    assert ct.returncode == 0 and "14 quantized layers, 0 flagged" in ct.stdout
    assert (auditing.audit_rows(both, format="gguf", workers=0)
            == auditing.audit_rows(tmp_path / "gg", workers=0))
    (both / "model.gguf").write_bytes(LFS_POINTER)
    line = one_line_error(cli_here(["audit", str(both), "--format", "gguf"], capfd))
    assert line == (f"nvfp4lab audit: {both / 'model.gguf'} is an un-fetched git-LFS pointer "
                    "(a small text file standing for the real one); run git lfs pull in its "
                    "repository (or download the file) and try again")
