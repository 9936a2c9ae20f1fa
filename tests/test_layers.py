"""The layers of docs/architecture.md held as data: every module of ``nvfp4lab`` has exactly one
layer, and every import it makes (module level, inside functions, under ``TYPE_CHECKING``, and
``importlib.import_module`` of a literal name) goes to its own layer or one below.

This table is the authority the architecture page points to. A new module of an existing folder
falls in that folder's layer by itself; a new module at the package root must be placed here by
name, or the test fails. The oracles stand beside the layers: they import nothing of the package
but each other, and nothing of the package imports them but their old, deprecated paths.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nvfp4lab"

#: The layers, top first: a module may import from its own layer and the ones after it.
LAYERS: tuple[str, ...] = (
    "faces",      # the command line, the report runner
    "studies",    # one module per notebook
    "bench",      # timing, results store, `nvfp4lab bench`
    "interop",    # disk formats, real models
    "execution",  # dispatch, GEMM paths, NVFP4Linear, quantize_model, GPTQ, the KV cache
    "formats",    # the study registry of number formats
    "numerics",   # the NVFP4 pipeline and its pieces
    "kernels",    # fused graphs, the C++ library, the one fused route rule
    "facts",      # named choices, constants, orders as data, settings, catalogues
)

#: Not a layer: the slow oracles, written independently of the fast path.
ORACLES = "oracles"

#: Every module of a folder (at any depth) is in the folder's layer.
FOLDERS: dict[str, str] = {
    "report": "faces",
    "studies": "studies",
    "bench": "bench",
    "checkpoint": "interop",
    "execution": "execution",
    "number_formats": "formats",
    "formats": "formats",  # the deprecated alias of number_formats (one release)
    "kernels": "kernels",
    "oracles": ORACLES,
}

#: The package root's modules, by name.
ROOT: dict[str, str] = {
    "__init__": "faces",  # the package's face: re-exports numerics and execution, lazy the rest
    "__main__": "faces",
    "cli": "faces",
    "cli_start": "faces",
    "cli_study": "faces",
    "cli_support": "faces",
    # deprecated aliases of nvfp4lab/report/ (one release)
    "reports": "faces",
    "report_kernels": "faces",
    "report_outputs": "faces",
    "report_pages": "faces",
    "notebook_imports": "faces",
    "models": "interop",
    "local_models": "interop",
    "codec": "numerics",
    "inputs": "numerics",
    "blocks": "numerics",
    "options": "numerics",
    "tensor": "numerics",
    "scales": "numerics",
    "e2m1": "numerics",
    "layout": "numerics",
    "ggml_blocks": "numerics",
    "hadamard": "numerics",
    "metrics": "numerics",
    "vocab": "facts",
    "orders": "facts",
    "constants": "facts",
    "settings": "facts",
    "gpus": "facts",
    "roofline": "facts",
    "plots": "facts",
    "corpus": "facts",
    "texts": "facts",
    # deprecated aliases of nvfp4lab/oracles/ (one release)
    "reference": ORACLES,
    "reference_ggml": ORACLES,
}


def module_name(path: Path) -> str:
    """``nvfp4lab/checkpoint/formats/gguf.py`` -> ``nvfp4lab.checkpoint.formats.gguf``; a
    package's ``__init__.py`` is the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str | None:
    """The layer (or :data:`ORACLES`) of a module of the package, None when the table has none."""
    parts = module.split(".")[1:]
    if not parts:
        return ROOT.get("__init__")
    if len(parts) > 1 or MODULES[module].name == "__init__.py":
        return FOLDERS.get(parts[0])
    return ROOT.get(parts[0])


def _target(name: str) -> str | None:
    """The module of the package that importing ``name`` executes last: its longest prefix that
    is a module here (``nvfp4lab.checkpoint.load`` -> ``nvfp4lab.checkpoint``)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(module: str) -> list[tuple[int, str]]:
    """(line, imported module of the package) for every import in ``module``'s source."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package `level - 1` folders up
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            names = [f"{source}.{alias.name}" for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name)
                       and node.func.id in ("import_module", "__import__")))):
            names = [node.args[0].value]
        for name in names:
            target = _target(name) if name.split(".")[0] == "nvfp4lab" else None
            if target is not None and target != module:
                found.append((node.lineno, target))
    return sorted(found)


def _file(module: str) -> str:
    """The module's file as the repository names it (``nvfp4lab/checkpoint/__init__.py``)."""
    path = module.replace(".", "/")
    return f"{path}/__init__.py" if MODULES[module].name == "__init__.py" else f"{path}.py"


def _rank(layer: str) -> int:
    return len(LAYERS) - LAYERS.index(layer)


def wrong_imports(module: str) -> list[str]:
    """``file:line (layer) imports target (layer)`` for each import of ``module`` that goes up
    the layers, or into or out of the oracles."""
    here = layer_of(module)
    wrong = []
    for line, target in imports_of(module):
        there = layer_of(target)
        if here is None or there is None:
            continue  # reported by test_every_module_has_exactly_one_layer
        oracle = ORACLES in (here, there)  # an oracle and a layer never meet
        if not (here == there if oracle else _rank(there) <= _rank(here)):
            wrong.append(f"{_file(module)}:{line} ({here}) imports {target} ({there})")
    return wrong


def test_every_module_has_exactly_one_layer() -> None:
    unplaced = [_file(m) for m in MODULES if layer_of(m) is None]
    assert not unplaced, (
        f"modules without a layer: {unplaced}; place each in tests/test_layers.py (a root module "
        f"in ROOT by name, a new folder in FOLDERS), as docs/architecture.md describes")
    root_files = {p.stem for p in PACKAGE.glob("*.py")}
    assert not set(ROOT) - root_files, f"ROOT lists modules that are gone: {set(ROOT) - root_files}"
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert not set(FOLDERS) - folders, (
        f"FOLDERS lists folders that are gone: {set(FOLDERS) - folders}")
    assert set(ROOT.values()) | set(FOLDERS.values()) <= {*LAYERS, ORACLES}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_import_goes_to_its_own_layer_or_below(module: str) -> None:
    if layer_of(module) is None:
        pytest.skip("not placed (test_every_module_has_exactly_one_layer fails)")
    wrong = wrong_imports(module)
    assert not wrong, "imports that go up the layers (or into / out of the oracles):\n" + (
        "\n".join(wrong))


def _stand_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, module: str, source: str) -> None:
    """Let ``module``'s source be ``source`` for the checker (a file under ``tmp_path``)."""
    fake = tmp_path / MODULES[module].relative_to(PACKAGE.parent)
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text(source)
    monkeypatch.setitem(MODULES, module, fake)


def test_the_checker_sees_every_kind_of_import(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """Module-level, function-level, relative and ``import_module`` imports are all found, each
    resolved to the module it executes."""
    _stand_in(monkeypatch, tmp_path, "nvfp4lab.checkpoint.formats.gguf", (
        "import nvfp4lab.codec\n"
        "from nvfp4lab.report import runner\n"
        "def f():\n"
        "    from .. import writer\n"
        "    from . import modelopt\n"
        "    import importlib\n"
        "    importlib.import_module('nvfp4lab.cli')\n"
        "    from nvfp4lab.checkpoint import load\n"
        "    import torch\n"
    ))
    found = [target for _, target in imports_of("nvfp4lab.checkpoint.formats.gguf")]
    assert found == ["nvfp4lab.codec", "nvfp4lab.report.runner", "nvfp4lab.checkpoint.writer",
                     "nvfp4lab.checkpoint.formats.modelopt", "nvfp4lab.cli",
                     "nvfp4lab.checkpoint"]


def test_the_checker_flags_an_import_up_and_into_the_oracles(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    _stand_in(monkeypatch, tmp_path, "nvfp4lab.codec", (
        "from nvfp4lab import vocab, kernels\n"
        "def f():\n"
        "    from nvfp4lab.checkpoint import load\n"
        "    from nvfp4lab.oracles import nvfp4\n"
    ))
    assert wrong_imports("nvfp4lab.codec") == [
        "nvfp4lab/codec.py:3 (numerics) imports nvfp4lab.checkpoint (interop)",
        "nvfp4lab/codec.py:4 (numerics) imports nvfp4lab.oracles.nvfp4 (oracles)",
    ]
    _stand_in(monkeypatch, tmp_path, "nvfp4lab.oracles.numbers", "import nvfp4lab.constants\n")
    assert wrong_imports("nvfp4lab.oracles.numbers") == [
        "nvfp4lab/oracles/numbers.py:1 (oracles) imports nvfp4lab.constants (facts)"]
