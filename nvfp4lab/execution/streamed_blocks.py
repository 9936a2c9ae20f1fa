"""Run a model block by block when only one block's weights are in memory at a time.

:mod:`nvfp4lab.execution.sequential` runs a model's repeated blocks one at a time over captured
calls (GPTQ's calibration). This module adds what a model whose blocks are NOT materialized
needs (their weights on the ``meta`` device, read from disk one block at a time by the caller):

* :func:`stand_ins`: while inside, every block's ``forward`` is replaced (an instance
  attribute; hooks still fire) by a stand-in, so the model's own code before and after its
  blocks (embeddings, masks, rotary position embeddings, final norm, output head, logit
  softcapping, ...) runs with real weights while the meta blocks never compute;
* :func:`capture_calls`: every block's call per batch (:class:`StreamedBatch`: one
  :class:`~nvfp4lab.execution.sequential.BlockCall` per block, as blocks may get different
  masks, and block 0's hidden states), captured in one pass with pass-through stand-ins, the
  blocks checked to form a chain (each called once, in order, nothing between them);
* :func:`placeholder_weights`: while inside, the blocks' meta tensors are zeros that take no
  memory (one zero expanded to each shape), so a whole forward can run where something needs one
  (``quantize_kv_cache``'s one-token probe, which only looks at which modules call attention);
* :func:`run_calls`: one materialized block over every batch, its outputs as the hidden states
  for the next block;
* :func:`finish`: the model run on one batch with the last block handing back given hidden
  states (the streamed output of the real last block): the model's own output (logits);
* :func:`quantize_block`: ``quantize_model`` on one block, GPTQ's calibration included (the
  block's calls as the calibration batches, each with its batch's ``attention_mask``).

Each function computes exactly what the whole model computes on the same inputs: the blocks see
the same arguments, the code outside them runs unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from nvfp4lab.execution.calibrate import run_batch
from nvfp4lab.execution.quantize_report import QuantizeReport
from nvfp4lab.execution.sequential import BlockCall, Blocks, block_call, block_output
from nvfp4lab.execution.whole_model import quantize_model
from nvfp4lab.vocab import QuantMethod

__all__ = [
    "StandIn",
    "StreamedBatch",
    "capture_calls",
    "finish",
    "pass_through",
    "placeholder_weights",
    "quantize_block",
    "run_calls",
    "stand_ins",
]

#: A block's stand-in: ``(block index, args, kwargs) -> what the block returns``.
StandIn = Callable[[int, tuple[Any, ...], dict[str, Any]], Any]


def pass_through(index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """A stand-in that returns the hidden states it is given (first positional argument, or
    keyword ``hidden_states``)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise ValueError(f"block {index} is called without a hidden-states tensor (first "
                         "argument or hidden_states=): it cannot be run block by block")
    return hidden


@contextlib.contextmanager
def stand_ins(blocks: Blocks, stand_in: StandIn = pass_through) -> Iterator[None]:
    """Inside, block ``i`` answers ``stand_in(i, args, kwargs)`` instead of running (its
    ``forward`` replaced; its hooks still run). On exit each block's own ``forward`` is back."""
    saved: list[tuple[nn.Module, Any]] = []
    try:
        for index, block in enumerate(blocks.modules):
            saved.append((block, vars(block).get("forward")))

            def forward(*args: Any, _index: int = index, **kwargs: Any) -> Any:
                return stand_in(_index, args, kwargs)

            block.forward = forward  # type: ignore[method-assign]
        yield
    finally:
        for block, previous in saved:
            if previous is None:
                vars(block).pop("forward", None)
            else:
                block.forward = previous  # type: ignore[method-assign]


@contextlib.contextmanager
def placeholder_weights(blocks: Blocks) -> Iterator[None]:
    """Inside, every parameter and buffer of ``blocks`` that is on the meta device is a zero of
    its dtype expanded to its shape (stride 0: no memory; an op may copy one layer's weight at a
    time); on exit the meta tensors are back. For forwards whose values do not matter."""
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for module in blocks.modules.modules():
            for store in (module._parameters, module._buffers):
                for name, tensor in list(store.items()):
                    if tensor is None or not tensor.is_meta:
                        continue
                    zero = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)
                    saved.append((store, name, tensor))
                    store[name] = (nn.Parameter(zero, requires_grad=False)
                                   if isinstance(tensor, nn.Parameter) else zero)
        yield
    finally:
        for store, name, tensor in reversed(saved):
            store[name] = tensor


_NO_HIDDEN = torch.empty(0)


@dataclass(frozen=True)
class StreamedBatch:
    """One batch on its way through the blocks: ``calls[i]`` is block ``i``'s call as the model
    makes it (its hidden states left out), ``hidden`` the hidden states entering the next block
    to run (e.g. ``[B, T, H]``). Blocks may get different arguments (masks of sliding-window and
    full-attention layers)."""

    calls: tuple[BlockCall, ...] = field(repr=False)
    hidden: torch.Tensor = field(repr=False)

    def call(self, index: int) -> BlockCall:
        """Block ``index``'s call on :attr:`hidden`."""
        return self.calls[index].with_hidden(self.hidden)

    def moved(self, hidden: torch.Tensor) -> StreamedBatch:
        """The batch with other hidden states (a block's output)."""
        return replace(self, hidden=hidden)


def capture_calls(model: nn.Module, blocks: Blocks, batches: Sequence[Any]) -> list[StreamedBatch]:
    """Every block's call for each of ``batches`` (model inputs as :func:`run_batch` takes
    them; each runs once through the model with the blocks standing in as pass-throughs, their
    weights possibly on the meta device), caches switched off as in
    :func:`~nvfp4lab.execution.sequential.capture_block_inputs`; ``hidden``: block 0's input.

    ValueError when the blocks are not a chain: each called once, in order, on the previous
    block's output (nothing changes the hidden states between blocks). Memory: the hidden states
    of every batch and what the model builds for its blocks (masks, position embeddings)."""
    last = len(blocks.modules) - 1
    out: list[StreamedBatch] = []
    for batch in batches:
        seen: list[tuple[int, BlockCall | None]] = []

        def record(index: int, args: tuple[Any, ...], kwargs: dict[str, Any],
                   _seen: list[tuple[int, BlockCall | None]] = seen, _batch: Any = batch) -> Any:
            _seen.append((index, block_call(_batch, args, kwargs)))
            if index == last:
                raise _Done  # nothing after the blocks is needed (no logits computed)
            return pass_through(index, args, kwargs)

        with torch.no_grad(), stand_ins(blocks, record), contextlib.suppress(_Done):
            run_batch(model, batch)
        out.append(_checked(model, blocks, seen))
    return out


class _Done(Exception):
    """Ends a capture pass at the last block; never leaves this module."""


def _checked(model: nn.Module, blocks: Blocks,
             seen: list[tuple[int, BlockCall | None]]) -> StreamedBatch:
    """The :class:`StreamedBatch` of one capture pass; ValueError when it is not a chain."""
    n = len(blocks.modules)
    calls = [c for _, c in seen]
    if [i for i, _ in seen] != list(range(n)) or any(c is None for c in calls):
        raise ValueError(
            f"{type(model).__name__}'s blocks ({blocks.name}) are not called once each, in "
            "order, with their hidden states: the model cannot be run block by block"
        )
    first = calls[0]
    assert first is not None
    if any(c is not None and c.hidden is not first.hidden for c in calls):
        raise ValueError(
            f"{type(model).__name__} changes the hidden states between its blocks "
            f"({blocks.name}): the model cannot be run block by block"
        )
    return StreamedBatch(tuple(c.with_hidden(_NO_HIDDEN) for c in calls if c is not None),
                         first.hidden)


def run_calls(block: nn.Module, index: int,
              batches: Sequence[StreamedBatch]) -> list[StreamedBatch]:
    """``block`` (block ``index`` of the model, materialized) run on every batch's call (no
    grad); its outputs as the hidden states for the next block. ValueError when the block
    returns no hidden-states tensor."""
    out = []
    with torch.no_grad():
        for batch in batches:
            hidden = block_output(batch.call(index).run(block))
            if hidden is None:
                raise ValueError(f"block {type(block).__name__} returned no tensor (nor a tuple "
                                 "starting with one): cannot feed the next block")
            out.append(batch.moved(hidden))
    return out


def finish(model: nn.Module, blocks: Blocks, batch: Any, hidden: torch.Tensor) -> Any:
    """``model``'s output on ``batch`` (:func:`run_batch`, no grad) when its last block
    returns ``hidden`` (e.g. ``[B, T, H]``, the real last block's output on this batch) and the
    others pass through: the code after the blocks (final norm, head, ...) runs as usual."""
    last = len(blocks.modules) - 1

    def stand_in(index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return hidden if index == last else pass_through(index, args, kwargs)

    with torch.no_grad(), stand_ins(blocks, stand_in):
        return run_batch(model, batch)


class _OneBlock(nn.Module):
    """One block as a model whose inputs are its calls: ``model(call=BlockCall,
    hidden_states=tensor[, attention_mask=...])`` runs the call with those hidden states."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([block])

    def forward(self, call: BlockCall, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> Any:
        return call.with_hidden(hidden_states).run(self.layers[0])


def _as_batch(call: BlockCall) -> dict[str, Any]:
    """A calibration batch for :class:`_OneBlock`: the call, its hidden states, and the
    ``attention_mask`` of the batch it came from (GPTQ leaves padding out of the Hessians)."""
    batch: dict[str, Any] = {"call": call, "hidden_states": call.hidden}
    mask = call.batch.get("attention_mask") if isinstance(call.batch, Mapping) else None
    if isinstance(mask, torch.Tensor):
        batch["attention_mask"] = mask
    return batch


def quantize_block(
    block: nn.Module, calls: Sequence[BlockCall] = (), **options: Any
) -> QuantizeReport:
    """``quantize_model`` on ``block`` alone (in place), with ``options`` its keywords
    (``backend``, ``method``, ``convention``, ``share_global_scale``, ...; not ``calibration``).

    GPTQ methods calibrate on ``calls``: the block's calls as the whole model makes them (each
    with its batch: its ``attention_mask`` masks padding out of the Hessians, as in the whole
    model), so each layer's Hessian is the one :func:`~nvfp4lab.execution.gptq_model.
    sequential_gptq` collects in the whole model when the earlier blocks are quantized the same
    way. Fused groups (q/k/v, gate/up) lie within one block, so their shared global scales are
    the whole model's. The report names layers as ``layers.0.<name in the block>``."""
    if "calibration" in options:
        raise TypeError("quantize_block takes the block's calls, not calibration=")
    method = options.get("method", QuantMethod.RTN)
    gptq = method != QuantMethod.RTN
    if gptq and not calls:
        raise ValueError(f"method={str(method)!r} needs the block's calibration calls")
    wrapper = _OneBlock(block)
    batches = [_as_batch(call) for call in calls] if gptq else None
    return quantize_model(wrapper, calibration=batches, **options)
