"""Attaching the hook: its public API, a light import, its settings, what the environment does
wrong, torch releases it was not tested on."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rankscope import profiler_hook
from rankscope.profiler_hook.config import Config
from rankscope.wire.errors import UsageError
from rankscope.wire.records import (
    WindowSummary,
    decode,
)
from tests.hook.common import one_rank_hook, run_steps
from tests.records import ListSink

# Steps, windows and threads timed on the machine's clock: no other test beside them.
pytestmark = pytest.mark.alone


def test_public_api_is_sorted_and_importable() -> None:
    # isort-style order, as ruff keeps it: CONSTANTS, then Classes, then functions.
    def order(name: str) -> tuple[int, str]:
        return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)

    assert profiler_hook.__all__ == sorted(profiler_hook.__all__, key=order)
    for name in profiler_hook.__all__:
        assert hasattr(profiler_hook, name)


def test_importing_the_hook_loads_nothing_heavy() -> None:
    code = (
        "import sys, profiler_hook; "
        "print([m for m in ('pandas', 'clickhouse_connect', 'chdb', 'fastapi', 'kafka', 'torch') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_config_rejects_bad_settings_naming_the_field() -> None:
    with pytest.raises(UsageError, match="window_steps"):
        Config(window_steps=0)
    with pytest.raises(UsageError, match="window_s"):
        Config(window_s=-1)
    with pytest.raises(UsageError, match="sink"):
        Config(sink="carrier-pigeon")
    with pytest.raises(UsageError, match="queue_size"):
        Config(queue_size=0)
    with pytest.raises(UsageError, match="trigger_ratio"):
        Config(trigger_ratio=0.9)
    with pytest.raises(UsageError, match="window_budget"):
        Config(window_budget=2)


def test_the_window_budget_comes_from_the_script_else_the_environment_else_half_a_percent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Config().window_budget == 0.005
    monkeypatch.setenv("RANKSCOPE_WINDOW_BUDGET", "0.02")
    assert Config().window_budget == 0.02
    assert Config(window_budget=0.01).window_budget == 0.01
    for bad in ("two", "0", "1.5"):
        monkeypatch.setenv("RANKSCOPE_WINDOW_BUDGET", bad)
        with pytest.raises(UsageError, match=r"(?i)window_budget"):
            Config()


def test_a_hook_profiles_on_its_clock() -> None:
    sink = ListSink()
    hook = one_rank_hook(sink, window_s=0.2, window_steps=3, with_stack=False, window_budget=1.0)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.5:  # a plan every 0.2 s, each LEAD_S (2 s) ahead
        with hook.step():
            time.sleep(0.005)
    hook.close()
    wins = [r for r in map(decode, sink.got) if isinstance(r, WindowSummary)]
    assert len(wins) >= 1
    assert all(w.step_hi - w.step_lo == 3 for w in wins)


def test_disabled_hook_is_a_no_op(tmp_path: Path) -> None:
    hook = profiler_hook.attach(enable=False, spool_dir=str(tmp_path), rank=0, world_size=1)
    run_steps(hook, 5)
    hook.close()
    assert not list(tmp_path.rglob("*.jsonl"))


@pytest.mark.parametrize(
    ("where", "settings", "env"),
    [
        ("a spool dir that cannot be created", {"spool_dir": "/proc/rankscope"}, {}),
        ("a spool dir under a file", {"spool_dir": "/dev/null/rankscope"}, {}),
        ("RANK=abc", {}, {"RANK": "abc", "WORLD_SIZE": "2"}),
    ],
)
def test_attach_never_raises_for_what_the_environment_does_wrong(
    where: str, settings: dict, env: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    hook = profiler_hook.attach(**{"spool_dir": str(tmp_path), **settings})
    assert (hook.enabled, hook.failures) == (False, 1), where
    run_steps(hook, 3)  # the job trains on
    hook.close()


_IMPORTER_PROBE = """
import sys, threading, time
import torch
assert "torch._inductor" not in sys.modules
importers = []

class Probe:  # notes which thread imports torch._inductor
    def find_spec(self, name, path=None, target=None):
        if name == "torch._inductor":
            importers.append(threading.current_thread().name)
        return None

sys.meta_path.insert(0, Probe())
from rankscope.profiler_hook.config import Config, Identity
from rankscope.profiler_hook import events, threadstates
from rankscope.profiler_hook.hook import Hook
from rankscope.wire.records import WindowSummary, decode

class Sink:
    got = []
    def send(self, key, value): self.got.append(value)
    def close(self): pass

hook = Hook(Config(window_s=0.2, window_steps=3, with_stack=False),
            Identity(rank=0, local_rank=0, world_size=1, host="h"), Sink())
at_attach = list(importers)
torch.optim.SGD(torch.nn.Linear(2, 2).parameters())  # the script's own imports (torch._dynamo)
t0, worst = time.monotonic(), 0.0
while time.monotonic() - t0 < 60 and not any(isinstance(decode(r), WindowSummary) for r in Sink.got):
    t = time.perf_counter()
    with hook.step():
        time.sleep(0.005)
    worst = max(worst, time.perf_counter() - t)
hook.close()
print(at_attach, importers, worst < 0.5, any(isinstance(decode(r), WindowSummary) for r in Sink.got))
"""


def test_the_profilers_first_start_is_paid_at_attach_not_by_a_step() -> None:
    """torch.profiler's first start() imports torch._inductor (~1.7 s): the hook does it at attach,
    on the script's thread (on a thread of its own it raced the script's imports), so no step waits."""
    out = subprocess.run(
        [sys.executable, "-c", _IMPORTER_PROBE], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "['MainThread'] ['MainThread'] True True"


def test_a_job_id_falling_back_to_none_is_warned_about_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Multi-node torchrun without --rdzv-id sets TORCHELASTIC_RUN_ID=none: unrelated runs would share it."""
    monkeypatch.delenv("RANKSCOPE_JOB", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setattr(profiler_hook.config, "_warned_shared_job", False, raising=False)
    with caplog.at_level(logging.WARNING, logger="rankscope.profiler_hook.config"):
        assert [Config().job, Config().job] == ["none", "none"]
        Config(job="chosen")
    assert len(caplog.records) == 1 and "TORCHELASTIC_RUN_ID=none" in caplog.text
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2a")
    monkeypatch.setattr(profiler_hook.config, "_warned_shared_job", False, raising=False)
    caplog.clear()
    assert Config().job == "3f2a" and not caplog.records


@pytest.mark.parametrize(
    ("version", "said"), [("2.7.1+cpu", True), ("2.8.0", False), ("2.15.0", False), ("2.16.0", True)]
)
def test_a_torch_outside_the_tested_releases_is_said_once_in_one_line(
    version: str, said: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from rankscope.profiler_hook import hook as hook_module

    monkeypatch.setattr(torch, "__version__", version)
    with caplog.at_level(logging.WARNING, logger="rankscope.profiler_hook.hook"):
        hook_module._check_release.__wrapped__()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == (
        [
            f"rankscope: torch {version} is outside the releases the hook is tested on (2.8 to 2.15): it keeps what it can"
        ]
        if said
        else []
    )
