"""Does the three-axis joint program find Bian et al.'s 3D matmul?

Bian et al. 2021 ("Maximizing Parallelism in Distributed Training for Huge
Neural Networks", Colossal-AI's 3D tensor parallelism) run ``Y = X W`` on a
``q x q x q`` cube with ``X`` split over the samples on one axis and over the
contraction dim on a second, ``W`` over the contraction dim on that second
axis and over its output dim on a third, and ``Y`` reduced over the second:
per linear, one axis splits the samples (``batch``), one runs Megatron's
column split (``colwise``) and one its row split (``rowwise``).

``tp_mode=mesh3`` decides every op's placement on three tensor axes in one
program (:func:`autopar.search.mesh_ilp.solve_mesh`), so Bian's layout is one
of its choices. Per case (a GPT-3-shaped model, a tp group laid out as an
``a x b x c`` mesh on a preset cluster, one microbatch of ``batch`` samples
per data-parallel rank) this benchmark solves

* **1d**: the single-axis ILP on the whole group as one axis;
* **joint**: the three-axis program, free;
* **Bian**: the three-axis program with every linear pinned to Bian's
  layout (its weight ``R|S(0)|S(1)``: whole on the outer axis, which splits
  the samples, or the tokens of a single sample; the output dim on the middle axis; the contraction dim on the
  inner one, whose output is a partial sum), the rest decided around it;

and counts the linears whose joint strategy is Bian's triple (a batch, a
column and a row split, one per axis, in any order). Times are one
microbatch on the tensor group as the programs count it (compute of the
local share forward + backward and every axis's collectives, bf16; no
data-parallel tail, no memory bound). A group that spans nodes is priced as
:mod:`benchmarks.mesh_ilp` explains (its 1d figure is pessimistic).

Run: ``python -m benchmarks.mesh3_bian [--quick]``; results in
``benchmarks/results/mesh3_bian-<device>.json`` and its README section.
"""
from __future__ import annotations

import argparse
import math
import time

import autopar
from autopar.search.ilp import solve_axis
from autopar.search.mesh_ilp import solve_mesh
from autopar.search.planner import Planner
from autopar.sharding import scaled_shapes
from benchmarks.common import save

GPT3_24 = "gpt:layers=24,hidden=12288,heads=96,seq=2048,vocab=51200"
GPT3_6 = "gpt:layers=6,hidden=12288,heads=96,seq=2048,vocab=51200"
NAMES = {GPT3_24: "GPT-3 175B shape, 24 layers", GPT3_6: "GPT-3 175B shape, 6 layers"}
BIAN = "R|S(0)|S(1)"

#: (model, cluster, tp mesh (a, b, c), samples per microbatch)
CASES = [
    (GPT3_24, "dgx-a100-80g", (2, 2, 2), 1),
    (GPT3_24, "dgx-a100-80g", (2, 2, 2), 8),
    (GPT3_24, "dgx-a100-80g", (4, 4, 4), 4),
    (GPT3_24, "dgx-h100", (4, 4, 4), 4),
]
QUICK = [(GPT3_6, "dgx-a100-80g", (2, 2, 2), 1)]


def _bian_pins(graph, shapes: dict, outer: int) -> dict[str, str]:
    """Every linear run as Bian's: its weight stored ``R|S(0)|S(1)`` and its
    output made ``S(d)|S(last)|P`` (the samples split on the outer axis, on
    the tokens ``d = 1`` where a microbatch has fewer samples than the axis;
    the output dim on the middle one; a partial sum over the contraction on
    the inner one), so that no linear reads its weight gathered instead."""
    out = {}
    for nd in graph.nodes:
        if nd.kind == "linear" and len(nd.inputs) > 1 and graph[nd.inputs[1]].is_state and nd.out is not None:
            shape = shapes[nd.name]
            out[nd.inputs[1]] = BIAN
            out[nd.name] = f"S({0 if shape[0] % outer == 0 else 1})|S({len(shape) - 1})|P"
    return out


def _bian_share(graph, axes) -> tuple[int, int]:
    """(linears whose per-axis strategies are a batch, a column and a row
    split, one each; linears)."""
    n = hits = 0
    for nd in graph.nodes:
        if nd.kind != "linear" or nd.name not in axes[0].strategy:
            continue
        n += 1
        names = sorted("batch" if ax.strategy[nd.name].name.startswith("batch") else ax.strategy[nd.name].name
                       for ax in axes)
        hits += names == ["batch", "colwise", "rowwise"]
    return hits, n


def row(spec: str, cluster: str, mesh: tuple[int, int, int], batch: int) -> dict:
    graph = autopar.trace(spec)
    tp = math.prod(mesh)
    planner = Planner(graph, cluster, global_batch=batch, devices=tp, optimizer="adamw")
    model = planner.cost("bf16")
    shapes = scaled_shapes(graph, batch)
    topo_mesh, topo_flat = model.topology((1, *mesh)), model.topology((1, tp))

    def comm_of(topo, axis: int):
        return lambda kind, nbytes: topo.collective_time(kind, nbytes * model.itemsize / 4, axis)

    def compute(nd, frac: float) -> float:
        return model.node_time(nd, model.scale(nd, batch), frac)

    comms = [comm_of(topo_mesh, 1 + a) for a in range(3)]
    one_d = solve_axis(graph, tp, shapes, comm=comm_of(topo_flat, 1), compute=compute)
    t0 = time.perf_counter()
    joint = solve_mesh(graph, mesh, shapes, comm=comms, compute=compute)
    joint_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    bian = solve_mesh(graph, mesh, shapes, comm=comms, compute=compute,
                      pins=_bian_pins(graph, shapes, mesh[0]))
    bian_s = time.perf_counter() - t0
    hits, linears = _bian_share(graph, joint)
    bian_hits, _ = _bian_share(graph, bian)
    return {"model": NAMES.get(spec, spec), "cluster": cluster, "mesh": " x ".join(map(str, mesh)), "batch": batch,
            "spans_nodes": [topo_mesh.spans_nodes(1 + a) for a in range(3)],
            "one_d_s": one_d.ilp.objective_s, "joint_s": joint[0].ilp.objective_s,
            "bian_s": bian[0].ilp.objective_s, "joint_bian_linears": hits, "pinned_bian_linears": bian_hits,
            "linears": linears, "variables": joint[0].ilp.variables, "solve_s": joint_s, "bian_solve_s": bian_s}


def main(quick: bool = False) -> dict:
    t0 = time.perf_counter()
    rows = []
    for case in QUICK if quick else CASES:
        r = row(*case)
        rows.append(r)
        print(f"{r['model']:28s} {r['cluster']:13s} {r['mesh']:9s} b={r['batch']}: 1d {r['one_d_s'] * 1e3:.2f} ms, "
              f"joint {r['joint_s'] * 1e3:.2f} ms ({r['joint_bian_linears']}/{r['linears']} linears Bian's), "
              f"Bian pinned {r['bian_s'] * 1e3:.2f} ms ({r['variables']} variables, {r['solve_s']:.1f} s)", flush=True)
    summary = {"cases where the joint program picks Bian's triple for some linear":
               f"{sum(r['joint_bian_linears'] > 0 for r in rows)} of {len(rows)}",
               "cases where the joint program is at most Bian's pinned":
               f"{sum(r['joint_s'] <= r['bian_s'] * (1 + 1e-9) for r in rows)} of {len(rows)}",
               "best Bian pinned / 1d": round(min(r["bian_s"] / r["one_d_s"] for r in rows), 3),
               "best joint / 1d": round(min(r["joint_s"] / r["one_d_s"] for r in rows), 3),
               "slowest three-axis solve (s)": round(max(max(r["solve_s"], r["bian_solve_s"]) for r in rows), 2)}
    res = {
        "title": "The three-axis joint program against Bian et al.'s 3D matmul",
        "description": "Time of one microbatch on the tensor-parallel group as the sharding programs count it "
                       "(compute of the local share forward + backward and every axis's collectives, bf16; no "
                       "data-parallel tail, no memory bound). 1d: the single-axis ILP on the group as one axis; "
                       "joint: `search/mesh_ilp.py` deciding the three axes together; Bian pinned: the same with "
                       "every linear pinned to Bian et al.'s 3D layout (weight R|S(0)|S(1), output S(0)|S(-1)|P). "
                       "The Bian columns "
                       "count the linears whose joint strategy is one batch, one column and one row split.",
        "notes": ["A tp group spanning nodes is priced as one flat group at one GPU's inter-node bandwidth "
                  "(pessimistic for 1d), each mesh axis on its own link (see mesh_ilp)."],
        "summary": summary,
        "table": {"columns": ["model", "cluster", "tp mesh", "samples", "axes span nodes", "1d ms", "joint ms",
                              "Bian pinned ms", "joint / 1d", "linears Bian's (joint)", "linears", "variables",
                              "solve s"],
                  "rows": [[r["model"], r["cluster"], r["mesh"], r["batch"],
                            ", ".join("yes" if s else "no" for s in r["spans_nodes"]), r["one_d_s"] * 1e3,
                            r["joint_s"] * 1e3, r["bian_s"] * 1e3, r["joint_s"] / r["one_d_s"],
                            r["joint_bian_linears"], r["linears"], r["variables"], r["solve_s"]] for r in rows]},
        "rows": rows, "params": {"quick": quick}, "wall_s": time.perf_counter() - t0,
    }
    path = save("mesh3_bian", res)
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one 6-layer case")
    main(ap.parse_args().quick)
