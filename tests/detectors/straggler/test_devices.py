"""What a slower device, a slow dataset or a slower GPU is named by: the forward, operator or kernels
that hold its extra time, or its operators as a whole; on hand-built jobs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from rankscope.diagnosis import JobData, diagnose
from rankscope.diagnosis.detectors.straggler.cause import ACROSS_OPERATORS
from rankscope.wire.records import sample_key
from tests.jobdata import functions_frame, only, samples_frame, synthetic


def test_a_slower_device_names_what_holds_half_its_excess_or_its_operators_as_a_whole() -> None:
    """Rank 6's device is slower (1.5 ms a step, 7.5 ms in its 5-step window). Its forward, its
    matrix product and the product's backward each hold under half of that: none is named, the
    finding says its operators as a whole, the largest with their shares. A forward that holds two
    thirds is named; so is the function of the job's code its stack samples put it in for half.
    The range a pipeline schedule marks around its forward holds all of it, and is no operator."""
    data = synthetic(slow={6: {"compute_us": 1500}})
    fwd = "train.py(10): forward"

    def frames(extra_fwd_us: float) -> dict[int, list[tuple]]:
        common = [
            ("op", "aten::mm", 15, 10_000.0),
            ("op", "AddmmBackward0", 15, 12_000.0),
            ("python", fwd, 5, 11_000.0),
            ("annotation", "Forward", 5, 33_000.0),
        ]
        slow = [
            ("op", "aten::mm", 15, 13_000.0),
            ("op", "AddmmBackward0", 15, 15_000.0),
            ("python", fwd, 5, 11_000.0 + extra_fwd_us),
            ("annotation", "Forward", 5, 33_000.0 + 7_500.0),
        ]
        return {r: slow if r == 6 else common for r in range(8)}

    f = only(diagnose(replace(data, functions=functions_frame(frames(2_500.0)))).findings)
    assert (f.cause, f.ranks, f.function) == ("compute", [6], ACROSS_OPERATORS)
    assert f.evidence["largest"] == pytest.approx(
        {"AddmmBackward0": 0.4, "aten::mm": 0.4, fwd: 0.333}, abs=0.01
    )
    assert "across the board, none holding half the extra time (" in f.summary
    assert "aten::mm 40%" in f.summary and "train.py(10): forward 33%)" in f.summary
    f = only(diagnose(replace(data, functions=functions_frame(frames(5_000.0)))).findings)
    assert (f.cause, f.function) == ("compute", fwd)
    assert f.evidence["function_share"] == pytest.approx(0.667, abs=0.01)
    step = "train.py(40): train_step"
    samples = samples_frame(
        {r: {sample_key(step, 41): 16, sample_key(fwd, 12): 8} for r in range(8) if r != 6}
        | {6: {sample_key(step, 41): 12, sample_key(fwd, 12): 20}}
    )
    f = only(diagnose(replace(data, functions=functions_frame(frames(2_500.0)), samples=samples)).findings)
    assert (f.cause, f.function) == ("compute", fwd)
    assert f.evidence["stack_samples_in_function"] == "20/32"


def test_a_slower_devices_largest_operators_are_quoted_at_their_median_calls_time() -> None:
    """As the rule weighs them: rank 6's ``aten::mm`` takes as long as its peers' at its median
    call, its extra 3 ms in a few calls preempted on shared cores. Quoted by their means, it read
    40% beside "none holding half"; at the median call it holds none of it, and its backward's
    40% leads."""
    data = synthetic(slow={6: {"compute_us": 1500}})
    common = [("op", "aten::mm", 15, 10_000.0), ("op", "AddmmBackward0", 15, 12_000.0)]
    slow = [("op", "aten::mm", 15, 13_000.0), ("op", "AddmmBackward0", 15, 15_000.0)]
    functions = functions_frame({r: slow if r == 6 else common for r in range(8)})
    mm = (functions["rank"] == 6) & (functions["name"] == "aten::mm")
    functions.loc[mm, "p50_us"] = 10_000.0 / 15  # the peers' median call
    f = only(diagnose(replace(data, functions=functions)).findings)
    assert (f.cause, f.ranks, f.function) == ("compute", [6], ACROSS_OPERATORS)
    assert f.evidence["largest"] == pytest.approx({"AddmmBackward0": 0.4, "aten::mm": 0.0}, abs=0.01)
    assert "(AddmmBackward0 40%, aten::mm 0%)" in f.summary, f.summary


@pytest.mark.parametrize("padded", [False, True])
def test_a_slower_model_is_named_by_its_innermost_forward_not_the_module_around_it(padded: bool) -> None:
    """The frames of a transformer under DDP, as torch.profiler records them (3 callers each):
    ``module.py: _call_impl`` runs every module, so it is a caller of each model function and
    called by each. Callers are followed along each frame's own path, not through every path of a
    frame of the same name, or every model function would enclose every other one and the module
    event around the block (a few µs longer than its forward) would be named.

    ``padded``: the slower rank's batch is padded (the demo's degraded device), which takes one
    ``aten::reshape`` more a step than its peers', 52 against 51, each of them slower: its reshapes
    hold a third of the excess, but the call more holds ~2% of it. No code path of its own."""
    data = synthetic(slow={6: {"compute_us": 1500}})
    call, gpt, block = (
        "torch/nn/modules/module.py(1782): _call_impl",
        "gpt.py(170): forward",
        "gpt.py(156): forward",
    )

    def frames(scale: float) -> list[tuple]:
        return [
            ("op", "aten::addmm", 40, 10_000.0 * scale),
            ("python", "nn.Module: GPT_0", 5, 16_000.0 * scale, "distributed.py(1710): _run_ddp_forward"),
            (
                "python",
                gpt,
                5,
                15_990.0 * scale,
                f"distributed.py(1710): _run_ddp_forward > nn.Module: GPT_0 > {call}",
            ),
            ("python", "nn.Module: Block_0", 5, 15_000.0 * scale, f"nn.Module: GPT_0 > {call} > {gpt}"),
            ("python", block, 5, 14_990.0 * scale, f"{gpt} > nn.Module: Block_0 > {call}"),
            ("pylib", "nn.Module: Linear_0", 5, 2_000.0 * scale, f"nn.Module: Block_0 > {call} > {block}"),
            ("pylib", call, 5, 1_990.0 * scale, f"{call} > {block} > nn.Module: Linear_0"),
            (
                "pylib",
                "linear.py(130): forward",
                5,
                1_980.0 * scale,
                f"{block} > nn.Module: Linear_0 > {call}",
            ),
        ]

    # 51 and 52 calls a step over the window's 5 steps, each of the culprit's 1.5x as long.
    reshape = {
        r: [("op", "aten::reshape", 260, 7_650.0) if r == 6 else ("op", "aten::reshape", 255, 5_000.0)]
        for r in range(8)
    }
    data = replace(
        data,
        functions=functions_frame(
            {r: frames(1.5 if r == 6 else 1.0) + (reshape[r] if padded else []) for r in range(8)}
        ),
    )
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.function) == ("compute", [6], block)
    assert f.evidence["stack"] == f"{gpt} > nn.Module: Block_0 > {call}"


def test_a_slow_dataset_is_named_by_its_own_function_with_the_loader_above_it() -> None:
    data = synthetic(slow={2: {"data_us": 2000}})
    loader = ("dataloader", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 5, 1_000.0)
    get = "data.py(30): __getitem__"
    peers = [loader, ("python", get, 320, 500.0, "torch/utils/data/_utils/fetch.py(50): fetch")]
    slow = [
        (*loader[:3], 11_000.0),
        ("python", get, 320, 10_400.0, "torch/utils/data/_utils/fetch.py(50): fetch"),
        (
            "pylib",
            "<built-in function sleep>",
            320,
            10_000.0,
            f"torch/utils/data/_utils/fetch.py(50): fetch > {get}",
        ),
    ]
    data = replace(data, functions=functions_frame({r: slow if r == 2 else peers for r in range(8)}))
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.function) == ("dataloader", [2], get)
    assert f.evidence["loader"] == loader[1]


def _gpu_job(slow: dict[int, dict[str, float]]) -> JobData:
    """A GPU job's step rows: the training thread's CPU time is the launching of kernels, the same
    on every rank whatever the kernels take (its time waiting on the GPU, in ``loss.item()``,
    costs none), and the collectives' time is their GPU time (``profiler_hook.nccl``)."""
    data = synthetic(ranks=8, steps=600, slow=slow)
    rng = np.random.default_rng(1)
    return replace(data, steps=data.steps.assign(cpu_us=1500 * rng.lognormal(0, 0.05, len(data.steps))))


def test_a_slower_gpu_is_named_compute_by_its_kernels_while_its_cpu_time_stays_flat() -> None:
    """Rank 2's GPU runs the same GEMM kernels 1.75x as long (its CPU launches them in the same
    time as its peers'): a slower device, named by the kernel that holds the extra time, with the
    operator that launched it in the evidence — not a code path, for want of CPU time."""
    gemm = "sm90_xmma_gemm_bf16bf16_bf16f32"
    launch = "train.py(10): forward > aten::mm"

    def window(kernel_us: float) -> list[tuple]:
        return [
            ("op", "aten::mm", 15, 1500.0),
            ("python", "train.py(10): forward", 5, 3000.0),
            ("kernel", gemm, 15, kernel_us, launch),
            ("kernel", "elementwise_kernel", 30, 2000.0, "aten::add"),
            ("collective", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 5, 4000.0, "record_param_comms"),
        ]

    data = _gpu_job({2: {"compute_us": 1500}})
    data = replace(
        data, functions=functions_frame({r: window(17_500.0 if r == 2 else 10_000.0) for r in range(8)})
    )
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.function) == ("compute", [2], gemm), f.summary
    assert f.evidence["launched_by"] == "aten::mm"
    assert f.evidence["operator_ratio"] == pytest.approx(1.75)


def test_a_cpu_side_stall_in_a_gpu_job_is_named_by_its_function() -> None:
    """Rank 3 blocks 7.5 ms a step in a metrics upload while its GPU idles; its kernels take what
    its peers' take: a code path, named by the function."""
    common = [
        ("op", "aten::mm", 15, 1500.0),
        ("python", "train.py(10): forward", 5, 3000.0),
        ("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", 15, 10_000.0, "train.py(10): forward > aten::mm"),
    ]
    stall = [*common, ("python", "train.py(80): upload_metrics", 5, 7500.0)]
    data = _gpu_job({3: {"compute_us": 1500}})
    data = replace(data, functions=functions_frame({r: stall if r == 3 else common for r in range(8)}))
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [3], "train.py(80): upload_metrics"), f.summary
