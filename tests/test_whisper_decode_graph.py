"""Fixed-shape greedy decoding (omni.decoding.GraphedGreedyDecoder): token for token the same as
greedy_decode, on CPU with the step run eagerly (random and briefly trained tiny models; rows ending by
eos, by the repetition guard and by the per-row token limits at different lengths; batch 1 and 3;
reuse across batches; min_new_tokens), the vectorised repetition guard against the reference one, and
on CUDA only (skipped here): the step captured in a CUDA graph (and compiled) against eager decoding."""

from __future__ import annotations

import copy

import pytest
import torch

from omni.decoding import RepetitionGuard
from omni.speech import GraphedGreedyDecoder, SpeechCollate, greedy_decode, pad_audio, speech_example, speech_loss
from _speech_models import one_token_model, tiny_model
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import TextTokenizer

SR = 16000
SENTENCES = ["The cat sat down.", "A red ball rolls away from the old grey wall.", "Hi.", "Where is my hat?"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def toks() -> tuple[AudioTokenizer, TextTokenizer]:
    return AudioTokenizer(), TextTokenizer()


@pytest.fixture(scope="module")
def random_setup(toks):
    """Untrained model with enlarged weights (varied tokens, not one repeated), 3 clips of different
    lengths (the key mask and the per-clip token limits matter)."""
    audio, text = toks
    model = tiny_model(audio, text, seed=1).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    waves = [torch.randn(int(SR * s), generator=g) * 0.1 for s in (0.7, 1.5, 1.1)]
    batch, mask = pad_audio([audio.encode(w).tokens for w in waves])
    with torch.no_grad():
        memory = model.encode(batch, mask)
    return model, memory, mask


@pytest.fixture(scope="module")
def trained_setup(toks):
    """A tiny model trained for a few seconds to map 4 tones (easy to tell apart) to 4 sentences of
    different lengths, so greedy decoding ends rows with eos at different steps."""
    audio, text = toks
    g = torch.Generator().manual_seed(3)
    waves = []
    for hz, seconds in zip((300.0, 700.0, 1500.0, 3000.0), (0.6, 1.3, 0.9, 1.0)):
        x = torch.arange(int(SR * seconds)) / SR
        waves.append(0.3 * torch.sin(2 * torch.pi * hz * x) + 0.01 * torch.randn(x.shape, generator=g))
    batch = SpeechCollate(text.pad_id)([speech_example(audio, text, w, s, key=str(i))
                                        for i, (w, s) in enumerate(zip(waves, SENTENCES))])
    model = tiny_model(audio, text, seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.0)
    for _ in range(300):
        loss, _ = speech_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:
            break
    model.eval()
    with torch.no_grad():
        memory = model.encode(batch.audio, batch.audio_mask)
    return model, memory, batch.audio_mask, text


def both(model, memory, mask, **kw) -> list[list[int]]:
    """greedy_decode's tokens, after checking the static step (one-off and reusable decoder) gives them too."""
    ref = greedy_decode(model, memory, mask, **kw)
    assert greedy_decode(model, memory, mask, graph=True, **kw) == ref
    dec = GraphedGreedyDecoder(model, graph=False, **kw)  # cache sized by max_new_tokens (maybe longer)
    assert dec(memory, mask) == ref
    assert dec(memory, mask) == ref  # reused: state reset per batch
    return ref


# ----------------------------------------------------------------------------------------------------


def _repeated_tail(out: torch.Tensor, t: int, max_period: int, max_repeats: int) -> torch.Tensor:
    """Reference repetition guard, one period at a time: (B,) length to keep for rows whose tokens out[:, :t+1]
    end in ``max_repeats`` copies of one block of p <= max_period tokens (first copy kept), else -1."""
    keep = torch.full((out.shape[0],), -1, dtype=torch.long, device=out.device)
    for p in range(max_period, 0, -1):  # shorter periods win (assigned last): "a a a a" keeps one "a"
        w = p * max_repeats
        if t + 1 < w:
            continue
        tail = out[:, t + 1 - w:t + 1]
        hit = (tail[:, p:] == tail[:, :-p]).all(1)
        keep = torch.where(hit, torch.full_like(keep, t + 1 - (max_repeats - 1) * p), keep)
    return keep


def test_vectorised_repetition_guard_matches_reference():
    g = torch.Generator().manual_seed(0)
    for max_period, max_repeats in [(8, 4), (4, 3), (3, 2), (1, 4), (5, 1)]:
        guard = RepetitionGuard(max_period, max_repeats, 0, torch.device("cpu"))
        for alphabet in (2, 3, 5):
            out = torch.randint(0, alphabet, (16, 40), generator=g)
            out[0, 5:] = 7  # one row that surely repeats
            out[1, 10:] = torch.tensor([4, 5, 6] * 10)
            for t in range(out.shape[1]):
                want = _repeated_tail(out, t, max_period, max_repeats)
                got = guard.keep(out, torch.tensor(t))
                assert torch.equal(got, want), (max_period, max_repeats, alphabet, t)


def test_random_model_same_tokens(random_setup):
    model, memory, mask = random_setup
    # token limit cut-off: every row runs to max_new_tokens
    rows = both(model, memory, mask, max_new_tokens=24, tokens_per_second=None, max_repeats=None)
    assert [len(r) for r in rows] == [24, 24, 24]
    assert len({t for r in rows for t in r}) >= 5  # varied tokens: the comparison means something
    # per-clip limits (tokens_per_second) and the repetition guard: rows end at different lengths
    rows = both(model, memory, mask, max_new_tokens=40, tokens_per_second=12.0, max_repeats=3, max_period=4)
    assert len({len(r) for r in rows}) == 3
    rows = both(model, memory, mask, max_new_tokens=30, tokens_per_second=25.0)  # the default guards
    # fewer host checks: same tokens
    for every in (1, 3, 100):
        assert GraphedGreedyDecoder(model, max_new_tokens=30, check_every=every)(memory, mask) == rows


def test_plain_random_init(toks):
    """The model as initialised (small weights: near-uniform logits, long runs of one token)."""
    audio, text = toks
    model = tiny_model(audio, text, seed=7).eval()
    g = torch.Generator().manual_seed(7)
    batch, mask = pad_audio([audio.encode(torch.randn(int(SR * s), generator=g) * 0.1).tokens for s in (0.4, 0.9)])
    with torch.no_grad():
        memory = model.encode(batch, mask)
    both(model, memory, mask, max_new_tokens=20)
    rows = both(model, memory, mask, max_new_tokens=20, tokens_per_second=None, max_repeats=None)
    assert [len(r) for r in rows] == [20, 20]


def test_batch_of_one_and_no_mask(random_setup):
    model, memory, mask = random_setup
    for kw in (dict(max_new_tokens=20, tokens_per_second=None, max_repeats=None),
               dict(max_new_tokens=40, tokens_per_second=12.0, max_repeats=3, max_period=4)):
        one = both(model, memory[1:2], mask[1:2], **kw)
        assert len(one) == 1 and len(one[0]) >= 1
        both(model, memory[1:2], None, **kw)
        both(model, memory, None, **kw)


def test_max_new_tokens_one(random_setup):
    model, memory, mask = random_setup
    rows = both(model, memory, mask, max_new_tokens=1, tokens_per_second=None)
    assert [len(r) for r in rows] == [1, 1, 1]


def test_trained_model_rows_end_with_eos(trained_setup):
    model, memory, mask, text = trained_setup
    rows = both(model, memory, mask, max_new_tokens=40)
    assert [text.decode(r) for r in rows] == SENTENCES  # each row stopped by its own eos
    assert len({len(r) for r in rows}) == 4
    # limits below some transcripts' lengths: those rows are cut, the others still end by eos
    cut = both(model, memory, mask, max_new_tokens=6)
    assert [len(r) for r in cut] == [min(len(r), 6) for r in rows]
    # batch of one, each clip alone
    for i in range(4):
        assert both(model, memory[i:i + 1], mask[i:i + 1], max_new_tokens=40) == [rows[i]]


def test_min_new_tokens(trained_setup):
    model, memory, mask, _ = trained_setup
    free = greedy_decode(model, memory, mask, max_new_tokens=40)
    n = max(len(r) for r in free) + 3
    rows = both(model, memory, mask, max_new_tokens=40, min_new_tokens=n)
    assert all(len(r) >= n for r in rows)
    assert all(model.eos_id not in r[:n] for r in rows)
    assert [r[:len(f)] for r, f in zip(rows, free)] == free  # eos suppressed: the prefix is unchanged
    fixed = both(model, memory, mask, max_new_tokens=12, min_new_tokens=12)
    assert [len(r) for r in fixed] == [12] * 4  # a fixed token count (what the benchmark uses)


def test_repetition_guard_model(toks):
    """A model forced to emit one token forever: the guard keeps one copy, on the static path too."""
    audio, text = toks
    model = one_token_model(audio, text, 500)
    with torch.no_grad():
        mem = model.encode(audio.encode(torch.zeros(SR)).tokens[None])
    assert both(model, mem, None, max_new_tokens=50, max_repeats=4) == [[500]]
    assert both(model, mem, None, max_new_tokens=50, max_repeats=None) == [[500] * 50]
    # min_new_tokens holds the guard off until then; it then keeps the first copy of the repeated block
    assert both(model, mem, None, max_new_tokens=50, max_repeats=4, min_new_tokens=10) == [[500] * 10]


def test_other_trunk_configs(toks):
    """Learned absolute positions, GQA, RMSNorm + SwiGLU: the step takes Trunk.forward's tensor-position
    path (cache_position: positions and mask from a device tensor), so check it beyond the default RoPE trunk."""
    audio, text = toks
    g = torch.Generator().manual_seed(5)
    waves = [torch.randn(int(SR * s), generator=g) * 0.1 for s in (0.5, 0.8)]
    batch, mask = pad_audio([audio.encode(w).tokens for w in waves])
    for trunk in (dict(positions="learned", max_positions=64), dict(n_kv_heads=2),
                  dict(norm="rmsnorm", mlp="swiglu", positions="sinusoidal")):
        model = tiny_model(audio, text, seed=4, **trunk).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
            memory = model.encode(batch, mask)
        rows = both(model, memory, mask, max_new_tokens=16, tokens_per_second=None, max_repeats=None)
        assert len({t for r in rows for t in r}) >= 3, trunk


def test_autocast(random_setup):
    """Under bf16 autocast the encoder output (and so the cache) is fp32 while k/v are bf16: the static
    step's index_put_ into the cache casts as the prompt's slice assignment does."""
    model, memory, mask = random_setup
    with torch.autocast("cpu", dtype=torch.bfloat16):
        both(model, memory, mask, max_new_tokens=16, tokens_per_second=None, max_repeats=None)
        both(model, memory.to(torch.bfloat16), mask, max_new_tokens=16, tokens_per_second=None, max_repeats=None)


def test_decoder_checks_shapes(random_setup):
    model, memory, mask = random_setup
    dec = GraphedGreedyDecoder(model, max_new_tokens=8)
    dec(memory, mask)
    with pytest.raises(ValueError, match="one decoder per batch shape"):
        dec(memory[:2], mask[:2])
    with pytest.raises(ValueError, match="one decoder per batch shape"):
        dec(memory, None)
    with pytest.raises(ValueError, match="needs CUDA"):
        GraphedGreedyDecoder(model, graph=True)(memory, mask)
    with pytest.raises(ValueError, match="use_cache=False"):
        greedy_decode(model, memory, mask, graph=True, use_cache=False)


# ----------------------------------------------------------------------------------------------------
# CUDA: the captured graph replays the eager step's kernels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_equals_eager(random_setup, trained_setup):
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 below
    try:
        for model, memory, mask, kws in [
            (*random_setup, [dict(max_new_tokens=24, tokens_per_second=None, max_repeats=None),
                             dict(max_new_tokens=40, tokens_per_second=12.0, max_repeats=3, max_period=4)]),
            (*trained_setup[:3], [dict(max_new_tokens=40), dict(max_new_tokens=40, min_new_tokens=20)]),
        ]:
            model = copy.deepcopy(model).cuda()  # the fixtures stay on the CPU for the other tests
            memory, mask = memory.cuda(), mask.cuda()
            perm = torch.arange(memory.shape[0] - 1, -1, -1, device="cuda")  # another batch of the same shape
            for kw in kws:
                ref = greedy_decode(model, memory, mask, **kw)
                assert greedy_decode(model, memory, mask, graph=True, **kw) == ref
                dec = GraphedGreedyDecoder(model, **kw)  # graph on: memory is on CUDA
                assert dec(memory, mask) == ref
                assert dec._graph is not None
                # the same graph replayed for another batch, then for the first again
                assert dec(memory[perm], mask[perm]) == greedy_decode(model, memory[perm], mask[perm], **kw)
                assert dec(memory, mask) == ref
            # compiled + graphed: in fp32 compiled rounding is far below these models' logit gaps
            kw = kws[0]
            ref = greedy_decode(model, memory, mask, **kw)
            dec = GraphedGreedyDecoder(model, compile=True, **kw)
            assert dec(memory, mask) == ref
            assert dec(memory[perm], mask[perm]) == greedy_decode(model, memory[perm], mask[perm], **kw)
            # fp32 weights under bf16 autocast (captured with autocast's cast cache off)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                assert GraphedGreedyDecoder(model, **kw)(memory, mask) == greedy_decode(model, memory, mask, **kw)
            # bf16 weights, the serving dtype: the graph replays the eager kernels, so exactly equal
            half, mem16 = model.to(torch.bfloat16), memory.to(torch.bfloat16)
            assert GraphedGreedyDecoder(half, **kw)(mem16, mask) == greedy_decode(half, mem16, mask, **kw)
            assert greedy_decode(half, mem16, mask, graph=True, **kw) == greedy_decode(half, mem16, mask, **kw)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
