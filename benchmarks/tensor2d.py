"""Where 2D, 2.5D and 3D tensor parallelism (``tp_mode=2d``, ``2.5d``, ``3d``: Colossal-AI's grids) beat 1D under the cost model.

Two tables, predictions only (no training):

1. **Search.** Per model, cluster preset, device count and global batch: the
   best strategy of the automatic search over 1d layouts only (the default),
   the best ``tp_mode=2d`` configuration (every q x q grid, microbatch count,
   recompute and ZeRO 0-3 that the model and batch allow, flat and in every
   pipeline the search would try), the same for 2.5d
   (2 and 4 deep) and for the ``q x q x q`` cubes of 3d, and what the search
   picks when it may use them all (``tp_modes=("1d", "2d", "2.5d", "3d")``). Search mode
   ``grid`` (Megatron placements on the tp axis, and on the grid's columns),
   so both sides are placed alike and the table takes minutes, not hours.
2. **Scaling of the tensor-parallel communication** at ``dp=1``: one 1d group
   of P ranks against a sqrt(P) x sqrt(P) grid and a cbrt(P)^3 cube, per
   step (2D moves ``O(1/sqrt(P))`` of the activations and weights per
   device; 1D all-reduces whole activations whatever P is; autopar's 3D moves
   ``O(P^(-2/3))`` of the activations and ``O(P^(-1/3))`` of the weights).

Run: ``python -m benchmarks.tensor2d [--quick]``; results in
``benchmarks/results/tensor2d-<device>.json`` and its README section.
"""
from __future__ import annotations

import argparse
import time

import autopar
from autopar import api
from autopar.errors import StrategyError
from autopar.search.grid import grid2d_configs, pipeline_configs
from benchmarks.common import save

GPT_1_3B = "gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200"
GPT_6_7B = "gpt:layers=32,hidden=4096,heads=32,seq=2048,vocab=51200"
LLAMA_8B = "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256"
NAMES = {GPT_1_3B: "GPT 1.3B", GPT_6_7B: "GPT 6.7B", LLAMA_8B: "Llama-3 8B"}

#: (model, cluster, devices, global batch)
CASES = [
    (GPT_1_3B, "dgx-a100-80g", 16, 16), (GPT_1_3B, "dgx-a100-80g", 16, 32), (GPT_1_3B, "dgx-a100-80g", 64, 64),
    (GPT_1_3B, "dgx-a100-80g", 64, 512), (GPT_1_3B, "dgx-h100", 64, 64),
    (GPT_6_7B, "dgx-a100-80g", 64, 64), (GPT_6_7B, "dgx-a100-80g", 64, 1024), (GPT_6_7B, "dgx-a100-80g", 256, 256),
    (GPT_6_7B, "dgx-h100", 256, 256),
    (LLAMA_8B, "dgx-h100", 32, 32), (LLAMA_8B, "dgx-h100", 64, 64),
]
QUICK = CASES[:3]
SCALING = (GPT_6_7B, "dgx-a100-80g", (4, 8, 16, 64))


def best_2d(model: str, cluster: str, devices: int, batch: int, mode: str = "2d"):
    """The fastest fitting ``tp_mode=2d`` (or ``2.5d``, ``3d``) estimate, flat or in a pipeline (None:
    no grid fits or divides)."""
    graph = api.as_graph(model)
    planner = api.planner_for(graph, cluster, "adamw", None, devices=devices, global_batch=batch)
    best = None
    piped = [c for c in pipeline_configs(graph, devices, batch, tp_modes=("1d", mode),
                                         devices_per_node=planner.cluster.devices_per_node) if c.tp_mode == mode]
    for line in grid2d_configs(graph, devices, batch, mode=mode) + [piped]:
        for cfg in line:
            try:
                e = planner.evaluate(cfg)
            except StrategyError:
                continue
            if e.fits and (best is None or e.step_time_s < best.step_time_s):
                best = e
    return best


def search_row(model: str, cluster: str, devices: int, batch: int) -> dict:
    kw = dict(cluster=cluster, devices=devices, global_batch=batch, search_mode="grid")
    t0 = time.perf_counter()
    one = autopar.plan(model, **kw)
    t1 = time.perf_counter()
    both = autopar.plan(model, tp_modes=("1d", "2d", "2.5d", "3d"), **kw)
    t2 = time.perf_counter()
    two = best_2d(model, cluster, devices, batch)
    deep = best_2d(model, cluster, devices, batch, "2.5d")
    cube = best_2d(model, cluster, devices, batch, "3d")
    t_one = one.data["predicted"]["step_time_s"]
    return {"model": NAMES[model], "cluster": cluster, "devices": devices, "global_batch": batch,
            "best_1d": one.strategy, "best_1d_s": t_one,
            "best_2d": two.strategy if two else None, "best_2d_s": two.step_time_s if two else None,
            "ratio_2d_over_1d": two.step_time_s / t_one if two else None,
            "best_25d": deep.strategy if deep else None, "best_25d_s": deep.step_time_s if deep else None,
            "ratio_25d_over_1d": deep.step_time_s / t_one if deep else None,
            "best_3d": cube.strategy if cube else None, "best_3d_s": cube.step_time_s if cube else None,
            "ratio_3d_over_1d": cube.step_time_s / t_one if cube else None,
            "best_3d_parts": _parts(cube) if cube else None, "best_25d_parts": _parts(deep) if deep else None,
            "search_with_2d": both.strategy, "search_with_2d_s": both.data["predicted"]["step_time_s"],
            "plan_s_1d": t1 - t0, "plan_s_with_2d": t2 - t1}


def _parts(e) -> dict:
    """Where a step's time goes (seconds), for the notes."""
    return {"compute": e.compute_time_s, "tp_comm": e.tp_comm_time_s, "dp_comm": e.dp_comm_time_s,
            "optimizer": e.optimizer_time_s, "step": e.step_time_s,
            "gathered_weights_gib": e.memory.get("grid_weights_gathered", 0.0) / 2**30}


def scaling_rows() -> list[dict]:
    model, cluster, sizes = SCALING
    rows = []
    for p in sizes:
        kw = dict(cluster=cluster, devices=p, global_batch=p)
        row: dict = {"P": p}
        for mode, text in (("1d", f"dp=1,tp={p}"), ("2d", f"dp=1,tp={p},tp_mode=2d"), ("3d", f"dp=1,tp={p},tp_mode=3d")):
            try:
                e = autopar.evaluate(model, strategy=text, **kw)
            except StrategyError as err:      # 1d: tp must divide the heads; 2d only its columns; 3d: a cube
                row[f"error_{mode}"] = str(err)
                continue
            row.update({f"tp_comm_{mode}_s": e.tp_comm_time_s, f"step_{mode}_s": e.step_time_s,
                        f"memory_{mode}_gib": e.peak_memory_bytes / 2**30})
        rows.append(row)
    return rows


def _scaling_note(s: dict) -> str:
    def one(mode: str) -> str:
        if f"step_{mode}_s" not in s:
            return f"{mode} invalid ({'not a square' if mode == '2d' else 'not a cube' if mode == '3d' else 'tp does not divide the heads'})"
        return (f"{mode} {s[f'tp_comm_{mode}_s']:.3g} s of {s[f'step_{mode}_s']:.3g} s, "
                f"{s[f'memory_{mode}_gib']:.3g} GiB")
    return f"P={s['P']}: {one('1d')}; {one('2d')}; {one('3d')}"


def cube_note(rows: list[dict]) -> str:
    """What the 3d column shows, read off this run's rows (no number typed in)."""
    wins = [r for r in rows if r["ratio_3d_over_1d"] is not None and r["ratio_3d_over_1d"] < 1]
    tried = [r for r in rows if r["ratio_3d_over_1d"] is not None]
    if not tried:
        return "3d: no cube divides the devices and batch of any case."
    best = min(tried, key=lambda r: r["ratio_3d_over_1d"])
    p = best["best_3d_parts"]
    head = (f"3d (q x q x q cubes: the samples over depth x rows, every matrix split over all q^3 ranks) beats the "
            f"best 1d in {len(wins)} of {len(rows)} cases" + (f", by up to {(1 - best['ratio_3d_over_1d']) * 100:.1f}%"
                                                             if wins else "") +
            f"; its best ratio is {best['ratio_3d_over_1d']:.3f} ({best['model']} on {best['devices']} "
            f"{best['cluster']}, batch {best['global_batch']}: {best['best_3d']}, {p['tp_comm']:.3g} s of tp "
            f"communication, {p['dp_comm']:.3g} s dp, {p['compute']:.3g} s compute of {p['step']:.3g} s).")
    lose = "".join(f" Not faster than 1d: {r['model']} on {r['devices']} {r['cluster']}, batch {r['global_batch']} "
                   f"({r['ratio_3d_over_1d']:.3f}: {r['best_3d_parts']['compute']:.3g} s of its "
                   f"{r['best_3d_parts']['step']:.3g} s is compute)." for r in tried if r not in wins)
    deep = best.get("best_25d_parts")
    if deep is None:
        return head + lose
    return head + (f" Against 2.5d on the same case ({best['best_25d']}): {deep['tp_comm']:.3g} s of tp communication "
                   f"and {deep['dp_comm']:.3g} s dp. On a 2 x 2 x 2 cube the weight gathers over the rows, then the "
                   "depth, move what 2.5d's gathers over the rows plus its depth all-reduce of the gradient shards "
                   "move, so the tp communication is alike; a cube rank holds an eighth of every matrix where a 2.5d "
                   "rank holds a quarter, so its data-parallel reduction carries half as much: 3d wins where that "
                   "reduction is a large part of the step. Its gathered weights are kept for backward (the "
                   "`gathered` memory, more than 2.5d's).") + lose


#: why the table looks as it does (read off the estimates' parts; see docs/strategies.md); the numbers
#: in braces are filled in from this run's rows (:func:`why`)
WHY = [
    "Where 2d wins (GPT 1.3B on A100 nodes, 16-64 GPUs): a 2 x 2 grid holds a quarter of every matrix, as tp=4 "
    "does, but moves activations over 2 columns only; its rows gather weights and reduce-scatter their gradients "
    "inside the node (NVLink), and the data-parallel reduction carries a quarter of the weights. E.g. 64 GPUs, "
    "batch 64: dp=16 x 2x2 has 0.016 s of tp communication against 0.034 s for dp=16,tp=4 (and 0.112 s of "
    "compute against 0.115 s: 2-way split matmuls are more efficient), with the same 0.037 s dp reduction.",
    "Where it loses (the larger models): the rows' weight gathers grow with h^2 per microbatch, are not "
    "overlapped, and the gathered weights are kept per microbatch in flight; grids of 4 x 4 and up put the rows "
    "across nodes on 8-GPU nodes. On H100 nodes (faster NVLink, same inter-node ratio) the 1d pipelines and ZeRO-3 "
    "plans stay ahead. The grids run Megatron's sequence parallelism on their columns, as the best 1d plans do: "
    "the search takes it on most grid rows of the table (less activation memory for a reduce-scatter and an "
    "all-gather in place of each all-reduce over the columns).",
    "2.5d (d grids of q x q, the samples split over the depth too, the weights replicated over it) wins where 2d "
    "does and a little more (up to {gain_25d} on 16 A100s: dp=2 x two 2 x 2 grids): a grid of 8 fills a node, so the "
    "depth's per-microbatch gradient all-reduce of each rank's quarter shard stays on NVLink and only dp=2 crosses "
    "nodes. It loses where 2d does, for the same reasons.",
    "The scaling line shows the paper's point: at dp=1 a 1d group of 16 spans two nodes and all-reduces whole "
    "activations over InfiniBand ({tp16_1d:.2g} s per step), a 4 x 4 grid moves 1/4 blocks ({tp16_2d:.2g} s); but no search "
    "would choose tp=16 on 16 GPUs for this model: data parallelism with 1d tp inside a node is cheaper still.",
]



def why(rows: list[dict], scale: list[dict]) -> list[str]:
    """:data:`WHY` with this run's numbers: 2.5d's best gain over 1d on 16 devices, the tp
    communication of 1d and 2d at P=16 in the scaling line."""
    on16 = [r for r in rows if r["devices"] == 16 and r["ratio_25d_over_1d"] is not None]
    gain = max((1 - r["ratio_25d_over_1d"] for r in on16), default=0.0)
    p16 = next((r for r in scale if r["P"] == 16), {})
    nums = {"gain_25d": f"{gain * 100:.1f}%", "tp16_1d": p16.get("tp_comm_1d_s", float("nan")),
            "tp16_2d": p16.get("tp_comm_2d_s", float("nan"))}
    return [w.format(**nums) for w in WHY]


def main(quick: bool = False) -> dict:
    t0 = time.perf_counter()
    rows = []
    for case in QUICK if quick else CASES:
        r = search_row(*case)
        rows.append(r)
        print(f"{r['model']:10s} {r['cluster']:13s} {r['devices']:4d} x {r['global_batch']:5d}: 1d "
              f"{r['best_1d_s']:.4f} s, 2d {r['best_2d_s'] or float('nan'):.4f} s "
              f"({r['ratio_2d_over_1d'] or float('nan'):.3f}), 3d {r['best_3d_s'] or float('nan'):.4f} s "
              f"({r['ratio_3d_over_1d'] or float('nan'):.3f}); search with grids: {r['search_with_2d']}", flush=True)
    scale = scaling_rows()
    wins = [r for r in rows if r["ratio_2d_over_1d"] is not None and r["ratio_2d_over_1d"] < 1]
    deep_wins = [r for r in rows if r["ratio_25d_over_1d"] is not None and r["ratio_25d_over_1d"] < 1]
    cube_wins = [r for r in rows if r["ratio_3d_over_1d"] is not None and r["ratio_3d_over_1d"] < 1]
    model, cluster, _ = SCALING
    res = {
        "title": "2D, 2.5D and 3D tensor parallel (tp_mode=2d, 2.5d, 3d) against 1D under the cost model",
        "description": "Predicted step times (bf16, AdamW), search mode `grid` (Megatron placements on the tp axis "
                       "and on the 2D grid's columns) for both sides. `best 1d`: the default search; `best 2d`: the "
                       "fastest fitting q x q grid configuration; `best 2.5d`: the same for 2 and 4 deep grids; `best 3d`: "
                       "for the q x q x q cubes; `search with grids`: what "
                       "`autopar.plan(..., tp_modes=('1d', '2d', '2.5d', '3d'))` (CLI `--tp-modes 1d,2d,2.5d,3d`) picks. "
                       "Each grid is tried flat and in the pipelines the search tries (each stage a dp x grid "
                       "sub-mesh); the grids run no sequence parallelism or cp, which the 1d plans may use.",
        "summary": {"cases where 2d beats the best 1d": f"{len(wins)} of {len(rows)}",
                    "cases where 2.5d beats the best 1d": f"{len(deep_wins)} of {len(rows)}",
                    "best 2d gain": f"{(1 - min(r['ratio_2d_over_1d'] for r in wins)) * 100:.1f}%" if wins else "none",
                    "best 2.5d gain": f"{(1 - min(r['ratio_25d_over_1d'] for r in deep_wins)) * 100:.1f}%"
                    if deep_wins else "none",
                    "cases where 3d beats the best 1d": f"{len(cube_wins)} of {len(rows)}",
                    "best 3d gain": f"{(1 - min(r['ratio_3d_over_1d'] for r in cube_wins)) * 100:.1f}%"
                    if cube_wins else "none"},
        "table": {"columns": ["model", "cluster", "devices", "batch", "best 1d", "s", "best 2d", "s", "2d / 1d",
                              "best 2.5d", "s", "2.5d / 1d", "best 3d", "s", "3d / 1d", "search with grids"],
                  "rows": [[r["model"], r["cluster"], r["devices"], r["global_batch"], r["best_1d"], r["best_1d_s"],
                            r["best_2d"], r["best_2d_s"], r["ratio_2d_over_1d"], r["best_25d"], r["best_25d_s"],
                            r["ratio_25d_over_1d"], r["best_3d"], r["best_3d_s"], r["ratio_3d_over_1d"],
                            r["search_with_2d"]] for r in rows]},
        "notes": why(rows, scale) + [cube_note(rows)] + [f"tensor-parallel communication per step at dp=1, {NAMES[model]} on {cluster}, global batch P "
                  f"(tp communication of the step, step time, peak memory per device): " +
                  " | ".join(_scaling_note(s) for s in scale)],
        "rows": rows, "scaling": scale, "params": {"cases": len(rows), "quick": quick},
        "wall_s": time.perf_counter() - t0,
    }
    path = save("tensor2d", res)
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first three cases only")
    main(ap.parse_args().quick)
