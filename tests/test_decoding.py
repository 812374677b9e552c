"""omni.decoding beyond the speech recognizer (tests/test_whisper*.py cover that): the multitask prefix-LM
transcriber through the same loop (cached == uncached == the fixed-shape step == beam width 1), the KV cache's
in-place methods (reorder, pin_cross), the interfaces and the option checks."""

from __future__ import annotations

import pytest
import torch

from omni.decoding import GraphedGreedyDecoder, beam_search, greedy_decode
from omni.interfaces import Seq2SeqDecoder
from omni.multitask import MultitaskModel, PrefixLMTranscriber, TranscribeTask
from omni.segment import Segment
from omni.speech import pad_audio
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import TextTokenizer
from omni.trunk import Trunk, preset

from _speech_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def prefix_lm():
    """A random-weight multitask prefix-LM (weights enlarged: varied tokens) and a padded batch of 3 clips of
    different lengths: (transcriber, audio tokens (3, S, F), mask (3, S))."""
    audio, text = AudioTokenizer(), TextTokenizer()
    g = torch.Generator().manual_seed(0)
    clips = [Segment("audio", torch.randn(n, audio.n_mels * audio.kernel, generator=g), torch.arange(n), audio.role)
             for n in (30, 47, 38)]
    task = TranscribeTask("asr", audio, text, clips, ["a", "b", "c"])
    torch.manual_seed(0)
    model = MultitaskModel([task], preset("tiny", positions="rope2d")).eval()
    with torch.no_grad():
        for p in model.omni.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    frames, mask = pad_audio([c.tokens for c in clips])
    return PrefixLMTranscriber.for_task(model.omni, task), frames, mask


def test_prefix_lm_decodes_through_every_path(prefix_lm):
    """The prefix-LM's cache holds the audio prefix before the text: the fixed-shape step (cache slots and text
    positions from device tensors) and the beam search's reordered cache give the greedy tokens."""
    dec, frames, mask = prefix_lm
    memory = dec.encode(frames, mask)
    for kw in (dict(max_new_tokens=12, tokens_per_second=None, max_repeats=None),
               dict(max_new_tokens=30, tokens_per_second=20.0, max_repeats=2, max_period=3)):
        with torch.no_grad():
            ref = greedy_decode(dec, memory, mask, **kw)
            assert greedy_decode(dec, memory, mask, use_cache=False, **kw) == ref
            assert greedy_decode(dec, memory, mask, graph=True, **kw) == ref
            static = GraphedGreedyDecoder(dec, graph=False, **kw)
            assert static(memory, mask) == ref
            assert static(memory, mask) == ref  # reused: cache and state refilled in place
            assert beam_search(dec, memory, mask, beam_size=1, **kw) == ref
        assert len({t for row in ref for t in row}) >= 3, ref  # varied tokens: the comparisons mean something
    assert [len(row) for row in ref] != [30] * 3  # the per-clip limits / the guard ended rows


def test_interfaces(prefix_lm):
    assert isinstance(prefix_lm[0], Seq2SeqDecoder)
    assert isinstance(tiny_model(AudioTokenizer(), TextTokenizer()), Seq2SeqDecoder)  # no adapter: decoded as it is


def test_kv_cache_changes_in_place():
    """reorder permutes rows and pin_cross refills the held cross K/V: the tensors keep their addresses (what a
    captured CUDA graph reads)."""
    torch.manual_seed(0)
    trunk = Trunk(preset("tiny", cross_attention=True)).eval()
    x, memory = torch.randn(3, 2, 64), torch.randn(3, 5, 64)
    cache = trunk.new_cache(3, 8)
    with torch.no_grad():
        trunk(x, memory=memory, cache=cache)
    cache.pin_cross()
    held = [(k.data_ptr(), v.data_ptr()) for k, v in cache.cross]
    addresses = [t.data_ptr() for t in cache.k + cache.v + [cache.valid]]
    before = [t.clone() for t in cache.k + cache.v + [cache.valid]]
    index = torch.tensor([2, 0, 0])
    cache.reorder(index)
    assert [t.data_ptr() for t in cache.k + cache.v + [cache.valid]] == addresses
    for t, b in zip(cache.k + cache.v + [cache.valid], before):
        assert torch.equal(t, b[index])
    cache.reset()
    assert cache.cross == [None] * len(cache.k) and cache.length == 0 and not cache.valid.any()
    with torch.no_grad():
        trunk(x, memory=2 * memory, cache=cache)  # a new batch: new cross K/V, computed into new tensors
    fresh = [(k.clone(), v.clone()) for k, v in cache.cross]
    cache.pin_cross()
    assert [(k.data_ptr(), v.data_ptr()) for k, v in cache.cross] == held
    for (k, v), (fk, fv) in zip(cache.cross, fresh):
        assert torch.equal(k, fk) and torch.equal(v, fv)


def test_option_checks(prefix_lm):
    dec, frames, mask = prefix_lm
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        greedy_decode(dec, frames, mask, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_repeats and max_period must be >= 1"):
        beam_search(dec, frames, mask, max_repeats=0)
    with pytest.raises(ValueError, match="check_every must be >= 1"):
        greedy_decode(dec, frames, mask, check_every=0)
    with pytest.raises(ValueError, match="beam_size must be >= 1"):
        beam_search(dec, frames, mask, beam_size=0)
