"""Fused NVFP4 kernels, written once as tensor code and compiled by ``torch.compile``.

The same source lowers to C++/OpenMP (``at::vec``) on the CPU and to Triton on CUDA:
:mod:`~nvfp4lab.kernels.graphs` holds the graphs, :mod:`~nvfp4lab.kernels.compiled` compiles them
(one compiled function per graph kind and static configuration, dynamic in the number of blocks)
and :mod:`~nvfp4lab.kernels.linear` runs a linear layer with the weight decoded tile by tile, on
the CPU by a hand-written C++ table-lookup kernel (:mod:`~nvfp4lab.kernels.lut_decode`) where it
can be built. On the CPU, quantize and fake_quantize run a hand-written C++ block encode
(:mod:`~nvfp4lab.kernels.block_encode`); :mod:`~nvfp4lab.kernels.quantize` picks it or the
graphs. Both C++ kernels are nvfp4lab's native library (:mod:`~nvfp4lab.kernels.native`, built
once per machine into nvfp4lab's cache).
They are bit for bit the eager pipeline of :mod:`nvfp4lab.codec` and :mod:`nvfp4lab.tensor`;
:mod:`nvfp4lab.codec`, :meth:`nvfp4lab.tensor.NVFP4Tensor.dequantize` and
:func:`nvfp4lab.execution.gemm.linear` route eligible calls here (this package imports only
:mod:`nvfp4lab.constants`, :mod:`nvfp4lab.vocab` and :mod:`nvfp4lab.settings`; ``torch._dynamo``
and inductor are imported on the first fused call, never by ``import nvfp4lab``).

When a call runs fused: :func:`fused_route` is the one rule every caller asks (the codec's
quantize and fake_quantize, ``NVFP4Tensor.dequantize``, the linear's weight; each asks with
``native=True``: on a CPU where the native library is built its C++ kernel runs from the first
call under ``auto`` and ``on``, see :func:`native_allows`). The call must be
eligible (plain options, 16-element blocks, K % 16 == 0, two blocks or more, an fp32/bf16/fp16
tensor, an arithmetic order the kernel implements: every order for the C++ block encode,
:func:`nvfp4lab.kernels.block_encode.supports`; the kernel and compressed-tensors orders for the
graphs, :func:`nvfp4lab.kernels.graphs.supports`) on a CPU or CUDA tensor; for the compiled
graphs a compiler must work here (:func:`compiler_available`), and the setting
``NVFP4LAB_FUSED`` (:func:`nvfp4lab.settings.fused_mode`) or the call's ``fused=`` must allow it
(:func:`use_fused`):

``on`` / ``fused=True``
    every eligible call (tests, benchmarks, long runs).
``off`` / ``fused=False``
    never.
``auto`` (default)
    tensors of at least :data:`AUTO_MIN_ELEMENTS`, as :func:`auto_decision` decides from what this
    process and this machine have already paid for (the measured costs are in
    docs/throughput.md, "Fused kernels"; per call the fused path wins from ~16 K elements, 6-22x
    from 256 K, but the first fused call of a process costs seconds):

    * once a fused call has run on the device type in this process (:func:`cache.started`), every
      large call: the start-up is paid, a further graph set costs 0.2-0.5 s warm;
    * when the kernel cache holds this dtype's graphs (:func:`cache.warm`: a marker written by a
      process that ran them), at once for a call of :data:`AUTO_WARM_CALL_ELEMENTS` or more, else
      once the process's eager work reaches :data:`AUTO_WARM_WORK_ELEMENTS`;
    * with a cold cache, once the process has done :data:`AUTO_WORK_ELEMENTS` of such work
      eagerly (the ski-rental rule: it never spends much more than twice the best choice made in
      hindsight), so short scripts never compile cold.

    The kernel cache is inductor's, kept at ``~/.cache/nvfp4lab/inductor`` (a
    ``TORCHINDUCTOR_CACHE_DIR`` of the user's wins; :mod:`nvfp4lab.kernels.cache`).

Without a working compiler (no C++ compiler for inductor's CPU backend, no Triton on CUDA, ...)
every call stays eager; the first fused attempt says so ONCE, as one WARNING line on the
``nvfp4lab.kernels`` logger (no traceback; Python's last-resort handler prints it on stderr
when logging is not configured). Where the native library cannot be built (no compiler, no ninja,
a build error) its first use says so in one such line too, and calls run the compiled graphs or
eagerly, as the rule above decides.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.kernels import block_encode, cache, native
from nvfp4lab.kernels.graphs import supports
from nvfp4lab.orders import ArithmeticOrder
from nvfp4lab.settings import fused_mode
from nvfp4lab.vocab import SUPPORTED_DTYPES, FusedMode

__all__ = [
    "AUTO_MIN_ELEMENTS",
    "AUTO_WARM_CALL_ELEMENTS",
    "AUTO_WARM_WORK_ELEMENTS",
    "AUTO_WORK_ELEMENTS",
    "FUSED_DEVICE_TYPES",
    "AutoState",
    "auto_decision",
    "auto_state",
    "compiler_available",
    "eager_work",
    "fused_route",
    "native_allows",
    "use_fused",
]

#: Device types the fused kernels compile for (C++/OpenMP and Triton).
FUSED_DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda")
#: ``auto``: smaller tensors always stay eager (their fused call's fixed ~0.2 ms of graph calls,
#: scalar glue and one host sync leaves less than a 3x gain).
AUTO_MIN_ELEMENTS: int = 1 << 16
#: ``auto``, cold kernel cache: eligible elements a process does eagerly on a device type before
#: it compiles: 2**30, ~20 s of eager quantize at 1 thread (55 M elements/s) or ~10 s at 2,
#: about what a process's first fused calls cost with a cold cache (19 s for quantize: inductor's
#: start-up, vector-ISA checks and a probe graph, then 5 s for its graphs; 1.6-3 s per further
#: graph set). Of the notebooks only 07 (SmolLM2, 1.07 G elements) gets there cold.
AUTO_WORK_ELEMENTS: int = 1 << 30
#: ``auto``, warm kernel cache: eager work after which a process compiles: 2**28, ~5 s of eager
#: quantize at 1 thread, about one warm start-up (4.6 s for quantize: 4 s importing dynamo and
#: inductor, the ISA checks and the probe, 0.7 s loading its graphs; 0.2-0.3 s per further set).
AUTO_WARM_WORK_ELEMENTS: int = 1 << 28
#: ``auto``, warm kernel cache: a single call this large compiles at once: 2**26 = 8192², ~1.2 s
#: of eager bf16 quantize at 1 thread (0.7 s at 2). A process making only that one call pays
#: the warm start-up instead (4-7x its eager time); from the second such call on it runs ~10x
#: faster than eager.
AUTO_WARM_CALL_ELEMENTS: int = 1 << 26

_LOG = logging.getLogger(__name__)
_EAGER_WORK: dict[str, int] = {}


@dataclass(frozen=True)
class AutoState:
    """What the ``auto`` rule knows about a device type when a call arrives."""

    eager_elements: int  #: eligible elements this process has already run eagerly (the ledger)
    started: bool  #: a fused call has run here in this process (start-up paid)
    warm: bool  #: the kernel cache holds the call's graphs (compiling costs the warm price)


def auto_decision(numel: int, state: AutoState) -> bool:
    """Whether an ``auto`` call over ``numel`` elements runs fused, given ``state`` (a pure
    function; see the module docstring for the rule and its costs)."""
    if numel < AUTO_MIN_ELEMENTS:
        return False
    if state.started:
        return True
    if state.warm:
        return (
            numel >= AUTO_WARM_CALL_ELEMENTS
            or state.eager_elements + numel >= AUTO_WARM_WORK_ELEMENTS
        )
    return state.eager_elements >= AUTO_WORK_ELEMENTS


def eager_work(device_type: str) -> int:
    """Elements this process has quantized/decoded eagerly in ``auto`` calls that were large
    enough to go fused (the ledger of the ``auto`` rule) on ``device_type``."""
    return _EAGER_WORK.get(device_type, 0)


def auto_state(device_type: str, dtype: torch.dtype | None = None) -> AutoState:
    """This process's :class:`AutoState` for ``device_type`` (``dtype``: the call's tensor dtype;
    None: any graphs of that device type count as warm)."""
    return AutoState(
        eager_elements=_EAGER_WORK.get(device_type, 0),
        started=cache.started(device_type),
        warm=cache.warm(device_type, dtype),
    )


def _auto_allows(numel: int, device_type: str, dtype: torch.dtype | None) -> bool:
    if numel < AUTO_MIN_ELEMENTS:
        return False
    if auto_decision(numel, auto_state(device_type, dtype)):
        return True
    _EAGER_WORK[device_type] = _EAGER_WORK.get(device_type, 0) + numel  # runs eagerly: it counts
    return False


def use_fused(
    numel: int,
    device: torch.device,
    fused: bool | None = None,
    env: Mapping[str, str] | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> bool:
    """Whether an eligible call over ``numel`` elements of ``dtype`` on ``device`` runs the fused
    kernels.

    ``fused``: the call's own choice (True: when a compiler works; False: never); None follows
    ``NVFP4LAB_FUSED`` of ``env`` (default: the live environment) as described above.
    """
    if device.type not in FUSED_DEVICE_TYPES or fused is False:
        return False
    if fused is None:
        mode = fused_mode(env)
        if mode == FusedMode.OFF or (
            mode == FusedMode.AUTO and not _auto_allows(numel, device.type, dtype)
        ):
            return False
    return compiler_available(device.type)


def fused_route(
    numel: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device,
    fused: bool | None = None,
    *,
    block_size: int = BLOCK_SIZE,
    order: ArithmeticOrder | None = None,
    plain: bool = True,
    native: bool = False,
) -> bool:
    """THE fused-eligibility rule: whether a call over ``numel`` elements (K = ``k``) of
    ``dtype`` on ``device`` runs the fused kernels.

    Eligible: ``plain`` (the caller's options are the defaults the graphs implement: RNE, amax
    scales, no rotation, NaN/Inf raising, no other tensor scale), 16-element blocks, ``k`` a
    multiple of 16, two blocks or more (a single block would compile its own size-1
    specialization), ``dtype`` in :data:`~nvfp4lab.vocab.SUPPORTED_DTYPES` and, for a quantizing
    call, an ``order`` the kernel implements (``None``: a decode, whose rule every kernel covers):
    the C++ block encode every order of :func:`nvfp4lab.kernels.block_encode.supports`, the
    graphs those of :func:`nvfp4lab.kernels.graphs.supports`.
    Then :func:`use_fused` decides (device, ``fused`` / ``NVFP4LAB_FUSED``, a working compiler).

    ``native``: a C++ kernel of the native library can serve the call (the LUT decode, the block
    encode: :mod:`nvfp4lab.kernels.native`). The library is built once per machine and loads in
    milliseconds: no per-process compilation to pay back, so on a CPU where it is available
    (:func:`native_allows`) ``auto`` runs it from the first call, as ``on`` / ``fused=True`` do
    (``off`` / ``fused=False``: never). Where it is not, the rule above applies.
    """
    if not plain or block_size != BLOCK_SIZE or dtype not in SUPPORTED_DTYPES:
        return False
    if numel < 2 * BLOCK_SIZE or k % BLOCK_SIZE:
        return False
    encodable = order is None or block_encode.supports(order)
    if native and encodable and native_allows(device, fused):
        return True
    if order is not None and not supports(order):
        return False
    return use_fused(numel, device, fused, dtype=dtype)


def native_allows(device: torch.device, fused: bool | None = None) -> bool:
    """Whether an eligible call on ``device`` runs a C++ kernel of the native library: a CPU
    tensor, ``fused`` not False and ``NVFP4LAB_FUSED`` not ``off`` (when ``fused`` is None), and
    the library built here (:func:`nvfp4lab.kernels.native.available`: its first use on a machine
    builds it)."""
    if fused is False or device.type != "cpu":
        return False
    if fused is None and fused_mode() == FusedMode.OFF:
        return False
    return native.usable(device)


def _probe_graph(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0 + 1.0


def _probe(device_type: str) -> str | None:
    """Why a tiny graph does not compile and run on ``device_type`` (None: it does)."""
    try:
        cache.prepare()  # inductor's cache directory, before anything compiles
        if device_type == "cpu":
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()  # raises at once when there is no C++ compiler
        elif device_type == "cuda":
            from torch.utils._triton import has_triton

            if not torch.cuda.is_available() or not has_triton():
                return "CUDA with Triton is not available"
        graph = torch.compile(_probe_graph, dynamic=True, fullgraph=True)
        x = torch.arange(32, dtype=torch.float32, device=device_type).reshape(2, 16)
        with warnings.catch_warnings():  # torch's own import-time deprecation notices
            warnings.simplefilter("ignore", DeprecationWarning)
            y = graph(x)
        if not torch.equal(y, x * 2.0 + 1.0):
            return "a probe graph computed wrong values"
    except Exception as exc:  # any failure of the compiler stack means: no fused kernels here
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"{type(exc).__name__}: {first}"
    return None


@functools.cache
def compiler_available(device_type: str) -> bool:
    """Whether ``torch.compile`` works on ``device_type`` here: decided once per process by
    compiling a tiny graph (the first call pays inductor's one-time start-up); when it does not,
    one WARNING line on the ``nvfp4lab.kernels`` logger says why and the eager path runs."""
    why = _probe(device_type)
    if why is None:
        return True
    _LOG.warning(
        "nvfp4lab: fused kernels unavailable on %s (%s); running the eager path", device_type, why
    )
    return False
