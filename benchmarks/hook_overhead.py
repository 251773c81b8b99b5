"""Hook overhead: the demo model on 2 gloo ranks, hook off vs. on at default settings, interleaved.

    python -m benchmarks.hook_overhead [--repeats 5] [--steps 2500] [--json PATH]

Each repeat runs the same fixed number of steps twice, without and with the hook (the order
alternates between repeats so drift hits both alike). The cost counted is the whole training
time per step as the training loop itself measures it — profiling windows, the summarizing
thread and shipping included — not only the median step, which a rare window would not move.
overhead_pct = (median over repeats of on/off time per step - 1) x 100.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from rankscope.workload import JobSpec, free_port, launch


def _run(hook: bool, steps: int, spool: str, n: int) -> dict[str, float]:
    spec = JobSpec(
        job=f"overhead-{n}",
        world_size=2,
        hosts=1,
        port=free_port(),
        max_steps=steps,
        hook={"spool_dir": spool} if hook else None,
        log_dir=f"{spool}/logs",
        progress=False,
    )
    stats = launch(spec)
    per_step = max(s["train_s"] / max(s["steps"], 1) for s in stats)
    return {
        "ms_per_step": 1e3 * per_step,
        "median_step_ms": statistics.median(s["median_step_ms"] for s in stats),
        "dropped": sum(s.get("dropped", 0) for s in stats),
        "sent": sum(s.get("sent", 0) for s in stats),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=2500, help="steps per run (default windows: one per 1,000)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rankscope-overhead-") as spool:
        for i in range(a.repeats):
            order = (False, True) if i % 2 == 0 else (True, False)
            res = {on: _run(on, a.steps, spool, i) for on in order}
            ratio = res[True]["ms_per_step"] / res[False]["ms_per_step"]
            med_ratio = res[True]["median_step_ms"] / res[False]["median_step_ms"]
            rows.append(
                {"repeat": i, "off": res[False], "on": res[True], "ratio": ratio, "median_ratio": med_ratio}
            )
            print(
                f"repeat {i}: off {res[False]['ms_per_step']:.3f} ms/step, on {res[True]['ms_per_step']:.3f} "
                f"ms/step, ratio {ratio:.4f} (median-step ratio {med_ratio:.4f})",
                flush=True,
            )
    ratios = [r["ratio"] for r in rows]
    result = {
        "benchmark": "hook_overhead",
        "ranks": 2,
        "steps_per_run": a.steps,
        "repeats": a.repeats,
        "overhead_pct": round((statistics.median(ratios) - 1) * 100, 3),
        "overhead_pct_min": round((min(ratios) - 1) * 100, 3),
        "overhead_pct_max": round((max(ratios) - 1) * 100, 3),
        "median_step_overhead_pct": round((statistics.median(r["median_ratio"] for r in rows) - 1) * 100, 3),
        "dropped_records": sum(r["on"]["dropped"] for r in rows),
        "seconds": round(time.perf_counter() - t0, 1),
        "runs": rows,
    }
    print()
    print("| metric | value |")
    print("|---|---|")
    for k in (
        "overhead_pct",
        "overhead_pct_min",
        "overhead_pct_max",
        "median_step_overhead_pct",
        "dropped_records",
    ):
        print(f"| {k} | {result[k]} |")
    print(f"| off ms/step (median) | {statistics.median(r['off']['ms_per_step'] for r in rows):.3f} |")
    print(f"| on ms/step (median) | {statistics.median(r['on']['ms_per_step'] for r in rows):.3f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
