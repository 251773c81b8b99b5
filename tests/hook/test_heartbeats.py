"""Heartbeats: a stalled rank's stack, the stack samples, each link's sends."""

from __future__ import annotations

import gc
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import pytest
from torch.profiler import ProfilerActivity, profile

from rankscope.profiler_hook import events, summarize, watchdog
from rankscope.wire.records import (
    Heartbeat,
    sample_key,
)
from tests.hook.common import SlowSink, one_rank_hook

# Steps, windows and threads timed on the machine's clock: no other test beside them.
pytestmark = pytest.mark.alone


def test_stalled_rank_heartbeat_carries_its_stack() -> None:
    hook = one_rank_hook(SlowSink(), window_s=0, heartbeat_s=60, stall_s=0.05)
    hook.begin_step(0)
    hb: list[Heartbeat] = []

    def later() -> None:
        time.sleep(0.2)
        hb.append(hook.watchdog.beat())

    t = threading.Thread(target=later)
    t.start()
    t.join()
    hook.end_step()
    after = hook.watchdog.beat()
    hook.close(timeout=30)
    assert hb[0].progress_age_s >= 0.05
    assert "test_stalled_rank_heartbeat_carries_its_stack" in hb[0].stack
    assert (hb[0].step, after.step) == (-1, 0), "a heartbeat names the last step finished, not the one begun"


def read_from_storage(seconds: float) -> None:
    time.sleep(seconds)  # a slow read: the thread waits in no Python frame of its own


def hold_the_gil(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:  # Python: the GIL held, let go only when another thread asks
        pass


def test_stack_samples_find_python_that_holds_the_gil_for_less_than_the_switch_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sample waits for the GIL: Python that holds it 3 ms at a time, then a 10-ms wait that lets
    it go, was sampled in the wait only (0 of ~200 samples in its Python, 23% of its time), where
    the sample came once the thread let the GIL go. The watchdog lowers the switch interval for
    the last moments before each sample, and puts it back."""
    monkeypatch.setattr(watchdog, "POLL_S", 0.02)
    interval = sys.getswitchinterval()
    hook = one_rank_hook(SlowSink(), window_s=0, heartbeat_s=60)
    end, seen = time.perf_counter() + 3, set()
    while time.perf_counter() < end:
        hold_the_gil(0.003)
        read_from_storage(0.010)
        seen.add(sys.getswitchinterval())
    counts = hook.watchdog.sampler.take()
    hook.close(timeout=30)
    assert sys.getswitchinterval() == interval and interval in seen, seen  # put back after each
    held = sum(n for site, n in counts.items() if "hold_the_gil" in site)
    assert sum(counts.values()) >= 60 and held >= 0.08 * sum(counts.values()), counts


def test_a_paused_hook_samples_no_stacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Paused, the hook measures nothing: no stack samples either, each of which takes the GIL from
    the training thread (and lowers the switch interval before it)."""
    monkeypatch.setattr(watchdog, "POLL_S", 0.02)
    hook = one_rank_hook(SlowSink(), window_s=0, heartbeat_s=60)
    hook.pause()
    time.sleep(0.3)  # a sample due when it paused is not taken
    hook.watchdog.sampler.take()
    time.sleep(0.5)
    paused = hook.watchdog.sampler.take()
    hook.resume()
    time.sleep(0.5)
    working = hook.watchdog.sampler.take()
    hook.close(timeout=30)
    assert paused == {} and sum(working.values()) >= 5, (paused, working)


@pytest.mark.releases
def test_heartbeats_carry_the_function_of_the_jobs_code_each_stack_sample_found_the_thread_in() -> None:
    """The watchdog samples the innermost function of the job's own code the training thread is in,
    named as torch's profiler names it, so that samples and windows name a function alike, and the
    line it is at."""
    hook = one_rank_hook(SlowSink(), window_s=0, heartbeat_s=60)
    hook.watchdog.beat()  # takes the samples so far

    def sample() -> None:
        time.sleep(0.05)
        for _ in range(5):
            hook.watchdog.sampler.sample()
            time.sleep(0.02)

    t = threading.Thread(target=sample)
    t.start()
    read_from_storage(0.4)
    t.join()
    beat = hook.watchdog.beat()
    hook.close(timeout=30)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        read_from_storage(0.001)
    profiled = {
        e.name for e in events.read(prof.profiler.kineto_results) if e.name.endswith(": read_from_storage")
    }
    assert len(profiled) == 1
    sleep_line = read_from_storage.__code__.co_firstlineno + 1
    assert beat.samples.get(sample_key(profiled.pop(), sleep_line), 0) >= 5, (beat.samples, profiled)
    assert not [
        f for f in beat.samples if f.startswith(("torch/", "threading.py", "rankscope/profiler_hook"))
    ]


def free_memory() -> None:
    gc.collect()


def test_a_sampler_reads_what_naming_a_frame_imports_when_it_is_made() -> None:
    """Naming a frame reads torch's path prefixes and the library directories (imports, the
    first time). A collection's callback names frames too, and can run in the middle of an
    import on the training thread: an import there broke CPython's import lock once (``KeyError``
    in ``_ModuleLock.acquire``). Making the sampler reads both."""
    watchdog._path_prefixes.cache_clear()
    summarize.library_dirs.cache_clear()
    watchdog.StackSampler(threading.get_ident())
    assert watchdog._path_prefixes.cache_info().currsize == 1
    assert summarize.library_dirs.cache_info().currsize == 1


def test_a_sample_due_while_the_garbage_collector_held_the_gil_counts_where_it_collected() -> None:
    """The sampler's thread waits for the GIL while a collection holds it, and samples after it,
    where the training thread may have left the function that collected (the samples of a rank
    that collected for 60% of its time once never found the function): a sample due meanwhile
    counts where the collection ran. Here the training thread samples itself, after the
    collection, from another function."""
    heap = [[i] for i in range(300_000)]  # a full collection of several ms
    hook = one_rank_hook(SlowSink(), window_s=0, heartbeat_s=60)
    # Only this test's samples: the watchdog's own, every ~0.5 s, can fall in the collection too
    # (a CI run's did: 2 samples in free_memory).
    hook.watchdog.close(timeout=5)
    hook.watchdog.beat()  # takes the samples so far
    free_memory()
    start, end, _ = hook._gc.last

    def sample_elsewhere() -> None:
        hook.watchdog.sampler.sample((start + end) // 2)  # due during the collection
        hook.watchdog.sampler.sample(end + 1)  # due after it

    sample_elsewhere()
    samples = hook.watchdog.beat().samples
    hook.close(timeout=30)
    del heap
    line = sample_elsewhere.__code__.co_firstlineno
    [(collected, during), (elsewhere, after)] = sorted(samples.items(), key=lambda kv: "elsewhere" in kv[0])
    assert collected.endswith(f"free_memory @{free_memory.__code__.co_firstlineno + 1}"), samples
    assert elsewhere.endswith(f"sample_elsewhere @{line + 2}") and during == after == 1, samples


def test_a_paused_hook_is_not_a_stalled_rank() -> None:
    """hook.pause() (an evaluation loop, a benchmark's A/B) stops the step clock: no stall, no stack."""
    hook = one_rank_hook(SlowSink(), window_s=0, heartbeat_s=60, stall_s=0.05)
    with hook.step():
        pass
    hook.pause()
    time.sleep(0.2)
    beat = hook.watchdog.beat()
    hook.resume()
    hook.close(timeout=30)
    assert beat.progress_age_s < 0.05 and beat.stack == ""


def _bulk_sender() -> tuple[socket.socket, socket.socket, Callable[[int], None], Callable[[], None]]:
    """An idle and a bulk loopback connection to a reading server, ``send(n)`` that waits until ``n``
    more bytes were read, and ``close()``."""
    server = socket.create_server(("127.0.0.1", 0))
    received = 0

    def read(conn: socket.socket) -> None:
        nonlocal received
        with conn:
            while chunk := conn.recv(1 << 20):
                received += len(chunk)

    def accept() -> None:
        for _ in range(2):
            threading.Thread(target=read, args=(server.accept()[0],), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    idle = socket.create_connection(server.getsockname())
    bulk = socket.create_connection(server.getsockname())

    def send(n: int) -> None:
        goal = received + n
        bulk.sendall(b"x" * n)
        deadline = time.monotonic() + 10
        while received < goal and time.monotonic() < deadline:
            time.sleep(0.01)

    def close() -> None:
        idle.close()
        bulk.close()
        acceptor.join(10)
        server.close()

    return idle, bulk, send, close


def test_heartbeats_carry_each_links_sends_from_a_real_bulk_transfer_and_not_idle_connections() -> None:
    from rankscope.profiler_hook.netstat import MIN_BYTES, LinkMeter, tcp_counters

    hook = one_rank_hook(SlowSink(), window_s=0, heartbeat_s=60)
    _, _, send, close = _bulk_sender()
    try:
        assert not tcp_counters()  # loopback connections never touch a NIC: left out by default
        hook.watchdog.links = LinkMeter(loopback=True)  # here they stand for a NIC's
        assert hook.watchdog.beat().sends == {}  # nothing to compare with yet
        send(32 << 20)
        beat = hook.watchdog.beat()
        quiet = hook.watchdog.beat()
    finally:
        close()
        hook.close(timeout=30)
    # One link, host > peer: the bulk connection's bytes (the idle one's few left out) and its time.
    assert list(beat.sends) == ["127.0.0.1>127.0.0.1"], beat
    nbytes, us = beat.sends["127.0.0.1>127.0.0.1"]
    assert 32 << 20 <= nbytes < (32 << 20) + MIN_BYTES and us > 0
    assert quiet.sends == {}  # nothing sent since


def test_a_process_with_many_descriptors_reads_its_bulk_connections_between_full_scans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rankscope.profiler_hook import netstat

    monkeypatch.setattr(netstat, "MAX_SCAN", 0)  # every process has "many"
    links = netstat.LinkMeter(loopback=True)
    idle, bulk, send, close = _bulk_sender()
    try:
        read: list[int] = []
        monkeypatch.setattr(netstat.os, "dup", lambda fd, dup=os.dup: read.append(fd) or dup(fd))
        links.read()  # the first two reads are full scans: the second finds the bulk connection
        send(1 << 20)
        assert links.read()
        read.clear()
        send(1 << 20)
        sends = links.read()  # the bulk connection alone
        assert read == [bulk.fileno()], (read, bulk.fileno(), idle.fileno())
    finally:
        close()
    nbytes, _ = sends["127.0.0.1>127.0.0.1"]
    assert 1 << 20 <= nbytes < (1 << 20) + netstat.MIN_BYTES
