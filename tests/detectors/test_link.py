"""``link`` on hand-built link sends: the rank behind a slow NIC, from the links through it."""

from __future__ import annotations

from dataclasses import replace

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
