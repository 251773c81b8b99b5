"""The HTML report, on made-up job data: structure, heatmap cells, charts and escaping."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from rankscope.diagnosis import Diagnosis, Finding, JobData
from rankscope.renderers.html import MAX_POINTS, STEP_PARTS, TOP_FUNCTIONS, short, write_report

RANKS = 4
CULPRIT = 2
STEPS = 2000
WINDOWS = ((0, 100, 105), (1, 900, 905))  # (window, step_lo, step_hi)
EVIL = "<script>alert(1)</script>"
_VOID = {"meta", "br", "hr", "img", "input", "link"}


class _Page(HTMLParser):
    """Parses the page, checks every element is closed in order, and keeps what the tests look at."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))
        if tag not in _VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def having(self, tag: str, cls: str) -> list[dict[str, str]]:
        return [a for t, a in self.elements if t == tag and cls in a.get("class", "").split()]


def _specs() -> list[tuple[int, str, str, float]]:
    """(rank, kind, name, ms per step): 30 work functions with distinct times per rank, plus the
    kinds the heatmap must leave out or mark."""
    out = []
    for rank in range(RANKS):
        out += [
            (rank, "op", f"aten::op{i:02d}", (40 - i) * 0.1 * (1 + 0.1 * ((rank * 7 + i) % 5)))
            for i in range(30)
        ]
        out.append((rank, "op", "aten::linear", 6.0 if rank == CULPRIT else 3.0))  # the culprit's 2x function
        out.append((rank, "collective", "all_reduce@world", 50.0))
        out.append((rank, "python", "train.py(10): _train", 19.0))  # encloses the whole step: left out
        if rank != 0:  # missing on rank 0: counts 0 there
            out.append((rank, "op", "aten::sometimes", 2.5))
        if rank == 3:
            out.append((rank, "python", EVIL, 8.0))
    return out


def _functions() -> pd.DataFrame:
    rows = []
    for window, lo, hi in WINDOWS:
        for rank, kind, name, ms in _specs():
            total = ms * 1000 * (hi - lo)
            rows.append(
                {"rank": rank, "window": window, "step_lo": lo, "step_hi": hi, "kind": kind, "name": name}
                | {"stack": "", "count": hi - lo, "total_us": total}
                | dict.fromkeys(("mean_us", "p50_us", "max_us"), total / (hi - lo))
            )
    return pd.DataFrame(rows)


def _steps() -> pd.DataFrame:
    step = pd.Series(range(STEPS))
    frames = []
    for rank in range(RANKS):
        own = 12_000 if rank == CULPRIT else 6_000
        frames.append(pd.DataFrame({"rank": rank, "step": step, "dur_us": 20_000, "comm_us": 20_000 - own}))
    return pd.concat(frames, ignore_index=True)


@pytest.fixture
def data() -> JobData:
    ranks = pd.DataFrame({"rank": range(RANKS), "host": [f"node{r // 2}" for r in range(RANKS)]})
    return JobData(job="job-1", ranks=ranks, steps=_steps(), functions=_functions())


@pytest.fixture
def diagnosis() -> Diagnosis:
    finding = Finding(
        cause="compute",
        ranks=[CULPRIT],
        hosts=["node1"],
        function="aten::linear",
        confidence=0.8,
        summary="rank 2 (node1): compute straggler",
        evidence={"rank_value_ms": 12.0, "peer_median_ms": 6.0},
    )
    return Diagnosis(job="job-1", findings=[finding])


def _write(tmp_path: Path, diagnosis: Diagnosis, data: JobData) -> tuple[str, _Page]:
    path = write_report(tmp_path / "report.html", diagnosis, data)
    assert path == tmp_path / "report.html" and path.is_file()
    text = path.read_text(encoding="utf-8")
    page = _Page(text)
    assert page.stack == [], f"unclosed elements: {page.stack}"
    return text, page


def test_findings_header_and_culprit_highlighted(tmp_path: Path, diagnosis: Diagnosis, data: JobData) -> None:
    text, page = _write(tmp_path, diagnosis, data)
    words = " ".join(page.text)
    assert "job-1" in words and "compute straggler" in words and "No findings" not in words
    assert "rank_value_ms" in words and "12.0" in words and "80%" in words
    culprit_rows = page.having("text", "culprit")
    assert len(culprit_rows) == 1
    assert re.search(r'class="row culprit"[^>]*>▶ rank 2 · node1<', text)
    assert len(page.having("text", "row")) == RANKS


def test_one_cell_per_rank_and_function_shown(tmp_path: Path, diagnosis: Diagnosis, data: JobData) -> None:
    text, page = _write(tmp_path, diagnosis, data)
    columns = page.having("text", "col")
    assert len(columns) == len(STEP_PARTS) + TOP_FUNCTIONS  # the step's split, then the functions
    assert len(page.having("g", "cell")) == RANKS * len(columns)
    assert all(f">{part}<" in text for part in STEP_PARTS.values())
    assert "▼ aten::linear" in text  # the finding's function is shown, and marked
    assert "all_reduce@world" not in text and "_train" not in text  # collectives, enclosing frames


def test_cells_are_ratios_to_the_median_over_ranks(
    tmp_path: Path, data: JobData, diagnosis: Diagnosis
) -> None:
    functions = _functions()
    data = JobData(
        job="j",
        ranks=data.ranks,
        steps=data.steps,
        functions=functions[functions["name"].isin(["aten::linear", "aten::sometimes"])],
    )
    text, _ = _write(tmp_path, diagnosis, data)
    cells = re.findall(r'<g class="cell">.*?<text[^>]*>([^<]*)</text></g>', text)
    per_row = len(STEP_PARTS) + 2
    functions_only = [c for i, c in enumerate(cells) if i % per_row >= len(STEP_PARTS)]
    # rows = ranks, columns by total time: aten::linear (3, 3, 6, 3 ms), aten::sometimes (0, 2.5, 2.5, 2.5)
    assert functions_only == ["1.00", "0.00", "1.00", "1.00", "2.00", "1.00", "1.00", "1.00"]
    own = [float(c) for i, c in enumerate(cells) if i % per_row == len(STEP_PARTS) - 1]
    assert max(own) == own[CULPRIT] > 1, "the slow rank's own work per step, against the median"
    assert "6.000 ms/step (median over ranks 3.000 ms)" in text


def test_step_charts_one_line_per_rank_smoothed(tmp_path: Path, diagnosis: Diagnosis, data: JobData) -> None:
    _, page = _write(tmp_path, diagnosis, data)
    lines = [a for t, a in page.elements if t == "polyline"]
    assert len(lines) == 2 * RANKS  # own time and step time
    culprit = [a for a in lines if a["stroke"] == "#d62728"]
    assert len(culprit) == 2 and all(float(a["stroke-width"]) > 2 for a in culprit)
    assert all(len(a["points"].split()) <= MAX_POINTS + 1 for a in lines)
    assert "rank 2 · node1 (culprit)" in " ".join(page.text)


def test_healthy_job_says_no_findings(tmp_path: Path, data: JobData) -> None:
    text, page = _write(tmp_path, Diagnosis(job="job-1", findings=[]), data)
    assert "No findings: the job looks healthy" in text
    assert not page.having("text", "culprit")
    assert not [a for t, a in page.elements if t == "polyline" and a["stroke"] == "#d62728"]


def test_text_is_escaped(tmp_path: Path, data: JobData) -> None:
    data = JobData(job=EVIL, ranks=data.ranks, steps=data.steps, functions=data.functions)
    finding = Finding(
        cause="code_path", ranks=[3], hosts=["node1"], function=EVIL, confidence=0.5, summary=EVIL,
        evidence={EVIL: EVIL},
    )  # fmt: skip
    text, page = _write(tmp_path, Diagnosis(job=EVIL, findings=[finding]), data)
    assert "<script" not in text
    assert text.count("&lt;script&gt;") >= 6  # title, job, function, summary, evidence, column
    assert "&lt;script&gt;" in text
    assert not [t for t, _ in page.elements if t == "script"]


def test_a_job_without_records(tmp_path: Path) -> None:
    _, page = _write(tmp_path, Diagnosis(job="empty", findings=[]), JobData(job="empty"))
    words = " ".join(page.text)
    assert "No profiling windows" in words and "No step records" in words


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("rankscope/workload.py(96): audit_gradients", "audit_gradients · workload.py:96"),
        ("<built-in method wait of pybind11_builtins.pybind11_detail_function_record>", "wait (built-in)"),
        ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "enumerate(DataLoader)#__next__"),
        ("aten::linear", "aten::linear"),
    ],
)
def test_short_column_labels(name: str, label: str) -> None:
    assert short(name) == label
    assert len(short("x" * 100)) <= 34
