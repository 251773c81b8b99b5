"""Per-function differential analysis inside profiling windows: where a culprit's extra time goes.

Windows cover the same steps on every rank, so a function's time and count per step can be
compared rank against peers directly. Two shapes matter:

* the same functions, executed as often as on the peers, but slower: a slower device (``compute``);
* functions the culprit executes and its peers do not, or more often: a different code path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from rankscope.wire import records
from rankscope.wire.records import WAIT_KIND

from ...robust import evenly

CUT_KIND = "cut"
"""The kind of the pattern that says what a window left out beyond ``max_functions`` (the hook's
``left_out@window``: ``count`` patterns, the largest of them ``max_us``)."""
CUT_MARGIN = 4.0
"""A function whose calls in the culprit's windows, at their median, add up to no more than this
times the largest function a peer's window left out may have run there unseen (the culprit's calls
may be slower than the peers'). The largest left out takes ~10-15 µs in a small job's 5-step
windows."""
MAX_PEERS = 32
"""Peers compared against (evenly spread over the rest): enough for a stable median at any scale."""
WORK_KINDS = ("op", "kernel", "memcpy")
DEVICE_KINDS = ("kernel", "memcpy")
"""A device's work: its time is not the training thread's CPU time."""
LAUNCHED_KINDS = (*DEVICE_KINDS, "collective")
"""The kinds of a device's work (NCCL's kernels are ``collective``): the hook names the operator that
launched each as its stack, after the job's function around it where the window recorded Python
functions (``"train.py(40): forward > aten::mm"``)."""
PYTHON_KINDS = ("python", "pylib")
"""Python functions: the job's own code, and libraries' (recorded in windows with stacks only)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FunctionExcess:
    kind: str
    name: str
    stack: str
    rank_us: float
    """The culprit's time in this function per step."""
    peer_us: float
    rank_robust_us: float = -1.0
    """...its time per step with the longest call of each window taken at the mean of the others
    (-1: not known): one call preempted for milliseconds is in ``rank_us``, not here..."""
    rank_typical_us: float = -1.0
    """...its calls per step at its median call's time: a few such calls are not here either, but
    calls of different sizes are not all counted at theirs (``aten::abs`` of a gradient audit over
    weights and biases: 3.5 µs at the median, 18 µs on average)..."""
    peer_typical_us: float = -1.0
    """...and the peers' median of the same."""
    rank_count: float
    """The culprit's executions per step."""
    peer_count: float

    waits: bool = False
    """A Python frame that calls a collective (directly or deeper): its time includes waiting
    for the other ranks, so it is not where the rank's own extra work is."""
    callers: frozenset[str] = frozenset()
    """The Python functions that call this one on the culprit, directly or through others."""
    windows: int = 1
    """The culprit's windows it ran in..."""
    of_windows: int = 1
    """...of the culprit's windows compared."""

    @property
    def excess_us(self) -> float:
        return self.rank_us - self.peer_us

    @property
    def extra(self) -> bool:
        """Executed more often than on the peers, or only on the culprit (a clean-up every few
        steps is called less than once a step): a different code path, not a slower one. In half
        the culprit's windows at least, and in two of two or more: one slow call in one window (a
        3 ms ``hasattr`` of the data loader's, preempted) is no code path. And the calls more,
        at the peers' time a call, hold half its excess: a slower device whose padded batch takes
        one ``aten::reshape`` more a step (52 against 51) runs its reshapes slower, not a path of
        its own; nor is an operator only it runs whose time one call holds (a slower device's
        padding, an ``aten::index`` of 22 µs a call, once 4.2 ms: preempted, in the one window of
        a demo run; counted by :attr:`rank_robust_us`)."""
        more = self.rank_count >= self.peer_count + 0.5 or (self.peer_count == 0 < self.rank_count)
        seen = self.windows >= max(min(2, self.of_windows), self.of_windows / 2)
        return more and seen and self.more_calls_us >= 0.5 * self.excess_us

    @property
    def more_calls_us(self) -> float:
        """The time per step of the calls the culprit makes beyond its peers', at their time a call
        (all of the culprit's time in a function its peers do not run)."""
        if self.peer_count > 0:
            return (self.rank_count - self.peer_count) * self.peer_us / self.peer_count
        return self.rank_us if self.rank_robust_us < 0 else min(self.rank_us, self.rank_robust_us)

    @property
    def typical_excess_us(self) -> float:
        """The excess of its calls at their median call's time (:attr:`excess_us` where unknown)."""
        if self.rank_typical_us < 0 or self.peer_typical_us < 0:
            return self.excess_us
        return self.rank_typical_us - self.peer_typical_us


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampled:
    """A function of the job's own code the culprit's stack samples (the heartbeats') found it in
    more often than its peers'."""

    name: str
    share: float
    """The culprit's samples in it, of all its samples."""
    peer_share: float
    """The peers' median share."""
    samples: int
    of: int
    line: int | None = None
    """The line of it the culprit's samples found it at most often (``None``: not sampled)."""
    peer_function_share: float = 0.0
    """The peers' median share of the function it is in (``peer_share`` where it is a function,
    not a line of one)."""

    @property
    def excess(self) -> float:
        return self.share - self.peer_share


MIN_SAMPLES = 10
"""Samples a culprit needs before they name anything (5 s of the watchdog's 2 a second)."""

MIN_SAMPLE_SHARE = 0.03
"""The share of a culprit's samples a function must hold beyond its peers' to be named..."""

MIN_SAMPLE_Z = 3.0
"""...and by this many standard deviations of the count its peers' share ``p`` leads one to expect
of ``n`` samples (binomial, ``sqrt(n p (1 - p) + 1)``): a stall its peers never make stands out
in a few samples, a function all ranks run at shares that differ from rank to rank does not."""

ENCLOSING_SHARE = 0.5
"""A function holding this share of the peers' samples encloses their loop (nanoGPT's module-level
loop holds ~90%): by 0.10 more of a culprit's, it says little; the line that does is named instead."""

_FUNCTION = re.compile(r"^(.*)\((\d+)\): (.*)$")


def top_sampled(samples: pd.DataFrame, rank: int, peers: list[int]) -> Sampled | None:
    """The function of the job's own code that the culprit's stack samples found it in most often
    beyond its peers' share, if by more than chance (``MIN_SAMPLE_SHARE``, ``MIN_SAMPLE_Z``): the
    cause rules then ask it to hold half the culprit's extra time. Windows profile a few
    steps now and then; samples come every 0.5 s whatever the step, so they see where a rare stall
    (one batch in 20 read slowly) puts the culprit's time when no window caught one.

    Functions first, as windows name them. A loop written at module level (nanoGPT's) or in one
    long function puts every rank's samples in that one function, the culprit's stall and its
    peers' wait for it alike: then its lines, each named as the profiler names a frame it finds
    running, at the line it is at (``"train.py(57): <module>"``)."""
    if samples.empty or not peers:
        return None
    s = samples[samples["rank"].isin([rank, *pick_peers(sorted(peers))])]
    totals = s.groupby("rank")["samples"].sum()
    if totals.get(rank, 0) < MIN_SAMPLES or len(totals) < 2:
        return None
    keys = [records.split_sample_key(k) for k in s["function"]]
    s = s.assign(
        function=[fn for fn, _ in keys],
        line=[-1 if line is None else line for _, line in keys],
        share=s["samples"] / s["rank"].map(totals),
    )
    s = s[s["function"] != ""]  # samples with none of the job's code on the stack
    ranks = list(totals.index)
    n = int(totals[rank])
    best, at, key = _beyond_peers(s, "function", rank, ranks, n), s, "function"
    # A line stands out more than any function where the function it is in encloses the loop: it
    # holds most of the peers' samples too, its culprit's stall and their wait for it on other
    # lines (then a function the culprit was found in a few more times, 5 of its 47 samples, can
    # stand out beyond noise less than the stall's line, 21 of them, does).
    lines = s[s["line"] >= 0]
    lines = lines.assign(
        at=[_at_line(fn, line) for fn, line in zip(lines["function"], lines["line"], strict=True)]
    )
    at_line = _beyond_peers(lines, "at", rank, ranks, n)
    if at_line is not None and (
        best is None or best[2] >= ENCLOSING_SHARE or at_line[1] - at_line[2] > best[1] - best[2]
    ):
        best, at, key = at_line, lines, "at"
    if best is None:
        return None
    name, share, peer_share = best
    mine = at[(at["rank"] == rank) & (at[key] == name)]
    lines = mine[mine["line"] >= 0].groupby("line")["samples"].sum()
    function = str(mine["function"].iloc[0])
    peer_function = s[(s["function"] == function) & (s["rank"] != rank)].groupby("rank")["share"].sum()
    return Sampled(
        name=name,
        share=share,
        peer_share=peer_share,
        samples=int(mine["samples"].sum()),
        of=int(totals[rank]),
        line=int(lines.idxmax()) if not lines.empty else None,
        peer_function_share=float(
            peer_function.reindex([r for r in ranks if r != rank], fill_value=0.0).median()
        ),
    )


def _beyond_peers(
    s: pd.DataFrame, by: str, rank: int, ranks: list[int], n: int
) -> tuple[str, float, float] | None:
    """The ``by`` value whose share of the culprit's ``n`` samples exceeds the peers' median share
    the most, of those that do by more than chance: (it, the culprit's share, the peers' median
    share; ``ranks``: the culprit and the peers, a peer without such samples counting 0)."""
    if s.empty:
        return None
    share = s.pivot_table(index=by, columns="rank", values="share", aggfunc="sum", fill_value=0.0)
    share = share.reindex(columns=ranks, fill_value=0.0)
    peer = share[[p for p in share.columns if p != rank]].median(axis=1)
    excess = share[rank] - peer
    z = excess * n / np.sqrt(n * peer * (1.0 - peer) + 1.0)
    excess = excess[(excess >= MIN_SAMPLE_SHARE) & (z >= MIN_SAMPLE_Z)]
    if excess.empty:
        return None
    best = str(excess.idxmax())
    return best, float(share.at[best, rank]), float(peer[best])


def _at_line(function: str, line: int) -> str:
    """``function`` named at ``line`` (``"train.py(1): <module>"``, 57 → ``"train.py(57): <module>"``)."""
    m = _FUNCTION.match(function)
    return f"{m[1]}({line}): {m[3]}" if m else records.sample_key(function, line)


def pick_peers(peers: list[int]) -> list[int]:
    """At most ``MAX_PEERS`` of ``peers``, evenly spread."""
    return [int(p) for p in evenly(np.asarray(peers, dtype=np.int64), MAX_PEERS)]


def compare(functions: pd.DataFrame, rank: int, peers: list[int]) -> list[FunctionExcess]:
    """The culprit's functions, largest excess time per step over the peer median first."""
    if functions.empty or not peers:
        return []
    peers = pick_peers(sorted(peers))
    f = functions[functions["rank"].isin([rank, *peers])]
    windows = set(f.loc[f["rank"] == rank, "window"])
    f = f[f["window"].isin(windows)]
    f = _by_operator(f)
    # Python functions are compared over the windows that recorded stacks (those that look for a
    # cause: ``profiler_hook.schedule``), everything else over all windows.
    python = f["kind"].isin(PYTHON_KINDS)
    stacked = set(f.loc[python & (f["rank"] == rank), "window"])
    f = f[~python | f["window"].isin(stacked)]
    if f.empty:
        return []
    n_windows = f.groupby("rank")["window"].nunique()
    n_stacked = f[f["window"].isin(stacked)].groupby("rank")["window"].nunique()
    present_peers = [p for p in peers if p in n_windows.index]
    if rank not in n_windows.index or not present_peers:
        return []
    # A window that left functions out (``cut``: those below the ``max_functions`` largest) kept
    # none that took less than the largest it left out. A function the culprit runs that small,
    # without the calls that held it up (its median call), may have run in the windows that lack it:
    # there it is averaged over the windows that know (those it is in, and those that left nothing
    # out). Counted absent, it would make a rank look like it runs a library function the others do
    # not (``isinstance``, a context manager's ``__exit__``: a few microseconds a step, left out on
    # every rank but one where a call is preempted for milliseconds). A larger one would be kept.
    is_cut = f["kind"] == CUT_KIND
    cuts = f.loc[is_cut, ["rank", "window", "max_us"]]
    f = f[~is_cut]
    steps = (f["step_hi"] - f["step_lo"]).clip(lower=1)
    cut = pd.MultiIndex.from_frame(cuts[["rank", "window"]])
    f = f.assign(
        us=f["total_us"] / steps,
        rob=np.where(
            f["count"] >= 2,
            (f["total_us"] - f["max_us"]) * f["count"] / (f["count"] - 1).clip(lower=1),
            f["total_us"],
        )
        / steps,
        typ=f["count"] * f["p50_us"] / steps,
        n=f["count"] / steps,
        in_cut=pd.MultiIndex.from_frame(f[["rank", "window"]]).isin(cut).astype(float),
    )
    key = ["kind", "name", "stack"]
    wide = (
        f.groupby(["rank", *key])[["us", "rob", "typ", "n", "in_cut"]].sum().unstack("rank", fill_value=0.0)
    )
    cols = wide["us"].columns
    python = wide.index.get_level_values("kind").isin(PYTHON_KINDS)

    def per_kind(python_value: pd.Series, other: pd.Series) -> np.ndarray:
        """Per row of ``wide`` and rank: ``python_value`` on Python functions, else ``other``."""
        py, rest = (v.reindex(cols, fill_value=0).to_numpy() for v in (python_value, other))
        return np.where(python[:, None], py, rest)

    n_cut = cuts.groupby("rank").size()
    n_cut_stacked = cuts[cuts["window"].isin(stacked)].groupby("rank").size()
    known = per_kind(n_stacked, n_windows)
    own = f[f["rank"] == rank]
    typical = (own["count"] * own["p50_us"]).groupby([own[k] for k in key]).mean().reindex(wide.index)
    floor = cuts.loc[cuts["rank"].isin(present_peers), "max_us"].max()  # NaN where none left out: none hidden
    hidden = (typical <= CUT_MARGIN * floor).to_numpy()[:, None]
    known = np.where(hidden, known - per_kind(n_cut_stacked, n_cut) + wide["in_cut"].to_numpy(), known)
    known = pd.DataFrame(known, index=wide.index, columns=cols)
    known = known.where(known > 0)  # NaN: no window of that rank knows whether it ran
    us, typ, n = wide["us"] / known, wide["typ"] / known, wide["n"] / known
    out = pd.DataFrame(
        {
            "rank_us": us[rank],
            "rank_rob": (wide["rob"] / known)[rank],
            "rank_typ": typ[rank],
            "peer_typ": typ[present_peers].median(axis=1).fillna(0.0),
            # A function every peer left out took less than what they kept: next to nothing.
            "peer_us": us[present_peers].median(axis=1).fillna(0.0),
            "rank_n": n[rank],
            "peer_n": n[present_peers].median(axis=1),  # NaN where no peer knows: never "extra"
        }
    )
    out = out[out["rank_us"] > out["peer_us"]]
    out = out.assign(excess=out["rank_us"] - out["peer_us"]).sort_values(by="excess", ascending=False)
    seen_in = f[f["rank"] == rank].groupby(["kind", "name", "stack"])["window"].nunique()
    mine = f[(f["rank"] == rank) & f["kind"].isin(PYTHON_KINDS)]
    callers = _callers(zip(mine["name"], mine["stack"], strict=True))
    waiting = {c for (nm, _), cs in callers.items() if _COLLECTIVE_FRAME.search(nm) for c in cs}
    return [
        FunctionExcess(
            kind=k,
            name=nm,
            stack=st,
            rank_us=float(r.rank_us),
            peer_us=float(r.peer_us),
            rank_robust_us=float(r.rank_rob),
            rank_typical_us=float(r.rank_typ),
            peer_typical_us=float(r.peer_typ),
            rank_count=float(r.rank_n),
            peer_count=float(r.peer_n),
            waits=nm in waiting,
            callers=frozenset(callers.get((nm, st), ())),
            windows=int(seen_in.get((k, nm, st), 0)),
            of_windows=int((n_stacked if k in PYTHON_KINDS else n_windows)[rank]),
        )
        for (k, nm, st), r in out.head(200).iterrows()
    ]


def _by_operator(f: pd.DataFrame) -> pd.DataFrame:
    """``f`` with a device's work named by the operator that launched it alone: windows without
    Python functions (periodic ones) name the operator only, and a kernel compared by its full stack
    would be two rows, one for the windows with stacks and one for those without, each averaged over
    all windows and holding a part of its time."""
    launched = f["kind"].isin(LAUNCHED_KINDS).to_numpy()
    if not launched.any():
        return f
    stack = f["stack"].to_numpy(dtype=object, copy=True)
    stack[launched] = [str(st).rsplit(" > ", 1)[-1] for st in stack[launched]]
    return f.assign(stack=stack)


_COLLECTIVES = (
    "all_reduce|all_gather|all_gather_into_tensor|_all_gather_base|all_gather_object|reduce_scatter|"
    "reduce_scatter_tensor|_reduce_scatter_base|all_to_all|all_to_all_single|broadcast|"
    "broadcast_object_list|reduce|gather|gather_object|scatter|scatter_object_list|barrier|"
    "monitored_barrier|send|recv|isend|irecv|batch_isend_irecv|send_object_list|recv_object_list"
)
_COLLECTIVE_FRAME = re.compile(
    rf"distributed_c10d\.py\(\d+\): (?:{_COLLECTIVES})$|c10d_logger\.py|profiler_hook/collectives\.py"
)
"""Python frames of collectives: torch.distributed's collectives and the wrappers around them (not
its other functions: a forward that asks ``get_world_size`` does not wait for the other ranks)."""


def _callers(frames: Iterable[tuple[str, str]]) -> dict[tuple[str, str], set[str]]:
    """Every function that calls each Python frame, directly or through others, by (name, stack).

    A frame's stack holds its nearest callers only (outermost first, `` > ``); the callers above
    them are those of the frame its stack ends in, *on the same path*: the frame named like its
    last caller whose own stack ends in the callers before that. Following names alone would join
    every path through a frame called from everywhere (``module.py: _call_impl`` runs every
    ``nn.Module``), making each model function the caller of every other.
    """
    frames = set(frames)
    by_tail: dict[tuple[str, tuple[str, ...]], list[tuple[str, str]]] = {}
    for name, stack in frames:
        path = tuple(stack.split(" > ")) if stack else ()
        by_tail.setdefault((name, path[-2:]), []).append((name, stack))
    out: dict[tuple[str, str], set[str]] = {}

    def callers(node: tuple[str, str], on: frozenset[tuple[str, str]]) -> set[str]:
        if node in out:
            return out[node]
        path = tuple(node[1].split(" > ")) if node[1] else ()
        found = set(path)
        if path:
            for parent in by_tail.get((path[-1], path[:-1][-2:]), ()):
                if parent not in on:  # a recursive function's path leads back to itself
                    found |= callers(parent, on | {node})
        out[node] = found
        return found

    for node in frames:
        callers(node, frozenset())
    return out


PROFILER_FRAME = "torch/profiler/"


def top_extra(excess: list[FunctionExcess]) -> FunctionExcess | None:
    """The costliest function only the culprit runs (or runs more often), the job's own Python
    functions first, then library Python functions, then operators."""
    # A collective is no code path of the culprit's own; the run-queue wait's count is threads, not
    # calls; what the profiler calls as its window starts or stops is the window's (the process
    # group's size, read once when the tracer caught it on this rank only).
    extra = [
        e
        for e in excess
        if e.extra
        and e.kind not in ("collective", WAIT_KIND)
        and not any(PROFILER_FRAME in c for c in e.callers)
    ]
    if not extra:
        return None
    best = max(e.excess_us for e in extra)
    # A Python function names the code path better than the operators it calls.
    for kind in PYTHON_KINDS:
        python = [e for e in extra if e.kind == kind and e.excess_us >= 0.5 * best]
        if python:
            return python[0]
    return extra[0]


def stray_builtin(excess: list[FunctionExcess], e: FunctionExcess) -> bool:
    """Whether ``e`` is a built-in that no code path holds: none of its callers runs only on the
    culprit, and no function of the job's own code holds half its excess. A built-in is a leaf;
    where it is called from is the path. Alone, its time is where the thread happened to be when
    it lost the CPU or the GIL: a ``getattr`` under torch's ``_disable_dynamo`` wrapper can take
    hundreds of µs a step on a rank whose device slowed, in the one window that caught it, and too
    little on its peers to be kept."""
    if not e.name.startswith("<built-in"):
        return False
    paths = {x.name for x in excess if x.extra and x.name in e.callers}
    return not paths and innermost_code(excess, 0.5 * e.excess_us) is None


def innermost_code(excess: list[FunctionExcess], min_us: float) -> FunctionExcess | None:
    """The innermost function of the job's own code (kind ``python``: not torch, the standard
    library or an installed package) that holds at least ``min_us`` of the culprit's excess per step.

    A function's time includes its callees', so every caller of the culprit function holds the
    excess too; the innermost one names where it is spent (callers as :func:`compare` found them on
    the culprit). Frames that call collectives are left out: their time includes waiting for the
    other ranks.
    """
    code = [e for e in excess if e.kind == "python" and not e.waits and e.excess_us >= min_us]
    if not code:
        return None
    enclosing = {c for e in code for c in e.callers}
    inner = [e for e in code if e.name not in enclosing]
    return max(inner or code, key=lambda e: e.excess_us)


def top_slower(excess: list[FunctionExcess], kinds: tuple[str, ...] = WORK_KINDS) -> FunctionExcess | None:
    """The costliest operator/kernel the culprit runs as often as its peers, only slower: in its
    calls at their median call's time, not in a few of them: a slower device slows every call.
    (The optimizer's ``aten::sqrt``, untouched by a slower device's padded batch, made 28 calls
    in a pipeline stage's one window, the median 10 µs, the longest 6.4 ms: preempted, it read
    13.3 ms, 28x its peers', and was named.)"""
    same = [e for e in excess if e.kind in kinds and not e.extra]
    return max(same, key=lambda e: e.typical_excess_us) if same else None


def largest(excess: list[FunctionExcess], n: int) -> list[FunctionExcess]:
    """The ``n`` operators, kernels, copies and functions of the job's own code with the largest
    excess at their median call's time (as :func:`top_slower` picks one) that the culprit runs as
    often as its peers, frames that wait in collectives left out."""
    kinds = (*WORK_KINDS, "python")
    same = [e for e in excess if e.kind in kinds and not e.extra and not e.waits]
    return sorted(same, key=lambda e: e.typical_excess_us, reverse=True)[:n]


def work_excess(excess: list[FunctionExcess], kinds: tuple[str, ...] = WORK_KINDS) -> float:
    """The culprit's excess per step in operators, kernels and copies (``kinds``) it runs as often
    as its peers (an upper bound: CPU operators nest, and the parent's time includes the child's)."""
    return sum(e.excess_us for e in excess if e.kind in kinds and not e.extra)


def top_of_kind(excess: list[FunctionExcess], kind: str) -> FunctionExcess | None:
    return top_of_kinds(excess, (kind,))


def top_of_kinds(excess: list[FunctionExcess], kinds: tuple[str, ...]) -> FunctionExcess | None:
    """The function of one of ``kinds`` with the largest excess."""
    of = [e for e in excess if e.kind in kinds]
    return of[0] if of else None
