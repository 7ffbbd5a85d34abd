"""The redistribution table: how a value moves between placements on one mesh axis.

One table, as DTensor's ``redistribute`` is one planner: the cost model, the
ILP's edge coefficients, the greedy propagation and the compiler all read it.
:func:`transition_steps` gives, for a value that is ``have`` and must be
``want`` (``R``, ``S(d)`` or ``P``), the collectives the compiler inserts
(named by the runtime kinds of :mod:`autopar.runtime.collectives`) and what
each costs in forward and backward; :func:`transition_time` sums them under a
cost model's ``comm(kind, nbytes)``.

==========  ==========  ===============================  ========================
have        want        steps                            forward / backward
==========  ==========  ===============================  ========================
P           R           all_reduce                       all_reduce / -
P           S(d)        reduce_scatter(d)                reduce_scatter / all_gather
R           S(d)        split(d)                         - / all_gather
S(d)        R           all_gather(d)                    all_gather / -
S(d)        S(e)        all_to_all(d, e)                 all_to_all / all_to_all
x           x           (none)                           - / -
not P       P           infeasible: a partial sum cannot be made from a whole value
==========  ==========  ===============================  ========================

Megatron's "f": a replicated value with a gradient that feeds split work
(``into_split``) gets partial input gradients back, one per rank, which its
backward must sum. After the steps above a ``reduce_grad`` step (identity /
all_reduce) is added; from a shard the gather and the sum fuse into
``all_gather_reduce_grad`` (all_gather / reduce_scatter: the sequence-parallel
entry, half the backward traffic).

A backward collective runs only for a value that carries a gradient. Bytes are
fractions of the full value's bytes (unsharded on this axis), the size the
cost model's ``comm(kind, nbytes)`` expects for every kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from ..errors import CompileError
from ..spec.placement import P, R, is_shard, shard_blocks, shard_dim, valid

INF = float("inf")

#: runtime collective kind -> (forward collectives, backward collectives), each
#: ``(cost-model kind, fraction of the full value's bytes)``
COLLECTIVES: dict[str, tuple[tuple[tuple[str, float], ...], tuple[tuple[str, float], ...]]] = {
    "all_reduce": ((("all_reduce", 1.0),), ()),
    "reduce_grad": ((), (("all_reduce", 1.0),)),
    "all_gather": ((("all_gather", 1.0),), ()),
    "split": ((), (("all_gather", 1.0),)),
    "reduce_scatter": ((("reduce_scatter", 1.0),), (("all_gather", 1.0),)),
    # the readers keep the shard and gather it again in backward (runtime/regather.py)
    "all_gather_reduce_grad": ((("all_gather", 1.0),), (("reduce_scatter", 1.0), ("all_gather", 1.0))),
    "all_to_all": ((("all_to_all", 1.0),), (("all_to_all", 1.0),)),
}


@dataclass(frozen=True)
class Step:
    """One collective to run: ``kind`` (a runtime collective), ``dims`` its
    dim arguments (``(d,)`` for a gather, split or reduce-scatter along d,
    ``(d, e)`` for an all-to-all from S(d) to S(e), ``()`` otherwise), and
    what it costs: ``forward`` / ``backward`` collectives as ``(kind,
    fraction of the full value's bytes)``."""

    kind: str
    dims: tuple[int, ...] = ()

    @property
    def forward(self) -> tuple[tuple[str, float], ...]:
        return COLLECTIVES[self.kind][0]

    @property
    def backward(self) -> tuple[tuple[str, float], ...]:
        return COLLECTIVES[self.kind][1]


def feasible(have: str, want: str) -> bool:
    """Whether a ``have`` value can be redistributed to ``want``: never into a
    partial sum, and never into or out of a blocked shard ``S(d,k)``, which
    only a fused projection's weights and outputs take, on the way to the
    split that hands each rank its chunk of every block."""
    if have != want and (shard_blocks(have) > 1 or shard_blocks(want) > 1):
        return False
    return want != P or have == P


@lru_cache(maxsize=None)
def transition_steps(have: str, want: str, grad: bool = False, into_split: bool = False) -> tuple[Step, ...]:
    """The steps that turn a ``have`` value into ``want`` (see the module table).

    ``grad``: the value carries a gradient; ``into_split``: the consumer
    divides its work over the axis (a replicated input then needs its
    gradient summed: Megatron's f). Returns the steps in order (empty when
    nothing moves). Raises :class:`CompileError` for an invalid placement or
    for ``want == P`` from anything but ``P``."""
    for p in (have, want):
        if not valid(p):
            raise CompileError(f"invalid placement {p!r}; valid: R, P, S(d) with d >= 0, S(d,k) with k >= 2")
    if not feasible(have, want):
        if want != P:
            raise CompileError(f"cannot turn a {have} value into {want}: a blocked shard S(d,k) is only "
                               f"read as it is")
        raise CompileError(f"cannot turn a {have} value into a partial sum (P): only a P value can be "
                           f"read as P; valid targets from {have}: R or S(d)")
    reduce_grad = grad and into_split and want == R
    if have == want:
        steps: tuple[Step, ...] = ()
    elif have == P:
        steps = (Step("all_reduce"),) if want == R else (Step("reduce_scatter", (shard_dim(want),)),)
    elif have == R:
        steps = (Step("split", (shard_dim(want),)),)
    elif want == R:
        if reduce_grad:     # the sequence-parallel entry: the backward reduce-scatters
            return (Step("all_gather_reduce_grad", (shard_dim(have),)),)
        steps = (Step("all_gather", (shard_dim(have),)),)
    else:
        steps = (Step("all_to_all", (shard_dim(have), shard_dim(want))),)
    if reduce_grad:
        steps += (Step("reduce_grad"),)
    return steps


@lru_cache(maxsize=None)
def transition_collectives(have: str, want: str, grad: bool = False,
                           into_split: bool = False) -> tuple[tuple[str, float], ...] | None:
    """Every collective (forward, then backward when ``grad``) the transition
    costs, as ``(kind, fraction of the value's bytes)``; None when infeasible."""
    if not feasible(have, want):
        return None
    out: list[tuple[str, float]] = []
    steps = transition_steps(have, want, grad, into_split)
    for s in steps:
        out += s.forward
    if grad:
        for s in steps:
            out += s.backward
    return tuple(out)


def transition_time(have: str, want: str, nbytes: float, grad: bool, into_split: bool,
                    comm: Callable[[str, float], float]) -> float:
    """Forward + backward seconds of turning a ``have`` value of ``nbytes``
    (full size on this axis) into ``want`` (see :func:`transition_steps`);
    ``comm(kind, nbytes)`` is the time of one collective on the axis. Returns
    INF when the transition is infeasible (``want == P`` from a non-P value)."""
    if have == want and not (into_split and grad and want == R):
        return 0.0
    colls = transition_collectives(have, want, grad, into_split)
    if colls is None:
        return INF
    t = 0.0
    for kind, frac in colls:
        t += comm(kind, nbytes * frac)
    return t


def nested_moves(haves: Sequence[str], wants: Sequence[str]) -> str | None:
    """How a value placed ``haves`` on the axes of a mesh (outermost first)
    moves to ``wants``, one axis after another. A dim split on several axes
    is cut outer axis first (the outer axis's chunk, then the inner axis's
    chunk of it), so per dim the axes splitting it after the move must
    extend those before by inner axes (split outer first) or keep a prefix of
    them (gather inner first): ``"outer first"`` or ``"inner first"``. None
    where no order keeps the chunks in place: an outer axis splitting a dim
    an inner one keeps split (or gathering one it keeps), an axis gathering
    a dim another splits, or one dim needing each order."""
    k = len(haves)
    dims = {shard_dim(p) for p in (*haves, *wants) if is_shard(p)}
    inner_first = outer_first = False
    for d in dims:
        before = [a for a in range(k) if is_shard(haves[a]) and shard_dim(haves[a]) == d]
        after = [a for a in range(k) if is_shard(wants[a]) and shard_dim(wants[a]) == d]
        if before == after:
            continue
        if after[:len(before)] == before:       # inner axes added
            outer_first |= len(after) - len(before) > 1
        elif before[:len(after)] == after:      # inner axes removed
            inner_first |= len(before) - len(after) > 1
        else:
            return None
    if inner_first and outer_first:
        return None
    return "inner first" if inner_first else "outer first"


def output_time(have: str, nbytes: float, comm: Callable[[str, float], float]) -> float:
    """Seconds to make the graph's output (the loss) whole on every rank:
    the transition from ``have`` to R, with no gradient flowing through it."""
    return transition_time(have, R, nbytes, False, False, comm)


__all__ = ["COLLECTIVES", "INF", "Step", "feasible", "output_time", "transition_collectives", "transition_steps",
           "transition_time"]
