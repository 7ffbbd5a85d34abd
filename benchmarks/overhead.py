"""Execution overhead: autopar's compiled program against hand-written PyTorch-native parallelism.

The same model (same weights: built from the same seed), the same global
batch and the same SGD optimizer run, in one job of 4 local gloo processes,
once through ``autopar.parallelize(...).train_step`` and once through the
PyTorch-native equivalent of the same strategy:

* ``dp=4``: ``DistributedDataParallel`` (default buckets) over the world.
* ``tp=4``: ``torch.distributed.tensor.parallel.parallelize_module`` on a 1-D
  ``DeviceMesh``, Megatron-style: ``ColwiseParallel`` on q, k, v and the MLP
  up/gate projections, ``RowwiseParallel`` on the attention output and the MLP
  down projection, the head counts of each attention module set to the
  per-rank counts (as torchtitan does); vocabulary-parallel token embedding
  (``RowwiseParallel(input_layouts=Replicate())``) and ``lm_head``
  (``ColwiseParallel(output_layouts=Shard(-1))`` with ``loss_parallel``), as
  autopar shards both; norms and GPT's position embedding stay replicated.
* ``dp=2,tp=2``: the same TP plan on the ``tp`` sub-mesh of a 2-D
  ``DeviceMesh`` and DDP over the ``dp`` sub-mesh (DDP's own DDP+TP path,
  ``DistributedDataParallel(device_mesh=mesh["dp"])``).
* ``pp=2,dp=2`` (1F1B, 4 microbatches) and ``pp=4`` (GPipe, 4 microbatches):
  ``torch.distributed.pipelining`` on a hand-split model. Each pipeline rank
  builds its stage module by hand from the zoo model's own submodules (first
  stage: token (+ position) embedding and its blocks; middle stages: blocks;
  last stage: blocks, final norm and ``lm_head``; Llama's stages each keep the
  RoPE tables as buffers), with the same layers per stage as autopar's plan
  (``plan.data["pipeline"]["layers"]``: an even split here), wraps it in a
  manual ``PipelineStage`` on the ``pp`` sub-mesh's group and runs it with
  ``Schedule1F1B`` / ``ScheduleGPipe`` over the same microbatches, the model's
  loss as the schedule's ``loss_fn`` (mean per microbatch, gradients scaled by
  1 / microbatches: ``scale_grads=True``, as autopar averages). With dp > 1
  the stage module is wrapped in DDP over the ``dp`` sub-mesh, which the
  pipelining stage drives itself (``no_sync`` for all but the last backward).
  The 2-D mesh is ``(pp, dp)`` with pp outermost, autopar's layout, so the
  same ranks pair up on both sides. ``torch.distributed.pipelining`` runs on
  gloo/CPU in torch 2.13 (its P2P ops are gloo send/recv), so no hand-written
  send/recv fallback is needed. (A world of 4 cannot hold ``pp=2`` alone:
  autopar runs every rank of the world, so ``pp=2`` comes with ``dp=2``.)

The first step's loss of both must agree to 1e-4 relative (else the benchmark
fails: a broken comparison would be visible). Then both are warmed up and
timed in alternating blocks of steps (ABBA order per round, to cancel drift):
each step is timed with ``time.perf_counter`` after a ``dist.barrier``, the
median is taken per rank and the max over ranks (a step ends when the slowest
rank does). The reported number is the step-time ratio autopar / native per
(model, strategy); the target is <= 1.10. One extra step of each is profiled
on rank 0 (``torch.profiler``) to count collectives and the time spent in them.

    python -m benchmarks.overhead [--quick]
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
import types

WORLD = 4
# The models of benchmarks/fidelity.py (4 layers, width 256, vocab 2048) at seq 64
# and global batch 8 (512 tokens). On the 2-core machine (4 processes, one thread
# each) a dp=4 step takes ~310 ms; tp steps take 370-720 ms, which is their 30-50
# gloo collectives, not compute (seq 128 doubled every step time).
MODELS = {
    "gpt": "gpt:layers=4,hidden=256,heads=8,seq=64,vocab=2048",
    "llama": "llama:layers=4,hidden=256,heads=8,kv_heads=4,ffn=704,seq=64,vocab=2048",
}
STRATEGIES = ["dp=4", "tp=4", "dp=2,tp=2",
              "pp=2,dp=2,microbatches=4,schedule=1f1b", "pp=4,microbatches=4,schedule=gpipe"]
BATCH = 8
LR = 0.01
TARGET = 1.10
LOSS_RTOL = 1e-4
SMALL = 64 * 2 ** 10   # a collective on at most this many bytes is latency-bound


def settings(quick: bool) -> dict:
    """Warm-up steps, timing rounds and steps per block (each round runs one
    block of each side twice, ABBA)."""
    if quick:
        return {"warmup": 3, "rounds": 2, "block": 3}
    return {"warmup": 3, "rounds": 5, "block": 5}


# ---------------------------------------------------------------------------- native side

def _tp_attention_forward_gpt(self, x):
    """GPTAttention.forward with the head dim fixed and the local head count
    (the zoo's version derives head_dim from the input width, which is the full
    hidden size under Megatron-style TP). Identical to the original when tp=1."""
    import torch.nn.functional as F
    B, T, _ = x.size()
    hd = self._head_dim
    q = self.q(x).view(B, T, self.heads, hd).transpose(1, 2)
    k = self.k(x).view(B, T, self.heads, hd).transpose(1, 2)
    v = self.v(x).view(B, T, self.heads, hd).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(B, T, self.heads * hd)
    return self.o(y)


class Native:
    """The hand-written PyTorch-native equivalent of one strategy."""

    def __init__(self, z, family: str, dp: int, tp: int, mesh) -> None:
        import torch
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                       parallelize_module)
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.dp, self.tp = dp, tp
        self.loss_fn = z.loss_fn
        model = z.model
        self.dp_rank = 0
        if tp > 1:
            tp_mesh = mesh["tp"] if dp > 1 else mesh
            if family == "gpt":
                blocks, embed = model.blocks, "wte"
                mlp = {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
            else:
                blocks, embed = model.layers, "embed"
                mlp = {"mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(), "mlp.w2": RowwiseParallel()}
            for blk in blocks:
                attn = blk.attn
                if family == "gpt":
                    attn._head_dim = attn.q.out_features // attn.heads
                    attn.forward = types.MethodType(_tp_attention_forward_gpt, attn)
                    attn.heads //= tp
                else:
                    attn.heads //= tp
                    attn.kv_heads //= tp
                parallelize_module(blk, tp_mesh, {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                                                  "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
                                                  **mlp})
            parallelize_module(model, tp_mesh, {
                embed: RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
            })
            self._loss_ctx = loss_parallel
        else:
            self._loss_ctx = contextlib.nullcontext
        if dp > 1:
            dp_mesh = mesh["dp"] if tp > 1 else mesh
            self.dp_rank = dp_mesh.get_local_rank()
            self.dp_group = dp_mesh.get_group()
            model = DDP(model, device_mesh=dp_mesh)
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def _local(self, t):
        return t if self.dp == 1 else t.chunk(self.dp, dim=0)[self.dp_rank]

    def step(self, x, y) -> float:
        """Forward, loss, backward, SGD step on this rank's shard of the global
        batch; returns the local loss (the mean over this dp rank's samples)."""
        x, y = self._local(x), self._local(y)
        self.optimizer.zero_grad(set_to_none=True)
        with self._loss_ctx():
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
        self.optimizer.step()
        if hasattr(loss, "to_local"):
            loss = loss.to_local()
        return loss.item()

    def global_loss(self, local: float) -> float:
        import torch
        import torch.distributed as dist
        if self.dp == 1:
            return local
        t = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(t, group=self.dp_group)
        return float(t) / self.dp


def _stage_module(model, family: str, lo: int, hi: int, first: bool, last: bool):
    """Pipeline stage ``[lo, hi)`` of the zoo model, by hand, from its own
    submodules (the same parameter objects, so the same weights): the first
    stage adds the embeddings, the last the final norm and ``lm_head``."""
    import torch
    import torch.nn as nn

    class GPTStage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if first:
                self.wte, self.wpe = model.wte, model.wpe
            self.blocks = nn.ModuleList(model.blocks[lo:hi])
            if last:
                self.ln_f, self.lm_head = model.ln_f, model.lm_head

        def forward(self, x):
            if first:
                x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
            for blk in self.blocks:
                x = blk(x)
            return self.lm_head(self.ln_f(x)) if last else x

    class LlamaStage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if first:
                self.embed = model.embed
            self.layers = nn.ModuleList(model.layers[lo:hi])
            if last:
                self.norm, self.lm_head = model.norm, model.lm_head
            self.register_buffer("cos", model.cos, persistent=False)
            self.register_buffer("sin", model.sin, persistent=False)

        def forward(self, x):
            T = x.size(1)
            cos, sin = self.cos.narrow(0, 0, T), self.sin.narrow(0, 0, T)
            if first:
                x = self.embed(x)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.lm_head(self.norm(x)) if last else x

    return GPTStage() if family == "gpt" else LlamaStage()


class NativePipeline:
    """``torch.distributed.pipelining``: this rank's hand-made stage module in
    a manual ``PipelineStage``, run by ``Schedule1F1B`` or ``ScheduleGPipe``;
    DDP over dp around the stage module when dp > 1."""

    def __init__(self, z, family: str, par, layers: list[int], mesh) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        from torch.nn.parallel import DistributedDataParallel as DDP

        if par.chunks != 1 or par.schedule not in ("1f1b", "gpipe") or par.tp != 1:
            raise ValueError(f"no native pipeline baseline for {par.to_string()}")
        self.dp, self.pp = par.dp, par.pp
        pp_mesh = mesh["pp"] if par.dp > 1 else mesh
        self.pp_rank, self.pp_group = pp_mesh.get_local_rank(), pp_mesh.get_group()
        self.dp_rank = mesh["dp"].get_local_rank() if par.dp > 1 else 0
        self.dp_group = mesh["dp"].get_group() if par.dp > 1 else None
        self.last_rank = dist.get_global_rank(self.pp_group, par.pp - 1)
        r = self.pp_rank
        self.first, self.last = r == 0, r == par.pp - 1
        lo = sum(layers[:r])
        mod = _stage_module(z.model, family, lo, lo + layers[r], self.first, self.last)
        if par.dp > 1:
            mod = DDP(mod, process_group=self.dp_group)
        self.stage = PipelineStage(mod, r, par.pp, torch.device("cpu"), group=self.pp_group)
        schedule = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[par.schedule]
        self.schedule = schedule(self.stage, par.microbatches, loss_fn=z.loss_fn, scale_grads=True)
        self.optimizer = torch.optim.SGD(mod.parameters(), lr=LR)

    def _local(self, t):
        return t if self.dp == 1 else t.chunk(self.dp, dim=0)[self.dp_rank]

    def step(self, x, y) -> float:
        """One pipeline step on this dp rank's shard; returns the mean loss
        over the microbatches on the last stage (nan elsewhere)."""
        import torch
        x, y = self._local(x), self._local(y)
        self.optimizer.zero_grad(set_to_none=True)
        losses: list = []
        if self.first:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        self.optimizer.step()
        return float(torch.stack(losses).detach().mean()) if losses else math.nan

    def global_loss(self, local: float) -> float:
        """The last stage's loss on every rank, averaged over dp."""
        import torch
        import torch.distributed as dist
        t = torch.tensor([0.0 if math.isnan(local) else local], dtype=torch.float64)
        dist.broadcast(t, self.last_rank, group=self.pp_group)
        if self.dp > 1:
            dist.all_reduce(t, group=self.dp_group)
        return float(t) / self.dp


# ---------------------------------------------------------------------------- worker

def _profile(fn, group_size: int) -> dict:
    """One call of ``fn`` under torch.profiler: its wall time, and per gloo
    collective (as gloo runs it: on gloo a reduce-scatter is an all-reduce of
    the full tensor) and point-to-point send / recv the count, the time its gloo thread spent in it, and the
    bytes each rank sends in a ring over ``group_size`` ranks; and the self
    time of DTensor's Python dispatch (``PythonSubclass``)."""
    from torch.profiler import ProfilerActivity, profile
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    wall = time.perf_counter() - t0
    w = group_size
    ops: dict[str, dict] = {}
    small = {"count": 0, "gloo_ms": 0.0}   # latency-bound collectives
    for e in prof.events():
        if not e.name.startswith("gloo:") or "barrier" in e.name:
            continue
        kind = e.name[5:]
        numel = math.prod(e.input_shapes[0]) if e.input_shapes and e.input_shapes[0] else 0
        nbytes = 4 * numel   # fp32 everywhere here
        sent = {"all_reduce": 2 * (w - 1) / w * nbytes, "all_gather": (w - 1) * nbytes,
                "broadcast": nbytes, "recv": 0}.get(kind, nbytes)   # send: point to point
        o = ops.setdefault(kind, {"count": 0, "gloo_ms": 0.0, "sent_mb": 0.0})
        o["count"] += 1
        o["gloo_ms"] += e.cpu_time_total / 1e3
        o["sent_mb"] += sent / 2 ** 20
        if nbytes <= SMALL:
            small["count"] += 1
            small["gloo_ms"] += e.cpu_time_total / 1e3
    # DTensor's Python __torch_dispatch__ (sharding propagation, wrapping), its own time only
    subclass_ms = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == "PythonSubclass") / 1e3
    return {"wall_ms": wall * 1e3, "collectives": sum(o["count"] for o in ops.values()),
            "dtensor_dispatch_ms": subclass_ms,
            # a point-to-point op's span includes the wait for its peer (the pipeline's bubble): not counted
            "gloo_ms": sum(o["gloo_ms"] for k, o in ops.items() if k not in ("send", "recv")),
            "sent_mb": sum(o["sent_mb"] for o in ops.values()), "small": small, "ops": ops}


def _program_comms(pm) -> dict:
    """autopar's compiled program, statically: collectives by kind (forward
    ops; each has its own backward), and how many only move constants (their
    input depends on buffers alone, no parameter or input data: e.g. RoPE tables)."""
    from autopar.compile.rewrite import Comm
    gms = [pm.program] if pm.program is not None else list(pm.stage_modules)   # a pipeline: this rank's stages
    kinds: dict[str, int] = {}
    const = 0
    for gm in gms:
        params = {p for p, _ in gm.named_parameters()}
        for node in gm.graph.nodes:
            if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), Comm):
                continue
            kind = gm.get_submodule(node.target).kind
            kinds[kind] = kinds.get(kind, 0) + 1
            stack, seen, constant = list(node.all_input_nodes), set(), True
            while stack:
                a = stack.pop()
                if a in seen:
                    continue
                seen.add(a)
                if a.op == "call_method" and a.target == "size":
                    continue   # a shape read off the input is not data
                if a.op == "placeholder" or (a.op == "get_attr" and a.target in params):
                    constant = False
                    break
                stack.extend(a.all_input_nodes)
            const += constant
    return {"by_kind": kinds, "constant_only": const}


def _measure(rank: int, family: str, spec: str, strategy: str, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    import autopar.zoo as zoo
    from autopar.spec import parse_strategy

    par = parse_strategy(strategy, WORLD)
    z_a = zoo.build(spec, device="cpu", batch=BATCH, seed=0)
    z_n = zoo.build(spec, device="cpu", batch=BATCH, seed=0)
    g = torch.Generator().manual_seed(1)
    vocab = z_a.config["vocab"]
    shape = z_a.example_inputs[0].shape
    x = torch.randint(0, vocab, shape, generator=g)
    y = torch.randint(0, vocab, shape, generator=g)

    t0 = time.perf_counter()
    pm = autopar.parallelize(z_a.model, (x,), loss_fn=z_a.loss_fn, example_target=y,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=LR), strategy=strategy)
    setup_autopar = time.perf_counter() - t0
    t0 = time.perf_counter()
    if par.pp > 1:
        dims = (par.pp, par.dp) if par.dp > 1 else (par.pp,)
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("pp", "dp")[:len(dims)])
        native = NativePipeline(z_n, family, par, pm.plan.data["pipeline"]["layers"], mesh)
    else:
        if par.dp > 1 and par.tp > 1:
            mesh = init_device_mesh("cpu", (par.dp, par.tp), mesh_dim_names=("dp", "tp"))
        else:
            mesh = init_device_mesh("cpu", (WORLD,))
        native = Native(z_n, family, par.dp, par.tp, mesh)
    setup_native = time.perf_counter() - t0

    # step 1 from identical weights: the losses must agree
    loss_a = pm.train_step((x,), y)
    loss_n = native.global_loss(native.step(x, y))

    # time autopar's optimizer step with data parallelism: the gradient reduction left after the
    # backward (the buckets not overlapped with it) and the update
    sync_times: list[float] = []
    if pm.dist_optimizer is not None and pm.config.dp > 1:
        inner = pm.dist_optimizer.step

        def timed_sync() -> bool:
            t = time.perf_counter()
            ok = inner()
            sync_times.append(time.perf_counter() - t)
            return ok
        pm.dist_optimizer.step = timed_sync

    sides = {"autopar": lambda: pm.train_step((x,), y), "native": lambda: native.step(x, y)}
    for _ in range(cfg["warmup"] - 1):
        for fn in sides.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in sides}
    del sync_times[:]
    order = ["autopar", "native"]
    for _ in range(cfg["rounds"]):
        for side in order + order[::-1]:   # ABBA, then BAAB
            fn = sides[side]
            for _ in range(cfg["block"]):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[side].append(time.perf_counter() - t0)
        order.reverse()
    sync_ms = statistics.median(sync_times) * 1e3 if sync_times else None
    # one more step of each under torch.profiler (rank 0 records; all ranks run it)
    group = par.dp if par.tp == 1 else par.tp
    prof = {}
    for side, fn in sides.items():
        dist.barrier()
        if rank == 0:
            prof[side] = _profile(fn, group)
        else:
            fn()
    return {"times": times, "loss_autopar": loss_a, "loss_native": loss_n, "comms": pm.comms,
            "program": _program_comms(pm), "grad_sync_ms": sync_ms,
            "setup_s": {"autopar": setup_autopar, "native": setup_native}, "profile": prof}


def _worker(rank: int, world: int, runs: list[tuple[str, str]], cfg: dict, models: dict | None = None) -> dict:
    """``models``: model family -> zoo string (default :data:`MODELS`; the smoke test passes tiny ones)."""
    models = models or MODELS
    out = {}
    for family, strategy in runs:
        out[(family, strategy)] = _measure(rank, family, models[family], strategy, cfg)
    return out


# ---------------------------------------------------------------------------- main

def _iqr_rel(ts: list[float]) -> float:
    """Interquartile range over median: how noisy one rank's step times were."""
    if len(ts) < 4:
        return 0.0
    q = statistics.quantiles(ts, n=4)
    return (q[2] - q[0]) / q[1]


def _notes(runs, per_key: dict) -> list[str]:
    notes = [
        "Native set-up: DDP with its defaults (25 MiB buckets, overlapped with backward, buffers broadcast "
        "every forward, so Llama's RoPE tables cost it one broadcast per step); TP with "
        "`parallelize_module` on a `DeviceMesh`: ColwiseParallel on q/k/v and the MLP up (GPT fc; Llama w1, "
        "w3), RowwiseParallel on the attention output and MLP down projection, vocabulary-parallel token "
        "embedding (RowwiseParallel, replicated input) and lm_head (ColwiseParallel to Shard(-1)) with "
        "`loss_parallel`; norms and GPT's position embedding replicated. Attention heads set to the "
        "per-rank counts (Llama: heads, kv_heads); GPT's attention derives its head dim from the input width, "
        "so for native TP its forward is swapped for an equivalent one with a fixed head dim (the same "
        "arithmetic; step-1 losses match). 2-D: DDP(device_mesh=mesh['dp']) over the TP-parallelized model, "
        "which is PyTorch's own DDP+TP composition (it localizes the DTensor parameters for DDP); it works on "
        "gloo/CPU in this torch.",
        "Native pipelines: `torch.distributed.pipelining` (it runs on gloo/CPU in this torch; no hand-written "
        "send/recv fallback was needed) with a manual `PipelineStage` per rank on a hand-split stage module "
        "built from the zoo model's own submodules (first stage: embeddings + its blocks; last: its blocks + "
        "final norm + lm_head; Llama's stages each hold the RoPE tables as buffers), the same layers per stage "
        "as autopar's plan, `Schedule1F1B` / `ScheduleGPipe` with the same 4 microbatches, the model's loss "
        "as the schedule's `loss_fn` (`scale_grads=True`: the mean over microbatches, as autopar); for "
        "pp=2,dp=2 the stage module is wrapped in DDP over the dp sub-mesh of a (pp, dp) `DeviceMesh` (pp "
        "outermost, autopar's rank layout), which the pipelining stage drives (`no_sync` except in the last "
        "backward, so DDP's all-reduce overlaps only that backward). A world of 4 cannot run pp=2 alone, so "
        "pp=2 comes with dp=2.",
        "autopar's step includes what `train_step` does beyond the native loop: slicing the global batch, "
        "a scalar all-reduce of the loss over dp (the returned loss is the global mean) and, for dp > 1, the "
        "gradient all-reduce after backward (GradSync: flattened 25 MiB buckets, not overlapped with backward). "
        "With a pipeline it also broadcasts the loss from the last stage over the pp group every step, which "
        "the native loop does not (its loss stays on the last stage).",
        "Collectives, MB and gloo time below are measured: one extra step of each side under torch.profiler on "
        "rank 0, counting the gloo work items (gloo runs a reduce-scatter as an all-reduce of the full tensor; "
        "with a pipeline, point-to-point sends and receives count too, and rank 0 is the first stage); "
        "MB is what one rank sends in a ring (a receive sends nothing); gloo ms is the time the gloo threads "
        "spent in the collectives (with DDP part of it overlaps backward; sends and receives are left out, as their "
        "profiled spans include the wait for the peer stage).",
    ]
    for key in runs:
        d = per_key[key]
        pa, pn = d["profile"].get("autopar") or {}, d["profile"].get("native") or {}
        prog = d["program"]
        line = (f"{key[0]} {key[1]}: ratio {d['ratio']:.3f}. autopar {pa.get('collectives')} collectives/step, "
                f"{pa.get('sent_mb', 0):.1f} MB sent, {pa.get('gloo_ms', 0):.0f} ms in gloo; native "
                f"{pn.get('collectives')} collectives, {pn.get('sent_mb', 0):.1f} MB, {pn.get('gloo_ms', 0):.0f} "
                f"ms in gloo")
        if pn.get("dtensor_dispatch_ms"):
            line += f", {pn['dtensor_dispatch_ms']:.0f} ms in DTensor's Python dispatch"
        line += f". autopar's program: {prog['by_kind']}"
        if prog["constant_only"]:
            line += (f"; {prog['constant_only']} of these move only constant buffers (RoPE cos/sin tables, "
                     "placed sharded and all-gathered again at every use)")
        if d["grad_sync_ms"] is not None:
            line += f"; optimizer step (gradient reduction left after backward + update) {d['grad_sync_ms']:.0f} ms of the step"
        notes.append(line + ".")
    notes += _findings(runs, per_key)
    return notes


def _findings(runs, per_key: dict) -> list[str]:
    """What drives the differences, from this run's numbers."""
    out = []
    over = [k for k in runs if per_key[k]["ratio"] > TARGET]
    if over:
        out.append("Above the target: " + ", ".join(f"{f} {s} ({per_key[(f, s)]['ratio']:.2f})" for f, s in over)
                   + ". See the per-strategy lines for the measured collectives and GradSync time.")
    dp = [k for k in runs if k[1].startswith("dp=") and "tp" not in k[1]]
    if dp:
        sync = [per_key[k]["grad_sync_ms"] for k in dp if per_key[k]["grad_sync_ms"]]
        out.append(
            "Data parallel (ratios " + ", ".join(f"{k[0]} {per_key[k]['ratio']:.2f}" for k in dp)
            + "): both sides all-reduce the same bytes ("
            + ", ".join(f"{k[0]} {per_key[k]['profile']['autopar']['sent_mb']:.1f} vs "
                        f"{per_key[k]['profile']['native']['sent_mb']:.1f} MB" for k in dp)
            + f"). The one structural difference: autopar's GradSync runs after backward ({min(sync):.0f}-"
            f"{max(sync):.0f} ms per step here, including the copies in and out of the flat buffer and the "
            "wait for the slowest rank), where DDP overlaps its buckets with backward. With 4 processes on 2 "
            "cores the gloo threads compete with compute for the same cores, so the overlap gains DDP little "
            "on this machine." if sync else "")
    tp = [k for k in runs if "tp=" in k[1]]
    if tp:
        rs = all(per_key[k]["program"]["by_kind"].get("reduce_scatter") for k in tp)
        out.append(
            "Tensor parallel (ratios " + ", ".join(f"{k[0]} {k[1]} {per_key[k]['ratio']:.2f}" for k in tp) + "): "
            + ("autopar is faster than `parallelize_module` here. " if all(per_key[k]["ratio"] < 1 for k in tp)
               else "")
            + "Native TP pays DTensor's Python dispatch on every sharded op ("
            + ", ".join(f"{k[0]} {k[1]} {per_key[k]['profile']['native'].get('dtensor_dispatch_ms', 0):.0f} ms"
                        for k in tp)
            + " per step in `PythonSubclass` alone, before wrapping and redistribution), while autopar's "
            "program is a flat fx graph of plain tensors with explicit collectives."
            + (" autopar's plan keeps the residual stream sharded along the hidden dim (sequence-parallel "
               "style: all-gather before each norm, reduce-scatter after each row-parallel linear, one shared "
               "`reduce_grad` for q/k/v), so it issues more but not larger collectives than Megatron-style "
               "native TP, which all-reduces after every row-parallel linear and, in backward, the input grad "
               "of every column-parallel module separately (q, k, v each)." if rs else ""))
    pipe = [k for k in runs if k[1].startswith("pp=")]
    if pipe:
        def p2p(prof: dict, kind: str) -> int:
            return prof["ops"].get(kind, {}).get("count", 0)
        synced = [k for k in pipe if per_key[k]["grad_sync_ms"]]
        out.append(
            "Pipelines (ratios " + ", ".join(f"{k[0]} {k[1]} {per_key[k]['ratio']:.2f}" for k in pipe)
            + "): both sides run the same schedule over the same stages; the differences are in the messages. "
            "On rank 0 (the first stage) one step sent / received (autopar vs native): "
            + ", ".join(f"{k[0]} {k[1].split(',microbatches')[0]} "
                        f"{p2p(per_key[k]['profile']['autopar'], 'send')}/"
                        f"{p2p(per_key[k]['profile']['autopar'], 'recv')} vs "
                        f"{p2p(per_key[k]['profile']['native'], 'send')}/"
                        f"{p2p(per_key[k]['profile']['native'], 'recv')}" for k in pipe)
            + ". autopar's executor sends a small int64 header (shape, dtype, requires-grad) before every "
            "forward activation, so a receiver needs no shape inference; `torch.distributed.pipelining` "
            "exchanges shapes once, at its first step, and then only the data. autopar also broadcasts the loss "
            "over the pp group every step."
            + (" With dp=2, autopar's GradSync runs after the whole schedule ("
               + ", ".join(f"{k[0]} {per_key[k]['grad_sync_ms']:.0f} ms" for k in synced)
               + " per step), where DDP inside the pipelining stage all-reduces during the last microbatch's "
               "backward." if synced else ""))
    const = [k for k in runs if per_key[k]["program"]["constant_only"]]
    if const:
        out.append(
            "Avoidable in autopar's TP plan: " + ", ".join(
                f"{k[0]} {k[1]} all-gathers {per_key[k]['program']['constant_only']} constant tensors per "
                "forward" for k in const)
            + " (the RoPE cos/sin buffers are placed sharded, so each use gathers them again). They are tiny, "
            "but each is one more gloo round trip (in the profiled step, collectives on <= 64 KiB, gloo time with waits: "
            + ", ".join(f"{k[0]} {k[1]} autopar {per_key[k]['profile']['autopar']['small']['count']} taking "
                        f"{per_key[k]['profile']['autopar']['small']['gloo_ms']:.0f} ms vs native "
                        f"{per_key[k]['profile']['native']['small']['count']} taking "
                        f"{per_key[k]['profile']['native']['small']['gloo_ms']:.0f} ms" for k in const)
            + "), and they make up most of the difference in collective count from native TP. Replicating buffers that carry no gradient would remove them. That is a "
            "choice of the planner (search/propagate), not runtime work.")
    return [o for o in out if o]


def main(quick: bool = False) -> dict:
    """Run every (model, strategy) in one job of 4 gloo ranks, save and return the result."""
    from autopar.runtime.launch import run_distributed

    from benchmarks.common import save

    cfg = settings(quick)
    runs = [(f, s) for f in MODELS for s in STRATEGIES]
    t_start = time.perf_counter()
    res = run_distributed(_worker, WORLD, runs, cfg, timeout=1800, threads=1)
    wall = time.perf_counter() - t_start

    rows, raw, ratios, loss_errors, per_key, noise = [], {}, [], [], {}, []
    for key in runs:
        family, strategy = key
        per_rank = [r[key] for r in res]
        med = {side: max(statistics.median(r["times"][side]) for r in per_rank) * 1e3
               for side in ("autopar", "native")}
        ratio = med["autopar"] / med["native"]
        ratios.append(ratio)
        la, ln = per_rank[0]["loss_autopar"], per_rank[0]["loss_native"]
        rel = abs(la - ln) / abs(ln)
        loss_errors.append(rel)
        prof = per_rank[0]["profile"]
        noise += [_iqr_rel(r["times"][s]) for r in per_rank for s in ("autopar", "native")]
        rows.append([family, strategy, med["autopar"], med["native"], ratio, ratio <= TARGET,
                     prof["autopar"]["collectives"], prof["native"]["collectives"],
                     prof["autopar"]["sent_mb"], prof["native"]["sent_mb"], f"{la:.6g} / {ln:.6g}"])
        per_key[key] = {"ratio": ratio, "profile": prof, "program": per_rank[0]["program"],
                        "grad_sync_ms": max((r["grad_sync_ms"] for r in per_rank), default=None)
                        if per_rank[0]["grad_sync_ms"] is not None else None}
        raw[f"{family} {strategy}"] = {
            "step_ms": med, "ratio": ratio,
            "step_ms_per_rank": {side: [statistics.median(r["times"][side]) * 1e3 for r in per_rank]
                                 for side in ("autopar", "native")},
            "times_ms_rank0": {side: [round(t * 1e3, 2) for t in per_rank[0]["times"][side]]
                               for side in ("autopar", "native")},
            "loss_step1": {"autopar": la, "native": ln, "rel_diff": rel},
            "autopar_program_collectives": per_rank[0]["program"], "autopar_comms": per_rank[0]["comms"],
            "autopar_grad_sync_ms": per_key[key]["grad_sync_ms"],
            "setup_s_rank0": per_rank[0]["setup_s"],
            "profile_rank0": prof,
        }
    result = {
        "title": "Execution overhead: autopar vs PyTorch-native",
        "description": (
            f"Step time of autopar's compiled program (`parallelize(...).train_step`) against the hand-written "
            f"PyTorch-native equivalent (DDP for dp; `parallelize_module` with Colwise/RowwiseParallel for tp; "
            f"both for dp=2,tp=2; `torch.distributed.pipelining` on a hand-split model, manual `PipelineStage` + "
            f"`Schedule1F1B` / `ScheduleGPipe`, DDP over dp, for pp): same model and weights, global batch {BATCH}, SGD, {WORLD} gloo processes "
            f"with 1 thread each. Median per rank over interleaved (ABBA) blocks of steps, max over ranks. "
            f"Target: ratio autopar / native <= {TARGET}. Collectives and MB per step are measured "
            f"(torch.profiler, rank 0)."),
        "params": {"models": MODELS, "strategies": STRATEGIES, "global_batch": BATCH, "world": WORLD,
                   "threads_per_rank": 1, "optimizer": f"SGD lr={LR}", "quick": quick, **cfg,
                   "timed_steps_per_side": cfg["rounds"] * 2 * cfg["block"]},
        "table": {"columns": ["model", "strategy", "autopar ms", "native ms", "ratio", f"<= {TARGET}",
                              "autopar collectives", "native collectives", "autopar MB", "native MB",
                              "step-1 loss autopar / native"],
                  "rows": rows},
        "summary": {"median ratio": statistics.median(ratios), "worst ratio": max(ratios),
                    f"within {TARGET}": f"{sum(r <= TARGET for r in ratios)}/{len(ratios)}",
                    "max step-1 loss rel. diff": max(loss_errors),
                    "median step-time IQR / median (noise)": statistics.median(noise),
                    "wall time s": round(wall, 1)},
        "notes": _notes(runs, per_key),
        "raw": raw,
    }
    bad = [(k, e) for k, e in zip(runs, loss_errors) if e > LOSS_RTOL]
    if bad:
        raise AssertionError(f"autopar and native step-1 losses disagree beyond {LOSS_RTOL} relative: {bad}")
    save("overhead", result)
    return result


def _cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer timed steps (< 5 minutes on 2 cores)")
    args = ap.parse_args()
    r = main(args.quick)
    from benchmarks.common import fmt
    cols = r["table"]["columns"]
    print(" | ".join(cols))
    for row in r["table"]["rows"]:
        print(" | ".join(fmt(c) for c in row))
    for k, v in r["summary"].items():
        print(f"{k}: {fmt(v)}")


if __name__ == "__main__":
    _cli()
