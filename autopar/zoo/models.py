"""Reference model families for autopar: GPT, Llama, MLP and CNN.

Plain ``nn.Module``s in the spirit of nanoGPT. They are written for the
planner as much as for people:

- every linear layer is its own ``nn.Linear`` (separate ``q``/``k``/``v``, no
  fused qkv that is split later), so each one can be sharded on its own;
- repeated layers live in an ``nn.ModuleList`` of identical blocks, so the
  planner can find them and plan one block for all;
- ``forward`` has no data-dependent control flow, so ``torch.fx.symbolic_trace``
  works;
- constructors do nothing beyond allocating parameters, so building GPT-3 175B
  under ``with torch.device("meta")`` is instant.

Each family has a config dataclass whose fields are the keys of the model
string (``gpt:layers=2,hidden=64``); invalid values raise
:class:`autopar.errors.ZooError`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ZooError


# --------------------------------------------------------------------- config checks

def _check_positive(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ZooError(f"{name}={value!r} is invalid: expected a positive integer")


def _check_flag(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value not in (0, 1) or isinstance(value, float):
            raise ZooError(f"{name}={value!r} is invalid: expected 0 or 1")


def _check_divides(cfg, small: str, big: str) -> None:
    a, b = getattr(cfg, small), getattr(cfg, big)
    if b % a:
        valid = [d for d in range(1, b + 1) if b % d == 0]
        shown = ", ".join(map(str, valid[:12])) + (", ..." if len(valid) > 12 else "")
        raise ZooError(f"{small}={a} does not divide {big}={b}: choose {small} from {shown}")


# ---------------------------------------------------------------------------- GPT

@dataclass
class GPTConfig:
    """GPT-2 style decoder; defaults are GPT-2 small (124M)."""

    layers: int = 12
    hidden: int = 768
    heads: int = 12
    seq: int = 1024
    vocab: int = 50257
    ffn: int | None = None  # None -> 4 * hidden
    bias: int = 1           # 1: linears and LayerNorms have biases
    tie: int = 0            # 1: lm_head.weight is wte.weight
    batch: int = 1          # batch size of the example inputs

    def __post_init__(self):
        if self.ffn is None:
            self.ffn = 4 * self.hidden
        _check_positive(self, "layers", "hidden", "heads", "seq", "vocab", "ffn", "batch")
        _check_flag(self, "bias", "tie")
        _check_divides(self, "heads", "hidden")


class GPTAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        bias = bool(cfg.bias)
        self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)
        self.k = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)
        self.v = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)

    def forward(self, x):
        B, T, C = x.size()
        hd = C // self.heads
        # [B, T, C] -> [B, heads, T, hd]
        q = self.q(x).view(B, T, self.heads, hd).transpose(1, 2)
        k = self.k(x).view(B, T, self.heads, hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.heads, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.o(y)


class GPTMLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn, bias=bool(cfg.bias))
        self.gelu = nn.GELU()
        self.proj = nn.Linear(cfg.ffn, cfg.hidden, bias=bool(cfg.bias))

    def forward(self, x):
        return self.proj(self.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, bias=bool(cfg.bias))
        self.attn = GPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden, bias=bool(cfg.bias))
        self.mlp = GPTMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT-2 style language model: ``forward(idx[B, T]) -> logits[B, T, vocab]``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.hidden, bias=bool(cfg.bias))
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        B, T = idx.size()
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# -------------------------------------------------------------------------- Llama

@dataclass
class LlamaConfig:
    """Llama-3 style decoder (RMSNorm, RoPE, GQA, SwiGLU); defaults are a ~1.5B model."""

    layers: int = 16
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 8192
    seq: int = 2048
    vocab: int = 128256
    rope_theta: float = 500000.0
    batch: int = 1

    def __post_init__(self):
        _check_positive(self, "layers", "hidden", "heads", "kv_heads", "ffn", "seq",
                        "vocab", "batch")
        _check_divides(self, "heads", "hidden")
        _check_divides(self, "kv_heads", "heads")
        if (self.hidden // self.heads) % 2:
            raise ZooError(f"head_dim = hidden/heads = {self.hidden // self.heads} must be even "
                           "for rotary embeddings: choose hidden and heads accordingly")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ZooError(f"rope_theta={self.rope_theta!r} is invalid: expected a positive number")
        self.rope_theta = float(self.rope_theta)


def rope_cache(seq: int, head_dim: int, theta: float, device=None):
    """Return ``(cos, sin)``, each ``[seq, head_dim]``, for rotate-half RoPE.

    Real arithmetic only: complex tensors do not trace or shard well.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    t = torch.arange(seq, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)            # [seq, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)     # [seq, head_dim]
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """Rotate ``x[B, T, heads, hd]`` by positions ``0..T-1`` (``cos``/``sin``: ``[T, hd]``)."""
    # [T, hd] -> [T, 1, hd] so it broadcasts over the batch and head dims
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.k = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        hd, n_rep = self.head_dim, self.heads // self.kv_heads
        q = self.q(x).view(B, T, self.heads, hd)
        k = self.k(x).view(B, T, self.kv_heads, hd)
        v = self.v(x).view(B, T, self.kv_heads, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # GQA: query head h uses kv head h // n_rep
        k = k.repeat_interleave(n_rep, dim=2)
        v = v.repeat_interleave(n_rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, self.heads * hd)
        return self.o(y)


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=1e-5)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=1e-5)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class Llama(nn.Module):
    """Llama language model: ``forward(idx[B, T]) -> logits[B, T, vocab]``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList([LlamaBlock(cfg) for _ in range(cfg.layers)])
        self.norm = nn.RMSNorm(cfg.hidden, eps=1e-5)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        # Non-persistent: derived from the config, so not part of the state dict.
        cos, sin = rope_cache(cfg.seq, cfg.hidden // cfg.heads, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset_rope(self) -> None:
        """Recompute the ``cos``/``sin`` buffers in place, e.g. after ``to_empty()``
        materialised a model built on the meta device."""
        cfg = self.config
        cos, sin = rope_cache(cfg.seq, cfg.hidden // cfg.heads, cfg.rope_theta, self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, idx):
        B, T = idx.size()
        # narrow, not [:T]: fx cannot slice a real buffer with a traced T
        cos, sin = self.cos.narrow(0, 0, T), self.sin.narrow(0, 0, T)
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


# ---------------------------------------------------------------------------- MLP

@dataclass
class MLPConfig:
    """Classifier of ``layers`` Linear+ReLU blocks."""

    layers: int = 4
    inp: int = 512
    hidden: int = 1024
    classes: int = 10
    batch: int = 1

    def __post_init__(self):
        _check_positive(self, "layers", "inp", "hidden", "classes", "batch")


class MLPBlock(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


class MLP(nn.Module):
    """``forward(x[B, inp]) -> logits[B, classes]``."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.config = cfg
        dims = [cfg.inp] + [cfg.hidden] * cfg.layers
        self.blocks = nn.ModuleList([MLPBlock(a, b) for a, b in zip(dims[:-1], dims[1:])])
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# ---------------------------------------------------------------------------- CNN

@dataclass
class CNNConfig:
    """Image classifier of ``layers`` conv stages of constant width ``channels``."""

    layers: int = 3
    channels: int = 32
    image: int = 32
    in_channels: int = 3
    classes: int = 10
    batch: int = 1

    def __post_init__(self):
        _check_positive(self, "layers", "channels", "image", "in_channels", "classes", "batch")
        # each of the layers-1 poolings halves the image; it must not vanish
        if self.image < 2 ** (self.layers - 1):
            raise ZooError(f"image={self.image} is too small for layers={self.layers}: "
                           f"need image >= {2 ** (self.layers - 1)} (or fewer layers)")


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)  # BN has the bias
        self.bn = nn.BatchNorm2d(c_out)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class CNN(nn.Module):
    """``forward(x[B, in_channels, image, image]) -> logits[B, classes]``."""

    def __init__(self, cfg: CNNConfig):
        super().__init__()
        self.config = cfg
        chans = [cfg.in_channels] + [cfg.channels] * cfg.layers
        self.blocks = nn.ModuleList([ConvBlock(a, b) for a, b in zip(chans[:-1], chans[1:])])
        self.pool = nn.MaxPool2d(2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(cfg.channels, cfg.classes)

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i > 0:  # depends on the layer index only, not on data: fx-safe
                x = self.pool(x)
            x = block(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.head(x)


def n_params(model: nn.Module) -> int:
    """Return the number of distinct parameters' elements (tied weights count once)."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "GPT", "GPTConfig", "Llama", "LlamaConfig", "MLP", "MLPConfig", "CNN", "CNNConfig",
    "rope_cache", "apply_rope", "rotate_half", "n_params",
]
