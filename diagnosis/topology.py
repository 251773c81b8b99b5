"""Culprits that make up a whole NIC, host, switch or spine become one finding naming it."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import pandas as pd

from .findings import LEVELS, Cause, Finding

_LEVELS = tuple((level, ("rank", *LEVELS[:i])) for i, level in enumerate(LEVELS))
"""Each topology level and the finding scopes it merges; a NIC only for communication culprits."""


def group(found: list[Finding], ranks: pd.DataFrame) -> list[Finding]:
    """Culprits that make up a whole NIC, host or switch become one finding naming it."""
    for label, below in _LEVELS:
        if ranks.empty or label not in ranks:
            continue
        cands = [
            f
            for f in found
            if f.scope in below
            and (f.scope != "rank" or len(f.ranks) == 1)
            and (label != "nic" or f.cause == "communication")
        ]
        if not cands:
            continue
        culprit = {r for f in cands for r in f.ranks}
        lab = ranks[["rank", label]].astype({"rank": "int64", label: str})
        label_of = dict(lab[lab["rank"].isin(culprit)].itertuples(index=False, name=None))
        if lab[label].nunique() < 2:
            continue
        by_key: dict[tuple[Cause, str], list[Finding]] = defaultdict(list)
        for f in cands:
            places = {label_of.get(r, "") for r in f.ranks}
            if len(places) == 1:
                by_key[(f.cause, places.pop())].append(f)
        wanted = {w for _, w in by_key if w}
        mine = lab[lab[label].isin(wanted)]
        members = {w: sorted(g.tolist()) for w, g in mine.groupby(label)["rank"]}
        merged_ids: set[int] = set()
        merged: list[Finding] = []
        for (cause, where), fs in by_key.items():
            covered = sorted(r for f in fs for r in f.ranks)
            if not where or len(members.get(where, [])) < 2 or covered != members[where]:
                continue
            per_rank: dict[int, Any] = {}
            for f in fs:
                per_rank.update(
                    f.evidence.get("per_rank", {}) if f.scope != "rank" else {f.ranks[0]: f.evidence}
                )
            merged_ids.update(id(f) for f in fs)
            merged.append(
                Finding(
                    cause=cause,
                    ranks=covered,
                    hosts=sorted({h for f in fs for h in f.hosts}),
                    function=Counter(f.function for f in fs).most_common(1)[0][0],
                    confidence=round(sum(f.confidence for f in fs) / len(fs), 3),
                    summary=(
                        f"{label} {where}: all its {len(covered)} ranks {_some(covered)} are {cause} "
                        f"{'culprits' if cause == 'communication' else 'stragglers'}; look at the {label}"
                    ),
                    evidence={label: where, "per_rank": per_rank},
                    scope=label,
                )
            )
        found = [f for f in found if id(f) not in merged_ids] + merged
    return found


def _some(ranks: list[int], n: int = 8) -> str:
    return str(ranks) if len(ranks) <= n else f"[{', '.join(map(str, ranks[:n]))}, ...]"
