"""The MILP solvers the sharding ILP can be handed to.

:mod:`autopar.search.ilp` builds its program as plain arrays (a
:class:`Model`: column costs, upper bounds and integrality, and rows as
``{column: coefficient}`` with their bounds); a backend solves those arrays:

* ``"highs"`` (the default): HiGHS through ``highspy``, the whole model passed
  in one ``passModel`` call (row-wise matrix, integrality in one array).
  PuLP's HiGHS interface adds columns and sets their integrality one call at
  a time, which took most of the time of these small programs (measured: 46
  solves for GPT-3 175B took 4.0 s through PuLP, 2.4x the direct path).
* ``"pulp:CBC"``, ``"pulp:GLPK"``, ``"pulp:GUROBI"``, ``"pulp:CPLEX"``,
  ``"pulp:HIGHS"`` (``"pulp"`` alone is ``"pulp:CBC"``): the same arrays as
  a PuLP problem, for users with another solver (PuLP ships CBC). Needs the
  ``pulp`` extra (``pip install autopar[pulp]``).

Every backend solves on one thread to the relative MIP gap the model asks
for (:attr:`Model.rel_gap`): :data:`MIP_GAP` (1e-7) by default, so the
objectives agree to within that, and :data:`BOUNDED_MIP_GAP` (0.1%) for a
program with a memory row (:mod:`autopar.search.ilp`), a knapsack whose
last fractions of a percent can take long to prove; the row itself is a
linear model of memory whose answer the planner evaluates exactly and
compares with the Megatron placements. (With presolve on, proving the last
percent of Llama-3-8B's bounded program took 2-4 s, the largest single cost
of its search; without presolve it is optimal in 0.5 s.)

HiGHS runs without presolve and without its feasibility-jump heuristic. On
these programs (one binary per candidate, an equality row per decision, a
pair or shared-transition variable per edge) presolve reduced little and its
reductions sent the solver into long rounds of cuts: a Hugging Face
Llama-3-8B's programs on 32 H100 took 4-5 s each with it, 0.2-0.6 s without (the
same optima); feasibility jump found nothing the root's own heuristics did
not (the 108 programs of the zoo Llama-3-8B solved one after another: 4.7 s
with it, 3.6 s without). Equal-cost ties may fall otherwise than with
presolve (a Llama's embedding: vocabulary-parallel rather than split along
the hidden size, at the same time and memory).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Protocol

import highspy
import numpy as np

from ..errors import StrategyError

DEFAULT = "highs"
MIP_GAP = 1e-7
BOUNDED_MIP_GAP = 1e-3
#: PuLP's solver classes per name of ``pulp:NAME``, the first available one used
PULP_SOLVERS = {
    "CBC": ("COIN_CMD", "PULP_CBC_CMD"),    # a cbc on the PATH, else the one PuLP ships
    "GLPK": ("GLPK_CMD", "PYGLPK"),
    "GUROBI": ("GUROBI", "GUROBI_CMD"),
    "CPLEX": ("CPLEX_PY", "CPLEX_CMD"),
    "HIGHS": ("HiGHS", "HiGHS_CMD"),
}
SOLVERS = (DEFAULT,) + tuple(f"pulp:{s}" for s in PULP_SOLVERS)


@dataclass
class Model:
    """A minimisation MILP as arrays: column ``j`` lies in ``[0, upper[j]]``
    with cost ``costs[j]`` (integer where ``integer[j]``); each row is
    ``(coefs, lo, hi)`` meaning ``lo <= sum(coefs[j] * x[j]) <= hi`` (``lo``,
    ``hi`` may be infinite). ``constant`` is added to the objective by the
    caller; no backend sees it. ``rel_gap``: the relative MIP gap to solve to."""

    costs: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)
    constant: float = 0.0
    rel_gap: float = MIP_GAP
    #: solve the LP relaxation first and take it where its integer columns come out integral (a
    #: certificate of MIP optimality); HiGHS only: a large program whose relaxation is usually tight
    relax_first: bool = False

    def var(self, integer: bool = False) -> int:
        """A new column in [0, 1]; returns its index."""
        self.costs.append(0.0)
        self.upper.append(1.0)
        self.integer.append(integer)
        return len(self.costs) - 1

    def cost(self, v: int | None, c: float) -> None:
        """Add ``c`` to the cost of column ``v`` (None: to the constant)."""
        if v is None:
            self.constant += c
        else:
            self.costs[v] += c

    def row(self, coefs: dict[int, float], lo: float, hi: float) -> None:
        """Add the row ``lo <= sum(coefs[j] * x[j]) <= hi``."""
        self.rows.append((coefs, lo, hi))


@dataclass
class Solution:
    """``status``: ``"Optimal"`` or the solver's word for what went wrong
    (then ``values`` is empty); ``values`` per column; ``objective`` without
    the model's constant."""

    status: str
    values: list[float]
    objective: float


class Backend(Protocol):
    """Solves a :class:`Model`: ``solve(model, time_limit_s)`` returns a
    :class:`Solution` (a status other than ``"Optimal"`` for infeasible
    programs and time-outs; it does not raise for those)."""

    name: str

    def solve(self, model: Model, time_limit_s: float) -> Solution: ...


_BANNER_LOCK = threading.Lock()
_banner_done = False


def quiet_highs() -> highspy.Highs:
    """A ``highspy.Highs`` that prints nothing: its logging (``output_flag``,
    ``log_to_console``) is off before anything is passed to it. HiGHS prints
    its banner ("Running HiGHS ... Copyright ...") from C++ when the first
    instance of a process is made, before any option can be set, so that
    first construction runs with the process's stdout and stderr pointed at
    the null device (at the file-descriptor level: the banner is not
    Python's); later instances print no banner (PuLP's HiGHS included)."""
    global _banner_done
    with _BANNER_LOCK:
        if _banner_done:
            h = highspy.Highs()
        else:
            with _fds_silenced():
                h = highspy.Highs()
            _banner_done = True
    h.setOptionValue("output_flag", False)
    h.setOptionValue("log_to_console", False)
    return h


@contextlib.contextmanager
def _fds_silenced():
    """File descriptors 1 and 2 on the null device for the block (C-level
    output included), restored after it."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError):
            pass
    saved = []
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        for fd in (1, 2):
            try:
                saved.append((fd, os.dup(fd)))
                os.dup2(null, fd)
            except OSError:   # no such descriptor (a daemon): nothing to silence
                pass
        yield
    finally:
        _flush_c_stdio()
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)


def _flush_c_stdio() -> None:
    """Flush the C library's stdout/stderr buffers (what HiGHS wrote, if it
    buffered it) while they still point at the null device."""
    try:
        import ctypes
        ctypes.CDLL(None).fflush(None)
    except Exception:   # noqa: BLE001 - no C library to flush (Windows): nothing buffered there
        pass


class HighsBackend:
    """HiGHS through ``highspy``, the model passed in one piece, silent
    (:func:`quiet_highs`)."""

    name = DEFAULT

    def solve(self, model: Model, time_limit_s: float) -> Solution:
        n = len(model.costs)
        if n == 0:
            return Solution("Optimal", [], 0.0)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = n, len(model.rows)
        lp.col_cost_ = np.array(model.costs)
        lp.col_lower_ = np.zeros(n)
        lp.col_upper_ = np.array(model.upper)
        inf = highspy.kHighsInf
        lp.row_lower_ = np.array([max(lo, -inf) for _, lo, _ in model.rows])
        lp.row_upper_ = np.array([min(hi, inf) for _, _, hi in model.rows])
        start, index, value = [0], [], []
        for coefs, _, _ in model.rows:
            index.extend(coefs)
            value.extend(coefs.values())
            start.append(len(index))
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.array(start, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(value, dtype=float)
        if model.relax_first:
            t0 = time.perf_counter()
            got = _integral_relaxation(lp, model, time_limit_s)
            if got is not None:
                return got
            time_limit_s = max(1.0, time_limit_s - (time.perf_counter() - t0))    # the MILP gets what is left
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                           for i in model.integer]
        h = _highs(time_limit_s)
        h.setOptionValue("mip_rel_gap", float(model.rel_gap))
        h.setOptionValue("mip_heuristic_run_feasibility_jump", False)
        h.passModel(lp)
        h.run()
        st = h.getModelStatus()
        if st != highspy.HighsModelStatus.kOptimal:
            return Solution(h.modelStatusToString(st), [], 0.0)
        return Solution("Optimal", list(h.getSolution().col_value), h.getInfo().objective_function_value)


def _highs(time_limit_s: float) -> "highspy.Highs":
    """A silent HiGHS instance as every solve here runs it: one thread, no
    presolve (module docstring), ``time_limit_s``."""
    h = quiet_highs()
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("threads", 1)
    h.setOptionValue("presolve", "off")
    return h


#: how far from an integer a relaxation's integer column may be and still count as integral
INTEGRAL_TOL = 1e-7


def _integral_relaxation(lp: "highspy.HighsLp", model: Model, time_limit_s: float) -> Solution | None:
    """``model``'s LP relaxation (``lp``, no integrality yet) solved by dual
    simplex; its solution, the integer columns rounded, when every integer
    column is within :data:`INTEGRAL_TOL` of an integer (then it is optimal
    for the MILP too: the relaxation's bound is met), else None. A
    three-axis mesh program's relaxation is integral at its optimum; HiGHS's
    MIP solver spends 2-3x the simplex's time at its root on the same LP
    (GPT-3's 24 layers on a 2 x 2 x 2 mesh: 2.7 s against 0.9 s)."""
    h = _highs(time_limit_s)
    h.setOptionValue("solver", "simplex")
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    values = np.array(h.getSolution().col_value)
    ints = np.array(model.integer, dtype=bool)
    if ints.any() and np.abs(values[ints] - np.round(values[ints])).max() > INTEGRAL_TOL:
        return None
    values[ints] = np.round(values[ints])
    return Solution("Optimal", values.tolist(), float(np.dot(model.costs, values)))


class PulpBackend:
    """The model as a PuLP problem, solved by ``solver`` (a PuLP solver
    object that is available)."""

    def __init__(self, name: str, solver) -> None:
        self.name, self.solver = name, solver

    def solve(self, model: Model, time_limit_s: float) -> Solution:
        import pulp

        n = len(model.costs)
        if n == 0:
            return Solution("Optimal", [], 0.0)
        prob = pulp.LpProblem("autopar_sharding", pulp.LpMinimize)
        xs = [pulp.LpVariable(f"x{j}", 0, up, pulp.LpInteger if i else pulp.LpContinuous)
              for j, (up, i) in enumerate(zip(model.upper, model.integer))]
        prob.setObjective(pulp.LpAffineExpression([(xs[j], c) for j, c in enumerate(model.costs) if c]))
        for coefs, lo, hi in model.rows:
            if not coefs:
                # a row of constants only: holds or not on its own
                if lo <= 0.0 <= hi:
                    continue
                return Solution("Infeasible", [], 0.0)
            expr = pulp.LpAffineExpression([(xs[j], c) for j, c in coefs.items()])
            if lo == hi:
                prob += pulp.LpConstraint(expr, pulp.LpConstraintEQ, rhs=lo)
                continue
            if math.isfinite(hi):
                prob += pulp.LpConstraint(expr, pulp.LpConstraintLE, rhs=hi)
            if math.isfinite(lo):
                prob += pulp.LpConstraint(expr, pulp.LpConstraintGE, rhs=lo)
        self.solver.timeLimit = float(time_limit_s)
        if "gapRel" in self.solver.optionsDict:
            self.solver.optionsDict["gapRel"] = float(model.rel_gap)
        status = prob.solve(self.solver)
        if status != pulp.LpStatusOptimal or prob.sol_status != pulp.LpSolutionOptimal:
            # a time-out with an incumbent is reported as Optimal with an
            # integer-feasible solution: not proven optimal, as HiGHS would say
            return Solution(pulp.LpSolution.get(prob.sol_status) or pulp.LpStatus[status], [], 0.0)
        values = [x.varValue or 0.0 for x in xs]
        return Solution("Optimal", values, float(np.dot(model.costs, values)))


@functools.lru_cache(maxsize=None)
def backend(name: str = DEFAULT) -> Backend:
    """The backend called ``name`` (one of :data:`SOLVERS`, in any case;
    ``"pulp"`` is ``"pulp:CBC"``).

    Raises :class:`StrategyError` for an unknown name, when PuLP is not
    installed, or when the named solver is not available to PuLP."""
    if not isinstance(name, str):
        raise StrategyError(f"solver {name!r} is not a name; valid: {', '.join(SOLVERS)}")
    if name.lower() == DEFAULT:
        return HighsBackend()
    kind, _, which = name.partition(":")
    which = (which or "CBC").upper()
    if kind.lower() != "pulp" or which not in PULP_SOLVERS:
        raise StrategyError(f"solver {name!r} is unknown; valid: {', '.join(SOLVERS)}")
    try:
        import pulp
    except ImportError:
        raise StrategyError(f"solver {name!r} needs PuLP, which is not installed: "
                            f"pip install 'autopar[pulp]' (or pulp>=2.7), or use solver='highs'") from None
    if which == "HIGHS":
        quiet_highs()   # the process's first HiGHS instance prints the banner: made here, silenced
    for cls_name in PULP_SOLVERS[which]:
        cls = getattr(pulp, cls_name, None)
        if cls is None:
            continue
        wanted = {"msg": False, "gapRel": MIP_GAP, "threads": 1}
        accepted = inspect.signature(cls.__init__).parameters
        with warnings.catch_warnings():
            # PULP_CBC_CMD (the CBC PuLP ships) warns that PuLP 4 drops it
            warnings.simplefilter("ignore")
            solver = cls(**{k: v for k, v in wanted.items() if k in accepted})
            if solver.available():
                return PulpBackend(f"pulp:{which}", solver)
    raise StrategyError(f"solver {name!r}: PuLP finds none of {', '.join(PULP_SOLVERS[which])} on this machine "
                        f"(available to PuLP: {', '.join(pulp.listSolvers(onlyAvailable=True)) or 'none'}); "
                        f"valid solvers: {', '.join(SOLVERS)}")
