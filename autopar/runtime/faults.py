"""Which rank failed, and where: a one-line answer for the ranks that survive it.

When one rank of a job raises or dies, its peers fail a moment later inside
a collective with the backend's own words ("Connection closed by peer
[127.0.0.1]:43817", a gloo timeout) which name no rank. This module lets the
survivors say which rank it was:

* every rank records the step it is starting on the process group's
  key-value store (``autopar/step/<rank>``: one small write per step);
* a rank that raises writes its error, in one line, to ``autopar/fault``
  (first writer wins), from :meth:`FaultBoard.record` or, for an error
  raised outside autopar's own code, from the excepthook this module installs;
* a survivor reads both (:meth:`FaultBoard.explain`): the failed rank's own
  line if it wrote one, else the ranks that never reached this step (stalled
  or killed), else nothing.

The store lives in rank 0's process; when rank 0 is the one that died every
read fails at once and the survivors say only that a peer was lost. The
excepthook prints a :class:`~autopar.errors.DistributedError` of a survivor as
one line instead of a traceback (``AUTOPAR_TRACEBACK=1`` restores the
traceback); every other exception is printed as Python prints it.
"""
from __future__ import annotations

import os
import sys
import traceback

import torch.distributed as dist

from autopar.errors import DistributedError

_FAULT = "autopar/fault"
_STEP = "autopar/step/{}"
_board: "FaultBoard | None" = None      # the board of this process's parallelized model


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()   # noqa: SLF001 - no public accessor
    except Exception:  # noqa: BLE001 - no store: a single process, or a backend without one
        return None


def where(exc: BaseException) -> str:
    """``file.py:line`` of the innermost frame of ``exc`` outside torch and autopar's runtime."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if "/torch/" not in f.filename and "/autopar/runtime/" not in f.filename]
    f = (mine or frames or [None])[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno}" if f is not None else "?"


class FaultBoard:
    """This rank's view of the job's faults, kept on the default store."""

    def __init__(self, rank: int, world: int, store=None):
        self.rank, self.world = rank, world
        self.store = store if store is not None else _default_store()

    def _try(self, fn, *args):
        if self.store is None:
            return None
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - the store's host may be the rank that died
            return None

    def start_step(self, step: int) -> None:
        """Record that this rank is starting ``step`` (1-based)."""
        self._try(self.store.set, _STEP.format(self.rank), str(step))

    def record(self, exc: BaseException, step: int | None = None) -> None:
        """Leave this rank's error for the others, in one line (the first error of the job wins)."""
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        at = f", step {step}" if step is not None else ""
        line = f"rank {self.rank} raised {type(exc).__name__} at {where(exc)}{at}: {first}"
        self._try(self.store.compare_set, _FAULT, "", line)

    def explain(self, step: int) -> str:
        """Who failed, as far as the store knows ("" when it cannot tell: no store, or its host died)."""
        try:
            return self._explain(step) if self.store is not None else ""
        except Exception:  # noqa: BLE001 - the store's host may be the rank that died
            return ""

    def _explain(self, step: int) -> str:
        if self.store.check([_FAULT]):
            line = self.store.get(_FAULT)
            return line.decode() if isinstance(line, bytes) else str(line)
        behind = [r for r in range(self.world) if r != self.rank and (
            not self.store.check([_STEP.format(r)]) or int(self.store.get(_STEP.format(r))) < step)]
        if not behind:
            return ""
        who = f"rank {behind[0]}" if len(behind) == 1 else "ranks " + ", ".join(map(str, behind))
        return f"{who} never reached step {step} (stalled or killed)"


def activate(board: FaultBoard) -> None:
    """Make ``board`` this process's board and install the excepthook (once)."""
    global _board
    _board = board
    if getattr(sys.excepthook, "_autopar", False):
        return
    previous = sys.excepthook

    def hook(kind, exc, tb):
        if _board is not None and not isinstance(exc, (DistributedError, KeyboardInterrupt)):
            _board.record(exc.with_traceback(tb))
        if isinstance(exc, DistributedError) and getattr(exc, "one_line", False) \
                and not os.environ.get("AUTOPAR_TRACEBACK"):
            print(f"autopar: {exc}", file=sys.stderr, flush=True)
            return
        previous(kind, exc, tb)

    hook._autopar = True
    sys.excepthook = hook
