"""THE Transformer trunk: one file, read top to bottom.

The trunk takes embeddings, never ids: tokenizers embed their modality into (B, T, d_model)
and heads read the output. Shapes in comments use
  B batch rows, T tokens (packed), S memory tokens (cross-attention), d d_model,
  H query heads, G key/value heads (GQA: H % G == 0), D head dim.

Attention masks are one of
  None              full bidirectional attention           -> SDPA, no mask (flash / cuDNN)
  "causal"          plain causal attention                 -> SDPA is_causal (flash / cuDNN)
  bool Tensor       allowed[b, h, q, k], broadcastable     -> SDPA with a dense mask (CPU, decoding)
  BlockMask         packed / modality-aware (omni.packing) -> FlexAttention
  LayerMasks        one of the above per layer (attention patterns: omni.attention_patterns)
and give the same numbers on every path (tests/test_trunk.py checks each against a dense reference).
``TrunkConfig.attention`` sets structured sparse attention per layer (local windows, 2-D windows, dilated, global
tokens: omni.attention_patterns); the trunk then builds a BlockMask per pattern from the mask it is given.

FlexAttention runs compiled kernels on CUDA; elsewhere a BlockMask runs ``banded_attention`` (eager, each query
block over its listed key blocks only: memory linear in T for local patterns); ``flex_mode("compiled")`` runs the
compiled kernels on the CPU too (the BlockMask path of every GPU run, tested on the CPU by tests/test_flex_cpu.py).
Torch has no FlexAttention backward on the CPU: there the gradient is that of ``banded_attention`` over the same
BlockMask, recomputed in the backward pass.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import InitVar, asdict, dataclass, field
from functools import partial
from typing import Callable, Iterator, Literal, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

from omni.attention_patterns import (LayerMasks, RingKVCache, normalise_config, pattern_masks, pin_cross,
                                     schedule_from_config)
from omni.banded_attention import banded_attention

Mask = Union[None, Literal["causal"], Tensor, BlockMask, LayerMasks]
Activation = Literal["gelu", "gelu_tanh", "relu", "swiglu"]  # the MLP's nonlinearity: see ACTIVATIONS


@dataclass
class TrunkConfig:
    d_model: int = 512
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int | None = None  # None = n_heads (MHA); 1 = MQA; else GQA
    activation: Activation = "gelu_tanh"  # the MLP's nonlinearity (ACTIVATIONS); "gelu" is the exact (erf) one
    mlp_ratio: float = 4.0  # hidden = mlp_ratio * d_model (swiglu: 2/3 of it, rounded to 64, as LLaMA)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    final_norm: bool = True  # False: the last block's output as it is (the head normalises: timm's fc_norm)
    positions: Literal["rope", "rope2d", "learned", "learned_1d", "sinusoidal", "none"] = "rope"
    max_positions: int = 4096  # learned table size (per axis for "learned")
    rope_base: float = 10000.0
    cross_attention: bool = False  # adds a cross-attention sublayer (encoder-decoder decoder)
    bias: bool = True
    dropout: float = 0.0
    # Structured sparse attention per layer (omni.attention_patterns), e.g. {"pattern": {"kind": "window",
    # "before": 64, "after": 64}, "full_every": 4}; None = full attention everywhere (converted peers, old configs).
    attention: dict | None = None
    # The field `activation` replaced: saved configs still say mlp="gelu" (the tanh form) or "swiglu".
    mlp: InitVar[Literal["gelu", "swiglu"] | None] = None

    def __post_init__(self, mlp: str | None) -> None:
        if mlp is not None:
            if mlp not in LEGACY_MLP:
                raise ValueError(f"unknown mlp {mlp!r}; use activation= one of {', '.join(ACTIVATIONS)}")
            if self.activation not in ("gelu_tanh", LEGACY_MLP[mlp]):  # "gelu_tanh": the default, not a choice
                raise ValueError(f"mlp={mlp!r} contradicts activation={self.activation!r}; give activation only")
            self.activation = LEGACY_MLP[mlp]  # type: ignore[assignment]
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; available: {', '.join(ACTIVATIONS)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.kv_heads}")
        if self.positions == "rope2d" and self.head_dim % 4:
            raise ValueError(f"2-D RoPE needs head_dim divisible by 4, got {self.head_dim}")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        self.attention = normalise_config(self.attention, self.n_layers)  # a plain dict for config.json

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


# Named sizes. ViT sizes follow the ViT paper, "whisper-*" the Whisper encoder/decoder stacks,
# "dt" the official Decision Transformer (GPT-2 with activation_function="relu", kzl/decision-transformer).
PRESETS: dict[str, dict] = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4),
    "Ti": dict(d_model=192, n_layers=12, n_heads=3),
    "S": dict(d_model=384, n_layers=12, n_heads=6),
    "B": dict(d_model=768, n_layers=12, n_heads=12),
    "L": dict(d_model=1024, n_layers=24, n_heads=16),
    "whisper-tiny": dict(d_model=384, n_layers=4, n_heads=6),
    "whisper-base": dict(d_model=512, n_layers=6, n_heads=8),
    "whisper-small": dict(d_model=768, n_layers=12, n_heads=12),
    "dt": dict(d_model=128, n_layers=3, n_heads=1, activation="relu"),
}


def preset(name: str, **overrides) -> TrunkConfig:
    """A TrunkConfig from a named size, with any field overridden."""
    if name not in PRESETS:
        raise KeyError(f"unknown trunk preset {name!r}; available: {', '.join(PRESETS)}")
    return TrunkConfig(**{**PRESETS[name], **overrides})


# ----------------------------------------------------------------------------------------------------
# Normalisation and MLP


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(cfg: TrunkConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


class SwiGLU(nn.Module):
    """LLaMA's gated unit: silu(gate) * value, the two halves of a twice-as-wide up projection."""

    def forward(self, h: Tensor) -> Tensor:
        gate, value = h.chunk(2, dim=-1)  # (..., hidden) each
        return F.silu(gate) * value


# TrunkConfig.activation -> a module factory. None has parameters, so the choice leaves checkpoints' keys alone.
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,  # exact (erf): timm ViT, Whisper, BERT
    "gelu_tanh": partial(nn.GELU, approximate="tanh"),  # tanh approximation: GPT-2's "gelu_new"
    "relu": nn.ReLU,  # the original Transformer; the Decision Transformer
    "swiglu": SwiGLU,  # LLaMA
}
LEGACY_MLP = {"gelu": "gelu_tanh", "swiglu": "swiglu"}  # TrunkConfig.mlp (saved configs) -> activation


class MLP(nn.Module):
    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        act = ACTIVATIONS[cfg.activation]()
        gated = isinstance(act, SwiGLU)
        hidden = int(cfg.mlp_ratio * cfg.d_model)
        if gated:  # keep the parameter count of an ungated MLP with the same ratio
            hidden = 64 * math.ceil(2 * hidden / 3 / 64)
        self.up = nn.Linear(cfg.d_model, 2 * hidden if gated else hidden, bias=cfg.bias)
        self.act = act
        self.down = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))  # (B, T, d) -> (B, T, hidden [x2 gated]) -> (B, T, d)


# ----------------------------------------------------------------------------------------------------
# Positions. Tokenizers supply per-token positions (B, T, 2): (row, col) for image grids, (p, p) for
# 1-D streams, so 2-D RoPE on a 1-D stream is plain RoPE with the frequencies split over two halves.


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE ("rope": axis 0 over the whole head; "rope2d": axis 0 and 1 over halves)."""

    def __init__(self, head_dim: int, base: float, two_d: bool) -> None:
        super().__init__()
        self.two_d = two_d
        n = head_dim // 4 if two_d else head_dim // 2
        inv_freq = base ** (-torch.arange(n, dtype=torch.float32) / n)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        p = positions.float()  # (B, T, 2)
        if self.two_d:
            angles = torch.cat([p[..., 0, None] * self.inv_freq, p[..., 1, None] * self.inv_freq], dim=-1)
        else:
            angles = p[..., 0, None] * self.inv_freq  # (B, T, D/2)
        return angles.cos()[:, None], angles.sin()[:, None]  # (B, 1, T, D/2) each


def apply_rotary(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of x (B, heads, T, D) by the position angles."""
    cos, sin = rope
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class LearnedPositions(nn.Module):
    """Factorised learned absolute positions: row table + column table (one table in effect for 1-D)."""

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        self.rows = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.cols = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.max_positions = cfg.max_positions

    def forward(self, positions: Tensor) -> Tensor:
        p = positions.clamp(0, self.max_positions - 1)  # documented: beyond the table, the last entry repeats
        return self.rows(p[..., 0]) + self.cols(p[..., 1])


class SequencePositions(nn.Module):
    """One learned table indexed by the token's place in its sequence (axis 0 of the positions): a ViT's
    (1 + N, d) position table, CLS at 0. Beyond the table the last entry repeats, as in LearnedPositions."""

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        self.table = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.max_positions = cfg.max_positions

    def forward(self, positions: Tensor) -> Tensor:
        return self.table(positions[..., 0].clamp(0, self.max_positions - 1))  # (B, T, 2) -> (B, T, d)


class SinusoidalPositions(nn.Module):
    """Fixed sin/cos positions; half the channels encode axis 0, half axis 1 (MAE-style 2-D sincos)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        if d_model % 4:
            raise ValueError(f"sinusoidal positions need d_model divisible by 4, got {d_model}")
        n = d_model // 4
        self.register_buffer("inv_freq", 10000.0 ** (-torch.arange(n, dtype=torch.float32) / n), persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        a = positions.float()[..., None] * self.inv_freq  # (B, T, 2, d/4)
        return torch.cat([a.sin(), a.cos()], dim=-1).flatten(-2)  # (B, T, d)


# TrunkConfig.positions -> the module whose output is added to the embeddings (rotary and "none" add nothing).
ABSOLUTE_POSITIONS: dict[str, Callable[[TrunkConfig], nn.Module]] = {
    "learned": LearnedPositions,  # row table + column table
    "learned_1d": SequencePositions,  # one table over token order (timm ViT)
    "sinusoidal": lambda cfg: SinusoidalPositions(cfg.d_model),
}


# ----------------------------------------------------------------------------------------------------
# Attention


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
    """q (B, H, Tq, D), k/v (B, G, Tk, D) -> (B, H, Tq, D), dispatching on the mask type."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockMask):
        return _flex(q, k, v, mask, gqa)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}; use None, 'causal', a bool tensor or a BlockMask")
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


FlexMode = Literal["auto", "compiled", "eager"]
FLEX_MODES: tuple[str, ...] = ("auto", "compiled", "eager")
_flex_mode: FlexMode = "auto"


@contextmanager
def flex_mode(mode: FlexMode) -> Iterator[None]:
    """Which FlexAttention runs BlockMask attention inside the block: "auto" (the default: compiled kernels on
    CUDA, the eager reference math elsewhere, which needs no compile), "compiled" (``torch.compile``'d kernels on
    every device: the CPU then runs the block-sparse kernels every GPU run uses; the first call per shape
    compiles, ~20-45 s on a CPU) or "eager". A process-wide setting, restored on exit; read when a forward runs
    (under ``torch.compile`` of a whole model: when it is traced)."""
    global _flex_mode
    if mode not in FLEX_MODES:
        raise ValueError(f"unknown flex mode {mode!r}; use one of {', '.join(FLEX_MODES)}")
    before, _flex_mode = _flex_mode, mode
    try:
        yield
    finally:
        _flex_mode = before


def _flex(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, gqa: bool) -> Tensor:
    compiled = _flex_mode == "compiled" or (_flex_mode == "auto" and q.is_cuda)
    if not compiled:  # eager: the linear-memory banded path over the same block tables (differentiable)
        return banded_attention(q, k, v, mask)
    fn = _compiled_flex()
    D = q.shape[-1]

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if compiled and D < 16:  # Flex's compiled kernels need head_dim >= 16: zero-pad (q.k unchanged)
            pad = (0, 16 - D)
            out = fn(F.pad(q, pad), F.pad(k, pad), F.pad(v, pad), block_mask=mask, enable_gqa=gqa, scale=D ** -0.5)
            return out[..., :D]
        return fn(q, k, v, block_mask=mask, enable_gqa=gqa)

    if not q.is_cuda and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _FlexBandedBackward.apply(q, k, v, mask, call)
    return call(q, k, v)


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def block_mask_to_dense(mask: BlockMask) -> Tensor:
    """A FlexAttention BlockMask as the dense bool mask (B, H, Q, KV) it applies: every pair of a full block,
    and the pairs of a partial block that its mask_mod allows; blocks not listed are masked. These are the
    compiled kernels' rules; eager flex_attention evaluates mask_mod alone. The two agree for an exact
    BlockMask (full blocks all allowed, unlisted blocks all masked), as omni.packing.block_mask builds."""
    Q, KV = mask.seq_lengths
    B, H, n_q = mask.kv_num_blocks.shape
    bq, bk = mask.BLOCK_SIZE
    n_kv = math.ceil(KV / bk)

    def blocks(num: Tensor | None, idx: Tensor | None) -> Tensor:  # (B, H, n_q) + (B, H, n_q, n) -> (B, H, Q, KV)
        dense = torch.zeros(B, H, n_q, n_kv + 1, dtype=torch.bool, device=mask.kv_num_blocks.device)
        if num is not None and idx is not None:
            listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]  # the first num entries count
            dense.scatter_(-1, torch.where(listed, idx.long(), n_kv), True)  # the rest land in a dropped column
        dense = dense[..., :n_kv]
        return dense.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[:, :, :Q, :KV]

    partial = blocks(mask.kv_num_blocks, mask.kv_indices)
    full = blocks(mask.full_kv_num_blocks, mask.full_kv_indices)
    allowed = create_mask(mask.mask_mod, B, H, Q, KV, device=mask.kv_num_blocks.device).bool()
    return full | (partial & allowed)


class _FlexBandedBackward(torch.autograd.Function):
    """FlexAttention where torch has no backward for it (the CPU: inputs that require grad are refused). The
    forward runs Flex (``call``) on the inputs detached; the backward differentiates the same attention computed
    by ``banded_attention`` over the BlockMask's tables (a query that sees no key gets zeros, as Flex gives):
    memory linear in T for local patterns, as the forward's."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, call: Callable) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(q, k, v)
        ctx.mask = mask
        return call(q.detach(), k.detach(), v.detach())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:  # type: ignore[override]
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
            dq, dk, dv = torch.autograd.grad(banded_attention(q, k, v, ctx.mask), (q, k, v), grad)
        return dq, dk, dv, None, None


# omni.introspect.capture sets ``record`` on attention modules to a reference attention (explicit softmax) that
# keeps the probabilities; None, the class default and the only value outside capture, is the fast path. A plain
# attribute read: nothing extra runs, traces or compiles when not recording.
Recorder = Callable[[Tensor, Tensor, Tensor, Mask], Tensor]  # (q, k, v, mask) -> (B, H, Tq, D), as attend


class SelfAttention(nn.Module):
    record: Recorder | None = None

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=cfg.bias)
        self.out = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None, mask: Mask,
                cache: "KVCache | None" = None, layer: int = 0, slots: Tensor | None = None) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split([self.n_heads * self.head_dim, self.n_kv * self.head_dim,
                                      self.n_kv * self.head_dim], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, G, T, D)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, G, T, D)
        if rope is not None:
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        if cache is not None:  # write the new keys/values, attend over the whole static buffer
            k, v = cache.update(layer, k, v, slots)  # (B, G, max_length, D)
        y = attend(q, k, v, mask) if self.record is None else self.record(q, k, v, mask)  # (B, H, T, D)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class CrossAttention(nn.Module):
    """Queries from the stream, keys/values from encoder memory (computed once per sequence when cached)."""

    record: Recorder | None = None  # as SelfAttention's

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.kv = nn.Linear(cfg.d_model, 2 * cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.out = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias)

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        B, S, _ = memory.shape
        k, v = self.kv(memory).view(B, S, 2, self.n_kv, self.head_dim).permute(2, 0, 3, 1, 4)
        return k, v  # (B, G, S, D) each

    def forward(self, x: Tensor, memory: Tensor | None, memory_mask: Tensor | None,
                cache: "KVCache | None" = None, layer: int = 0) -> Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        if cache is not None and cache.cross[layer] is not None:
            k, v = cache.cross[layer]
        else:
            if memory is None:
                raise ValueError("cross-attention needs `memory` (encoder output) on the first call")
            k, v = self.memory_kv(memory)
            if cache is not None:
                cache.cross[layer] = (k, v)
        mask = None if memory_mask is None else memory_mask[:, None, None, :]  # (B, 1, 1, S) keys kept
        y = attend(q, k, v, mask) if self.record is None else self.record(q, k, v, mask)  # (B, H, T, D)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    """Pre-norm block: x + SelfAttn(norm x) [+ CrossAttn(norm x)] + MLP(norm x)."""

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = make_norm(cfg), SelfAttention(cfg)
        self.cross_norm = make_norm(cfg) if cfg.cross_attention else None
        self.cross = CrossAttention(cfg) if cfg.cross_attention else None
        self.mlp_norm, self.mlp = make_norm(cfg), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None, mask: Mask,
                memory: Tensor | None = None, memory_mask: Tensor | None = None,
                cache: "KVCache | None" = None, layer: int = 0, slots: Tensor | None = None) -> Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), rope, mask, cache, layer, slots))
        if self.cross is not None:
            x = x + self.drop(self.cross(self.cross_norm(x), memory, memory_mask, cache, layer))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


# ----------------------------------------------------------------------------------------------------
# KV cache


@dataclass
class KVCache:
    """Static key/value buffers for incremental decoding.

    Shapes never change while decoding (a precondition for CUDA graphs): every step attends over
    the whole buffer (B, G, max_length, D) and a mask hides the slots not written yet and the
    slots written as padding. Cross-attention K/V are computed on the first call and reused.

    Two ways to say where new tokens go:
      length (Python int)      the default: append after `length` slots, then advance it. A new int
                               each call, so a step can be neither captured in a CUDA graph nor
                               compiled once for all positions.
      slots  (device tensor)   Trunk.forward(..., cache_position=p): write slots p .. p+T-1 with
                               index_put_, mask from p; `length` is neither read nor advanced (the
                               caller keeps p). Fixed shapes and addresses, no host sync: one graph
                               replays every step.
    Keys/values are one tensor PER LAYER, not one (L, ...) tensor: torch.compile writes a separate
    input in place but copies the whole shared buffer for a write into one layer's view of it.

    Callers change the cache only through its methods: ``reset`` (a new batch), ``reorder`` (beam search),
    ``pin_cross`` (fixed cross K/V addresses for a captured graph), ``rollback`` (speculative decoding); the trunk
    writes it through ``update`` and ``attention_mask``.
    """

    k: list[Tensor]  # per layer (B, G, max_length, D)
    v: list[Tensor]  # per layer (B, G, max_length, D)
    valid: Tensor  # (B, max_length) bool: slot written by a real (non-pad) token
    length: int = 0  # slots used so far (the Python-int path)
    cross: list[tuple[Tensor, Tensor] | None] = field(default_factory=list)
    pinned: list[tuple[Tensor, Tensor] | None] | None = field(default=None, repr=False)  # see pin_cross

    @classmethod
    def empty(cls, cfg: TrunkConfig, batch_size: int, max_length: int,
              device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> "KVCache":
        shape = (batch_size, cfg.kv_heads, max_length, cfg.head_dim)
        new = lambda: [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]  # noqa: E731
        return cls(k=new(), v=new(), valid=torch.zeros(batch_size, max_length, dtype=torch.bool, device=device),
                   cross=[None] * cfg.n_layers)

    @property
    def max_length(self) -> int:
        return self.valid.shape[1]

    def reset(self) -> None:
        """Empty the cache IN PLACE (the same tensors: a captured CUDA graph keeps its addresses);
        cross K/V are dropped (recomputed on the next call that passes memory; see ``pin_cross``)."""
        for t in self.k + self.v:
            t.zero_()  # stale slots are masked anyway; zeros keep old NaN/inf out of 0 * v
        self.valid.zero_()
        self.length = 0
        self.cross = [None] * len(self.k)

    def reorder(self, index: Tensor) -> None:
        """Row i takes the self-attention state of row ``index[i]`` (B,), IN PLACE: beams follow their
        source beam. Cross K/V stay: ``index`` must map each row to a row of the same memory (the beams
        of one input share it)."""
        for t in self.k + self.v + [self.valid]:
            t.copy_(t.index_select(0, index))

    def pin_cross(self) -> None:
        """Keep the cross K/V at the same addresses from batch to batch (a captured CUDA graph reads
        them): the first call holds the tensors computed since ``reset``, later calls copy the new batch's
        K/V into those and hold them again."""
        pin_cross(self)

    def real_tokens(self) -> Tensor:
        """(B,) slots written by real (non-pad) tokens per row."""
        return self.valid.sum(1)

    def rollback(self, lengths: Tensor, compact: bool = False) -> None:
        """Row b keeps its first ``lengths[b]`` (B,) real slots and forgets the later ones, IN PLACE (speculative
        decoding: the drafts the decoder rejected). ``compact``: also move every row's kept slots to the front, in
        order, so the free slots follow them (keys carry their positions, so attention is unchanged)."""
        kept = self.valid & (self.valid.cumsum(1) <= lengths[:, None])
        if compact:
            order = (~kept).to(torch.uint8).argsort(dim=1, stable=True)  # (B, max_length): kept slots first
            for t in self.k + self.v:
                t.copy_(t.gather(2, order[:, None, :, None].expand_as(t)))
            kept = kept.gather(1, order)
        self.valid.copy_(kept)

    def update(self, layer: int, k: Tensor, v: Tensor, slots: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Write k/v (B, G, T, D) after `length`, or at `slots` (T,) long; -> the layer's whole buffers."""
        if slots is None:
            T = k.shape[2]
            self.k[layer][:, :, self.length:self.length + T] = k
            self.v[layer][:, :, self.length:self.length + T] = v
        else:  # index_put_, not a slice: compiles to an in-place write; the cast is what slice assignment does
            self.k[layer][:, :, slots] = k.to(self.k[layer].dtype)
            self.v[layer][:, :, slots] = v.to(self.v[layer].dtype)
        return self.k[layer], self.v[layer]

    def attention_mask(self, T: int, new_mask: Mask, pad: Tensor | None, slots: Tensor | None = None) -> Tensor:
        """Mask (B, 1, T, max_length) for T new tokens: all earlier valid slots, plus `new_mask`
        (None = causal, "full" = bidirectional, or bool (B|1, 1, T, T)) among the new tokens.
        The new tokens go after `length`, or at `slots` (T,) = p .. p+T-1 (a device tensor: no overflow
        check, which would need a host sync; an out-of-range slot fails in index_put_)."""
        B, device = self.valid.shape[0], self.valid.device
        block = _new_token_block(T, new_mask, device)  # (B|1, 1, T, T)
        if slots is None:
            start = self.length
            if start + T > self.max_length:
                raise ValueError(f"KV cache overflow: {start} cached + {T} new > max_length {self.max_length}")
            self.valid[:, start:start + T] = True if pad is None else ~pad
            full = torch.zeros(B, 1, T, self.max_length, dtype=torch.bool, device=device)
            full[..., :start] = True
            full[..., start:start + T] = block
            full = full & self.valid[:, None, None, :]
            # A pad query that sees nothing would give NaN: let it see its own slot.
            own = torch.zeros_like(full)
            own[..., start:start + T] = torch.eye(T, dtype=torch.bool, device=device)
            return full | own
        # The same mask (pad queries seeing their own slot included) from slot offsets rel[s] = s - p,
        # with no Python int.
        self.valid[:, slots] = torch.ones(B, T, dtype=torch.bool, device=device) if pad is None else ~pad
        rel = torch.arange(self.max_length, device=device) - slots[0]  # (max_length,)
        new = (rel >= 0) & (rel < T)  # slots of the new tokens
        full = (rel < 0) | (new & block[..., rel.clamp(0, T - 1)])  # (B|1, 1, T, max_length)
        full = full & self.valid[:, None, None, :]
        own = rel == torch.arange(T, device=device)[:, None]  # (T, max_length): query i sees slot p + i
        return full | own


def _new_token_block(T: int, new_mask: Mask, device: torch.device) -> Tensor:
    """Which new tokens see which (B|1, 1, T, T), from a cached call's mask argument."""
    if new_mask is None or (isinstance(new_mask, str) and new_mask == "causal"):
        return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
    if isinstance(new_mask, str) and new_mask == "full":
        return torch.ones(1, 1, T, T, dtype=torch.bool, device=device)
    if isinstance(new_mask, Tensor):
        return new_mask
    raise TypeError(f"with a KV cache the mask must be None/'causal'/'full' or a bool tensor, got {type(new_mask)}")


# ----------------------------------------------------------------------------------------------------
# The trunk


class Trunk(nn.Module):
    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope = (RotaryEmbedding(cfg.head_dim, cfg.rope_base, two_d=cfg.positions == "rope2d")
                     if cfg.positions in ("rope", "rope2d") else None)
        absolute = ABSOLUTE_POSITIONS.get(cfg.positions)
        self.absolute = absolute(cfg) if absolute is not None else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.schedule = schedule_from_config(cfg.attention, cfg.n_layers)  # per-layer pattern, None = full
        self.norm = make_norm(cfg) if cfg.final_norm else nn.Identity()
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith(("attn.out.weight", "cross.out.weight", "mlp.down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, x: Tensor, positions: Tensor | None = None, mask: Mask | str = None,
                memory: Tensor | None = None, memory_mask: Tensor | None = None,
                cache: KVCache | None = None, pad: Tensor | None = None,
                cache_position: Tensor | None = None) -> Tensor:
        """x (B, T, d) embeddings -> (B, T, d) hidden states (normalised unless cfg.final_norm is False).

        positions: (B, T, 2) or (B, T) ints; default 0..T-1 (continuing after the cache).
        mask:      see the module docstring; with a cache: None/"causal", "full" or bool (B|1, 1, T, T)
                   among the new tokens (earlier cached tokens are always visible). With cfg.attention, the
                   patterns are AND-ed in per layer (a packed batch: PackedBatch.attention_mask(schedule=...)).
        memory:    (B, S, d) encoder output for cross-attention; memory_mask (B, S) bool, True = keep.
        cache:     KVCache to read and extend (incremental decoding); pad (B, T) bool marks pad tokens.
        cache_position: () or (1,) long DEVICE tensor p: the new tokens take cache slots p .. p+T-1
                   (and positions p .. by default) instead of following cache.length, which is left
                   alone. Nothing then depends on a Python int, so a step compiles and CUDA-graphs once.
        """
        B, T, _ = x.shape
        slots = None  # (T,) cache slots of the new tokens, when given as data
        if cache_position is not None:
            if cache is None or cache_position.numel() != 1:
                raise ValueError("cache_position is one slot index (a () or (1,) tensor) and needs a cache")
            slots = cache_position.reshape(1) + torch.arange(T, device=cache_position.device)
        if positions is None:
            if slots is not None:
                positions = slots.expand(B, T)
            else:
                start = cache.length if cache is not None else 0
                positions = torch.arange(start, start + T, device=x.device).expand(B, T)
        if positions.dim() == 2:
            positions = torch.stack([positions, positions], dim=-1)  # 1-D -> (p, p)
        if self.absolute is not None:
            x = x + self.absolute(positions).to(x.dtype)
        rope = self.rope(positions) if self.rope is not None else None
        if cache is not None:
            if self.schedule.sparse and not isinstance(cache, RingKVCache):
                raise ValueError("a trunk with attention patterns decodes with the cache Trunk.new_cache makes")
            mask = cache.attention_mask(T, mask, pad, slots)
        elif self.schedule.sparse:
            mask = pattern_masks(self.schedule, mask, positions)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, mask[i] if isinstance(mask, LayerMasks) else mask, memory, memory_mask, cache, i, slots)
        if cache is not None and slots is None:
            cache.length += T
        return self.norm(x)

    def new_cache(self, batch_size: int, max_length: int, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> KVCache | RingKVCache:
        p = next(self.parameters())
        if self.schedule.sparse:  # windowed layers keep a ring of their window
            return RingKVCache.empty(self.schedule, self.cfg.kv_heads, self.cfg.head_dim, batch_size, max_length,
                                     device or p.device, dtype or p.dtype)
        return KVCache.empty(self.cfg, batch_size, max_length, device or p.device, dtype or p.dtype)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
