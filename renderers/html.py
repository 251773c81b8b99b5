"""One self-contained HTML page of a diagnosis: the findings, a rank x function heatmap, step-time charts.

Inline SVG and a little CSS, no scripts and no network: the file opens anywhere and travels with a ticket.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from rankscope.diagnosis import Diagnosis, Finding, JobData
from rankscope.diagnosis.efficiency import Efficiency, per_rank
from rankscope.diagnosis.ettr import Reliability

from .text import pct

TOP_FUNCTIONS = 20
WRAPPER_SHARE = 0.6
"""A Python frame holding this share of a rank's median step encloses the step (the training loop, a
collective's wait): it is the same on every rank and would crowd out the functions that differ."""
SAME_TIME = 0.05
"""Functions whose time on every rank is within this fraction of a shown one are its callers or callees."""
MAX_ROWS = 64
MAX_LINES = 16
SMOOTH_STEPS = 25
MAX_POINTS = 400
_Column = tuple[tuple[str, str], list[str]]
"""A heatmap column: (kind, name) and the functions with the same time on every rank it stands for."""
_RED, _BLUE = (178, 24, 43), (33, 102, 172)
_PALETTE = ("#4e79a7", "#59a14f", "#9c755f", "#76b7b2", "#b07aa1", "#edc948", "#f28e2b", "#bab0ac")
_CSS = """
body{font:14px/1.45 system-ui,sans-serif;color:#222;margin:24px 32px;max-width:1400px}
h1{font-size:22px;margin:0 0 4px}h1 code{font-size:20px}h2{font-size:17px;margin:28px 0 4px}
h2{border-bottom:1px solid #ddd}
.meta,.note{color:#666;font-size:13px}.ok{background:#e8f5e9;border-left:4px solid #43a047;padding:10px 14px}
.card{border:1px solid #ddd;border-left:4px solid #b2182b;border-radius:4px;padding:10px 14px;margin:10px 0}
.cause{background:#b2182b;color:#fff;border-radius:3px;padding:1px 7px;font-weight:600;margin-right:6px}
.conf{display:inline-block;width:80px;height:8px;background:#eee;margin:0 6px}
.conf i{display:block;height:8px}
dl.ev{display:grid;grid-template-columns:repeat(3,max-content minmax(80px,max-content));gap:2px 12px}
.ev{font-size:12.5px}.ev dt{color:#666}.ev dd{margin:0 24px 0 0}code{font-size:12.5px;background:#f4f4f4}
.legend span{margin-right:14px}.legend b{display:inline-block;width:18px;height:3px;vertical-align:middle}
"""


def write_report(path: str | Path, diagnosis: Diagnosis, data: JobData) -> Path:
    """Write one self-contained HTML page showing what ``diagnosis`` found in ``data``; return its path.

    >>> write_report("job.html", diagnose(data), data)  # doctest: +SKIP
    PosixPath('job.html')
    """
    out = Path(path)
    out.write_text(render_report(diagnosis, data), encoding="utf-8")
    return out


def render_report(
    diagnosis: Diagnosis, data: JobData, extra: str = "", head: str = "", drawn: str | None = None
) -> str:
    """The page :func:`write_report` writes, as a string; ``extra`` (HTML) goes after the findings,
    ``head`` (HTML) into ``<head>``; ``drawn``: :func:`pictures` of the same diagnosis and data,
    if the caller has them already."""
    parts = [
        _header(diagnosis, not data.steps.empty),
        extra,
        pictures(diagnosis, data) if drawn is None else drawn,
    ]
    return page(f"rankscope: job {diagnosis.job}", "\n".join(parts), head)


def pictures(diagnosis: Diagnosis, data: JobData, wide: pd.DataFrame | None = None) -> str:
    """The report's heatmap and step-time charts (HTML), the culprits highlighted (``wide``:
    :func:`per_step` of ``data``, if the caller has it already)."""
    culprits = culprit_ranks(diagnosis)
    hosts = data.hosts()
    wide = per_step(data, culprits) if wide is None else wide
    return _heatmap(data, diagnosis, culprits, hosts, wide) + "\n" + _charts(data, culprits, hosts)


def culprit_ranks(diagnosis: Diagnosis) -> list[int]:
    return sorted({r for f in diagnosis.findings for r in f.ranks})


def page(title: str, body: str, head: str = "") -> str:
    """A whole HTML page in the report's style around ``body``."""
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>{head}'
        f"<style>{_CSS}</style></head><body>\n{body}\n</body></html>\n"
    )


def heatmap_data(data: JobData, wide: pd.DataFrame | None = None) -> dict[str, Any]:
    """The heatmap's numbers: ``ranks`` and, per function shown, its ms per step on each rank
    (``wide``: :func:`per_step` of ``data``, if the caller has it already)."""
    wide = per_step(data) if wide is None else wide
    if wide.empty:
        return {"ranks": [], "functions": []}
    cols = _columns(wide, set())
    return {
        "ranks": [int(r) for r in wide.columns],
        "functions": [
            {"kind": kind, "name": name, "ms_per_step": [round(v / 1e3, 4) for v in wide.loc[(kind, name)]]}
            for (kind, name), _ in cols
        ],
    }


def step_series(
    data: JobData, points: int = MAX_POINTS, ranks: list[int] | None = None, culprits: Sequence[int] = ()
) -> dict[str, Any]:
    """Per rank, step time and own time (ms) by step, smoothed and cut to about ``points`` points:
    of ``ranks``, or by default of every rank up to ``MAX_LINES`` of them, and beyond that of the
    ``culprits`` and peers spread over the rest, as the job page draws them (``ranks_total`` says
    how many there are)."""
    s = data.steps
    if s.empty:
        return {"ranks": {}, "ranks_total": 0}
    every = sorted(int(r) for r in s["rank"].unique())
    if ranks is None:
        ranks = _sample(every, list(culprits), MAX_LINES)
    ranks = sorted(set(ranks) & set(every))
    dur, own = _series(s, s["dur_us"], ranks, points), _series(s, s["dur_us"] - s["comm_us"], ranks, points)
    return {
        "ranks_total": len(every),
        "ranks": {
            str(r): {
                "step": [int(x) for x in dur[r].index],
                "step_ms": [round(float(v), 3) for v in dur[r]],
                "own_ms": [round(float(v), 3) for v in own[r]],
            }
            for r in ranks
        },
    }


def _e(value: object) -> str:
    return html.escape(str(value))


def _header(diagnosis: Diagnosis, has_steps: bool = True) -> str:
    a = diagnosis.analyzed
    meta = ", ".join(f"{k} {_e(v)}" for k, v in a.items() if k in ("ranks", "steps", "windows"))
    out = [f"<h1>Job <code>{_e(diagnosis.job)}</code></h1>", f'<div class="meta">analyzed: {meta}</div>']
    if gaps := a.get("coverage_gaps"):
        out.append(f'<p class="note">Not seen by the hook: {_e("; ".join(gaps))}</p>')
    if lost := a.get("records_missing"):
        out.append(f'<p class="note">Never stored (dropped by the hook or lost on the way): {_e(lost)}</p>')
    out.append("<h2>Findings</h2>")
    if not diagnosis.findings and not has_steps:
        out.append(
            '<p class="note">No findings: the job has no steps yet, so there is nothing to compare.</p>'
        )
    elif not diagnosis.findings:
        out.append('<p class="ok">No findings: the job looks healthy.</p>')
    out += [_finding(f) for f in diagnosis.findings]
    return "\n".join(out)


def _finding(f: Finding) -> str:
    rows = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in f.evidence.items())
    confidence = round(100 * f.confidence)
    return (
        f'<div class="card"><span class="cause">{_e(f.cause)}</span>'
        f"ranks <b>{_e(', '.join(map(str, f.ranks)))}</b> · hosts {_e(', '.join(f.hosts))} · "
        f"scope {_e(f.scope)} · function <code>{_e(f.function)}</code> · confidence "
        f'<span class="conf"><i style="width:{confidence}%;background:#b2182b"></i></span>{confidence}%'
        f'<p>{_e(f.summary)}</p><dl class="ev">{rows}</dl></div>'
    )


def per_step(data: JobData, culprits: Sequence[int] = ()) -> pd.DataFrame:
    """Time per step (us) of each (kind, name): one row per function, one column per profiled rank
    (the ``culprits`` and up to ``MAX_ROWS`` others spread over the rest, as the heatmap shows them)."""
    profiled = sorted(int(r) for r in data.spans()["rank"].unique())
    f = data.functions_of(_sample(profiled, list(culprits), MAX_ROWS))
    f = f[f["kind"] != "collective"]
    if f.empty:
        return pd.DataFrame()
    f = f.assign(us=f["total_us"] / (f["step_hi"] - f["step_lo"]).clip(lower=1))
    n_windows = f.groupby("rank")["window"].nunique()
    if not data.steps.empty:
        step_us = f["rank"].map(data.steps.groupby("rank")["dur_us"].median())
        enclosing = f["kind"].isin(("python", "pylib")) & (f["us"] >= WRAPPER_SHARE * step_us)
        f = f[~f["name"].isin(set(f.loc[enclosing, "name"]))]
    per = f.groupby(["rank", "kind", "name"])["us"].sum().div(n_windows, level="rank")
    return per.unstack("rank", fill_value=0.0).sort_index(axis=1)


def _columns(wide: pd.DataFrame, forced: set[str]) -> list[_Column]:
    """The functions to show, largest total first, each with the same-time functions it stands for."""
    order = wide.sum(axis=1).sort_values(ascending=False).index.tolist()
    order = [k for k in order if k[1] in forced] + [k for k in order if k[1] not in forced]
    kept: list[_Column] = []
    for key in order:
        v = wide.loc[key]
        for k, alias in kept:
            w = wide.loc[k]
            if (v - w).abs().max() <= SAME_TIME * max(v.max(), w.max()):
                alias.append(f"{key[1]} ({key[0]})")
                break
        else:
            if len(kept) >= TOP_FUNCTIONS:
                break
            kept.append((key, []))
    total = wide.sum(axis=1)
    return sorted(kept, key=lambda c: -total[c[0]])


def short(name: str, limit: int = 34) -> str:
    """A column label: ``path/file.py(96): func`` -> ``func · file.py:96``; long names cut in the middle."""
    if m := re.fullmatch(r"(?:.*/)?([^/]+)\((\d+)\): (.+)", name):
        name = f"{m[3]} · {m[1]}:{m[2]}"
    elif m := re.fullmatch(r"<built-in (?:method|function) (\w+).*", name):
        name = f"{m[1]} (built-in)"
    elif len(name) > limit and "#" in name:  # profiler labels: ``enumerate(DataLoader)#Class.__next__``
        head, tail = name.split("#", 1)
        name = f"{head}#{tail.rsplit('.', 1)[-1]}"
    if len(name) > limit:
        name = name[: limit // 2 - 1] + "…" + name[-(limit // 2) :]
    return name


def _colour(ratio: float) -> tuple[str, str]:
    """Diverging fill around 1.0 (log scale, saturating at 4x either way) and a readable text colour."""
    if math.isnan(ratio):
        return "#f4f4f4", "#999"
    t = max(-1.0, min(1.0, math.log2(max(ratio, 1e-3)) / 2)) if math.isfinite(ratio) else 1.0
    end = _RED if t > 0 else _BLUE
    rgb = [round(255 + (c - 255) * abs(t)) for c in end]
    return f"rgb({rgb[0]},{rgb[1]},{rgb[2]})", "#fff" if abs(t) > 0.55 else "#222"


def _sample(ranks: list[int], culprits: list[int], limit: int) -> list[int]:
    """The culprits and peers spread evenly over the rest, ``limit`` ranks at most (beyond the culprits)."""
    peers = [r for r in ranks if r not in culprits]
    room = max(1, limit - len(culprits))
    return sorted(set(peers[:: math.ceil(len(peers) / room) or 1][:room]) | (set(culprits) & set(ranks)))


def _heatmap(
    data: JobData, diagnosis: Diagnosis, culprits: list[int], hosts: dict[int, str], wide: pd.DataFrame
) -> str:
    head = "<h2>Where each rank spends its time</h2>"
    if wide.empty:
        return head + '<p class="note">No profiling windows were recorded for this job.</p>'
    named = {f.function for f in diagnosis.findings}
    parts = _step_parts(data, wide.columns)
    cols: list[_Column] = [(key, []) for key in parts.index] + _columns(wide, named)
    wide = pd.concat([parts, wide])
    ranks = _sample([int(r) for r in wide.columns], culprits, MAX_ROWS)
    profiled = data.spans()["rank"].nunique()
    more = f"; {len(ranks)} of {profiled} ranks shown" if len(ranks) < profiled else ""
    note = (
        '<p class="note">Each cell: the rank\'s time per step in the function ÷ the median over ranks '
        "(red: slower than its peers, blue: faster; ∞: only some ranks run it). Hover for ms per step. "
        f"The {len(cols)} functions with the most time; collectives, enclosing frames and functions timed "
        f"the same as a shown one (listed in its tooltip) are left out{more}. "
        "Functions a finding names are marked ▼. The first columns split each rank's whole step, "
        "from the always-on rows: waiting for its batch, waiting in collectives, and its own work.</p>"
    )
    rows = [(r, f"rank {r} · {hosts.get(r, '?')}", r in culprits) for r in ranks]
    return head + note + _heatmap_svg(wide, cols, rows, named)


STEP_PARTS = {"data_us": "waiting for data", "comm_us": "waiting in collectives", "own_us": "own work"}


def _step_parts(data: JobData, ranks: pd.Index) -> pd.DataFrame:
    """Each rank's mean time per step (us) waiting for data, waiting in collectives and on its own
    work, as heatmap rows of kind ``step`` (the breakdown ``rankscope efficiency`` gives)."""
    if data.steps.empty:
        return pd.DataFrame(columns=ranks)
    sums = per_rank(data.steps)
    mean = pd.DataFrame(
        {
            "data_us": sums["data"] / sums["n"],
            "comm_us": sums["comm"] / sums["n"],
            "own_us": (sums["dur"] - sums["data"] - sums["comm"]) / sums["n"],
        }
    )
    per = mean.T.reindex(columns=ranks, fill_value=0.0)
    per.index = pd.MultiIndex.from_tuples([("step", STEP_PARTS[c]) for c in per.index])
    return per


def _heatmap_svg(
    wide: pd.DataFrame, cols: list[_Column], rows: list[tuple[int, str, bool]], named: set[str]
) -> str:
    """One row per (rank, label, culprit), one cell per shown function; column labels rotated."""
    cw, ch, lw, top = 50, 24, 170, 190
    median = wide.median(axis=1)
    # Cells by position: a lookup by label per cell costs more than drawing it (1,000s of cells).
    shown = wide.loc[[key for key, _ in cols], [rank for rank, _, _ in rows]].to_numpy()
    medians = median.loc[[key for key, _ in cols]].to_numpy()
    svg = [_svg(lw + cw * len(cols) + 140, top + ch * len(rows) + 8, 12), *_scale(10, 24)]
    for j, ((kind, name), alias) in enumerate(cols):
        tip = "\n".join([f"{name} ({kind})", *(["same time as:", *alias] if alias else [])])
        mark = {"fill": "#b2182b", "font_weight": "700"} if name in named else {}
        label = _el("title", _e(tip)) + ("▼ " if mark else "") + _e(short(name))
        at = f"translate({lw + cw * j + cw / 2:.0f},{top - 6}) rotate(-45)"
        svg.append(_el("text", label, transform=at, **{"class": "col", **mark}))
    for i, (_, label, bad) in enumerate(rows):
        y = top + ch * i
        if bad:
            svg.append(_el("rect", x=0, y=y, width=lw - 2, height=ch - 1, fill="#fde0dd"))
        mark = {"fill": "#b2182b", "font_weight": "700", "class": "row culprit"} if bad else {"class": "row"}
        label = ("▶ " if bad else "") + _e(label)
        svg.append(_el("text", label, x=lw - 8, y=y + ch / 2 + 4, text_anchor="end", **mark))
        for j in range(len(cols)):
            svg.append(_cell(lw + cw * j, y, cw, ch, float(shown[j, i]), float(medians[j])))
    return "\n".join([*svg, "</svg>"])


def _scale(x: float, y: float) -> list[str]:
    """The colour key: ratios from 1/4 to 4."""
    out = [_el("text", "time ÷ median over ranks", x=x, y=y - 6, fill="#666", font_size=11)]
    for i, r in enumerate((0.25, 0.5, 0.75, 1, 1.33, 2, 4)):
        fill, ink = _colour(r)
        out.append(_el("rect", x=x + 26 * i, y=y, width=25, height=16, fill=fill, stroke="#ddd"))
        at = {"x": x + 26 * i + 12.5, "y": y + 12, "text_anchor": "middle", "font_size": 9, "fill": ink}
        out.append(_el("text", f"{r:g}", **at))
    return out


def _cell(x: float, y: float, w: float, h: float, us: float, median_us: float) -> str:
    if median_us > 0:
        ratio, text = us / median_us, f"{us / median_us:.2f}"
    else:
        ratio, text = (math.inf, "∞") if us > 0 else (math.nan, "–")
    fill, ink = _colour(ratio)
    tip = _el("title", f"{us / 1000:.3f} ms/step (median over ranks {median_us / 1000:.3f} ms)")
    rect = _el("rect", x=x, y=y, width=w - 1, height=h - 1, fill=fill)
    label = _el("text", text, x=x + w / 2, y=y + h / 2 + 4, text_anchor="middle", fill=ink)
    return _el("g", tip + rect + label, **{"class": "cell"})


def _svg(width: float, height: float, size: int) -> str:
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="{size}">'


def _el(tag: str, body: str = "", **attrs: object) -> str:
    """An SVG element; ``body`` is markup (escape text first), attribute names take ``-`` for ``_``."""
    at = "".join(f' {k.replace("_", "-")}="{_e(v)}"' for k, v in attrs.items())
    return f"<{tag}{at}>{body}</{tag}>" if body else f"<{tag}{at}/>"


def _series(
    steps: pd.DataFrame, values: pd.Series, ranks: list[int], points: int = MAX_POINTS
) -> dict[int, pd.Series]:
    """Per rank, ``values`` in ms by step: a rolling median, then at most ``points`` points."""
    out = {}
    shown = steps["rank"].isin(ranks).to_numpy()  # first: a job's steps can be millions of rows
    frame = pd.DataFrame({"rank": steps["rank"].to_numpy()[shown], "step": steps["step"].to_numpy()[shown]})
    frame["v"] = values.to_numpy()[shown] / 1000
    for rank, g in frame.groupby("rank"):
        s = g.sort_values("step").set_index("step")["v"]
        s = s.rolling(SMOOTH_STEPS, center=True, min_periods=1).median()
        stride = max(1, math.ceil(len(s) / points))
        out[int(rank)] = pd.concat([s.iloc[::stride], s.iloc[-1:]]).groupby(level=0).last()
    return out


def _ticks(hi: float, n: int = 5) -> list[float]:
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(math.ceil(hi / step - 1e-9) + 1)]  # the last one >= hi


def _charts(data: JobData, culprits: list[int], hosts: dict[int, str]) -> str:
    s = data.steps
    if s.empty:
        return '<h2>Step times</h2><p class="note">No step records for this job.</p>'
    ranks = sorted(int(r) for r in s["rank"].unique())
    shown = _sample(ranks, culprits, MAX_LINES)
    peers = [r for r in shown if r not in culprits]
    strokes = {r: (_PALETTE[i % len(_PALETTE)], 1.3) for i, r in enumerate(peers)}
    strokes |= {r: ("#d62728", 2.6) for r in shown if r in culprits}  # last: drawn on top
    legend = "".join(
        f'<span><b style="background:{strokes[r][0]}"></b> rank {r} · {_e(hosts.get(r, "?"))}'
        + (" (culprit)</span>" if r in culprits else "</span>")
        for r in shown
    )
    note = f" ({len(shown)} of {len(ranks)} ranks shown)" if len(shown) < len(ranks) else ""
    return (
        f'<h2>Own time per step</h2><p class="note">Step time minus time in collectives (ms): the work a rank'
        f" does itself. Rolling median over {SMOOTH_STEPS} steps{note}.</p>"
        + _line_chart(_series(s, s["dur_us"] - s["comm_us"], shown), strokes, 300)
        + f'<div class="legend">{legend}</div><h2>Step time</h2><p class="note">Wall time per step (ms), '
        "collectives included: ranks that wait for a slow peer finish their steps with it.</p>"
        + _line_chart(_series(s, s["dur_us"], shown), strokes, 180)
    )


def _line_chart(series: dict[int, pd.Series], strokes: dict[int, tuple[str, float]], height: int) -> str:
    width, left, bottom, top, right = 1100, 56, 28, 26, 44
    x_lo = min(float(s.index.min()) for s in series.values())
    x_span = max(max(float(s.index.max()) for s in series.values()) - x_lo, 1.0)
    yt = _ticks(max(float(s.max()) for s in series.values()) or 1.0)
    y_hi, pw, ph = yt[-1], width - left - right, height - top - bottom
    grey = {"fill": "#666"}
    svg = [_svg(width, height, 11), _el("text", "ms", x=left - 6, y=top - 12, text_anchor="end", **grey)]
    for t in yt:
        y = top + ph * (1 - t / y_hi)
        svg.append(_el("line", x1=left, x2=width - right, y1=f"{y:.1f}", y2=f"{y:.1f}", stroke="#eee"))
        svg.append(_el("text", f"{t:g}", x=left - 6, y=f"{y + 4:.1f}", text_anchor="end", **grey))
    for t in [t for t in _ticks(x_span, 10) if t <= x_span]:
        x = f"{left + pw * t / x_span:.1f}"
        svg.append(_el("text", f"{x_lo + t:g}", x=x, y=height - 10, text_anchor="middle", **grey))
    svg.append(_el("text", "step", x=width - 4, y=height - 10, text_anchor="end", **grey))
    for rank, (colour, w) in strokes.items():
        xy = [(left + pw * (x - x_lo) / x_span, top + ph * (1 - y / y_hi)) for x, y in series[rank].items()]
        at = {
            "fill": "none",
            "stroke": colour,
            "stroke_width": w,
            "points": " ".join(f"{x:.1f},{y:.1f}" for x, y in xy),
        }
        svg.append(_el("polyline", f"<title>rank {rank}</title>", **at))
    return "\n".join([*svg, "</svg>"])


def reliability_section(r: Reliability) -> str:
    """The job's ETTR, the time it lost by cause and its attempts, as an HTML section."""
    lost = "".join(
        f"<tr><td>{_e(cause)}</td><td>{s:.1f}</td><td>{100 * s / max(r.wall_s, 1e-9):.1f}%</td></tr>"
        for cause, s in sorted(r.lost_s.items(), key=lambda kv: -kv[1])
        if s > 0
    )
    attempts = "".join(
        f"<tr><td>{a.number}</td><td>{a.start_s:.1f}</td><td>{a.first_step}-{a.last_step}</td>"
        f"<td>{a.redone_steps}</td><td>{a.hang_s:.1f}</td><td>{a.restart_s:.1f}</td>"
        f"<td>{_e(f'rank {a.failed_rank} ' if a.failed_rank >= 0 else '')}{_e(a.failure)}"
        f"{'<br>' + _e(a.error) if a.error else ''}</td></tr>"
        for a in r.attempts
    )
    projected = f", expected {r.expected_ettr:.3f}" if r.expected_ettr is not None else ""
    notes = "".join(f'<p class="note">{_e(n)}</p>' for n in r.notes)
    return (
        f"<h2>Reliability</h2><p>ETTR <b>{r.ettr:.3f}</b>: {r.productive_s:.1f} s productive of "
        f"{r.wall_s:.1f} s ({r.steps} steps at {1e3 * r.baseline_step_s:.1f} ms){projected}; "
        f"{r.saves} checkpoints saved, MTTF at {r.nodes} nodes {r.mttf_s / 86_400:.1f} days</p>"
        f'<table class="list"><tr><th>lost to</th><th>s</th><th>of wall</th></tr>{lost}</table>'
        f'<table class="list"><tr><th>attempt</th><th>from s</th><th>steps</th><th>redone</th>'
        f"<th>hung s</th><th>restart s</th><th>failed</th></tr>{attempts}</table>{notes}"
    )


def efficiency_section(e: Efficiency) -> str:
    """Where the job's time goes per rank, as an HTML section."""

    rows = "".join(
        f"<tr><td>{r.rank}</td><td>{_e(r.host)}</td><td>{r.step_ms:.1f}</td><td>{pct(r.compute)}</td>"
        f"<td>{pct(r.comm_wait)}</td><td>{pct(r.data_wait)}</td><td>{pct(r.overhead)}</td></tr>"
        for r in e.ranks
    )
    s = e.shares
    notes = "".join(f'<p class="note">{_e(n)}</p>' for n in e.notes)
    return (
        f"<h2>Where the time goes</h2><p>compute {pct(s['compute'])}, waiting for collectives "
        f"{pct(s['comm_wait'])}, waiting for data {pct(s['data_wait'])}, host overhead and idle "
        f"{pct(s['overhead'])} ({e.device})</p>"
        '<table class="list"><tr><th>rank</th><th>host</th><th>step ms</th><th>compute</th>'
        f"<th>collectives</th><th>data</th><th>overhead</th></tr>{rows}</table>{notes}"
    )
