"""Reference runs kept on disk (:mod:`nvfp4lab.studies.reference_cache`), on a tiny seeded random
Llama (:func:`tests.tiny_decoders.tiny_model`). The oracle is a fresh, uncached
:func:`nvfp4lab.studies.llm.reference_run`; a wrapper of ``llm._forward`` counts the model's
passes (not a forward hook: a hooked model is never cached), so a test can tell a run read from
disk from one made again."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nvfp4lab import settings
from nvfp4lab.studies import llm, reference_cache
from nvfp4lab.studies.reference_cache import SUBDIR, cached_reference_run, reference_key
from tests.tiny_decoders import TINY_VOCAB, tiny_model

ROOT = Path(__file__).resolve().parents[1]
CONTEXT, BATCH = 32, 2


def ids_of(n: int = 150, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def files(cache: Path) -> list[Path]:
    folder = cache / SUBDIR
    return sorted(folder.glob("*")) if folder.is_dir() else []


def count_passes(model: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at each forward pass of ``model`` in ``llm``'s runs."""
    calls: list[int] = []
    forward = llm._forward

    def counted(m: Any, input_ids: torch.Tensor) -> torch.Tensor:
        if m is model:
            calls.append(1)
        return forward(m, input_ids)

    monkeypatch.setattr(llm, "_forward", counted)
    return calls


def assert_same_run(got: llm.ReferenceRun, want: llm.ReferenceRun) -> None:
    assert got.hidden is not None and want.hidden is not None
    assert torch.equal(got.ids, want.ids) and torch.equal(got.nll, want.nll)
    assert got.nll.dtype == torch.float64
    assert (got.windows, got.batches, got.context, got.batch_size) == (
        want.windows, want.batches, want.context, want.batch_size)
    assert len(got.hidden) == len(want.hidden) == len(want.batches)
    for b in range(len(want.batches)):
        assert torch.equal(got.hidden[b], want.hidden[b])
        assert torch.equal(got.logits(b), want.logits(b))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(settings.REFERENCE_CACHE_ENV, raising=False)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("llama", seed=0)


_CHILD = """
import json, sys, torch
CONTEXT, BATCH = int(sys.argv[3]), int(sys.argv[4])
from nvfp4lab.studies import llm
from nvfp4lab.studies.reference_cache import cached_reference_run
from tests.tiny_decoders import tiny_model
model = tiny_model("llama", seed=0)
calls = []
forward = llm._forward
llm._forward = lambda m, input_ids: (calls.append(1), forward(m, input_ids))[1]
ids = torch.load(sys.argv[1])
run = cached_reference_run(model, ids, context=CONTEXT, batch_size=BATCH, progress=False)
torch.save({"ids": run.ids, "nll": run.nll, "hidden": list(run.hidden),
            "logits": [run.logits(b) for b in range(len(run.batches))]}, sys.argv[2])
print(json.dumps({"passes": len(calls)}))
"""


def test_another_process_reads_the_run_without_running_the_model(
        model: Any, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = ids_of()
    fresh = llm.reference_run(model, ids, context=CONTEXT, batch_size=BATCH, progress=False)
    counted = copy.deepcopy(model)
    passes = count_passes(counted, monkeypatch)
    first = cached_reference_run(counted, ids, context=CONTEXT, batch_size=BATCH,
                                 progress=False)
    assert len(passes) == len(fresh.batches) == 3  # windows of 32, 32 | 32, 32 | 22
    (stored,) = files(cache)
    assert stored.suffix == ".safetensors"
    inode, data = stored.stat().st_ino, stored.read_bytes()  # a rewrite is a new file (os.replace)
    assert_same_run(first, fresh)
    again = cached_reference_run(counted, ids, context=CONTEXT, batch_size=BATCH,
                                 progress=False)
    assert len(passes) == 3 and again is not first  # read back in this process: no pass
    assert_same_run(again, fresh)

    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, settings.CACHE_ENV: str(cache), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "ids.pt"), str(tmp_path / "out.pt"),
         str(CONTEXT), str(BATCH)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"passes": 0}
    assert files(cache) == [stored] and stored.stat().st_ino == inode
    assert stored.read_bytes() == data  # read, not rewritten (a read only touches its time)
    child = torch.load(tmp_path / "out.pt")
    assert torch.equal(child["ids"], fresh.ids) and torch.equal(child["nll"], fresh.nll)
    assert fresh.hidden is not None
    for b in range(len(fresh.batches)):
        assert torch.equal(child["hidden"][b], fresh.hidden[b])
        assert torch.equal(child["logits"][b], fresh.logits(b))


def test_any_change_is_another_key(model: Any, cache: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ids = ids_of()
    base = reference_key(model, ids, CONTEXT, BATCH)
    assert base is not None and len(base) == 64
    assert reference_key(copy.deepcopy(model), ids, CONTEXT, BATCH) == base
    nudged = copy.deepcopy(model)
    with torch.no_grad():
        weight = nudged.model.layers[1].mlp.down_proj.weight.view(-1)
        weight[7] = torch.nextafter(weight[7], torch.tensor(float("inf")))
    other_ids = ids.clone()
    other_ids[-1] = (other_ids[-1] + 1) % TINY_VOCAB
    keys = {base, reference_key(nudged, ids, CONTEXT, BATCH),
            reference_key(model, other_ids, CONTEXT, BATCH),
            reference_key(model, ids[:-1], CONTEXT, BATCH),
            reference_key(model, ids, CONTEXT + 1, BATCH),
            reference_key(model, ids, CONTEXT, BATCH + 1)}
    assert len(keys) == 6
    # no reuse: the nudged model gets its own file and its own (fresh) run
    cached_reference_run(model, ids, context=CONTEXT, batch_size=BATCH, progress=False)
    passes = count_passes(nudged, monkeypatch)
    got = cached_reference_run(nudged, ids, context=CONTEXT, batch_size=BATCH, progress=False)
    assert len(passes) == 3 and len(files(cache)) == 2
    assert_same_run(got, llm.reference_run(nudged, ids, context=CONTEXT, batch_size=BATCH,
                                           progress=False))


def test_a_hooked_model_is_never_served_a_stored_run(model: Any, cache: Path) -> None:
    """A hook changes what the model computes without changing a byte the key reads: such a
    model runs fresh every time (before, the unhooked model's file was served)."""
    ids = ids_of()
    hooked = copy.deepcopy(model)
    cached_reference_run(hooked, ids, context=CONTEXT, batch_size=BATCH, progress=False)
    assert len(files(cache)) == 1 and reference_key(hooked, ids, CONTEXT, BATCH) is not None
    down = hooked.model.layers[0].mlp.down_proj
    handle = down.register_forward_pre_hook(lambda _m, args: (args[0].round(),))
    try:
        want = llm.reference_run(hooked, ids, context=CONTEXT, batch_size=BATCH, progress=False)
        assert reference_key(hooked, ids, CONTEXT, BATCH) is None
        got = cached_reference_run(hooked, ids, context=CONTEXT, batch_size=BATCH,
                                   progress=False)
        assert not torch.equal(want.nll, llm.reference_run(
            model, ids, context=CONTEXT, batch_size=BATCH, progress=False).nll)
        assert_same_run(got, want)
    finally:
        handle.remove()
    assert reference_key(hooked, ids, CONTEXT, BATCH) is not None
    for undo in (torch.nn.modules.module.register_module_forward_hook(lambda *_: None).remove,
                 torch.nn.modules.module.register_module_forward_pre_hook(lambda *_: None).remove):
        assert reference_key(hooked, ids, CONTEXT, BATCH) is None  # a global hook
        undo()
    down.forward = lambda x: torch.nn.functional.linear(x.round(), down.weight)
    assert reference_key(hooked, ids, CONTEXT, BATCH) is None  # forward replaced on the instance
    del down.forward
    assert reference_key(hooked, ids, CONTEXT, BATCH) is not None
    assert len(files(cache)) == 1


def test_a_model_in_training_mode_is_never_cached(model: Any, cache: Path) -> None:
    """Dropout draws new numbers on every run: one module in training mode and nothing is read
    or written (the model in eval mode is cached as before)."""
    ids = ids_of()
    trained = copy.deepcopy(model)
    trained.model.layers[0].train()
    assert reference_key(trained, ids, CONTEXT, BATCH) is None
    cached_reference_run(trained, ids, context=CONTEXT, batch_size=BATCH, progress=False)
    assert files(cache) == []
    trained.eval()
    cached_reference_run(trained, ids, context=CONTEXT, batch_size=BATCH, progress=False)
    assert len(files(cache)) == 1


def test_global_float_switches_are_in_the_key(model: Any) -> None:
    """float32 matmuls in bfloat16 (oneDNN on this CPU) or autocast change the run's numbers:
    each is another key."""
    ids = ids_of(80)
    base = reference_key(model, ids, CONTEXT, BATCH)
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        medium = reference_key(model, ids, CONTEXT, BATCH)
    finally:
        torch.set_float32_matmul_precision(precision)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = reference_key(model, ids, CONTEXT, BATCH)
    assert len({base, medium, autocast}) == 3
    assert reference_key(model, ids, CONTEXT, BATCH) == base


@pytest.mark.parametrize("damage", ["truncated", "garbage", "another run's file"])
def test_a_bad_file_is_ignored_recomputed_and_rewritten(
        model: Any, cache: Path, damage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = ids_of()
    cached_reference_run(model, ids, context=CONTEXT, batch_size=BATCH, progress=False)
    (stored,) = files(cache)
    good = stored.read_bytes()
    if damage == "truncated":
        stored.write_bytes(good[: len(good) // 2])
    elif damage == "garbage":
        stored.write_bytes(b"\xff" * 64 + good[64:])
    else:  # a valid file of another context, under this key's name
        cached_reference_run(model, ids, context=CONTEXT + 8, batch_size=BATCH, progress=False)
        (other,) = set(files(cache)) - {stored}
        os.replace(other, stored)
    damaged = stored.read_bytes()
    counted = copy.deepcopy(model)
    passes = count_passes(counted, monkeypatch)
    with pytest.warns(UserWarning, match="ignoring the cached reference run"):
        got = cached_reference_run(counted, ids, context=CONTEXT, batch_size=BATCH,
                                   progress=False)
    assert len(passes) == 3
    fresh = llm.reference_run(model, ids, context=CONTEXT, batch_size=BATCH, progress=False)
    assert_same_run(got, fresh)
    # rewritten (the header's key order may differ from the first write's), read without a pass
    assert stored.read_bytes() != damaged and stored.stat().st_size == len(good)
    assert_same_run(cached_reference_run(counted, ids, context=CONTEXT, batch_size=BATCH,
                                         progress=False), fresh)
    assert len(passes) == 3


def test_token_fidelity_of_a_cached_run_is_the_fresh_runs(model: Any, cache: Path) -> None:
    ids = ids_of()
    quantized = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in quantized.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=generator))
    fresh = llm.reference_run(model, ids, context=CONTEXT, batch_size=BATCH, progress=False)
    cached_reference_run(model, ids, context=CONTEXT, batch_size=BATCH, progress=False)
    read = cached_reference_run(model, ids, context=CONTEXT, batch_size=BATCH, progress=False)
    want = llm.token_fidelity(fresh, quantized, progress=False)
    got = llm.token_fidelity(read, quantized, progress=False)
    assert want.kld_mean > 0 and got == want
    for name in ("kld", "nll", "reference_nll", "top1"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_turned_off_nothing_is_written(model: Any, cache: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ids = ids_of(80)
    run = cached_reference_run(model, ids, context=CONTEXT, batch_size=BATCH, progress=False,
                               cache=False)
    assert run.hidden is not None and not cache.exists()
    monkeypatch.setenv(settings.REFERENCE_CACHE_ENV, "0")
    cached_reference_run(model, ids, context=CONTEXT, batch_size=BATCH, progress=False)
    assert not cache.exists()
    monkeypatch.setenv(settings.REFERENCE_CACHE_ENV, "no")
    with pytest.raises(ValueError, match="NVFP4LAB_REFERENCE_CACHE must be an integer"):
        cached_reference_run(model, ids, context=CONTEXT, batch_size=BATCH, progress=False)
    assert settings.reference_cache({}) and settings.reference_cache(
        {settings.REFERENCE_CACHE_ENV: "1"})


def test_a_run_that_keeps_the_model_is_not_stored(model: Any, cache: Path) -> None:
    class Scaled(torch.nn.Module):  # logits that are not the head's output
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.inner.lm_head

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.inner(input_ids=input_ids).logits * 0.5

    scaled = Scaled()
    run = cached_reference_run(scaled, ids_of(80), context=CONTEXT, progress=False)
    assert run.model is scaled and run.hidden is None and files(cache) == []


def test_the_folder_is_bounded_least_recently_used_first(
        model: Any, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_BYTES the least recently used runs go (a read counts as a use), never the run
    just stored; what is left still reads back as the fresh run."""
    runs = {seed: cached_reference_run(model, ids_of(seed=seed), context=CONTEXT,
                                       batch_size=BATCH, progress=False) for seed in (1, 2)}
    first, second = files(cache)[0].stat().st_size, files(cache)[1].stat().st_size
    assert len(files(cache)) == 2
    os.utime(files(cache)[0], (1, 1))  # both old: the order below is the reads' alone
    os.utime(files(cache)[1], (1, 1))
    calls = count_passes(model, monkeypatch)
    cached_reference_run(model, ids_of(seed=1), context=CONTEXT, batch_size=BATCH,
                         progress=False)  # read: seed 1 is now the most recently used
    assert calls == []
    monkeypatch.setattr(reference_cache, "MAX_BYTES", first + second + 1)
    third = cached_reference_run(model, ids_of(seed=3), context=CONTEXT, batch_size=BATCH,
                                 progress=False)
    assert len(calls) == len(third.batches) and len(files(cache)) == 2  # seed 2 evicted
    calls.clear()
    for seed in (1, 3):  # kept: read back without a pass, bit for bit
        got = cached_reference_run(model, ids_of(seed=seed), context=CONTEXT,
                                   batch_size=BATCH, progress=False)
        want = runs[1] if seed == 1 else third
        assert_same_run(got, want)
    assert calls == []
    cached_reference_run(model, ids_of(seed=2), context=CONTEXT, batch_size=BATCH,
                         progress=False)
    assert calls, "seed 2's run was evicted: it runs again"
