"""Summaries of real profiler output: the functions a window saw, as the diagnosis reads them."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.procs import free_port
from rankscope import profiler_hook
from rankscope.profiler_hook.summarize import library_frame, summarize

# Steps, windows and threads timed on the machine's clock: no other test beside them.
pytestmark = pytest.mark.alone


def audit(model: torch.nn.Module) -> float:
    return sum(float(p.detach().norm()) for p in model.parameters())


@pytest.mark.releases
def test_summary_of_real_profiler_output() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    data = torch.utils.data.TensorDataset(torch.randn(256, 32), torch.randint(0, 4, (256,)))
    loader = torch.utils.data.DataLoader(data, batch_size=32)
    t0 = time.time_ns()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for x, y in loader:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            audit(model)
    window_ns = time.time_ns() - t0
    functions, busy, n = summarize(prof.profiler.kineto_results, [], window_ns, max_functions=300)
    assert n > 100
    # The 300 largest, and one more pattern that says what was left out: a function missing from
    # a window may have run there, below what was kept.
    everything, _, _ = summarize(prof.profiler.kineto_results, [], window_ns, max_functions=10**6)
    assert len(everything) > 300 and functions[:300] == everything[:300]
    (cut,) = functions[300:]
    assert (cut.kind, cut.count, cut.max_us) == ("cut", len(everything) - 300, everything[300].total_us)
    assert cut.total_us == pytest.approx(sum(f.total_us for f in everything[300:]), abs=0.1)
    by = {(f.kind, f.name.rsplit(": ", 1)[-1]): f for f in functions}
    # The Python function is identified by its name and the stack that called it.
    audit_fn = by[("python", "audit")]
    assert audit_fn.count == 8
    assert "test_summary_of_real_profiler_output" in audit_fn.stack
    assert by[("op", "aten::addmm")].count == 16  # two layers x eight batches
    # The job's own functions, apart from the interpreter's, the standard library's and packages'.
    assert ("pylib", "_call_impl") in by
    assert not [f.name for f in functions if f.kind == "python" and f.name.startswith(("torch/", "<"))]
    loader_fn = next(f for (k, _), f in by.items() if k == "dataloader")
    assert loader_fn.count >= 8
    for f in functions:
        assert f.p50_us <= f.p90_us <= f.max_us + 1e-6
        # mean is rounded to 0.01 us, total to 0.1 us
        assert f.mean_us * f.count == pytest.approx(f.total_us, rel=0.001, abs=0.005 * f.count + 0.1)
        assert " at 0x" not in f.name  # object addresses differ per rank: stripped
    assert 0 < busy["compute"] <= 1 and 0 <= busy["idle"] < 1


@pytest.mark.releases
def test_a_pipeline_schedules_microbatches_are_one_function_of_its_stage() -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        stage = PipelineStage(model, 0, 1, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        schedule.step(x, target=y)
        t0 = time.time_ns()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                schedule.step(x, target=y)
        functions, _, _ = summarize(prof.profiler.kineto_results, [], time.time_ns() - t0, max_functions=300)
    finally:
        torch.distributed.destroy_process_group()
    # The schedule annotates each microbatch's work ("Forward 0" ... "Backward 3"): one function of
    # the stage, run 4 times a step, so that a slower stage's excess is not split over its microbatches.
    by = {f.name: f.count for f in functions if f.kind == "annotation"}
    assert (by.get("Forward"), by.get("Backward")) == (8, 8)
    assert not [name for name in by if name.startswith(("Forward ", "Backward "))]


def pause_for_garbage_collection() -> None:
    time.sleep(0.15)


@pytest.mark.releases
def test_a_call_that_holds_most_of_a_window_is_an_execution_but_the_loop_around_it_is_not() -> None:
    """The frames open when the window starts and ends (the loop, its callers) are left out; a long
    call inside it — a garbage-collection pause taking most of a 5-step window — is kept."""
    model = torch.nn.Linear(32, 4)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        t0 = time.time_ns()  # after the start: a process's first one imports for ~1 s
        for step in range(5):
            model(torch.randn(8, 32)).sum().backward()
            if step == 2:
                pause_for_garbage_collection()
        window_ns = time.time_ns() - t0
    functions, _, _ = summarize(prof.profiler.kineto_results, [], window_ns, max_functions=300)
    names = {f.name.rsplit(": ", 1)[-1]: f for f in functions if f.kind == "python"}
    pause = names["pause_for_garbage_collection"]
    assert pause.count == 1 and pause.total_us >= 0.5 * window_ns / 1e3
    assert (
        "test_a_call_that_holds_most_of_a_window_is_an_execution_but_the_loop_around_it_is_not" not in names
    )


def _checkout_hook() -> bool:
    """Whether the hook is imported from a checkout's ``profiler_hook/`` on ``sys.path``."""
    return importlib.util.find_spec("profiler_hook") is not None


def test_library_frames_are_told_from_the_jobs_own_code() -> None:
    for name in (
        "torch/nn/modules/module.py(1751): _call_impl",  # an installed package
        "enum.py(686): __call__",  # the standard library, as the profiler shortens its paths
        "<built-in method item of Tensor object>",
        "rankscope/profiler_hook/collectives.py(130): wrapper",  # the hook's own frames
        f"{os.path.dirname(profiler_hook.__file__)}/collectives.py(130): wrapper",  # an editable install's
        # An editable install that maps the package to the checkout's directory, run from the
        # checkout: the profiler names the frame relative to the checkout, as a top-level module.
        *(["profiler_hook/collectives.py(521): <lambda>"] if _checkout_hook() else []),
        "/usr/lib/python3/dist-packages/yaml/__init__.py(10): load",
        "nn.Module: Linear_1",  # torch's module class
        "nn.Module: Sequential_0",
        "nn.Module: DistributedDataParallel_0",  # not in torch.nn itself
    ):
        assert library_frame(name), name
    for name in (
        "train.py(12): train_step",
        "test_hook.py(50): audit",
        "rankscope/demo_job.py(317): main",  # the demo's training script, in a checkout
        "/home/u/job/model.py(3): forward",
        "nn.Module: CausalSelfAttention_0",  # the job's own module class
    ):
        assert not library_frame(name), name
