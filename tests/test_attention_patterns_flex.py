"""Attention patterns through ``torch.compile``'d FlexAttention on the CPU (omni.trunk.flex_mode "compiled"): the
kernels every GPU run uses, which skip unlisted tiles and trust full ones, so a wrong block table shows here.
Every pattern, packed and unpacked, forward and backward, equals SDPA with the dense mask (fp32, 1e-5); a packed
trunk with a schedule under capture too. Every pattern lowers to the same mask_mod reading tensors and every test
uses the same shapes, so the module compiles Flex ONCE (``test_one_compile``). Marker: ``flex_cpu``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from omni import trunk as trunk_module
from omni.attention_patterns import Any_, Dilated, Full, Global, Layout, Window, Window2D, block_mask, dense
from omni.introspect import capture
from omni.packing import Packer
from omni.segment import Role, Sample, Segment
from omni.trunk import Trunk, TrunkConfig, flex_mode

B, T, HEADS, KV_HEADS, HEAD_DIM = 2, 512, 4, 2, 16  # four 128-token blocks per row: skipped tiles occur
TOL = dict(atol=1e-5, rtol=1e-5)
pytestmark = [pytest.mark.flex_cpu, pytest.mark.filterwarnings("ignore::UserWarning")]

PATTERNS = {
    "full": Full(),
    "window": Window(before=100, after=30),
    "causal_window": Window(before=150, after=0),
    "window2d": Window2D(rows=2, cols=3),
    "dilated": Dilated(dilation=3, before=200, after=200),
    "window+global": Window(before=60, after=60) | Global(first=3),
    "all": Any_((Window2D(rows=1, cols=1), Dilated(dilation=7), Window(before=20, after=0), Global(first=1))),
}


def grid(n: int, w: int = 16) -> Segment:
    pos = torch.stack([torch.arange(n) // w, torch.arange(n) % w], -1)
    return Segment("vec", torch.randn(n, 3), pos, Role.BIDIRECTIONAL)


def text(n: int) -> Segment:
    return Segment("ids", torch.randint(0, 9, (n,)), torch.arange(n), Role.CAUSAL)


def packed():
    torch.manual_seed(0)
    samples = [Sample([grid(200), text(90)], key="a"), Sample([text(150)], key="b"),
               Sample([grid(200)], key="c"), Sample([text(40), grid(100), text(130)], key="d")]
    batch = Packer(row_length=T)(samples)
    assert batch.shape == (B, T)
    return batch


def unpacked(causal: bool) -> Layout:
    pos = torch.stack([torch.arange(T) // 16, torch.arange(T) % 16], -1).expand(B, T, 2)
    return Layout.single(pos, causal)


LAYOUTS = {"packed": lambda: packed().layout(), "unpacked": lambda: unpacked(False),
           "unpacked_causal": lambda: unpacked(True)}


def qkv(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """q (B, H, T, D), k/v (B, G, T, D) as a trunk with RoPE makes them (q, k rotated into their own tensors, v a
    view of the projection: the same strides, so the same compiled graph), from a leaf that requires grad."""
    fused = torch.randn(B, T, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g, requires_grad=True)
    q, k, v = fused.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    q = q.view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
    k, v = (t.view(B, T, KV_HEADS, HEAD_DIM).transpose(1, 2) for t in (k, v))
    return q.contiguous(), k.contiguous(), v


@pytest.fixture(scope="module")
def compiled():
    before = counters["stats"]["unique_graphs"]
    with flex_mode("compiled"):
        yield before


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_every_pattern_equals_dense_sdpa(compiled, layout_name):
    """Compiled Flex over each pattern's BlockMask == SDPA with the dense mask: output and q/k/v gradients (the
    CPU backward recomputes through the banded path); and the tables skip tiles where the pattern is local."""
    layout = LAYOUTS[layout_name]()
    g = torch.Generator().manual_seed(2)
    for name, p in PATTERNS.items():
        q, k, v = qkv(g)
        bm = block_mask(layout, p)
        out = trunk_module.attend(q, k, v, bm)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense(layout, p), enable_gqa=True)
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        torch.testing.assert_close(out, ref, **TOL, msg=name)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, **TOL, msg=name)
        if name in ("window", "causal_window"):
            assert int((bm.kv_num_blocks + bm.full_kv_num_blocks).max()) <= 3, name
    assert trunk_module._FLEX is not None


def test_packed_trunk_with_schedule_and_capture(compiled):
    """A packed batch through a trunk with per-layer patterns (2-D window + global, every 2nd layer full):
    compiled Flex == the dense masks, forward and parameter gradients; capture's reference attention gives the
    same outputs with probabilities zero outside each layer's mask."""
    batch = packed()
    att = {"pattern": (Window2D(rows=2, cols=2) | Global(first=1)).to_dict(), "full_every": 2}
    torch.manual_seed(0)
    trunk = Trunk(TrunkConfig(d_model=HEADS * HEAD_DIM, n_layers=3, n_heads=HEADS, n_kv_heads=KV_HEADS,
                              positions="rope2d", attention=att))
    x = torch.randn(B, T, HEADS * HEAD_DIM)
    block = batch.attention_mask("block", schedule=trunk.schedule)
    dense_ = batch.attention_mask("dense", schedule=trunk.schedule)
    runs = []
    for mask in (block, dense_):
        trunk.zero_grad()
        out = trunk(x, batch.positions, mask)
        out.square().mean().backward()
        runs.append((out.detach(), [p.grad.clone() for p in trunk.parameters()]))
    torch.testing.assert_close(runs[0][0], runs[1][0], **TOL)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, **TOL)
    with torch.no_grad(), capture(trunk, layers=["trunk.blocks.0.attn"]) as rec:
        recorded = trunk(x, batch.positions, block)  # layer 0 recorded, layers 1-2 through compiled Flex
    torch.testing.assert_close(recorded, runs[0][0], **TOL)
    probs = rec.attention["trunk.blocks.0.attn"]
    assert probs.masked_select(~dense_[0]).abs().max() == 0


def test_one_compile(compiled):
    """Every pattern and layout above ran the same compiled Flex graph: one compile for the module."""
    assert counters["stats"]["unique_graphs"] - compiled <= 1
