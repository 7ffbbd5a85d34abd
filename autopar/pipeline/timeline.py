"""Drawing pipeline timelines: which rank computed what when, predicted and measured one above the other."""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from ..errors import PlanError
from .schedule import Timeline, build_schedule, simulate

_DPI = 120
_WIDTH_IN = 12.0            # figure width; the axes get about 85 % of it
_ROW_HEIGHT_IN = 0.35       # figure height per pipeline rank and panel
_PX_PER_DIGIT = 7.0         # a 7 pt digit is about 6 px wide at 120 dpi, plus a margin


def predicted_timeline(plan) -> Timeline:
    """The simulated schedule of a pipelined :class:`~autopar.plan.Plan`
    (from its per-stage forward, backward and transfer times). Raises
    :class:`PlanError` for a plan without a pipeline."""
    pipe = plan.data.get("pipeline")
    if not pipe or "forward_s" not in pipe:
        raise PlanError(f"this plan has no pipeline (strategy {plan.strategy}): there is no schedule to draw")
    par = plan.parallel
    return simulate(build_schedule(pipe["schedule"], par["pp"], par["microbatches"], pipe["chunks"]),
                    pipe["forward_s"], pipe["backward_s"], pipe["p2p_time_s"])


def plot_timeline(timeline: Timeline, path: str | os.PathLike, *, title: str | None = None,
                  measured: Timeline | None = None) -> Path:
    """Draw ``timeline`` (and a ``measured`` one below it, if given) to a PNG at ``path``.

    One row per pipeline rank, rank 0 on top, one box per event: forwards in
    blues, backwards in oranges, later model chunks darker, the microbatch
    number in each box wide enough for it. Each panel's title gives its
    makespan and bubble fraction; each has its own x axis, in ms (in s when
    the makespan exceeds 10 s). Returns the path of the PNG.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("predicted", timeline), ("measured", measured)] if measured else [("", timeline)]
    pp = max(tl.pp for _, tl in panels)
    fig, axes = plt.subplots(len(panels), 1, sharey=True, squeeze=False,
                             figsize=(_WIDTH_IN, len(panels) * (1.4 + _ROW_HEIGHT_IN * pp)))
    try:
        for ax, (name, tl) in zip(axes[:, 0], panels):
            _draw(ax, tl, name)
        axes[0, 0].set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
        axes[0, 0].set_ylim(pp - 0.5, -0.5)          # shared: rank 0 on top in every panel
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=_DPI)
    finally:
        plt.close(fig)
    return out


def _draw(ax, tl: Timeline, name: str) -> None:
    """One panel: ``tl``'s events as boxes, one collection per (rank, kind, chunk) to stay fast."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scale, unit = (1.0, "s") if tl.makespan > 10 else (1e3, "ms")
    origin = min((e.start for e in tl.events), default=0.0)
    span = max(tl.makespan * scale, 1e-12)
    px_per_unit = _WIDTH_IN * 0.85 * _DPI / span
    colours = {"F": plt.get_cmap("Blues"), "B": plt.get_cmap("Oranges")}

    def shade(chunk: int) -> float:
        return 0.45 + 0.45 * chunk / max(tl.chunks - 1, 1)                       # later chunks darker

    def colour(kind: str, chunk: int) -> tuple:
        return colours[kind](shade(chunk))

    boxes: dict[tuple[int, str, int], list[tuple[float, float]]] = defaultdict(list)
    for e in tl.events:
        x, w = (e.start - origin) * scale, (e.end - e.start) * scale
        boxes[e.rank, e.kind, e.chunk].append((x, w))
        if w * px_per_unit >= _PX_PER_DIGIT * len(str(e.microbatch)) + 2:
            ax.text(x + w / 2, e.rank, str(e.microbatch), ha="center", va="center", fontsize=7,
                    color="white" if shade(e.chunk) > 0.7 else "black")
    for (rank, kind, chunk), ranges in boxes.items():
        ax.broken_barh(ranges, (rank - 0.4, 0.8), facecolors=colour(kind, chunk), edgecolors="white",
                       linewidth=0.3)
    facts = (f"makespan {tl.makespan * scale:.4g} {unit} (the forwards and backwards; a step adds the dp "
             f"reduction and the optimizer), bubble {tl.bubble_fraction:.1%}")
    ax.set_title(f"{name}: {facts}" if name else facts, fontsize=10)
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time ({unit})")
    suffix = (lambda c: f" chunk {c}") if tl.chunks > 1 else (lambda c: "")
    ax.legend(handles=[Patch(color=colour(kind, c), label=f"{word}{suffix(c)}")
                       for kind, word in (("F", "forward"), ("B", "backward")) for c in range(tl.chunks)],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
