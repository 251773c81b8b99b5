"""What ``pip install`` puts on a user's path: one name, ``rankscope``, holding every module of the
project's packages (the README's ``pip wheel --no-deps -w dist .``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_installs_one_top_level_name_holding_every_module(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: the build writes build/ and egg-info beside what it builds
    shutil.copytree(
        ROOT / "rankscope", src / "rankscope", symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
    )
    packages = sorted(p.name for p in (ROOT / "rankscope").iterdir() if p.is_symlink())
    for name in packages:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(tmp_path),
        str(src),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = tmp_path.glob("rankscope-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"rankscope"}
    expected = {f"rankscope/{f.name}" for f in (src / "rankscope").glob("*.py")} | {
        f"rankscope/{f.relative_to(src)}" for p in packages for f in (src / p).rglob("*.py")
    }
    assert expected <= set(names), sorted(expected - set(names))
    assert {f"rankscope/{p}/__init__.py" for p in packages} <= set(names)
