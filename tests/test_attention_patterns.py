"""Structured sparse attention (omni.attention_patterns): every pattern against a brute-force reference written
pair by pair, the block tables exact, the eager banded path equal to SDPA with the dense mask (forward and
backward, packed and unpacked, GQA), the trunk and introspection's capture with a schedule, the ring-buffer KV
cache against full recompute, and the one-line errors. The compiled-Flex half: tests/test_attention_patterns_flex.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni.attention_patterns import (Any_, Dilated, Full, Global, LayerMasks, Layout, RingKVCache, Window, Window2D,
                                     block_mask, dense, normalise_config, pattern_from_dict, schedule_from_config)
from omni.banded_attention import banded_attention
from omni.introspect import capture
from omni.packing import Packer
from omni.segment import Role, Sample, Segment
from omni.trunk import Trunk, TrunkConfig, block_mask_to_dense

TOL = dict(atol=1e-5, rtol=1e-5)

PATTERNS = {
    "full": Full(),
    "window": Window(before=9, after=4),
    "causal_window": Window(before=12, after=0),
    "window2d": Window2D(rows=1, cols=2),
    "dilated": Dilated(dilation=3, before=20, after=20),
    "strided": Dilated(dilation=5),
    "window+global": Window(before=5, after=5) | Global(first=2),
    "all": Any_((Window2D(rows=1, cols=1), Dilated(dilation=4, before=16, after=0), Window(before=2, after=2),
                 Global(first=1))),
}


def segment(kind: str, n: int, grid_w: int = 5) -> Segment:
    if kind == "grid":  # an image-like span on a grid_w-wide patch grid, bidirectional
        pos = torch.stack([torch.arange(n) // grid_w, torch.arange(n) % grid_w], -1)
        return Segment("vec", torch.randn(n, 3), pos, Role.BIDIRECTIONAL)
    return Segment("ids", torch.randint(0, 9, (n,)), torch.arange(n), Role.CAUSAL)


def packed_layout() -> Layout:
    """Two rows of 80 tokens: documents of image-like and text-like segments (prefix-LM pairs), padding."""
    torch.manual_seed(0)
    samples = [Sample([segment("grid", 23), segment("text", 14)], key="a"), Sample([segment("text", 31)], key="b"),
               Sample([segment("grid", 40)], key="c"), Sample([segment("text", 9), segment("grid", 15),
                                                                segment("text", 12)], key="d")]
    batch = Packer(row_length=80, block_size=16)(samples)
    assert batch.shape == (2, 80)
    return batch.layout()


def unpacked_layout(causal: bool) -> Layout:
    T = 75
    pos = torch.stack([torch.arange(T) // 8, torch.arange(T) % 8], -1).expand(2, T, 2)
    return Layout.single(pos, causal)


LAYOUTS = {"packed": packed_layout, "unpacked": lambda: unpacked_layout(False),
           "unpacked_causal": lambda: unpacked_layout(True)}


def brute_force(layout: Layout, p) -> torch.Tensor:
    """The rule pair by pair in Python, from the definitions (module docstring of omni.attention_patterns)."""
    doc, seg, causal = layout.document.tolist(), layout.segment.tolist(), layout.causal.tolist()
    pos = layout.positions.tolist()
    B, T = layout.document.shape
    starts = [[next(j for j in range(i, -1, -1) if j == 0 or seg[b][j - 1] != seg[b][i] or doc[b][j - 1] != doc[b][i])
               for i in range(T)] for b in range(B)]

    def pattern(part, b, q, k) -> bool:
        if isinstance(part, Any_):
            return any(pattern(x, b, q, k) for x in part.parts)
        if isinstance(part, Full):
            return True
        if isinstance(part, Window):
            return (part.before is None or q - k <= part.before) and (part.after is None or k - q <= part.after)
        if isinstance(part, Dilated):
            return ((part.before is None or q - k <= part.before) and (part.after is None or k - q <= part.after)
                    and (q - k) % part.dilation == 0)
        if isinstance(part, Window2D):
            return (seg[b][q] == seg[b][k] and abs(pos[b][q][0] - pos[b][k][0]) <= part.rows
                    and abs(pos[b][q][1] - pos[b][k][1]) <= part.cols)
        if isinstance(part, Global):
            return q - starts[b][q] < part.first or k - starts[b][k] < part.first
        raise AssertionError(part)

    out = torch.zeros(B, 1, T, T, dtype=torch.bool)
    for b in range(B):
        for q in range(T):
            for k in range(T):
                packing = doc[b][q] == doc[b][k] and (seg[b][k] < seg[b][q] or (
                    seg[b][k] == seg[b][q] and (not causal[b][q] or k <= q)))
                out[b, 0, q, k] = packing and pattern(p, b, q, k)
    return out


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_rule_and_block_tables_equal_brute_force(layout_name):
    """For every pattern: the mask_mod materialised == the pair-by-pair reference; the BlockMask (16-token tiles:
    full, partial and skipped tiles all occur; any length) applies exactly that mask; and local patterns skip
    tiles (cost follows the pattern)."""
    layout = LAYOUTS[layout_name]()
    full_tiles = None
    for name, p in PATTERNS.items():
        ref = brute_force(layout, p)
        assert torch.equal(dense(layout, p), ref), name
        bm = block_mask(layout, p, bs=16)
        assert torch.equal(block_mask_to_dense(bm), ref.expand(-1, 1, -1, -1)), name
        listed = int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())
        if name == "full":
            full_tiles = listed
        elif name in ("window", "causal_window", "window2d"):
            assert listed < full_tiles, name
        assert ref.any(-1)[:, 0].all(), name  # every query (pads included) sees at least itself


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("name", list(PATTERNS))
def test_banded_attention_equals_dense_sdpa(layout_name, name):
    """The eager linear-memory path == SDPA with the dense mask, fp32 1e-5: output and q/k/v gradients (GQA)."""
    layout, p = LAYOUTS[layout_name](), PATTERNS[name]
    B, T = layout.document.shape
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, h, T, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    bm = block_mask(layout, p, bs=16)
    out = banded_attention(q, k, v, bm, budget=3000)  # a small budget: several chunks of query blocks
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense(layout, p), enable_gqa=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, **TOL)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL)


def test_banded_memory_follows_the_window():
    """The banded path reads, per query block, only the key blocks listed for it: with a window the number is
    the same at 1k and 16k tokens (memory linear in T), with full attention it grows with T."""
    widths = {}
    for T in (1024, 16384):
        pos = torch.arange(T).expand(1, T)
        layout = Layout.single(torch.stack([pos, pos], -1), causal=True)
        for name, p in (("window", Window(before=256, after=0)), ("full", None)):
            bm = block_mask(layout, p)
            widths[name, T] = int((bm.kv_num_blocks + bm.full_kv_num_blocks).max())
    assert widths["window", 1024] == widths["window", 16384] == 3
    assert widths["full", 16384] == 128 and widths["full", 1024] == 8


def test_round_trip_and_old_configs():
    """Patterns and schedules go to plain dicts and back; TrunkConfig keeps them as dicts (config.json) and an
    old config without the field loads as full attention."""
    for p in PATTERNS.values():
        assert pattern_from_dict(p.to_dict()) == p
    cfg = TrunkConfig(d_model=32, n_layers=4, n_heads=4, attention=PATTERNS["window+global"].to_dict())
    assert cfg.attention == {"pattern": PATTERNS["window+global"].to_dict(), "full_every": 0}
    again = TrunkConfig(**cfg.to_dict())
    assert again == cfg
    assert Trunk(again).schedule.layers == (PATTERNS["window+global"],) * 4
    old = {k: v for k, v in cfg.to_dict().items() if k != "attention"}
    assert TrunkConfig(**old).attention is None and not Trunk(TrunkConfig(**old)).schedule.sparse
    every = schedule_from_config({"pattern": {"kind": "window", "before": 3, "after": 3}, "full_every": 2}, 4)
    assert every.layers == (Window(3, 3), None, Window(3, 3), None)
    with pytest.raises(ValueError, match="layer 1's pattern .* leaves a token that is not global with no key"):
        normalise_config({"layers": [None, {"kind": "global", "first": 1}, {"kind": "full"}]}, 3)
    ok = normalise_config({"layers": [None, Window(2, 0), {"kind": "full"}]}, 3)
    assert ok == {"layers": [None, Window(2, 0).to_dict(), {"kind": "full"}]}
    assert schedule_from_config(ok, 3).layers == (None, Window(2, 0), None)


@pytest.mark.parametrize("spec, message", [
    ({"kind": "window", "before": 0, "after": 0}, "a window of 0"),
    ({"kind": "window", "before": -3, "after": 2}, "window before must be an integer >= 0"),
    ({"kind": "window", "before": 2.5, "after": 2}, "window before must be an integer >= 0"),
    ({"kind": "window2d", "rows": True, "cols": 2}, "window2d rows must be an integer"),
    ({"kind": "dilated", "dilation": 1}, "dilated dilation must be an integer >= 2"),
    ({"kind": "dilated", "dilation": 4, "before": 3, "after": 0}, "a dilated reach of before=3, after=0 under its "
                                                                  "dilation 4 lets a token see only itself"),
    ({"kind": "global", "first": 0}, "global first must be an integer >= 1"),
    ({"kind": "global", "first": 2}, "leaves a token that is not global with no key"),
    ({"kind": "ring"}, "unknown kind 'ring'"),
    ({"kind": "window", "size": 4}, "unknown entries \\['size'\\]"),
    ({"kind": "any", "of": [{"kind": "window", "before": 1}, {"kind": "window", "before": 2}]}, "2 'window' parts"),
    ({"pattern": {"kind": "window", "before": 1}, "full_every": -1}, "full_every must be an integer >= 0"),
    ({"layers": [None]}, "expected a list of 2 patterns"),
    ("window", "expected a dict"),
])
def test_bad_patterns_are_one_line_errors(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        TrunkConfig(d_model=32, n_layers=2, n_heads=4, attention=spec)
    assert "\n" not in str(info.value)


def dense_masks(trunk: Trunk, layout: Layout) -> LayerMasks:
    return LayerMasks(dense(layout, p) for p in trunk.schedule.layers)


@pytest.mark.parametrize("mask", [None, "causal"])
def test_trunk_unpacked_equals_dense_masks(mask):
    """A trunk with a schedule (window + global, every 2nd layer full; 2-D RoPE, GQA), called unpacked with
    None / "causal": the BlockMask + banded path == the same trunk over dense per-layer masks (SDPA), forward and
    every parameter's gradient."""
    torch.manual_seed(0)
    att = {"pattern": PATTERNS["all"].to_dict(), "full_every": 2}
    trunk = Trunk(TrunkConfig(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, positions="rope2d", attention=att))
    T = 150  # two 128-token blocks, the second partial
    pos = torch.stack([torch.arange(T) // 10, torch.arange(T) % 10], -1).expand(2, T, 2)
    x = torch.randn(2, T, 32)
    runs = []
    for m in (mask, dense_masks(trunk, Layout.single(pos, mask == "causal"))):
        trunk.zero_grad()
        out = trunk(x, pos, m)
        out.square().mean().backward()
        runs.append((out.detach(), [p.grad.clone() for p in trunk.parameters()]))
    torch.testing.assert_close(runs[0][0], runs[1][0], **TOL)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, **TOL)
    # the pattern matters: the same weights with full attention give other numbers
    plain = Trunk(TrunkConfig(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, positions="rope2d"))
    plain.load_state_dict(trunk.state_dict())
    assert (plain(x, pos, mask) - runs[0][0]).abs().max() > 1e-3


def test_packed_trunk_and_capture():
    """Packed: PackedBatch.attention_mask(schedule=...) block (banded) == dense, and capture records each layer's
    probabilities, zero outside that layer's mask, with the same outputs."""
    torch.manual_seed(0)
    samples = [Sample([segment("grid", 70), segment("text", 30)], key="a"), Sample([segment("text", 90)], key="b"),
               Sample([segment("grid", 45), segment("text", 20)], key="c")]
    batch = Packer(row_length=256)(samples)
    att = {"layers": [PATTERNS["window2d"].to_dict(), PATTERNS["window+global"].to_dict(), None]}
    trunk = Trunk(TrunkConfig(d_model=32, n_layers=3, n_heads=4, positions="rope2d", attention=att)).eval()
    x = torch.randn(*batch.shape, 32)
    block = batch.attention_mask("block", schedule=trunk.schedule)
    dense_ = batch.attention_mask("dense", schedule=trunk.schedule)
    assert isinstance(block, LayerMasks) and len(block) == 3
    assert torch.equal(dense_[2], batch.attention_mask("dense")[:, :, :, :])  # the full layer: the packing rule
    with torch.no_grad():
        fast, ref = trunk(x, batch.positions, block), trunk(x, batch.positions, dense_)
        with capture(trunk) as rec:
            recorded = trunk(x, batch.positions, block)
    torch.testing.assert_close(fast, ref, **TOL)
    torch.testing.assert_close(recorded, fast, **TOL)
    for i in range(3):
        probs = rec.attention[f"trunk.blocks.{i}.attn"]
        assert probs.masked_select(~dense_[i]).abs().max() == 0
        torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)), **TOL)
    assert not torch.equal(dense_[0], dense_[2])
    with pytest.raises(ValueError, match="PackedBatch.attention_mask\\(schedule=trunk.schedule\\)"):
        trunk(x, batch.positions, batch.attention_mask("block"))


@pytest.mark.parametrize("prefix_mask", ["causal", "full"])
def test_ring_cache_equals_full_recompute(prefix_mask):
    """Decoding with windowed layers (window + 2 sink tokens; dilated; one full layer): a 6-token prompt then
    34 single-token steps == one full forward with the same masks; the windowed layers' buffers never grow."""
    torch.manual_seed(0)
    att = {"layers": [(Window(before=5, after=0) | Global(first=2)).to_dict(),
                      Dilated(dilation=2, before=8, after=0).to_dict(), None]}
    trunk = Trunk(TrunkConfig(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, attention=att)).eval()
    T, P = 40, 6
    x = torch.randn(2, T, 32)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if prefix_mask == "full":  # a bidirectional prompt (prefix-LM), else a causal one
        causal[:P, :P] = True
    pos = torch.arange(T).expand(2, T)
    layout = Layout.single(torch.stack([pos, pos], -1), causal=False)
    with torch.no_grad():
        full = trunk(x, mask=LayerMasks(causal & (dense(layout, p) if p else True) for p in trunk.schedule.layers))
        cache = trunk.new_cache(2, 64)
        assert isinstance(cache, RingKVCache)
        steps = [trunk(x[:, :P], cache=cache, mask=prefix_mask)]
        sizes = [tuple(k.shape[2] for k in cache.k)]
        for i in range(P, T):
            steps.append(trunk(x[:, i:i + 1], cache=cache))
            sizes.append(tuple(k.shape[2] for k in cache.k))
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)
    assert set(sizes) == {(2 + 5, 8, 64)}  # ring of 5 + 2 sinks; ring of 8; the full layer keeps max_length
    assert cache.length == T and cache.real_tokens().tolist() == [T, T]


def test_ring_cache_memory_is_fixed_and_errors():
    """All layers windowed: the cache holds window-many keys whatever max_length says; a 2-D window cannot
    decode; a plain KVCache with a windowed trunk is refused."""
    att = {"pattern": Window(before=16, after=0).to_dict()}
    trunk = Trunk(TrunkConfig(d_model=32, n_layers=2, n_heads=4, attention=att)).eval()
    small, huge = trunk.new_cache(1, 100), trunk.new_cache(1, 1_000_000)
    assert small.nbytes() == huge.nbytes() == 2 * 2 * 16 * 32 * 4
    with torch.no_grad():
        for _ in range(50):
            trunk(torch.randn(1, 3, 32), cache=huge)
    assert huge.nbytes() == small.nbytes() and huge.length == 150
    grid = Trunk(TrunkConfig(d_model=32, n_layers=2, n_heads=4, attention={"pattern": Window2D(1, 1).to_dict()}))
    with pytest.raises(ValueError, match="window2d layer cannot decode"):
        grid.new_cache(1, 10)
    from omni.trunk import KVCache
    with pytest.raises(ValueError, match="decodes with the cache Trunk.new_cache makes"):
        trunk(torch.randn(1, 3, 32), cache=KVCache.empty(trunk.cfg, 1, 10))


def test_recipes_take_the_pattern_through_trunk_overrides():
    """`--set trunk_overrides.attention={...}` is a checked entry (omni.config types it from TrunkConfig): a good
    schedule makes the trunk, a bad one is one line naming trunk_overrides and the setting."""
    from omni.config import RULES, check_trunk, trunk_keys

    assert trunk_keys()["attention"].type == (dict, None)
    att = {"pattern": {"kind": "window", "before": 32, "after": 32}, "full_every": 2}
    trunk = check_trunk({"trunk": "tiny", "trunk_overrides": {"attention": att}}, RULES)
    assert trunk.attention == att
    with pytest.raises(ValueError, match="trunk_overrides .*a window of 0") as info:
        check_trunk({"trunk": "tiny", "trunk_overrides": {"attention": {"kind": "window", "before": 0}}}, RULES)
    assert "\n" not in str(info.value)


def test_windowed_speech_decoder_decodes_with_the_ring_cache():
    """A speech recognizer whose encoder and decoder are windowed greedy-decodes through the ring cache (the decoding
    loop pins its cross K/V) token for token as the uncached recompute with the same masks; twice in a row (the
    pinned cross K/V of the first batch are overwritten by the second's)."""
    from omni.decoding import greedy_decode
    from omni.speech import SpeechRecognizer
    from omni.tokenizers.audio import AudioTokenizer
    from omni.tokenizers.text import TextTokenizer
    from omni.trunk import preset

    audio, text = AudioTokenizer(), TextTokenizer()
    window = {"pattern": {"kind": "window", "before": 3, "after": 3}, "full_every": 0}
    torch.manual_seed(0)
    model = SpeechRecognizer(audio, text, preset("tiny", attention=window),
                             preset("tiny", cross_attention=True, attention=window)).eval()
    with torch.no_grad():
        for p in model.decoder.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # varied tokens, not one repeated
    g = torch.Generator().manual_seed(3)
    for batch in range(2):
        x = torch.randn(2, 30, audio.n_mels * audio.kernel, generator=g)
        mask = torch.ones(2, 30, dtype=torch.bool)
        mask[1, 21:] = False
        with torch.no_grad():
            memory = model.encode(x, mask)
            cached = greedy_decode(model, memory, mask, max_new_tokens=12, max_repeats=None, min_new_tokens=12)
            full = greedy_decode(model, memory, mask, max_new_tokens=12, max_repeats=None, min_new_tokens=12,
                                 use_cache=False)
            stepped = greedy_decode(model, memory, mask, max_new_tokens=12, max_repeats=None, min_new_tokens=12,
                                    graph=True)  # the fixed-shape step (eager on the CPU)
        assert isinstance(model.decoder.new_cache(2, 8), RingKVCache)
        assert cached == full == stepped and all(len(row) == 12 for row in cached)
        assert len({t for row in cached for t in row}) > 3
