"""Bytes of model state (weights, gradients, optimizer state) per device."""
from __future__ import annotations

_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "tf32": 4, "bfloat16": 2, "float16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}

# Bytes per parameter: (weights, gradients, optimizer state).
# mixed = bf16/fp16 weights and gradients plus an fp32 master copy, which is
# counted in the optimizer state (it is sharded with it by ZeRO stage 1).
# bf16 / fp16 are the same policy with the gradients accumulated and reduced
# in ``grad_bytes`` (fp32 by default: Megatron's main_grad buffer).
_BYTES_PER_PARAM = {
    "fp32": {"adam": (4, 4, 8), "adamw": (4, 4, 8),          # m, v
             "sgd": (4, 4, 0), "sgd_momentum": (4, 4, 4)},   # momentum buffer
    "mixed": {"adam": (2, 2, 12), "adamw": (2, 2, 12),       # master, m, v
              "sgd": (2, 2, 4), "sgd_momentum": (2, 2, 8)},  # master (+ momentum)
}
for _p in _BYTES_PER_PARAM.values():     # fused kernels keep the same state
    _p["adam_fused"], _p["adamw_fused"] = _p["adam"], _p["adamw"]
_BYTES_PER_PARAM["bf16"] = _BYTES_PER_PARAM["fp16"] = _BYTES_PER_PARAM["mixed"]
OPTIMIZERS = tuple(_BYTES_PER_PARAM["fp32"])
PRECISIONS = tuple(_BYTES_PER_PARAM)


def dtype_bytes(dtype: str) -> int:
    """Return the bytes of one element of ``dtype`` (torch name without "torch.").

    Raises ValueError for an unknown dtype, listing valid ones.
    """
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(_DTYPE_BYTES)}") from None


def _per_param(num_params: float, optimizer: str, precision: str) -> tuple[int, int, int]:
    """``(weights, gradients, optimizer state)`` bytes per parameter, after
    checking the count, the optimizer and the precision (ValueError naming the
    valid ones)."""
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    if precision not in _BYTES_PER_PARAM:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    if optimizer not in _BYTES_PER_PARAM[precision]:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    return _BYTES_PER_PARAM[precision][optimizer]


def model_state_bytes(num_params: int, optimizer: str = "adamw",
                      precision: str = "fp32", grad_bytes: int | None = None) -> dict[str, int]:
    """Return ``{"weights", "gradients", "optimizer", "total"}`` in bytes for
    ``num_params`` unsharded parameters.

    ``precision``: "fp32", or "bf16" / "fp16" / "mixed" (low-precision weights
    with an fp32 master copy in the optimizer state). ``grad_bytes``: bytes of
    one accumulated gradient element (default: the precision's table; bf16 and
    fp16 training usually accumulate in fp32, pass 4).

    Raises ValueError for a negative count or an unknown optimizer / precision.
    """
    w, g, o = _per_param(num_params, optimizer, precision)
    if grad_bytes is not None:
        g = grad_bytes
    w, g, o = num_params * w, num_params * g, num_params * o
    return {"weights": w, "gradients": g, "optimizer": o, "total": w + g + o}


#: fp32 element accesses per trainable element in one step of torch's optimizers, each op one
#: pass over its tensors (the foreach implementation GPUs default to, and the loop over tensors
#: the CPU runs, issue the same ops). AdamW (weight decay on by default): mul_ of the weights
#: (read, write: 2), lerp_ of m (3), mul_ of v (2), addcmul_ of v (3), sqrt of v into a
#: temporary (2), div_ and add_ of it (2 + 2), addcdiv_ of the weights (4): 20. Adam (no weight
#: decay by default) 18; SGD one add_ of the weights (3); SGD with momentum mul_ and add_ of the
#: buffer, add_ of the weights (2 + 3 + 3). The fused Adam and AdamW kernels (``fused=True``,
#: apex's FusedAdam in Megatron-LM, DeepSpeed's) read the weights, gradients, m and v once
#: and write the weights, m and v once: 7. Measured on an H100: a 355M GPT's AdamW step under
#: bf16 took 11.9 ms, 86 bytes an element at 0.77 of the datasheet bandwidth (counting one read
#: and one write of the state, 24 bytes, it had been predicted 3.3x too fast).
OPTIMIZER_ACCESSES = {"adam": 18, "adamw": 20, "sgd": 3, "sgd_momentum": 8, "adam_fused": 7, "adamw_fused": 7}


def optimizer_step_bytes(num_params: float, optimizer: str = "adamw", precision: str = "fp32",
                         grad_bytes: int | None = None) -> float:
    """Return the bytes one optimizer step reads and writes over ``num_params``
    elements: torch's own ops on the fp32 state (:data:`OPTIMIZER_ACCESSES`),
    plus under a low ``precision`` the casts around them: a gradient held in
    ``grad_bytes`` < 4 copied into the fp32 master gradient, and the updated
    master cast back into the low-precision weights.

    Raises ValueError for a negative count or an unknown optimizer / precision.
    """
    w, g, _ = _per_param(num_params, optimizer, precision)
    per = 4.0 * OPTIMIZER_ACCESSES[optimizer]
    if precision != "fp32":
        g = g if grad_bytes is None else grad_bytes
        per += (g + 4 if g < 4 else 0) + 4 + w
    return num_params * per


def zero_sharded_state_bytes(states: dict[str, int], dp: int, stage: int) -> dict[str, int]:
    """Return per-device model state bytes under ZeRO ``stage`` over ``dp`` ranks.

    Stage 0 keeps everything; stage 1 shards the optimizer state, stage 2 also
    the gradients, stage 3 also the weights. A shard is rounded up, since every
    rank holds an equal padded shard. ``states`` is a result of
    :func:`model_state_bytes`. Raises ValueError for dp < 1 or stage not in 0-3.
    """
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    sharded = ("optimizer", "gradients", "weights")[:stage]
    out = {k: (-(-states[k] // dp) if k in sharded else states[k])
           for k in ("weights", "gradients", "optimizer")}
    out["total"] = sum(out.values())
    return out
