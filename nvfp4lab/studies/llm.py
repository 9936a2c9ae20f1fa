"""The LLM study: what NVFP4 does to a decoder's next-token predictions (SmolLM2-135M-Instruct,
:func:`nvfp4lab.models.smollm2`) on held-out text (the evaluation part of :mod:`nvfp4lab.corpus`).

:func:`reference_run` runs the reference (float) model over a text once and keeps what comparing
needs; :func:`token_fidelity` compares a quantized model with it (or with a reference model,
running it first): perplexity of both, per-token KL divergence KL(reference ‖ quantized), top-1
agreement, each mean with a 95 % confidence interval, as a :class:`TokenFidelity`.

**How a text is scored.** It is tokenized once, without special tokens, and cut into consecutive
non-overlapping windows of ``context`` tokens; the last window is shorter when the text is not a
multiple of ``context`` (a last window of one token predicts nothing and is dropped). Each window
is its own sequence: its token t (1 ≤ t < T) is predicted from its tokens 0 … t-1, so the first
token of every window is not predicted and a window of T tokens scores T - 1 predictions. The
models run in their own dtype (float32 for SmolLM2); log-softmax, KL divergence and negative
log-likelihood (NLL) are computed in float64, in nats:
``KL(P ‖ Q) = Σ_v P(v) (log P(v) - log Q(v))`` at each predicted position, P the reference's
next-token distribution, Q the quantized model's. Perplexity is ``exp(mean NLL)`` of the true next
tokens.

**Confidence intervals** (:mod:`nvfp4lab.studies.llm_statistics`): the windows are the
independent units; every mean (KL divergence, perplexity and its ratio, top-1 agreement) has a 95 %
interval, and two configurations on the same run compare by :func:`paired_difference`.

**One reference pass for many configurations.** A :class:`ReferenceRun` keeps the reference's
per-token NLL and, to give its logits again later, the input of its output head (the hidden
states, ``[B, T, hidden]`` per batch: 576 floats a token for SmolLM2, not 49152) with a copy of the
head; the logits recomputed from them were checked, batch by batch, to equal the model's own bit
for bit. A model whose logits are not its head's output (or without ``get_output_embeddings``) is
kept instead and run again at each comparison. Pass the run to :func:`token_fidelity` for each
quantized model.
"""

from __future__ import annotations

import copy
import math
import numbers
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nvfp4lab import corpus
from nvfp4lab.models import module_device
from nvfp4lab.settings import tqdm_class
from nvfp4lab.studies.llm_statistics import (
    PairedDifference,
    TokenFidelity,
    fidelity_of,
    mean_ci,
    paired_difference,
)
from nvfp4lab.vocab import CorpusPart

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_CONTEXT",
    "LOGITS_KEPT_BYTES",
    "PairedDifference",
    "ReferenceRun",
    "TokenFidelity",
    "fidelity_of",
    "mean_ci",
    "output_head_copy",
    "paired_difference",
    "reference_run",
    "token_fidelity",
    "windows_of",
]

#: Tokens per window (SmolLM2 was trained with up to 8192).
DEFAULT_CONTEXT = 512
#: Windows run through a model together (at 512 tokens, SmolLM2's logits are 100 MB a window).
DEFAULT_BATCH_SIZE = 4
#: A :class:`ReferenceRun` keeps its head's logits (CPU) when all of them fit in this many bytes
#: (and in a quarter of the memory available when it keeps the first).
LOGITS_KEPT_BYTES = 1 << 30
#: Predicted positions whose float64 log-softmax is computed at once on a GPU (limits the memory).
_ROWS = 256
#: On the CPU, the float64 temporaries of one chunk of rows stay about this size (bytes per
#: tensor) so that the chunk's dozen passes run in cache: 4 rows of SmolLM2's 49,152 logits, 2.0x
#: faster than 256 rows on 2 threads, with the same bits (the sums run along each row).
_CPU_CHUNK_BYTES = 3 << 19


def _chunk_rows(rows: torch.Tensor) -> int:
    """Rows of ``rows [R, V]`` per float64 chunk (:func:`_chunks`): at least 2, as one row
    takes another reduction path in torch, so its sums may differ in the last bit."""
    if rows.device.type != "cpu":
        return _ROWS
    return max(2, _CPU_CHUNK_BYTES // (8 * max(1, rows.shape[-1])))


def _chunks(rows: torch.Tensor, n: int | None = None) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of the chunks of ``n`` rows (default ``R``) like ``rows [R, V]``:
    :func:`_chunk_rows` each, a last chunk of one row joined to the one before."""
    n, step, start = rows.shape[0] if n is None else n, _chunk_rows(rows), 0
    while start < n:
        stop = n if n - start - step <= 1 else start + step
        yield start, stop
        start = stop


def _row_chunks(logits: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """:func:`_chunks` of the predicting rows ``b·(T-1) + t`` (``t < T-1``) of ``logits [B, T,
    V]``: ``(start, stop, rows)``, a view where the chunk lies in one window, a copy of its rows
    where it spans windows (never a ``[B·(T-1), V]`` copy; one-row windows still make no one-row
    chunk, whose sums torch reduces another way)."""
    windows, predicted = logits.shape[0], logits.shape[1] - 1
    if predicted < 1:
        return
    for start, stop in _chunks(logits, windows * predicted):
        first, last = start // predicted, (stop - 1) // predicted
        if first == last:
            offset = first * predicted
            yield start, stop, logits[first, start - offset:stop - offset]
            continue
        parts = [logits[w, max(start - w * predicted, 0):min(stop - w * predicted, predicted)]
                 for w in range(first, last + 1)]
        yield start, stop, torch.cat(parts)


#: A causal LM: ``model(input_ids=int64 [B, T])`` returns an object with ``.logits`` ``[B, T, V]``
#: (or the logits tensor itself).
CausalLM = Callable[..., Any]


# ---------------------------------------------------------------------------------------------
# Windows
# ---------------------------------------------------------------------------------------------


def _whole(name: str, value: object, minimum: int, meaning: str) -> int:
    """``value`` as an int >= ``minimum``: TypeError when it is not a whole number (a bool, a
    float such as 2.5, a string), ValueError when it is too small; both name ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a whole number >= {minimum} ({meaning}), got {value!r} "
                        f"({type(value).__name__}); pass an int")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} ({meaning}), got {value}")
    return int(value)


def windows_of(tokens: int, context: int) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of the consecutive non-overlapping windows of ``context`` tokens that
    cover ``tokens`` tokens; the last is shorter when ``tokens`` is not a multiple of ``context``,
    and left out when it would hold a single token (nothing to predict). ``context``: an int
    >= 2 (TypeError / ValueError otherwise)."""
    context = _whole("context", context, 2, "tokens per window, one to predict from")
    spans = tuple((start, min(start + context, tokens)) for start in range(0, tokens, context))
    return tuple((a, b) for a, b in spans if b - a >= 2)


def _batches(
    windows: Sequence[tuple[int, int]], batch_size: int
) -> tuple[tuple[int, ...], ...]:
    """Indices of ``windows`` in runs of at most ``batch_size`` consecutive windows of one length
    (they are stacked into one ``[B, T]`` input)."""
    batch_size = _whole("batch_size", batch_size, 1, "windows per forward pass")
    out: list[list[int]] = []
    for i, (a, b) in enumerate(windows):
        last = out[-1] if out else None
        if (last is not None and len(last) < batch_size
                and windows[last[0]][1] - windows[last[0]][0] == b - a):
            last.append(i)
        else:
            out.append([i])
    return tuple(tuple(batch) for batch in out)


def _stack(
    ids: torch.Tensor, windows: Sequence[tuple[int, int]], batch: Sequence[int]
) -> torch.Tensor:
    """The windows ``batch`` (indices into ``windows``) of ``ids`` stacked, int64 ``[B, T]``."""
    return torch.stack([ids[windows[i][0] : windows[i][1]] for i in batch])


def _token_ids(text: str | torch.Tensor | None, tokenizer: Any) -> torch.Tensor:
    """The tokens to score, int64 ``[N]`` on the CPU: ``text`` tokenized once (default: the
    evaluation part of the corpus, with SmolLM2's tokenizer), or ``text`` itself when it is a
    tensor of token ids."""
    if isinstance(text, torch.Tensor):
        if text.dtype.is_floating_point or text.dtype.is_complex or text.dim() != 1:
            raise TypeError(f"token ids must be a 1-D integer tensor, got {text.dtype} "
                            f"{tuple(text.shape)}")
        return text.to(device="cpu", dtype=torch.int64)
    if text is None:
        text = corpus.pydoc_text(CorpusPart.EVALUATION)
    if tokenizer is None:
        from nvfp4lab.models import smollm2_tokenizer

        tokenizer = smollm2_tokenizer()
    return corpus.token_ids(tokenizer, text)


# ---------------------------------------------------------------------------------------------
# Running a model
# ---------------------------------------------------------------------------------------------


def _device(model: CausalLM) -> torch.device:
    return module_device(model) if isinstance(model, nn.Module) else torch.device("cpu")


#: What a model passed as a causal LM must be, said by every refusal.
_CAUSAL_LM = ("a causal language model: model(input_ids=int64 [B, T]) returning .logits "
              "[B, T, vocabulary], the next token predicted from the tokens before it (e.g. "
              "transformers' AutoModelForCausalLM)")


def _check_causal_lm(model: CausalLM, role: str) -> None:
    """TypeError when ``model`` is a transformers model but no decoder-only causal LM
    (``BertModel``, ``BertForMaskedLM``, ``LlamaModel``, encoder-decoders; only types with a
    masked-LM head read ``is_decoder``, False in every transformers 4 config); others trusted."""
    config = getattr(model, "config", None)
    can_generate = getattr(model, "can_generate", None)
    if not (isinstance(model, nn.Module) and callable(can_generate) and config is not None):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES
    both_ways = (getattr(config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES
                 and not getattr(config, "is_decoder", False))
    if not can_generate() or getattr(config, "is_encoder_decoder", False) or both_ways:
        raise TypeError(
            f"the {role} model is a {type(model).__name__} ({config.model_type}), not a "
            f"decoder that predicts the next token; token_fidelity needs {_CAUSAL_LM}"
        )


def _vocabulary(model: CausalLM) -> int | None:
    """The number of token ids ``model`` embeds (its input embedding's rows, else its config's
    ``vocab_size``); None when it does not say."""
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    if isinstance(embedding, nn.Embedding):
        return int(embedding.num_embeddings)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _check_ids(ids: torch.Tensor, vocabulary: int | None, role: str) -> None:
    """ValueError naming the first token id of ``ids`` that is negative or, with a known
    ``vocabulary``, that ``role``'s model has no entry for (a tokenizer that is not the
    model's)."""
    if not ids.numel():
        return
    bad = ids < 0 if vocabulary is None else (ids < 0) | (ids >= vocabulary)
    if not bool(bad.any()):
        return
    first = tuple(int(i) for i in torch.nonzero(bad)[0])
    where = first[0] if len(first) == 1 else first
    limits = "ids are >= 0" if vocabulary is None else (
        f"the {role} model's vocabulary is ids 0..{vocabulary - 1}")
    raise ValueError(
        f"token id {int(ids[first])} at position {where} is out of range ({limits}; "
        f"{int(bad.sum())} id(s) out of range): the token ids are not the model's; tokenize "
        "the text with the model's own tokenizer"
    )


def _forward(model: CausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """``model``'s logits ``[B, T, V]`` for ``input_ids [B, T]`` (moved to its device), without
    a key-value cache where the model has that switch."""
    kwargs = {"use_cache": False} if hasattr(getattr(model, "config", None), "use_cache") else {}
    with torch.no_grad():
        out = model(input_ids=input_ids.to(_device(model)), **kwargs)
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{type(model).__name__} returned a {type(out).__name__} without "
                        f"logits; token_fidelity needs {_CAUSAL_LM}")
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits of shape {tuple(logits.shape)} for input_ids of shape "
                         f"{tuple(input_ids.shape)}: expected [B, T, vocabulary]")
    _check_ids(input_ids, logits.shape[-1], type(model).__name__)  # ids its logits lack
    return logits


def _output_head(model: CausalLM) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, nn.Module) else None


def output_head_copy(model: CausalLM) -> nn.Module | None:
    """A deep copy of ``model``'s output head (``get_output_embeddings()``), as a
    :class:`ReferenceRun` keeps it; None when the model has none."""
    head = _output_head(model)
    return copy.deepcopy(head) if head is not None else None


def _softmax_parts(
    rows: torch.Tensor, top: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For float64 ``rows [R, V]`` and their maxima ``top [R, 1]``: ``exp(rows - top)``
    ``[R, V]``, its row sums ``[R]`` and the log normalizer ``log Σ_v exp(rows) = top +
    log(sum)`` ``[R]`` (one exp per element)."""
    scaled = (rows - top).exp_()
    total = scaled.sum(dim=-1)
    return scaled, total, top.squeeze(-1) + total.log()


def _nll(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """-log P(next token), float64 ``[B·(T-1)]`` on the CPU."""
    targets = input_ids[:, 1:].reshape(-1).to(logits.device)
    out = torch.empty(targets.shape[0], dtype=torch.float64)
    for start, stop, rows in _row_chunks(logits):
        chunk = rows.double()
        _, _, normalizer = _softmax_parts(chunk, chunk.amax(dim=-1, keepdim=True))
        picked = chunk.gather(1, targets[start:stop, None]).squeeze(1)
        out[start:stop] = (normalizer - picked).cpu()
    return out


def _compare(
    reference: torch.Tensor, quantized: torch.Tensor, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per predicted position of logits ``[B, T, V]`` (on the quantized logits' device):
    KL(reference ‖ quantized) and the quantized model's NLL, float64, and whether the two
    argmaxes agree (bool), each ``[B·(T-1)]`` on the CPU.

    With reference logits r, quantized logits q, P = softmax(r) and normalizers ``Z_r``, ``Z_q``:
    ``KL = Σ_v P(v) ((r_v - log Z_r) - (q_v - log Z_q)) = Σ_v P(v) (r_v - q_v) - (log Z_r -
    log Z_q) Σ_v P(v)``, all in float64: two exps per vocabulary entry instead of the four of two
    log-softmaxes, and exactly 0 for identical logits. Logits must be finite.

    Memory traffic sets the pace on a CPU: chunks are views (:func:`_row_chunks`), and one
    ``max`` gives each row's maximum and first index (the argmax: widening is exact)."""
    targets = input_ids[:, 1:].reshape(-1).to(quantized.device)
    n = targets.shape[0]
    kld, nll = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    agree = torch.empty(n, dtype=torch.bool)
    for (start, stop, ref_rows), (_, _, q_rows) in zip(
            _row_chunks(reference), _row_chunks(quantized), strict=True):
        r = ref_rows.to(q_rows.device, torch.float64, copy=True)  # changed in place below
        q = q_rows.double()
        top_r, argmax_r = r.max(dim=-1, keepdim=True)
        top_q, argmax_q = q.max(dim=-1, keepdim=True)
        agree[start:stop] = (argmax_r == argmax_q).squeeze(1).cpu()
        scaled, total, log_zr = _softmax_parts(r, top_r)
        _, _, log_zq = _softmax_parts(q, top_q)
        p = scaled.div_(total[:, None])
        picked = q.gather(1, targets[start:stop, None]).squeeze(1)
        nll[start:stop] = (log_zq - picked).cpu()
        divergence = (p * r.sub_(q)).sum(-1) - (log_zr - log_zq) * p.sum(-1)
        kld[start:stop] = divergence.cpu()
    return kld, nll, agree


def _bar(total: int, desc: str, progress: bool) -> Any:
    """A bar over ``total`` windows, drawn even where stderr is not a terminal (a notebook
    kernel rendering a report page) unless ``progress`` is False."""
    return tqdm_class()(total=total, desc=desc, unit="window", file=sys.stderr,
                        disable=not progress, leave=False)


# ---------------------------------------------------------------------------------------------
# The reference, run once
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ReferenceRun:
    """The reference model run once over a text, kept to compare many quantized models with
    (:func:`reference_run` makes it, :func:`token_fidelity` takes it).

    ``ids``: the text's tokens, int64 ``[N]`` (CPU). ``windows``: ``(start, stop)`` into
    ``ids`` (:func:`windows_of`); ``batches``: the windows run together, as indices. ``nll``:
    the reference's -log P(next token), float64 ``[tokens]`` in window order (nats).
    ``hidden``: per batch, the input of the reference's output head ``[B, T, hidden]`` (its
    dtype and device), with ``head`` a copy of that head, made when the run was (later changes to
    the model do not reach it); both None when the head's output is not the model's logits, and
    then ``model`` is the reference itself, run again at each comparison (do not change it
    in place afterwards: quantize a copy). Runs compare by identity. Unless ``keep_logits`` is
    False (the streamed study, whose point is memory), the head's logits are kept after their
    first use while all of them fit in :data:`LOGITS_KEPT_BYTES` (SmolLM2's 2,040 scored tokens:
    400 MB, 0.4 s of head GEMM saved per compared model).
    """

    ids: torch.Tensor = field(repr=False)
    windows: tuple[tuple[int, int], ...] = field(repr=False)
    batches: tuple[tuple[int, ...], ...] = field(repr=False)
    context: int
    batch_size: int
    nll: torch.Tensor = field(repr=False)
    hidden: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)
    head: nn.Module | None = field(default=None, repr=False)
    model: CausalLM | None = field(default=None, repr=False)
    keep_logits: bool = field(default=True, repr=False)
    _kept_logits: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    @property
    def tokens(self) -> int:
        """Predicted tokens (``N`` less one per window)."""
        return int(self.nll.numel())

    @property
    def window_tokens(self) -> tuple[int, ...]:
        """Predicted tokens per window (``stop - start - 1``)."""
        return tuple(b - a - 1 for a, b in self.windows)

    @property
    def perplexity(self) -> float:
        """The reference's perplexity on the text, ``exp(mean NLL)``."""
        return math.exp(float(self.nll.mean()))

    def input_ids(self, batch: int) -> torch.Tensor:
        """The windows of batch ``batch`` stacked, int64 ``[B, T]`` (CPU)."""
        return _stack(self.ids, self.windows, self.batches[batch])

    def logits(self, batch: int) -> torch.Tensor:
        """The reference's logits for batch ``batch``, ``[B, T, V]``: its head applied to the
        kept hidden states (bit for bit the model's own), or the model run again. Read it,
        do not change it in place: it may be the kept tensor."""
        if self.hidden is not None and self.head is not None:
            kept = self._kept_logits.get(batch)
            if kept is not None:
                return kept
            with torch.no_grad():
                logits = self.head(self.hidden[batch])
            if self._logits_fit(logits):
                self._kept_logits[batch] = logits
            return logits
        if self.model is None:
            raise ValueError("this ReferenceRun keeps neither hidden states nor the model")
        return _forward(self.model, self.input_ids(batch))

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and deep-copied without the kept logits (they are made again when used)."""
        return {**self.__dict__, "_kept_logits": {}}

    def _logits_fit(self, logits: torch.Tensor) -> bool:
        """Whether every batch's logits, each the size of ``logits`` per window, fit in
        :data:`LOGITS_KEPT_BYTES` and in a quarter of the memory available now (on the CPU; a
        GPU's memory is left alone)."""
        if not self.keep_logits or logits.device.type != "cpu":
            return False
        from nvfp4lab.bench.runner import available_memory_bytes

        total = logits.element_size() * logits[0].numel() * len(self.windows)
        available = available_memory_bytes("cpu")
        return total <= LOGITS_KEPT_BYTES and (available is None or 4 * total <= available)


def reference_run(
    model: CausalLM,
    text: str | torch.Tensor | None = None,
    *,
    tokenizer: Any = None,
    context: int = DEFAULT_CONTEXT,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_tokens: int | None = None,
    progress: bool = True,
) -> ReferenceRun:
    """Run the reference ``model`` once over ``text`` and keep what :func:`token_fidelity`
    needs to compare quantized models with it (see :class:`ReferenceRun`).

    ``text``: a string, tokenized once by ``tokenizer`` (default: SmolLM2's,
    :func:`nvfp4lab.models.smollm2_tokenizer`), or the token ids themselves (a 1-D integer
    tensor); default: the corpus's evaluation part (:func:`nvfp4lab.corpus.pydoc_text`).
    ``max_tokens``: score only the first ``max_tokens`` tokens. ``context``: tokens per window;
    ``batch_size``: windows per forward pass. A progress bar (:func:`settings.tqdm_class`)
    counts the windows unless ``progress`` is False.

    Refused before the model runs: ``context`` / ``batch_size`` / ``max_tokens`` that are not
    whole numbers (TypeError) or too small (ValueError); a model that is not a causal LM
    (TypeError); token ids outside the model's vocabulary (ValueError: a tokenizer that is not
    the model's).
    """
    context = _whole("context", context, 2, "tokens per window, one to predict from")
    batch_size = _whole("batch_size", batch_size, 1, "windows per forward pass")
    if max_tokens is not None:
        max_tokens = _whole("max_tokens", max_tokens, 2, "tokens scored")
    _check_causal_lm(model, "reference")
    ids = _token_ids(text, tokenizer)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    _check_ids(ids, _vocabulary(model), "reference")
    windows = windows_of(ids.numel(), context)
    if not windows:
        raise ValueError(f"the text has {ids.numel()} token(s): nothing to predict")
    batches = _batches(windows, batch_size)
    head = _output_head(model)
    head_copy = copy.deepcopy(head) if head is not None else None
    captured: list[torch.Tensor] = []
    handle = None
    if head is not None:
        handle = head.register_forward_pre_hook(
            lambda module, args: captured.append(args[0].detach())
        )
    hidden: list[torch.Tensor] | None = [] if head is not None else None
    nll: list[torch.Tensor] = []
    try:
        with _bar(len(windows), "reference", progress) as bar:
            for batch in batches:
                input_ids = _stack(ids, windows, batch)
                captured.clear()
                logits = _forward(model, input_ids)
                if hidden is not None:
                    hidden = _keep_hidden(hidden, captured, head_copy, logits)
                nll.append(_nll(logits, input_ids))
                bar.update(len(batch))
    finally:
        if handle is not None:
            handle.remove()
    kept = tuple(hidden) if hidden is not None else None
    return ReferenceRun(
        ids=ids, windows=windows, batches=batches, context=context, batch_size=batch_size,
        nll=torch.cat(nll), hidden=kept, head=head_copy if kept is not None else None,
        model=None if kept is not None else model,
    )


def _keep_hidden(
    hidden: list[torch.Tensor], captured: list[torch.Tensor], head: nn.Module | None,
    logits: torch.Tensor,
) -> list[torch.Tensor] | None:
    """``hidden`` with this batch's head input appended, or None (keep the model instead)
    when the head did not run exactly once or its output is not bit for bit ``logits``."""
    if head is None or len(captured) != 1:
        return None
    with torch.no_grad():
        again = head(captured[0])
    if again.shape != logits.shape or not torch.equal(again, logits):
        return None
    hidden.append(captured[0])
    return hidden


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------


def token_fidelity(
    reference: CausalLM | ReferenceRun,
    quantized: CausalLM,
    text: str | torch.Tensor | None = None,
    *,
    tokenizer: Any = None,
    context: int | None = None,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    progress: bool = True,
) -> TokenFidelity:
    """How closely ``quantized`` predicts the next token as ``reference`` does, on ``text``.

    ``reference``: the float causal LM, run here first (:func:`reference_run` with ``text``,
    ``tokenizer``, ``context`` (default :data:`DEFAULT_CONTEXT`), ``batch_size`` (default
    :data:`DEFAULT_BATCH_SIZE`), ``max_tokens``), or a :class:`ReferenceRun` made once and
    passed for every quantized model (then leave those five arguments out: the run fixes them).
    ``quantized``: a causal LM with the same vocabulary, ``quantized(input_ids=int64 [B, T])``
    returning ``.logits [B, T, V]``; it runs the run's windows in the run's batches. A progress
    bar counts the windows unless ``progress`` is False. Returns a :class:`TokenFidelity`.
    Bad arguments, a model that is not a causal LM and token ids beyond either model's
    vocabulary are refused before anything runs, as :func:`reference_run` says.
    """
    _check_causal_lm(quantized, "quantized")
    if not isinstance(reference, ReferenceRun):
        sizes = (_vocabulary(reference), _vocabulary(quantized))
        if None not in sizes and sizes[0] != sizes[1]:
            raise ValueError(f"the reference model has a vocabulary of {sizes[0]} tokens, the "
                             f"quantized model {sizes[1]}: compare a model with its own "
                             "quantized copy")
    if isinstance(reference, ReferenceRun):
        given = {"text": text, "tokenizer": tokenizer, "context": context,
                 "batch_size": batch_size, "max_tokens": max_tokens}
        clash = [name for name, value in given.items() if value is not None]
        if clash:
            raise ValueError(
                f"a ReferenceRun fixes the text and its windows: leave out {', '.join(clash)} "
                "(or pass the reference model instead)"
            )
        run = reference
    else:
        run = reference_run(
            reference, text, tokenizer=tokenizer,
            context=DEFAULT_CONTEXT if context is None else context,
            batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
            max_tokens=max_tokens, progress=progress,
        )
    _check_ids(run.ids, _vocabulary(quantized), "quantized")
    kld, nll, agree = [], [], []
    with _bar(len(run.windows), "quantized", progress) as bar:
        for index, batch in enumerate(run.batches):
            input_ids = run.input_ids(index)
            q_logits = _forward(quantized, input_ids)
            ref_logits = run.logits(index)
            if ref_logits.shape[-1] != q_logits.shape[-1]:
                raise ValueError(f"the reference predicts {ref_logits.shape[-1]} tokens, the "
                                 f"quantized model {q_logits.shape[-1]}")
            k, n, a = _compare(ref_logits, q_logits, input_ids)
            kld.append(k)
            nll.append(n)
            agree.append(a)
            bar.update(len(batch))
    return fidelity_of(torch.cat(kld), torch.cat(nll), run.nll, torch.cat(agree),
                       run.window_tokens, run.context)
