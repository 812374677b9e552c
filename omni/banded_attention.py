"""The eager linear-memory attention path over a FlexAttention BlockMask's tables (omni.attention_patterns makes
them): each query block attends to its listed key blocks only, in chunks, with a hand-written backward that
recomputes each chunk's probabilities, so time and memory grow linearly with the length for local patterns.
Where FlexAttention is not compiled (and for its missing CPU backward), omni.trunk runs this instead."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask



def banded_attention(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, scale: float | None = None,
                     budget: int = 1 << 21) -> Tensor:
    """Attention over a BlockMask's tables without FlexAttention: each query block attends to its listed key
    blocks only (full ones whole, partial ones through mask_mod), as the compiled kernels do. q (B, H, Tq, D),
    k/v (B, G, Tk, D) -> (B, H, Tq, D). Query blocks go in chunks of about ``budget`` scores, grouped by how many
    key blocks they read (a global token's block reads all of them, its neighbours a few), each chunk reading
    only its listed keys; the backward recomputes each chunk's probabilities and adds its key / value gradients
    in place: time and memory linear in T for local patterns, never Tq x Tk. A query that may see no key gets
    zeros (as FlexAttention gives). Float32 inside."""
    B, H, Tq, D = q.shape
    G = k.shape[1]
    if H != G:  # GQA: query head h reads key/value head h // (H / G)
        k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    return _Banded.apply(q, k, v, _plan(mask, B, H, Tq, k.shape[2], budget), D ** -0.5 if scale is None else scale)


@dataclass
class _Chunk:
    sel: Tensor  # (c,) query blocks
    kp: Tensor  # (B, Hm, c, K) key places read by each query block (clamped)
    qp: Tensor  # (1, 1, c, bq, 1) query places (clamped)
    trusted: Tensor  # (B, Hm, c, K) keys of full blocks
    usable: Tensor  # (B, Hm, c, K) keys listed and inside the sequence


def _plan(mask: BlockMask, B: int, H: int, Tq: int, Tk: int, budget: int) -> tuple:
    """The chunks of query blocks (similar widths, neighbours together) and what each reads."""
    bq, bk = mask.BLOCK_SIZE
    nq, dev = math.ceil(Tq / bq), mask.kv_num_blocks.device
    pnum, pidx = mask.kv_num_blocks[..., :nq].long(), mask.kv_indices[..., :nq, :].long()
    if mask.full_kv_num_blocks is None or mask.full_kv_indices is None:
        fnum, fidx = torch.zeros_like(pnum), torch.zeros_like(pidx[..., :1])
    else:
        fnum, fidx = mask.full_kv_num_blocks[..., :nq].long(), mask.full_kv_indices[..., :nq, :].long()
    widths = (pnum + fnum).flatten(0, 1).max(0).values.clamp_min(1)  # (nq,) key blocks each query block reads
    order = widths.argsort(stable=True).tolist()
    width = widths.tolist()
    ar = torch.arange(bk, device=dev)
    chunks, s = [], 0
    while s < nq:
        e = s + 1
        while e < nq and (e + 1 - s) * width[order[e]] * bk * bq * B * H <= budget:
            e += 1
        sel = torch.tensor(order[s:e], device=dev)
        W = width[order[e - 1]]
        slot = torch.arange(W, device=dev)
        n_p, n_f = pnum[..., sel, None], fnum[..., sel, None]  # (b, h, c, 1)
        pi, fi = pidx[..., sel, :], fidx[..., sel, :]
        from_p = pi.gather(-1, slot.clamp(max=pi.shape[-1] - 1).expand(*pi.shape[:-1], W))
        from_f = fi.gather(-1, (slot - n_p).clamp(0, fi.shape[-1] - 1))
        blocks = torch.where(slot < n_p, from_p, from_f)  # (b, h, c, W): partial blocks first, then full ones
        listed, full = slot < n_p + n_f, (slot >= n_p) & (slot < n_p + n_f)
        kp = blocks[..., None] * bk + ar  # (b, h, c, W, bk)
        Hm = blocks.shape[1]  # the tables' heads: 1 when the mask is the same for every head
        usable = (listed[..., None] & (kp < Tk)).flatten(-2).expand(B, Hm, -1, -1)
        trusted = full[..., None].expand(*full.shape, bk).flatten(-2).expand(B, Hm, -1, -1)
        qp = (sel[:, None] * bq + torch.arange(bq, device=dev)).clamp(max=Tq - 1)[None, None, :, :, None]
        chunks.append(_Chunk(sel, kp.flatten(-2).clamp(max=Tk - 1).expand(B, Hm, -1, -1), qp, trusted, usable))
        s = e
    return mask, bq, nq, chunks


def _probs(mask: BlockMask, ch: _Chunk, qc: Tensor, kg: Tensor, scale: float) -> Tensor:
    """softmax over the chunk's listed keys: (B, H, c, bq, K) float32, 0 where not allowed."""
    B, Hm = ch.kp.shape[:2]
    b = torch.arange(B, device=qc.device)[:, None, None, None, None]
    h = torch.arange(Hm, device=qc.device)[None, :, None, None, None]
    allowed = mask.mask_mod(b, h if Hm > 1 else h * 0, ch.qp, ch.kp[..., None, :])  # (B, Hm, c, bq, K)
    allowed = (allowed | ch.trusted[..., None, :]) & ch.usable[..., None, :]
    scores = torch.einsum("bhcqd,bhckd->bhcqk", qc, kg) * scale
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)


def _float32(fn: Callable) -> Callable:
    """Run a Function's forward / backward with autocast off: the math is float32 by design (under a bf16
    autocast the einsums would give bf16, which the float32 buffers they fill refuse)."""

    @functools.wraps(fn)
    def run(ctx: Any, first: Tensor, *rest: Any) -> Any:
        with torch.autocast(first.device.type, enabled=False):
            return fn(ctx, first, *rest)

    return run


class _Banded(torch.autograd.Function):
    """The chunked attention with a hand-written backward: per chunk, recompute the probabilities P, then
    dV += P^T dO, dS = P (dP - rowsum(dO * O)), dQ = dS K, dK += dS^T Q (scaled), added in place at the chunk's
    key places: no chunk's scores outlive it."""

    @staticmethod
    @_float32
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: tuple, scale: float) -> Tensor:  # type: ignore[override]
        mask, bq, nq, chunks = plan
        B, H, Tq, D = q.shape
        qb = F.pad(q.float(), (0, 0, 0, nq * bq - Tq)).view(B, H, nq, bq, D)
        kf, vf = k.float(), v.float()
        out = torch.zeros_like(qb)
        bi, hi = torch.arange(B, device=q.device)[:, None, None, None], torch.arange(H, device=q.device)[None, :, None, None]
        for ch in chunks:
            kh = ch.kp.expand(B, H, -1, -1)
            p = _probs(mask, ch, qb[:, :, ch.sel], kf[bi, hi, kh], scale)
            out[:, :, ch.sel] = torch.einsum("bhcqk,bhckd->bhcqd", p, vf[bi, hi, kh])
        ctx.save_for_backward(q, k, v, out)
        ctx.plan, ctx.scale = plan, scale
        return out.flatten(2, 3)[:, :, :Tq].to(q.dtype)

    @staticmethod
    @_float32
    def backward(ctx, grad: Tensor) -> tuple:  # type: ignore[override]
        q, k, v, out = ctx.saved_tensors
        mask, bq, nq, chunks = ctx.plan
        B, H, Tq, D = q.shape
        qb = F.pad(q.float(), (0, 0, 0, nq * bq - Tq)).view(B, H, nq, bq, D)
        gb = F.pad(grad.float(), (0, 0, 0, nq * bq - Tq)).view(B, H, nq, bq, D)
        kf, vf = k.float(), v.float()
        dq, dk, dv = torch.zeros_like(qb), torch.zeros_like(kf), torch.zeros_like(vf)
        bi, hi = torch.arange(B, device=q.device)[:, None, None, None], torch.arange(H, device=q.device)[None, :, None, None]
        for ch in chunks:
            kh = ch.kp.expand(B, H, -1, -1)
            qc, go, kg, vg = qb[:, :, ch.sel], gb[:, :, ch.sel], kf[bi, hi, kh], vf[bi, hi, kh]
            p = _probs(mask, ch, qc, kg, ctx.scale)
            dv.index_put_((bi, hi, kh), torch.einsum("bhcqk,bhcqd->bhckd", p, go), accumulate=True)
            dp = torch.einsum("bhcqd,bhckd->bhcqk", go, vg)
            ds = p * (dp - (go * out[:, :, ch.sel]).sum(-1, keepdim=True)) * ctx.scale
            dq[:, :, ch.sel] = torch.einsum("bhcqk,bhckd->bhcqd", ds, kg)
            dk.index_put_((bi, hi, kh), torch.einsum("bhcqk,bhcqd->bhckd", ds, qc), accumulate=True)
        dq = dq.flatten(2, 3)[:, :, :Tq]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


__all__ = ["banded_attention"]
