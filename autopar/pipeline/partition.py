"""Cut a traced graph into pipeline stages between its repeated layers.

A pipeline cuts only between *units*: the nodes before the first layer (unit
0: embeddings), each layer in graph order (units 1..L), and the nodes after
the last one (unit L+1: final norm, head, loss). The layers are the instances
of the largest repeated-layer group whose instances run in sequence (see
:func:`units`). A node outside them that sits between two layers belongs to
the layer before it. Parameters are not units: a parameter lives on every
stage that reads it.

A partition of ``V`` virtual stages is given by the number of layers each
stage holds (``layers[v] >= 0``, summing to L; only the first and the last
stage may hold none, since they have the embedding and the head). Stage 0
always holds unit 0 and stage V-1 unit L+1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..errors import StrategyError
from ..graph import STATE_KINDS, Graph, parent_module

_NOT_UNITS = STATE_KINDS


@dataclass(frozen=True)
class Units:
    """The graph in pipeline units: ``labels[u]`` names unit ``u``
    (``"<embed>"``, the layer instances, ``"<head>"``), ``of_node`` maps every
    non-parameter node to its unit."""

    labels: tuple[str, ...]
    of_node: dict[str, int]

    @property
    def layers(self) -> int:
        return len(self.labels) - 2


def units(graph: Graph) -> Units:
    """The pipeline units of ``graph`` (memoised on it). The layers are the
    instances of the largest repeated-layer group whose instances run one
    after the other (each reads what the one before produced: transformer
    blocks, not the parallel q/k/v projections inside one). Raises
    :class:`StrategyError` for a graph without such layers."""
    return graph.memo(("pipeline_units",), lambda: _units(graph))


def _units(graph: Graph) -> Units:
    pos = {nd.name: k for k, nd in enumerate(graph.nodes)}
    group = _sequential_group(graph, pos)
    if group is None:
        raise StrategyError(f"pipeline parallelism cuts between repeated layers that run in sequence, and "
                            f"{graph.name} has none (no sibling modules of identical structure, such as "
                            "transformer blocks, each reading the previous one's output); use pp=1")
    order = {inst: k + 1 for k, inst in enumerate(group)}
    last_layer_pos = max(pos[nd.name] for nd in graph.nodes if nd.group in order)
    tail = len(order) + 1
    of_node: dict[str, int] = {}
    cur = 0
    for k, nd in enumerate(graph.nodes):
        if nd.kind in _NOT_UNITS:
            continue
        if nd.group in order:
            cur = order[nd.group]
        elif k > last_layer_pos:
            cur = tail
        of_node[nd.name] = cur
    return Units(labels=("<embed>", *order, "<head>"), of_node=of_node)


def _sequential_group(graph: Graph, pos: dict[str, int]) -> list[str] | None:
    """The instances, in graph order, of the largest group whose every
    instance reads a value produced at or after the end of the instance
    before it, with the other layer instances of its stack (same
    parent module) when they all run so; and the instances of every such
    stack when the stacks run one after another (an encoder's layers, then
    a decoder's)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    reads: dict[str, int] = {}     # the latest value an instance reads from outside itself
    for k, nd in enumerate(graph.nodes):
        if nd.group is None or nd.kind in _NOT_UNITS:
            continue
        if nd.group not in first:
            first[nd.group] = k
        last[nd.group] = k
        outside = [pos[i] for i in nd.inputs if graph[i].kind not in _NOT_UNITS and graph[i].group != nd.group]
        reads[nd.group] = max(reads.get(nd.group, -1), *outside, -1)
    stacks = []     # the stacks of the groups whose instances run in sequence, the largest first
    for g in sorted(graph.groups, key=lambda g: -g.nodes_per_instance * len(g.instances)):
        insts = sorted((i for i in g.instances if i in first), key=first.__getitem__)
        if len(insts) < 2 or not _in_sequence(insts, reads, last):
            continue
        # with the layers beside it in the same stack (unlike it, so in no group, or in
        # another group): DeepSeek-V3's dense first layer, SmolLM3's layers without rotary
        parent = parent_module(insts[0])
        stack = sorted((i for i in first if parent_module(i) == parent), key=first.__getitem__)
        stack = stack if len(stack) > len(insts) and _in_sequence(stack, reads, last) else insts
        if not any(set(stack) & set(s) for s in stacks):
            stacks.append(stack)
    if not stacks:
        return None
    # stacks that run one after the other are one sequence of layers (an encoder's then a
    # decoder's, a vision model's stages): each a stack of its own, none inside another's span
    order = sorted(stacks, key=lambda s: first[s[0]])
    if len(order) > 1 and all(last[a[-1]] < first[b[0]] for a, b in zip(order, order[1:])):
        every = [i for s in order for i in s]
        if _in_sequence(every, reads, last):
            return every
    return stacks[0]


def _in_sequence(insts: list[str], reads: dict[str, int], last: dict[str, int]) -> bool:
    """Whether every instance reads a value produced at or after the end of
    the instance before it (its input; not only its first node's: Nemotron's
    layers start with ``weight + 1`` of their norm, which reads a weight alone)."""
    return all(reads[b] >= last[a] for a, b in zip(insts, insts[1:]))


def check_layers(layers: Sequence[int], n_layers: int) -> None:
    """Raise :class:`StrategyError` unless ``layers`` is a valid partition of
    ``n_layers`` repeated layers into ``len(layers)`` stages."""
    v = len(layers)
    if v < 1 or any(k < 0 for k in layers) or sum(layers) != n_layers:
        raise StrategyError(f"stage layer counts {list(layers)} must be >= 0 and sum to the model's "
                            f"{n_layers} repeated layers")
    empty = [i for i in range(1, v - 1) if layers[i] == 0]
    if empty:
        raise StrategyError(f"pipeline stage {empty[0]} holds no layer; only the first and the last stage "
                            f"may (they hold the embedding and the head)")


def even_layers(n_layers: int, stages: int) -> list[int]:
    """Layers per stage as even as possible (the earlier stages get the
    remainder last, as the last stage also carries the head). With one or
    two stages more than layers, one layer each and the embedding alone on
    the first stage (and the head alone on the last): Llama 3's 126 layers
    on 16 ranks of 8 model chunks."""
    if stages > n_layers + 2:
        raise StrategyError(f"{stages} pipeline stages need at least {stages - 2} repeated layers (a stage each, "
                            f"the first and the last may hold the embedding and the head alone); the model has "
                            f"{n_layers}")
    if stages > n_layers:
        return [0] + [1] * n_layers + [0] * (stages - n_layers - 1)
    base, extra = divmod(n_layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def unit_bounds(layers: Sequence[int]) -> list[int]:
    """``b`` with stage ``v`` holding units ``b[v] <= u < b[v+1]``."""
    bounds = [0]
    for k in layers:
        bounds.append(bounds[-1] + k)
    bounds = [b + 1 for b in bounds]   # unit 0 (embedding) goes with stage 0
    bounds[0] = 0
    bounds[-1] += 1                    # the head unit goes with the last stage
    return bounds


def stage_of_units(layers: Sequence[int]) -> list[int]:
    """The stage of every unit."""
    b = unit_bounds(layers)
    out: list[int] = []
    for v in range(len(layers)):
        out.extend([v] * (b[v + 1] - b[v]))
    return out


def assign(graph: Graph, layers: Sequence[int]) -> dict[str, int]:
    """Stage of every non-parameter node of ``graph`` under ``layers``."""
    u = units(graph)
    check_layers(layers, u.layers)
    of_unit = stage_of_units(layers)
    return {name: of_unit[k] for name, k in u.of_node.items()}


def param_stages(graph: Graph, stage_of: dict[str, int]) -> dict[str, list[int]]:
    """For each parameter / buffer node, the sorted stages that read it (a
    tied weight read by the embedding and the head is on two)."""
    out: dict[str, set[int]] = {}
    for nd in graph.nodes:
        s = stage_of.get(nd.name)
        if s is None:
            continue
        for i in nd.inputs:
            if i in graph and graph[i].kind in _NOT_UNITS:
                out.setdefault(i, set()).add(s)
    return {k: sorted(v) for k, v in out.items()}


def in_flight(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> list[float]:
    """Per virtual stage, the microbatches whose activations its rank holds at
    the rank's peak (the schedule's memory multiplier): GPipe keeps all ``m``;
    1F1B keeps ``pp - r`` on rank ``r``; interleaved 1F1B keeps Megatron's
    warm-up count plus one, counted in chunk-microbatches and spread over the
    rank's chunks."""
    m = microbatches
    out: list[float] = []
    for v in range(pp * chunks):
        r = v % pp
        if schedule == "gpipe":
            out.append(float(m))
        elif schedule == "interleaved":
            peak = min(m * chunks, (pp - r - 1) * 2 + (chunks - 1) * pp + 1)
            out.append(peak / chunks)
        else:
            out.append(float(min(pp - r, m)))
    return out


def least_busiest(layers: int, ranks: int, size: float, first: float, last: float) -> float:
    """A lower bound on the largest load of ``ranks`` pipeline ranks (``ranks
    >= 2``) sharing ``layers`` layers of ``size`` or more each, the first rank
    also holding ``first`` (the embedding) and the last ``last`` (the head):
    the least ``T`` with ``sum_r floor((T - o_r) / size) >= layers`` over whole
    layers per rank. Generous by 1e-9 of a layer per rank (so a bound, never
    above the true least maximum, whatever the rounding)."""
    if size <= 0:
        return max(first, last)
    offsets = ((0.0, ranks - 2), (first, 1), (last, 1))

    def fits(t: float) -> bool:
        held = 0
        for o, count in offsets:
            if t < o:
                return False
            held += count * math.floor((t - o) / size + 1e-9)
        return held >= layers

    # the least maximum is some rank's offset plus whole layers, at least the
    # fractional one and at most a layer above it: a few steps from there
    frac = max(first, last, (layers * size + first + last) / ranks) * (1 - 1e-12)
    best = math.inf
    for o, _ in offsets:
        k = max(0, math.ceil((frac - o) / size) - 1)
        for step in range(k, k + 4):
            if fits(step * size + o):
                best = min(best, step * size + o)
                break
    return best if best < math.inf else frac


def balance(time: Sequence[float], states: Sequence[float], act: Sequence[float], fixed: Sequence[float],
            stages: int, in_flight: Sequence[float], cap: float) -> list[int] | None:
    """Layers per stage that minimise the slowest stage, with every stage's
    memory ``sum(states) + in_flight[v] * sum(act) + max(fixed)`` within
    ``cap``; ``None`` when no partition fits.

    The inputs are per unit (embedding, layers, head). For a bound ``T`` on
    the stage time, packing units greedily from the last stage backwards is
    optimal when ``in_flight`` does not grow with the stage (GPipe, 1F1B):
    every constraint is monotone in a contiguous range and looser for later
    stages, so the greedy stage ``k`` starts no later than that of any
    feasible partition. The smallest feasible ``T`` is found by bisection.
    This is Alpa's inter-operator stage DP specialised to one sub-mesh shape
    per stage; for interleaved schedules (whose ``in_flight`` rises again at
    each chunk) it is a heuristic.
    """
    n = len(time)
    if stages > n:
        return None
    pre_t, pre_s, pre_a = _prefix(time), _prefix(states), _prefix(act)
    fixed = list(fixed)

    def pack(bound: float) -> list[int] | None:
        starts: list[int] = []
        end = n
        for v in range(stages - 1, -1, -1):
            t_end, s_end, a_end, f = pre_t[end], pre_s[end], pre_a[end], in_flight[v]
            if v == 0:
                start, peak = 0, max(fixed[:end])
            else:
                # leave at least one unit for each earlier stage; whether units start - 1
                # to end - 1 fit inlined (the search packs thousands of times)
                start, peak = end - 1, fixed[end - 1]
                while start > v:
                    p = peak if peak >= fixed[start - 1] else fixed[start - 1]
                    if t_end - pre_t[start - 1] > bound or \
                            s_end - pre_s[start - 1] + f * (a_end - pre_a[start - 1]) + p > cap:
                        break
                    start -= 1
                    peak = p
            if not (t_end - pre_t[start] <= bound and
                    s_end - pre_s[start] + f * (a_end - pre_a[start]) + peak <= cap):
                return None
            starts.append(start)
            end = start
        return starts[::-1][1:] + [n]

    lo, hi = max(time), pre_t[n]
    best = pack(hi)
    if best is None:
        return None
    for _ in range(40):
        if hi - lo <= 1e-4 * hi:   # finer than any layer's share of a stage
            break
        mid = (lo + hi) / 2
        got = pack(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    bounds = [0, *best]
    sizes = [bounds[v + 1] - bounds[v] for v in range(stages)]
    sizes[0] -= 1          # the embedding unit
    sizes[-1] -= 1         # the head unit
    return sizes


def _prefix(xs: Sequence[float]) -> list[float]:
    out = [0.0]
    for x in xs:
        out.append(out[-1] + x)
    return out
