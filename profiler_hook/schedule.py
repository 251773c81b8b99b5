"""When profiling windows start: on a clock, and when the step time jumps — at one step every rank agrees on.

Ranks can only be compared on the same steps, and a schedule in steps is wrong for most jobs (one
window every 2 minutes at 120 ms a step, every 5 s at 5 ms). So one rank plans: rank 0, every
``window_s`` seconds, or as soon as any rank asks for a window because its step time jumped. It
picks a step ``LEAD_S`` seconds ahead (from its recent step time) and publishes it in the job's
c10d store (the one ``init_process_group`` made, which every job has); every rank reads
it from a background thread and starts its window when it reaches that step. The training thread
only compares two integers per step. A rank that reads the plan too late skips that window (rare:
the lead is several times the polling interval) and says so in the store; rank 0 then plans
further ahead, doubling the lead up to ``MAX_LEAD_S``, so a loaded machine stops missing windows.
The first windows come as soon as the budget has room for them, so that a fault present from the
first step is profiled early. Every window, whatever asked for it, waits until it fits the windows' cost
budget (``profiler_hook.budget``), which also says how many steps it profiles. A window is also asked for by a rank that stands out from its peers with no
jump in its own steps (a fault that began before the trigger had a history, or grew slowly): every
step block (~2 s, ``profiler_hook.blocks``) each rank publishes its own time and CPU time per
step; rank 0 gathers those of up to ``SAMPLE`` ranks into one key, and each rank compares itself
with the median of the others there.

Python stacks are recorded in the windows that look for a cause, where one step with them costs
no more than one interval of the budget buys (such a window waits for room for them): the second
window (the first measures what a window costs), those a slowdown
triggers with their follow-ups, and every window while a rank stands out (a rank found at a change
is attributed from the windows since). Other periodic windows record operators only: stacks more
than double a window's events, and were more than half of what a window cost a 2-rank DDP job;
the plan carries the choice, so every rank profiles the same way.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .budget import WindowBudget

log = logging.getLogger(__name__)

POLL_S = 0.5
"""How often each rank's background thread reads the plan (and rank 0 makes one). Each request of
the store is a round trip the thread waits for without the GIL, then takes the GIL back from the
training thread (what polling costs a pipeline job: docs/benchmarks.md), so a poll makes one
request for each key it reads once the key exists (:meth:`Schedule._exists`)."""
LEAD_S = 2.0
"""A window is planned this many seconds of steps ahead, so that every rank has read the plan."""
MAX_LEAD_S = 16.0
"""The lead after ranks missed plans (it doubles with each miss any rank reports)."""
TRIGGER_BUCKET_S = 1.0
"""The slowdown trigger compares mean step times over buckets of consecutive steps lasting about
this long, not single steps: on a busy machine, bursts of slow steps come and go within a few hundred
milliseconds (measured on 2 cores, 2 DDP ranks at 4 ms a step: runs of 20-50 steps at 2-3x). A
per-step median over the last 20 steps fired on them every few seconds in a healthy job, and each
window it started cost the job ~0.1 s."""
TRIGGER_HISTORY = 10
"""Buckets the trigger keeps: the last ``TRIGGER_RECENT`` against the ones before."""
TRIGGER_RECENT = 2
"""Each of the last this many buckets must be slow: a stall of one second (a checkpoint, a busy
neighbour for a moment) does not trigger."""
TRIGGER_OWN_RATIO = 1.3
"""A rank's own time per step (outside collectives) that jumps this much also triggers. A rank that
gets slower raises the job's step time only by its extra work, often less than ``trigger_ratio``
(a garbage collection every few steps, a busy neighbour), but its own time by all of it. In a
healthy 2-rank DDP job on 2 shared cores the largest own-time jump between 1 s buckets was 1.12x."""
LEAD_STEPS = 20
"""The lead is counted at the median of this many last steps (robust to a slow first step)."""
TRIGGER_COOLDOWN_S = 10.0
"""After a triggered window, requests for this long are dropped: the slowdown is being profiled."""
FOLLOW_UPS = 2
"""Windows planned after a triggered one, ``TRIGGER_COOLDOWN_S`` apart: a finding needs a slowdown
seen in more than one window, and the trigger stops firing once the slow steps fill its history."""
SAMPLE = 32
"""Ranks whose rates rank 0 gathers (evenly spread): each rank compares itself with their median,
so at any scale rank 0 reads this many keys a block, and every rank one."""
STAND_OUT_OWN = 1.3
STAND_OUT_CPU = 1.15
"""A rank stands out from its peers when its own time per step (outside collectives) is this
multiple of theirs, or its CPU time per step is. The largest in the fault suite's 14 healthy runs
(2 of each of 7 jobs, 2 shared cores), over two blocks in a row: own time 1.23x (rank 0 of the GPT
under torchrun, which also evaluates), CPU time 1.06x; a device 1.5x slower showed 1.23-1.25x in
CPU time, 1.23-1.31x in own time, and triggered no jump."""
STAND_OUT_BLOCKS = 2
"""Blocks in a row a rank must stand out in before it asks for a window (once, until it stops)."""


def default_store() -> Any:
    """The default process group's store, or None before ``init_process_group`` (or without torch)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    except Exception:
        pass
    return None


class Schedule:
    """The next window's first step (``planned``), agreed through the job's store."""

    def __init__(
        self,
        *,
        window_s: float,
        window_steps: int,
        trigger_ratio: float,
        rank: int,
        world_size: int,
        job: str,
        store: Callable[[], Any] = default_store,
        clock: Callable[[], float] = time.monotonic,
        ready: threading.Event | None = None,
        budget: WindowBudget | None = None,
    ) -> None:
        self.window_s, self.window_steps, self.trigger_ratio = window_s, window_steps, trigger_ratio
        self.budget = budget
        """What windows cost and may cost (``profiler_hook.budget``; None: unbounded)."""
        self.role = 0
        """This rank's role, a number (its pipeline stage + 1; 0: none): a rank stands out only
        against the sampled ranks of its own role (the hook sets it once it sees a mesh)."""
        self.rank, self.world_size = rank, world_size
        self.planned = -1
        """The step the next window starts at (-1: none); the training thread compares against it."""
        self.stacks = True
        """Whether that window records Python stacks (windows that look for a cause: see above)..."""
        self.steps = window_steps
        """...and how many steps it profiles (fewer where windows cost much: the budget)."""
        self.plans = 0
        self.missed = 0
        """Windows this rank learnt of only after their step had passed."""
        self.asking = False
        """This rank's trigger fired (or a caller asks for a window) and the request is not sent yet."""
        self.requests_read = 0
        """The ranks' requests for a window rank 0 has read from the job's store."""
        self._store_fn, self._clock = store, clock
        self._key, self._req_key = f"rankscope/{job}/window", f"rankscope/{job}/requests"
        self._ready_key = f"rankscope/{job}/ready"
        self._missed_key = f"rankscope/{job}/missed"
        self._rates_key, self._peers_key = f"rankscope/{job}/rates/", f"rankscope/{job}/peer_rates"
        self._standing_key = f"rankscope/{job}/standing_out"
        """How many ranks stand out now: while any does, every window records stacks."""
        self._sample = sorted(
            {i * world_size // min(SAMPLE, world_size) for i in range(min(SAMPLE, world_size))}
        )
        self._rates: tuple[float, float] | None = None
        """This rank's own time and CPU time per step (µs) in its last block..."""
        self._published: tuple[float, float] | None = None
        """...and the rates it last published and compared."""
        self.spent_ns = 0
        """What the windows cost the rank that measured the most, of the ranks rank 0 gathers."""
        self._pending = False
        """Rank 0: a window was asked for (and not in a cooldown); it waits for the budget."""
        self._compare_warned = False
        self._standing_out = 0
        """Comparisons in a row in which this rank stood out (counted past ``STAND_OUT_BLOCKS``
        without asking again, until it stops)."""
        self._lead_s = LEAD_S
        self._known: set[str] = set()
        """The keys this rank has found in the store ``_known_in`` (:meth:`_exists`)."""
        self._known_in: Any = None
        self._ready = ready
        """Set when this rank's profiler can start without stalling; rank 0 plans no window until
        every rank has said so, or a rank still warming up would miss windows the others take."""
        self._ready_sent = self._all_ready = False
        self._means: deque[float] = deque(maxlen=TRIGGER_HISTORY)
        """Mean step time (ns) of each of the last buckets of ``TRIGGER_BUCKET_S``."""
        self._own_means: deque[float] = deque(maxlen=TRIGGER_HISTORY)
        """The same for this rank's own time per step (outside collectives)."""
        self._bucket_ns = self._bucket_own_ns = self._bucket_n = 0
        self.recent: deque[int] = deque(maxlen=LEAD_STEPS)
        """The last steps' durations (ns), those a window disturbed left out."""
        self._last_plan = clock()
        self._last_trigger = -math.inf
        self._follow_ups = FOLLOW_UPS
        """Windows still due ``TRIGGER_COOLDOWN_S`` apart. At the start too: a fault present from the
        first step makes no jump to trigger on, and short jobs would otherwise wait ``window_s``."""
        self._seen = -1
        self._warned = False
        self._paused_at: float | None = None
        self._lock = threading.Lock()

    def pause(self) -> None:
        """Stop the clock (and planning) until :meth:`resume`."""
        with self._lock:
            self._paused_at = self._clock()
            if self.budget is not None:
                self.budget.pause()

    def resume(self) -> None:
        with self._lock:
            if self._paused_at is not None:
                self._last_plan += self._clock() - self._paused_at
                self._paused_at = None
                if self.budget is not None:
                    self.budget.resume()

    # --- the training thread -------------------------------------------------------------------

    def note_step(self, dur_ns: int, own_ns: int | None = None, disturbed: bool = False) -> None:
        """Record a finished step (``own_ns``: its time outside collectives); at the end of each
        bucket, ask for a window if the step time jumped (each of the last ``TRIGGER_RECENT``
        buckets ``trigger_ratio`` times the median of the ones before) or this rank's own time did
        (``TRIGGER_OWN_RATIO``). A step a window ``disturbed`` counts for nothing: a window must
        not call the next."""
        if disturbed:
            return
        self.recent.append(dur_ns)
        self._bucket_ns += dur_ns
        self._bucket_own_ns += dur_ns if own_ns is None else own_ns
        self._bucket_n += 1
        if self._bucket_ns < TRIGGER_BUCKET_S * 1e9:
            return
        self._means.append(self._bucket_ns / self._bucket_n)
        self._own_means.append(self._bucket_own_ns / self._bucket_n)
        self._bucket_ns = self._bucket_own_ns = self._bucket_n = 0
        if self.trigger_ratio and (
            _jumped(self._means, self.trigger_ratio) or _jumped(self._own_means, TRIGGER_OWN_RATIO)
        ):
            self.asking = True

    def note_block(self, own_us: float, cpu_us: float) -> None:
        """A step block ended: its own time and CPU time per step (µs), compared with the peers'."""
        self._rates = (own_us, cpu_us)

    # --- the background thread -----------------------------------------------------------------

    def poll(self, step: int) -> None:
        """Send this rank's request, make (rank 0) or read the plan. Never raises."""
        try:
            with self._lock:
                self._poll(step)
        except Exception as exc:
            if not self._warned:
                self._warned = True
                log.warning("rankscope: window schedule unavailable (%s: %s)", type(exc).__name__, exc)

    def _poll(self, step: int) -> None:
        if not self.window_s or step < 0 or self._paused_at is not None:
            return
        store = self._store_fn() if self.world_size > 1 else None
        if self.world_size > 1 and store is None:
            return  # no process group yet: ranks could not agree
        if self._ready is not None and not self._ready_sent:
            if not self._ready.is_set():
                return
            if store is not None:
                store.add(self._ready_key, 1)
            self._ready_sent = True
        if store is not None and self.trigger_ratio:
            try:
                self._compare(store)
            except Exception as exc:  # windows are planned without it
                if not self._compare_warned:
                    self._compare_warned = True
                    log.warning("rankscope: ranks' rates not compared (%s: %s)", type(exc).__name__, exc)
        if self.rank != 0 and store is not None:
            if self.asking:
                store.add(self._req_key, 1)
                self.asking = False
            if self._exists(store, self._key):
                first, stacks, steps = [*store.get(self._key).decode().split(":"), ""][:3]
                if not self._adopt(int(first), step, stacks != "0", int(steps or self.window_steps)):
                    store.add(self._missed_key, 1)
            return
        if self.planned >= 0 and self.planned + self.steps > step:
            return  # a window is planned or running: requests wait for it to end, not dropped
        if store is not None and self._ready is not None and not self._all_ready:
            if store.add(self._ready_key, 0) < self.world_size:
                return  # some rank is not ready to profile yet
            self._all_ready = True
        now = self._clock()
        requests = store.add(self._req_key, 0) if store is not None else 0
        if (self.asking or requests > self.requests_read) and now - self._last_trigger >= TRIGGER_COOLDOWN_S:
            self._pending = True
        self.asking, self.requests_read = False, requests
        asked = self._pending
        follow_up = self._follow_ups > 0 and now - self._last_plan >= TRIGGER_COOLDOWN_S
        if not (asked or follow_up or now - self._last_plan >= self.window_s):
            return
        standing = store is not None and store.add(self._standing_key, 0) > 0
        stacks = asked or follow_up or standing or self.plans < FOLLOW_UPS
        steps, budget = self.window_steps, self.budget
        if budget is not None:
            if budget.measuring:
                return  # the last window's cost is not known yet
            # The first window measures what one costs. Python stacks where a step with them costs
            # no more than an interval buys: the window waits for room for them rather than spend
            # it on one without (which would leave none for them). Else operators and kernels.
            stacks = stacks and budget.affordable(True, self.window_s, self.spent_ns)
            steps = budget.fit(stacks, self.window_steps, self._step_s(), self.window_s, self.spent_ns)
            if not steps:
                return  # it waits until the windows so far have paid for it; a request stays
        if asked:
            self._last_trigger, self._follow_ups, self._pending = now, FOLLOW_UPS, False
        elif follow_up:
            self._follow_ups -= 1
        if store is not None:
            self._lead_s = LEAD_S * 2 ** min(
                store.add(self._missed_key, 0), int(math.log2(MAX_LEAD_S / LEAD_S))
            )
        first = step + self._lead()
        self._last_plan = now
        if store is not None:
            store.set(self._key, f"{first}:{int(stacks)}:{steps}")
        self._adopt(first, step, stacks, steps)

    def _compare(self, store: Any) -> None:
        """Once a block: publish this rank's rates, (rank 0) gather the sample's, and ask for a
        window when this rank has stood out from the others in the sample ``STAND_OUT_BLOCKS``
        blocks in a row."""
        rates = self._rates
        if rates is None or rates is self._published:
            return
        self._published = rates
        cost_us = self.budget.spent_ns // 1000 if self.budget is not None else 0
        store.set(f"{self._rates_key}{self.rank}", f"{rates[0]:.1f},{rates[1]:.1f},{cost_us},{self.role}")
        keys = [f"{self._rates_key}{r}" for r in self._sample]
        gathered = ""
        if self.rank == 0 and store.check(keys):  # every sampled rank has ended a block
            values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
            gathered = ";".join(f"{r}:{v.decode()}" for r, v in zip(self._sample, values, strict=True))
            store.set(self._peers_key, gathered)
        if not (gathered or self._exists(store, self._peers_key)):
            return
        peers, spent = [], 0.0
        for entry in (gathered or store.get(self._peers_key).decode()).split(";"):
            r, _, v = entry.partition(":")
            values = tuple(map(float, v.split(",")))
            spent = max([spent, *values[2:3]])
            if int(r) != self.rank and values[3:4] == (float(self.role),):  # a rank of the same role
                peers.append(values)
        self.spent_ns = int(spent * 1000)
        if not peers:
            return
        own, cpu = (statistics.median(p[i] for p in peers) for i in (0, 1))
        if rates[0] >= STAND_OUT_OWN * own or rates[1] >= STAND_OUT_CPU * cpu > 0:
            self._standing_out += 1
            if self._standing_out == STAND_OUT_BLOCKS:
                self.asking = True
                store.add(self._standing_key, 1)
        else:
            if self._standing_out >= STAND_OUT_BLOCKS:
                store.add(self._standing_key, -1)
            self._standing_out = 0

    def _exists(self, store: Any, key: str) -> bool:
        """Whether ``key`` is in the store: asked until it is once (keys are never deleted), so
        that a poll then makes one request for it, not two (see ``POLL_S``). A new store (a
        process group made again) has none of them: a ``get`` of a missing key waits for it."""
        if store is not self._known_in:
            self._known_in, self._known = store, set()
        if key not in self._known:
            if not store.check([key]):
                return False
            self._known.add(key)
        return True

    def _step_s(self) -> float:
        """The recent step time (s): the median of the last steps (``LEAD_S`` before any)."""
        return statistics.median(self.recent) / 1e9 if self.recent else LEAD_S

    def _lead(self) -> int:
        """Steps in the lead (``LEAD_S``, longer after misses) at the recent step time (at least 2)."""
        return max(2, math.ceil(self._lead_s / max(self._step_s(), 1e-6)))

    def _adopt(self, first: int, step: int, stacks: bool, steps: int) -> bool:
        """Take the plan ``first`` (with Python ``stacks`` or not, of ``steps``); False if it is new
        and its step has passed (a miss)."""
        if first == self._seen:
            return True
        self._seen = first
        if first <= step:
            self.missed += 1
            return False
        self.stacks, self.steps = stacks, steps  # before ``planned``: read once that matches
        self.planned = first
        self.plans += 1
        return True


def _jumped(means: deque[float], ratio: float) -> bool:
    """Each of the last ``TRIGGER_RECENT`` buckets at least ``ratio`` times the median of the ones
    before (once ``TRIGGER_HISTORY`` buckets are known)."""
    if len(means) < TRIGGER_HISTORY:
        return False
    m = list(means)
    return min(m[-TRIGGER_RECENT:]) >= ratio * statistics.median(m[:-TRIGGER_RECENT])
