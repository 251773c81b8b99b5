"""What the hook does with CUPTI on a GPU, as far as a machine without one holds it: whether it asks
kineto to detach CUPTI between windows (by the CUDA release torch was built with, as torch decides
for CUDA graphs), and that torch's one-cycle warning stays out of the user's log."""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch

from rankscope.profiler_hook import cupti


@pytest.fixture
def no_teardown(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(cupti.TEARDOWN, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("cuda", "detached"), [("13.0", True), ("12.6", True), ("12.4", False), (None, False)]
)
def test_cupti_is_detached_between_windows_only_where_cuda_graphs_survive_it(
    no_teardown: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, cuda: str | None, detached: bool
) -> None:
    no_teardown.setattr(torch.version, "cuda", cuda)
    with caplog.at_level(logging.INFO, logger="rankscope.profiler_hook.cupti"):
        assert cupti.ask_teardown() is detached
    assert os.environ.get(cupti.TEARDOWN) == ("1" if detached else None)
    assert ("stays attached" in caplog.text) is not detached


@pytest.mark.parametrize("value", ["0", "1"])
def test_a_users_own_teardown_setting_stands(no_teardown: pytest.MonkeyPatch, value: str) -> None:
    no_teardown.setenv(cupti.TEARDOWN, value)
    no_teardown.setattr(torch.version, "cuda", "13.0")
    assert cupti.ask_teardown() is (value == "1")
    assert os.environ[cupti.TEARDOWN] == value


def test_torchs_one_cycle_warning_is_kept_out_of_the_users_log() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with cupti.quiet():
            warnings.warn(
                "Warning: Profiler clears events at the end of each cycle. Only ...",
                UserWarning,
                stacklevel=1,
            )
            warnings.warn("the user's own warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["the user's own warning"]
