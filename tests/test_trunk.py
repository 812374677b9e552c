"""Trunk correctness on CPU, fp32: every attention path against a dense reference, KV-cache decoding
against full recomputation, position schemes, presets and compile-cleanliness."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask

from omni.trunk import PRESETS, Trunk, TrunkConfig, attend, preset

torch.manual_seed(0)


def reference_attention(q, k, v, allowed):
    """Plain softmax attention with a bool mask (B|1, H|1, Tq, Tk); GQA by repeating K/V heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_paths_match_dense_reference(kv_heads):
    B, H, T, D = 2, 4, 256, 16
    q = torch.randn(B, H, T, D)
    k, v = torch.randn(B, kv_heads, T, D), torch.randn(B, kv_heads, T, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    # full
    torch.testing.assert_close(attend(q, k, v, None), reference_attention(q, k, v, None), atol=1e-5, rtol=1e-5)
    # causal via SDPA is_causal
    torch.testing.assert_close(attend(q, k, v, "causal"), reference_attention(q, k, v, causal), atol=1e-5, rtol=1e-5)
    # dense bool mask: a random sliding-window-ish pattern that keeps the diagonal
    qi, ki = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = ((qi - ki).abs() < 37) | (ki % 5 == 0)
    torch.testing.assert_close(attend(q, k, v, allowed), reference_attention(q, k, v, allowed), atol=1e-5, rtol=1e-5)
    # FlexAttention BlockMask with the same pattern (eager flex on CPU)
    bm = create_block_mask(lambda b, h, qq, kk: ((qq - kk).abs() < 37) | (kk % 5 == 0), None, None, T, T, device="cpu")
    torch.testing.assert_close(attend(q, k, v, bm), reference_attention(q, k, v, allowed), atol=1e-5, rtol=1e-5)


def test_unknown_string_mask_rejected():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="unknown mask"):
        attend(q, q, q, "sideways")


CACHE_CONFIGS = [
    dict(positions="rope"),
    dict(positions="rope2d", n_kv_heads=2),
    dict(positions="rope", n_kv_heads=1, activation="swiglu", norm="rmsnorm"),
    dict(positions="learned", cross_attention=True, n_kv_heads=2),
    dict(positions="sinusoidal", cross_attention=True),
    dict(positions="none", cross_attention=True, n_kv_heads=1),
]


@pytest.mark.parametrize("overrides", CACHE_CONFIGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_kv_cache_equals_full_recompute(overrides):
    cfg = TrunkConfig(d_model=64, n_layers=3, n_heads=4, **overrides)
    trunk = Trunk(cfg).eval()
    B, T, S = 2, 23, 11
    x = torch.randn(B, T, cfg.d_model)
    memory = torch.randn(B, S, cfg.d_model) if cfg.cross_attention else None
    memory_mask = torch.ones(B, S, dtype=torch.bool)
    memory_mask[1, 7:] = False  # second row has a shorter encoder output
    mm = memory_mask if cfg.cross_attention else None
    with torch.no_grad():
        full = trunk(x, mask="causal", memory=memory, memory_mask=mm)
        # one token at a time
        cache = trunk.new_cache(B, max_length=32)
        steps = [trunk(x[:, t:t + 1], memory=memory, memory_mask=mm, cache=cache) for t in range(T)]
        # a 9-token prefill, then chunks of 5 and 1 (cross K/V computed once, on the first call only)
        cache2 = trunk.new_cache(B, max_length=32)
        chunks = [trunk(x[:, :9], memory=memory, memory_mask=mm, cache=cache2)]
        chunks.append(trunk(x[:, 9:14], memory_mask=mm, cache=cache2))
        chunks += [trunk(x[:, t:t + 1], memory_mask=mm, cache=cache2) for t in range(14, T)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == T and cache2.length == T


def test_kv_cache_bidirectional_prefix_then_causal():
    """Prefix-LM decoding: a bidirectional prompt prefilled with mask='full', then causal steps,
    equals one full pass with the matching dense mask."""
    cfg = TrunkConfig(d_model=32, n_layers=2, n_heads=4, positions="rope")
    trunk = Trunk(cfg).eval()
    P, T = 6, 10
    x = torch.randn(1, T, 32)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    allowed[:P, :P] = True
    with torch.no_grad():
        full = trunk(x, mask=allowed[None, None])
        cache = trunk.new_cache(1, 16)
        out = [trunk(x[:, :P], mask="full", cache=cache)]
        out += [trunk(x[:, t:t + 1], cache=cache) for t in range(P, T)]
    torch.testing.assert_close(torch.cat(out, 1), full, atol=1e-5, rtol=1e-5)


def test_kv_cache_padding_slots_are_ignored():
    """Left-padded prompts: pad slots never influence real tokens, so a padded row equals the
    same row run without padding."""
    cfg = TrunkConfig(d_model=32, n_layers=2, n_heads=4, positions="rope")
    trunk = Trunk(cfg).eval()
    real = torch.randn(1, 5, 32)
    padded = torch.cat([torch.randn(1, 3, 32), real], 1)
    pad = torch.tensor([[True, True, True, False, False, False, False, False]])
    pos = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        alone = trunk(real, mask="causal")
        cache = trunk.new_cache(1, 16)
        out = trunk(padded, positions=pos, cache=cache, pad=pad)
    torch.testing.assert_close(out[:, 3:], alone, atol=1e-5, rtol=1e-5)


def test_kv_cache_overflow_is_an_error():
    trunk = Trunk(TrunkConfig(d_model=32, n_layers=1, n_heads=2)).eval()
    cache = trunk.new_cache(1, 4)
    with pytest.raises(ValueError, match="overflow"):
        trunk(torch.randn(1, 5, 32), cache=cache)


def _cached_run(trunk, x, memory, mm, chunks, tensor_position, pad=None, positions=None, mask=None):
    """Run x (B, T, d) through a fresh cache in chunks (list of lengths), slots given as a Python int
    (cache.length) or as a device tensor (cache_position); pad and mask apply to the first chunk,
    positions (B, T) (default: the slots) to every chunk."""
    cache = trunk.new_cache(x.shape[0], max_length=32)
    out, t = [], 0
    for i, n in enumerate(chunks):
        kw = dict(pad=pad, mask=mask) if i == 0 else {}
        if positions is not None:
            kw["positions"] = positions[:, t:t + n]
        if tensor_position:
            kw["cache_position"] = torch.tensor(t)
        out.append(trunk(x[:, t:t + n], memory=memory if i == 0 else None, memory_mask=mm, cache=cache, **kw))
        t += n
    return torch.cat(out, 1), cache


@pytest.mark.parametrize("overrides", CACHE_CONFIGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_cache_position_equals_int_path_and_full_recompute(overrides):
    """Slots as a device tensor (the CUDA-graph path) give exactly the Python-int path's numbers, so both
    equal full recomputation; cache.length is left alone."""
    cfg = TrunkConfig(d_model=64, n_layers=3, n_heads=4, **overrides)
    trunk = Trunk(cfg).eval()
    B, T, S = 2, 23, 11
    x = torch.randn(B, T, cfg.d_model)
    memory = torch.randn(B, S, cfg.d_model) if cfg.cross_attention else None
    mm = torch.ones(B, S, dtype=torch.bool) if cfg.cross_attention else None
    if mm is not None:
        mm[1, 7:] = False
    with torch.no_grad():
        full = trunk(x, mask="causal", memory=memory, memory_mask=mm)
        for chunks in ([1] * T, [9, 5] + [1] * 9):  # token by token; a prefill, a chunk, then tokens
            ref, ref_cache = _cached_run(trunk, x, memory, mm, chunks, tensor_position=False)
            got, cache = _cached_run(trunk, x, memory, mm, chunks, tensor_position=True)
            assert torch.equal(got, ref)
            torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
            assert cache.length == 0 and ref_cache.length == T
            for a, b in zip(cache.k + cache.v + [cache.valid], ref_cache.k + ref_cache.v + [ref_cache.valid]):
                assert torch.equal(a, b)
    # mixing: an int-path prefill (advances length) then tensor-position steps (as GraphedGreedyDecoder)
    with torch.no_grad():
        cache = trunk.new_cache(B, max_length=32)
        out = [trunk(x[:, :4], memory=memory, memory_mask=mm, cache=cache)]
        out += [trunk(x[:, t:t + 1], memory_mask=mm, cache=cache, cache_position=torch.tensor([t]))
                for t in range(4, T)]
    torch.testing.assert_close(torch.cat(out, 1), full, atol=1e-5, rtol=1e-5)


def test_cache_position_padded_rows_and_block_masks():
    """valid handling on the tensor path: left-padded rows (per-row positions) equal the int path and
    each row run alone; mask='full' and a bool block among the new tokens (prefix-LM prefill) too."""
    cfg = TrunkConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, positions="rope")
    trunk = Trunk(cfg).eval()
    x = torch.randn(2, 12, 32)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[0, :3] = True  # row 0: 3 left pads then 9 real tokens; row 1: 12 real tokens
    pos = torch.stack([(torch.arange(12) - 3).clamp(min=0), torch.arange(12)])
    P = 8  # prompt (pads included) prefilled at once, then 4 single tokens
    with torch.no_grad():
        for mask in (None, "full", torch.ones(P, P, dtype=torch.bool).tril()[None, None]):
            ref, _ = _cached_run(trunk, x, None, None, [P, 1, 1, 1, 1], False, pad[:, :P], pos, mask)
            got, cache = _cached_run(trunk, x, None, None, [P, 1, 1, 1, 1], True, pad[:, :P], pos, mask)
            assert torch.equal(got, ref)
            assert torch.equal(cache.valid[:, :12], ~pad)
        # causal: each row equals its real tokens run alone (pad slots never seen)
        got, _ = _cached_run(trunk, x, None, None, [P, 1, 1, 1, 1], True, pad[:, :P], pos)
        torch.testing.assert_close(got[0, 3:], trunk(x[:1, 3:], mask="causal")[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], trunk(x[1:], mask="causal")[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs a cache"):
        trunk(x, cache_position=torch.tensor(0))
    with pytest.raises(ValueError, match="one slot index"):
        trunk(x[:, :1], cache=trunk.new_cache(2, 16), cache_position=torch.tensor([0, 1]))


@pytest.mark.parametrize("cross", [False, True])
def test_cache_position_step_compiles_as_one_graph(cross):
    """The CPU proxy for CUDA-graph capture: a one-token step at a tensor position traces as ONE graph
    (fullgraph: no data-dependent Python branch) with static shapes and no value read back to the host
    (dynamo captures .item()/int(t) as an unbacked SymInt rather than breaking, so the graph is checked
    for those: on CUDA each would be a sync, which stream capture refuses), through AOT functionalisation
    (in-place cache writes), with no recompilation as the position changes; results equal eager decoding."""
    from torch._dynamo.backends.registry import lookup_backend

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    cfg = TrunkConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, cross_attention=cross,
                      positions="learned" if cross else "rope", activation="swiglu", norm="rmsnorm")
    trunk = Trunk(cfg).eval()
    B, P, T = 2, 3, 8
    x = torch.randn(B, T, 32)
    memory = torch.randn(B, 5, 32) if cross else None
    mm = torch.tensor([[True] * 5, [True] * 3 + [False] * 2]) if cross else None
    caches = [trunk.new_cache(B, 16) for _ in range(2)]
    with torch.no_grad():
        for c in caches:  # prompt (and cross K/V) eagerly, as a decoder does before capture
            trunk(x[:, :P], memory=memory, memory_mask=mm, cache=c)

        def step(token: Tensor, position: Tensor, cache) -> Tensor:
            return trunk(token, memory_mask=mm, cache=cache, cache_position=position)

        torch._dynamo.reset()
        compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
        position = torch.tensor(P)
        for t in range(P, T):
            position.fill_(t)  # one static position tensor, updated in place (as a graph replays it)
            got = compiled(x[:, t:t + 1], position, caches[0])
            want = step(x[:, t:t + 1], position, caches[1])
            assert torch.equal(got, want), t
    assert len(graphs) == 1
    for node in graphs[0].graph.nodes:  # data-dependent: a symbolic scalar, or a tensor of symbolic shape
        value = node.meta.get("example_value")
        symbolic = isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) or (
            isinstance(value, Tensor) and not all(isinstance(n, int) for n in value.shape))
        assert not symbolic, f"host read-back / data-dependent shape in the step: {node.format_node()}"
    for a, b in zip(caches[0].k + caches[0].v + [caches[0].valid], caches[1].k + caches[1].v + [caches[1].valid]):
        assert torch.equal(a, b)  # the compiled step wrote the cache in place


@pytest.mark.parametrize("positions", ["rope", "rope2d"])
def test_rope_is_relative(positions):
    """RoPE attention depends only on position differences: shifting all positions changes nothing."""
    trunk = Trunk(TrunkConfig(d_model=32, n_layers=2, n_heads=2, positions=positions)).eval()
    with torch.no_grad():  # sharpen attention so positions visibly matter
        for block in trunk.blocks:
            block.attn.qkv.weight.mul_(20)
    x = torch.randn(1, 12, 32)
    pos = torch.stack([torch.arange(12) // 4, torch.arange(12) % 4], -1)[None]
    with torch.no_grad():
        a = trunk(x, positions=pos, mask=None)
        b = trunk(x, positions=pos + 7, mask=None)
        c = trunk(x, positions=pos.flip(1), mask=None)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a, c, atol=1e-3)  # but positions do matter


def test_1d_positions_equal_duplicated_2d():
    trunk = Trunk(TrunkConfig(d_model=32, n_layers=1, n_heads=2, positions="learned")).eval()
    x = torch.randn(2, 7, 32)
    p = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        torch.testing.assert_close(trunk(x, positions=p), trunk(x, positions=torch.stack([p, p], -1)))


def test_presets_and_config_validation():
    for name in PRESETS:
        cfg = preset(name)
        assert cfg.d_model % cfg.n_heads == 0
    assert preset("B").d_model == 768 and preset("whisper-base", cross_attention=True).cross_attention
    b16 = Trunk(preset("B", n_layers=1))
    per_layer = b16.num_params() - 2 * 768  # minus the final LayerNorm
    assert per_layer == 12 * 768 * 768 + 13 * 768  # ViT-B block: 4d^2 attn + 8d^2 mlp, biases, 2 norms
    with pytest.raises(KeyError, match="unknown trunk preset"):
        preset("XXL")
    with pytest.raises(ValueError, match="divisible"):
        TrunkConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        TrunkConfig(d_model=64, n_heads=4, n_kv_heads=3)


def test_swiglu_width_matches_gelu_params():
    g = Trunk(TrunkConfig(d_model=192, n_layers=1, n_heads=3, activation="gelu_tanh")).num_params()
    s = Trunk(TrunkConfig(d_model=192, n_layers=1, n_heads=3, activation="swiglu")).num_params()
    assert abs(s - g) / g < 0.03


def test_trunk_block_compiles_without_graph_breaks():
    """fullgraph=True fails on any graph break: the block must trace as one graph for every
    mask kind, with RoPE, GQA and cross-attention."""
    cfg = TrunkConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, positions="rope2d", cross_attention=True,
                      activation="swiglu", norm="rmsnorm")
    trunk = Trunk(cfg).eval()
    x, mem = torch.randn(2, 16, 32), torch.randn(2, 5, 32)
    pos = torch.randint(0, 8, (2, 16, 2))
    dense = torch.rand(2, 1, 16, 16) > 0.3
    dense |= torch.eye(16, dtype=torch.bool)
    torch._dynamo.reset()
    compiled = torch.compile(trunk, fullgraph=True, backend="eager")
    with torch.no_grad():
        for mask in (None, "causal", dense):
            torch.testing.assert_close(compiled(x, pos, mask, mem), trunk(x, pos, mask, mem))


def test_trunk_inductor_compile_matches_eager():
    cfg = TrunkConfig(d_model=32, n_layers=2, n_heads=4, positions="rope")
    trunk = Trunk(cfg).eval()
    x = torch.randn(2, 16, 32)
    torch._dynamo.reset()
    compiled = torch.compile(trunk, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, None, "causal"), trunk(x, None, "causal"), atol=1e-5, rtol=1e-5)


def test_gradients_flow_to_every_parameter():
    cfg = TrunkConfig(d_model=32, n_layers=2, n_heads=4, cross_attention=True, positions="learned")
    trunk = Trunk(cfg)
    out = trunk(torch.randn(2, 9, 32), mask="causal", memory=torch.randn(2, 4, 32))
    out.square().mean().backward()
    missing = [n for n, p in trunk.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    # learned position rows/cols beyond the used positions get zero (not None) grads
    assert missing == []


def test_flex_mode_is_checked_and_restored():
    from omni import trunk as trunk_module
    from omni.trunk import flex_mode

    with pytest.raises(ValueError, match="unknown flex mode 'fast'"):
        with flex_mode("fast"):  # type: ignore[arg-type]
            pass
    with flex_mode("eager"):
        assert trunk_module._flex_mode == "eager"
        with pytest.raises(RuntimeError):
            with flex_mode("compiled"):
                raise RuntimeError
        assert trunk_module._flex_mode == "eager"
    assert trunk_module._flex_mode == "auto"


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_block_mask_attention_trains_on_cpu(kv_heads):
    """Torch refuses FlexAttention inputs that require grad on the CPU; the trunk's Flex path differentiates the
    dense form of the BlockMask instead: q/k/v gradients equal SDPA's with the dense mask (eager Flex forward)."""
    B, H, T, D = 2, 4, 256, 8
    g = torch.Generator().manual_seed(3)
    q0, k0, v0 = torch.randn(B, H, T, D, generator=g), torch.randn(B, kv_heads, T, D, generator=g), \
        torch.randn(B, kv_heads, T, D, generator=g)
    qi, ki = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = ((qi - ki).abs() < 37) & (ki <= qi + 5)
    bm = create_block_mask(lambda b, h, qq, kk: ((qq - kk).abs() < 37) & (kk <= qq + 5), None, None, T, T,
                           device="cpu")
    grads = []
    for mask in (bm, allowed):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = attend(q, k, v, mask)
        (out * torch.linspace(-1, 1, D)).sum().backward()
        grads.append((out.detach(), q.grad, k.grad, v.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
