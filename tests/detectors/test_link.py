"""``link`` on hand-built link sends: the rank behind a slow NIC, from the links through it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from rankscope.diagnosis import diagnose
from rankscope.diagnosis.detectors import link
from tests.jobdata import LINK_T0, only, ring_links, synthetic

SETTINGS = link.Settings()


def test_a_slow_nic_is_the_endpoint_its_slow_links_share_not_the_rank_sending_into_it() -> None:
    # Rank 3's NIC is slow both ways: its link out (3 -> 0) and the link into it (2 -> 3) are slow.
    links = ring_links(4, {(2, 3): 6.0, (3, 0): 6.0})
    data = replace(synthetic(ranks=4, hosts_of=4), links=links)
    f = only(link.find(data, SETTINGS))
    assert (f.cause, f.ranks, f.hosts) == ("communication", [3], ["node3"])
    assert f.evidence["spans_flagged"] == "6/6" and f.evidence["span_s"] == 5.0 and f.evidence["ratio"] > 4
    # Healthy links: nothing.
    assert link.find(replace(data, links=ring_links(4, {})), SETTINGS) == []
    # A milder one, and the link before it backed up: the healthy baseline is still a healthy
    # link's rate (a quartile interpolated towards the backed-up link left the slow ones short).
    links = ring_links(4, {(2, 3): 4.0, (3, 0): 4.5, (1, 2): 1.8})
    f = only(link.find(replace(data, links=links), SETTINGS))
    assert (f.cause, f.ranks) == ("communication", [3])


def test_a_slow_nic_is_named_from_when_it_slowed_and_a_burst_is_not() -> None:
    data = synthetic(ranks=4, hosts_of=4)
    healthy, slow = ring_links(4, {}, spans=8), ring_links(4, {(2, 3): 6.0, (3, 0): 6.0}, spans=8)
    late = slow["time_us"] >= LINK_T0 + 25_000_000  # from the fifth span on
    f = only(link.find(replace(data, links=healthy.where(~late, slow)), SETTINGS))
    assert (f.ranks, f.evidence["spans_flagged"]) == ([3], "4/4")
    burst = slow["time_us"] // 5_000_000 == (LINK_T0 + 20_000_000) // 5_000_000  # one span of eight
    assert link.find(replace(data, links=healthy.where(~burst, slow)), SETTINGS) == []


def test_each_span_holds_one_beat_of_every_rank_whatever_phase_it_beats_at() -> None:
    """Heartbeats 5.25 s apart (5 s and a poll's lateness, as measured), each rank at its own phase
    of them, each beat up to 0.3 s early or late: spans cut at fixed times held two beats of a rank
    near their edges now and then and the one before it none, where rank 3's slow NIC showed only
    through the links into it (here in one span of 12)."""
    data = synthetic(ranks=4, hosts_of=4)
    links = ring_links(4, {(2, 3): 6.0, (3, 0): 6.0}, spans=12)
    beat = (links["time_us"] - LINK_T0) // 5_000_000
    jitter = np.random.default_rng(0).integers(-300_000, 300_000, (13, 4))  # the poll it comes at
    links["time_us"] = LINK_T0 + beat * 5_250_000 + links["rank"] * 1_700_000 + jitter[beat, links["rank"]]
    f = only(link.find(replace(data, links=links), SETTINGS))
    assert (f.ranks, f.evidence["spans_flagged"]) == ([3], "12/12"), f.evidence


def test_an_older_hooks_windows_with_their_link_sends_still_name_the_slow_nic() -> None:
    """Hooks before the heartbeats carried link sends measured them per profiling window, as the
    ``net_send@tcp`` pattern with the link as its stack."""
    links = ring_links(4, {(2, 3): 6.0, (3, 0): 6.0}, spans=3)
    windows = pd.DataFrame(
        {
            "rank": links["rank"],
            "window": (links["time_us"] - LINK_T0) // 5_000_000 * 50,
            "kind": "collective",
            "name": "net_send@tcp",
            "stack": links["link"],
            "count": 1,
            "total_us": links["send_us"].astype(float),
            "mean_us": links["send_us"].astype(float),
            "nbytes": links["nbytes"],
        }
    )
    f = only(diagnose(replace(synthetic(ranks=4, hosts_of=4), functions=windows)).findings)
    assert (f.cause, f.ranks, f.evidence["windows_flagged"]) == ("communication", [3], "3/3")


def test_a_slow_switch_uplink_is_the_switch_whose_links_to_the_rest_are_slow() -> None:
    # Six hosts, two per switch; sw1's uplink (hosts 2 and 3) is slow: 1 -> 2 and 3 -> 4 cross it.
    links = ring_links(6, {(1, 2): 5.0, (3, 4): 5.0})
    data = synthetic(ranks=6, hosts_of=6)
    ranks = data.ranks.assign(switch=[f"sw{r // 2}" for r in range(6)])
    f = only(diagnose(replace(data, ranks=ranks, links=links)).findings)
    assert (f.cause, f.scope, f.ranks, f.evidence["switch"]) == ("communication", "switch", [2, 3], "sw1")


def pipeline_links(slow_ms_per_mb: dict[tuple[int, int], float], spans: int = 6) -> pd.DataFrame:
    """Heartbeats' link sends of a (dp=2, pp=2) job on four hosts (one rank each, 10.0.0.<rank>):
    each data-parallel pair (0-2, 1-3) moves 40 MB of gradients each way per 5 s at ~1 ms per MB;
    each pipeline's stages (0-1, 2-3) 6 MB of activations and their gradients, small messages that
    read ~60 ms per MB (measured on a healthy pipeline_dp job: their latency, not the link's rate);
    ``slow_ms_per_mb[(src, dst)]`` instead where given."""
    rows = []
    for span in range(spans):
        t = LINK_T0 + (span + 1) * 5_000_000
        for src, dst, mb, ms in [
            *((a, b, 40, 1.0 + 0.03 * ((a + span) % 3)) for a, b in ((0, 2), (2, 0), (1, 3), (3, 1))),
            *((a, b, 6, 60.0 + 5.0 * ((a + span) % 3)) for a, b in ((0, 1), (1, 0), (2, 3), (3, 2))),
        ]:
            ms = slow_ms_per_mb.get((src, dst), ms)
            rows.append(
                {"rank": src, "time_us": t + src * 1_000, "link": f"10.0.0.{src}>10.0.0.{dst}",
                 "nbytes": mb << 20, "send_us": int(mb * ms * 1000)}
            )  # fmt: skip
    return pd.DataFrame(rows)


def test_a_slow_link_between_two_stages_is_named_as_the_link_not_either_end() -> None:
    data = synthetic(ranks=4, hosts_of=4)
    assert link.find(replace(data, links=pipeline_links({})), SETTINGS) == [], "a healthy pipeline"
    for slow in ({(2, 3): 300.0, (3, 2): 300.0}, {(2, 3): 300.0}):  # both ways, or one
        f = only(link.find(replace(data, links=pipeline_links(slow)), SETTINGS))
        assert (f.cause, f.scope, f.ranks, f.hosts) == ("communication", "link", [2, 3], ["node2", "node3"])
        assert f.summary.startswith("the link between rank 2 (node2) and rank 3 (node3) is slow"), f.summary
        assert f.evidence["spans_flagged"] == "6/6" and f.evidence["ratio"] > 4


def test_a_pipelines_slow_link_is_compared_with_the_stage_links_beside_it() -> None:
    """The same job with its mesh, as measured on the simulated network: a healthy pipeline's
    stage-to-stage links read 9-16x the data-parallel links' time per byte and differ from each
    other by up to 1.8x (here 100 ms per MB on the first pipeline's, 60-70 on the other); a rank's
    heartbeat can come a span late (that span then holds two of its beats, the one before none):
    here ranks 0 and 2 every third span, rank 3 the span after; and the data-parallel link into
    rank 3 backs up behind the slow one (1.6x, as measured; the other way at its peers' speed).
    Before, nothing was found. Still nothing where every link is compared with all of its span's;
    nothing where a group is judged in a span without its own sends (rank 2's links seen only as
    the slow one into it: a slow NIC, which takes the span from the link); and rank 3 a slow NIC
    where a group's slow links are counted rather than its peers at the end of them."""
    data = synthetic(ranks=4, hosts_of=4)
    staged = replace(data, ranks=data.ranks.assign(mesh=[{"dp": r // 2, "pp": r % 2} for r in range(4)]))
    slow = {(0, 1): 100.0, (1, 0): 100.0, (2, 3): 300.0, (3, 2): 300.0, (1, 3): 1.6}
    links = pipeline_links(slow, spans=9)
    span = (links["time_us"] - LINK_T0) // 5_000_000
    late = (links["rank"].isin([0, 2]) & (span % 3 == 0)) | ((links["rank"] == 3) & (span % 3 == 1))
    links.loc[late, "time_us"] += 5_000_000
    healthy = pipeline_links({(0, 1): 100.0, (1, 0): 100.0}, spans=9)
    assert link.find(replace(staged, links=healthy), SETTINGS) == []
    f = only(link.find(replace(staged, links=links), SETTINGS))
    assert (f.cause, f.scope, f.ranks) == ("communication", "link", [2, 3]), f.summary
    assert f.evidence["spans_flagged"] == "10/10" and 2.0 < f.evidence["ratio"] < 5.0, f.evidence


def test_a_link_a_little_slower_than_the_rest_is_its_path_and_one_at_half_its_rate_a_fault() -> None:
    """One link of a ring (1 to 2) slower than the others, each end at its peers' speed on its other
    link: at 1.5x the time per byte that is its path or its load (a healthy job on the simulated
    network had one link so in every span), not named; at 2.5x, as a port or cable that trained
    down to half its rate or less, it is the link."""
    data = synthetic(ranks=4, hosts_of=4)
    path = replace(data, links=ring_links(4, {(1, 2): 1.5}))
    assert link.find(path, SETTINGS) == []
    assert link.find(path, replace(SETTINGS, one_link_ratio=1.3)), "found but for the ratio"
    f = only(link.find(replace(data, links=ring_links(4, {(1, 2): 2.5})), SETTINGS))
    assert (f.cause, f.scope, f.ranks) == ("communication", "link", [1, 2]), f.summary
    assert 2.0 < f.evidence["ratio"] < 3.0
