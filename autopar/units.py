"""Numbers for people: seconds, bytes and FLOP rates in the unit that reads
best, with three significant digits (``14.7 ms``, ``1.66 MiB``, ``1.45
GFLOP/s``), never ``0.001664 GiB`` or ``6.1e-05 GiB``. A leaf module: the CLI,
the plan summary and the explanation all format through it."""
from __future__ import annotations


def _sig(x: float, digits: int = 3) -> str:
    """``x`` with ``digits`` significant digits, without an exponent."""
    if x == 0:
        return "0"
    s = f"{x:.{digits}g}"
    if "e" in s:                       # 1.23e+03 -> 1230 (the unit choice keeps these rare)
        s = f"{x:.0f}"
    return s


def seconds(s: float) -> str:
    """``0.01468`` -> ``14.7 ms``; µs, ms, s, min, h."""
    a = abs(s)
    if a == 0:
        return "0 s"
    for unit, k in (("h", 3600.0), ("min", 60.0), ("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if a >= k or unit == "µs":
            if unit in ("h", "min") and a < 2 * k:
                continue               # 95 s reads better than 1.58 min
            return f"{_sig(s / k)} {unit}"
    return f"{_sig(s)} s"


def nbytes(b: float) -> str:
    """``1745000`` -> ``1.66 MiB``; binary units, B to TiB."""
    a = abs(b)
    for unit, k in (("TiB", 2.0 ** 40), ("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10)):
        if a >= k:
            return f"{_sig(b / k)} {unit}"
    return f"{b:.0f} B"


def flops_rate(f: float) -> str:
    """FLOP per second: ``1.447e9`` -> ``1.45 GFLOP/s``."""
    a = abs(f)
    for unit, k in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if a >= k:
            return f"{_sig(f / k)} {unit}"
    return f"{_sig(f)} FLOP/s"


def count(n: float) -> str:
    """``117504`` -> ``118 k``; k, M, G, T."""
    for unit, k in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= k:
            return f"{_sig(n / k)} {unit}"
    return _sig(n)
