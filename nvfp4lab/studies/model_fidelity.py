"""The model study: what NVFP4 does to a real model (all-MiniLM-L6-v2, :mod:`nvfp4lab.models`).

:func:`embedding_fidelity` (cosine similarity of quantized vs float embeddings, per sentence, plus
how much the sentence-to-sentence similarity matrix moves), :func:`paraphrase_recall` (a small
retrieval task), :func:`layer_sqnr` (per-layer output SQNR through forward hooks) and
:func:`capture_inputs` (each Linear's real input activations), on :data:`SENTENCES`, a small set
written for this project (nothing is downloaded). :data:`CALIBRATION_SENTENCES`, written for this
project too and disjoint from :data:`SENTENCES`, calibrate GPTQ (:func:`calibration_batches`), so
:data:`SENTENCES` stay held out. Notebook 05's formats and GPTQ sections live in
:mod:`nvfp4lab.studies.model_formats` and :mod:`nvfp4lab.studies.model_gptq`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from nvfp4lab import metrics
from nvfp4lab.models import SentenceEncoder, module_device

__all__ = [
    "CALIBRATION_SENTENCES",
    "PARAPHRASE_PAIRS",
    "SENTENCES",
    "FidelityReport",
    "LayerSQNR",
    "calibration_batches",
    "capture_inputs",
    "embedding_fidelity",
    "layer_sqnr",
    "linear_names",
    "paraphrase_recall",
]

#: Sentences written for nvfp4lab: paraphrase pairs, near misses and unrelated topics, so both
#: absolute fidelity and the similarity structure between sentences can be checked.
SENTENCES: tuple[str, ...] = (
    "The cat is sleeping on the warm windowsill.",
    "A cat naps in the sun by the window.",
    "My dog refuses to walk in the rain.",
    "The puppy hates going outside when it is wet.",
    "Four-bit floating point numbers have one sign bit, two exponent bits and one mantissa bit.",
    "An FP4 E2M1 value stores a sign, a two-bit exponent and a single mantissa bit.",
    "Each block of sixteen weights shares one FP8 scale factor.",
    "A scale stored in eight-bit floating point is applied to every group of 16 values.",
    "The GPU finished the matrix multiplication in under a millisecond.",
    "Tensor cores multiply small matrices very quickly.",
    "She baked fresh bread every Sunday morning.",
    "On weekends he makes pancakes for the whole family.",
    "The train to Lyon leaves from platform nine at noon.",
    "Our flight was delayed by three hours because of fog.",
    "Quantization trades a little accuracy for much less memory.",
    "Storing weights in fewer bits makes the model smaller but slightly less precise.",
    "The committee postponed the vote until next month.",
    "Members decided to delay the decision by a few weeks.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "Plants use light to make their own food.",
    "The museum opens at ten and closes at six.",
    "Visiting hours for the gallery are from 10 am to 6 pm.",
    "He forgot his umbrella and got soaked on the way home.",
    "The stock market fell sharply after the announcement.",
    "Prices of shares dropped quickly once the news came out.",
    "A rounding error can grow when it is repeated in every layer.",
    "Small numerical mistakes accumulate through a deep network.",
    "The violinist played the concerto from memory.",
    "Mountains in the north are covered with snow until June.",
    "Please restart the server after installing the update.",
    "The recipe needs two eggs, flour and a pinch of salt.",
    "Nobody expected the underdog team to win the final.",
)
#: Index pairs of :data:`SENTENCES` written as paraphrases of each other (in the float model
#: each is the other's nearest neighbour); the remaining sentences are distractors.
PARAPHRASE_PAIRS: tuple[tuple[int, int], ...] = (
    (0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11),
    (14, 15), (16, 17), (18, 19), (20, 21), (23, 24), (25, 26),
)


#: Calibration text for GPTQ, written for nvfp4lab (no sentence of :data:`SENTENCES`): 64 varied
#: sentences, about 900 tokens with MiniLM's tokenizer.
CALIBRATION_SENTENCES: tuple[str, ...] = (
    "The river flooded the lower fields after a week of heavy autumn rain.",
    "Our neighbours adopted two kittens from the shelter down the road.",
    "A good night's sleep improves memory, mood and concentration.",
    "The bakery on the corner sells croissants until eleven in the morning.",
    "Engineers tested the bridge by driving loaded trucks across it.",
    "Most of the ocean floor has never been mapped in high resolution.",
    "She practised the piano for an hour before every lesson.",
    "The library extended its opening hours during the exam period.",
    "Farmers in the valley grow apples, pears and a little barley.",
    "The spacecraft sent back photographs of the planet's icy rings.",
    "He repaired the bicycle chain with a borrowed set of pliers.",
    "Inflation eased slightly in March, according to the central bank.",
    "The children built a sandcastle and watched the tide wash it away.",
    "A compiler translates source code into instructions a processor can run.",
    "Memory bandwidth often limits how fast large language models generate text.",
    "The hospital opened a new wing for children with heart conditions.",
    "Thunderstorms are expected over the mountains later this afternoon.",
    "The orchestra rehearsed the symphony three times before the premiere.",
    "Please submit your travel expenses before the end of the month.",
    "The old lighthouse was turned into a small maritime museum.",
    "Bees carry pollen from flower to flower as they collect nectar.",
    "The software update fixed a bug that drained the phone's battery.",
    "A marathon runner needs both endurance and careful pacing.",
    "The detective noticed muddy footprints leading to the back door.",
    "Fresh basil, tomatoes and olive oil make a simple summer sauce.",
    "The startup raised money to build cheaper solar panels.",
    "Volcanic ash grounded flights across northern Europe for days.",
    "Our teacher explained fractions using slices of a pizza.",
    "Gradient descent updates the parameters in the direction that lowers the loss.",
    "The hikers reached the summit just before the clouds rolled in.",
    "Several species of whales migrate thousands of kilometres each year.",
    "He apologised for arriving late to the meeting with the client.",
    "A matrix multiplication on the accelerator took only a few microseconds.",
    "The city council approved a plan for more bicycle lanes downtown.",
    "Grandmother kept every letter she had received during the war.",
    "The chef sharpened his knives before the dinner service began.",
    "Electric cars are becoming cheaper as battery prices fall.",
    "The festival attracted musicians from more than twenty countries.",
    "Lossy compression discards details the human eye rarely notices.",
    "The printer jammed again, so she sent the file to a colleague.",
    "Penguins huddle together to survive the Antarctic winter.",
    "The novel follows a family through three generations of change.",
    "An earthquake shook the coastal town early on Tuesday morning.",
    "Students debated whether homework should be banned in primary school.",
    "The museum's new exhibition features ancient Egyptian jewellery.",
    "Coffee prices rose after a drought hit the main growing regions.",
    "The goalkeeper saved a penalty in the last minute of the match.",
    "Antibiotics do not work against infections caused by viruses.",
    "Rounding every weight to four bits saves memory but adds noise.",
    "The tram stopped because a delivery van was blocking the tracks.",
    "My sister is learning Japanese with an app on her phone.",
    "The committee will publish its final report next spring.",
    "Owls hunt at night and can turn their heads almost all the way round.",
    "A leaking pipe in the basement caused the electricity to fail.",
    "The painter mixed blue and yellow to get a soft green.",
    "Tourists queued for hours to see the famous painting.",
    "Cloud servers automatically scale up when traffic increases.",
    "The recipe calls for butter, sugar and three ripe bananas.",
    "Climbers must acclimatise slowly to avoid altitude sickness.",
    "The court postponed the hearing because a witness was ill.",
    "Wind turbines produced a record share of the country's electricity.",
    "He forgot the password and had to reset his account.",
    "A telescope on the mountain observed a distant supernova.",
    "The kindergarten planted sunflowers along the playground fence.",
)


def calibration_batches(
    encoder: SentenceEncoder,
    sentences: Sequence[str] = CALIBRATION_SENTENCES,
    batch_size: int = 8,
) -> list[dict[str, torch.Tensor]]:
    """Tokenizer outputs (padded ``[B, T]`` tensors) of ``sentences`` in batches of
    ``batch_size``: the ``calibration=`` of ``quantize_model(method="gptq")``."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    sentences = list(sentences)
    return [encoder.tokenize(sentences[i : i + batch_size])
            for i in range(0, len(sentences), batch_size)]


@dataclass
class FidelityReport:
    """Cosine similarity between float and quantized embeddings of the same sentences.

    ``cosine[i]``: cos(float embedding i, quantized embedding i). ``similarity_max_abs_error``:
    max over pairs |S_fp - S_q| of the sentence-to-sentence cosine matrices (how much the
    geometry used for retrieval moves). ``neighbor_agreement``: fraction of sentences whose
    nearest other sentence is the same under both models.
    """

    sentences: list[str]
    cosine: list[float]
    similarity_max_abs_error: float
    neighbor_agreement: float

    @property
    def mean(self) -> float:
        return statistics.fmean(self.cosine)

    @property
    def min(self) -> float:
        return min(self.cosine)

    @property
    def median(self) -> float:
        return statistics.median(self.cosine)

    def summary(self) -> dict[str, float]:
        """Headline numbers (cosine mean/min/median, similarity-matrix error, neighbours)."""
        return {
            "sentences": float(len(self.cosine)),
            "cosine_mean": self.mean,
            "cosine_min": self.min,
            "cosine_median": self.median,
            "similarity_max_abs_error": self.similarity_max_abs_error,
            "neighbor_agreement": self.neighbor_agreement,
        }

    def rows(self) -> list[dict[str, object]]:
        """One dict per sentence (for a pandas DataFrame)."""
        return [
            {"sentence": s, "cosine": c} for s, c in zip(self.sentences, self.cosine, strict=True)
        ]


def _as_encoder(model: SentenceEncoder | nn.Module, tokenizer: Any) -> SentenceEncoder:
    if isinstance(model, SentenceEncoder):
        return model
    if tokenizer is None:
        raise ValueError("pass tokenizer= when giving a bare model instead of a SentenceEncoder")
    return SentenceEncoder(model, tokenizer)


def embedding_fidelity(
    model_fp: SentenceEncoder | nn.Module,
    model_q: SentenceEncoder | nn.Module,
    sentences: Sequence[str] = SENTENCES,
    *,
    tokenizer: Any = None,
    batch_size: int = 32,
) -> FidelityReport:
    """Compare the embeddings of ``model_q`` with those of ``model_fp`` on ``sentences``.

    Each model is a :class:`SentenceEncoder` or a bare transformers encoder (then pass
    ``tokenizer``). Cosines are computed in float64 on the mean-pooled float32 embeddings.
    """
    enc_fp = _as_encoder(model_fp, tokenizer)
    enc_q = _as_encoder(model_q, tokenizer if tokenizer is not None else enc_fp.tokenizer)
    sentences = list(sentences)
    if len(sentences) < 2:
        raise ValueError("embedding_fidelity needs at least two sentences")
    e_fp = enc_fp.encode(sentences, batch_size=batch_size).to(torch.float64)
    e_q = enc_q.encode(sentences, batch_size=batch_size).to(torch.float64)
    cosine = torch.nn.functional.cosine_similarity(e_fp, e_q, dim=-1)
    s_fp = _cosine_matrix(e_fp)
    s_q = _cosine_matrix(e_q)
    eye = torch.eye(len(sentences), dtype=torch.bool)
    nn_fp = s_fp.masked_fill(eye, -math.inf).argmax(dim=1)
    nn_q = s_q.masked_fill(eye, -math.inf).argmax(dim=1)
    return FidelityReport(
        sentences=sentences,
        cosine=[float(c) for c in cosine],
        similarity_max_abs_error=float((s_fp - s_q).abs().max()),
        neighbor_agreement=float((nn_fp == nn_q).to(torch.float64).mean()),
    )


def paraphrase_recall(
    encoder: SentenceEncoder,
    sentences: Sequence[str] = SENTENCES,
    pairs: Sequence[tuple[int, int]] = PARAPHRASE_PAIRS,
) -> float:
    """Fraction of paraphrase-pair members whose nearest other sentence is their partner
    (a small retrieval task: 1.0 for the float MiniLM on :data:`SENTENCES`)."""
    if not pairs:
        raise ValueError("no paraphrase pairs given")
    sims = _cosine_matrix(encoder.encode(list(sentences)).to(torch.float64))
    sims.fill_diagonal_(-math.inf)
    nearest = sims.argmax(dim=1)
    hits = sum(int(nearest[a]) == b for a, b in pairs) + sum(int(nearest[b]) == a for a, b in pairs)
    return hits / (2 * len(pairs))


def _cosine_matrix(e: torch.Tensor) -> torch.Tensor:
    unit = torch.nn.functional.normalize(e, dim=-1)
    return unit @ unit.T


def _is_quantized(module: nn.Module) -> bool:
    return hasattr(module, "weight_packed")


def _keep(value: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``value [B, T, ...]`` at the real tokens of ``mask [B, T]`` (``[tokens, ...]``); other
    shapes (e.g. BERT's pooler input ``[B, H]``) and ``mask=None`` unchanged."""
    if mask is None or value.ndim < 3 or tuple(value.shape[:2]) != tuple(mask.shape):
        return value
    return value[mask.to(value.device).bool()]


@contextmanager
def _capture(
    model: nn.Module,
    names: Sequence[str],
    store: dict[str, list[torch.Tensor]],
    inputs: bool,
    mask: torch.Tensor | None = None,
) -> Iterator[None]:
    handles = []
    modules = dict(model.named_modules())
    for name in names:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any, name: str = name) -> None:
            value = args[0] if inputs else output
            if isinstance(value, torch.Tensor):
                store.setdefault(name, []).append(_keep(value.detach(), mask))

        handles.append(modules[name].register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def linear_names(model: nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` modules of ``model`` (module order)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


@torch.no_grad()
def capture_inputs(
    encoder: SentenceEncoder,
    sentences: Sequence[str] = SENTENCES,
    layers: Sequence[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Each layer's real input activations, ``[tokens, K]`` on the CPU (padding tokens left out),
    captured with forward hooks while ``encoder`` embeds ``sentences`` (one batch).

    ``layers``: module names (default: every ``nn.Linear`` of ``encoder.model``).
    """
    layers = linear_names(encoder.model) if layers is None else list(layers)
    if not layers:
        raise ValueError("capture_inputs: no layer to capture (the model has no nn.Linear)")
    batch = encoder.tokenize(list(sentences))
    seen: dict[str, list[torch.Tensor]] = {}
    with _capture(encoder.model, layers, seen, inputs=True, mask=batch["attention_mask"]):
        encoder.model(**batch)
    return {n: torch.cat([t.reshape(-1, t.shape[-1]).cpu() for t in seen[n]]) for n in layers
            if n in seen}


@dataclass
class LayerSQNR:
    """Per-layer output SQNR (dB) of a quantized model against its float original.

    ``mode``: "propagated" (each model runs on its own activations, so errors of earlier layers
    are included) or "isolated" (the quantized layer is fed the float layer's input: its own
    error only). ``sqnr_db``: layer name -> dB, in module order.
    """

    mode: str
    sqnr_db: dict[str, float] = field(default_factory=dict)

    @property
    def min(self) -> float:
        return min(self.sqnr_db.values())

    @property
    def max(self) -> float:
        return max(self.sqnr_db.values())

    def rows(self) -> list[dict[str, object]]:
        return [{"layer": k, "sqnr_db": v, "mode": self.mode} for k, v in self.sqnr_db.items()]


@torch.no_grad()
def layer_sqnr(
    model_fp: SentenceEncoder | nn.Module,
    model_q: SentenceEncoder | nn.Module,
    sentences: Sequence[str] = SENTENCES,
    *,
    tokenizer: Any = None,
    mode: Literal["propagated", "isolated"] = "propagated",
    layers: Sequence[str] | None = None,
    mask_padding: bool = False,
) -> LayerSQNR:
    """SQNR (dB) of each quantized layer's output vs the same-named float layer, via hooks.

    ``layers``: module names to compare (default: every module of ``model_q`` holding an NVFP4
    weight that also exists in ``model_fp``). Padding positions are included (same tokens in
    both models) unless ``mask_padding`` (then only real tokens count, as in the embeddings).
    See :class:`LayerSQNR` for ``mode``.
    """
    if mode not in ("propagated", "isolated"):
        raise ValueError(f"unknown mode {mode!r}; accepted values: propagated, isolated")
    enc_fp = _as_encoder(model_fp, tokenizer)
    enc_q = _as_encoder(model_q, tokenizer if tokenizer is not None else enc_fp.tokenizer)
    fp_modules = dict(enc_fp.model.named_modules())
    q_modules = dict(enc_q.model.named_modules())
    if layers is None:
        layers = [n for n, m in q_modules.items() if _is_quantized(m) and n in fp_modules]
    missing = [n for n in layers if n not in fp_modules or n not in q_modules]
    if missing:
        raise ValueError(f"layers not present in both models: {missing[:5]}")
    if not layers:
        raise ValueError("no quantized layer to compare (the quantized model has no NVFP4 layer)")
    batch = enc_fp.tokenize(list(sentences))
    mask = batch["attention_mask"] if mask_padding else None
    ref: dict[str, list[torch.Tensor]] = {}
    got: dict[str, list[torch.Tensor]] = {}
    if mode == "propagated":
        with _capture(enc_fp.model, layers, ref, inputs=False, mask=mask):
            enc_fp.model(**batch)
        q_batch = {k: v.to(module_device(enc_q.model)) for k, v in batch.items()}
        with _capture(enc_q.model, layers, got, inputs=False, mask=mask):
            enc_q.model(**q_batch)
    else:
        seen: dict[str, list[torch.Tensor]] = {}
        with _capture(enc_fp.model, layers, seen, inputs=True, mask=mask), _capture(
            enc_fp.model, layers, ref, inputs=False, mask=mask
        ):
            enc_fp.model(**batch)
        for name in layers:
            module = q_modules[name]
            got[name] = [module(x.to(module_device(module))) for x in seen.get(name, [])]
    result = LayerSQNR(mode=mode)
    for name in layers:
        if not ref.get(name) or not got.get(name):
            continue
        a = torch.cat([t.reshape(-1).cpu() for t in ref[name]])
        b = torch.cat([t.reshape(-1).cpu() for t in got[name]])
        result.sqnr_db[name] = metrics.sqnr_db(a, b)
    return result
