"""``benchmarks/results/RESULTS.md`` from the ``--json`` files kept beside it: one table per
benchmark, one row per run, newest first. The README and docs quote the newest row.

    python -m benchmarks.results           # rewrite RESULTS.md
    python -m benchmarks.results --check   # exit 1 if RESULTS.md is not what the files make

A run is kept as ``<benchmark>-<label>-<YYYY-MM-DD>.json`` (``faults-full-2026-11-27.json``) or
``<benchmark>-<YYYY-MM-DD>.json``: the JSON its benchmark wrote with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
OUT = HERE / "RESULTS.md"
_NAME = re.compile(
    r"(?P<bench>[a-z][a-z0-9_]*?)(?:-(?P<label>[a-z0-9_]+))?-(?P<date>\d{4}-\d{2}-\d{2})\.json"
)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.2f}%"


def _interval(pair: list[float] | None) -> str:
    return "—" if not pair else f"{pair[0]:+.2f} … {pair[1]:+.2f}%"


def _gb(x: float | None) -> str:
    return "—" if x is None else f"{x:g} GB"


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:g} s"


def _faults(run: dict[str, Any]) -> list[str]:
    t = run["totals"]
    faults = t["fault_scenarios"]
    scored = [s["score"] for s in run["scenarios"] if "score" in s]  # not those skipped
    named = [s["function_ok"] for s in scored if s.get("function_ok") is not None]
    return [
        f"{t['scenarios']} ({faults} faults, {t['healthy_scenarios']} healthy)",
        f"{round(t['top1_accuracy'] * faults)}/{faults}" if faults else "—",
        f"{sum(named)}/{len(named)}" if named else "—",
        f"{t['precision']:.2f}" if faults else "—",
        str(t["healthy_false_findings"]),
        str(t.get("false_extra_findings", "—")),
        _s(t["median_detect_s"]),
        _s(t["median_localize_s"]),
        _s(t["p90_localize_slowdowns_s"]),
        _s(t["max_localize_hangs_s"]),
        _s(t.get("median_stable_s")),
        # Scored as the service runs (absent before 2026-11-29's second session): every probe.
        f"{t['false_alarm_probes']}/{t['alarm_probes']} ({t['false_alarm_runs']} runs)"
        if "alarm_probes" in t
        else "—",
        str(t["false_tickets"]) if "false_tickets" in t else "—",
    ]


def _serve(run: dict[str, Any]) -> list[str]:
    rows = run["rows"]
    healthy = [r for r in rows if r["expected"] == "none"]
    faults = [r for r in rows if r["expected"] != "none"]
    return [
        f"{len(faults)} faults, {len(healthy)} healthy",
        f"{sum(r['right'] for r in faults)}/{len(faults)}",
        _s(run["median_open_s"]),
        _s(run["hang_open_s"]),
        f"{run['healthy_tickets']} in {run.get('healthy_job_hours', '—')} job-h",
        str(run.get("false_tickets", "—")),
        str(run.get("flaps", "—")),
    ]


def _overhead(run: dict[str, Any]) -> list[str]:
    rows = [r for r in run["rows"] if r["loop"] == "ddp"] or run["rows"]
    r = rows[0]
    return [
        f"{r['loop']}, width {r['width']}",
        str(r["pairs"]),
        f"{r['off_ms_per_step']:.2f}",
        f"{r['on_ms_per_step']:.2f}",
        _pct(r["overhead_pct"]),
        _interval(r.get("ci95_pct")),
        _pct(r.get("median_pair_pct")),
        f"{r['windows']} ({r.get('stacked_windows', '—')})",
        f"{r['window_job_ms']:.0f} ms",
        f"{run['step_us']:.2f} µs",
    ]


def _jobs(run: dict[str, Any]) -> list[str]:
    rows = run["rows"]

    def each(cell: Callable[[dict[str, Any]], str]) -> str:
        return "; ".join(f"{r['job']} {cell(r)}" for r in rows)

    worst = max(rows, key=lambda r: r["median_pair_pct"])
    return [
        f"{len(rows)} × {run['ranks']} ranks",
        str(min(r["pairs"] for r in rows)),
        each(lambda r: f"{r['off_ms_per_step']:.1f} → {r['on_ms_per_step']:.1f}"),
        # In one run (--in-run): the ratio of the time per step over all pairs' blocks.
        each(
            lambda r: (
                f"{_pct(r.get('ratio_pct', r.get('overhead_pct')))} "
                f"({_interval(r.get('ratio_ci95_pct', r.get('ci95_pct')))})"
            )
        ),
        each(lambda r: _pct(r["median_pair_pct"])),
        f"{worst['job']} {_pct(worst['median_pair_pct'])} ({_interval(worst['median_ci95_pct'])})",
        each(lambda r: "—" if r["window_ms"] is None else f"{r['window_ms']:.0f} ms"),
        each(lambda r: "/".join("—" if x is None else f"{x:g}" for x in r["windows"])),
        each(lambda r: "/".join("—" if x is None else f"{x:.2f}%" for x in r["windows_share_pct"])),
    ]


def _gpu(run: dict[str, Any]) -> list[str]:
    env = run["environment"]

    def arms(runs: list[dict[str, Any]]) -> str:
        by: dict[str, list[float]] = {}
        for r in runs:
            if r.get("mode") != "ab" and r.get("ms_per_step"):
                arm = " ".join([r["mode"], *(f"{k}={v}" for k, v in r.get("env", {}).items())])
                by.setdefault(arm, []).append(r["ms_per_step"])
        return "; ".join(f"{arm} {' / '.join(f'{x:.2f}' for x in ms)}" for arm, ms in by.items())

    def ab(runs: list[dict[str, Any]]) -> str:
        r = next((r for r in runs if r.get("mode") == "ab"), {})
        return f"{_pct(r.get('ab_median_pair_pct'))} ({r.get('ab_pairs', 0)} pairs)"

    def ms(runs: list[dict[str, Any]], key: str) -> str:
        times = [t for r in runs for t in r.get(key) or []]
        return "—" if not times else f"{1e3 * min(times):.0f}–{1e3 * max(times):.0f} ms"

    loops = run.get("loops", {})
    scenarios = run.get("scenarios", {}).get("runs", {})
    every = [r for runs in loops.values() for r in runs]
    return [
        f"{env.get('gpu', '—')}, torch {env['torch']}",
        "<br>".join(f"{loop}: {arms(runs)}" for loop, runs in loops.items()),
        "<br>".join(f"{loop}: {ab(runs)}" for loop, runs in loops.items()),
        f"{ms(every, 'window_start_s')} / {ms(every, 'window_stop_s')}",
        "; ".join(
            f"{name} {'right' if r.get('right') else 'wrong' if 'right' in r else 'not diagnosed'}"
            for name, r in scenarios.items()
        )
        or "—",
    ]


def _scale(run: dict[str, Any]) -> list[str]:
    sizes = run["sizes"]

    def each(cell: Callable[[dict[str, Any]], str]) -> str:
        return "; ".join("failed" if "error" in s else cell(s) for s in sizes)

    return [
        "; ".join(f"{s['ranks']:,} × {s['minutes']:g} min" for s in sizes),
        each(lambda s: f"{s['records_per_s']:,}"),
        each(lambda s: f"{s['diagnose_s']:g} s ({s['read_s']:g} s)"),
        each(lambda s: f"{s['cycle_s'][0]:g} s"),
        each(lambda s: _s(s.get("cycle_steady_s"))),
        each(lambda s: f"{s['peak_rss_gb']:g} GB"),
        each(lambda s: "yes" if s["straggler_named"] else "no"),
        each(
            lambda s: (
                f"{s['repeated_minutes']:g} min: {s['repeated_diagnose_s']:g} s "
                f"({s['repeated_read_s']:g} s), {_gb(s.get('repeated_peak_rss_gb'))}, "
                f"{'named' if s['repeated_straggler_named'] else 'not named'}"
                if "repeated_minutes" in s
                else "—"
            )
        ),
    ]


def _ingest(run: dict[str, Any]) -> list[str]:
    if "records" in run:  # --ranks: what hooks ship at their defaults
        what = f"{run['ranks']:,} ranks × {run['minutes']:g} min at the hooks' defaults"
        n, rate, ceiling = run["records"], run["records_per_s"], run["read_only_records_per_s"]
        return [what, f"{n:,} records", f"{rate:,} records/s", f"{ceiling:,} records/s"]
    what = f"window summaries of {run['functions_per_summary']} functions"
    n, rate, ceiling = run["summaries"], run["summaries_per_s"], run["read_only_summaries_per_s"]
    return [what, f"{n:,} summaries", f"{rate:,} summaries/s", f"{ceiling:,} summaries/s"]


def _calls(run: dict[str, Any]) -> list[str]:
    rows = {r["mode"]: r for r in run["rows"]}
    lean, full = rows["lean"], rows["full"]
    return [
        f"{run['rounds']} × {run['iters']:,}",
        f"{rows['off']['cpu_us_per_iteration']} µs",
        f"+{lean['over_off_us']} µs ({lean['over_off_quartiles_us'][0]} … {lean['over_off_quartiles_us'][2]})",
        f"+{full['over_off_us']} µs ({full['over_off_quartiles_us'][0]} … {full['over_off_quartiles_us'][2]})",
    ]


TABLES: dict[str, tuple[str, list[str], Callable[[dict[str, Any]], list[str]]]] = {
    "faults": (
        "Fault suite (`python -m benchmarks.faults`)",
        [
            "scenarios",
            "top-1",
            "function right",
            "precision",
            "healthy runs with a finding",
            "false extra findings",
            "median detect",
            "median localize",
            "slowdowns' p90 localize",
            "hangs: slowest",
            "median right from",
            "false alarms: probes",
            "false tickets",
        ],
        _faults,
    ),
    "serve_e2e": (
        "`rankscope serve` end to end (`python -m benchmarks.faults.serve_e2e`): live jobs into its spool",
        [
            "jobs",
            "right ticket",
            "median onset → ticket",
            "hang: onset → ticket",
            "tickets on healthy jobs",
            "false tickets",
            "flaps",
        ],
        _serve,
    ),
    "job_overhead": (
        "Users' jobs with and without the hook (`python -m benchmarks.overhead.job`): separate runs, "
        "interleaved; `in_run`: blocks of one run, working vs. paused",
        [
            "jobs",
            "pairs",
            "ms/step off → on (medians)",
            "ratio of medians (95% interval)",
            "median pair",
            "worst job, median pair",
            "one window's cost",
            "windows per rank",
            "windows' share of each rank's run",
        ],
        _jobs,
    ),
    "hook_overhead": (
        "Hook overhead (`python -m benchmarks.overhead.hook`): in-run A/B, working vs. paused",
        [
            "loop",
            "pairs",
            "ms/step paused",
            "ms/step working",
            "overhead",
            "95% interval",
            "median pair",
            "windows (with stacks)",
            "one window in the job",
            "always-on per step",
        ],
        _overhead,
    ),
    "tracking_calls": (
        "The tracking's CPU per call (`python -m benchmarks.overhead.calls`): an iteration of a 2-rank "
        "exchange (an isend/irecv pair and their waits, a blocking all-gather), interleaved",
        [
            "rounds × iterations",
            "an iteration, unpatched",
            "lean step (quartiles)",
            "every call in full (quartiles)",
        ],
        _calls,
    ),
    "gpu_check": (
        "On a GPU (`python -m benchmarks.gpu_check`): one rank's loops on NCCL, four ranks' scenarios",
        [
            "GPU",
            "ms/step after warm-up, separate runs, by arm",
            "in-run A/B, median pair",
            "window start / stop on the training thread",
            "scenarios",
        ],
        _gpu,
    ),
    "scale": (
        "Scale (`python -m benchmarks.scale.pipeline`): one job through spool, ingest, diagnose and serve, per size",
        [
            "ranks × minutes of records",
            "ingest records/s",
            "diagnose (of which the read)",
            "first serve cycle",
            "serve cycle as the job runs (median)",
            "peak RSS",
            "straggler named",
            "records copied to (`--repeat`): diagnose (read)",
        ],
        _scale,
    ),
    "ingest": (
        "Ingest through Kafka (`python -m benchmarks.scale.ingest`): one aggregator process, the broker on the same cores",
        ["records", "produced", "stored", "bare consumer (ceiling)"],
        _ingest,
    ),
}


def render(folder: Path = HERE) -> str:
    runs: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path in sorted(folder.glob("*.json")):
        m = _NAME.fullmatch(path.name)
        if m is None or m["bench"] not in TABLES:
            raise SystemExit(f"{path.name}: not <benchmark>[-<label>]-<YYYY-MM-DD>.json of {sorted(TABLES)}")
        runs.setdefault(m["bench"], []).append((m["date"], m["label"] or "", json.loads(path.read_text())))
    out = [
        "# Benchmark results",
        "",
        "Made by `python -m benchmarks.results` from the JSON files here: one table per benchmark, one row",
        "per run, newest first. The README and docs quote the newest row. How the diagnosis' thresholds",
        "were set: [thresholds.md](thresholds.md).",
        "",
    ]
    for bench, (title, columns, row) in TABLES.items():
        out += [f"## {title}", "", "| run | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for date, label, run in sorted(runs.get(bench, []), key=lambda r: (r[0], r[1]), reverse=True):
            name = f"{bench}-{label + '-' if label else ''}{date}.json"
            out.append(f"| [{date}{' ' + label if label else ''}]({name}) | " + " | ".join(row(run)) + " |")
        notes = [
            f"- {date}{' ' + label if label else ''}: {run['about']}"
            for date, label, run in runs.get(bench, [])
            if run.get("about")
        ]
        out += ["", *notes, ""] if notes else [""]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md is out of date")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        same = OUT.exists() and OUT.read_text() == text
        print(
            "RESULTS.md is up to date" if same else "RESULTS.md is out of date: python -m benchmarks.results"
        )
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
