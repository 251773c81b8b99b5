"""What ``pip install`` puts on a user's path: one name, ``rankscope``, holding every module of the
project's packages (the README's ``pip wheel --no-deps -w dist .``); the hook-only wheel
(``pip wheel --no-deps -w dist packaging/hook``) holds what the hook imports and no more."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _wheel(project: Path, into: Path) -> list[str]:
    """Build the wheel of ``project`` into ``into``; the names it holds."""
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(into)]
    done = subprocess.run([*cmd, str(project)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = into.glob("*.whl")
    return zipfile.ZipFile(wheel).namelist()


def _copy(project: Path, to: Path) -> Path:
    """A copy of ``project`` (the build writes build/ and egg-info beside what it builds): its
    rankscope/ as it is, and each folder that rankscope/ links to beside it, as the links find it."""
    to.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        if (project / name).exists():
            shutil.copy(project / name, to / name)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(project / "rankscope", to / "rankscope", symlinks=True, ignore=ignore)
    for link in (project / "rankscope").iterdir():
        if link.is_symlink() and link.is_dir():
            target = (to / "rankscope" / os.readlink(link)).resolve()
            if not target.exists():
                shutil.copytree(link.resolve(), target, ignore=ignore)
        elif link.is_symlink():
            (to / "rankscope" / link.name).unlink()
            shutil.copy(link.resolve(), to / "rankscope" / link.name)
    return to


def test_the_wheel_installs_one_top_level_name_holding_every_module(tmp_path: Path) -> None:
    src = _copy(ROOT, tmp_path / "src")
    packages = sorted(p.name for p in (ROOT / "rankscope").iterdir() if p.is_symlink())
    names = _wheel(src, tmp_path / "dist")
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"rankscope"}
    expected = {f"rankscope/{f.name}" for f in (src / "rankscope").glob("*.py")} | {
        f"rankscope/{f.relative_to(src)}" for p in packages for f in (src / p).rglob("*.py")
    }
    assert expected <= set(names), sorted(expected - set(names))
    assert {f"rankscope/{p}/__init__.py" for p in packages} <= set(names)


def test_the_hook_wheel_holds_what_the_hook_imports_and_runs_a_rank_from_it_alone(tmp_path: Path) -> None:
    hook = ROOT / "packaging" / "hook"
    src = _copy(hook, tmp_path / "src" / "packaging" / "hook")
    names = _wheel(src, tmp_path / "dist")
    files = {n for n in names if ".dist-info/" not in n}
    assert files == {"rankscope/__init__.py"} | {
        f"rankscope/{f.relative_to(ROOT)}"
        for package in ("wire", "profiler_hook")
        for f in (ROOT / package).rglob("*.py")
        if "__pycache__" not in f.parts
    }
    full, alone = (tomllib.loads((p / "pyproject.toml").read_text())["project"] for p in (ROOT, hook))
    assert alone["version"] == full["version"] and alone["dependencies"] == full["dependencies"]
    extras = alone["optional-dependencies"]
    assert extras == {k: full["optional-dependencies"][k] for k in extras}
    assert set(extras) == {"kafka", "lightning", "hf", "gpu"}

    # A rank of a job whose path holds this wheel and torch only: attach, steps, a spool.
    site = tmp_path / "site"
    zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))).extractall(site)
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(site)!r}]
        import rankscope
        assert rankscope.__file__.startswith({str(site)!r}), rankscope.__file__
        from rankscope import profiler_hook
        hook = profiler_hook.attach(job="hook-wheel", spool_dir={str(tmp_path / "spool")!r}, window_s=0)
        for _ in range(20):
            with hook.step():
                pass
        hook.close()
        ours = sorted(m.split(".")[1] for m in sys.modules if m.startswith("rankscope."))
        print(sorted(set(ours)))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD", "LOCAL_RANK"))}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "['profiler_hook', 'wire']"
    assert list((tmp_path / "spool").rglob("*.jsonl")), "the rank wrote nothing to its spool"
