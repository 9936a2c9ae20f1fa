"""Guard: vocabulary values are spelled only in their homes; everywhere else names the member.

Every ``.py`` under the package is parsed with :mod:`ast` (docstrings skipped) and a string
constant equal to a guarded value of :mod:`nvfp4lab.vocab` fails the test with its file:line and
the member to use. Values that are also ordinary words (``"output"``, ``"bf16"``, ``"auto"``,
``"cpu"``, ...) are guarded only where they mean the vocabulary: as a call keyword, a parameter
default, an assignment, a comparison or a dict entry whose name is the vocabulary's (``backend``,
``bias_mode``, ``convention``, ...), a ``for`` loop over such a name, a ``return`` of a function
named after it, or beside a distinctive value of the same vocabulary in one literal collection.
Tuples, lists and sets of two or more of ``torch.float32/bfloat16/float16`` outside ``vocab.py``
(private copies of ``SUPPORTED_DTYPES``) fail too.

:func:`violations` takes the package root, so the guard can be pointed at another tree.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from nvfp4lab import vocab

#: The package the guard walks (pass another root to :func:`violations` for another tree).
PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "nvfp4lab"

#: Where literals are allowed, relative to the package root: path (a folder ends in "/") ->
#: "all" (the whole file) or "module" (module-level statements only: tables, not code).
HOMES: dict[str, str] = {
    "vocab.py": "all",  # the declarations
    "oracles/": "all",  # the independent oracles import nothing from the rest of the package
    "checkpoint/formats/": "all",  # on-disk values of each checkpoint format
    "execution/vllm_rules.py": "all",  # vLLM's own names, by release
    "execution/vllm_select.py": "module",  # vLLM's own names in its era tables
}

#: (file, value, reason): a literal that equals a vocabulary value but means something else.
ALLOWED: tuple[tuple[str, str, str], ...] = (
    ("bench/peers.py", "compressed-tensors", "the peer library's name in the results"),
    ("models.py", "gguf", "the Python package's import name (transformers' GGUF reader)"),
)


#: Names that mark a context as one vocabulary's (matched whole, or as a ``_``-suffix).
CONTEXT: dict[type[StrEnum], tuple[str, ...]] = {
    vocab.Backend: ("backend", "backends", "path", "paths"),
    vocab.GemmPath: ("path", "paths", "backend", "backends"),
    vocab.Numerics: ("numerics",),
    vocab.BiasMode: ("bias_mode", "bias_modes", "bias", "mode", "modes"),
    vocab.OrderName: ("convention", "conventions", "conv"),
    vocab.CheckpointFormat: ("format", "formats", "fmt"),
    vocab.Rounding: ("rounding",),
    vocab.ScaleSelection: ("scale_selection", "selection"),
    vocab.NonFinite: ("nonfinite",),
    vocab.QuantMethod: ("method", "methods"),
    vocab.ScaleTiming: ("scales", "scale_timing", "timing"),
    vocab.Platform: ("platform", "platforms"),
    vocab.Scheme: ("scheme", "schemes"),
    vocab.VllmPackage: ("package", "packages"),
    vocab.VllmAlias: ("vllm", "release", "rel"),
    vocab.FusedMode: ("fused", "fused_mode"),
    vocab.KVCacheKind: ("kind", "kinds", "cache_dtype", "kv_cache_dtype"),
    vocab.CorpusPart: ("part", "parts"),
    vocab.Engine: ("engine", "engines"),
}

#: Values that are also ordinary words elsewhere (devices, dtypes, column names, flags): guarded
#: only in a vocabulary's context. Every other value is guarded everywhere.
COMMON_WORDS: frozenset[str] = frozenset({
    "output", "fp32", "bf16", "fp8", "kernel", "amax", "raise", "NVFP4", "original", "updated",
    "auto", "on", "off", "cpu", "cuda", "rocm", "xpu", "seed", "latest", "nvfp4",
    "calibration", "evaluation", "vllm",
})

_DTYPES = frozenset({"float32", "bfloat16", "float16"})


def _members(value: str) -> list[str]:
    found = [f"{e.__name__}.{m.name}" for e in CONTEXT for m in e if m.value == value]
    return found + (["vocab.AUTO"] if value == vocab.AUTO else [])


def _vocabularies(value: str) -> set[type[StrEnum]]:
    found = {e for e in CONTEXT if value in {m.value for m in e}}
    return found | ({vocab.Backend} if value == vocab.AUTO else set())


_VALUES: frozenset[str] = frozenset(
    {m.value for e in CONTEXT for m in e} | {vocab.AUTO}
)


@dataclass(frozen=True)
class Violation:
    """One literal out of its home: ``where`` is ``file:line`` relative to the package root."""

    file: str
    line: int
    literal: str
    fix: str
    scope: str  # the enclosing top-level function or class ("" at module level)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.literal} -> use {self.fix}"


def _name_of(node: ast.AST) -> str | None:
    """The name a node stands for: ``x``, ``a.x``, ``r["x"]``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value if isinstance(node.slice.value, str) else None
    if isinstance(node, ast.Starred):
        return _name_of(node.value)
    return None


def _is_context(name: str | None, value: str) -> bool:
    if not name:
        return False
    name = name.lower().lstrip("_")
    if name == value.lower().replace("-", "_"):  # a private copy: _KERNEL = "kernel"
        return True
    words = {w for e in _vocabularies(value) for w in CONTEXT[e]}
    return any(name == w or name.endswith("_" + w) for w in words)


def _strings(node: ast.AST | None) -> Iterator[ast.Constant]:
    """The string constants an expression evaluates to: itself, either branch of ``a if c else
    b``, the operands of ``a or b``, the elements of a literal collection (not a condition, a
    call's arguments or an f-string's pieces)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node
    elif isinstance(node, ast.IfExp):
        yield from _strings(node.body)
        yield from _strings(node.orelse)
    elif isinstance(node, ast.BoolOp):
        for value in node.values:
            yield from _strings(value)
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        for elt in node.elts:
            yield from _strings(elt)
    elif isinstance(node, ast.Starred):
        yield from _strings(node.value)


def _collection_strings(node: ast.AST) -> Iterator[ast.Constant]:
    """String constants spelled as elements of a literal collection (nested ones included)."""
    items: list[ast.AST | None]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        items = list(node.elts)
    elif isinstance(node, ast.Dict):
        items = list(node.keys)
    else:
        return
    for item in items:
        if isinstance(item, ast.Constant) and isinstance(item.value, str):
            yield item
        elif item is not None:
            yield from _collection_strings(item)


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = n.body[0] if n.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _in_context(tree: ast.Module) -> set[int]:
    """ids of the string constants that stand in a vocabulary's context."""
    hits: set[int] = set()

    def mark(name: str | None, expr: ast.AST | None) -> None:
        for c in _strings(expr):
            if c.value in _VALUES and _is_context(name, c.value):
                hits.add(id(c))

    functions: list[ast.AST] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.keyword):
            mark(n.arg, n.value)
        elif isinstance(n, ast.arguments):
            positional = [*n.posonlyargs, *n.args]
            for arg, default in zip(positional[len(positional) - len(n.defaults):], n.defaults,
                                    strict=True):
                mark(arg.arg, default)
            for arg, kw_default in zip(n.kwonlyargs, n.kw_defaults, strict=True):
                mark(arg.arg, kw_default)
        elif isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            for side in sides:
                for other in sides:
                    if other is not side:
                        mark(_name_of(side), other)
        elif isinstance(n, ast.Assign):
            for target in n.targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    mark(_name_of(t), n.value)
        elif isinstance(n, ast.AnnAssign):
            mark(_name_of(n.target), n.value)
        elif isinstance(n, ast.Dict):
            for key, val in zip(n.keys, n.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    mark(key.value, val)
        elif isinstance(n, ast.For | ast.comprehension):
            mark(_name_of(n.target), n.iter)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            functions.append(n)
        if isinstance(n, ast.Tuple | ast.List | ast.Set | ast.Dict):  # beside a distinctive value
            strings = list(_collection_strings(n))
            distinctive = {e for c in strings if c.value in _VALUES - COMMON_WORDS
                           for e in _vocabularies(c.value)}
            for c in strings:
                if c.value in _VALUES and _vocabularies(c.value) & distinctive:
                    hits.add(id(c))
    for f in functions:
        assert isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        for n in ast.walk(f):
            if isinstance(n, ast.Return):
                mark(f.name, n.value)
    return hits


def _scopes(tree: ast.Module) -> tuple[dict[int, str], set[int]]:
    """(id -> enclosing top-level def/class name, ids of nodes inside any function body)."""
    scope: dict[int, str] = {}
    in_function: set[int] = set()
    for top in tree.body:
        name = top.name if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef
                                      | ast.ClassDef) else ""
        for n in ast.walk(top):
            scope[id(n)] = name
    for f in ast.walk(tree):
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
            for stmt in f.body:
                in_function.update(id(n) for n in ast.walk(stmt))
    return scope, in_function


def _home(rel: str) -> str | None:
    for place, how in HOMES.items():
        if rel == place or (place.endswith("/") and rel.startswith(place)):
            return how
    return None


def file_violations(path: Path, rel: str) -> list[Violation]:
    """Every literal of ``path`` (``rel`` to the package root) out of its home."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    home = _home(rel)
    if home == "all":
        return []
    docs, context = _docstrings(tree), _in_context(tree)
    scope, in_function = _scopes(tree)
    allowed = {value for file, value, _ in ALLOWED if file == rel}
    found: list[Violation] = []
    for n in ast.walk(tree):
        if home == "module" and id(n) not in in_function:
            continue
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in _VALUES:
            if id(n) in docs or n.value in allowed:
                continue
            if n.value in COMMON_WORDS and id(n) not in context:
                continue
            fix = " or ".join(_members(n.value))
            found.append(Violation(rel, n.lineno, repr(n.value), fix, scope.get(id(n), "")))
        elif isinstance(n, ast.Tuple | ast.List | ast.Set):
            dtypes = [e for e in n.elts if isinstance(e, ast.Attribute) and e.attr in _DTYPES
                      and isinstance(e.value, ast.Name) and e.value.id == "torch"]
            if len(dtypes) >= 2:
                spelled = ", ".join(f"torch.{e.attr}" for e in dtypes)  # type: ignore[attr-defined]
                found.append(Violation(rel, n.lineno, f"({spelled})", "vocab.SUPPORTED_DTYPES",
                                       scope.get(id(n), "")))
    return sorted(found, key=lambda v: v.line)


def violations(root: Path = PACKAGE_ROOT) -> list[Violation]:
    """Every vocabulary literal out of its home under the package ``root``."""
    found: list[Violation] = []
    for path in sorted(root.rglob("*.py")):
        found += file_violations(path, path.relative_to(root).as_posix())
    return found


def test_vocabulary_values_are_spelled_only_in_their_homes() -> None:
    bad = violations()
    assert not bad, "vocabulary literals out of their homes (name the member instead):\n" + (
        "\n".join(map(str, bad))
    )


def test_the_guard_catches_each_kind_of_leak(tmp_path: Path) -> None:
    """A planted module with one leak per rule, and the uses the guard must leave alone."""
    (tmp_path / "planted.py").write_text(
        '"""native: a docstring is prose."""\n'
        "import torch\n"
        "DTYPES = (torch.float32, torch.bfloat16)\n"  # 3: a private dtype list
        "def f(backend='emulation', bias_mode='output', device='cpu'):\n"  # 4: two leaks
        "    if backend == 'auto':\n"  # 5
        "        return linear(x, convention='kernel', what='kernel')\n"  # 6: one leak
        "    paths = ('bf16', 'w4a16')\n"  # 7: two leaks (bf16 beside w4a16)
        "    return {'output': 1, 'name': 'bf16', 'fmt': 'x'}\n"  # 8: nothing
        "_KERNEL = 'kernel'\n"  # 9: a private copy
    )
    found = violations(tmp_path)
    assert [(v.line, v.literal) for v in found] == [
        (3, "(torch.float32, torch.bfloat16)"), (4, "'emulation'"), (4, "'output'"),
        (5, "'auto'"), (6, "'kernel'"), (7, "'bf16'"), (7, "'w4a16'"), (9, "'kernel'"),
    ]
    assert str(found[1]) == (
        "planted.py:4: 'emulation' -> use Backend.EMULATION or GemmPath.EMULATION or "
        "Numerics.EMULATION"
    )
    assert found[3].fix == "FusedMode.AUTO or vocab.AUTO"
