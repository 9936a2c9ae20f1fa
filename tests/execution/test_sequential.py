"""nvfp4lab.execution.sequential: the repeated blocks found, block 0's inputs captured (caches
off, the chain checked), one block run over the calls (early end, final layers remembered)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from nvfp4lab.execution.sequential import (
    BlockCall,
    BlockRunner,
    Blocks,
    block_output,
    capture_block_inputs,
    find_blocks,
    first_row,
)
from tests.execution.tiny_models import tiny_model


class Counting(nn.Linear):
    """A Linear that counts how often its own forward ran."""

    runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return super().forward(x)


class Toy(nn.Module):
    """``c(b(a(x)) + a(x))``; ``in_place``: ``a``'s output is changed in place (by 0) after use;
    ``swap``: a batch whose first value is negative calls ``b`` before ``a``; ``plain``: plain
    ``nn.Linear`` layers (what quantize_model takes) instead of :class:`Counting` ones."""

    def __init__(self, d: int = 16, *, in_place: bool = False, swap: bool = False,
                 plain: bool = False) -> None:
        super().__init__()
        linear = nn.Linear if plain else Counting
        self.a, self.b, self.c = linear(d, d), linear(d, d), linear(d, d)
        self.in_place, self.swap = in_place, swap

    def forward(self, hidden_states: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if self.swap and float(hidden_states.flatten()[0]) < 0:
            z = self.b(hidden_states)
            y = self.a(z)
        else:
            y = self.a(hidden_states)
            z = self.b(y) + y
        if self.in_place:
            y.add_(0.0)
        return self.c(z) * scale


class Chain(nn.Module):
    def __init__(self, *, keyword: bool = False, **toy: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Toy(**toy), Toy(**toy)])
        self.keyword = keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(hidden_states=x, scale=0.5) if self.keyword else block(x, 0.5)
        return x


def _batches(n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 16, generator=g) for _ in range(n)]


def _watched(block: nn.Module, prefix: str = "blocks.0") -> dict[str, nn.Module]:
    return {f"{prefix}.{n}": getattr(block, n) for n in "abc"}


# -- finding the blocks ----------------------------------------------------------------------


def test_find_blocks() -> None:
    model = tiny_model()
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    blocks = find_blocks(model, names)
    assert blocks is not None and blocks.name == "blocks" and blocks.modules is model.blocks
    assert blocks.index("blocks.1.attn.q_proj") == 1
    assert blocks.index("blocks.1") is None  # the block itself is no layer in it
    assert blocks.index("blocks.7.gate_proj") is None and blocks.index("odd") is None
    assert find_blocks(nn.Sequential(nn.Linear(16, 16)), ["0"]) is None
    outer = nn.Module()
    outer.layers = nn.ModuleList([nn.Module() for _ in range(2)])
    for layer in outer.layers:
        layer.experts = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
    names = [n for n, m in outer.named_modules() if isinstance(m, nn.Linear)]
    found = find_blocks(outer, names)
    assert found is not None and found.name == "layers"  # the outermost list holds the most
    assert find_blocks(outer, names[:3]) == Blocks("layers", outer.layers)  # ties: outermost


# -- capturing block 0's inputs --------------------------------------------------------------


def test_capture_llama_inputs_without_cache() -> None:
    """Block 0's calls hold the embeddings, no cache object and use_cache=False; running the
    blocks on them one after the other gives the model's own hidden states bit for bit (the
    model itself runs with its default KV cache)."""
    pytest.importorskip("transformers")
    from tests.checkpoint.builders import tiny_llama, token_batches

    model = tiny_llama().float()
    ids = token_batches(2)
    batches = [{"input_ids": t, "attention_mask": torch.ones_like(t)} for t in ids]
    batches[1]["attention_mask"][0, :4] = 0
    blocks = find_blocks(model, ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"])
    assert blocks is not None and blocks.name == "model.layers"
    with torch.no_grad():
        calls = capture_block_inputs(model, blocks, batches)
        assert calls is not None and len(calls) == 2
        for call, batch in zip(calls, batches, strict=True):
            assert call.batch is batch
            assert torch.equal(call.hidden, model.model.embed_tokens(batch["input_ids"]))
            assert call.kwargs["use_cache"] is False
            assert not any("Cache" in type(v).__name__ for v in call.kwargs.values())
            h = call.hidden
            for block in blocks.modules:
                h = block_output(call.with_hidden(h).run(block))
                assert h is not None
            expected = model.model(**batch).last_hidden_state
            assert torch.equal(model.model.norm(h), expected)


@pytest.mark.parametrize("keyword", [False, True])
def test_capture_positional_or_keyword_hidden_states(keyword: bool) -> None:
    model = Chain(keyword=keyword)
    batches = _batches()
    blocks = find_blocks(model, ["blocks.0.a", "blocks.1.a"])
    assert blocks is not None
    calls = capture_block_inputs(model, blocks, batches)
    assert calls is not None
    for call, x in zip(calls, batches, strict=True):
        assert call.key == ("hidden_states" if keyword else 0)
        assert call.hidden is x
        moved = call.with_hidden(x + 1)
        assert torch.equal(moved.hidden, x + 1) and call.hidden is x
        assert (moved.kwargs if keyword else dict(enumerate(moved.args)))[
            "scale" if keyword else 1] == 0.5


class _Reversed(Chain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            x = block(x)
        return x


class _Changed(Chain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) + 1.0
        return x


class _PerBlockScale(Chain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, scale=torch.tensor(float(i + 1)))
        return x


class _Twice(Chain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        x = self.blocks[0](x)
        return self.blocks[1](x)


class _Skips(Chain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


@pytest.mark.parametrize("model_type", [_Reversed, _Changed, _PerBlockScale, _Twice, _Skips])
def test_capture_refuses_what_is_not_a_chain(model_type: type[Chain]) -> None:
    """Blocks out of order, hidden states changed between blocks, per-block arguments, a block
    run twice or never: None (the caller runs the whole model)."""
    model = model_type()
    blocks = find_blocks(model, ["blocks.0.a", "blocks.1.a"])
    assert blocks is not None
    assert capture_block_inputs(model, blocks, _batches()) is None


# -- one block over the calls ----------------------------------------------------------------


def test_capture_records_each_block_order_and_the_runner_needs_no_probe() -> None:
    """The chain check's pass records, per block but the last, the order its Linears ran in;
    a runner given that order does not run its block to learn it, and collects the same
    inputs as one that probes."""
    model = Chain(keyword=True)
    batches = _batches()
    blocks = find_blocks(model, ["blocks.0.a", "blocks.1.a"])
    assert blocks is not None
    watched = {f"blocks.{i}.{n}": getattr(model.blocks[i], n) for i in range(2) for n in "abc"}
    orders: dict[int, list[str]] = {}
    with torch.no_grad():
        calls = capture_block_inputs(model, blocks, batches, orders=orders, watched=watched)
    assert calls is not None
    assert orders == {0: ["blocks.0.a", "blocks.0.b", "blocks.0.c"]}  # the last block: no pass
    block = model.blocks[0]
    block.a.runs = block.b.runs = block.c.runs = 0
    with BlockRunner(block, calls, _watched(block), order=orders[0]) as given:
        assert (block.a.runs, block.b.runs, block.c.runs) == (0, 0, 0)
        seen_given, handle = _inputs_of(block.b)
        for _, run in given.collect(["blocks.0.b"]):
            run()
        handle.remove()
    with BlockRunner(block, calls, _watched(block)) as probed:
        assert probed._order == orders[0]
        seen_probed, handle = _inputs_of(block.b)
        for _, run in probed.collect(["blocks.0.b"]):
            run()
        handle.remove()
    assert len(seen_given) == len(batches)
    assert all(torch.equal(a, b) for a, b in zip(seen_given, seen_probed, strict=True))
    orders = {0: ["stale"]}
    assert capture_block_inputs(_Reversed(), blocks, batches, orders=orders,
                                watched=watched) is None
    assert orders == {}  # not a chain: nothing recorded


def test_first_row_cuts_every_batch_sized_tensor() -> None:
    ids, mask, positions = torch.arange(12).reshape(3, 4), torch.ones(3, 4), torch.arange(4)[None]
    cut = first_row({"input_ids": ids, "attention_mask": mask, "position_ids": positions,
                     "use_cache": False})
    assert isinstance(cut, dict) and cut["use_cache"] is False
    assert torch.equal(cut["input_ids"], ids[:1]) and torch.equal(cut["attention_mask"], mask[:1])
    assert cut["position_ids"] is positions  # [1, T]: not the batch's first dimension
    assert torch.equal(first_row(ids), ids[:1])
    pair = first_row((ids, 0.5))
    assert isinstance(pair, tuple) and torch.equal(pair[0], ids[:1]) and pair[1] == 0.5
    assert isinstance(first_row([ids, mask]), list)
    for nothing in (ids[:1], {"input_ids": ids[:1]}, (1, 2), "text", torch.tensor(3)):
        assert first_row(nothing) is None


class _NoSingleRows(Chain):
    """Refuses a one-row batch (as a model with a batch-size assertion would)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            raise RuntimeError("batch of one")
        return super().forward(x)


def test_a_model_refusing_one_row_is_checked_on_the_whole_first_batch() -> None:
    model, batches = _NoSingleRows(), _batches()
    blocks = find_blocks(model, ["blocks.0.a", "blocks.1.a"])
    assert blocks is not None
    calls = capture_block_inputs(model, blocks, batches)
    assert calls is not None and all(c.hidden is x for c, x in zip(calls, batches, strict=True))


class _Routed(nn.Module):
    """``out(e0(x))``, plus ``e1`` only when the batch has more than one row (an expert the
    first row is not routed to)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.e0, self.e1, self.out = Counting(d, d), Counting(d, d), Counting(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.e0(x)
        if x.shape[0] > 1:
            y = y + self.e1(x)
        return self.out(y)


class _RoutedChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.blocks = nn.ModuleList([_Routed(), _Routed()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_an_order_missing_a_watched_layer_in_the_row_is_dropped() -> None:
    """The one-row pass did not call block 0's e1: no order for block 0 (its runner probes the
    whole first batch), and the runner's own order then has every expert."""
    model, batches = _RoutedChain(), _batches()
    blocks = find_blocks(model, ["blocks.0.e0", "blocks.1.e0"])
    assert blocks is not None
    watched = {f"blocks.{i}.{n}": getattr(model.blocks[i], n)
               for i in range(2) for n in ("e0", "e1", "out")}
    orders: dict[int, list[str]] = {}
    with torch.no_grad():
        calls = capture_block_inputs(model, blocks, batches, orders=orders, watched=watched)
        assert calls is not None and orders == {}
        inside = {n: m for n, m in watched.items() if n.startswith("blocks.0.")}
        with BlockRunner(model.blocks[0], calls, inside) as runner:
            assert runner._order == ["blocks.0.e0", "blocks.0.e1", "blocks.0.out"]


class CountingNorm(nn.LayerNorm):
    """A LayerNorm that counts how often its own forward ran."""

    runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return super().forward(x)


class Normed(nn.Module):
    """``c(b(a(norm(x))))``: a norm (parameters, no watched Linear) before the Linears."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.norm = CountingNorm(d)
        self.a, self.b, self.c = Counting(d, d), Counting(d, d), Counting(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(self.norm(x))))


def test_a_norm_is_remembered_and_the_next_layer_matches_by_identity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From the first freeze on the norm remembers its calls: it runs once more per call, and
    the remembered ``a`` then gets the very tensor it saw, without a ``torch.equal``."""
    block = Normed()
    xs = _batches()
    with torch.no_grad():
        expected = [block.c(block.b(block.a(block.norm(x)))) for x in xs]
    calls = [BlockCall(None, (x,), {}) for x in xs]
    compared: list[int] = []
    real_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(1) or real_equal(a, b))
    with BlockRunner(block, calls, _watched(block)) as runner:
        for _, run in runner.collect(["blocks.0.a"]):
            run()
        runner.freeze("blocks.0.a", block.a)
        block.norm.runs = block.a.runs = 0
        for stage in ("b", "c"):
            for _, run in runner.collect([f"blocks.0.{stage}"]):
                run()
            runner.freeze(f"blocks.0.{stage}", getattr(block, stage))
        outputs = runner.outputs()
    assert (block.norm.runs, block.a.runs) == (3, 3)  # once per call, then remembered
    assert compared == []
    assert all(torch.equal(o.hidden, e) for o, e in zip(outputs, expected, strict=True))


def _inputs_of(module: nn.Module) -> tuple[list[torch.Tensor], Any]:
    seen: list[torch.Tensor] = []
    handle = module.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    return seen, handle


def test_block_runner_ends_each_stage_early_and_remembers_final_layers() -> None:
    model = Chain()
    block = model.blocks[0]
    calls = [BlockCall(None, (x, 0.5), {}) for x in _batches()]
    with torch.no_grad():
        full = [block(x, 0.5) for x in _batches()]
        b_inputs = [block.a(x) for x in _batches()]
    block.a.runs = block.b.runs = block.c.runs = 0
    runner = BlockRunner(block, calls, _watched(block))
    assert runner._order == ["blocks.0.a", "blocks.0.b", "blocks.0.c"]  # the probe (call 0)
    assert (block.a.runs, block.b.runs, block.c.runs) == (1, 1, 1)
    with runner:
        seen, handle = _inputs_of(block.a)
        for _, run in runner.collect(["blocks.0.a"]):
            run()
        handle.remove()
        assert len(seen) == 3 and (block.a.runs, block.b.runs, block.c.runs) == (1, 1, 1)
        runner.freeze("blocks.0.a", block.a)
        seen, handle = _inputs_of(block.b)
        for _, run in runner.collect(["blocks.0.b"]):
            run()
        handle.remove()
        assert all(torch.equal(s, e) for s, e in zip(seen, b_inputs, strict=True))
        assert (block.a.runs, block.b.runs, block.c.runs) == (4, 1, 1)  # a ran once per call
        runner.freeze("blocks.0.b", block.b)
        for _, run in runner.collect(["blocks.0.c"]):
            run()
        assert (block.a.runs, block.b.runs, block.c.runs) == (4, 4, 1)  # a remembered
        runner.freeze("blocks.0.c", block.c)
        outputs = runner.outputs()
        assert (block.a.runs, block.b.runs, block.c.runs) == (4, 4, 4)  # a, b remembered
    assert all(torch.equal(o.hidden, f) for o, f in zip(outputs, full, strict=True))
    assert "forward" not in vars(block.a)  # the class's forward again
    with torch.no_grad():
        block(calls[0].hidden, 0.5)
    assert block.a.runs == 5


def test_block_runner_recomputes_what_changed_in_place() -> None:
    """``a``'s remembered output was changed in place (its version moved): ``a`` runs again."""
    model = Chain(in_place=True)
    block = model.blocks[0]
    calls = [BlockCall(None, (x, 0.5), {}) for x in _batches()]
    with BlockRunner(block, calls, _watched(block)) as runner:
        runner.freeze("blocks.0.a", block.a)
        block.a.runs = 0
        for _ in range(2):
            for _, run in runner.collect(["blocks.0.c"]):
                run()
        assert block.a.runs == 6


def test_block_runner_runs_a_departing_batch_to_the_end() -> None:
    """A batch that calls the layers in another order than the probe's is not ended early:
    the stage's layer still sees every input it gets in a full run."""
    model = Chain(swap=True)
    block = model.blocks[0]
    xs = [torch.ones(4, 16), -torch.ones(4, 16), torch.full((4, 16), 2.0)]
    calls = [BlockCall(None, (x, 0.5), {}) for x in xs]
    with torch.no_grad():
        expected = [block.a(x) if i != 1 else block.a(block.b(x)) for i, x in enumerate(xs)]
    with BlockRunner(block, calls, _watched(block)) as runner:
        seen, handle = _inputs_of(block.b)
        for _, run in runner.collect(["blocks.0.b"]):
            run()
        handle.remove()
    assert len(seen) == 3
    assert torch.equal(seen[0], expected[0]) and torch.equal(seen[2], expected[2])
    assert torch.equal(seen[1], xs[1])  # b first in the departing batch



class Routed(nn.Module):
    """``out(e0(x) [+ e2(x)])``: "experts" ``e0`` always, ``e2`` only for a batch whose first
    value is positive, ``e1`` never (a router's data-dependent choice)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.e0, self.e1, self.e2, self.out = (Counting(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.e0(x)
        if float(x.flatten()[0]) > 0:
            y = y + self.e2(x)
        return self.out(y)


@pytest.mark.parametrize("order", [None, ["r.e0", "r.out"]])
def test_a_stage_layer_missing_from_the_order_is_not_ended_early(
    order: list[str] | None,
) -> None:
    """The recorded order (the probe's, or the chain check's) holds ``e0`` but not ``e2``: a
    later batch that calls ``e2`` after ``e0`` must not end at ``e0`` (``e2`` would miss its
    rows). A stage wholly in the order still ends early."""
    block = Routed()
    xs = [-torch.ones(4, 16), torch.ones(4, 16), torch.full((4, 16), 2.0)]
    calls = [BlockCall(None, (x,), {}) for x in xs]
    watched = {f"r.{n}": getattr(block, n) for n in ("e0", "e1", "e2", "out")}
    with BlockRunner(block, calls, watched, order=order) as runner:
        seen, handle = _inputs_of(block.e2)
        for _, run in runner.collect(["r.e0", "r.e1", "r.e2"]):
            run()
        handle.remove()
        assert len(seen) == 2 and torch.equal(seen[0], xs[1]) and torch.equal(seen[1], xs[2])
        block.out.runs = 0
        for _, run in runner.collect(["r.e0"]):
            run()
        assert block.out.runs == 0  # ended right after e0 in every batch

def test_sequential_gptq_on_a_chain_of_toys_uses_the_blocks() -> None:
    """quantize_model on Chain: every Linear quantized, the model's own forward only runs to
    capture block 0's inputs (once per batch, after the chain check on the first batch's first
    row)."""
    from nvfp4lab.execution import NVFP4Linear, quantize_model
    from tests.execution.reference_gptq import differing, whole_model_gptq

    batches = _batches()
    reference, model = Chain(plain=True), Chain(plain=True)
    whole_model_gptq(reference, batches)
    forwards: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, a: forwards.append(a[0].shape[0]))
    quantize_model(model, backend="w4a16", method="gptq", calibration=batches)
    handle.remove()
    assert forwards == [1] + [len(b) for b in batches]
    assert all(isinstance(model.get_submodule(f"blocks.{i}.{n}"), NVFP4Linear)
               for i in range(2) for n in "abc")
    assert differing(reference, model) == []


class Fork(nn.Module):
    """``b`` and ``c`` both on ``a``'s output (``chained``: ``c`` on ``b``'s output instead)."""

    def __init__(self, chained: bool = False, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b, self.c = Counting(d, d), Counting(d, d), Counting(d, d)
        self.chained = chained

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        p = self.b(y)
        return p + self.c(p if self.chained else y)


def _collect_inputs(runner: BlockRunner, stage: list[str], modules: dict[str, nn.Module]
                    ) -> tuple[dict[str, list[torch.Tensor]], int]:
    """What the stage's modules receive per call, as a Hessian collector records it (hooks
    registered first; a pass that asks to be repeated drops its records); and the repeats."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in stage}
    current: dict[str, list[torch.Tensor]] = {}
    handles = [modules[n].register_forward_pre_hook(
        lambda m, a, n=n: current.setdefault(n, []).append(a[0].clone())) for n in stage]
    repeats = 0
    for _, run in runner.collect(stage):
        current.clear()
        while not run():
            repeats += 1
            current.clear()
        for n in stage:
            seen[n] += current.get(n, [])
    for handle in handles:
        handle.remove()
    return seen, repeats


@pytest.mark.parametrize("chained", [False, True])
def test_stage_layers_return_zeros_only_while_they_share_one_input(chained: bool) -> None:
    """b and c on one input: b does not compute (zeros), c's pass ends at its call. c fed b's
    output: the first pass is repeated with b computing, and so is the rest of the stage. The
    recorded inputs are the real ones either way."""
    block = Fork(chained)
    xs = _batches()
    with torch.no_grad():
        ys = [block.a(x) for x in xs]
        expected_c = [block.b(y) if chained else y for y in ys]
    calls = [BlockCall(None, (x,), {}) for x in xs]
    watched = _watched(block)
    with BlockRunner(block, calls, watched) as runner:
        runner.freeze("blocks.0.a", block.a)
        block.b.runs = block.c.runs = 0
        seen, repeats = _collect_inputs(runner, ["blocks.0.b", "blocks.0.c"], watched)
    assert all(torch.equal(s, y) for s, y in zip(seen["blocks.0.b"], ys, strict=True))
    assert all(torch.equal(s, e) for s, e in zip(seen["blocks.0.c"], expected_c, strict=True))
    assert (repeats, block.b.runs, block.c.runs) == ((1, 3, 0) if chained else (0, 0, 0))
    assert "forward" not in vars(block.b) and "forward" not in vars(block.c)
