"""Run a model's repeated blocks one at a time over calibration batches (the sequential pipeline).

Sequential calibration (GPTQ) needs, for every stage of Linear layers, their inputs as the model
produces them with every earlier stage already quantized. Running the whole model for each
stage costs one full pass per stage (120 for a 30-layer decoder with 4 stages a layer). Almost
all of a transformer's Linears live in one ``nn.ModuleList`` of blocks (``model.layers`` of a
Llama, ``encoder.layer`` of a BERT) that the model calls as a chain,
``h_{i+1} = block_i(h_i, **same_kwargs)``; the inputs of block ``i + 1`` are the outputs of
block ``i``. So (the idea of llm-compressor's sequential pipeline and GPTQModel's layer loop,
written here from that description, no code taken):

Steps 1 and 2 live in :mod:`~nvfp4lab.execution.block_calls`, step 3 here:

1. :func:`find_blocks`: the ``nn.ModuleList`` holding the most of the Linears to calibrate.
2. :func:`capture_block_inputs`: run the model on each batch only up to block 0 (a forward
   pre-hook records its positional and keyword arguments, then ends the pass with an
   exception of its own) and keep one :class:`BlockCall` per batch. Before that, the first
   row of the first batch runs up to the model's LAST block, to check that it is a chain:
   every block called once, in order, each on the previous block's output, with the very same
   other arguments (masks, position embeddings, ...). Anything else (a block skipped or
   repeated, per-block masks, hidden states changed between blocks) returns None, and the
   caller runs the whole model instead.
3. Each stage then runs only its block over the captured calls; the block's outputs (with its
   Linears quantized) become the next block's calls (:meth:`BlockCall.with_hidden`).

KV caches are switched off in the captured arguments (``use_cache=False``, a cache object
replaced by None): a block run several times on the same call must not append keys and values
to a cache each time. A fresh cache used once (the whole-model path) and no cache give the same
attention (tests/execution/test_gptq.py compares the two paths bit for bit on a Llama).

:class:`BlockRunner` runs one block over the calls and makes the repeated passes cheap without
changing a bit of what they compute:

* a probe (the block once, on the first call) records the order in which the block calls the
  Linears being calibrated, unless the chain-check pass of :func:`capture_block_inputs` (one
  row) recorded it already (every block but the last that called all its Linears in that row;
  float hidden states there, those of the blocks quantized so far in a probe: the same order
  wherever it does not depend on the values, and a departing batch is caught as below); a pass
  that only needs a stage's inputs ends right after the last call of that stage
  (:meth:`BlockRunner.collect`), as long as the batch calls the Linears in that order so far
  (checked at every call; a batch that departs runs to the end) and every Linear of the stage is
  in the order (else, e.g. an expert the recorded batch was not routed to, every pass runs to
  the end); the stage's own Linears, about to be replaced, return zeros instead of computing
  while they all receive one and the same input tensor (else the pass is repeated with them
  computing);
* a layer that is already final (an earlier stage) remembers, per call, its input and output;
  a later pass that feeds it an input equal to the remembered one (``torch.equal``; neither
  tensor changed in place since, by its version counter) gets the remembered output instead of
  running it again (:meth:`BlockRunner.freeze`); a module holding parameters but no Linear
  being calibrated (a norm) remembers its calls from the first freeze on, so the next layer is
  handed the very same tensor and matches it by identity, without ``torch.equal``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nvfp4lab.execution.block_calls import (
    BlockCall,
    Blocks,
    EndPass,
    block_call,
    block_output,
    capture_block_inputs,
    find_blocks,
    first_row,
    same_value,
)

__all__ = [
    "BlockCall",
    "BlockRunner",
    "Blocks",
    "block_call",
    "block_output",
    "capture_block_inputs",
    "find_blocks",
    "first_row",
]


# --------------------------------------------------------------------------------------------
# one block over the calls
# --------------------------------------------------------------------------------------------


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value`` (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _equal(a: Any, b: Any) -> bool:
    """Equal arguments: tensors identical or ``torch.equal`` (same dtype, shape, device),
    tuples / lists / dicts item by item, anything else
    :func:`~nvfp4lab.execution.block_calls.same_value`."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
            a is b or (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
                       and torch.equal(a, b))
        )
    if isinstance(a, tuple | list) or isinstance(b, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(
            _equal(x, y) for x, y in zip(a, b, strict=True)
        )
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(_equal(a[k], b[k]) for k in a))
    return same_value(a, b)


@dataclass
class _Entry:
    """One remembered call: its arguments, output, the tensors' versions then, and the watched
    modules it called (in order)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    versions: list[tuple[torch.Tensor, int]]
    watched: list[str]

    def unchanged(self) -> bool:
        return all(t._version == v for t, v in self.versions)


@dataclass
class _Memo:
    """A final submodule's remembered calls per (call index, use within the call)."""

    own_forward: Callable[..., Any]
    #: the module's own ``forward`` instance attribute before (None: the class's method)
    previous: Any
    entries: dict[tuple[int, int], _Entry] = field(default_factory=dict)
    uses: int = 0


class BlockRunner:
    """Runs one block over the calls of every batch (module docstring: probe, early end, final
    layers). ``watched``: name -> module of the Linears being calibrated in this block, the
    modules whose call order the probe records; ``order``: that order when it is known already
    (the chain check's one-row pass of :func:`capture_block_inputs` through this block: then
    there is no probe). Use as a context manager (it removes its hooks and restores memoized
    modules on exit)."""

    def __init__(self, block: nn.Module, calls: Sequence[BlockCall],
                 watched: Mapping[str, nn.Module], order: Sequence[str] | None = None) -> None:
        self.block = block
        self.calls = list(calls)
        self._names = {id(m): n for n, m in watched.items()}
        self._modules = dict(watched)
        self._final: set[str] = set()
        self._order: list[str] = []
        self._seen: list[str] = []
        self._strict = False
        self._memos: dict[int, tuple[nn.Module, _Memo]] = {}
        self._current = 0
        self._handles = [m.register_forward_pre_hook(self._watch) for m in watched.values()]
        if order is None:
            self._probe()
        else:
            self._order = list(order)

    def __enter__(self) -> BlockRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks, restore memoized modules' own ``forward``, drop the memos."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module, memo in self._memos.values():
            if memo.previous is None:
                vars(module).pop("forward", None)
            else:
                module.forward = memo.previous
        self._memos.clear()

    # -- call order ----------------------------------------------------------------------------

    def _watch(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        name = self._names.get(id(module))
        if name is not None:
            self._saw(name)

    def _saw(self, name: str) -> None:
        position = len(self._seen)
        self._seen.append(name)
        if self._strict and (position >= len(self._order) or self._order[position] != name):
            self._strict = False  # this batch departs from the probe's order: run to the end

    def _probe(self) -> None:
        if not self.calls:
            return
        self._begin(0)
        with torch.no_grad():
            self.calls[0].run(self.block)
        self._order = list(self._seen)

    def _last_call(self, stage: Sequence[str]) -> int:
        """Position in the probe's order of the last call of a module of ``stage``; -1 (no early
        end) when a module of ``stage`` is not in that order: a batch may call it after that
        position (an expert the recorded batch was not routed to) and its rows would be lost."""
        members = set(stage)
        if not members <= set(self._order):
            return -1
        return max((i for i, n in enumerate(self._order) if n in members), default=-1)

    # -- passes --------------------------------------------------------------------------------

    def collect(self, stage: Sequence[str]) -> Iterator[tuple[Any, Callable[[], bool]]]:
        """``(batch, run)`` per call: ``run()`` runs the block on the call (no grad) and returns
        True, or False when its pass must be repeated (whatever it recorded dropped; the repeat
        returns True).

        A run ends right after the last call of a module of ``stage`` when the batch has called
        the watched modules in the probe's order so far and every module of ``stage`` is in that
        order (:meth:`_last_call`). The stage's Linears are about to be
        replaced, so they do not compute: they return zeros of their output's shape, as long as
        each receives the very tensor the first of them received (then no zero output can have
        reached a stage input, e.g. q/k/v or gate/up); otherwise the run asks to be repeated and
        the rest of the stage runs them for real. Ending and zeros are forward pre-hooks and
        ``forward`` replacements on ``stage``'s modules installed when this generator starts:
        pre-hooks registered on them before (a Hessian collector's) run first and see every
        call."""
        last = self._last_call(stage)
        members = [self._modules[n] for n in stage if n in self._modules]
        state = {"first": None, "same": True, "zeros": True}

        def check_and_stop(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if state["first"] is None:
                state["first"] = x
            elif x is not state["first"]:
                state["same"] = False
            if self._strict and len(self._seen) - 1 == last:
                raise EndPass

        def zeros_for(module: nn.Linear) -> Callable[..., Any]:
            own = module.forward

            def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if not state["zeros"] or args or kwargs or not isinstance(x, torch.Tensor):
                    return own(x, *args, **kwargs)
                return x.new_zeros(*x.shape[:-1], module.out_features)

            return forward

        def run(index: int) -> Callable[[], bool]:
            def go() -> bool:
                self._begin(index)
                self._strict = last >= 0
                state["first"], state["same"] = None, True
                try:
                    with torch.no_grad():
                        self.calls[index].run(self.block)
                except EndPass:
                    pass
                finally:
                    self._strict = False
                if state["zeros"] and not state["same"]:
                    state["zeros"] = False  # real outputs from now on, this call again
                    return False
                return True

            return go

        handles = [m.register_forward_pre_hook(check_and_stop) for m in members]
        replaced = [m for m in members if isinstance(m, nn.Linear) and "forward" not in vars(m)]
        for module in replaced:
            module.forward = zeros_for(module)  # type: ignore[method-assign]
        try:
            for index, call in enumerate(self.calls):
                yield call.batch, run(index)
        finally:
            for handle in handles:
                handle.remove()
            for module in replaced:
                vars(module).pop("forward", None)
        self._prune()

    def outputs(self) -> list[BlockCall]:
        """The next block's calls: this block run to the end on every call, its output as the
        hidden states (ValueError when the block returns no tensor)."""
        out = []
        with torch.no_grad():
            for index, call in enumerate(self.calls):
                self._begin(index)
                hidden = block_output(call.run(self.block))
                if hidden is None:
                    raise ValueError(
                        f"block {type(self.block).__name__} returned no tensor (nor a tuple "
                        "starting with one): cannot feed the next block"
                    )
                out.append(call.with_hidden(hidden))
        return out

    def _begin(self, index: int) -> None:
        self._current = index
        self._seen = []
        for _, memo in self._memos.values():
            memo.uses = 0

    # -- final layers --------------------------------------------------------------------------

    def freeze(self, name: str, module: nn.Module) -> None:
        """``module`` (installed under ``name`` in the block, replacing the watched one) is final
        for the rest of this block. Every largest submodule of the block whose watched modules
        are all final then remembers its calls and answers an equal call (equal arguments,
        none of the tensors changed in place since) with the remembered output, without running
        (the watched modules it would have called still count in the call order).

        A submodule holding no watched module but parameters of its own (a norm, a router) is
        final from the first freeze: remembered, its output is the very tensor a later pass
        hands the next layer, whose memo then matches by identity instead of comparing the
        values (``torch.equal``), and the norm is not recomputed. Parameter-free ones (an
        activation, a dropout) run again: cheaper than holding their outputs."""
        old = self._modules.get(name)
        if old is not module:
            if old is not None:
                self._names.pop(id(old), None)
            self._handles.append(module.register_forward_pre_hook(self._watch))
        self._modules[name] = module
        self._names[id(module)] = name
        self._final.add(name)
        watched_ids = {id(m): n for n, m in self._modules.items()}
        final: dict[str, nn.Module] = {}
        for path, sub in self.block.named_modules():
            if not path:
                continue
            inside = [watched_ids[id(m)] for m in sub.modules() if id(m) in watched_ids]
            if all(n in self._final for n in inside) and (
                inside or next(sub.parameters(), None) is not None
            ):
                final[path] = sub
        for path, sub in final.items():
            parent = path.rpartition(".")[0]
            if parent not in final and id(sub) not in self._memos:
                self._remember(sub)

    def _prune(self) -> None:
        """Forget the calls of memoized modules inside a memoized module that remembers every
        call (it answers them all; a miss would refill them)."""
        for module, memo in self._memos.values():
            if len({index for index, _ in memo.entries}) < len(self.calls):
                continue
            for below in module.modules():
                if below is not module and id(below) in self._memos:
                    self._memos[id(below)][1].entries.clear()

    def _remember(self, module: nn.Module) -> None:
        memo = _Memo(module.forward, vars(module).get("forward"))

        def forward(*args: Any, **kwargs: Any) -> Any:
            key = (self._current, memo.uses)
            memo.uses += 1
            hit = memo.entries.get(key)
            if hit is not None and hit.unchanged() and _equal(hit.args, args) and _equal(
                hit.kwargs, kwargs
            ):
                for name in hit.watched:
                    self._saw(name)
                return hit.output
            start = len(self._seen)
            output = memo.own_forward(*args, **kwargs)
            versions = [(t, t._version) for t in _tensors((args, kwargs, output))]
            memo.entries[key] = _Entry(args, kwargs, output, versions, self._seen[start:])
            return output

        module.forward = forward  # type: ignore[method-assign]
        self._memos[id(module)] = (module, memo)
