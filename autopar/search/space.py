"""Manual strategies: the grammar, parsing and validation.

Grammar (whitespace ignored, keys in any order, each at most once)::

    strategy := item ("," item)*
    item     := key "=" value
    key      := dp | tp | pp | microbatches | schedule | chunks | recompute | zero

* ``dp``, ``tp``: data- and tensor-parallel degrees (default: ``dp`` is what
  the devices leave after ``tp`` and ``pp``; ``tp`` 1).
* ``pp``: pipeline stages (default 1).
* ``microbatches``: microbatches per optimizer step: gradient accumulation
  without a pipeline, the pipeline's microbatches with one (default 1, and
  ``pp`` when ``pp > 1``).
* ``schedule``: ``none`` without a pipeline; ``gpipe``, ``1f1b`` (default)
  or ``interleaved`` with ``pp > 1``.
* ``chunks``: model chunks per pipeline rank (virtual stages), for
  ``schedule=interleaved`` only (default 2 there, else 1).
* ``recompute``: ``none`` | ``full`` | ``selective`` (activation checkpointing;
  evaluated by the cost model, not executed yet).
* ``zero``: 0 | 1 | 2 | 3 (optimizer-state / gradient / weight sharding over
  ``dp``; evaluated by the cost model, not executed yet).

Colossal-AI and MindFormers spellings are accepted as aliases:
``data_parallel``, ``model_parallel``/``tensor``, ``pipeline_stage``/``pipeline``,
``micro_batch_num``, ``num_microbatches``, ``num_model_chunks``/``vpp``.
The seeds' pipeline rules are enforced (:func:`autopar.pipeline.schedule.check_schedule`):
MindFormers' ``micro_batch_num >= pipeline_stage``, and for the interleaved
schedule Colossal-AI's microbatches as a multiple of the stages.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import StrategyError

ALIASES = {
    "data_parallel": "dp", "data": "dp",
    "model_parallel": "tp", "tensor": "tp", "tensor_parallel": "tp",
    "pipeline_stage": "pp", "pipeline": "pp", "pipeline_parallel": "pp",
    "micro_batch_num": "microbatches", "micro_batches": "microbatches", "grad_accum": "microbatches",
    "num_microbatches": "microbatches", "num_model_chunks": "chunks", "vpp": "chunks",
    "virtual_pipeline_stages": "chunks", "pipeline_schedule": "schedule",
}
KEYS = ("dp", "tp", "pp", "microbatches", "schedule", "chunks", "recompute", "zero")
RECOMPUTE = ("none", "selective", "full")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class ParallelConfig:
    """A complete strategy: every key resolved."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    schedule: str = "none"
    recompute: str = "none"
    zero: int = 0
    chunks: int = 1

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    def to_string(self) -> str:
        """Canonical strategy string (round-trips through :func:`parse_strategy`)."""
        pipe = ""
        if self.pp > 1:
            pipe = f",schedule={self.schedule}" + (f",chunks={self.chunks}" if self.chunks > 1 else "")
        return (f"dp={self.dp},tp={self.tp},pp={self.pp},microbatches={self.microbatches}{pipe},"
                f"recompute={self.recompute},zero={self.zero}")

    @property
    def stages(self) -> int:
        """Virtual pipeline stages: ``pp x chunks``."""
        return self.pp * self.chunks

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def executable(self) -> bool:
        """Whether this release can run it (not only evaluate it)."""
        return self.recompute == "none" and self.zero == 0


def _int(key: str, value: str, lo: int = 1) -> int:
    try:
        v = int(value)
    except ValueError:
        raise StrategyError(f"strategy key {key!r} needs an integer, got {value!r}") from None
    if v < lo:
        raise StrategyError(f"strategy key {key!r} must be >= {lo}, got {v}")
    return v


def parse_strategy(text: str, devices: int | None = None) -> ParallelConfig:
    """Parse ``"dp=2,tp=4"`` into a :class:`ParallelConfig`.

    With ``devices``, a missing ``dp`` is inferred and the product of the
    degrees must equal it. Raises :class:`StrategyError` saying what is wrong
    and what would be valid.
    """
    if not isinstance(text, str) or not text.strip():
        raise StrategyError(f"empty strategy; expected e.g. 'dp=2,tp=4' with keys {', '.join(KEYS)}")
    vals: dict[str, str] = {}
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        if "=" not in item:
            raise StrategyError(f"strategy item {item!r} is not key=value; valid keys: {', '.join(KEYS)}")
        k, v = item.split("=", 1)
        k = ALIASES.get(k.lower(), k.lower())
        if k not in KEYS:
            raise StrategyError(f"unknown strategy key {k!r}; valid keys: {', '.join(KEYS)} "
                                f"(aliases: {', '.join(sorted(ALIASES))})")
        if k in vals:
            raise StrategyError(f"strategy key {k!r} given twice")
        vals[k] = v
    tp = _int("tp", vals["tp"]) if "tp" in vals else 1
    pp = _int("pp", vals["pp"]) if "pp" in vals else 1
    if "dp" in vals:
        dp = _int("dp", vals["dp"])
    elif devices is not None:
        if devices % (tp * pp):
            raise StrategyError(f"tp={tp} x pp={pp} does not divide {devices} devices; "
                                f"tp x pp must be one of {', '.join(map(str, divisors(devices)))}")
        dp = devices // (tp * pp)
    else:
        dp = 1
    mb = _int("microbatches", vals["microbatches"]) if "microbatches" in vals else pp
    schedule, chunks = _pipeline(pp, mb, vals)
    recompute = vals.get("recompute", "none").lower()
    if recompute not in RECOMPUTE:
        raise StrategyError(f"recompute={recompute!r} is invalid; valid: {', '.join(RECOMPUTE)}")
    zero = _int("zero", vals["zero"], lo=0) if "zero" in vals else 0
    if zero > 3:
        raise StrategyError(f"zero={zero} is invalid; valid stages: 0, 1, 2, 3")
    if pp > 1 and zero > 1:
        raise StrategyError(f"zero={zero} with pp={pp}: ZeRO stages 2 and 3 shard gradients and weights that every "
                            "pipeline microbatch would reduce or gather again (DeepSpeed refuses the combination "
                            "too); with a pipeline use zero=0 or zero=1")
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, microbatches=mb, schedule=schedule, recompute=recompute, zero=zero,
                         chunks=chunks)
    if devices is not None and cfg.devices != devices:
        raise StrategyError(f"dp={dp} x tp={tp} x pp={pp} = {cfg.devices} devices, but the world has {devices}; "
                            f"the product of the degrees must equal the number of devices")
    return cfg


def _pipeline(pp: int, microbatches: int, vals: dict[str, str]) -> tuple[str, int]:
    """The schedule and chunks of a strategy, checked against the seeds' rules."""
    schedule = vals.get("schedule", "1f1b" if pp > 1 else "none").lower()
    if pp == 1:
        if schedule != "none":
            raise StrategyError(f"schedule={schedule} needs a pipeline (pp > 1); with pp=1 leave it out")
        if "chunks" in vals and _int("chunks", vals["chunks"]) != 1:
            raise StrategyError("chunks > 1 needs a pipeline (pp > 1) with schedule=interleaved")
        return "none", 1
    if schedule not in PIPELINE_SCHEDULES:
        raise StrategyError(f"schedule {schedule!r} is invalid with pp={pp}; valid: {', '.join(PIPELINE_SCHEDULES)}")
    chunks = _int("chunks", vals["chunks"]) if "chunks" in vals else (2 if schedule == "interleaved" else 1)
    from ..pipeline.schedule import check_schedule
    check_schedule(schedule, pp, microbatches, chunks)
    return schedule, chunks


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
