"""Data flows one way — hook → wire → aggregator → store → diagnosis → renderers → api → CLI — and
no package imports one downstream of it (imports inside functions included)."""

from __future__ import annotations

import ast
import graphlib
import importlib.metadata
import os
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent

MAY_IMPORT = {
    "wire": set(),
    "profiler_hook": {"wire"},
    "aggregator": {"wire"},
    "diagnosis": {"wire"},
    "preflight": set(),
    "renderers": {"diagnosis", "preflight"},
    "api": {"wire", "aggregator", "diagnosis", "renderers"},
    "rankscope": {"wire", "profiler_hook", "aggregator", "diagnosis", "renderers", "api", "preflight"},
}


def _package(name: str) -> str:
    """The package of ours a module belongs to: ``rankscope.wire.records`` is ``wire``'s (the
    packages are imported by their installed names, under ``rankscope``), ``rankscope.cli``
    ``rankscope``'s."""
    parts = name.split(".")
    return parts[1] if parts[0] == "rankscope" and len(parts) > 1 and parts[1] in MAY_IMPORT else parts[0]


def _canonical(name: str) -> str:
    """A module's name as its file's path reads: ``rankscope.wire.records`` is ``wire/records.py``."""
    return name.removeprefix("rankscope.") if _package(name) != "rankscope" else name


def _imports(package: str) -> dict[str, set[str]]:
    """Each of our packages ``package`` imports, with the files that import it."""
    out: dict[str, set[str]] = {}
    for f in sorted((ROOT / package).rglob("*.py")):
        for name in _all_imports(f):
            top = _package(name)
            if top in MAY_IMPORT and top != package:
                out.setdefault(top, set()).add(str(f.relative_to(ROOT)))
    return out


def test_no_package_imports_one_downstream_of_it() -> None:
    assert set(MAY_IMPORT) == {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {
        "benchmarks",
        "tests",
    }, "a new package needs its place in the flow"
    wrong = {
        package: {dep: files for dep, files in _imports(package).items() if dep not in allowed}
        for package, allowed in MAY_IMPORT.items()
    }
    assert not any(wrong.values()), wrong


def test_the_packages_are_imported_by_their_installed_names_only() -> None:
    """The wheel installs one name, ``rankscope``, with the packages under it; in a checkout they are
    links to the top-level folders (``rankscope/wire -> ../wire``). A bare ``import wire`` would work
    here and fail installed, or load a second copy of the module beside ``rankscope.wire``."""
    links = {p.name: os.readlink(p) for p in (ROOT / "rankscope").iterdir() if p.is_symlink()}
    assert links == {p: f"../{p}" for p in MAY_IMPORT if p != "rankscope"}
    bare = {
        str(f.relative_to(ROOT)): names
        for package in (*MAY_IMPORT, "benchmarks", "tests")
        for f in sorted((ROOT / package).rglob("*.py"))
        if (names := sorted({n for n in _all_imports(f) if n.split(".")[0] in links}))
    }
    assert bare == {}, "import them as rankscope.<package>"


def test_every_error_kind_is_in_the_one_error_tree() -> None:
    """``wire/errors.py`` lists every kind of ``RankscopeError`` the product raises: none is
    defined elsewhere, so the CLI's and the API's mappings of the tree see them all."""
    from rankscope.wire import errors

    tree = {name for name, v in vars(errors).items() if isinstance(v, type) and issubclass(v, Exception)}
    elsewhere = {
        f"{f.relative_to(ROOT)}: {node.name}"
        for package in MAY_IMPORT
        for f in sorted((ROOT / package).rglob("*.py"))
        if f.relative_to(ROOT) != Path("wire/errors.py")
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.ClassDef) and {ast.unparse(b).split(".")[-1] for b in node.bases} & tree
    }
    assert elsewhere == set()


def test_the_demo_offers_faults_its_script_has() -> None:
    from rankscope.demo import FAULTS

    tree = ast.parse((ROOT / "rankscope" / "demo_job.py").read_text())
    script = next(
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == ["FAULTS"]
    )
    assert set(FAULTS.values()) <= set(script)


def test_the_product_holds_no_test_harness_and_its_commands_no_training_code() -> None:
    """No product package imports the benchmarks' fault harness or the tests; the demo runs its
    training script by path (as a user runs one), so no command loads training code."""
    product = [p for p in MAY_IMPORT if p != "rankscope"] + ["rankscope"]
    harness = {
        str(f.relative_to(ROOT))
        for package in product
        for f in sorted((ROOT / package).rglob("*.py"))
        if any(name.split(".")[0] in ("benchmarks", "tests") for name in _all_imports(f))
    }
    assert not harness
    for module in ("cli.py", "demo.py"):
        names = _all_imports(ROOT / "rankscope" / module)
        assert not [n for n in names if n.split(".")[-1] in ("demo_job", "torch")], (module, names)


def test_the_architecture_doc_draws_these_layers() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (.+) \|$", doc, re.MULTILINE)
    drawn = {
        package: set(re.findall(r"`(\w+)`", deps)) if "all" not in deps else set(MAY_IMPORT) - {package}
        for package, deps in rows
        if package in MAY_IMPORT
    }
    assert drawn == MAY_IMPORT


def _module_imports(f: Path) -> set[str]:
    """The modules of this repository that file ``f`` imports, anywhere in it (inside functions
    too) but under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    parts = list(f.relative_to(ROOT).with_suffix("").parts)
    package = parts[:-1]  # a module's package; an __init__'s, its own
    tree = ast.parse(f.read_text(), str(f))
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            for a in node.names:  # a name may be a submodule: ``from . import topology``
                sub = f"{module}.{a.name}" if module else a.name
                out.add(sub if _is_module(sub) else module)
    return {_canonical(m) for m in out if _is_module(m)}


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _module(f: Path) -> str:
    parts = f.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles_anywhere() -> None:
    """No module imports, however indirectly, one that imports it (lazy imports inside functions
    count: they only hide a cycle), in the product, the benchmarks and the tests."""
    graph = {
        _module(f): _module_imports(f)
        for package in (*MAY_IMPORT, "benchmarks", "tests")
        for f in sorted((ROOT / package).rglob("*.py"))
    }
    # A package's own __init__ is imported by each of its modules, which Python allows: leave
    # out the edges from a module to the packages above it.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"an import cycle: {' -> '.join(e.args[1])}") from None


NOT_DECLARED = {
    "torch": "the user's: the hook runs on the release their job has",
    "pytorch_lightning": "Lightning's older name, tried where ``lightning`` is not installed",
}
"""Third-party modules the product imports without declaring them, and why."""
USED_THROUGH = {"chdb": "clickhouse-connect", "accelerate": "transformers"}
"""Declared requirements the product never imports itself: another of them loads it."""


def test_the_declared_dependencies_are_those_the_product_imports() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {k: v for k, v in project["optional-dependencies"].items() if k != "dev"}
    declared = {
        _normalized(re.match(r"[A-Za-z0-9._-]+", req)[0])  # type: ignore[index]
        for req in [*project["dependencies"], *(r for reqs in extras.values() for r in reqs)]
    }
    modules = {
        top
        for package in MAY_IMPORT
        for f in (ROOT / package).rglob("*.py")
        for top in (_package(m) for m in _all_imports(f))
        if top not in MAY_IMPORT and top not in sys.stdlib_module_names and top not in NOT_DECLARED
    }
    # A module's distribution as installed here (``kafka`` is kafka-python's), else its own name.
    distributions = importlib.metadata.packages_distributions()
    imported = {_normalized(distributions.get(m, [m])[0]) for m in modules}
    if "pynvml" in modules and "pynvml" not in distributions:  # optional, absent without a GPU
        imported = (imported - {"pynvml"}) | {"nvidia-ml-py"}
    assert imported - declared == set(), "imported by the product, declared nowhere in pyproject.toml"
    assert declared - imported - set(USED_THROUGH) == set(), "declared, never imported"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _all_imports(f: Path) -> list[str]:
    """The modules file ``f`` imports by absolute name, anywhere in it."""
    out = []
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def test_no_test_module_imports_another() -> None:
    """What tests share lives in fixtures (conftest.py) or helper modules (``tests/records.py``,
    ``tests/jobdata.py``…), never in another test module, whose tests it would collect twice."""
    shared = {
        str(f.relative_to(ROOT)): sorted(m for m in _all_imports(f) if m.split(".")[-1].startswith("test_"))
        for f in (ROOT / "tests").rglob("test_*.py")
    }
    assert {f: ms for f, ms in shared.items() if ms} == {}
