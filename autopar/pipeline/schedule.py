"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B) and a discrete-event simulator.

A schedule is, per pipeline rank, the ordered list of compute actions the rank
runs: the forward (``F``) or backward (``B``) of one microbatch on one of its
model chunks. :func:`simulate` executes such lists the way a runtime with
blocking receives and non-blocking sends would, from per-stage forward /
backward times and a point-to-point transfer time, and returns a
:class:`Timeline` (when each action ran, how busy and how full each rank was).

Virtual stages: with ``chunks`` model chunks per rank the model is cut into
``V = pp * chunks`` consecutive stages and rank ``r`` holds stages
``r, r + pp, r + 2 pp, ...`` (Megatron's interleaving), so chunk ``c`` of rank
``r`` is virtual stage ``c * pp + r``. Without interleaving ``chunks == 1`` and
the virtual stage is the rank.

No torch: the planner simulates every candidate pipeline configuration, so
:func:`simulate` turns the actions into flat arrays with numpy, runs one event
loop over them, and builds :class:`Event` objects only when someone reads them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache, partial
from itertools import accumulate, chain
from operator import attrgetter

import numpy as np

from ..spec import PIPELINE_SCHEDULES as SCHEDULES, check_schedule   # the rules live with the strategy keys

KINDS = ("F", "B")
_HOLDS = {"F": 1, "B": -1}  # change in activations held when an action of each kind finishes


@dataclass(frozen=True)
class Action:
    """One compute step of a rank: forward (``F``) or backward (``B``) of one microbatch on one model chunk."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.microbatch < 0 or self.chunk < 0:
            raise ValueError(f"invalid {self}: kind must be one of {KINDS}, microbatch and chunk >= 0")

    def stage(self, rank: int, pp: int) -> int:
        """The virtual stage this action runs on when executed by ``rank`` of ``pp``."""
        return self.chunk * pp + rank


def build_schedule(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
    """Per pipeline rank ``0..pp-1``, the ordered list of its compute actions.

    Each rank gets exactly one ``F`` and one ``B`` per (microbatch, chunk) it
    owns, each ``B`` after its ``F``, and one virtual stage's forwards (and
    backwards) in increasing microbatch order. Raises :class:`StrategyError`
    for an invalid combination (see :func:`check_schedule`). The (immutable)
    :class:`Action` objects are shared between ranks.
    """
    check_schedule(schedule, pp, microbatches, chunks)
    forward = [[Action("F", i, c) for c in range(chunks)] for i in range(microbatches)]
    backward = [[Action("B", i, c) for c in range(chunks)] for i in range(microbatches)]
    if schedule != "interleaved":
        forwards, backwards = [f[0] for f in forward], [b[0] for b in backward]
        if schedule == "gpipe":
            return [forwards + backwards for _ in range(pp)]
        return [_one_f_one_b(forwards, backwards, min(pp - r - 1, microbatches)) for r in range(pp)]
    # Megatron's interleaved 1F1B is 1F1B over a rank's (microbatch, chunk) units, taken in groups of
    # pp microbatches per chunk (forwards chunk 0 first, backwards last chunk first), with a warm-up
    # long enough for the first backward to come back to the rank on its last chunk.
    units = range(microbatches * chunks)
    group = pp * chunks
    forwards = [forward[k // group * pp + k % pp][k % group // pp] for k in units]
    backwards = [backward[k // group * pp + k % pp][chunks - 1 - k % group // pp] for k in units]
    return [_one_f_one_b(forwards, backwards, min((pp - r - 1) * 2 + (chunks - 1) * pp, len(units)))
            for r in range(pp)]


def _one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """PipeDream-flush / Megatron 1F1B: ``warmup`` forwards, then one forward one backward, then the rest.

    The warm-up fills the pipeline below this rank; afterwards each backward
    frees the activations of one forward, which bounds the memory held.
    """
    steady = len(forwards) - warmup
    actions = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards[:steady]):
        actions += (f, b)
    return actions + backwards[steady:]


@dataclass
class Event:
    """One action as it ran: on which rank and virtual stage, and from when to when (seconds)."""

    rank: int
    stage: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass(eq=False)
class Timeline:
    """When every action of a pipeline step ran, and what that means for each rank.

    ``busy[r]``: seconds rank ``r`` spent computing. ``peak_in_flight[r]``: the
    most (microbatch, chunk) activations rank ``r`` held at once (forwards
    finished minus backwards finished), which sizes its activation memory.
    :attr:`events` is built by ``make_events`` on first use, so the planner,
    which reads only the totals, does not pay for one object per action.
    """

    pp: int
    chunks: int
    makespan: float
    busy: list[float]
    peak_in_flight: list[int]
    make_events: Callable[[], list[Event]] = field(default=list, repr=False)

    @cached_property
    def events(self) -> list[Event]:
        """Every action that ran, rank by rank in execution order for simulated timelines."""
        return self.make_events()

    @property
    def bubble_fraction(self) -> float:
        """``1 - sum(busy) / (pp * makespan)``: the idle share of the pipeline."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.pp * self.makespan)

    def to_dict(self) -> dict:
        """JSON-friendly form; floats rounded to 6 significant digits, events as rows of ``event_fields``."""
        return {
            "pp": self.pp,
            "chunks": self.chunks,
            "makespan": _round(self.makespan),
            "bubble_fraction": _round(self.bubble_fraction),
            "busy": [_round(b) for b in self.busy],
            "peak_in_flight": list(self.peak_in_flight),
            "event_fields": ["rank", "stage", "kind", "microbatch", "chunk", "start", "end"],
            "events": [[e.rank, e.stage, e.kind, e.microbatch, e.chunk, _round(e.start), _round(e.end)]
                       for e in self.events],
        }

    @classmethod
    def from_events(cls, events: Sequence[Event], pp: int, chunks: int = 1) -> Timeline:
        """Build from measured events (e.g. ``time.perf_counter`` stamps of a real run).

        The makespan runs from the earliest start to the latest end, so the
        stamps need not be offset to start at 0. A rank's events are ordered
        by end time (ties keep the given order) to count the activations it holds.
        """
        busy = [0.0] * pp
        per_rank: list[list[Event]] = [[] for _ in range(pp)]
        for e in events:
            if not 0 <= e.rank < pp or e.kind not in KINDS:
                raise ValueError(f"{e}: rank must be in 0..{pp - 1} and kind one of {KINDS}")
            busy[e.rank] += e.end - e.start
            per_rank[e.rank].append(e)
        peak = [_peak_in_flight(sorted(rank_events, key=attrgetter("end"))) for rank_events in per_rank]
        makespan = max((e.end for e in events), default=0.0) - min((e.start for e in events), default=0.0)
        return cls(pp=pp, chunks=chunks, makespan=makespan, busy=busy, peak_in_flight=peak,
                   make_events=partial(list, events))


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def _peak_in_flight(ordered: Iterable[Event]) -> int:
    """Most activations held at once (forwards minus backwards so far) over one rank's events in order."""
    return max(accumulate(map(_HOLDS.__getitem__, map(attrgetter("kind"), ordered)), initial=0))


def simulate(actions: Sequence[Sequence[Action]], fwd: Sequence[float], bwd: Sequence[float],
             p2p: float | Sequence[float] = 0.0) -> Timeline:
    """Run the per-rank action lists on a model of the pipeline and time every action.

    ``fwd[v]``, ``bwd[v]``: seconds of one microbatch's forward / backward on
    virtual stage ``v`` (``len == pp * chunks`` with ``pp = len(actions)``).
    ``p2p``: seconds to send one microbatch's boundary activations from stage
    ``v`` to ``v + 1`` (one float for all boundaries, or ``V - 1`` of them);
    the gradient going back costs the same.

    ``F(v, i)`` waits for ``F(v-1, i)`` plus the transfer; ``B(v, i)`` for
    ``F(v, i)`` and, below the last stage, ``B(v+1, i)`` plus the transfer.
    Each rank runs its list in order, one action at a time; sends never block.
    Raises :class:`RuntimeError` naming the stuck ranks if the lists deadlock,
    :class:`ValueError` for malformed input (an action listed twice, a chunk
    the stage times do not cover, a negative time).
    """
    pp, stages = len(actions), len(fwd)
    if pp < 1 or len(bwd) != stages or stages % pp:
        raise ValueError(f"need len(fwd) == len(bwd) == pp * chunks with pp = len(actions) = {pp}, "
                         f"got len(fwd)={stages}, len(bwd)={len(bwd)}")
    return _timed(_Order.of(actions, stages), fwd, bwd, p2p)


def simulate_schedule(schedule: str, pp: int, microbatches: int, chunks: int, fwd: Sequence[float],
                      bwd: Sequence[float], p2p: float | Sequence[float] = 0.0) -> Timeline:
    """:func:`simulate` of :func:`build_schedule` ``(schedule, pp, microbatches,
    chunks)``, the same timeline, with the schedule's actions and their order
    (what does not depend on the times) made once per schedule and kept for
    the next call (a search simulates one schedule under many stage times)."""
    if len(fwd) != pp * chunks or len(bwd) != pp * chunks:
        raise ValueError(f"need len(fwd) == len(bwd) == pp * chunks = {pp * chunks}, "
                         f"got len(fwd)={len(fwd)}, len(bwd)={len(bwd)}")
    if pp * microbatches * chunks > ORDERS_KEPT_UNITS:      # a few MB each: made for this call only
        return _timed(_Order.of(build_schedule(schedule, pp, microbatches, chunks), pp * chunks), fwd, bwd, p2p)
    return _timed(_schedule_order(schedule, pp, microbatches, chunks), fwd, bwd, p2p)


#: :func:`simulate_schedule` keeps the orders of the last 16 schedules of at most this many
#: (microbatch, chunk) units per rank times ranks (about 5 MB each at most)
ORDERS_KEPT_UNITS = 1 << 15


@lru_cache(maxsize=16)
def _schedule_order(schedule: str, pp: int, microbatches: int, chunks: int) -> _Order:
    return _Order.of(build_schedule(schedule, pp, microbatches, chunks), pp * chunks)


def _timed(order: _Order, fwd: Sequence[float], bwd: Sequence[float], p2p: float | Sequence[float]) -> Timeline:
    """The timeline of ``order`` under these stage and transfer times (see :func:`simulate`)."""
    fwd_v, bwd_v = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
    if (fwd_v < 0).any() or (bwd_v < 0).any():
        raise ValueError("forward and backward times must be >= 0")
    # gap[v]: transfer v -> v+1; gap[V-1] (also gap[-1]) = 0: no transfer past either end
    gap = np.append(_links(p2p, len(fwd)), 0.0)
    wait = np.where(order.backward, gap[order.stage], gap[order.stage - 1])
    cost = np.where(order.backward, bwd_v[order.stage], fwd_v[order.stage])
    begin, pos, clock = _run(order, wait.tolist(), cost.tolist())
    stuck = [r for r in range(order.pp) if pos[r] < order.offsets[r + 1]]
    if stuck:
        raise RuntimeError("pipeline schedule deadlocks: " + "; ".join(
            f"rank {r} waits forever at action {pos[r] - order.offsets[r]}, "
            f"{order.flat[pos[r]]}" for r in stuck))
    return Timeline(pp=order.pp, chunks=order.chunks, makespan=max(clock),
                    busy=np.bincount(order.rank, weights=cost, minlength=order.pp).tolist(),
                    peak_in_flight=list(order.peak_in_flight),
                    make_events=partial(_events, order.flat, order.offsets, np.array(begin), list(fwd),
                                        list(bwd)))


@dataclass(frozen=True)
class _Order:
    """The action lists as flat arrays (rank 0's actions, then rank 1's, ...), ready for :func:`_run`:
    everything but the times, so one schedule's order serves every simulation of it.

    Every (kind, stage, microbatch) has a slot ``F(v, i) = v m + i``,
    ``B(v, i) = (V + v) m + i`` and one more slot, always finished at time 0,
    stands for "nothing to wait for". Each action waits for one slot (``dep``)
    plus a transfer: ``F(v-1, i)`` for a forward, ``B(v+1, i)`` for a
    backward. That a backward also waits
    for its own forward is checked once, statically: the forward must come
    earlier in the same rank's list (then the rank has finished it, and it
    finished before ``B(v+1, i)`` could start).
    """

    pp: int
    chunks: int
    offsets: list[int]          # rank r's actions are offsets[r]:offsets[r+1]
    slots: int                  # state slots, the "nothing to wait for" one last
    flat: list[Action]
    rank: np.ndarray
    backward: np.ndarray        # bool: B (else F)
    stage: np.ndarray
    slot: list[int]
    dep: list[int]
    peak_in_flight: tuple[int, ...]

    @classmethod
    def of(cls, actions: Sequence[Sequence[Action]], stages: int) -> _Order:
        pp = len(actions)
        flat = list(chain.from_iterable(actions))
        n = len(flat)
        offsets = [0, *accumulate(map(len, actions))]
        rank = np.repeat(np.arange(pp), np.diff(offsets))
        chunk = np.fromiter(map(attrgetter("chunk"), flat), dtype=np.int64, count=n)
        micro = np.fromiter(map(attrgetter("microbatch"), flat), dtype=np.int64, count=n)
        backward = np.fromiter(map("B".__eq__, map(attrgetter("kind"), flat)), dtype=bool, count=n)
        if n and chunk.max() >= stages // pp:
            raise ValueError(f"an action has chunk {chunk.max()}, but len(fwd) / pp = {stages // pp} chunks")
        m = int(micro.max()) + 1 if n else 0
        stage = chunk * pp + rank
        fslot = stage * m + micro
        slot = fslot + backward * (stages * m)
        nothing = 2 * stages * m                                     # the last slot
        dep = np.where(backward, np.where(stage == stages - 1, nothing, slot + m),
                       np.where(stage == 0, nothing, fslot - m))
        _check_order(flat, offsets, rank, backward, slot, fslot, nothing + 1)
        return cls(pp=pp, chunks=stages // pp, offsets=offsets, slots=nothing + 1, flat=flat, rank=rank,
                   backward=backward, stage=stage, slot=slot.tolist(), dep=dep.tolist(),
                   peak_in_flight=_peaks(backward, offsets))


def _check_order(flat: list[Action], offsets: list[int], rank: np.ndarray, backward: np.ndarray,
                 slot: np.ndarray, fslot: np.ndarray, slots: int) -> None:
    """Reject an action listed twice, and a backward not preceded by its forward on the same rank."""
    order = np.arange(len(slot))
    index = np.full(slots, -1)
    index[slot] = order
    twice = np.flatnonzero(index[slot] != order)
    if len(twice):
        raise ValueError(f"rank {rank[twice[0]]} lists {flat[twice[0]]} more than once")
    b = np.flatnonzero(backward)
    own_forward = index[fslot[b]]
    stuck = b[(own_forward < 0) | (own_forward > b)]
    if len(stuck):
        k, r = int(stuck[0]), int(rank[stuck[0]])
        raise RuntimeError(f"pipeline schedule deadlocks: rank {r} runs {flat[k]} at action "
                           f"{k - offsets[r]} before (or without) its forward on the same rank, "
                           f"so it would wait for it forever")


def _peaks(backward: np.ndarray, offsets: list[int]) -> tuple[int, ...]:
    """Per rank, the most activations held at once: its list order alone decides it."""
    held = np.cumsum(np.where(backward, -1, 1))
    peaks = []
    for lo, hi in zip(offsets, offsets[1:]):
        before = held[lo - 1] if lo else 0
        peaks.append(int(max(held[lo:hi].max(initial=before) - before, 0)))
    return tuple(peaks)


def _run(order: _Order, wait: list[float], cost: list[float]) -> tuple[list[float], list[int], list[float]]:
    """The event loop: advance each rank through its actions while what it waits for has finished.

    A rank that must wait parks on the slot it waits for and is resumed when
    that slot finishes, so every action is visited once (plus once per park).
    Returns each action's start time, where each rank stopped (its end offset
    unless stuck) and each rank's clock.
    """
    offsets, slot, dep = order.offsets, order.slot, order.dep
    done = [-1.0] * (order.slots - 1) + [0.0]    # end time per slot, -1: not yet; last: "nothing"
    parked = [-1] * order.slots                    # the rank waiting for each slot, -1: none
    begin = [0.0] * len(slot)
    pos, clock = offsets[:-1], [0.0] * order.pp
    runnable = list(range(order.pp))
    while runnable:
        r = runnable.pop()
        now = clock[r]
        for k in range(pos[r], offsets[r + 1]):
            ready = done[dep[k]]
            if ready < 0:
                parked[dep[k]] = r
                break
            ready += wait[k]
            if ready > now:
                now = ready
            begin[k] = now
            now += cost[k]
            done[slot[k]] = now
            if parked[slot[k]] >= 0:
                runnable.append(parked[slot[k]])
        else:
            k = offsets[r + 1]
        pos[r], clock[r] = k, now
    return begin, pos, clock


def _events(flat: list[Action], offsets: list[int], begin: np.ndarray, fwd: list[float],
            bwd: list[float]) -> list[Event]:
    """The simulated actions as :class:`Event` objects, rank by rank in execution order.

    Kept apart from :class:`_Order` so that a timeline holds on to only
    8 bytes per action (its start) plus the action list, not the whole plan.
    """
    pp, starts, events = len(offsets) - 1, begin.tolist(), []
    for r in range(pp):
        for k in range(offsets[r], offsets[r + 1]):
            a, t0 = flat[k], starts[k]
            v = a.chunk * pp + r
            events.append(Event(r, v, a.kind, a.microbatch, a.chunk, t0, t0 + (fwd if a.kind == "F" else bwd)[v]))
    return events


def _links(p2p: float | Sequence[float], stages: int) -> list[float]:
    """Transfer time across each of the ``stages - 1`` stage boundaries."""
    link = [float(p2p)] * (stages - 1) if isinstance(p2p, (int, float)) else [float(t) for t in p2p]
    if len(link) != stages - 1 or any(t < 0 for t in link):
        raise ValueError(f"p2p needs one time >= 0 per stage boundary ({stages - 1}), got {p2p!r}")
    return link


def bubble_fraction(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> float:
    """Closed-form idle share on uniform stages without transfer cost.

    ``(pp-1) / (m+pp-1)`` for gpipe and 1f1b; ``(pp-1) / (m*chunks+pp-1)`` for
    interleaved, where a chunk's forward and backward take ``1/chunks`` of a
    whole stage's (Megatron's ``(p-1)/v`` bubble in units of one microbatch).
    """
    check_schedule(schedule, pp, microbatches, chunks)
    units = microbatches * chunks if schedule == "interleaved" else microbatches
    return (pp - 1) / (units + pp - 1)


def makespan_lower_bound(pp: int, microbatches: int, fwd: Sequence[float], bwd: Sequence[float],
                         p2p: Sequence[float]) -> float:
    """A lower bound on the makespan :func:`simulate` gives *any* schedule of
    ``microbatches`` on these virtual stages (``fwd``, ``bwd`` and ``p2p`` as
    there, ``V = pp * chunks`` stages, rank ``r`` holding ``r, r + pp, ...``).

    Rank ``r`` computes ``busy[r]`` seconds in all; it cannot start before a
    first forward has come through the stages before ``r``, and after its
    last backward that microbatch's gradient still goes back through them.
    So the makespan is at least, over the ranks, those three one after the
    other (the pipeline's fill and drain). On balanced 1F1B stages without
    transfers the bound is the simulated makespan itself."""
    V = len(fwd)
    bound = ramp = 0.0     # ramp: a microbatch's forward and backward through the stages before r
    for r in range(pp):
        busy = microbatches * sum(fwd[v] + bwd[v] for v in range(r, V, pp))
        bound = max(bound, ramp + busy)
        if r + 1 < V:
            ramp += fwd[r] + bwd[r] + 2 * p2p[r]
    return bound
