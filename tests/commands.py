"""The ``rankscope`` command as the tests run it."""

from __future__ import annotations

import subprocess
import sys


def rankscope(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``rankscope *args`` in a new process of this interpreter, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "rankscope.cli", *args], capture_output=True, text=True, timeout=timeout
    )
