"""Why the planner chose what it chose (``autopar plan --explain``).

:func:`explain` turns a :class:`~autopar.plan.Plan` and the
:class:`~autopar.search.planner.SearchRecord` returned with it by
:func:`autopar.api.plan_and_record` (the search's working state, which the
plan's JSON does not keep) into a plain dict: the search (mode, candidates, ILP solves and their time), the
runners-up among the mesh / pipeline / microbatch / memory configurations
with their predicted step times, the pipeline's stages and bubble, the size and solve time of the chosen configuration's
ILP, and per layer group the chosen placement of every op that had a choice
with its cheapest alternatives and what each would add per step.
"""
from __future__ import annotations

from typing import Any

from .errors import PlanError
from .plan import Plan
from .search.planner import SearchRecord

#: op kinds worth a line of their own (views and elementwise ops follow their neighbours)
_SHOWN = {"linear", "matmul", "einsum", "sdpa", "embedding", "cross_entropy", "conv", "layernorm", "rmsnorm",
          "batchnorm", "softmax", "pool"}


def explain(plan: Plan, record: SearchRecord | None, *, all_ops: bool = False) -> dict[str, Any]:
    """The explanation of ``plan`` found by the search ``record`` describes,
    as a JSON-able dict (see the module docstring). ``all_ops`` lists every
    op with a choice, not only matmuls, attention, embeddings, norms and
    losses. Raises :class:`PlanError` without a record (a plan loaded from a
    file: the search state is not saved in the JSON) or with the record of
    another model's plan."""
    if record is None:
        raise PlanError("explain needs the search record of a plan made in this process by "
                        "autopar.api.plan_and_record (a saved plan keeps the decisions but not the search that "
                        "led to them)")
    graph, sh, res = record.graph, record.sharding, record.result
    if graph.fingerprint != plan.data["model"]["fingerprint"]:
        raise PlanError(f"the search record is of model {graph.name} ({graph.fingerprint}), the plan of "
                        f"{plan.data['model']['name']} ({plan.data['model']['fingerprint']}): pass the record "
                        "plan_and_record returned with this plan")
    m = plan.parallel["microbatches"]
    out: dict[str, Any] = {"search": dict(plan.data["search"])}
    out["search"]["time_s"] = round(record.planning_time_s, 3)
    if res is not None:
        out["search"].update({"ilp_solves": res.ilp_solves, "ilp_time_s": round(res.ilp_time_s, 3),
                              "best_plan_per_config_from": dict(sorted(res.won.items()))})
        out["configs"] = [{"strategy": e.strategy, "step_time_s": e.step_time_s,
                           "peak_memory_gib": e.peak_memory_bytes / 2**30} for e in res.top]
    pipe = plan.data.get("pipeline")
    if pipe:
        out["pipeline"] = {
            "schedule": pipe["schedule"], "chunks": pipe["chunks"], "layers_per_stage": pipe["layers"],
            "stage_time_s": [f + b for f, b in zip(pipe["forward_s"], pipe["backward_s"])],
            "p2p_time_s": pipe["p2p_time_s"], "bubble_fraction": pipe["bubble_fraction"],
            "memory_per_rank_gib": [x / 2**30 for x in pipe["rank_memory_bytes"]],
            "note": "stages balanced under the cost model (the slowest stage as fast as the per-stage memory "
                    "allows)" if plan.data["search"].get("mode") != "manual" else "equal layers per stage "
                    "(a manual strategy is evaluated as written)"}
    info = sh.ilp
    if info is not None:
        out["ilp"] = {"decisions": info.decisions, "nodes": info.nodes, "variables": info.variables,
                      "constraints": info.constraints, "build_s": round(info.build_s, 4),
                      "solve_s": round(info.solve_s, 4), "status": info.status,
                      "objective_s_per_microbatch": info.objective_s, "memory_bound": info.memory_limited}
        runners = info.runners_up()
    else:
        runners = {}
    group_of = {i: g for g in graph.groups for i in g.instances}
    groups: dict[str, dict[str, Any]] = {}
    seen_instance: dict[str, str] = {}
    for nd in graph.nodes:
        st = sh.strategy.get(nd.name)
        if st is None or (not all_ops and nd.kind not in _SHOWN):
            continue
        g = group_of.get(nd.group) if nd.group else None
        label = f"{g.name} (x{len(g.instances)})" if g is not None else "outside repeated layers"
        if g is not None:
            # one instance stands for the group: the first whose decisions were made (not copied)
            first = seen_instance.setdefault(g.name, nd.group)
            if nd.group != first:
                continue
        entry = groups.setdefault(label, {"ops": []})
        row = {"node": nd.name, "module": nd.module.removeprefix(graph.loss_prefix), "kind": nd.kind,
               "strategy": st.name, "out": st.out}
        if nd.name in runners:
            row["runners_up"] = [{"strategy": a, "out": o, "extra_s_per_step": d * m}
                                 for a, o, d in runners[nd.name]]
        entry["ops"].append(row)
    out["groups"] = groups
    if info is None:
        out["note"] = ("the tensor-parallel placements come from "
                       f"{plan.data['search'].get('tp_axis', 'the manual strategy')} propagation, not the ILP: "
                       "no per-op runners-up")
    return out
