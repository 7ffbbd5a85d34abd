"""The ``autopar`` command: plan, evaluate, show, trace, zoo, presets, calibrate, import, export.

Every command that reports something takes ``--json`` and then writes only
JSON to stdout (progress bars and spinners go to stderr), so scripts can pipe
it. Tables, progress and errors are drawn with ``rich``. Every error autopar
raises on purpose (:class:`autopar.AutoparError`, a bad cluster) is printed as
one red paragraph without a traceback, and the command exits with code 2,
the same code as a usage error.
"""
from __future__ import annotations

import json
import sys
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import cost_models
from cost_models.memory import OPTIMIZERS

from . import __version__, units
from .errors import AutoparError
from .spec import zero_words

app = typer.Typer(
    name="autopar",
    help="Automatic parallelization planner for PyTorch: trace a model, predict strategies, "
         "search for the best one and write it as a plan.json.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# stdout for results, stderr for progress and errors (so --json output stays clean)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

EXIT_ERROR = 2
MODEL_HELP = ("Model string: a zoo family 'gpt:layers=2,hidden=64,...' (see `autopar zoo`) "
              "or a factory 'path/to/file.py:make' returning (model, example_inputs[, loss_fn, target]).")

# -------------------------------------------------------------------------------- options
ClusterOpt = typer.Option(..., "--cluster", "-c", help="Cluster preset (see `autopar presets`) or a cluster JSON file.")
DevicesOpt = typer.Option(..., "--devices", "-n", min=1, help="Number of devices (world size).")
BatchOpt = typer.Option(..., "--global-batch", "-b", min=1, help="Samples per optimizer step, over all devices.")
OptimizerOpt = typer.Option("adamw", "--optimizer", help=f"Optimizer whose state is counted: {', '.join(OPTIMIZERS)}.")
PrecisionOpt = typer.Option(None, "--precision", help="fp32, bf16 or fp16 (mixed = bf16; default: the cluster's).")
JsonOpt = typer.Option(False, "--json", help="Print JSON to stdout instead of tables.")
BatchDimOpt = typer.Option(0, "--batch-dim", min=0,
                           help="The dim of a factory's example inputs that holds the batch: 1 for [seq, batch, ...] "
                                "(PyTorch's nn.Transformer*, nn.MultiheadAttention, nn.LSTM by default).")


# -------------------------------------------------------------------------------- helpers
def _check_out_dir(path: Optional[Path], what: str) -> None:
    """Refuse an output file in a directory that does not exist before the
    work (a large search, minutes of calibration), not after it."""
    if path is not None and not path.parent.is_dir():
        _fail(f"cannot write the {what} to {str(path)!r}: the directory {str(path.parent)!r} does not exist")


def _fail(message: str) -> None:
    """Print one red error paragraph to stderr and exit with code 2."""
    err.print(f"[bold red]error:[/] [red]{escape(message)}[/]")
    raise typer.Exit(EXIT_ERROR)


@contextmanager
def _errors(hint: Callable[[Exception], str] | None = None) -> Iterator[None]:
    """Turn autopar's own errors into a clean message and exit code 2.

    Anything else (a bug, an exception inside a user's model factory) keeps
    its traceback: hiding it would hide where to look."""
    try:
        yield
    except (AutoparError, cost_models.ClusterError) as e:
        msg = str(e)
        extra = hint(e) if hint is not None else ""
        _fail(msg + (f"; {extra}" if extra else ""))


def _check_options(optimizer: str, precision: str | None) -> None:
    if optimizer not in OPTIMIZERS:
        _fail(f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    if precision is not None and precision not in ("fp32", "bf16", "fp16", "mixed"):
        _fail(f"precision {precision!r} is invalid; valid: fp32, bf16, fp16 (mixed = bf16)")


def _load_graph(model: str, quiet: bool = False, batch_dim: int = 0) -> Any:
    """Trace a model string with a spinner on stderr (its inputs' batch at ``batch_dim``).

    Zoo models are built with an example batch of 2 (as :func:`autopar.plan`
    does), so the batch dimension can be told apart from the others."""
    from .api import as_graph
    with _errors(), warnings.catch_warnings():
        # as_graph asks every model string for batch 2; a factory fixes its own batch, which is fine here
        warnings.filterwarnings("ignore", message=r"batch=\d+ is ignored for factory")
        if quiet or not err.is_terminal:
            return as_graph(model, batch_dim=batch_dim)
        with err.status(f"tracing [bold]{escape(model)}[/]"):
            return as_graph(model, batch_dim=batch_dim)


def _tp_hint(graph: Any, devices: int) -> Callable[[Exception], str]:
    """For a strategy error: the tensor-parallel sizes this model allows on
    ``devices`` (the strategy parser alone does not know the model)."""
    def hint(e: Exception) -> str:
        from .cost import tp_valid_sizes
        from .errors import StrategyError
        # only for the degree-vs-world errors of the parser, which cannot know the model
        if not isinstance(e, StrategyError) or "valid sizes" in str(e) or "devices" not in str(e):
            return ""
        sizes = [t for t in tp_valid_sizes(graph) if devices % t == 0]
        return f"valid sizes of tp for this model on {devices} devices: {', '.join(map(str, sizes))}"
    return hint


def _echo_json(obj: Any) -> None:
    # plain write: rich would wrap long lines and add colour codes
    sys.stdout.write(json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")


_gib, _seconds, _count = units.nbytes, units.seconds, units.count     # human units (autopar/units.py)


def _kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    t = Table(title=title, show_header=False, title_justify="left", title_style="bold")
    t.add_column("key", style="bold cyan", no_wrap=True)
    t.add_column("value")
    for k, v in rows:
        t.add_row(k, v)
    return t


# -------------------------------------------------------------------------------- app
def _version(value: bool) -> None:
    if value:
        typer.echo(f"autopar {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                        help="Print the version and exit.")) -> None:
    """Automatic parallelization planner for PyTorch."""


def _dur(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _print_explain(p, record) -> None:
    from .explain import explain as why
    e = why(p, record)
    s = e["search"]
    line = f"search: {s['mode']}"
    if "ilp_solves" in s:
        line += (f", {s.get('candidates', 0)} configurations, {s['ilp_solves']} ILP solves in {s['ilp_time_s']:.3g} s"
                 "; best placements per configuration came from "
                 + ", ".join(f"{k} {v}" for k, v in s["best_plan_per_config_from"].items()))
    out.print(escape(line))
    if e.get("configs"):
        t = Table(title="best configurations", title_justify="left")
        t.add_column("strategy", overflow="fold")          # the part that differs must show, never "..."
        for c in ("step time", "vs best", "peak memory"):
            t.add_column(c, no_wrap=True, justify="right")
        best = e["configs"][0]["step_time_s"]
        for c in e["configs"]:
            t.add_row(c["strategy"].replace(",", ", "), _dur(c["step_time_s"]), f"{c['step_time_s'] / best:.3f}x",
                      units.nbytes(c["peak_memory_gib"] * 2**30))
        out.print(t)
    if e.get("pipeline"):
        pl = e["pipeline"]
        out.print(escape(f"pipeline: {pl['schedule']}, layers per stage {pl['layers_per_stage']}, stage times "
                         f"{', '.join(_dur(x) for x in pl['stage_time_s'])}, bubble {pl['bubble_fraction']:.1%}, "
                         f"memory per rank {', '.join(units.nbytes(x * 2**30) for x in pl['memory_per_rank_gib'])}; "
                         f"{pl['note']}"))
    if e.get("ilp"):
        i = e["ilp"]
        out.print(f"ILP of the chosen configuration: {i['decisions']} decisions for {i['nodes']} nodes "
                  f"(repeated layers share theirs), {i['variables']} variables, {i['constraints']} constraints; "
                  f"built in {i['build_s'] * 1e3:.3g} ms, solved in {i['solve_s'] * 1e3:.3g} ms ({i['status']})"
                  + (", under the memory bound" if i["memory_bound"] else ""))
    for label, g in e["groups"].items():
        t = Table(title=label, title_justify="left")
        for c in ("op", "module", "chosen", "runners-up (extra time per step)"):
            t.add_column(c, overflow="fold")
        for r in g["ops"]:
            alts = ", ".join(f"{a['strategy']}->{a['out']} +{_dur(a['extra_s_per_step'])}"
                             if a["extra_s_per_step"] != float("inf") else f"{a['strategy']} (infeasible)"
                             for a in r.get("runners_up", []))
            t.add_row(f"{r['node']} [{r['kind']}]", r["module"], f"{r['strategy']} -> {r['out']}", escape(alts))
        out.print(t)
    if e.get("note"):
        out.print(escape(e["note"]))


def _parse_pins(items: list[str]) -> dict[str, str]:
    """``--pin NAME=PLACEMENT`` options as a dict; a malformed one, or a name
    pinned twice to different placements, is an error in words."""
    shardings: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            _fail(f"--pin {item!r}: expected NAME=PLACEMENT, e.g. blocks.0.mlp.fc.weight=S(0)")
        key, value = key.strip(), value.strip()
        if key in shardings and shardings[key] != value:
            _fail(f"--pin {key}: pinned twice, to {shardings[key]} and to {value}; keep one")
        shardings[key] = value
    return shardings


@contextmanager
def _search_progress(quiet: bool) -> Iterator[Callable[[int, int], None]]:
    """A progress callback for the search: a bar on a terminal, one line per
    quarter on stderr when piped (none with ``quiet``)."""
    progress = Progress(TextColumn("searching dp x tp x microbatches x recompute x zero"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), console=err, transient=True,
                        disable=not err.is_terminal)
    with progress:
        task = progress.add_task("search", total=None)
        t0, shown = time.perf_counter(), [-1]

        def tick(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)
            quarter = 4 * done // max(total, 1)     # piped: one line per quarter, not a bar
            if not err.is_terminal and not quiet and quarter > shown[0]:
                shown[0] = quarter
                err.print(f"searching: {done}/{total} configurations ({time.perf_counter() - t0:.1f} s)")

        yield tick


def _write_plan(p: Any, record: Any, out_path: Optional[Path], html_out: Optional[Path]) -> None:
    """Write the plan JSON to ``out_path`` and its HTML report to ``html_out``
    (each when given)."""
    if out_path is not None:
        try:
            p.save(out_path)
        except OSError as e:
            _fail(f"cannot write the plan to {str(out_path)!r}: {e.strerror or e}")
    if html_out is not None:
        from .explain import explain as why
        from .report import html_report
        with _errors():
            html_report(p, html_out, explained=why(p, record))
        err.print(f"report written to {escape(str(html_out))}")


@app.command()
def plan(
    model: str = typer.Argument(..., help=MODEL_HELP),
    cluster: str = ClusterOpt,
    devices: int = DevicesOpt,
    global_batch: int = BatchOpt,
    strategy: str = typer.Option("auto", "--strategy", "-s",
                                 help="'auto' (search) or a manual strategy, e.g. 'dp=2,tp=4,microbatches=2'."),
    optimizer: str = OptimizerOpt,
    precision: Optional[str] = PrecisionOpt,
    plain: bool = typer.Option(False, "--plain", "--executable-only",
                               help="Search the plain strategies only: no recompute, ZeRO, sequence parallelism "
                                    "or offload (--executable-only is its former name)."),
    out_path: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the plan JSON to this file."),
    search_mode: Optional[str] = typer.Option(
        None, "--search-mode", "-m",
        help="How per-op placements are searched: dynamic_programming (the ILP; default with --strategy auto), "
             "sharding_propagation (from --pin), recursive_programming (fast greedy), grid (Megatron-style only). "
             "With a manual --strategy, searches the placements on that mesh."),
    pin: Optional[list[str]] = typer.Option(
        None, "--pin", help="Pin a placement on the tensor-parallel axis, e.g. 'blocks.0.mlp.fc.weight=S(0)' "
                            "or 'blocks.0.attn=R' (a module's output). Repeatable."),
    explain: bool = typer.Option(False, "--explain",
                                 help="Show why: per layer group the chosen placements and the runners-up with "
                                      "their predicted cost, the best configurations, the ILP's size and time."),
    solver: str = typer.Option(
        "highs", "--solver",
        help="MILP solver of the per-op ILP: highs (default) or, through PuLP (pip install 'autopar[pulp]'), "
             "pulp:CBC, pulp:GLPK, pulp:GUROBI, pulp:CPLEX."),
    html_out: Optional[Path] = typer.Option(None, "--html", help="Also write the plan as one self-contained HTML "
                                            "page, with the search's runners-up."),
    as_json: bool = JsonOpt,
    tp_modes: str = typer.Option("1d", "--tp-modes",
                                 help="Tensor-parallel layouts the search tries, comma-separated: 1d (default), "
                                      "or 1d,2d to add Colossal-AI's q x q grids (tp_mode=2d), 1d,2d,2.5d also them 2 and "
                                      "4 deep (tp_mode=2.5d), 3d for the q x q x q cubes (tp_mode=3d), and mesh for a tp "
                                      "group as a two-axis mesh whose placements one program decides (tp_mode=mesh; mesh3 on three "
                                      "axes)."),
    batch_dim: int = BatchDimOpt,
) -> None:
    """Search for the best strategy (or take a manual one) and print the plan."""
    from .api import plan_and_record as make_plan
    _check_options(optimizer, precision)
    shardings = _parse_pins(pin or [])
    _check_out_dir(out_path, "plan")
    _check_out_dir(html_out, "report")
    graph = _load_graph(model, quiet=as_json, batch_dim=batch_dim)
    with _errors(_tp_hint(graph, devices)):
        if strategy == "auto":
            with _search_progress(quiet=as_json) as tick:
                p, record = make_plan(graph, cluster=cluster, devices=devices, global_batch=global_batch,
                                      strategy="auto", optimizer=optimizer, precision=precision,
                                      memory_options=not plain, progress=tick, search_mode=search_mode,
                                      shardings=shardings, solver=solver,
                                      tp_modes=tuple(m.strip() for m in tp_modes.split(",") if m.strip()))
        else:
            p, record = make_plan(graph, cluster=cluster, devices=devices, global_batch=global_batch,
                                  strategy=strategy, optimizer=optimizer, precision=precision,
                                  search_mode=search_mode, shardings=shardings, solver=solver)
    _write_plan(p, record, out_path, html_out)
    if as_json:
        if explain:
            from .explain import explain as why
            sys.stdout.write(json.dumps({"plan": p.to_dict(), "explain": why(p, record)}, indent=1,
                                        default=float))
        else:
            sys.stdout.write(p.to_json())
        return
    typer.echo(p.summary(max(out.width, 100)).rstrip("\n"))
    if explain:
        _print_explain(p, record)
    if out_path is not None:
        out.print(f"plan written to [bold]{escape(str(out_path))}[/]  (inspect it with `autopar show "
                  f"{escape(str(out_path))}`)")


@app.command()
def evaluate(
    model: str = typer.Argument(..., help=MODEL_HELP),
    cluster: str = ClusterOpt,
    devices: int = DevicesOpt,
    strategy: str = typer.Option(..., "--strategy", "-s", help="Manual strategy, e.g. 'dp=2,tp=4'."),
    global_batch: int = BatchOpt,
    optimizer: str = OptimizerOpt,
    precision: Optional[str] = PrecisionOpt,
    as_json: bool = JsonOpt,
    batch_dim: int = BatchDimOpt,
) -> None:
    """Predict step time and memory of one manual strategy."""
    from .api import evaluate as estimate
    _check_options(optimizer, precision)
    if strategy == "auto":
        _fail("evaluate takes a manual strategy such as 'dp=2,tp=2'; use `autopar plan` to search")
    graph = _load_graph(model, quiet=as_json, batch_dim=batch_dim)
    with _errors(_tp_hint(graph, devices)):
        est = estimate(graph, cluster=cluster, devices=devices, strategy=strategy, global_batch=global_batch,
                       optimizer=optimizer, precision=precision)
    if as_json:
        _echo_json(est.to_dict())
        return
    fits = "[green]fits[/]" if est.fits else "[bold red]DOES NOT FIT[/]"
    rows = [
        ("model", escape(graph.name)),
        ("strategy", est.strategy),
        ("devices", f"{est.devices}  (global batch {est.global_batch}, {est.precision}, {est.optimizer})"),
        ("step time", f"[bold]{_seconds(est.step_time_s)}[/]"),
        ("  compute", _seconds(est.compute_time_s)),
        ("  tp comm", _seconds(est.tp_comm_time_s)),
        ("  dp comm", _seconds(est.dp_comm_time_s)),
        ("  optimizer", _seconds(est.optimizer_time_s)),
        ("throughput", f"{units.flops_rate(est.tflops_per_device * 1e12)} per device"),
        ("peak memory", f"[bold]{_gib(est.peak_memory_bytes)}[/] of {_gib(est.device_memory_bytes)}  ({fits})"),
    ]
    rows += [(f"  {k}", _gib(v)) for k, v in est.memory.items()]
    if est.pipeline:
        pl = est.pipeline
        rows.append(("pipeline", f"{pl['schedule']}, layers per stage {pl['layers']} (even, as written), "
                                 f"bubble {pl['bubble_fraction']:.1%}"))
    out.print(_kv_table(f"autopar evaluate: {escape(est.strategy)} (predicted)", rows))


@app.command()
def diff(
    a: Path = typer.Argument(..., help="The plan to compare from (JSON, from `autopar plan --out`)."),
    b: Path = typer.Argument(..., help="The plan to compare to."),
    limit: int = typer.Option(12, "--limit", min=0, help="Changed templates to list per section (0: all)."),
    as_json: bool = JsonOpt,
) -> None:
    """What changed between two plans, and what it does to the predictions.
    Exit code 0 when they are identical, 1 when they differ, 2 on an error."""
    from .plan import Plan
    with _errors():
        d = Plan.load(a).diff(Plan.load(b))
    if as_json:
        _echo_json(d)
    elif d["identical"]:
        out.print(f"{escape(str(a))} and {escape(str(b))} are the same plan")
    else:
        out.print(_kv_table(f"autopar diff: {escape(str(a))} -> {escape(str(b))}", _diff_rows(d, limit)))
    raise typer.Exit(0 if d["identical"] else 1)


def _placements_text(v: Any) -> str:
    """A parameter's placements on (dp, tp) (``R,S(0)``) or an op's strategies
    and output placements (``batch0,colwise (S(0),S(2))``)."""
    if v is None:
        return "absent"
    if isinstance(v, dict):
        return f"{','.join(v['strategy'])} ({','.join(v['out'])})"
    return ",".join(v)


def _signed(fmt: Callable[[float], str], x: float) -> str:
    return ("+" if x > 0 else "") + fmt(x)


def _diff_rows(d: dict[str, Any], limit: int) -> list[tuple[str, str]]:
    """The rows of ``autopar diff``'s table (``d``: :meth:`autopar.plan.Plan.diff`)."""
    rows = [("model", "the same" if d["same_model"] else "DIFFERENT models (fingerprints differ)")]
    rows += [(k, f"{x} -> {y}") for k, (x, y) in d["request"].items()]
    rows += [(k, f"{x} -> {y}") for k, (x, y) in d["parallel"].items()] or [("strategy", "the same")]
    rows += [(f"pipeline {k}", f"{x} -> {y}") for k, (x, y) in d["pipeline"].items()]
    for what in ("params", "ops"):
        c = d[what]
        if c["changed"] is None:
            rows.append((what, c["note"]))
            continue
        rows.append((what, f"{c['changed']} of {c['of']} placed otherwise"))
        shown = c["templates"] if limit == 0 else c["templates"][:limit]
        rows += [(f"  {escape(t['pattern'])}", f"{_placements_text(t['from'])}  ->  {_placements_text(t['to'])}"
                  + (f"  (x{t['count']})" if t["count"] > 1 else "")) for t in shown]
        if len(shown) < len(c["templates"]):
            rows.append(("", f"[dim]... and {len(c['templates']) - len(shown)} more (--limit 0 shows all)[/]"))
    for k, ch in d["predicted"].items():
        f = _prediction_format(k)
        delta = (f"  ({_signed(f, ch['delta'])}" + (f", {ch['relative']:+.1%}" if ch["relative"] is not None else "")
                 + ")") if "delta" in ch else ""
        rows.append((_PREDICTION_LABELS.get(k, k.replace("memory.", "  memory ")), f"{f(ch['from'])} -> {f(ch['to'])}"
                     + delta))
    if d["other"]:
        rows.append(("also differs", ", ".join(d["other"])))
    return rows


def _prediction_format(key: str) -> Callable[[Any], str]:
    """How ``autopar diff`` writes a prediction of ``key``: human units, the fit in words."""
    if key.endswith("_bytes") or key.startswith("memory."):
        return units.nbytes
    if key == "tflops_per_device":
        return lambda v: units.flops_rate(v * 1e12)
    if key == "fits":
        return lambda v: "fits" if v else "does not fit"
    return units.seconds if key.endswith("_s") else str


_PREDICTION_LABELS = {"step_time_s": "step time", "compute_time_s": "compute", "tp_comm_time_s": "tp comm",
                      "dp_comm_time_s": "dp comm", "cp_comm_time_s": "cp comm", "optimizer_time_s": "optimizer",
                      "peak_memory_bytes": "peak memory per device", "host_memory_bytes": "host memory",
                      "tflops_per_device": "per device", "fits": "fits"}


@app.command()
def show(
    path: Path = typer.Argument(..., help="A plan JSON file written by `autopar plan --out`."),
    limit: int = typer.Option(20, "--limit", min=0, help="Parameter patterns to list (0: all)."),
    timeline: Optional[Path] = typer.Option(None, "--timeline", help="Draw the predicted pipeline schedule into this PNG."),
    html_out: Optional[Path] = typer.Option(None, "--html", help="Write the plan as one self-contained HTML page "
                                            "(summary, memory bars, timeline, placements)."),
    as_json: bool = JsonOpt,
) -> None:
    """Print a saved plan: summary, parameter placements, op strategies."""
    from .plan import Plan
    _check_out_dir(html_out, "report")
    with _errors():
        p = Plan.load(path)
        if timeline is not None:
            from .pipeline.timeline import plot_timeline, predicted_timeline
            plot_timeline(predicted_timeline(p), timeline, title=p.strategy)
        if html_out is not None:
            from .report import html_report
            html_report(p, html_out)
            err.print(f"report written to {escape(str(html_out))}")
    if as_json:
        sys.stdout.write(p.to_json())
        return
    typer.echo(p.summary(max(out.width, 100)).rstrip("\n"))
    if timeline is not None:
        out.print(f"predicted pipeline timeline written to [bold]{escape(str(timeline))}[/]")
    axes = p.placement_axes()   # placements are per (dp, tp); a mesh's tp column holds each of its axes
    params: dict[str, list[str]] = p.data["params"]

    # placement pairs: how many parameter tensors sit where
    by_pair = Counter(tuple(v) for v in params.values())
    t = Table(title="parameter placements", title_justify="left", title_style="bold")
    for a in axes:
        t.add_column(a)
    t.add_column("tensors", justify="right")
    t.add_column("e.g.")
    for pair, n in sorted(by_pair.items(), key=lambda kv: (-kv[1], kv[0])):
        example = next(k for k, v in params.items() if tuple(v) == pair)
        t.add_row(*pair, str(n), escape(example))
    out.print(t)
    words = zero_words(p.parallel)
    if words:     # the dp column is the layout the tp program sees
        out.print(f"[dim]Besides: {words}, whatever the dp column says[/]")

    # per parameter, repeated layers collapsed (blocks.0, blocks.1 ... -> blocks.*)
    patterns: dict[str, dict[tuple, int]] = {}
    pattern = p.patterns()
    for name, pl in params.items():
        patterns.setdefault(pattern(name), Counter())[tuple(pl)] += 1
    t = Table(title="placement per parameter (repeated layers collapsed)", title_justify="left",
              title_style="bold")
    t.add_column("parameter")
    for a in axes:
        t.add_column(a)
    t.add_column("tensors", justify="right")
    rows = [(pat, pair, n) for pat, pairs in patterns.items() for pair, n in pairs.items()]
    shown = rows if limit == 0 else rows[:limit]
    for pat, pair, n in shown:
        t.add_row(escape(pat), *(("[yellow]" + x + "[/]") if x != "R" else x for x in pair), str(n))
    out.print(t)
    if len(shown) < len(rows):
        out.print(f"[dim]... and {len(rows) - len(shown)} more (--limit 0 shows all)[/]")

    # op strategies on each axis
    ops = p.data["ops"]
    if ops:
        t = Table(title="op strategies", title_justify="left", title_style="bold")
        t.add_column("axis")
        t.add_column("strategy")
        t.add_column("ops", justify="right")
        for i, a in enumerate(axes):
            c = Counter(e["strategy"][i] for e in ops.values() if i < len(e["strategy"]))
            for name, n in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])):
                t.add_row(a, name, str(n))
        kernels = Counter(e["kernel"] for e in ops.values() if "kernel" in e)
        for k, n in sorted(kernels.items()):
            t.add_row("kernel", k, str(n))
        out.print(t)


@app.command()
def trace(
    model: str = typer.Argument(..., help=MODEL_HELP),
    as_json: bool = JsonOpt,
    batch_dim: int = BatchDimOpt,
) -> None:
    """Trace a model and summarise its graph: nodes, parameters, FLOPs, repeated layers, op kinds."""
    graph = _load_graph(model, quiet=as_json, batch_dim=batch_dim)
    s = graph.summary()
    if as_json:
        _echo_json(s)
        return
    front = s["frontend"]
    if s.get("fallback_reason"):    # what happened and what it costs: only tracing time, every strategy runs
        front += (f" (symbolic torch.fx failed: {escape(s['fallback_reason'].splitlines()[0])}; torch.export "
                  "traced it instead, slower to trace, every strategy runs)")
    out.print(_kv_table("autopar trace", [
        ("model", escape(s["name"])),
        ("frontend", front),
        ("nodes", str(s["nodes"])),
        ("parameters", f"{_count(s['params'])}  ({s['params']:,})"),
        ("forward FLOPs", f"{_count(s['forward_flops'])}  (example batch {s['batch_size']})"),
        ("fingerprint", s["fingerprint"]),
    ]))
    if s["groups"]:
        t = Table(title="repeated layers", title_justify="left", title_style="bold")
        t.add_column("group")
        t.add_column("instances", justify="right")
        t.add_column("nodes each", justify="right")
        for g in s["groups"]:
            t.add_row(escape(g["name"]), str(g["instances"]), str(g["nodes_per_instance"]))
        out.print(t)
    t = Table(title="op kinds", title_justify="left", title_style="bold")
    t.add_column("kind")
    t.add_column("nodes", justify="right")
    for k, n in sorted(s["kinds"].items(), key=lambda kv: (-kv[1], kv[0])):
        t.add_row(k, str(n))
    out.print(t)


@app.command()
def zoo(as_json: bool = JsonOpt) -> None:
    """List the built-in model families and their keys with defaults."""
    from . import zoo as zoo_
    fams = zoo_.families()
    if as_json:
        _echo_json(fams)
        return
    t = Table(title="model families  (use as FAMILY:key=value,...)", title_justify="left", title_style="bold")
    t.add_column("family", style="bold cyan")
    t.add_column("keys (defaults)")
    def shown(name: str, k: str, v: object) -> object:
        if name == "gpt" and k == "ffn" and v is None:
            return "4*hidden"
        return zoo_.PLAN_BATCH if k == "batch" else v    # what plan / evaluate / trace build a string at

    for name, keys in fams.items():
        t.add_row(name, ", ".join(f"{k}={shown(name, k, v)}" for k, v in keys.items()))
    out.print(t)
    out.print("example: [bold]gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128[/]  "
              "or a factory: [bold]path/to/file.py:make[/]")
    out.print("a Hugging Face checkpoint's own config.json (a directory, the file or a Hub id): "
              "[bold]hf:PATH[,seq=N,batch=N,FIELD=VALUE...][/]")
    out.print(f"batch: the example batch a model string is traced at ({zoo_.PLAN_BATCH}, so the batch dim is "
              "told apart from the others); the global batch is --global-batch")


@app.command()
def presets(as_json: bool = JsonOpt) -> None:
    """List the cluster presets: device, memory, devices per node, links."""
    rows = []
    with _errors():
        for name in cost_models.list_presets():
            c = cost_models.load_cluster(name)
            rows.append({
                "name": name,
                "device": c.device.name,
                "memory_bytes": c.device.memory_bytes,
                "peak_tflops": c.device.peak_flops.get(c.compute_dtype, 0.0) / 1e12,
                "compute_dtype": c.compute_dtype,
                "devices_per_node": c.devices_per_node,
                "max_nodes": c.max_nodes,
                "intra_node_gb_s": c.intra_node.bandwidth / 1e9,
                "inter_node_gb_s": c.inter_node.bandwidth / 1e9,
                "default_precision": c.default_precision,
                "description": c.description,
            })
    if as_json:
        _echo_json(rows)
        return
    t = Table(title="cluster presets  (--cluster NAME, or a path to a cluster JSON file)", title_justify="left",
              title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("preset", style="bold cyan", no_wrap=True)
    t.add_column("device", no_wrap=True)
    t.add_column("memory", justify="right", no_wrap=True)
    t.add_column("TFLOP/s", justify="right", no_wrap=True)
    t.add_column("per node", justify="right", no_wrap=True)
    t.add_column("links GB/s", justify="right", no_wrap=True)
    for r in rows:
        dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(r["compute_dtype"], r["compute_dtype"])
        t.add_row(r["name"], r["device"], f"{r['memory_bytes'] / 2**30:.3g} GiB", f"{r['peak_tflops']:.4g} {dtype}",
                  str(r["devices_per_node"]), f"{r['intra_node_gb_s']:.3g} / {r['inter_node_gb_s']:.3g}")
    out.print(t)
    out.print("[dim]TFLOP/s: dense peak in the default precision; per node: devices per node; "
              "links: bandwidth per device inside / across nodes[/]")


@app.command()
def calibrate(
    out_path: Path = typer.Option(..., "--out", "-o", help="Write the calibrated cluster JSON to this file."),
    quick: bool = typer.Option(False, "--quick", help="Fewer sizes and repetitions (about a minute on 2 cores)."),
    procs: Optional[int] = typer.Option(None, "--procs", "-p", min=1,
                                        help="Processes that run at once, one per device "
                                             "(default: 4 on CPU, every GPU on CUDA)."),
    base: Optional[str] = typer.Option(None, "--base",
                                       help="Preset or cluster file whose unmeasured values are kept "
                                            "(default: cpu; on CUDA dgx-h100, or dgx-a100-80g on an A100)."),
    as_json: bool = JsonOpt,
) -> None:
    """Measure this machine (matmul, memory, collectives) and write a cluster file for --cluster."""
    from .calibrate import KINDS
    from .calibrate import calibrate as run_calibration
    _check_out_dir(out_path, "cluster")
    t0 = time.perf_counter()
    interactive = err.is_terminal
    progress = Progress(TextColumn("[bold]calibrating[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=err, transient=True, disable=not interactive)
    phase = [""]

    def tick(done: int, total: int, what: str) -> None:
        progress.update(task, completed=done, total=total, description=escape(what))
        # without a terminal: one status line per phase (matmul, kernel, memory, each collective)
        name = what.split()[0] if not what.startswith(("all_", "reduce_", "send_", "broadcast")) else \
            " ".join(what.split()[:3])
        if not interactive and name != phase[0]:
            phase[0] = name
            err.print(f"calibrating: {escape(what)}  ({done}/{total}, {time.perf_counter() - t0:.0f} s)")

    with _errors(), progress:
        task = progress.add_task("starting the processes", total=None)
        if not interactive:
            err.print(f"calibrating: starting {procs or 'the'} processes")
        cluster = run_calibration(quick=quick, procs=procs, base=base, progress=tick)
    try:
        out_path.write_text(json.dumps(cluster, indent=2, sort_keys=True) + "\n")
    except OSError as e:
        _fail(f"cannot write the cluster to {str(out_path)!r}: {e.strerror or e}")
    with _errors():
        cost_models.load_cluster(out_path)     # what was written loads back
    elapsed = time.perf_counter() - t0
    if as_json:
        _echo_json(cluster)
        return
    dev = cluster["device"]
    rows = [("cluster", f"{escape(cluster['name'])}  ({escape(cluster['device']['name'])})")]
    rows += [(f"peak {dt}", f"{v / 1e9:.4g} GFLOP/s") for dt, v in dev["peak_flops"].items()]
    rows += [
        ("matmul efficiency", f"{dev['matmul_efficiency']:.3f}"),
        ("kernel overhead", _seconds(dev["kernel_overhead_s"])),
        ("memory bandwidth", f"{dev['memory_bandwidth'] / 1e9:.4g} GB/s"),
        ("memory efficiency", f"{dev['memory_efficiency']:.3f}"),
        ("intra-node link", f"{_seconds(cluster['intra_node']['latency'])} latency, "
                            f"{cluster['intra_node']['bandwidth'] / 1e9:.4g} GB/s"),
        ("time", f"{elapsed:.0f} s"),
    ]
    out.print(_kv_table("autopar calibrate (per process, all running at once)", rows))
    fits = cluster.get("collectives", {}).get("intra_node", {})
    if fits:
        sizes = sorted({int(g) for per in fits.values() for g in per})
        t = Table(title="collectives: alpha, 1/beta  (time = alpha + beta * nbytes)",
                  title_justify="left", title_style="bold")
        t.add_column("collective")
        for g in sizes:
            t.add_column(f"group {g}", justify="right")
        for kind in sorted(fits, key=lambda k: KINDS.index(k) if k in KINDS else len(KINDS)):
            cells = []
            for g in sizes:
                f = fits[kind].get(str(g))
                cells.append("" if f is None else f"{_seconds(f['alpha'])}, "
                             + (f"{1 / f['beta'] / 1e9:.3g} GB/s" if f["beta"] else "∞ GB/s"))
            t.add_row(kind, *cells)
        out.print(t)
    else:
        out.print("[dim]no collectives measured (one process); the base's link values are kept[/]")
    out.print(f"cluster written to [bold]{escape(str(out_path))}[/]  (use it with `--cluster "
              f"{escape(str(out_path))}`)")


# -------------------------------------------------------------------------------- other frameworks' configs
def _notes(notes: Any, label: str) -> None:
    for n in notes:
        err.print(f"[yellow]{label}:[/] {escape(n)}")


@app.command("import")
def import_config(
    fmt: str = typer.Argument(..., metavar="FORMAT", help="colossal, mindformers or torchtitan."),
    path: Path = typer.Argument(..., help="The config: a Colossal-AI Python file (read with ast, never run), a "
                                          "MindFormers YAML or a torchtitan TOML."),
    devices: int = DevicesOpt,
    evaluate_model: Optional[str] = typer.Option(None, "--evaluate", metavar="MODEL",
                                                 help="Predict the imported strategy on MODEL (as `autopar evaluate`)."),
    plan_model: Optional[str] = typer.Option(None, "--plan", metavar="MODEL",
                                             help="Plan MODEL with the imported strategy (as `autopar plan`; a "
                                                  "search for MindFormers' parallel_mode 2)."),
    cluster: Optional[str] = typer.Option(None, "--cluster", "-c", help="With --evaluate / --plan: cluster preset "
                                                                         "or cluster JSON file."),
    global_batch: Optional[int] = typer.Option(None, "--global-batch", "-b", min=1,
                                               help="With --evaluate / --plan: samples per optimizer step."),
    optimizer: str = OptimizerOpt,
    precision: Optional[str] = PrecisionOpt,
    out_path: Optional[Path] = typer.Option(None, "--out", "-o", help="With --plan: write the plan JSON here."),
    pin: Optional[list[str]] = typer.Option(None, "--pin", help="With --plan: pin a placement as in `autopar plan` "
                                                                "(sharding_propagation starts from the pins)."),
    as_json: bool = JsonOpt,
) -> None:
    """Read a Colossal-AI, MindFormers or torchtitan config as an autopar strategy (notes on stderr)."""
    from . import compat
    if fmt not in compat.FORMATS:
        _fail(f"unknown config format {fmt!r}; valid: {', '.join(compat.FORMATS)}")
    with _errors():
        got = compat.READERS[fmt](path, devices)
    _notes(got.notes, "note")
    model = evaluate_model or plan_model
    if model is None:
        if as_json:
            _echo_json({"strategy": got.strategy, "search_mode": got.search_mode, "notes": list(got.notes),
                        "parallel": None if got.config is None else got.config.as_dict()})
        else:
            typer.echo(got.strategy)
            if got.search_mode:
                err.print(f"search mode: {got.search_mode} (autopar plan --search-mode {got.search_mode})")
        return
    if evaluate_model and plan_model:
        _fail("give --evaluate or --plan, not both")
    if cluster is None or global_batch is None:
        _fail(f"--{'evaluate' if evaluate_model else 'plan'} needs --cluster and --global-batch")
    if not as_json:
        out.print(f"imported strategy: [bold]{escape(got.strategy)}[/]")
    if evaluate_model:
        if got.config is None:
            _fail("this config asks for a search (parallel_mode 2): there is no fixed strategy to evaluate; "
                  "use --plan")
        evaluate(model=model, cluster=cluster, devices=devices, strategy=got.strategy, global_batch=global_batch,
                 optimizer=optimizer, precision=precision, as_json=as_json, batch_dim=0)
        return
    plan(model=model, cluster=cluster, devices=devices, global_batch=global_batch, strategy=got.strategy,
         optimizer=optimizer, precision=precision, plain=False, out_path=out_path, search_mode=got.search_mode,
         pin=pin, explain=False, solver="highs", html_out=None, as_json=as_json, tp_modes="1d", batch_dim=0)


@app.command()
def export(
    source: str = typer.Argument(..., help="A plan JSON file (`autopar plan --out`), or a strategy such as "
                                           "'dp=2,tp=4' (with --devices)."),
    fmt: str = typer.Option("json", "--format", "-f", help="colossal, mindformers, torchtitan or json."),
    devices: Optional[int] = typer.Option(None, "--devices", "-n", min=1,
                                          help="For a strategy: the world size (a missing dp is inferred)."),
    global_batch: Optional[int] = typer.Option(None, "--global-batch", "-b", min=1,
                                               help="torchtitan, for a strategy: the batch, to write the batch and "
                                                    "microbatch sizes (a plan has its own)."),
    out_path: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the config to this file."),
) -> None:
    """Write a plan or strategy as a Colossal-AI, MindFormers or torchtitan config (what is lost on stderr)."""
    from . import compat
    from .plan import Plan
    from .spec import parse_strategy
    if fmt not in (*compat.FORMATS, "json"):
        _fail(f"unknown format {fmt!r}; valid: {', '.join(compat.FORMATS)}, json")
    if global_batch is not None and fmt != "torchtitan":
        _fail("--global-batch is for --format torchtitan (the other formats carry no batch size)")
    with _errors():
        what = Plan.load(source) if source.endswith(".json") or Path(source).is_file() else \
            parse_strategy(source, devices)
        if fmt == "json":
            cfg = what.config if isinstance(what, Plan) else what
            text, notes = json.dumps({"strategy": cfg.to_string(), "parallel": cfg.as_dict()}, indent=1,
                                     sort_keys=True) + "\n", ()
        else:
            kw = {"global_batch": global_batch} if fmt == "torchtitan" else {}
            exported = compat.WRITERS[fmt](what, **kw)
            text, notes = exported.text, exported.notes
    _notes(notes, "lost")
    if out_path is None:
        sys.stdout.write(text)
        return
    try:
        out_path.write_text(text)
    except OSError as e:
        _fail(f"cannot write the config to {str(out_path)!r}: {e.strerror or e}")
    err.print(f"{fmt} config written to [bold]{escape(str(out_path))}[/]")


def main() -> None:
    """Console-script entry point (``autopar``; ``python -m autopar``)."""
    app(prog_name="autopar")


if __name__ == "__main__":
    main()
