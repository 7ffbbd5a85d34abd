"""Manual strategies: the grammar, parsing and validation.

Grammar (whitespace ignored, keys in any order, each at most once)::

    strategy := item ("," item)*
    item     := key "=" value
    key      := dp | tp | pp | microbatches | accumulate | schedule | chunks | recompute | zero
              | sequence_parallel | offload | precision | reduce_dtype | overlap | bucket_mb

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
* ``accumulate``: gradient accumulation without a pipeline: the same as
  ``microbatches`` there (the global batch is cut into ``N`` microbatches run
  one after the other, for memory only; the result equals the large batch).
  With ``pp > 1`` the pipeline's ``microbatches`` already accumulate.
* ``recompute``: ``none`` | ``full`` (every repeated layer keeps only its
  input and runs again in backward) | ``selective`` (matmul outputs kept, the
  cheap ops recomputed: norms, activations, softmax, dropout).
* ``zero``: 0 | 1 | 2 | 3: optimizer state (1), plus gradients (2), plus
  weights (3) sharded over ``dp`` (MindSpore's optimizer parallel).
* ``sequence_parallel``: ``true`` | ``false`` (Megatron sequence parallelism
  inside the tensor-parallel group: norms, dropout and residual adds split
  along the sequence; needs ``tp > 1``).
* ``offload``: ``none`` | ``optimizer`` (fp32 master weights and optimizer
  state in host memory, the optimizer step on the host).
* ``precision``: ``fp32`` | ``bf16`` | ``fp16`` (low-precision weights and
  compute with fp32 master weights; fp16 with dynamic loss scaling; ``mixed``
  is ``bf16``). Default: the plan's precision (the cluster's default).
* ``reduce_dtype``: ``fp32`` | ``bf16`` | ``fp16``: the dtype gradients are
  accumulated and reduced in under bf16/fp16 (default fp32).
* ``overlap``: ``true`` (default) | ``false``: reduce gradients bucket by
  bucket during backward, or all after it.
* ``bucket_mb``: gradient bucket size in MiB (communication fusion,
  MindFormers' ``gradient_aggregation_group``; default 25).

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
    "gradient_accumulation_steps": "accumulate", "accumulate_grad_batches": "accumulate",
    "use_seq_parallel": "sequence_parallel", "seq_parallel": "sequence_parallel", "sp": "sequence_parallel",
    "enable_sequence_parallelism": "sequence_parallel", "zero_stage": "zero", "optimizer_offload": "offload",
    "recompute_granularity": "recompute", "dtype": "precision", "grad_reduce_dtype": "reduce_dtype",
    "overlap_grad_reduce": "overlap", "bucket_size_mb": "bucket_mb",
}
KEYS = ("dp", "tp", "pp", "microbatches", "accumulate", "schedule", "chunks", "recompute", "zero",
        "sequence_parallel", "offload", "precision", "reduce_dtype", "overlap", "bucket_mb")
RECOMPUTE = ("none", "selective", "full")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOAD = ("none", "optimizer")
BUCKET_MB = 25.0
_BOOL = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


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
    sequence_parallel: bool = False
    offload: str = "none"
    precision: str = ""        # "": the plan's precision (the evaluator's default)
    reduce_dtype: str = ""     # "": fp32 under bf16/fp16, the weights' dtype under fp32
    overlap: bool = True
    bucket_mb: float = BUCKET_MB

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    def to_string(self) -> str:
        """Canonical strategy string (round-trips through :func:`parse_strategy`);
        the memory and communication options appear when not at their default."""
        pipe = ""
        if self.pp > 1:
            pipe = f",schedule={self.schedule}" + (f",chunks={self.chunks}" if self.chunks > 1 else "")
        extra = ""
        if self.sequence_parallel:
            extra += ",sequence_parallel=true"
        if self.offload != "none":
            extra += f",offload={self.offload}"
        if self.precision:
            extra += f",precision={self.precision}"
        if self.reduce_dtype:
            extra += f",reduce_dtype={self.reduce_dtype}"
        if not self.overlap:
            extra += ",overlap=false"
        if self.bucket_mb != BUCKET_MB:
            extra += f",bucket_mb={self.bucket_mb:g}"
        return (f"dp={self.dp},tp={self.tp},pp={self.pp},microbatches={self.microbatches}{pipe},"
                f"recompute={self.recompute},zero={self.zero}{extra}")

    @property
    def low_precision(self) -> bool:
        return self.precision in ("bf16", "fp16")

    @property
    def stages(self) -> int:
        """Virtual pipeline stages: ``pp x chunks``."""
        return self.pp * self.chunks

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def executable(self) -> bool:
        """Whether this release can run it (not only evaluate it): every
        strategy the grammar accepts."""
        return True


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
    if "accumulate" in vals:
        if "microbatches" in vals:
            raise StrategyError("give either accumulate= or microbatches=, not both (without a pipeline they "
                                "are the same: gradient accumulation over that many microbatches)")
        if pp > 1:
            raise StrategyError(f"accumulate= is gradient accumulation without a pipeline; with pp={pp} the "
                                "pipeline's microbatches= already accumulate the gradients of the whole batch")
        vals["microbatches"] = vals.pop("accumulate")
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
    sp = _bool("sequence_parallel", vals.get("sequence_parallel", "false"))
    if sp and tp == 1:
        raise StrategyError("sequence_parallel=true splits the norm and dropout regions along the sequence inside "
                            "the tensor-parallel group: it needs tp > 1")
    offload = vals.get("offload", "none").lower()
    if offload not in OFFLOAD:
        raise StrategyError(f"offload={offload!r} is invalid; valid: {', '.join(OFFLOAD)}")
    precision = vals.get("precision", "").lower()
    precision = "bf16" if precision == "mixed" else precision
    if precision and precision not in PRECISIONS:
        raise StrategyError(f"precision={precision!r} is invalid; valid: {', '.join(PRECISIONS)} (mixed = bf16)")
    reduce_dtype = vals.get("reduce_dtype", "").lower()
    if reduce_dtype and reduce_dtype not in PRECISIONS:
        raise StrategyError(f"reduce_dtype={reduce_dtype!r} is invalid; valid: {', '.join(PRECISIONS)}")
    if reduce_dtype and reduce_dtype != "fp32" and precision == "fp32":
        raise StrategyError(f"reduce_dtype={reduce_dtype} with precision=fp32: gradients are never reduced in a "
                            "lower precision than the weights; use precision=bf16 or fp16")
    overlap = _bool("overlap", vals.get("overlap", "true"))
    try:
        bucket = float(vals.get("bucket_mb", BUCKET_MB))
    except ValueError:
        raise StrategyError(f"bucket_mb needs a number of MiB, got {vals['bucket_mb']!r}") from None
    if not bucket > 0:
        raise StrategyError(f"bucket_mb must be > 0, got {bucket:g}")
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, microbatches=mb, schedule=schedule, recompute=recompute, zero=zero,
                         chunks=chunks, sequence_parallel=sp, offload=offload, precision=precision,
                         reduce_dtype=reduce_dtype, overlap=overlap, bucket_mb=bucket)
    if devices is not None and cfg.devices != devices:
        raise StrategyError(f"dp={dp} x tp={tp} x pp={pp} = {cfg.devices} devices, but the world has {devices}; "
                            f"the product of the degrees must equal the number of devices")
    return cfg


def _bool(key: str, value: str) -> bool:
    try:
        return _BOOL[value.lower()]
    except KeyError:
        raise StrategyError(f"strategy key {key!r} needs true or false, got {value!r}") from None


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
