"""Process-group set-up and the device mesh that the per-rank program runs on.

``init_process_group()`` works the same under ``torchrun`` (reads RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and in a plain ``python`` process (a
world of one over an in-memory store), so compiled programs have one code path.
``Mesh`` arranges the world's ranks row-major (last axis fastest) into a named
N-d grid and hands out, per axis, the process group of the ranks that differ
from this one only along that axis.
"""
from __future__ import annotations

import datetime
import math
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar.errors import DistributedError

__all__ = ["init_process_group", "local_device", "Mesh"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise DistributedError(f"environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"environment variable {name}={raw!r} is not an integer") from None


def _default_backend() -> str:
    """"nccl" when every local rank can have its own GPU, else "gloo"."""
    if torch.cuda.is_available():
        n_gpus = torch.cuda.device_count()
        if n_gpus >= _env_int("LOCAL_WORLD_SIZE", 1) and _env_int("LOCAL_RANK", 0) < n_gpus:
            return "nccl"
    return "gloo"


def init_process_group(backend: str | None = None, timeout_s: float = 600) -> tuple[int, int]:
    """Initialise ``torch.distributed`` once and return ``(rank, world_size)``.

    Already initialised: returns the existing rank and world size. torchrun
    variables set (RANK / WORLD_SIZE with MASTER_ADDR / MASTER_PORT): joins that
    world through ``env://``. None of them set: creates a one-process world over
    an in-memory ``HashStore``. ``backend`` defaults to "nccl" when CUDA has a
    GPU for every local rank (the device is then set to LOCAL_RANK), else
    "gloo". Every wait is bounded by ``timeout_s``. Failures raise
    ``DistributedError``.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed support")
    if timeout_s <= 0:
        raise DistributedError(f"timeout_s must be > 0, got {timeout_s}")
    backend = backend or _default_backend()
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise DistributedError("backend 'nccl' needs CUDA, but torch.cuda.is_available() is False; use 'gloo'")
        local_rank = _env_int("LOCAL_RANK", 0)
        if local_rank >= torch.cuda.device_count():
            raise DistributedError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible")
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)

    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if "RANK" in present or "WORLD_SIZE" in present:
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise DistributedError(
                f"torchrun-style launch detected ({', '.join(present)} set) but {', '.join(missing)} "
                f"missing; launch with torchrun or set all of {', '.join(_TORCHRUN_VARS)}")
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
        if not 0 <= rank < world:
            raise DistributedError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
        where = (f"rank {rank} of {world} via env:// at "
                 f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
        kwargs = dict(init_method="env://", rank=rank, world_size=world)
    else:
        where = "single process (world size 1, in-memory store)"
        kwargs = dict(store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise DistributedError(
            f"could not initialise the {backend!r} process group, {where}, timeout {timeout_s}s: "
            f"{type(e).__name__}: {e}") from e
    return dist.get_rank(), dist.get_world_size()


def set_timeout(timeout_s: float, groups: Sequence[Any] = ()) -> None:
    """Bound every wait on the world group and on ``groups`` by ``timeout_s``
    (a stalled or dead peer then raises on every other rank instead of
    holding it for torch's default 30 minutes)."""
    if timeout_s <= 0:
        raise DistributedError(f"timeout_s must be > 0, got {timeout_s}")
    from torch.distributed.distributed_c10d import _set_pg_timeout
    td = datetime.timedelta(seconds=timeout_s)
    for g in [None, *groups]:
        if g is not None and dist.get_rank(g) < 0:
            continue
        _set_pg_timeout(td, g)


def local_device() -> torch.device:
    """This rank's compute device: ``cuda:LOCAL_RANK`` under nccl, else cpu."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", _env_int("LOCAL_RANK", 0))
    return torch.device("cpu")


class Mesh:
    """Named N-d grid of the world's ranks, row-major (last axis fastest).

    Rank ``r`` has coordinates ``unravel(r, shape)``. ``group(axis)`` is the
    process group of the ranks sharing all of this rank's coordinates except
    along ``axis``, ordered by their coordinate on ``axis`` (so
    ``dist.get_rank(group) == coord(axis)``); it is ``None`` for an axis of size
    1, which every collective treats as the identity. Build with
    :meth:`Mesh.build` (collective: every rank must call it, in the same order).
    """

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...], rank: int,
                 groups: list, device_mesh=None):
        self.shape, self.names, self.rank = shape, names, rank
        self._groups = groups
        self.device_mesh = device_mesh  # torch DeviceMesh when it was used, else None
        self._joint: dict[str, tuple[tuple[int, ...], Any]] = {}   # "dp_cp" -> (axes, group)

    @classmethod
    def build(cls, shape: Sequence[int], names: Sequence[str], *, use_device_mesh: bool = True,
              timeout_s: float | None = None, joint: Sequence[Sequence[str]] = ()) -> "Mesh":
        """Create the groups of a ``shape`` mesh with axis ``names`` over the default world.

        Uses ``torch.distributed.device_mesh.init_device_mesh`` when
        ``use_device_mesh`` (falls back to ``dist.new_group`` if that fails),
        else ``dist.new_group`` for every group of every axis. ``timeout_s``
        bounds every wait on every group (torch's default for a new group is
        30 minutes whatever the world's is); None keeps torch's default.
        ``joint``: groups of several axes at once (``("dp", "cp")``: the ranks
        that share every other coordinate), named by the axes joined with
        ``_`` (``group("dp_cp")``).
        """
        shape, names = tuple(shape), tuple(names)
        if not shape or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in shape):
            raise DistributedError(f"mesh shape must be a non-empty tuple of positive ints, got {shape}")
        if len(names) != len(shape) or len(set(names)) != len(names) or not all(
                isinstance(n, str) and n for n in names):
            raise DistributedError(
                f"mesh names must be {len(shape)} distinct non-empty strings (one per axis of {shape}), got {names}")
        if not dist.is_initialized():
            raise DistributedError("Mesh.build needs a process group; call init_process_group() first")
        world, rank = dist.get_world_size(), dist.get_rank()
        if math.prod(shape) != world:
            raise DistributedError(
                f"mesh shape {shape} has {math.prod(shape)} devices but the world size is {world}")
        mesh = cls(shape, names, rank, [None] * len(shape))
        device_mesh = None
        if use_device_mesh:
            try:
                from torch.distributed.device_mesh import init_device_mesh
                device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
                device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
                groups = [device_mesh.get_group(n) for n in names]
                for ax, g in enumerate(groups):  # guard against a layout change in torch
                    if dist.get_process_group_ranks(g) != mesh.group_ranks(ax):
                        raise RuntimeError(f"DeviceMesh group of axis {names[ax]} has unexpected ranks")
            except Exception:  # noqa: BLE001 - deterministic on all ranks, so all fall back together
                device_mesh = None
        if device_mesh is None:
            groups = mesh._new_groups()
        if timeout_s is not None:
            set_timeout(timeout_s, [g for g, s in zip(groups, shape) if s > 1])
        mesh._groups = [g if s > 1 else None for g, s in zip(groups, shape)]
        mesh.device_mesh = device_mesh
        for axes in joint:
            mesh._add_joint(tuple(mesh.axis_index(a) for a in axes), timeout_s)
        return mesh

    def _add_joint(self, axes: tuple[int, ...], timeout_s: float | None) -> None:
        """Create the groups spanning ``axes`` together (same order on every rank); keep this rank's."""
        name = "_".join(self.names[a] for a in axes)
        if math.prod(self.shape[a] for a in axes) == 1:
            self._joint[name] = (axes, None)
            return
        mine, seen = None, set()
        for r in range(math.prod(self.shape)):
            ranks = self._ranks_across(r, axes)
            if ranks[0] in seen:
                continue
            seen.add(ranks[0])
            g = dist.new_group(ranks)
            if self.rank in ranks:
                mine = g
        if timeout_s is not None:
            set_timeout(timeout_s, [mine])
        self._joint[name] = (axes, mine)

    def _ranks_across(self, rank: int, axes: tuple[int, ...]) -> list[int]:
        """The ranks sharing ``rank``'s coordinates off ``axes``, row-major over ``axes``."""
        out = [rank - sum(self._coords(rank)[a] * math.prod(self.shape[a + 1:]) for a in axes)]
        for a in axes:
            stride = math.prod(self.shape[a + 1:])
            out = [b + i * stride for b in out for i in range(self.shape[a])]
        return out

    def _new_groups(self) -> list:
        """Create every group of every axis with ``dist.new_group`` (same order on all ranks)."""
        groups = []
        for ax, size in enumerate(self.shape):
            mine = None
            if size > 1:
                for r in range(math.prod(self.shape)):
                    if self._coords(r)[ax] == 0:  # r is the first rank of its group along ax
                        ranks = self._ranks_along(r, ax)
                        g = dist.new_group(ranks)
                        if self.rank in ranks:
                            mine = g
            groups.append(mine)
        return groups

    def _coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for s in reversed(self.shape):
            rank, c = divmod(rank, s)
            out.append(c)
        return tuple(reversed(out))

    def _ranks_along(self, rank: int, ax: int) -> list[int]:
        stride = math.prod(self.shape[ax + 1:])
        base = rank - self._coords(rank)[ax] * stride
        return [base + i * stride for i in range(self.shape[ax])]

    def axis_index(self, axis: int | str) -> int:
        """Index of ``axis`` given by name or (possibly negative) index."""
        if isinstance(axis, str):
            if axis not in self.names:
                raise DistributedError(f"mesh has no axis {axis!r}; axes are {self.names}")
            return self.names.index(axis)
        if isinstance(axis, int) and -len(self.shape) <= axis < len(self.shape):
            return axis % len(self.shape)
        raise DistributedError(f"axis {axis!r} is out of range for mesh {self.shape} with axes {self.names}")

    def size(self, axis: int | str) -> int:
        """Number of ranks along ``axis``."""
        return self.shape[self.axis_index(axis)]

    def coord(self, axis: int | str) -> int:
        """This rank's coordinate along ``axis`` (= its rank inside ``group(axis)``)."""
        return self._coords(self.rank)[self.axis_index(axis)]

    @property
    def coords(self) -> tuple[int, ...]:
        """This rank's coordinates on all axes."""
        return self._coords(self.rank)

    def group_ranks(self, axis: int | str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in coordinate order."""
        return self._ranks_along(self.rank, self.axis_index(axis))

    def group(self, axis: int | str):
        """Process group along ``axis`` (or a joint group built with ``joint=``,
        e.g. ``"dp_cp"``) containing this rank; ``None`` if it has size 1."""
        if isinstance(axis, str) and axis in self._joint:
            return self._joint[axis][1]
        return self._groups[self.axis_index(axis)]

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))
        return f"Mesh({axes}; rank {self.rank} at {self.coords})"
