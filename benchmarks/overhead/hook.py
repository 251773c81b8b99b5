"""Hook overhead at the defaults a user gets: an in-run A/B inside real 2-rank jobs (DDP, a pipeline).

    python -m benchmarks.overhead.hook [--pairs 240] [--block-s 0.5] [--start-s 25] [--width 3072]
                                       [--loops ddp,manual,pipeline] [--volume-s 60] [--json PATH]
                                       [--hook KEY=VALUE ...]
    python -m benchmarks.overhead.hook --pool RUN.json [RUN.json ...]

Each loop shape runs as one 2-rank gloo job on this machine's cores, each rank on its own core
where there are enough (the hook's threads then share their rank's core: the worst case for the
hook). After ``--start-s`` seconds of work (a job's steady state, past its start-up), the job
alternates blocks of ``--block-s`` seconds (the same step counts on
every rank) with the hook working and paused (``hook.pause()``); the order within a pair
alternates so that drift hits both alike. A working block goes on while a window is busy on any
rank, so that no window is cut short or summarized in a paused block. Short blocks: a step's time
here drifts (its correlation with the next step's is ~0.55, with the 10th's ~0.2), and the drift
cancels within a pair of adjacent blocks (at width 3072, back to back, once: 240 pairs of 0.5 s
gave half the interval of 60 pairs of 2 s in the same time; the machine's load moves it as
much). Both arms train the same model: two copies differ in speed by their memory layout alone
(measured: 2% between two DDP copies of one model, hook off in both), more than the hook.

- ``ddp``: ``DistributedDataParallel`` built after ``profiler_hook.attach``, so its synchronization
  is counted and timed in the working blocks; paused, its two gradient hooks return at once.
- ``manual``: the hand-written all-reduce loop, for comparison with earlier measurements.
- ``pipeline``: the MLP split into two ``torch.distributed.pipelining`` stages, one per rank, each
  holding one of its ``width`` x ``width`` layers, trained by a 1F1B schedule over 4 microbatches,
  as PyTorch's pipelining docs write one: each step sends 4 activations and 4 gradients each way
  (``batch_isend_irecv``, then ``wait()``), the point-to-point traffic the fault suite's pipeline
  jobs carry, here with a core per rank.

The model is an MLP of ``--width`` (3072: ~90-110 ms steps on one core here, in the 50-120 ms of
the DDP scripts users brought to us; 2048: ~36 ms; 512: ~4 ms, where the hook's ~36 µs of CPU a
step are ~0.9% and the steps' jitter on shared cores is too large for the A/B to resolve it).
What is counted is the whole training time per step as the loop measures it, windows, the
summarizing thread and the shipper included; heartbeats (every 5 s) go on in paused blocks too.
``overhead_pct`` is the ratio of the time per step working vs. paused, over all pairs (windows
come every ``window_s`` of working time, as they would), with ``ci95_pct`` its 95% bootstrap
interval over pairs; ``median_pair_pct`` is the median over pairs of each pair's ratio, which
leaves out the windows of the pairs that had none, with ``median_ci95_pct`` its own interval.
``step_us`` (the always-on work per step), ``window_ms`` (one periodic window) and
``stacked_window_ms`` (one with Python stacks: the first two of a job, triggered ones, and all
while a rank stands out) are measured alone in one process. The volume figures come from
``--volume-s`` seconds of uninterrupted training after the pairs (each pause closes a step row
early, so the alternating blocks ship more rows than a job does).

One run's pairs vary by 3-9% each (steps' jitter on shared cores), so a run of 240 pairs gives
the median to about ±0.5 points. ``--pool`` reads the ``--json`` of several runs and prints
their pairs' figures pooled per loop shape (``pair_s``: each pair's working and paused seconds
and steps), running nothing.

``--hook KEY=VALUE`` (repeatable) sets a hook option away from its default, to find where the cost
is (``--hook window_s=0``: no windows; ``--hook enable=false``: an A/A run); the figures to report
are those at the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.overhead.blocks import window_busy
from benchmarks.procs import free_port
from rankscope.diagnosis.detectors.straggler.functions import PYTHON_KINDS
from rankscope.profiler_hook.config import Config, Identity
from rankscope.profiler_hook.hook import Hook
from rankscope.profiler_hook.sinks import NullSink
from rankscope.wire.records import WindowSummary, decode

WORLD = 2


def _model(width: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(128, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )  # fmt: skip


def _stage(model: Any, rank: int, width: int) -> tuple[Any, Any]:
    """Rank ``rank``'s half of ``model`` as a pipeline stage (``width`` x ``width`` layers: the
    first stage the input layer and one, the last one and the output layer) and its 1F1B schedule."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    layers = list(model)[:4] if rank == 0 else [torch.nn.Linear(width, width), torch.nn.ReLU(), model[4]]
    stage = PipelineStage(torch.nn.Sequential(*layers), rank, WORLD, torch.device("cpu"))
    return stage.submod, Schedule1F1B(stage, n_microbatches=4, loss_fn=torch.nn.functional.cross_entropy)


def _worker(
    rank: int, loop: str, port: int, args: argparse.Namespace, spool: str, out: str, options: dict
) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from rankscope import profiler_hook

    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= WORLD:
        os.sched_setaffinity(0, {cores[rank]})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    hook = profiler_hook.attach(
        job=f"overhead-{loop}", spool_dir=spool, rank=rank, world_size=WORLD, **options
    )
    model = DDP(_model(args.width)) if loop == "ddp" else _model(args.width)
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(16)]
    if loop == "pipeline":
        model, schedule = _stage(model, rank, args.width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        if loop == "pipeline":
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
            opt.step()
            return
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if loop == "manual":
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
            dist.all_reduce(flat)
            flat /= WORLD
        opt.step()

    trace: list[tuple[float, bool]] = []  # every working step: its time, and whether a window was busy

    def run(mode: str, n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            t = time.perf_counter()
            if mode == "on":
                with hook.step():
                    step(i)
                trace.append((time.perf_counter() - t, window_busy(hook)))
            else:
                step(i)
        return time.perf_counter() - t0

    def block(mode: str, n: int) -> tuple[float, int]:
        """A block of ``n`` steps, working or paused; a working block goes on, ``n`` steps at a
        time, while a window is busy on any rank (a pause would cut it short, or leave its
        summarizing to the paused block). Its time and steps."""
        if mode == "on":
            hook.resume()
        else:
            hook.pause()
        took, steps = run(mode, n), n
        while mode == "on":
            flag = torch.tensor([float(window_busy(hook))])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank runs the same steps
            if not flag.item():
                break
            took, steps = took + run(mode, n), steps + n
        return took, steps

    block("on", 30)
    block("off", 30)
    per_step = torch.tensor([block("off", 100)[0] / 100])
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # every rank runs the same block lengths
    n = max(3, round(args.block_s / float(per_step)))
    # Measure the steady state of a job, past its start-up.
    block("on", round(args.start_s / float(per_step)))
    trace.clear()
    rows = []
    for p in range(args.pairs):
        order = ("on", "off") if p % 2 == 0 else ("off", "on")
        runs = {mode: block(mode, n) for mode in order}
        rows.append(
            {"on_s": runs["on"][0], "on_steps": runs["on"][1], "off_s": runs["off"][0], "off_steps": n}
        )
    tail = [time.time()]  # the volume: uninterrupted training, as a job runs
    block("on", max(1, round(args.volume_s / float(per_step))))
    tail.append(time.time())
    hook.close()
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {"rows": rows, "tail": tail, "windows": _window_costs(trace), "dropped": hook.shipper.dropped}
        )
    )


def _window_costs(trace: list[tuple[float, bool]]) -> list[float]:
    """What each window cost the training loop (seconds): the working steps it was busy (profiling,
    then summarizing on its thread) and the two after, less the median working step without one."""
    quiet = [dt for dt, busy in trace if not busy]
    if not quiet:
        return []
    typical, costs, k = statistics.median(quiet), [], 0
    while k < len(trace):
        if not trace[k][1]:
            k += 1
            continue
        end = k
        while end < len(trace) and trace[end][1]:
            end += 1
        costs.append(sum(dt - typical for dt, _ in trace[k : end + 2]))
        k = end
    return costs


def in_run(loop: str, args: argparse.Namespace, options: dict) -> dict[str, Any]:
    """One job of ``loop`` with alternating blocks; the ratios and the volume it shipped."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="rankscope-overhead-") as tmp:
        spool, out = f"{tmp}/spool", f"{tmp}/out"
        os.makedirs(out)
        mp.start_processes(
            _worker,
            args=(loop, free_port(), args, spool, out, options),
            nprocs=WORLD,
            start_method="spawn",
        )
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
        volume = _volume(Path(spool), ranks[0]["tail"])
    # The job runs at its slowest rank's pace: per pair, the slowest rank's block times.
    pairs = [
        [
            max(r["rows"][i]["on_s"] for r in ranks),
            ranks[0]["rows"][i]["on_steps"],
            max(r["rows"][i]["off_s"] for r in ranks),
            ranks[0]["rows"][i]["off_steps"],
        ]
        for i in range(args.pairs)
    ]
    return {
        "loop": loop,
        "width": args.width,
        "steps_per_block": pairs[0][3],
        **_figures(pairs),
        "pair_s": pairs,
        "dropped": sum(r["dropped"] for r in ranks),
        "window_job_ms": round(1e3 * statistics.median(w), 1)
        if (w := [c for r in ranks for c in r["windows"]])
        else 0.0,
        **volume,
    }


def _figures(pairs: list[list]) -> dict[str, Any]:
    """The A/B's figures from its pairs, each ``[on_s, on_steps, off_s, off_steps]``: the time per
    step paused and working, the overall ratio with its 95% interval, and the median of the pairs'
    ratios (the issue's measure) with its own."""
    on, on_steps, off, off_steps = (list(col) for col in zip(*pairs, strict=True))
    ratios = [(a / n) / (b / m) for a, n, b, m in pairs]
    return {
        "pairs": len(pairs),
        "off_ms_per_step": round(1e3 * sum(off) / sum(off_steps), 3),
        "on_ms_per_step": round(1e3 * sum(on) / sum(on_steps), 3),
        "overhead_pct": round(_pct(on, on_steps, off, off_steps, range(len(pairs))), 3),
        "ci95_pct": _bootstrap(on, on_steps, off, off_steps),
        "median_pair_pct": round((statistics.median(ratios) - 1) * 100, 3),
        "median_ci95_pct": _median_interval(ratios),
        "pair_pct": [round((r - 1) * 100, 2) for r in ratios],
    }


def _pct(on: list[float], on_steps: list[int], off: list[float], off_steps: list[int], idx: Any) -> float:
    """How much longer a working step took than a paused one (in %), over the pairs ``idx``."""
    on_s, off_s = sum(on[i] for i in idx), sum(off[i] for i in idx)
    return (on_s / sum(on_steps[i] for i in idx) / (off_s / sum(off_steps[i] for i in idx)) - 1) * 100


def _bootstrap(
    on: list[float], on_steps: list[int], off: list[float], off_steps: list[int], n: int = 2000
) -> list[float]:
    """The 95% interval of the overall ratio of time per step (in %), resampling pairs."""
    rng, idx = random.Random(0), range(len(on))
    ratios = sorted(_pct(on, on_steps, off, off_steps, rng.choices(idx, k=len(on))) for _ in range(n))
    return [round(ratios[int(0.025 * n)], 2), round(ratios[int(0.975 * n)], 2)]


def _median_interval(ratios: list[float], n: int = 2000) -> list[float]:
    """The 95% interval of the median of the pairs' ratios (in %), resampling pairs."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return [round((meds[int(0.025 * n)] - 1) * 100, 2), round((meds[int(0.975 * n)] - 1) * 100, 2)]


def pool(paths: list[str]) -> list[dict[str, Any]]:
    """Earlier runs' pairs (their ``--json``), pooled per loop shape: one row each, as a run's."""
    by_loop: dict[str, list] = defaultdict(list)
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            if "pair_s" not in row:
                raise SystemExit(f"--pool {path}: its rows have no pair_s (written by an older version)")
            by_loop[row["loop"]] += row["pair_s"]
    return [{"loop": loop, **_figures(pairs)} for loop, pairs in by_loop.items()]


def _volume(spool: Path, tail: list[float]) -> dict[str, float]:
    """Bytes one rank shipped: always-on records (step rows, heartbeats) per minute of the
    uninterrupted ``tail`` (its start and end, epoch seconds), and per window over the run."""
    always: dict[int, int] = defaultdict(int)
    windows: list[int] = []
    stacked = 0
    start_us, end_us = (int(t * 1e6) for t in tail)
    for f in spool.rglob("*.jsonl"):
        for line in f.read_bytes().splitlines():
            rec = decode(line)
            if isinstance(rec, WindowSummary):
                windows.append(len(line) + 1)
                stacked += any(fn.kind in PYTHON_KINDS for fn in rec.functions)
            elif rec.TYPE in ("steps", "heartbeat") and start_us <= rec.time_us <= end_us:
                always[rec.rank] += len(line) + 1
    minutes = (end_us - start_us) / 60e6
    return {
        "always_on_kb_per_min": round(max(always.values(), default=0) / minutes / 1e3, 1),
        "window_kb": round(max(windows) / 1e3, 1) if windows else 0.0,
        "windows": len(windows) // WORLD,
        "stacked_windows": stacked // WORLD,
    }


def components(width: int, reps: int = 5) -> dict[str, float]:
    """The hook's two costs measured alone, in one process.

    ``step_us``: the always-on work of one step (begin/end, a data fetch, one tracked collective).
    ``window_ms``: one periodic window on the benchmark's model: profiler start, the extra time of
    its steps, stop, and summarizing (median of ``reps`` windows); ``stacked_window_ms``: one that
    records Python stacks (those that look for a cause), alternating with the periodic ones.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rankscope.profiler_hook.summarize import summarize

    hook = Hook(
        Config(window_s=0, sink="none"), Identity(rank=0, local_rank=0, world_size=1, host="b"), NullSink()
    )
    n = 20_000
    t = time.perf_counter()
    for _ in hook.wrap_loader(range(n)):
        hook.begin_step()
        hook.tracker.exit(hook.tracker.enter("world", "all_reduce", 4))
        hook.end_step()
    step_us = (time.perf_counter() - t) / n * 1e6
    hook.close()

    torch.set_num_threads(1)
    model = _model(width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))

    def train_step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # as attach sets it: no lines per window
    steps, cfg = Config().window_steps, Config()
    costs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps + 1):
        for stacks in costs:
            t0 = time.perf_counter()
            for _ in range(steps):
                train_step()
            plain = time.perf_counter() - t0
            t0 = time.perf_counter()
            prof: Any = profile(activities=[ProfilerActivity.CPU], with_stack=stacks and cfg.with_stack)
            prof.start()
            for _ in range(steps):
                train_step()
            prof.stop()
            summarize(prof.profiler.kineto_results, [], int(1e9), cfg.max_functions)
            costs[stacks].append(time.perf_counter() - t0 - plain)
    return {
        "step_us": round(step_us, 2),
        "window_ms": round(1e3 * statistics.median(costs[False][1:]), 2),
        "stacked_window_ms": round(1e3 * statistics.median(costs[True][1:]), 2),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=240, help="block pairs per loop shape (default 240)")
    p.add_argument("--block-s", type=float, default=0.5, help="seconds per block (default 0.5)")
    p.add_argument(
        "--start-s", type=float, default=25.0, help="seconds of work before the pairs (default 25)"
    )
    p.add_argument("--width", type=int, default=3072, help="the model's hidden width (default 3072)")
    p.add_argument("--loops", default="ddp,manual,pipeline", help="loop shapes, comma-separated")
    p.add_argument(
        "--volume-s", type=float, default=60.0, help="seconds of uninterrupted training for the volume"
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--hook", action="append", default=[], metavar="KEY=VALUE", help="a hook option off its default"
    )
    p.add_argument(
        "--pool",
        nargs="+",
        metavar="JSON",
        help="print earlier runs' pairs pooled per loop shape; run nothing",
    )
    a = p.parse_args(argv)
    if a.pool:
        pooled = pool(a.pool)
        _table(pooled, ["loop", "pairs", "off_ms_per_step", "on_ms_per_step", "overhead_pct", "ci95_pct",
                        "median_pair_pct", "median_ci95_pct"])  # fmt: skip
        return {"benchmark": "hook_overhead", "pooled": a.pool, "rows": pooled}
    options = dict(_option(o) for o in a.hook)
    t0 = time.perf_counter()
    rows = [in_run(loop, a, options) for loop in a.loops.split(",")]
    parts = components(a.width)
    cfg = Config(**options)
    result = {
        "benchmark": "hook_overhead",
        "ranks": WORLD,
        "settings": options or "defaults",
        "window_s": cfg.window_s,
        "overhead_pct": rows[0]["overhead_pct"],
        **parts,
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _table(rows, ["loop", "off_ms_per_step", "on_ms_per_step", "overhead_pct", "ci95_pct", "median_pair_pct",
                  "median_ci95_pct", "pairs", "windows", "stacked_windows", "window_job_ms",
                  "always_on_kb_per_min", "window_kb", "dropped"])  # fmt: skip
    share = (
        f"every {cfg.window_s:.0f} s: {parts['window_ms'] / 10 / cfg.window_s:.3f}%"
        if cfg.window_s
        else "none"
    )
    print(f"\nalways-on work per step: {parts['step_us']} us; one periodic window: {parts['window_ms']} ms "
          f"({share} of a rank's time); one with Python stacks: {parts['stacked_window_ms']} ms")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return result


def _table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or key not in Config.__dataclass_fields__:
        raise SystemExit(f"--hook {text!r}: expected KEY=VALUE with KEY a profiler_hook.Config field")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


if __name__ == "__main__":
    main()
