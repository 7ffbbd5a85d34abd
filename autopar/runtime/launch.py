"""Run a function on N local gloo ranks: ``run_distributed(fn, world_size, *args)``.

Used by the tests, the benchmarks and ``autopar calibrate``.

Each rank is a fresh "spawn" process with torchrun-style env vars, so
``autopar.runtime.dist.init_process_group()`` joins the world as it would under
torchrun. ``fn(rank, world_size, *args)`` must be a picklable top-level
function; its (picklable) return values come back as a list in rank order.
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import sys
import time
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank: int, world_size: int, port: int, timeout: float, threads: int, args: tuple,
           results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist = None
    try:
        import torch
        import torch.distributed as dist

        from autopar.runtime.dist import init_process_group

        torch.set_num_threads(threads)  # default 1: the CI machine has 2 cores for all ranks
        init_process_group("gloo", timeout_s=timeout)
        # plain pickle: tensors are copied, not shared through file descriptors of a dying process
        payload = (rank, True, pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        payload = (rank, False, traceback.format_exc())
    finally:
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()
    results.put(payload)


_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "closed by peer")


def _failure_report(failed: dict[int, str], results, world_size: int, grace_s: float = 2.0) -> str:
    """The message for a failed run. When one rank raises, its peers fail in
    their next collective a moment later ("connection reset by peer"), and
    either report may arrive first: wait ``grace_s`` for the others and name
    the rank whose error is not such a consequence."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and len(failed) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if not ok:
            failed[rank] = payload
    causes = [r for r, tb in sorted(failed.items()) if not any(m in tb for m in _PEER_LOST)]
    first = causes[0] if causes else min(failed)
    others = sorted(set(failed) - {first})
    tail = f"\n(rank(s) {others} failed too)" if others else ""
    return f"run_distributed: rank {first} of {world_size} failed:\n{failed[first]}{tail}"


_GRACE_S = 3.0     # how long a rank that exited with code 0 may take to have its result read

#: Set to "1" (the test suite does, in tests/conftest.py) to keep the rank processes alive between
#: runs: each run then skips starting Python and importing torch in every rank (2-3 s of CPU each).
REUSE_ENV = "AUTOPAR_REUSE_RANKS"


def _serve(inbox, results, acks) -> None:
    """A reusable rank: run jobs from ``inbox`` until it yields None. Each job
    starts as a fresh process would: the default torch seed, the environment
    as it was, and a process group of its own (destroyed after the job).
    After each job it says on ``acks`` whether it takes another (True) or
    retires (False), which the pool reads before it sends the next job."""
    import torch
    import torch.distributed  # noqa: F401 - imported once, before the first job (what a job imports stays)

    seed = torch.initial_seed()
    while (job := inbox.get()) is not None:
        env = dict(os.environ)
        torch.manual_seed(seed)
        try:
            _child(*job, results)
        finally:
            os.environ.clear()
            os.environ.update(env)
        retire = _meshes_outlive_the_job()
        acks.put(not retire)
        if retire:
            return       # this rank retires: the pool starts a fresh one for the next run


#: torch.distributed's lru caches found so far (module-level: they live as long as their modules)
_LRU_CACHES: dict[int, object] = {}


def _meshes_outlive_the_job() -> bool:
    """Clear torch.distributed's memoised results after a job (DTensor's
    sharding propagation caches outputs that hold the job's DeviceMesh) and
    say whether a DeviceMesh is still alive: its process-group names are
    reused by a later job's groups, so such a rank must not run another job.

    When none is, what survived the job (imports, module state) is frozen
    out of the collector's view (``gc.freeze``): the next job's scans and
    collections walk only what it made. Walking the whole heap of a rank
    that imported transformers took about a second per job, in every rank,
    between every two spawns of the suite."""
    import functools
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():          # the unfrozen objects: what was made since the last freeze
        if isinstance(obj, functools._lru_cache_wrapper) and \
                str(getattr(obj, "__module__", "")).startswith("torch.distributed"):
            _LRU_CACHES[id(obj)] = obj
    for cached in _LRU_CACHES.values():
        cached.cache_clear()
    gc.collect()
    if any(isinstance(obj, DeviceMesh) for obj in gc.get_objects()):
        return True
    gc.freeze()
    return False


class _Pool:
    """Rank processes kept between runs (opt-in, ``AUTOPAR_REUSE_RANKS=1``)."""

    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.results = None
        self.procs: list = []
        self.inboxes: list = []
        self.acks: list = []
        self.busy: set[int] = set()      # ranks that ran the last job and have not said yet what next

    def take(self, world_size: int) -> tuple[list, object]:
        """The first ``world_size`` ranks (started as needed) and the queue they answer on.
        Waits for the ranks of the last job to say they take another; when
        one retires (or says nothing within a minute) every rank is
        replaced."""
        for r in sorted(self.busy):
            try:
                going_on = self.acks[r].get(timeout=60)
            except queue.Empty:
                going_on = False
            if not going_on:
                self.close()
                break
        self.busy = set()
        if any(not p.is_alive() for p in self.procs):
            self.close()
        if self.results is None:
            self.results = self.ctx.Queue()
        while len(self.procs) < world_size:
            inbox, acks = self.ctx.Queue(), self.ctx.Queue()
            p = self.ctx.Process(target=_serve, args=(inbox, self.results, acks), name=f"rank{len(self.procs)}",
                                 daemon=True)
            p.start()
            self.procs.append(p)
            self.inboxes.append(inbox)
            self.acks.append(acks)
        return self.procs[:world_size], self.results

    def send(self, rank: int, job: tuple) -> None:
        self.inboxes[rank].put(job)
        self.busy.add(rank)

    def close(self) -> None:
        """Stop every rank (after a failed run: its process groups may be wedged)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()
        for q in self.inboxes + self.acks + ([self.results] if self.results is not None else []):
            q.close()
        self.procs, self.inboxes, self.acks, self.results, self.busy = [], [], [], None, set()


_pool = _Pool()


def _sendable(job) -> bool:
    """Whether ``job`` can go to a running rank (a multiprocessing queue among
    the arguments can only be given to a process as it starts)."""
    from multiprocessing.reduction import ForkingPickler
    try:
        ForkingPickler.dumps(job)
    except Exception:  # noqa: BLE001 - anything unpicklable: start fresh ranks
        return False
    return True


def run_distributed(fn, world_size: int, *args, timeout: float = 180, threads: int = 1,
                    dead_ok: bool = False) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    A rank that raises makes this raise ``RuntimeError`` with that rank and its
    traceback (the other ranks are killed); a rank that dies without reporting
    raises ``RuntimeError`` (or, with ``dead_ok``, has the result None while the
    others are waited for: fault tests), and a run that exceeds ``timeout``
    seconds ``TimeoutError``. With ``AUTOPAR_REUSE_RANKS=1`` (not for
    ``dead_ok`` runs) the ranks are processes kept from the previous run.
    """
    port = _free_port()
    reuse = os.environ.get(REUSE_ENV) == "1" and not dead_ok and _sendable((fn, args))
    if reuse:
        procs, results = _pool.take(world_size)
        for r in range(world_size):
            _pool.send(r, (fn, r, world_size, port, timeout, threads, args))
    else:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, timeout, threads, args, results),
                             name=f"rank{r}", daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
    out: dict[int, object] = {}
    try:
        _collect(fn, procs, results, out, timeout, dead_ok)
    finally:
        if not reuse:
            for p in procs:
                p.join(timeout=5 if len(out) == world_size else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
            results.close()
        elif len(out) < world_size:
            _pool.close()
    return [out[r] for r in range(world_size)]


def _collect(fn, procs: list, results, out: dict, timeout: float, dead_ok: bool) -> None:
    """Fill ``out`` (rank -> result) from ``results``; raise as :func:`run_distributed` says."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    gone: dict[int, float] = {}      # rank -> when its exit counts as dying unreported
    while len(out) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(
                    f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}): "
                    f"rank(s) {missing} did not finish within {timeout}s (hung in a collective?)") from None
            now = time.monotonic()
            for r, p in enumerate(procs):     # exit code 0: its result may still be in the queue
                if r not in out and p.exitcode is not None:
                    gone.setdefault(r, now + (_GRACE_S if p.exitcode == 0 else 0.0))
            dead = [r for r, at in gone.items() if r not in out and now >= at]
            if dead and not dead_ok:
                p = procs[dead[0]]
                raise RuntimeError(f"run_distributed: {p.name} died with exit code {p.exitcode} without reporting")
            for r in dead:
                out[r] = None
            continue
        if not ok:
            raise RuntimeError(_failure_report({rank: payload}, results, world_size))
        out[rank] = pickle.loads(payload)
