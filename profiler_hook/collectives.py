"""Always-on collective tracking: per-process-group sequence numbers, arrival and completion times.

Like PyTorch's Flight Recorder, every collective a rank enters gets the next sequence number of
its process group; ranks of a healthy job enter the same sequence numbers in the same order, so
the first number a rank never entered names the rank a hang waits for. Unlike Flight Recorder
this state is always shipped (on heartbeats), not dumped only at the watchdog timeout.

Tracking wraps the public ``torch.distributed`` collective and point-to-point functions, which is
where plain calls, FSDP and FSDP2 (``fully_shard``) and pipeline schedules pass, and the functional
collectives' Python entry points (``torch.distributed._functional_collectives``), which is where
tensor parallelism's DTensor launches its all-reduces, all-gathers and reduce-scatters inside
forward and backward; DDP's gradient all-reduces, launched from C++, are timed once per backward
pass by :mod:`profiler_hook.ddp`. A blocking call is timed by its wrapper; an asynchronous one
(``async_op=True``) by its work's future, which on gloo completes when the collective has
finished; a point-to-point call's work and a functional collective's tensor where the thread waits
for them (``Work.wait``, ``wait_tensor``). Every other collective — DDP's, and those launched from
C++ by a functional collective's backward, by ``ProcessGroup`` methods called directly or by an
extension, by a collective function called through a name bound before the hook patched it — is
counted and numbered from c10d's own per-group sequence number, which every collective launched
on a group advances: the step rows count them once per block (:meth:`CollectiveTracker.catch_up`);
DDP's are timed per backward pass, the others where the training thread waits on their work.
Heartbeats report c10d's numbers (:func:`c10d_seqs`), so a rank that never launched the
collective its peers wait in is named whatever launched it. At most steps (those that neither read
the run-queue wait nor record a window) a blocking call and a point-to-point one are only noted as
made and their waits timed; the step's end counts and numbers them (:attr:`CollectiveTracker.noted`).
Flight Recorder itself is not read always-on: on gloo it has no completion times, and one dump of
its 2,000-entry ring holds the GIL for ~30 ms.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rankscope.wire.records import PIPELINE_DIMS

log = logging.getLogger(__name__)

WAIT_EVERY_NS = 100_000_000
"""The training thread's run-queue wait is read at the collectives of one step in every 100 ms at
most (every step, where steps take longer), and less often where a step's calls are many, so that
the reads take ``WAIT_READ_SHARE`` of the time at most. A read step also reads the whole step's
wait and CPU time, and a block of steps counts as its wait outside collectives the read steps'
share of its time off the CPU there (``blocks.StepBlocks``): never more than all of its wait.
All of a step's calls are read, not a sample of calls: a call picked by when it comes is not
picked in proportion to its time, and the share came out wrong. Fewer read
steps miss by more: on shared cores, read at one step a second, a healthy rank's own time spread
0.11-0.19 from chunk to chunk of steps (0.02-0.10 at one step in 100 ms, 0.01-0.02 at every step).
Counted at the share of the collectives' time (not of the wait) the read steps waited, a read step
whose collectives waited long for a CPU counted more wait inside the block's collectives than the
block waited in all, and its rank's own time read 1.3-1.5x its peer's (DeepSpeed's healthy
pipeline: a false ticket)."""
WAIT_READ_NS = 20_000
"""A read: one ``pread`` of the kernel's schedstat, ~1.5 µs in a loop but ~20 µs in a training step,
whose tensors have left the caches cold (a DDP job on shared cores: median 22 µs, mean 28-64 µs)."""
WAIT_READ_SHARE = 0.0005
"""The most of the time the calls' reads take (a read step reads twice more, where it begins and
ends): a pipeline-parallel job's steps of 15 calls, each read twice, are read one a second; a DDP
job's, one in 100 ms."""

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
)
P2P = ("send", "recv", "isend", "irecv")
"""Point-to-point calls (what ``torch.distributed.pipelining``'s schedules issue, through
``batch_isend_irecv`` and ``P2POp`` too): numbered with the group's collectives, as c10d numbers
them on gloo, and timed where the thread waits for the peer: inside ``send``/``recv``, and in the
``wait()`` of an ``isend``/``irecv``'s work (gloo's have no future)."""
FUNCTIONAL = (
    "all_reduce",
    "all_gather_single",
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "broadcast",
)
"""Functional collectives (``torch.distributed._functional_collectives``; those a release lacks are
skipped): each launches one collective and returns a tensor that ``wait_tensor`` waits on, at its
first use (DTensor) or at once."""
_FUNCOL = "torch.distributed._functional_collectives"
STAGE_RUNNERS = (
    ("torch.distributed.pipelining.stage", "_PipelineStageBase", "forward_one_chunk", "stage_index"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine", "train_batch", "stage_id"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine", "eval_batch", "stage_id"),
)
"""Where a pipeline says which stage a rank runs where no device mesh does: (module, class, a
method called once per microbatch or step, the attribute of its object that holds the stage's
index). ``torch.distributed.pipelining``'s stages; DeepSpeed's ``PipelineEngine``, whose
``PipelineModule`` makes its own process groups."""
_STAGE_KEYS = {f"{m}.{c}.{f}": (m, c, f) for m, c, f, _ in STAGE_RUNNERS}
MAX_AWAITED = 4096
"""Calls kept until the thread waits on them (``isend``/``irecv`` works, functional collectives'
tensors); the oldest go first (a job that never waits)."""


def _keep(waits: dict[int, Any], key: int, value: Any) -> None:
    """``waits[key] = value``, at most ``MAX_AWAITED`` kept: the oldest was never waited on."""
    waits[key] = value
    if len(waits) > MAX_AWAITED:
        del waits[next(iter(waits))]


@dataclass(slots=True)
class CollectiveCall:
    group: str
    op: str
    seq: int
    nbytes: int
    enter_ns: int
    """``time.perf_counter_ns`` when this rank issued it: its arrival."""
    dur_ns: int = -1
    """Until it completed on this rank (-1 while in flight): the wait for the last rank + transfer."""
    blocking: bool = True
    """The calling thread waited inside the call (False: ``async_op=True``, waited on later)."""
    enter_wait_ns: int = 0
    """The training thread's run-queue wait so far when it was issued (-1: not read, see
    ``WAIT_EVERY_NS``)..."""
    wait_ns: int = 0
    """...and how much it grew until the call completed: the part of ``dur_ns`` the training
    thread spent waiting for a CPU (counted in the step's collective time, not in its own)."""
    peer: int = -1
    """A point-to-point call's peer (global rank; -1: a collective, or a ``recv`` from any rank)."""


def _nbytes(obj: Any) -> int:
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return int(getattr(obj, "nbytes", 0))  # a tensor's: one C call, where size x count were two


def group_name(group: Any) -> str:
    if group is None:
        return "world"
    from torch.distributed.distributed_c10d import GroupMember

    if group is GroupMember.WORLD:  # DDP passes the default group by name: the same sequence
        return "world"
    return str(getattr(group, "group_name", "") or id(group))


def c10d_seqs(unnumbered: set[str] | None = None) -> dict[str, int]:
    """c10d's sequence number of every process group this rank belongs to: the collectives launched
    on the group so far, from Python or C++ alike. Groups whose backend has none are left out, and
    named in ``unnumbered``."""
    try:
        from torch.distributed import distributed_c10d

        groups = list(distributed_c10d._world.pg_names)
    except Exception:  # no torch.distributed, or a group created meanwhile on another thread
        return {}
    seqs = {}
    pg: Any
    for pg in groups:
        try:
            seqs[group_name(pg)] = int(pg._get_sequence_number_for_group())
        except Exception:
            if unnumbered is not None:
                unnumbered.add(group_name(pg))
    return seqs


def process_groups() -> list[tuple[str, str]]:
    """(name, backend) of every process group this rank belongs to, the default one first; for any
    thread (a group made meanwhile on another is seen at the next call)."""
    try:
        from torch.distributed import distributed_c10d

        world = distributed_c10d._world
        return [(group_name(pg), _backend_of(pg, str(world.pg_map[pg][0]))) for pg in list(world.pg_names)]
    except Exception:  # no torch.distributed, or a group changed meanwhile
        return []


def _backend_of(pg: Any, said: str) -> str:
    """A group's backend: c10d records "undefined" for a group made without one named (as
    ``init_device_mesh`` makes the default group); the process group knows which it chose."""
    if said != "undefined":
        return said
    try:
        return str(pg.name())
    except Exception:
        return said


MEGATRON_GROUPS = {
    "DATA_PARALLEL_GROUP": "dp",
    "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "CONTEXT_PARALLEL_GROUP": "cp",
    "EXPERT_MODEL_PARALLEL_GROUP": "ep",
}
"""Megatron-LM's process groups (``megatron.core.parallel_state`` describes each group it makes,
``group_desc``), by the dimension of the job's parallelism they span."""


def mesh_coordinates(stages: Iterable[int] = ()) -> dict[str, int]:
    """This rank's coordinate on each named dimension of the job's parallelism: ``DeviceMesh``
    gives the process group of each dimension the description ``mesh_<name>`` and orders its ranks
    along it (a dimension that spans the whole job uses the default group, and is not named);
    Megatron-LM, without a mesh, describes its groups by name (``MEGATRON_GROUPS``), each ordered
    along its dimension too. Where neither says a pipeline dimension, the pipeline stages the rank
    ran (``stages``, ``CollectiveTracker.stages``) do: ``pp`` is the first one's index (a rank that
    runs several, as interleaved schedules do, runs stages i, i + P, ...)."""
    coords = _named_coordinates()
    # tuple() copies the set in one C call: the training thread may add a stage meanwhile.
    known = [s for s in tuple(stages) if s >= 0]
    if known and not any(d in PIPELINE_DIMS for d in coords):
        coords["pp"] = min(known)
    return coords


def _named_coordinates() -> dict[str, int]:
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        me, coords = dist.get_rank(), {}
        for pg in list(distributed_c10d._world.pg_names):
            desc = str(getattr(pg, "group_desc", "") or "")
            if desc.startswith("mesh_") and desc != "mesh_default":
                dim = desc.removeprefix("mesh_")
            elif (dim := MEGATRON_GROUPS.get(desc, "")) == "":
                continue
            ranks = dist.get_process_group_ranks(pg)
            if me in ranks:
                coords[dim] = ranks.index(me)
        return coords
    except Exception:  # no torch.distributed, or a group made meanwhile on another thread
        return {}


def _wait_key(on: Any) -> int:
    """What a wait is matched to its call by: a work itself; a tensor's storage, since DTensor
    waits on a view of the tensor a functional collective returned (a view of an
    ``AsyncCollectiveTensor`` is one too)."""
    storage = getattr(on, "untyped_storage", None)
    return int(storage().data_ptr()) if storage is not None else id(on)


def _position(fn: Any, name: str) -> int:
    """Index of parameter ``name`` of ``fn`` when passed positionally (-1 if it has none)."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return -1
    return params.index(name) if name in params else -1


def _arg(args: tuple, kwargs: dict, name: str, pos: int) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[pos] if 0 <= pos < len(args) else None


@dataclass(frozen=True, slots=True)
class _Site:
    """A wrapped function: the name its calls are recorded under, and where a call's arguments
    give its group and its peer (a point-to-point call's)."""

    op: str
    group_pos: int
    peer: tuple[str, str, int] = ("", "", -1)
    """A point-to-point call's peer parameter, its group-rank twin and the first's position."""

    def note(self, args: tuple, kwargs: dict, start_ns: int) -> Noted:
        """A call: its group and peer as given (no tensor: a note must not keep one alive)."""
        group = _arg(args, kwargs, "group", self.group_pos)
        name, group_name, pos = self.peer
        if not name:
            return (self, group, None, None, start_ns)
        return (self, group, _arg(args, kwargs, name, pos), kwargs.get(group_name), start_ns)


Noted = tuple[_Site, Any, Any, Any, int]
"""A call as a wrapper noted it (:meth:`_Site.note`): its function, its group and its peer as
given (as a global rank, or as a rank of the group) and where it, or the wait for it, started
(``time.perf_counter_ns``)."""

MAX_NOTED = 1024
"""Calls noted at most before they are counted, where no step ends (a loop the hook does not see)."""


def _noting_stage(run: Any, attribute: str, stages: set[int]) -> Any:
    """``run`` (a pipeline stage's or engine's method), first adding its object's stage index
    (``attribute``) to ``stages``."""

    @functools.wraps(run)
    def noting(stage: Any, *args: Any, **kwargs: Any) -> Any:
        stages.add(getattr(stage, attribute, -1))
        return run(stage, *args, **kwargs)

    return noting


class _Inside(threading.local):
    """Per thread: inside a wrapped call (its inner calls are not counted again), and the
    functional collective it is launching. Class attributes, so that a thread reads them without a
    missed attribute's exception: ~0.5 µs a read, where this is ~0.1."""

    inside = False
    launching: CollectiveCall | None = None


@dataclass(slots=True)
class CollectiveTracker:
    """Counts, sequences and times collectives; read by the step accounting and the watchdog."""

    last_seq: dict[str, int] = field(default_factory=dict)
    current: CollectiveCall | Noted | None = None
    """The blocking call the training thread is inside now (as noted, at a lean step:
    :meth:`oldest_inflight` reads it)."""
    inflight: dict[tuple[str, int], CollectiveCall] = field(default_factory=dict)
    """Asynchronous calls launched and not yet complete, oldest first."""
    last_exit_ns: int = 0
    active: bool = False
    """Patched: measuring (False while the hook is paused or closed)."""
    counted: dict[str, int] = field(default_factory=dict)
    """Per group, the collectives counted so far: by the wrapped functions and by :meth:`catch_up`
    (never reset)."""
    _c10d: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per group, c10d's sequence number and ``counted`` at the last :meth:`catch_up` (or patch)."""
    unnumbered: set[str] = field(default_factory=set)
    """Groups c10d does not number (found by :meth:`catch_up`, logged once)."""
    steps: int = 0
    """Steps taken (``take_step`` calls)."""
    # Per-step accumulators, reset by take_step().
    step_comm_ns: int = 0
    step_count: int = 0
    step_first_enter_ns: int = -1
    step_last_async: CollectiveCall | None = None
    step_comm_wait_ns: int = 0
    step_gpu_ns: int = 0
    """GPU time of the NCCL collectives completed since the last step (:mod:`profiler_hook.nccl`)."""
    _step_wait_mark: int = -1
    """The run-queue wait where this step began, where it reads the wait (-1: not read)."""
    read_wait: bool = False
    """This step's collectives read the run-queue wait (see ``WAIT_EVERY_NS``): from the second
    step on, where the step before it marks where it begins."""
    _next_wait_read_ns: int = 0
    _step_start_ns: int = 0
    """Where this step began (the last :meth:`take_step`'s ``now_ns``): the next read is counted from
    a read step's start, so that where steps take longer than ``WAIT_EVERY_NS`` each step reads."""
    thread_wait: Callable[[], int] = lambda: 0
    """The training thread's run-queue wait so far, ns (``schedstat.ThreadWait``)."""
    thread_cpu: Callable[[], int] = time.thread_time_ns
    """The training thread's CPU time so far, ns: read where a read step begins and ends."""
    _step_cpu_mark: int = -1
    """The CPU time where this step began, where it reads the wait (-1: not read)."""
    # Calls recorded while a profiling window is open.
    recording: list[CollectiveCall] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _originals: dict[str, Any] = field(default_factory=dict)
    _local: _Inside = field(default_factory=_Inside)
    stages: set[int] = field(default_factory=set)
    """The indices of the ``torch.distributed.pipelining`` stages this rank ran a microbatch of
    (:meth:`_watch_stages`): its place in a pipeline where no device mesh says it."""
    noted: list[Noted] = field(default_factory=list)
    """The calls of this step, where it is lean: one that neither reads the run-queue wait nor
    records a window. There a wrapper only notes a call (its function, group, peer and start) and
    times the wait in it, or in its work's ``wait()``; :meth:`take_step` counts and numbers them,
    and a hang's heartbeat reads the one the thread is in. The wrappers' Python runs from cold
    caches inside a training step, where each object it touches costs: noting a call makes fewer
    of them than recording it (``benchmarks.overhead.calls`` measures both)."""
    _noted_awaited: dict[int, Noted] = field(default_factory=dict)
    """The ``isend``/``irecv`` works launched at a lean step, by ``id``, until the thread waits on them."""
    _awaited: dict[int, CollectiveCall] = field(default_factory=dict)
    """Calls by what the thread will wait on (an ``isend``/``irecv``'s work: its ``id``; a
    functional collective's tensor: :func:`_wait_key`), until it does."""
    _launched: dict[int, None] = field(default_factory=dict)
    """The ``id`` of each asynchronous collective's work that a wrapper launched and times to its
    completion, until the thread waits on it (if ever)."""
    training_thread: int = field(default_factory=threading.get_ident)
    """The thread that made the tracker (the hook's, at ``attach``): the one whose step it times."""
    _names: dict[Any, str] = field(default_factory=dict)
    """The name of each process group a wrapped call was given (:meth:`name_of`)..."""
    _peers: dict[tuple[Any, int], int] = field(default_factory=dict)
    """...and the global rank of each peer a point-to-point call named by its rank in a group;
    both kept while patched (a destroyed group's object is let go at :meth:`unpatch`)."""

    def enter(
        self, group: str, op: str, nbytes: int, blocking: bool = True, peer: int = -1, awaited: bool = False
    ) -> CollectiveCall:
        """A call issued; an asynchronous point-to-point one (``peer`` >= 0) or a functional
        collective (``awaited``) is timed where the thread waits on it (:meth:`waited`), not
        tracked in flight meanwhile: the thread computes while it runs."""
        now = time.perf_counter_ns()
        # No lock: a group's calls come from one thread at a time (c10d orders them by issue), and
        # the watchdog only copies the dict. Positional arguments, and _wait_mark() inlined (here
        # and in begin_wait): this runs at every wrapped call, ~2 µs of Python in all.
        seq = self.last_seq.get(group, 0) + 1
        self.last_seq[group] = seq
        wait = -1  # one timed where the thread waits on it reads the run-queue wait there
        if self.read_wait and (blocking or not (awaited or op in ("send", "recv"))):
            wait = self.thread_wait()
        call = CollectiveCall(group, op, seq, nbytes, now, -1, blocking, wait, 0, peer)
        if blocking:
            self.current = call
        elif op not in ("send", "recv") and not awaited:
            self.inflight[(group, seq)] = call
            self.step_last_async = call
        if self.step_first_enter_ns < 0:
            self.step_first_enter_ns = now
        self.step_count += 1
        self.counted[group] = self.counted.get(group, 0) + 1
        return call

    def sync(self, group: str, nbytes: int, now: int) -> CollectiveCall:
        """The training thread starts waiting for collectives launched from C++ (DDP's buckets),
        counted and numbered at the block's end by :meth:`catch_up` (heartbeats number the call as
        c10d does). It waits as in a blocking call, and this wait supersedes the last asynchronous
        call's (a user's DDP hook's)."""
        seq = self.last_seq.get(group, 0)
        call = CollectiveCall(group, "all_reduce", seq, nbytes, now, enter_wait_ns=self._wait_mark())
        if self.step_first_enter_ns < 0:
            self.step_first_enter_ns = now
        if self.step_last_async is not None and self.step_last_async.group == group:
            self.step_last_async = None
        self.current = call
        return call

    def add_gpu(self, ns: int) -> None:
        """An NCCL collective completed after ``ns`` of GPU time (on c10d's hook thread): counted in
        the step that ends next, as the time the rank waited in collectives (not while paused)."""
        if not self.active:
            return
        with self._lock:
            self.step_gpu_ns += ns

    def catch_up(self) -> int:
        """Count the collectives launched on each process group since the last call that no other
        path counted (see the module's docstring), number them as c10d does, and return how many.
        Once per step block: c10d's number costs ~17 µs a read inside a training step."""
        if self.active:
            self._patch_functional()
            self._watch_stages()
        self.count_noted()  # counted by the wrappers, not by c10d's numbers alone
        extra, unnumbered = 0, set[str]()
        seqs = c10d_seqs(unnumbered)
        if unnumbered - self.unnumbered:
            self.unnumbered |= unnumbered
            log.warning(
                "rankscope: process groups %s have no sequence numbers (backend without them): "
                "collectives launched on them from C++ are not counted",
                sorted(unnumbered),
            )
        for group, seq in seqs.items():
            counted = self.counted.get(group, 0)
            base_seq, base_counted = self._c10d.get(group, (0, 0))  # a group new since: all of it
            if (n := (seq - base_seq) - (counted - base_counted)) > 0:
                extra += n
                counted = self.counted[group] = counted + n
            self._c10d[group] = (seq, counted)
            if seq > self.last_seq.get(group, 0):  # no lock, as in enter(): the same thread
                self.last_seq[group] = seq
        return extra

    def entered(self) -> dict[str, int]:
        """Per group, the last call the wrappers saw this rank enter: those numbered, and this
        step's noted ones (:attr:`noted`). For any thread."""
        seqs = dict(self.last_seq)
        for note in list(self.noted):  # a copy: the training thread adds to it
            group = self.name_of(note[1])
            seqs[group] = seqs.get(group, 0) + 1
        return seqs

    def seqs(self) -> dict[str, int]:
        """Per group, the last collective this rank entered: c10d's number where it is further on
        (collectives launched from C++ since the last :meth:`catch_up`). For any thread."""
        seqs = self.entered()
        for group, seq in c10d_seqs().items():
            if seq > seqs.get(group, 0):
                seqs[group] = seq
        return seqs

    def _wait_mark(self) -> int:
        """The run-queue wait so far, where this step reads it; -1 where it does not."""
        return self.thread_wait() if self.read_wait else -1

    def name_of(self, group: Any) -> str:
        """:func:`group_name`, remembered per group object."""
        name = self._names.get(group)
        if name is None:
            name = self._names[group] = group_name(group)
        return name

    def peer_of(self, group: Any, group_peer: int) -> int:
        """The global rank of rank ``group_peer`` of ``group`` (None: the default group)."""
        key = (group, group_peer)
        peer = self._peers.get(key)
        if peer is None:
            import torch.distributed as dist

            peer = group_peer if group is None else dist.get_global_rank(group, group_peer)
            self._peers[key] = peer
        return peer

    def exit(self, call: CollectiveCall) -> None:
        """A call completed: a blocking one returned, or an asynchronous one's future finished."""
        now = time.perf_counter_ns()
        call.dur_ns = now - call.enter_ns
        if call.enter_wait_ns >= 0:
            call.wait_ns = max(0, self.thread_wait() - call.enter_wait_ns)
        self.last_exit_ns = now
        if call.blocking:
            self.current = None
            self.step_comm_ns += call.dur_ns
            if call.enter_wait_ns >= 0:
                self.step_comm_wait_ns += call.wait_ns
        else:
            self.inflight.pop((call.group, call.seq), None)
        recording = self.recording  # read once: the training thread may end the window meanwhile
        if recording is not None:
            recording.append(call)

    def expect_wait(self, key: int, call: CollectiveCall) -> None:
        """The thread will wait for ``call`` on what ``key`` names (a work's ``id``, a tensor's
        :func:`_wait_key`): see :meth:`waited`."""
        _keep(self._awaited, key, call)

    def waited(self, on: Any, wait: Callable[[], Any], call: CollectiveCall | None = None) -> Any:
        """``wait()`` on a functional collective's tensor ``on`` (``call``: one whose wait comes
        before its launch returned). The thread waits for its peers inside it, timed as a blocking
        call from there."""
        try:
            call = self._awaited.pop(_wait_key(on), call)
        except Exception:  # an object without a storage to read: tracking must never break the wait
            return wait()
        if call is None or call.dur_ns >= 0 or not self.active:
            return wait()
        self.begin_wait(call)
        try:
            return wait()
        finally:
            self.exit(call)

    def begin_wait(self, call: CollectiveCall) -> None:
        """The thread starts to wait for ``call``, launched earlier (an ``isend``/``irecv``, a
        functional collective): timed as a blocking call from here, until :meth:`exit`."""
        call.enter_ns, call.blocking = time.perf_counter_ns(), True
        call.enter_wait_ns = self.thread_wait() if self.read_wait else -1
        self.current = call

    def exit_on_completion(self, call: CollectiveCall, work: Any) -> None:
        """Complete ``call`` when its ``work``'s future does (on the thread that completes it); a
        wait on the work is then no wait to time (:meth:`wait_unwrapped`)."""
        work.get_future().add_done_callback(lambda _: self.exit(call))
        _keep(self._launched, id(work), None)

    def wait_unwrapped(self, work: Any, wait: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """``wait(work, *args, **kwargs)``, for a work whose launch no wrapper timed: a collective
        called through a name bound before the hook patched it (``from torch.distributed import
        all_reduce`` at the top of a training script: its blocking call waits here), or a
        ``ProcessGroup`` method called directly. On the training thread its wait is the rank's
        wait in collectives, counted in the step as a blocking call's (c10d's sequence numbers
        count the call itself: :meth:`catch_up`); unseen, it was the rank's own time, and a
        healthy rank that waited there longer than its peers read as slower than they
        (nanoGPT-shaped DDP on shared cores: 16.3 ms a step against 11.7-14.6 on its peers, at
        the same CPU time)."""
        timed_to_completion = self._launched.pop(id(work), False) is None
        if timed_to_completion or threading.get_ident() != self.training_thread:
            return wait(work, *args, **kwargs)
        enter, enter_wait = time.perf_counter_ns(), self._wait_mark()
        try:
            return wait(work, *args, **kwargs)
        finally:
            self.step_comm_ns += time.perf_counter_ns() - enter
            if enter_wait >= 0:
                self.step_comm_wait_ns += max(0, self.thread_wait() - enter_wait)

    def inside_noted(self, call: Noted, run: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``run(*args, **kwargs)``, a blocking call (or the wait for one) noted at a lean step:
        the thread is inside it until it returns, and the time is the step's wait in collectives."""
        local = self._local
        self.current, local.inside = call, True
        try:
            return run(*args, **kwargs)
        finally:
            now = time.perf_counter_ns()
            self.current, local.inside = None, False
            self.last_exit_ns = now
            self.step_comm_ns += now - call[4]

    def oldest_inflight(self) -> CollectiveCall | None:
        """The call the rank is waiting in now: the blocking one, else the oldest asynchronous one."""
        current = self.current  # read once: the training thread may leave it meanwhile
        if isinstance(current, tuple):
            return self._resolved(current)
        if current is not None:
            return current
        try:
            return next(iter(self.inflight.values()), None)
        except RuntimeError:  # changed size while iterating: another thread completed one
            return None

    def _resolved(self, note: Noted) -> CollectiveCall:
        """The call a lean step noted, as the full path records it (its bytes not known): numbered
        as the last its group entered so far (a heartbeat takes c10d's number where that is further
        on)."""
        site, pg, peer, group_peer, start_ns = note
        group = self.name_of(pg)
        seq = self.entered().get(group, 0)
        return CollectiveCall(group, site.op, seq, 0, start_ns, peer=self._peer(pg, peer, group_peer))

    def _peer(self, group: Any, peer: Any, group_peer: Any) -> int:
        """A point-to-point call's peer as a global rank (-1: none, or any rank)."""
        if peer is None and group_peer is not None:
            peer = self.peer_of(group, group_peer)
        return -1 if peer is None else int(peer)

    def note(self, note: Noted) -> None:
        """Note a call made at a lean step (:attr:`noted`)."""
        self.noted.append(note)
        if len(self.noted) >= MAX_NOTED:
            self.count_noted()

    def count_noted(self) -> None:
        """Count and number the calls noted so far, in the order they were made, into this step."""
        noted = self.noted
        if not noted:
            return
        n, first = len(noted), noted[0][4]
        for note in noted[:n]:
            group = self.name_of(note[1])
            self.last_seq[group] = self.last_seq.get(group, 0) + 1
            self.counted[group] = self.counted.get(group, 0) + 1
        del noted[:n]  # in place: the wrappers hold the list
        self.step_count += n
        if self.step_first_enter_ns < 0 or first < self.step_first_enter_ns:
            self.step_first_enter_ns = first

    def take_step(self, now_ns: int) -> tuple[int, int, int, int, int, int]:
        """(comm_ns, count, first_enter_ns, comm_wait_ns, step_wait_ns, step_cpu_ns) since the last call, then
        reset; ``now_ns`` (``time.perf_counter_ns``) decides whether the next step reads the wait.

        ``comm_ns`` is the time the rank waited in collectives: inside blocking calls, plus, for
        asynchronous ones, the last one's time from launch to completion — a DDP communication hook
        launches each bucket's all-reduce as soon as its gradients are ready, and DDP waits for all
        of them at the end of the backward pass, so the last bucket's time is what the step waited
        (for the slowest rank, and for the transfer); the earlier buckets overlap the backward pass.
        DDP's own wait, timed by :meth:`sync`, replaces it where measured. On NCCL, where the CPU
        waits for none of this, the GPU time of the collectives that completed since (:meth:`add_gpu`)
        is added: it arrives up to c10d's watchdog period late, so a block of steps counts it to
        within that at its edges. In a step that reads the run-queue wait (``WAIT_EVERY_NS``),
        ``comm_wait_ns`` is the training thread's wait for a CPU inside its collectives,
        ``step_wait_ns`` its wait in the whole step and ``step_cpu_ns`` its CPU time; -1 where it
        did not.
        """
        comm, comm_wait = self.step_comm_ns, self.step_comm_wait_ns
        if self.step_gpu_ns:
            with self._lock:
                comm, self.step_gpu_ns = comm + self.step_gpu_ns, 0
        last = self.step_last_async
        if last is not None and last.dur_ns >= 0:
            comm += last.dur_ns
            if last.enter_wait_ns >= 0:
                comm_wait += last.wait_ns
        mark = step_wait = cpu_mark = step_cpu = -1
        if self.read_wait and self._step_wait_mark >= 0:
            mark, cpu_mark = self.thread_wait(), self.thread_cpu()
            step_wait, step_cpu = mark - self._step_wait_mark, cpu_mark - self._step_cpu_mark
        self.count_noted()
        calls = self.step_count
        out = (comm, calls, self.step_first_enter_ns, comm_wait, step_wait, step_cpu)
        self.step_comm_ns, self.step_count, self.step_first_enter_ns = 0, 0, -1
        self.step_comm_wait_ns = 0
        if self.read_wait:  # each call read twice: where it starts and ends, or is waited on
            reads_ns = 2 * calls * WAIT_READ_NS / WAIT_READ_SHARE
            self._next_wait_read_ns = self._step_start_ns + max(WAIT_EVERY_NS, int(reads_ns))
        self.read_wait = now_ns >= self._next_wait_read_ns
        self._step_start_ns = now_ns
        self._step_wait_mark = (mark if mark >= 0 else self.thread_wait()) if self.read_wait else -1
        self._step_cpu_mark = (cpu_mark if cpu_mark >= 0 else self.thread_cpu()) if self.read_wait else -1
        self.step_last_async = None
        self.steps += 1
        return out

    def patch(self) -> None:
        """Wrap torch.distributed's collectives (idempotent)."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for op in (*COLLECTIVES, *P2P):
            original = getattr(c10d, op, None)
            if original is None or op in self._originals:
                continue
            self._originals[op] = original
            wrapped = self._wrap(op, original) if op in COLLECTIVES else self._wrap_p2p(op, original)
            setattr(c10d, op, wrapped)
            if getattr(dist, op, None) is original:
                setattr(dist, op, wrapped)
        if "Work.wait" not in self._originals and hasattr(dist, "Work"):
            self._originals["Work.wait"] = wait = dist.Work.wait
            awaited, tracker, local = self._awaited, self, self._local
            noted_awaited, perf = self._noted_awaited, time.perf_counter_ns

            def waited(work: Any, *args: Any, **kwargs: Any) -> Any:
                """An ``isend``/``irecv``'s work waited on: the thread waits for its peer here. Any
                other work the training thread waits on, outside a wrapped call, is one no wrapper
                saw launched: its wait is timed too (:meth:`CollectiveTracker.wait_unwrapped`)."""
                if noted_awaited and (launched := noted_awaited.pop(id(work), None)) is not None:
                    if not tracker.active:
                        return wait(work, *args, **kwargs)
                    return tracker.inside_noted((*launched[:4], perf()), wait, (work, *args), kwargs)
                call = awaited.pop(id(work), None) if awaited else None
                if call is None and tracker.active and not local.inside:
                    return tracker.wait_unwrapped(work, wait, args, kwargs)
                if call is None or call.dur_ns >= 0 or not tracker.active:
                    return wait(work, *args, **kwargs)
                tracker.begin_wait(call)
                try:
                    return wait(work, *args, **kwargs)
                finally:
                    tracker.exit(call)

            setattr(dist.Work, "wait", waited)  # noqa: B010 (a method of a C++ class: mypy refuses the plain form)
        self.active = True
        self._watch_stages()
        self.catch_up()  # what was launched until now (or while paused) belongs to no step

    def _patch_functional(self) -> None:
        """Wrap the functional collectives, once the job has imported them (DTensor, FSDP2 and
        tensor parallelism do; importing them here would cost a job without them its start-up):
        at :meth:`patch` and at each :meth:`catch_up` after it. Idempotent."""
        funcol = sys.modules.get(_FUNCOL)
        if funcol is None or _FUNCOL in self._originals or not hasattr(funcol, "wait_tensor"):
            return
        import torch
        import torch.distributed.distributed_c10d as c10d

        self._originals[_FUNCOL] = funcol
        for op in FUNCTIONAL:
            if (original := getattr(funcol, op, None)) is not None:
                self._originals[f"{_FUNCOL}.{op}"] = original
                setattr(
                    funcol, op, self._wrap_functional(op, original, funcol, c10d, torch.compiler.is_compiling)
                )
        self._originals[f"{_FUNCOL}.wait_tensor"] = wait = funcol.wait_tensor
        local = self._local

        @functools.wraps(wait)
        def wait_tensor(tensor: Any) -> Any:
            if torch.compiler.is_compiling():
                return wait(tensor)
            return self.waited(tensor, lambda: wait(tensor), local.launching)

        setattr(funcol, "wait_tensor", wait_tensor)  # noqa: B010 (a module mypy knows only as ModuleType)

    def _watch_stages(self) -> None:
        """Note the index of each pipeline stage this rank runs (``stages``), once the job has
        imported a pipeline's module (``STAGE_RUNNERS``; importing it here would cost every other
        job its start-up): a job that builds its pipeline without a device mesh, as PyTorch's own
        pipelining docs do (``PipelineStage(module, stage_index, num_stages, device)``) and as
        DeepSpeed's ``PipelineModule`` does, says where each rank sits only there. The method is
        wrapped on the class (``forward_one_chunk`` on torch 2.8 to 2.15, DeepSpeed's
        ``train_batch``), so stages made before the hook attached are seen too. At :meth:`patch`
        and at each :meth:`catch_up` after it. Idempotent."""
        for module, name, method, attribute in STAGE_RUNNERS:
            key = f"{module}.{name}.{method}"
            cls = getattr(sys.modules.get(module), name, None)
            original = getattr(cls, method, None)
            if key in self._originals or original is None:
                continue
            self._originals[key] = original
            setattr(cls, method, _noting_stage(original, attribute, self.stages))

    def unpatch(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.active = False
        funcol = self._originals.pop(_FUNCOL, None)
        for op, original in self._originals.items():
            if op == "Work.wait":
                setattr(dist.Work, "wait", original)  # noqa: B010
            elif op in _STAGE_KEYS:
                module, name, method = _STAGE_KEYS[op]
                setattr(getattr(sys.modules[module], name), method, original)
            elif op.startswith(_FUNCOL):
                setattr(funcol, op.removeprefix(_FUNCOL + "."), original)
            else:
                setattr(c10d, op, original)
                setattr(dist, op, original)
        self._originals.clear()
        self._awaited.clear()
        self._noted_awaited.clear()
        self._names.clear()
        self._peers.clear()

    def _wrap_functional(
        self, op: str, original: Any, funcol: Any, c10d: Any, compiling: Callable[[], bool]
    ) -> Any:
        """A functional collective: counted and numbered at launch on its group, timed where the
        thread waits on its result (:meth:`waited`; inside the launch for those that wait at
        once)."""
        tracker, local = self, self._local
        group_pos = _position(original, "group")

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # One user call is one collective: all_gather_tensor calls all_gather_single. Under
            # torch.compile the collective is traced into a graph, not run: nothing to time.
            if local.inside or not tracker.active or compiling():
                return original(*args, **kwargs)
            try:
                name = funcol._resolve_group_name(_arg(args, kwargs, "group", group_pos))
                group = tracker.name_of(c10d._resolve_process_group(name))
                tensor = args[0] if args else kwargs.get("self")
                call = tracker.enter(group, op, _nbytes(tensor), blocking=False, awaited=True)
            except Exception:  # tracking must never break the collective
                return original(*args, **kwargs)
            local.inside, local.launching = True, call
            try:
                out = original(*args, **kwargs)
            finally:
                local.inside, local.launching = False, None
            if call.dur_ns < 0:  # not waited on yet: an AsyncCollectiveTensor waits at first use
                with contextlib.suppress(Exception):  # tracking must never break the collective
                    tracker.expect_wait(_wait_key(getattr(out, "elem", out)), call)
            return out

        wrapper.__rankscope_original__ = original  # type: ignore[attr-defined]
        return wrapper

    def _wrap(self, op: str, original: Any) -> Any:
        tracker, local, perf = self, self._local, time.perf_counter_ns
        site, async_pos = _Site(op, _position(original, "group")), _position(original, "async_op")

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # One user call is one collective: all_gather_into_tensor calls all_gather_single.
            if local.inside:
                return original(*args, **kwargs)
            blocking = not _arg(args, kwargs, "async_op", async_pos)
            if blocking and not tracker.read_wait and tracker.recording is None:  # a lean step
                note = site.note(args, kwargs, perf())
                tracker.note(note)
                return tracker.inside_noted(note, original, args, kwargs)
            try:
                group = tracker.name_of(_arg(args, kwargs, "group", site.group_pos))
                call = tracker.enter(group, op, _nbytes(args[0]) if args else 0, blocking)
            except Exception:  # tracking must never break the collective
                return original(*args, **kwargs)
            local.inside = True
            work = None
            try:
                work = original(*args, **kwargs)
                return work
            finally:
                local.inside = False
                if blocking or work is None:
                    tracker.exit(call)
                else:
                    try:
                        tracker.exit_on_completion(call, work)
                    except Exception:  # no future (a backend without one): launch time only
                        tracker.exit(call)

        wrapper.__rankscope_original__ = original  # type: ignore[attr-defined]
        return wrapper

    def _wrap_p2p(self, op: str, original: Any) -> Any:
        tracker, local, blocking = self, self._local, op in ("send", "recv")
        awaited, perf = self._noted_awaited, time.perf_counter_ns
        params = ("dst", "group_dst") if op.endswith("send") else ("src", "group_src")
        site = _Site(
            op.removeprefix("i"), _position(original, "group"), (*params, _position(original, params[0]))
        )

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # One user call is one transfer: send and recv are isend and irecv waited on at once.
            if local.inside:
                return original(*args, **kwargs)
            if not tracker.read_wait and tracker.recording is None:  # a lean step
                note = site.note(args, kwargs, perf())
                tracker.note(note)
                if blocking:
                    return tracker.inside_noted(note, original, args, kwargs)
                work = original(*args, **kwargs)
                if work is not None:  # None: inside a coalescing manager (NCCL's batch_isend_irecv)
                    _keep(awaited, id(work), note)
                return work
            try:
                _, pg, peer, group_peer, _ = site.note(args, kwargs, 0)
                nbytes = _nbytes(args[0] if args else kwargs.get("tensor"))
                call = tracker.enter(
                    tracker.name_of(pg), site.op, nbytes, blocking, tracker._peer(pg, peer, group_peer)
                )
            except Exception:  # tracking must never break the call
                return original(*args, **kwargs)
            if blocking:
                local.inside = True
                try:
                    return original(*args, **kwargs)
                finally:
                    local.inside = False
                    tracker.exit(call)
            work = original(*args, **kwargs)
            if work is not None:  # None: inside a coalescing manager (NCCL's batch_isend_irecv)
                tracker.expect_wait(id(work), call)
            return work

        wrapper.__rankscope_original__ = original  # type: ignore[attr-defined]
        return wrapper
