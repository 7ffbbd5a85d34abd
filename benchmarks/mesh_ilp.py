"""The joint ILP over two tensor axes against the layouts written out.

Per case, a tensor-parallel group of ``a x b`` ranks laid out on the cluster
as a mesh (the first axis outermost: across nodes where the group spans
them), priced by the cost model (the planner's compute and each axis's
collectives, bf16, one microbatch of ``b`` samples per data-parallel rank):

* **1d (today)**: the single-axis ILP on the whole group as one axis
  (:func:`autopar.search.ilp.solve_axis`, Megatron-like splits over all
  ``a x b`` ranks, its collectives on the group's slowest link);
* **batch x 1d**: the samples split over the first axis, the single-axis
  ILP on the second (what a 2D grid's rows and columns do, before their
  weight gathers);
* **joint**: :func:`autopar.search.mesh_ilp.solve_mesh`, both axes decided
  together.

The figure is the time of one microbatch on the tensor group as the
programs count it (compute of the local share, forward + backward, and
every axis's collectives; no data-parallel tail, no memory bound: the joint
program has no memory row yet). The joint program's size and solve time
show that repeated layers keep it small.

Read the groups that span nodes with care: the cost model charges a
collective on a group spanning nodes entirely at one GPU's inter-node
bandwidth (``MeshTopology.axis_link``; NCCL's rings use every NIC of a node,
so such a flat group is priced pessimistically), while the joint program's
outer axis pairs one GPU per node, which that price fits. There the gain
over 1d is an upper bound; inside a node both are priced alike.

Run: ``python -m benchmarks.mesh_ilp [--quick]``; results in
``benchmarks/results/mesh_ilp-<device>.json`` and its README section.
"""
from __future__ import annotations

import argparse
import time

import autopar
from autopar.search.ilp import solve_axis
from autopar.search.mesh_ilp import _MeshProblem, solve_mesh
from autopar.spec.placement import joint_placement
from autopar.search.planner import Planner
from autopar.sharding import follow_batch, scaled_shapes
from benchmarks.common import save

GPT3 = "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200"
GPT3_24 = "gpt:layers=24,hidden=12288,heads=96,seq=2048,vocab=51200"
LLAMA_70B = "llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,seq=8192,vocab=128256"
NAMES = {GPT3: "GPT-3 175B", GPT3_24: "GPT-3 175B (24 layers)", LLAMA_70B: "Llama-3 70B"}

#: (model, cluster, mesh of the tp group (a, b), samples per microbatch)
CASES = [
    (GPT3, "dgx-a100-80g", (2, 4), 1),
    (GPT3, "dgx-a100-80g", (2, 4), 8),
    (GPT3, "dgx-a100-80g", (4, 2), 8),
    (LLAMA_70B, "dgx-h100", (2, 4), 1),
    (GPT3, "dgx-a100-80g", (2, 8), 1),
    (GPT3, "dgx-a100-80g", (4, 8), 4),
    (LLAMA_70B, "dgx-h100", (2, 8), 1),
]
QUICK = [(GPT3_24, "dgx-a100-80g", (2, 8), 1)]


def _objective(prob: _MeshProblem, axes) -> float:
    """What the joint program charges per-axis decisions ``axes`` (each
    node's strategies matched by name and placements)."""
    k = len(axes)
    strategy, out = {}, {}
    for name, cs in prob.cands.items():
        want = [(ax.strategy[name].name, ax.strategy[name].ins, ax.out[name]) if name in ax.strategy else None
                for ax in axes]
        st = next((st for st in cs if all(w is None or (p.name, p.ins, p.out) == w
                                           for p, w in zip(st.parts, want))), None)
        if st is None:
            return float("inf")
        strategy[name] = st
    for nd in prob.graph.nodes:
        st = strategy.get(prob.key[nd.name])
        if st is not None:
            strategy[nd.name], out[nd.name] = st, st.out
        else:
            out[nd.name] = joint_placement([ax.out.get(nd.name, "R") for ax in axes])
    return prob.objective(strategy, out)


def row(spec: str, cluster: str, mesh: tuple[int, int], batch: int) -> dict:
    a, b = mesh
    graph = autopar.trace(spec)
    tp = a * b
    planner = Planner(graph, cluster, global_batch=batch, devices=tp, optimizer="adamw")
    model = planner.cost("bf16")
    shapes = scaled_shapes(graph, batch)
    topo_mesh, topo_flat = model.topology((1, a, b)), model.topology((1, tp))

    def comm_of(topo, axis: int):
        return lambda kind, nbytes: topo.collective_time(kind, nbytes * model.itemsize / 4, axis)

    def compute(nd, frac: float) -> float:
        return model.node_time(nd, model.scale(nd, batch), frac)

    comms = [comm_of(topo_mesh, 1), comm_of(topo_mesh, 2)]
    t0 = time.perf_counter()
    joint = solve_mesh(graph, mesh, shapes, comm=comms, compute=compute)
    solve_s = time.perf_counter() - t0
    one_d = solve_axis(graph, tp, shapes, comm=comm_of(topo_flat, 1), compute=compute)
    half = scaled_shapes(graph, batch, a) if batch % a == 0 else None
    prob = _MeshProblem(graph, mesh, shapes, {})
    prob.comms, prob.comm, prob.compute, prob.param_time = comms, comms[0], compute, lambda nd, p: 0.0
    batch_1d = _objective(prob, [follow_batch(graph, a, shapes, batch_axis=False),
                                 solve_axis(graph, b, half, comm=comms[1], compute=compute)]) if half else None
    both = sum(1 for nd in graph.nodes if nd.is_state and all(ax.out.get(nd.name, "R").startswith("S") for ax in joint))
    return {"model": NAMES.get(spec, spec), "cluster": cluster, "mesh": f"{a} x {b}", "batch": batch,
            "spans_nodes": [topo_mesh.spans_nodes(1), topo_mesh.spans_nodes(2)],
            "one_d_s": one_d.ilp.objective_s, "batch_1d_s": batch_1d, "joint_s": joint[0].ilp.objective_s,
            "weights_split_on_both": both, "variables": joint[0].ilp.variables,
            "decisions": joint[0].ilp.decisions, "solve_s": solve_s}


def main(quick: bool = False) -> dict:
    t0 = time.perf_counter()
    rows = []
    for case in QUICK if quick else CASES:
        r = row(*case)
        rows.append(r)
        print(f"{r['model']:22s} {r['cluster']:13s} {r['mesh']:6s} b={r['batch']}: 1d {r['one_d_s'] * 1e3:.2f} ms, "
              f"batch x 1d {r['batch_1d_s'] * 1e3 if r['batch_1d_s'] else float('nan'):.2f} ms, joint "
              f"{r['joint_s'] * 1e3:.2f} ms ({r['variables']} variables, {r['solve_s']:.1f} s)", flush=True)
    inside = [r for r in rows if not any(r["spans_nodes"])]
    spanning = [r for r in rows if any(r["spans_nodes"])]
    beats = sum(r["joint_s"] < r["one_d_s"] * (1 - 1e-9) for r in rows)
    no_worse = sum(r["batch_1d_s"] is None or r["joint_s"] <= r["batch_1d_s"] * (1 + 1e-9) for r in rows)
    summary = {"cases where joint beats 1d": f"{beats} of {len(rows)}",
               "cases where joint is at most batch x 1d": f"{no_worse} of {len(rows)}",
               "largest joint program (variables)": max(r["variables"] for r in rows),
               "slowest joint solve (s)": round(max(r["solve_s"] for r in rows), 2)}
    for what, group in (("inside a node", inside), ("groups spanning nodes (an upper bound)", spanning)):
        if group:
            summary[f"best joint / 1d, {what}"] = round(min(r["joint_s"] / r["one_d_s"] for r in group), 3)
    res = {
        "title": "The joint ILP over two tensor axes against the layouts written out",
        "description": "Time of one microbatch on the tensor-parallel group as the sharding programs count it "
                       "(compute of the local share forward + backward and every axis's collectives, bf16; no "
                       "data-parallel tail, no memory bound). 1d: the single-axis ILP on the group as one axis; "
                       "batch x 1d: the samples over the first axis, the single-axis ILP on the second; joint: "
                       "`search/mesh_ilp.py` deciding both axes together. The first axis is the outer one (across "
                       "nodes where the group spans them).",
        "notes": ["A tp group spanning nodes is priced as one flat group at one GPU's inter-node bandwidth "
                  "(`MeshTopology.axis_link`, pessimistic: NCCL's rings use every NIC), the joint program's outer "
                  "axis (one GPU per node) at its own NIC's, which fits: for the rows whose axes span nodes the "
                  "gain over 1d is an upper bound. Inside a node both are priced alike."],
        "summary": summary,
        "table": {"columns": ["model", "cluster", "tp mesh", "samples", "axes span nodes", "1d ms", "batch x 1d ms",
                              "joint ms", "joint / 1d", "weights split on both axes", "variables", "solve s"],
                  "rows": [[r["model"], r["cluster"], r["mesh"], r["batch"],
                            ", ".join("yes" if s else "no" for s in r["spans_nodes"]), r["one_d_s"] * 1e3,
                            r["batch_1d_s"] * 1e3 if r["batch_1d_s"] is not None else None, r["joint_s"] * 1e3,
                            r["joint_s"] / r["one_d_s"], r["weights_split_on_both"], r["variables"], r["solve_s"]]
                           for r in rows]},
        "rows": rows, "params": {"quick": quick}, "wall_s": time.perf_counter() - t0,
    }
    path = save("mesh_ilp", res)
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one 24-layer case")
    main(ap.parse_args().quick)
