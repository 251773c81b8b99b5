"""Data flows one way — hook → wire → aggregator → store → diagnosis → renderers → api → CLI — and
no package imports one downstream of it (imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

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


def _imports(package: str) -> dict[str, set[str]]:
    """Each of our packages ``package`` imports, with the files that import it."""
    out: dict[str, set[str]] = {}
    for f in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
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


def test_the_cli_does_not_load_the_demo_workload() -> None:
    """The product's commands (``diagnose``, ``serve``…) import no demo training code: the demo's
    workload and fault injection load only when ``rankscope demo`` runs."""
    tree = ast.parse((ROOT / "rankscope" / "cli.py").read_text())
    top = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert not [n.module for n in top if n.module and n.module.split(".")[-1] == "workload"]
    demo = ast.parse((ROOT / "rankscope" / "demo.py").read_text())
    assert not [n for n in demo.body if isinstance(n, ast.ImportFrom) and n.module == "workload"]
