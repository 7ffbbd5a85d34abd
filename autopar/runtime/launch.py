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


def run_distributed(fn, world_size: int, *args, timeout: float = 180, threads: int = 1,
                    dead_ok: bool = False) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    A rank that raises makes this raise ``RuntimeError`` with that rank and its
    traceback (the other ranks are killed); a rank that dies without reporting
    raises ``RuntimeError`` (or, with ``dead_ok``, has the result None while the
    others are waited for: fault tests), and a run that exceeds ``timeout``
    seconds ``TimeoutError``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, timeout, threads, args, results),
                         name=f"rank{r}", daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    out: dict[int, object] = {}
    gone: dict[int, float] = {}      # rank -> when its exit counts as dying unreported
    try:
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
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [out[r] for r in range(world_size)]
