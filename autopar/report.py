"""A plan as one self-contained HTML page (``autopar show plan.json --html``).

:func:`html_report` writes the page: the plan's summary, memory bars per
pipeline rank (the peak rank's weights, gradients, optimizer state,
activations and transient buffers, against the device's memory), the
predicted pipeline timeline as inline SVG, the placement of every parameter
with repeated layers collapsed into one row per pattern, and, given the
:func:`autopar.explain.explain` dict of a plan made in this process, the
search's runners-up. No script, no stylesheet or font from the network: the
page renders the same offline.
"""
from __future__ import annotations

import html
import os
from collections import Counter
from pathlib import Path
from typing import Any

from . import units
from .errors import PlanError
from .plan import Plan
from .spec import zero_words

#: memory parts in stacking order, with their bar colours (also what the browser test looks for)
MEMORY_COLORS = {"weights": "#1f77b4", "gradients": "#ff7f0e", "optimizer": "#2ca02c",
                 "activations": "#d62728", "transient": "#9467bd"}
FORWARD_COLOR, BACKWARD_COLOR = "#4c78a8", "#f58518"

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px} td,th{padding:3px 10px;text-align:left;border-bottom:1px solid #eee}
th{background:#f6f6f6} td.num{text-align:right;font-variant-numeric:tabular-nums}
.sub{color:#666;font-size:13px} .shard{color:#b35900;font-weight:600}
.bar{display:flex;height:22px;border:1px solid #999;background:#fafafa;width:640px;position:relative}
.bar div{height:100%} .legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:-1px}
.limit{position:absolute;top:-3px;bottom:-3px;border-left:2px dashed #000}
.fits{color:#2a7a2a;font-weight:600} .nofit{color:#b00;font-weight:600}
"""


def html_report(plan: Plan, path: str | os.PathLike | None = None, *, explained: dict[str, Any] | None = None) -> str:
    """The report of ``plan`` as HTML text, also written to ``path`` when given.

    ``explained``: :func:`autopar.explain.explain`'s dict for this plan, whose
    runners-up and per-op choices are then shown too."""
    d = plan.data
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
             f"<title>autopar plan: {_e(d['model']['name'])}</title><style>{_CSS}</style></head><body>",
             f"<h1>autopar plan: {_e(plan.strategy)}</h1>",
             f"<div class=\"sub\">{_e(d['model']['name'])} on {d['devices']} x {_e(d['cluster']['name'])}, "
             f"global batch {d['global_batch']}</div>",
             _summary(plan), _memory(plan), _timeline(plan), _placements(plan)]
    if explained is not None:
        parts.append(_runners_up(explained))
    parts.append(f"<p class=\"sub\">plan version {d['plan_version']}, autopar {_e(d['autopar_version'])}, "
                 f"model fingerprint {_e(d['model']['fingerprint'])}</p></body></html>\n")
    text = "\n".join(parts)
    if path is not None:
        out = Path(path)
        if not out.parent.is_dir():
            raise PlanError(f"cannot write the report to {str(out)!r}: the directory {str(out.parent)!r} does not "
                            "exist")
        out.write_text(text, encoding="utf-8")
    return text


def _e(x: Any) -> str:
    return html.escape(str(x))


def _rows(rows: list[tuple[str, str]]) -> str:
    return "<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _summary(plan: Plan) -> str:
    d, pred = plan.data, plan.predicted
    fits = pred.get("fits", True)
    step = pred["step_time_s"]
    rows = [
        ("mesh", _e(" x ".join(f"{a}={n}" for a, n in zip(d["mesh"]["axes"], d["mesh"]["shape"])))),
        ("step time", f"{_e(units.seconds(step))} (compute {_e(units.seconds(pred['compute_time_s']))}, "
                      f"tp comm {_e(units.seconds(pred.get('tp_comm_time_s', 0.0)))}, "
                      f"dp comm {_e(units.seconds(pred.get('dp_comm_time_s', 0.0)))}, "
                      f"optimizer {_e(units.seconds(pred.get('optimizer_time_s', 0.0)))})"),
        ("throughput", _e(units.flops_rate(pred["tflops_per_device"] * 1e12) + " per device")),
        ("peak memory", f"{_e(units.nbytes(pred['peak_memory_bytes']))} of "
                        f"{_e(units.nbytes(pred['device_memory_bytes']))} "
                        f"<span class=\"{'fits' if fits else 'nofit'}\">{'fits' if fits else 'does not fit'}</span>"),
        ("precision, optimizer", _e(f"{d['precision']}, {d['optimizer']}")),
        ("search", _e(", ".join(f"{k} {v}" for k, v in d.get("search", {}).items()))),
    ]
    return "<h2>Summary</h2>" + _rows(rows)


def _memory(plan: Plan) -> str:
    """One bar per pipeline rank (its peak), the peak rank's split by kind; the
    dashed line is the device's memory."""
    pred = plan.predicted
    parts = pred.get("memory", {})
    limit = float(pred["device_memory_bytes"])
    pipe = plan.data.get("pipeline") or {}
    ranks = [float(x) for x in pipe.get("rank_memory_bytes", [pred["peak_memory_bytes"]])]
    top = max(ranks) or 1.0
    off_scale = limit > 4 * top         # a tiny model on a big device: scale to the use, say where the limit is
    scale = top * 1.25 if off_scale else max(limit, top)
    peak_rank = max(range(len(ranks)), key=lambda r: ranks[r])
    known = sum(float(parts.get(k, 0.0)) for k in MEMORY_COLORS)
    out = ["<h2>Memory per device</h2>",
           "<div class=\"legend sub\">" + "".join(f"<span style=\"background:{c}\"></span>{k}"
                                                  for k, c in MEMORY_COLORS.items()) +
           "<span style=\"border-left:2px dashed #000;width:0\"></span>device memory</div>", "<table>"]
    for r, total in enumerate(ranks):
        if r == peak_rank and known > 0:     # the breakdown the plan records is the peak rank's
            segs = [(k, float(parts.get(k, 0.0)) * total / known, c) for k, c in MEMORY_COLORS.items()]
        else:
            segs = [("total", total, "#888888")]
        bar = "".join(f"<div title=\"{_e(k)} {_e(units.nbytes(v))}\" class=\"mem-{_e(k)}\" "
                      f"style=\"width:{100 * v / scale:.3f}%;background:{c}\"></div>" for k, v, c in segs if v > 0)
        if not off_scale:
            bar += f"<div class=\"limit\" style=\"left:{100 * limit / scale:.3f}%\"></div>"
        label = f"pipeline rank {r}" if len(ranks) > 1 else "every device"
        out.append(f"<tr><th>{label}</th><td><div class=\"bar\">{bar}</div></td>"
                   f"<td class=\"num\">{_e(units.nbytes(total))}</td></tr>")
    out.append("</table>")
    if off_scale:
        out.append(f"<p class=\"sub\">the device's {_e(units.nbytes(limit))} lies far beyond the right edge: "
                   f"the bars are scaled to the use ({100 * top / limit:.2g}% of it at the peak)</p>")
    if known > 0:
        out.append("<p class=\"sub\">" + ", ".join(f"{k} {_e(units.nbytes(parts.get(k, 0.0)))}"
                                                    for k in MEMORY_COLORS) +
                   (f" (pipeline rank {peak_rank}, the peak)" if len(ranks) > 1 else "") + "</p>")
    return "\n".join(out)


def _timeline(plan: Plan) -> str:
    """The predicted pipeline schedule as SVG: a row per pipeline rank, a box per
    forward (blue) and backward (orange) with its microbatch number."""
    from .pipeline.timeline import predicted_timeline
    if not plan.data.get("pipeline"):
        return "<h2>Pipeline</h2><p class=\"sub\">no pipeline (pp=1): every device runs the whole model</p>"
    tl = predicted_timeline(plan)
    width, row, left = 1000.0, 26.0, 70.0
    span = tl.makespan or 1.0
    x = (width - left - 10) / span
    svg = [f"<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0f}\" height=\"{row * tl.pp + 30:.0f}\" "
           "font-family=\"sans-serif\" font-size=\"10\" role=\"img\" aria-label=\"predicted pipeline timeline\">"]
    for r in range(tl.pp):
        svg.append(f"<text x=\"4\" y=\"{row * r + 17:.0f}\">rank {r}</text>")
    for ev in tl.events:
        color = FORWARD_COLOR if ev.kind == "F" else BACKWARD_COLOR
        x0, w = left + ev.start * x, max((ev.end - ev.start) * x, 0.5)
        y = row * ev.rank + 3
        svg.append(f"<rect class=\"ev-{ev.kind}\" x=\"{x0:.2f}\" y=\"{y:.0f}\" width=\"{w:.2f}\" height=\"{row - 6:.0f}\" "
                   f"fill=\"{color}\" stroke=\"#fff\" stroke-width=\"0.5\"><title>{'forward' if ev.kind == 'F' else 'backward'}"
                   f" microbatch {ev.microbatch} chunk {ev.chunk}</title></rect>")
        if w > 14:
            svg.append(f"<text x=\"{x0 + w / 2:.2f}\" y=\"{y + 13:.0f}\" text-anchor=\"middle\" fill=\"#fff\">"
                       f"{ev.microbatch}</text>")
    svg.append(f"<text x=\"{left:.0f}\" y=\"{row * tl.pp + 22:.0f}\">0</text><text x=\"{width - 10:.0f}\" "
               f"y=\"{row * tl.pp + 22:.0f}\" text-anchor=\"end\">{_e(units.seconds(span))}</text></svg>")
    pipe = plan.data["pipeline"]
    note = (f"{_e(pipe['schedule'])}, layers per stage {_e(pipe['layers'])}, bubble "
            f"{100 * tl.bubble_fraction:.1f}%. The timeline is one step's forwards and backwards "
            f"(makespan {_e(units.seconds(span))}); the step time above also counts the data-parallel "
            "communication and the optimizer that follow it.")
    return "<h2>Predicted pipeline timeline</h2>" + "".join(svg) + f"<p class=\"sub\">{note}</p>"


def _placements(plan: Plan) -> str:
    """Every parameter's placement per mesh axis, repeated layers collapsed
    (``blocks.7.attn.q.weight`` counts under ``blocks.*.attn.q.weight``)."""
    axes = plan.placement_axes()
    patterns: dict[str, Counter] = {}
    pattern = plan.patterns()
    for name, pl in plan.data["params"].items():
        patterns.setdefault(pattern(name), Counter())[tuple(pl)] += 1
    head = "".join(f"<th>{_e(a)}</th>" for a in axes)
    rows = []
    for pat, pairs in patterns.items():
        for pair, n in pairs.items():
            cells = "".join(f"<td class=\"{'shard' if p != 'R' else ''}\">{_e(p)}</td>" for p in pair)
            rows.append(f"<tr><td>{_e(pat)}</td>{cells}<td class=\"num\">{n}</td></tr>")
    words = zero_words(plan.parallel)
    note = f"<p class=\"sub\">Besides: {_e(words)}, whatever the dp placement says.</p>" if words else ""
    return (f"<h2>Parameter placements</h2><table><tr><th>parameter</th>{head}<th>tensors</th></tr>"
            + "".join(rows) + "</table>" + note)


def _runners_up(explained: dict[str, Any]) -> str:
    """The best configurations the search compared, with their predicted step
    time, how much slower than the best and their peak memory."""
    configs = explained.get("configs") or []
    if not configs:
        return ""
    best = configs[0]["step_time_s"]
    rows = []
    for i, c in enumerate(configs, 1):
        slower = "" if i == 1 else f"+{100 * (c['step_time_s'] / best - 1):.1f}%"
        rows.append(f"<tr><td class=\"num\">{i}</td><td>{_e(c['strategy'])}</td>"
                    f"<td class=\"num\">{_e(units.seconds(c['step_time_s']))}</td><td class=\"num\">{slower}</td>"
                    f"<td class=\"num\">{_e(units.nbytes(c['peak_memory_gib'] * 2**30))}</td></tr>")
    return ("<h2>Runners-up</h2><table><tr><th>#</th><th>strategy</th><th>step time</th><th>vs best</th>"
            f"<th>peak memory</th></tr>{''.join(rows)}</table>")
