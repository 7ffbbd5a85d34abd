"""Checkpoints any other plan or world size can load: ``save`` / ``load`` of a
:class:`~autopar.runtime.parallel.ParallelModule`, and :func:`load_full_state_dict`.

The saved form knows nothing of the plan that wrote it. It is a
``torch.distributed.checkpoint`` (DCP) directory holding

* ``model/<key>``: every entry of the original model's ``state_dict()`` as
  its logical full tensor (the fp32 master weights where the distributed
  optimizer keeps them apart from bf16/fp16 parameters);
* ``optim/<key>/<state>``: the optimizer state of parameter ``<key>`` (its
  first ``state_dict`` key; ``exp_avg``, ``momentum_buffer``, ``step``...),
  elementwise state as the parameter's full logical tensor, scalars as they are;

and ``autopar.json``: the format version, the model's name and fingerprint,
the strategy and world that wrote it, the step count, the fp16 loss scale,
the LR scheduler's ``state_dict``, the optimizer's class and its param
groups' hyperparameters by parameter name. That file is written last: a directory without it is no checkpoint.

How, in this first version: every rank assembles the full logical tensors of
the parameters it holds (tensor-parallel shards gathered over tp, ZeRO-1/2
master and state shards and FSDP2 shards over dp) and DCP writes each once
(it de-duplicates the copies several ranks hold and spreads the writes over
the ranks); on load every rank reads the full tensors of the parameters it
holds and keeps its shard. So saving and loading need, on each rank, host
memory for the full weights and optimizer state of that rank's pipeline
stages (not 1/(dp*tp) of them); writing sharded DTensors instead would remove
that and keep the same format.

Writes are atomic: all ranks write into ``.<name>.tmp`` beside ``path``, then
rank 0 moves the previous checkpoint aside to ``.<name>.old``, renames the new
one into place and deletes the old one. A failure while writing leaves the
previous checkpoint as it was; a crash between the two renames leaves it at
``.<name>.old``, where :func:`load` and :func:`load_full_state_dict` find it.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..spec import is_shard, local_chunk, shard_blocks, shard_dim, unblock
from . import collectives as C
from .collectives import _all_gather_single
from .regions import full_tensor

__all__ = ["save", "load", "load_full_state_dict", "FORMAT", "META"]

FORMAT = 1
META = "autopar.json"

#: how the DCP files are written (tests replace it to inject a failure)
storage_writer: Callable[[Path], Any] = lambda path: _dcp().FileSystemWriter(path)


def _dcp():
    import torch.distributed.checkpoint as dcp
    return dcp


def _cause(e: BaseException) -> str:
    """One line naming what failed: DCP raises a ``CheckpointException``
    (a ``BaseException``) holding each failed rank's exception; a Ctrl-C is
    re-raised (importing DCP just to name its exception costs a second)."""
    if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise e
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {type(x[0]).__name__}: {x[0]}" for r, x in sorted(failures.items()))
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _on_rank0(fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on rank 0 and make every rank raise :class:`CheckpointError`
    when it failed (collective)."""
    err = None
    if _rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported on every rank
            err = f"{type(e).__name__}: {e}"
    if _dist() and dist.get_world_size() > 1:
        box = [err]
        dist.broadcast_object_list(box, src=0)
        err = box[0]
    if err:
        raise CheckpointError(f"{what}: {err}")


# ----------------------------------------------------------------------------- this rank's tensors
#: how a tensor is split over the tensor axes: (dim, axis size, this rank's coordinate, group, blocks) per
#: axis that splits it (the tp axis; with a tp_mode grid also its rows, and a 3d cube's depth), innermost
#: first; empty: whole
Split = tuple[tuple[int, int, int, Any, int], ...]


def _held(pm) -> list[tuple[str, torch.Tensor, list[str], Split]]:
    """(program name, local tensor, state_dict keys, how it is split) of
    every tensor this rank holds that the model's ``state_dict`` has."""
    out = []
    tp = pm.config.tp_grid[-1]
    rows = getattr(pm, "row_placement", None) or {}
    row_n = pm.config.tp_grid[-2] if len(pm.config.tp_grid) > 1 else 1
    row_rank = dist.get_rank(pm.row_group) if rows and pm.row_group is not None else 0
    depth = getattr(pm, "depth_placement", None) or {}     # tp_mode=3d: the cube's depth splits them again
    depth_n = pm.config.tp_grid[0] if len(pm.config.tp_grid) == 3 else 1
    depth_rank = dist.get_rank(pm.depth_group) if depth and pm.depth_group is not None else 0
    for name, t in pm._local_tensors().items():
        keys = pm.state_names.keys_of(name)
        if keys:
            split: list[tuple[int, int, int, Any, int]] = []
            p, r = pm.param_placement.get(name, "R"), rows.get(name, "R")
            if is_shard(p) and tp > 1:
                split.append((shard_dim(p), tp, pm.tp_rank, pm.tp_group, shard_blocks(p)))
            if is_shard(r) and row_n > 1:
                split.append((shard_dim(r), row_n, row_rank, pm.row_group, 1))
            dep = depth.get(name, "R")
            if is_shard(dep) and depth_n > 1:
                split.append((shard_dim(dep), depth_n, depth_rank, pm.depth_group, 1))
            out.append((name, t, keys, tuple(split)))
    return out


def _logical_shape(pm, t: torch.Tensor, split: Split) -> tuple[int, ...]:
    shape = list(t.shape)         # an FSDP2 DTensor's shape is the (tp-local) unsharded one
    for d, n, _, _, _ in split:
        shape[d] *= n
    return tuple(shape)


def _tp_local(pm, full: torch.Tensor, split: Split) -> torch.Tensor:
    for d, n, r, _, blocks in reversed(split):     # the rows' chunk of the whole, then the columns' of that
        full = local_chunk(full, d, n, r, blocks)
    return full


def _tp_whole(v: torch.Tensor, split: Split) -> torch.Tensor:
    for d, n, _, group, blocks in split:
        v = unblock(C.all_gather(v.contiguous(), d, group), d, n, blocks)
    return v


def _place(like: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (tp-local, unsharded over dp) laid out like ``like``: this
    rank's FSDP2 shard as a DTensor when ``like`` is one."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    if isinstance(like, DTensor):
        return distribute_tensor(value.to(like.device, like.dtype), like.device_mesh, like.placements,
                                 src_data_rank=None)
    return value


# the distributed optimizer's flat layout: buckets end to end, a rank's shard is its 1/d of every bucket
def _flat_views(dopt, full: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for i, p in enumerate(dopt.params):
        b, off = dopt._where[i]
        out.append(full[b.start + off:b.start + off + p.numel()].view(p.shape))
    return out


def _flat_gather(dopt, shard: torch.Tensor) -> torch.Tensor:
    """The full flat vector from this rank's shard (collective over dp for ZeRO >= 1)."""
    if dopt.zero == 0 or dopt.dp == 1:
        return shard
    shard = shard.to(dopt.device)
    full = shard.new_zeros(dopt.padded_numel)
    for b in dopt.buckets:
        _all_gather_single(full[b.start:b.start + b.numel], shard[b.shard_start:b.shard_start + b.shard].contiguous(),
                           group=dopt.dp_group)
    return full


def _flat_shard(dopt, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the full flat vector ``full``."""
    if dopt.zero == 0 or dopt.dp == 1:
        return full
    out = full.new_zeros(dopt.shard_numel)
    r = dopt.dp_rank
    for b in dopt.buckets:
        out[b.shard_start:b.shard_start + b.shard] = full[b.start + r * b.shard:b.start + (r + 1) * b.shard]
    return out


def _is_flat(pm) -> bool:
    return pm.dist_optimizer is not None and pm.dist_optimizer.mode == "flat"


def _inner(pm) -> torch.optim.Optimizer:
    return pm.dist_optimizer.optimizer if pm.dist_optimizer is not None else pm.optimizer


def _hyper(group: dict) -> dict:
    """A param group's JSON-able hyperparameters (tensors as floats, tuples as lists)."""
    return _jsonable({k: v for k, v in group.items() if k != "params"})


def _jsonable(d: dict) -> dict:
    """The entries of ``d`` JSON can hold (tensors as floats, tuples as lists;
    functions, e.g. a LambdaLR's, left out)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, tuple):
            v = list(v)
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        out[k] = v
    return out


@torch.no_grad()
def _local_state(pm) -> tuple[dict[int, torch.Tensor], dict[int, dict[str, Any]], set[str], list]:
    """By ``id(parameter)``: the tp-local fp32 master weights kept apart from
    the parameters, and the tp-local optimizer state (unsharded over dp);
    the names of the elementwise states; ``(keys, hyperparameters)`` per
    param group. Collective over dp (ZeRO / FSDP2)."""
    inner, masters, states, elementwise = _inner(pm), {}, {}, set()
    key = {id(t): keys[0] for _, t, keys, _ in _held(pm)}
    if _is_flat(pm):
        dopt = pm.dist_optimizer
        if dopt.master is not None and dopt.master is not dopt._pbuf:
            masters = {id(p): v for p, v in zip(dopt.params, _flat_views(dopt, _flat_gather(dopt, dopt.master)))}
        states = {id(p): {} for p in dopt.params}
        for s, v in inner.state.get(dopt.master, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == dopt.shard_numel:
                elementwise.add(s)
                for p, x in zip(dopt.params, _flat_views(dopt, _flat_gather(dopt, v))):
                    states[id(p)][s] = x
            else:
                for p in dopt.params:
                    states[id(p)][s] = v
        groups = [([key[id(p)] for p in dopt.params if id(p) in key], _hyper(inner.param_groups[0]))]
        rest = inner.param_groups[1:]     # fsdp_layers: FSDP2's shards in a group of their own
    else:
        groups, rest = [], inner.param_groups
    for g in rest:
        for p in g["params"]:
            st = {}
            for s, v in inner.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.shape == p.shape and (p.dim() > 0 or s != "step"):
                    elementwise.add(s)
                    v = full_tensor(v)
                st[s] = v
            states[id(p)] = st
        groups.append(([key[id(p)] for p in g["params"] if id(p) in key], _hyper(g)))
    return masters, states, elementwise, groups


def _as_saved(v: Any) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu()
    return torch.as_tensor(v)


@torch.no_grad()
def _state_dict(pm) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's part of the saved form, and the metadata (collective)."""
    masters, states, elementwise, groups = _local_state(pm)
    sd: dict[str, torch.Tensor] = {}
    numbers: set[str] = set()
    for _, t, keys, dim in _held(pm):
        w = masters.get(id(t))
        w = full_tensor(t) if w is None else w
        if w.is_floating_point() and w.dtype in (torch.bfloat16, torch.float16):
            w = w.float()        # bf16/fp16 parameters without a master: rounded copies
        w = _tp_whole(w, dim).cpu()
        for k in keys:
            sd[f"model/{k}"] = w
        for s, v in sorted(states.get(id(t), {}).items()):
            if s in elementwise:
                v = _tp_whole(v, dim)
            elif not isinstance(v, torch.Tensor):
                numbers.add(s)
            sd[f"optim/{keys[0]}/{s}"] = _as_saved(v)
    for k, v in pm.state_names.constant.items():
        sd.setdefault(f"model/{k}", v)
    # every rank's param groups (a pipeline rank knows only its own parameters)
    every = [(groups, sorted(numbers))]
    if _dist() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (groups, sorted(numbers)))
    hyper: list[dict] = []
    group_of: dict[str, int] = {}
    for rank_groups, _ in every:
        for keys, h in rank_groups:
            if h not in hyper:
                hyper.append(h)
            for k in keys:
                group_of.setdefault(k, hyper.index(h))
    dopt = pm.dist_optimizer
    model = (getattr(pm.plan, "data", None) or {}).get("model", {})
    meta = {
        "format": FORMAT, "model": {"name": model.get("name"), "fingerprint": model.get("fingerprint")},
        "strategy": pm.config.to_string(), "world": pm.world, "precision": pm.config.precision or "fp32",
        "steps": pm.steps, "skipped_steps": pm.skipped_steps,
        "loss_scale": dopt.loss_scale if dopt is not None else 1.0,
        "good_steps": dopt._good_steps if dopt is not None else 0,
        "lr_scheduler": _jsonable(sched.state_dict()) if (sched := getattr(pm, "lr_scheduler", None)) else None,
        "optimizer": {"class": type(_inner(pm)).__name__, "elementwise": sorted(elementwise),
                      "numbers": sorted({n for _, ns in every for n in ns}),
                      "param_groups": hyper, "group_of": group_of},
    }
    return sd, meta


# ----------------------------------------------------------------------------- save
def save(pm, path: str | os.PathLike) -> Path:
    """Write ``pm``'s weights, optimizer state, step count and loss scale to
    the directory ``path`` (collective: every rank calls it with the same
    path, on a file system they share). Returns the path. Raises
    :class:`CheckpointError` when ``path`` is a file or a directory that is
    no checkpoint, or the write failed (the previous checkpoint then stays)."""
    path = Path(path).absolute()
    tmp, old = path.parent / f".{path.name}.tmp", path.parent / f".{path.name}.old"

    def prepare() -> None:
        if path.exists() and not (path / META).is_file():
            what = "a file" if not path.is_dir() else "a directory that is no autopar checkpoint"
            if not path.is_dir() or any(path.iterdir()):
                raise CheckpointError(f"{path} is {what}; refusing to replace it")
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _on_rank0(prepare, f"cannot save a checkpoint to {path}")
    sd, meta = _state_dict(pm)
    try:
        _dcp().save(sd, storage_writer=storage_writer(tmp))
    except BaseException as e:    # DCP gathers every rank's failure and raises it on every rank
        cause = _cause(e)
        _on_rank0(lambda: shutil.rmtree(tmp, ignore_errors=True), f"saving to {path} failed")
        raise CheckpointError(f"saving the checkpoint to {path} failed ({cause}); the previous checkpoint "
                              "there, if any, is unchanged") from e

    def commit() -> None:
        with open(tmp / META, "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _on_rank0(commit, f"saving the checkpoint to {path} failed")
    return path


# ----------------------------------------------------------------------------- load
def _resolve(path: str | os.PathLike) -> tuple[Path, dict]:
    """The checkpoint directory (``path``, or where an interrupted save left
    it) and its metadata; :class:`CheckpointError` when there is none."""
    path = Path(path).absolute()
    old = path.parent / f".{path.name}.old"
    where = path if (path / META).is_file() or not (old / META).is_file() else old
    if not where.exists():
        raise CheckpointError(f"no checkpoint at {path}: it does not exist")
    if not (where / META).is_file():
        raise CheckpointError(f"{path} is no autopar checkpoint (or an incomplete one): it has no {META}")
    try:
        meta = json.loads((where / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{where / META} is unreadable: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is a checkpoint of format {meta.get('format') if isinstance(meta, dict) else '?'}"
                              f"; this autopar reads format {FORMAT}")
    return where, meta


def _metadata(path: Path) -> dict[str, Any]:
    try:
        return _dcp().FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: the tensor index is unreadable ({type(e).__name__}: {e})") from None


def _read(sd: dict[str, torch.Tensor], path: Path, no_dist: bool) -> None:
    try:
        _dcp().load(sd, storage_reader=_dcp().FileSystemReader(path), no_dist=no_dist)
    except BaseException as e:
        raise CheckpointError(f"reading the checkpoint {path} failed: {_cause(e)}") from e


def _restore_hyper(group: dict, saved: dict) -> dict:
    out = dict(group)
    for k, v in saved.items():
        cur = group.get(k)
        if isinstance(cur, torch.Tensor):
            out[k] = cur.clone().fill_(v)
        elif isinstance(cur, tuple) and isinstance(v, list):
            out[k] = tuple(v)
        else:
            out[k] = v
    return out


def _plan_load(pm, path: str | os.PathLike, optimizer: bool) -> tuple:
    """What :func:`load` reads on this rank: ``(path, meta, held, empty state
    dict, weight key, optimizer key by program name)``; raises
    :class:`CheckpointError` for what it cannot load."""
    path, meta = _resolve(path)
    ours = (getattr(pm.plan, "data", None) or {}).get("model", {})
    theirs = meta.get("model") or {}
    if ours.get("fingerprint") and theirs.get("fingerprint") and ours["fingerprint"] != theirs["fingerprint"]:
        raise CheckpointError(f"{path} is a checkpoint of model {theirs.get('name')} (fingerprint "
                              f"{theirs['fingerprint']}), but this module runs {ours.get('name')} (fingerprint "
                              f"{ours['fingerprint']})")
    om = meta["optimizer"]
    inner = _inner(pm)
    if optimizer and om["class"] != type(inner).__name__ and om["param_groups"]:
        raise CheckpointError(f"{path} holds the state of a {om['class']} optimizer, this module's is "
                              f"{type(inner).__name__}: pass optimizer=False to load only the weights")
    md = _metadata(path)
    held = _held(pm)
    sd: dict[str, torch.Tensor] = {}
    wkey, okey = {}, {}
    for name, t, keys, dim in held:
        k = next((k for k in keys if f"model/{k}" in md), None)
        if k is None:
            raise CheckpointError(f"{path} has no weight {keys[0]!r}: it is a checkpoint of another model")
        shape, m = _logical_shape(pm, t, dim), md[f"model/{k}"]
        if tuple(m.size) != shape:
            raise CheckpointError(f"{path}: weight {k!r} is {tuple(m.size)} there, {shape} in this model")
        wkey[name] = k
        sd.setdefault(f"model/{k}", torch.empty(shape, dtype=m.properties.dtype))
        ok = next((k for k in keys if optimizer and k in om["group_of"]), None)
        if ok is not None:
            okey[name] = ok
            for s in [f for f in md if f.startswith(f"optim/{ok}/")]:
                sd.setdefault(s, torch.empty(tuple(md[s].size), dtype=md[s].properties.dtype))
    return path, meta, held, sd, wkey, okey


@torch.no_grad()
def load(pm, path: str | os.PathLike, *, optimizer: bool = True) -> dict:
    """Load the checkpoint at ``path`` into ``pm``, whatever plan and world
    size wrote it (collective). ``optimizer=False`` loads only the weights
    and the step count (the optimizer stays as it is); with the state come
    the param groups' hyperparameters (``lr``...), as torch's
    ``Optimizer.load_state_dict`` restores them. Returns the
    checkpoint's metadata. Raises :class:`CheckpointError` for a missing or
    incomplete checkpoint, one of another model (fingerprint) or of other
    parameter shapes, or (``optimizer=True``) one written with another
    optimizer class. Every rank raises the same error: they agree before reading."""
    err = planned = None
    try:
        planned = _plan_load(pm, path, optimizer)
    except CheckpointError as e:
        err = str(e)
    if _dist() and dist.get_world_size() > 1:   # one rank's refusal must not leave the others waiting
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, err)
        err = next((e for e in every if e), None)
    if err:
        raise CheckpointError(err)
    path, meta, held, sd, wkey, okey = planned
    _read(sd, path, no_dist=not _dist())
    om = meta["optimizer"]
    inner = _inner(pm)
    numbers, elementwise = set(om["numbers"]), set(om["elementwise"])
    dopt = pm.dist_optimizer
    weights: dict[int, torch.Tensor] = {}     # id(param) -> tp-local value
    states: dict[int, dict[str, Any]] = {}
    hyper_of: dict[int, dict] = {}
    for name, t, _, dim in held:
        weights[id(t)] = _tp_local(pm, sd[f"model/{wkey[name]}"], dim)
        if name in okey:
            pre = f"optim/{okey[name]}/"
            st = {}
            for f in [f for f in sd if f.startswith(pre)]:
                s, v = f[len(pre):], sd[f]
                st[s] = _tp_local(pm, v, dim) if s in elementwise else (v.item() if s in numbers else v)
            states[id(t)] = st
            hyper_of[id(t)] = om["param_groups"][om["group_of"][okey[name]]]
    # weights: parameters and buffers; with a flat optimizer its parameter buffer and master
    flat = set(map(id, dopt.params)) if _is_flat(pm) else set()
    for _, t, _, _ in held:
        if id(t) not in flat:
            src, dst = _place(t, weights[id(t)]), t
            if hasattr(dst, "to_local"):     # an FSDP2 shard
                src, dst = src.to_local(), dst.to_local()
            dst.detach().copy_(src)
    if flat:
        vec = torch.zeros(dopt.padded_numel, dtype=dopt.master_dtype)
        for p, v in zip(dopt.params, _flat_views(dopt, vec)):
            v.copy_(weights[id(p)])
        dopt._pbuf.copy_(vec.to(dopt._pbuf.device, dopt.param_dtype))
        if dopt.master is not None and dopt.master is not dopt._pbuf:
            dopt.master.copy_(_flat_shard(dopt, vec).to(dopt.master.device))
    if optimizer:
        _load_optimizer(pm, inner, states, elementwise, hyper_of)
        if dopt is not None and dopt.precision == "fp16" and meta.get("precision") == "fp16":
            dopt._scale, dopt._good_steps = float(meta["loss_scale"]), int(meta["good_steps"])
        sched, saved = getattr(pm, "lr_scheduler", None), meta.get("lr_scheduler")
        if sched is not None and saved:
            sched.load_state_dict(_restore_scheduler(sched.state_dict(), saved))
    pm.start_step, pm.step_times = int(meta["steps"]), []
    pm.skipped_steps = int(meta["skipped_steps"])
    return meta


def _restore_scheduler(current: dict, saved: dict) -> dict:
    """``current`` (a scheduler's ``state_dict``) with the saved entries; a
    per-group list (``base_lrs``, ``_last_lr``) saved for another number of
    param groups (ZeRO's one flat group against plain mode's several) takes
    its first value for every group."""
    out = dict(current)
    for k, v in saved.items():
        cur = current.get(k)
        if isinstance(v, list) and isinstance(cur, (list, tuple)) and len(v) != len(cur) and v:
            v = [v[0]] * len(cur)
        out[k] = v
    return out


def _load_optimizer(pm, inner: torch.optim.Optimizer, states: dict[int, dict], elementwise: set[str],
                    hyper_of: dict[int, dict]) -> None:
    """Put the loaded per-parameter state and hyperparameters into ``inner``
    (a flat optimizer's master in its first param group, any other group's
    parameters, FSDP2's shards of ``fsdp_layers``, one by one)."""
    state, groups, i, rest = {}, [], 0, inner.param_groups
    if _is_flat(pm):
        dopt = pm.dist_optimizer
        st: dict[str, Any] = {}
        for s in sorted({s for p in dopt.params for s in states.get(id(p), {})}):
            if s in elementwise:
                vec = torch.zeros(dopt.padded_numel, dtype=dopt.master_dtype)
                for p, v in zip(dopt.params, _flat_views(dopt, vec)):
                    if s in states.get(id(p), {}):
                        v.copy_(states[id(p)][s])
                st[s] = _flat_shard(dopt, vec).to(dopt.master.device)
            else:
                st[s] = next(states[id(p)][s] for p in dopt.params if s in states.get(id(p), {}))
        saved = next((hyper_of[id(p)] for p in dopt.params if id(p) in hyper_of), {})
        if st:
            state[0] = st
        groups.append({**_restore_hyper(inner.param_groups[0], saved), "params": [0]})
        i, rest = 1, inner.param_groups[1:]
    for g in rest:
        ids = []
        for p in g["params"]:
            if states.get(id(p)):
                state[i] = {s: _place(p, v) if s in elementwise else v for s, v in states[id(p)].items()}
            ids.append(i)
            i += 1
        saved = next((hyper_of[id(p)] for p in g["params"] if id(p) in hyper_of), {})
        groups.append({**_restore_hyper(g, saved), "params": ids})
    inner.load_state_dict({"state": state, "param_groups": groups})


# ----------------------------------------------------------------------------- single process
def load_full_state_dict(path: str | os.PathLike, *, optimizer: bool = False) -> Any:
    """The weights of the checkpoint at ``path`` as the original model's
    plain ``state_dict`` (full CPU tensors; ``model.load_state_dict`` takes
    it). With ``optimizer=True``: ``(weights, optim)`` where ``optim`` is
    ``{"state": {param key: {state name: tensor}}, "param_groups": [{...,
    "params": [param keys]}]}``. Reads in this process alone (no process
    group needed). Raises :class:`CheckpointError` for a missing or
    incomplete checkpoint."""
    path, meta = _resolve(path)
    md = _metadata(path)
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()
          if k.startswith(("model/", "optim/")) and hasattr(m, "size")}
    with warnings.catch_warnings():     # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        _read(sd, path, no_dist=True)
    weights = {k[len("model/"):]: v for k, v in sd.items() if k.startswith("model/")}
    if not optimizer:
        return weights
    om = meta["optimizer"]
    state: dict[str, dict[str, Any]] = {}
    for k, v in sd.items():
        if k.startswith("optim/"):
            key, s = k[len("optim/"):].rsplit("/", 1)
            state.setdefault(key, {})[s] = v.item() if s in om["numbers"] else v
    groups = [{**h, "params": [k for k, g in om["group_of"].items() if g == i]}
              for i, h in enumerate(om["param_groups"])]
    return weights, {"state": state, "param_groups": groups}
