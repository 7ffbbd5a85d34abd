"""What one op costs on one mesh axis: the time every search and the cost model charge.

For one node, one candidate :class:`~autopar.strategies.Strategy` and the
placements its inputs arrive in, :func:`op_axis_time` is

* the forward compute of this rank's share of the work (1/n when the
  strategy splits it), three times over for forward + backward;
* the collectives the op runs inside (vocabulary-parallel cross-entropy);
* the transition of every input from the placement it arrives in to the one
  the strategy reads, from the redistribution table
  (:func:`~autopar.strategies.redistribute.transition_time`, Megatron's f
  included), once for the readers of a layer instance that read a value
  alike (:func:`shared_key`), as the compiler inserts it once.

The greedy propagation ranks candidates by it (plus search heuristics of its
own), the cost model sums it over the decided graph, and the ILP splits the
same sum: :func:`op_local_time` on the decision (it does not depend on the
neighbours) and the input transitions on the edges.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..graph import Node
from ..spec.placement import P, R
from .redistribute import INF, transition_time
from .rules import Strategy

Comm = Callable[[str, float], float]       # (collective kind, full bytes) -> seconds on the axis
Compute = Callable[[Node, float], float]   # (node, fraction of its work) -> forward seconds


@dataclass(frozen=True)
class AxisTime:
    """The time of one op on one axis, per microbatch: ``fwd`` forward compute
    of the local share, ``inside`` the op's own collectives and ``inputs`` the
    input transitions (both forward + backward)."""

    fwd: float
    inside: float
    inputs: float

    @property
    def comm(self) -> float:
        """Communication on the axis, forward + backward."""
        return self.inside + self.inputs

    @property
    def total(self) -> float:
        """Forward + backward (twice the forward) compute plus communication."""
        return 3.0 * self.fwd + self.inside + self.inputs


def work_fraction(st: Strategy, n: int) -> float:
    """The share of a node's work one rank does under ``st`` on an axis of size ``n``."""
    return 1.0 / n if st.split else 1.0


def inside_time(st: Strategy, comm: Comm) -> float:
    """Seconds of the collectives ``st`` runs inside the op."""
    t = 0.0
    for kind, nbytes in st.comm:
        t += comm(kind, nbytes)
    return t


def op_local_time(nd: Node, st: Strategy, n: int, compute: Compute, comm: Comm) -> float:
    """The part of :func:`op_axis_time` that does not depend on the inputs'
    placements: 3x the forward compute of the share plus the inside collectives."""
    return 3.0 * compute(nd, work_fraction(st, n)) + inside_time(st, comm)


def shared_key(nd: Node, name: str, want: str, split: bool, grad: Mapping[str, bool]) -> tuple:
    """What makes two readers share the transition of their input ``name``
    (read as ``want`` by ``nd``, whose strategy splits its work or not): the
    value, the placement read, whether the backward sums a gradient (Megatron's
    f) and the reader's layer instance (``nd.group``; None outside the
    layers). The compiler inserts each transition once for every reader
    that reads the value alike (a LayerNorm output read by the q, k and v
    projections is reduced once in backward); the searches and the cost
    model charge it once per layer instance, so that an instance's cost
    stays its own (a value read by every layer, a rotary table, is charged
    in each: those are replicated and rarely move)."""
    return name, want, split and want == R and grad.get(name, False), nd.group


def inputs_time(nd: Node, st: Strategy, have: Sequence[str | None], nbytes: Callable[[str], float],
                grad: Mapping[str, bool], comm: Comm, charged: set | None = None, commit: bool = True) -> float:
    """Seconds of moving every input of ``nd`` from ``have`` to what ``st``
    reads (``st.ins``), forward + backward. ``have[i]`` None: the input is not
    placed yet (a parameter before its first consumer) and takes the
    placement read, which must not be a partial sum (INF then).

    ``charged``, when given, holds the transitions already paid for by
    earlier readers (:func:`shared_key`): those are skipped, and the new
    ones added (``commit``; else left out, to rank a candidate)."""
    t = 0.0
    split = st.split
    for h, w, name in zip(have, st.ins, nd.inputs):
        if h is None:
            if w == P:
                return INF
            h = w
        if h == w and not (split and w == R):
            continue    # nothing moves (and no Megatron f): skip the size
        if charged is not None:
            key = shared_key(nd, name, w, split, grad)
            if key in charged:
                continue
            if commit:
                charged.add(key)
        t += transition_time(h, w, nbytes(name), grad.get(name, False), split, comm)
    return t


def op_axis_time(nd: Node, st: Strategy, have: Sequence[str | None], n: int, *,
                 nbytes: Callable[[str], float], grad: Mapping[str, bool], compute: Compute,
                 comm: Comm, charged: set | None = None, commit: bool = True) -> AxisTime:
    """The time of ``nd`` run as ``st`` on an axis of size ``n`` when its
    inputs arrive as ``have`` (aligned with ``nd.inputs``; None: not placed
    yet, see :func:`inputs_time`). ``nbytes(name)`` is a value's full size on
    this axis, ``grad[name]`` whether it carries a gradient, ``compute(node,
    fraction)`` the forward seconds of doing ``fraction`` of the node's work
    and ``comm(kind, nbytes)`` a collective's seconds; ``charged``: see
    :func:`inputs_time` (and ``commit``). Returns an :class:`AxisTime` (``inputs`` is INF
    for an infeasible transition)."""
    return AxisTime(compute(nd, work_fraction(st, n)), inside_time(st, comm),
                    inputs_time(nd, st, have, nbytes, grad, comm, charged, commit))
