"""What every benchmark shares: where results go, what is recorded with them,
and how ``benchmarks/README.md`` is regenerated from them.

A benchmark builds a result dict and calls :func:`save`::

    save("fidelity", {
        "params": {...},                     # what was run (sizes, strategies, cluster)
        "table": {"columns": [...], "rows": [[...], ...]},   # the table for the README
        "summary": {"spearman": 0.91, ...},  # headline numbers, one line each in the README
        "notes": ["what drives the error ...", ...],
        ...                                  # anything else (raw measurements)
    })

``save`` adds ``machine`` (host, CPU, cores, memory, GPU if any), ``versions``
(python, torch, autopar, git commit) and ``date``, writes
``benchmarks/results/<name>-<device>.json`` (device is ``cpu`` or the GPU's
name, so GPU runs sit beside CPU runs), and rewrites the README section of
that result between ``<!-- result:<file stem> -->`` and ``<!-- end -->``
(appending the section when it is new).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"


def device_tag() -> str:
    """``cpu`` here; ``gpu-<name>`` (e.g. ``gpu-nvidia-h100-80gb-hbm3``) on a CUDA machine."""
    import torch
    if torch.cuda.is_available():
        return "gpu-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")
    return "cpu"


def machine() -> dict[str, Any]:
    import torch
    info: dict[str, Any] = {"host": platform.node(), "platform": platform.platform(),
                            "cores": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def versions() -> dict[str, Any]:
    import torch

    import autopar
    v = {"python": platform.python_version(), "torch": torch.__version__, "autopar": autopar.__version__}
    try:
        v["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                                     text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        v["commit"] = None
    return v


def save(name: str, result: dict[str, Any], *, readme: bool = True) -> Path:
    """Write ``result`` (plus machine, versions, date) to ``results/<name>-<device>.json``
    and refresh its README section. Returns the path written."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{device_tag()}"
    full = {"benchmark": name, "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine(), "versions": versions(), **result}
    path = RESULTS / f"{stem}.json"
    path.write_text(json.dumps(full, indent=1, default=_jsonable) + "\n")
    if readme:
        update_readme(stem, full)
    return path


def timed_run(name: str, run: Any, quick: bool, save_result: bool = True, log: Any = print) -> dict[str, Any]:
    """Call ``run()`` (which returns a result dict), add ``params.quick`` and
    ``wall_s``, :func:`save` it unless ``save_result`` is false; return it."""
    t0 = time.perf_counter()
    result = run()
    result.setdefault("params", {})["quick"] = quick
    result["wall_s"] = time.perf_counter() - t0
    if save_result:
        path = save(name, result)
        log(f"wrote {path} ({result['wall_s']:.0f} s)")
    return result


def quick_cli(module: str, doc: str, quick: list[str], main: Any) -> None:
    """The command line of a benchmark with a ``--quick`` set of cases and
    ``--no-save``: ``main(quick, save_result=...)``."""
    import argparse
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"the quick cases ({', '.join(quick)})")
    ap.add_argument("--no-save", action="store_true", help="print only: write no result")
    args = ap.parse_args()
    main(args.quick, save_result=not args.no_save)


def each_case(keys: list[str], run: Any, failed: str = "error") -> list[dict[str, Any]]:
    """``run(key)`` for every key, each record printed as it comes with its
    ``wall_s``; a case that raises is a record ``{"case": key, failed: "Type:
    message"}`` (its traceback printed) and the others go on."""
    import traceback
    raw = []
    for key in keys:
        t0 = time.perf_counter()
        try:
            rec = run(key)
        except Exception as e:  # noqa: BLE001 - a failing case is a row
            traceback.print_exc()
            rec = {"case": key, failed: f"{type(e).__name__}: {e}"}
        rec["wall_s"] = round(time.perf_counter() - t0, 1)
        raw.append(rec)
        print(rec, flush=True)
    return raw


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def fmt(x: Any) -> str:
    """A table cell: floats to 3 significant digits, everything else as text."""
    if isinstance(x, bool) or x is None:
        return "" if x is None else ("yes" if x else "no")
    if isinstance(x, float):
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
            return f"{x:.3g}"
        return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    return str(x)


def markdown_section(stem: str, result: dict[str, Any]) -> str:
    m, v = result.get("machine", {}), result.get("versions", {})
    lines = [f"### {result.get('title', stem)}", "",
             f"`results/{stem}.json` — {result.get('date', '')}, {m.get('gpu') or m.get('cpu', '?')} "
             f"({m.get('cores', '?')} cores), torch {v.get('torch', '?')}, commit {v.get('commit', '?')}", ""]
    if result.get("description"):
        lines += [result["description"], ""]
    summary = result.get("summary") or {}
    for k, val in summary.items():
        lines.append(f"- **{k}**: {fmt(val)}")
    if summary:
        lines.append("")
    table = result.get("table")
    if table and table.get("rows"):
        cols = table["columns"]
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "|".join("---" for _ in cols) + "|")
        for row in table["rows"]:
            lines.append("| " + " | ".join(fmt(c) for c in row) + " |")
        lines.append("")
    for note in result.get("notes") or []:
        lines.append(f"- {note}")
    if result.get("notes"):
        lines.append("")
    if result.get("plot"):
        lines += [f"![{stem}]({result['plot']})", ""]
    return "\n".join(lines)


def update_readme(stem: str, result: dict[str, Any]) -> None:
    start, end = f"<!-- result:{stem} -->", "<!-- end -->"
    body = f"{start}\n{markdown_section(stem, result)}\n{end}"
    text = README.read_text() if README.exists() else "# Benchmarks\n\n## Results\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: body, text)
    else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    README.write_text(text)
