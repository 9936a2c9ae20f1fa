"""Run a model's repeated blocks one at a time over calibration batches (the sequential pipeline).

Sequential calibration (GPTQ) needs, for every stage of Linear layers, their inputs as the model
produces them with every earlier stage already quantized. Running the whole model for each
stage costs one full pass per stage (120 for a 30-layer decoder with 4 stages a layer). Almost
all of a transformer's Linears live in one ``nn.ModuleList`` of blocks (``model.layers`` of a
Llama, ``encoder.layer`` of a BERT) that the model calls as a chain,
``h_{i+1} = block_i(h_i, **same_kwargs)``; the inputs of block ``i + 1`` are the outputs of
block ``i``. So (the idea of llm-compressor's sequential pipeline and GPTQModel's layer loop,
written here from that description, no code taken):

1. :func:`find_blocks`: the ``nn.ModuleList`` holding the most of the Linears to calibrate.
2. :func:`capture_block_inputs`: run the model on each batch only up to block 0 (a forward
   pre-hook records its positional and keyword arguments, then ends the pass with a private
   exception) and keep one :class:`BlockCall` per batch. On the first batch the model runs up
   to its LAST block instead, to check that it is a chain: every block called once, in order,
   each on the previous block's output, with the very same other arguments (masks, position
   embeddings, ...). Anything else (a block skipped or repeated, per-block masks, hidden states
   changed between blocks) returns None, and the caller runs the whole model instead.
3. Each stage then runs only its block over the captured calls; the block's outputs (with its
   Linears quantized) become the next block's calls (:meth:`BlockCall.with_hidden`).

KV caches are switched off in the captured arguments (``use_cache=False``, a cache object
replaced by None): a block run several times on the same call must not append keys and values
to a cache each time. A fresh cache used once (the whole-model path) and no cache give the same
attention (tests/execution/test_gptq.py compares the two paths bit for bit on a Llama).

:class:`BlockRunner` runs one block over the calls and makes the repeated passes cheap without
changing a bit of what they compute:

* a probe (the block once, on the first call) records the order in which the block calls the
  Linears being calibrated, unless the first batch's chain-check pass of
  :func:`capture_block_inputs` recorded it already (every block but the last; float hidden states
  there, those of the blocks quantized so far in a probe: the same order wherever it does not
  depend on the values, and a departing batch is caught as below); a pass that only needs a
  stage's inputs ends right after the last call of that stage (:meth:`BlockRunner.collect`), as
  long as the batch calls the Linears in that order so far (checked at every call; a batch that
  departs runs to the end) and every Linear of the stage is in the order (else, e.g. an expert
  the recorded batch was not routed to, every pass runs to the end); the stage's own Linears,
  about to be replaced, return zeros instead of computing while they all receive one and the
  same input tensor (else the pass is repeated with them computing);
* a layer that is already final (an earlier stage) remembers, per call, its input and output;
  a later pass that feeds it an input equal to the remembered one (``torch.equal``; neither
  tensor changed in place since, by its version counter) gets the remembered output instead of
  running it again (:meth:`BlockRunner.freeze`); a module holding parameters but no Linear
  being calibrated (a norm) remembers its calls from the first freeze on, so the next layer is
  handed the very same tensor and matches it by identity, without ``torch.equal``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from nvfp4lab.execution.calibrate import run_batch

__all__ = [
    "BlockCall",
    "BlockRunner",
    "Blocks",
    "block_call",
    "block_output",
    "capture_block_inputs",
    "find_blocks",
]


class _Stop(Exception):
    """Raised by a hook to end a forward pass early; never leaves this module."""


@dataclass(frozen=True)
class Blocks:
    """The repeated blocks: ``modules`` is ``model.get_submodule(name)``, an ``nn.ModuleList``."""

    name: str
    modules: nn.ModuleList

    def index(self, layer: str) -> int | None:
        """The block holding the module named ``layer`` (a full name below a block), or None."""
        prefix = f"{self.name}." if self.name else ""
        if not layer.startswith(prefix):
            return None
        head, dot, _ = layer[len(prefix):].partition(".")
        if not dot or not head.isdigit() or int(head) >= len(self.modules):
            return None
        return int(head)


def find_blocks(model: nn.Module, names: Sequence[str]) -> Blocks | None:
    """The ``nn.ModuleList`` (below or equal to ``model``) whose children hold the most of the
    modules named ``names`` (the outermost one on a tie), or None when none holds any."""
    best: Blocks | None = None
    best_count = 0
    for list_name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module):
            continue
        blocks = Blocks(list_name, module)
        count = sum(blocks.index(n) is not None for n in names)
        if count > best_count:
            best, best_count = blocks, count
    return best


def block_output(output: Any) -> torch.Tensor | None:
    """The hidden states a block returns: the tensor itself, or the first element of a tuple or
    list (older transformers blocks return ``(hidden_states, ...)``); None otherwise."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _is_cache(value: object) -> bool:
    """A key/value cache object (transformers' ``Cache`` classes and look-alikes)."""
    return not isinstance(value, torch.Tensor) and any(
        "Cache" in klass.__name__ for klass in type(value).__mro__
    )


def _no_cache(value: Any) -> Any:
    return None if _is_cache(value) else value


@dataclass(frozen=True)
class BlockCall:
    """One calibration batch at a block's entrance: the block is called as
    ``block(*args, **kwargs)``, the hidden states (a tensor, e.g. float32 ``[B, T, H]``) at
    ``args[0]`` (``key == 0``) or ``kwargs[key]``. ``batch``: the calibration batch it came from
    (its ``attention_mask`` still describes every block's tokens)."""

    batch: Any
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    key: int | str = 0

    @property
    def hidden(self) -> torch.Tensor:
        """The hidden states passed to the block."""
        value = self.args[0] if self.key == 0 else self.kwargs[str(self.key)]
        assert isinstance(value, torch.Tensor)
        return value

    def with_hidden(self, hidden: torch.Tensor) -> BlockCall:
        """The same call with other hidden states (the next block's call)."""
        if self.key == 0:
            return replace(self, args=(hidden, *self.args[1:]))
        return replace(self, kwargs={**self.kwargs, str(self.key): hidden})

    def run(self, block: nn.Module) -> Any:
        """``block(*args, **kwargs)``."""
        return block(*self.args, **self.kwargs)


def _call_of(batch: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> BlockCall | None:
    """A :class:`BlockCall` from a block's arguments, caches switched off; None when no hidden
    states tensor is found (first positional argument, or keyword ``hidden_states``)."""
    clean_args = tuple(_no_cache(a) for a in args)
    clean_kwargs = {k: _no_cache(v) for k, v in kwargs.items()}
    if "use_cache" in clean_kwargs:
        clean_kwargs["use_cache"] = False
    if clean_args and isinstance(clean_args[0], torch.Tensor):
        return BlockCall(batch, clean_args, clean_kwargs, 0)
    if isinstance(clean_kwargs.get("hidden_states"), torch.Tensor):
        return BlockCall(batch, clean_args, clean_kwargs, "hidden_states")
    return None


def block_call(batch: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> BlockCall | None:
    """The :class:`BlockCall` of a block called with ``args`` / ``kwargs`` on ``batch``, caches
    switched off as :func:`capture_block_inputs` does; None when no hidden-states tensor is
    found (first positional argument, or keyword ``hidden_states``)."""
    return _call_of(batch, args, kwargs)


def _same(a: object, b: object) -> bool:
    """The same object, or equal plain values (None, bool, int, float, str)."""
    if a is b:
        return True
    plain = (bool, int, float, str)
    return type(a) is type(b) and isinstance(a, plain) and a == b


def _same_arguments(first: BlockCall, other: BlockCall) -> bool:
    """``other`` passes its block the very same arguments as ``first``, hidden states aside."""
    if len(first.args) != len(other.args) or first.kwargs.keys() != other.kwargs.keys():
        return False
    if first.key != other.key:
        return False
    skip_arg = 0 if first.key == 0 else -1
    return all(
        _same(a, b) for i, (a, b) in enumerate(zip(first.args, other.args, strict=True))
        if i != skip_arg
    ) and all(_same(v, other.kwargs[k]) for k, v in first.kwargs.items() if k != first.key)


def _chain_calls(model: nn.Module, blocks: Blocks, batch: Any,
                 orders: dict[int, list[str]] | None = None,
                 watched: Mapping[str, nn.Module] | None = None) -> BlockCall | None:
    """Run ``batch`` up to the last block; the first block's call if the blocks form a chain
    (each called once, in order, on the previous block's output, with the same other
    arguments), else None. ``orders`` (filled when given): block index -> the names of
    ``watched`` modules in the order that block called them (every block but the last, which
    the pass does not run)."""
    n = len(blocks.modules)
    calls: list[tuple[int, BlockCall | None]] = []
    outputs: dict[int, Any] = {}

    def pre(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls.append((index, _call_of(batch, args, kwargs)))
            if index == n - 1:
                raise _Stop

        return hook

    def post(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            outputs.setdefault(index, output)

        return hook

    handles = [b.register_forward_pre_hook(pre(i), with_kwargs=True)
               for i, b in enumerate(blocks.modules)]
    handles += [b.register_forward_hook(post(i)) for i, b in enumerate(blocks.modules)]
    for name, module in (watched or {}).items() if orders is not None else ():
        index = blocks.index(name)
        if index is not None and index < n - 1:
            handles.append(module.register_forward_pre_hook(
                lambda m, a, name=name, i=index: orders.setdefault(i, []).append(name)))
    try:
        with suppress(_Stop):
            run_batch(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    if [i for i, _ in calls] != list(range(n)) or any(c is None for _, c in calls):
        if orders is not None:
            orders.clear()
        return None
    chain = [c for _, c in calls]
    first = chain[0]
    assert first is not None
    for i in range(1, n):
        call = chain[i]
        assert call is not None
        if call.hidden is not block_output(outputs.get(i - 1)) or not _same_arguments(first, call):
            return None
    return first


def capture_block_inputs(
    model: nn.Module, blocks: Blocks, batches: Sequence[Any], *,
    orders: dict[int, list[str]] | None = None,
    watched: Mapping[str, nn.Module] | None = None,
) -> list[BlockCall] | None:
    """One :class:`BlockCall` per batch: the arguments of block 0, caches switched off.

    The first batch runs up to the last block to check that the blocks form a chain (module
    docstring); None when they do not, or when a batch never reaches block 0. The others run
    only up to block 0. Memory: the hidden states of every batch at block 0 (e.g. float32
    ``[B, T, H]`` each) and what the model built for the blocks (masks, position embeddings).

    ``orders`` (a dict, filled when given): block index -> the names of the ``watched``
    modules (name -> module) in the order that block called them in the first batch's pass,
    for every block but the last: a :class:`BlockRunner`'s ``order``, so that it need not run
    its block once more to learn it.
    """
    first = _chain_calls(model, blocks, batches[0], orders, watched)
    if first is None:
        return None
    calls = [first]
    found: list[BlockCall | None] = []

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        found.append(_call_of(None, args, kwargs))
        raise _Stop

    handle = blocks.modules[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for batch in batches[1:]:
            found.clear()
            with suppress(_Stop):
                run_batch(model, batch)
            if len(found) != 1 or found[0] is None:
                return None
            calls.append(replace(found[0], batch=batch))
    finally:
        handle.remove()
    return calls


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
    tuples / lists / dicts item by item, anything else :func:`_same`."""
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
    return _same(a, b)


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
    (the first batch's pass of :func:`capture_block_inputs` through this block: then there is
    no probe). Use as a context manager (it removes its hooks and restores memoized modules on
    exit)."""

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
                raise _Stop

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
                except _Stop:
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
