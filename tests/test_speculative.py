"""omni.speculative: speculative decoding gives greedy decoding's tokens for every model kind (omni's speech
recognizer, a converted Whisper with its logit rules and timestamp rules, the prefix-LM transcriber, GPT-2), batched
with a different acceptance per row, k in {1, 3, 5}, drafts all wrong and all right; and it takes fewer sequential
decoder passes when the draft is right (counted at the model). Plus the drafters, the cache rollback and the
option checks."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from _speech_models import tiny_model

from omni.decoding import greedy_decode
from omni.multitask import MultitaskModel, PrefixLMTranscriber, TranscribeTask
from omni.segment import Segment
from omni.speculative import DraftModel, DraftStats, PromptLookup, Reference, continuation, speculative_decode
from omni.speech import SpeechRecognizer, ctc_draft, decode_batch, ngram_draft, pad_audio
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import TextTokenizer
from omni.trunk import Trunk, preset

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

KS = (1, 3, 5)


class Counted:
    """A decoder that counts its sequential passes (every ``logits`` / ``decode_hidden`` call is one forward of
    the decoder), everything else its model's."""

    def __init__(self, model: Any) -> None:
        self.model, self.passes = model, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def logits(self, *args: Any) -> torch.Tensor:
        self.passes += 1
        return self.model.logits(*args)

    def decode_hidden(self, *args: Any) -> torch.Tensor:
        self.passes += 1
        return self.model.decode_hidden(*args)


def wrong(rows: list[list[int]], vocab: int) -> list[list[int]]:
    """Drafts that are never the greedy token (each shifted by one id)."""
    return [[(t + 1) % vocab for t in r] + [1] * 8 for r in rows]


def mixed(rows: list[list[int]], vocab: int) -> list[list[int]]:
    """Row 0 right, row 1 right for its first half then wrong, the others wrong: each row accepts differently."""
    out = wrong(rows, vocab)
    out[0] = list(rows[0])
    half = len(rows[1]) // 2
    out[1] = list(rows[1][:half]) + [(t + 1) % vocab for t in rows[1][half:]]
    return out


def check(model: Any, memory: torch.Tensor, mask: torch.Tensor | None, vocab: int, **kw: Any) -> list[list[int]]:
    """Speculative == greedy with right, wrong, mixed and n-gram drafts at every k; right drafts take fewer
    passes, wrong ones as many as greedy; the stats count what the model saw."""
    counted = Counted(model)
    ref = greedy_decode(counted, memory, mask, **kw)
    greedy_passes = counted.passes
    assert greedy_passes >= max(len(r) for r in ref)  # one pass per token (eos and a guard's cut included)
    accepted = {}
    for k in KS:
        for name, drafter in (("right", Reference(ref)), ("wrong", Reference(wrong(ref, vocab))),
                              ("mixed", Reference(mixed(ref, vocab))), ("ngram", PromptLookup())):
            counted.passes, stats = 0, DraftStats()
            got = speculative_decode(counted, memory, mask, drafter=drafter, draft_tokens=k, stats=stats, **kw)
            assert got == ref, (name, k)
            assert stats.passes == counted.passes
            accepted[name, k] = stats.accepted
            if name == "right":
                assert counted.passes <= -(-greedy_passes // (k + 1)) + 1, (k, counted.passes, greedy_passes)
            if name == "wrong":
                assert counted.passes == greedy_passes and stats.accepted == 0
        assert 0 < accepted["mixed", k] < accepted["right", k]
    return ref


def perturbed(model: Any, scale: float, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


@pytest.fixture(scope="module")
def speech():
    """A tiny random speech recognizer with a CTC head (weights enlarged: varied tokens), 3 clips of 40, 25 and
    33 audio tokens: (model, text tokenizer, audio, mask)."""
    audio, text = AudioTokenizer(), TextTokenizer()
    model = perturbed(_ctc_model(audio, text), 0.6)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 40, audio.n_mels * audio.kernel, generator=g)
    mask = torch.ones(3, 40, dtype=torch.bool)
    mask[1, 25:], mask[2, 33:] = False, False
    return model, text, x, mask


def _ctc_model(audio: AudioTokenizer, text: TextTokenizer) -> SpeechRecognizer:
    torch.manual_seed(0)
    return SpeechRecognizer(audio, text, preset("tiny"), preset("tiny", cross_attention=True), ctc=True)


def test_speech_recognizer(speech):
    """Guards on (the repetition guard and the per-clip limits end rows at different lengths) and off."""
    model, text, x, mask = speech
    memory = model.encode(x, mask)
    with torch.no_grad():
        ref = check(model, memory, mask, model.vocab_size, max_new_tokens=40)
        assert len({len(r) for r in ref}) > 1 and len({t for r in ref for t in r}) >= 8, ref
        long = check(model, memory, mask, model.vocab_size, max_new_tokens=30, tokens_per_second=None,
                     max_repeats=None)
        assert [len(r) for r in long] == [30, 30, 30]


def test_ctc_and_ngram_drafts_through_decode_batch(speech):
    """decode_batch with ``draft``: the CTC head's transcript re-tokenized (random weights: mostly rejected) and
    n-gram lookup give greedy's ids; a model without a CTC head is refused in one line."""
    model, text, x, mask = speech
    with torch.no_grad():
        ref = decode_batch(model, x, mask)
        for source in (ctc_draft(model, text), ngram_draft):
            for k in KS:
                stats = DraftStats()
                assert decode_batch(model, x, mask, draft=source, draft_tokens=k, draft_stats=stats) == ref
                assert stats.tokens >= sum(len(r) for r in ref) and stats.passes >= 2
        drafts = ctc_draft(model, text)(model.encode(x, mask), mask).drafts
        assert len(drafts) == 3 and all(text.bos_id not in d and text.eos_id not in d for d in drafts)
    plain = tiny_model(AudioTokenizer(), text)
    with pytest.raises(ValueError, match="CTC head"):
        ctc_draft(plain, text)
    with pytest.raises(ValueError, match="beam_size"):
        decode_batch(model, x, mask, beam_size=2, draft=ngram_draft)


def test_draft_model(speech):
    """(b) a smaller decoder (one layer) drafts: greedy's ids; the model drafting for itself is always right."""
    model, text, x, mask = speech
    audio = AudioTokenizer()
    torch.manual_seed(3)
    small = perturbed(SpeechRecognizer(audio, text, preset("tiny", n_layers=1),
                                       preset("tiny", n_layers=1, cross_attention=True)), 0.6, seed=3)
    with torch.no_grad():
        memory = model.encode(x, mask)
        ref = greedy_decode(model, memory, mask, max_new_tokens=40)
        for draft in (small, model):
            stats = DraftStats()
            got = speculative_decode(model, memory, mask, drafter=DraftModel(draft, draft.encode(x, mask), mask),
                                     draft_tokens=3, stats=stats, max_new_tokens=40)
            assert got == ref
        assert stats.accepted > 0 and stats.passes < max(len(r) for r in ref)


def _fresh_greedy(draft: Any, memory: torch.Tensor, mask: torch.Tensor, row: list[int], b: int, k: int) -> list[int]:
    """The draft model's k greedy tokens after ``row``, computed from nothing (no cache): the reference."""
    ids = list(row)
    for _ in range(k):
        text = torch.tensor([draft.prompt + ids])
        ids.append(int(draft.head(draft.decode_hidden(text, memory[b:b + 1], mask[b:b + 1]))[0, -1].argmax()))
    return ids[len(row):]


def test_draft_model_cache(speech):
    """DraftModel's KV cache across proposals (rows growing by different counts, a row without tokens, a cache that
    must be compacted and then grown): every proposal equals the draft's greedy tokens computed from nothing."""
    model, text, x, mask = speech
    with torch.no_grad():
        memory = model.encode(x, mask)
        drafter = DraftModel(model, memory, mask, capacity=12)
        g = torch.Generator().manual_seed(0)
        rows: list[list[int]] = [[], [5], [9, 10]]
        for step in range(7):
            got = drafter.propose(rows, 3)
            for b, row in enumerate(rows):
                assert got[b] == _fresh_greedy(model, memory, mask, row, b, 3), (step, b)
            # rows grow by 0, 1 and 3 tokens: a drafted prefix, or other tokens
            rows = [rows[0] + got[0][:step % 2], rows[1] + [int(torch.randint(100, 900, (1,), generator=g))],
                    rows[2] + got[2][:2] + [int(torch.randint(100, 900, (1,), generator=g))]]
        assert drafter.capacity > 12  # grown once the rows' real tokens no longer fit


# ----------------------------------------------------------------------------------------------------
# A converted Whisper: SuppressTokens, SuppressAtStart (the model's filters) and the timestamp rules


@pytest.fixture(scope="module")
def converted_whisper():
    whisper = pytest.importorskip("whisper")
    from _interop import o1_weights
    from whisper.model import ModelDimensions, Whisper

    from omni.interop.whisper import from_openai
    from omni.speech import build_speech_recognizer

    dims = dict(n_mels=80, n_audio_ctx=1500, n_audio_state=64, n_audio_head=4, n_audio_layer=2, n_vocab=51865,
                n_text_ctx=448, n_text_state=64, n_text_head=4, n_text_layer=2)
    peer = o1_weights(Whisper(ModelDimensions(**dims)), 1,
                      embedding_std=lambda table: table.shape[1] ** -0.5 if table.shape[0] > 50000 else 1,
                      named={"positional_embedding": 1.0})
    config, sd, toks = from_openai(peer.state_dict(), dims)
    model = build_speech_recognizer(config, toks)
    model.load_state_dict(sd, strict=True)
    del whisper
    g = torch.Generator().manual_seed(2)
    memory = torch.randn(3, 60, 64, generator=g)  # decoding reads the memory only: no need for the encoder
    mask = torch.ones(3, 60, dtype=torch.bool)
    mask[1, 40:] = False
    return model.eval(), memory, mask


def test_converted_whisper_with_its_rules(converted_whisper):
    model, memory, mask = converted_whisper
    guards = {**dict(model.decoding.guards), "max_new_tokens": 24}
    with torch.no_grad():
        ref = check(model, memory, mask, model.vocab_size, **guards)
        assert all(r and r[0] not in model.logit_filters[-1].ids.tolist() for r in ref)  # SuppressAtStart held
        mode = model.timestamp_mode()
        tref = check(mode, memory, mask, model.vocab_size, **guards)
    tb = mode.timestamp_begin
    assert all(r[0] >= tb for r in tref)  # the first token is a timestamp: the rules ran
    assert sum(t >= tb for r in tref for t in r) >= 6, tref  # and later ones: pairs, monotonic, forced


# ----------------------------------------------------------------------------------------------------
# The prefix-LM transcriber: the audio prefix in the cache (padded frames: invalid slots before the text)


def test_prefix_lm_transcriber():
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
    dec = PrefixLMTranscriber.for_task(model.omni, task)
    frames, mask = pad_audio([c.tokens for c in clips])
    with torch.no_grad():
        ref = check(dec, dec.encode(frames, mask), mask, text.vocab_size, max_new_tokens=20, tokens_per_second=None,
                    max_repeats=None)
    assert len({t for r in ref for t in r}) >= 3


# ----------------------------------------------------------------------------------------------------
# GPT-2 through omni.generate: prompt lookup, batched prompts of different lengths


def test_gpt2_generation():
    pytest.importorskip("transformers")
    from test_interop_gpt2 import PROMPTS, TEXT, hf_model, omni_lm

    from omni.generate import generate_ids

    lm = omni_lm(hf_model())
    prompts = [lm.encode(p) for p in PROMPTS + [TEXT]]
    with torch.no_grad():
        ref = generate_ids(lm, prompts, max_new_tokens=16)
        calls = {"n": 0}
        features = lm.features

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls["n"] += 1
            return features(*args, **kwargs)

        lm.features = counted  # type: ignore[method-assign]
        generate_ids(lm, prompts, max_new_tokens=16)
        greedy_passes = calls["n"]
        for k in KS:
            for draft in ("ngram", Reference(ref), Reference(wrong(ref, 50257)), Reference(mixed(ref, 50257))):
                calls["n"], stats = 0, DraftStats()
                assert generate_ids(lm, prompts, max_new_tokens=16, draft=draft, draft_tokens=k, stats=stats) == ref
                assert stats.passes == calls["n"]
                if isinstance(draft, Reference) and draft.drafts == ref:  # right for every row
                    assert calls["n"] < greedy_passes and stats.accepted > 0
    assert greedy_passes == 16
    with pytest.raises(ValueError, match="greedy"):
        generate_ids(lm, prompts, max_new_tokens=8, temperature=0.5, draft="ngram")
    with pytest.raises(ValueError, match="draft must be"):
        generate_ids(lm, prompts, max_new_tokens=8, draft="nope")


# ----------------------------------------------------------------------------------------------------
# Pieces


def test_continuation_and_prompt_lookup():
    assert continuation([5, 6, 7, 8, 5, 6, 9], [1, 5, 6], 1, 3) == [9]  # the latest occurrence of the 2-gram
    assert continuation([5, 6, 7, 8, 5, 6, 9], [1, 5, 6], 2, 3) == [7, 8]  # the latest followed by k tokens
    assert continuation([4, 4, 4, 4, 4], [4, 4], 3, 2, exclude_end=True) == [4, 4, 4]  # a repeating text
    assert continuation([5, 6, 7, 8, 5, 6, 9], [5, 6], 2, 3, near=2) == [7, 8]  # the one nearest position 2
    assert continuation([1, 2, 3], [4], 2, 3) is None
    lookup = PromptLookup([[10, 11, 12, 13]], max_ngram=2)
    assert lookup.propose([[11]], 2) == [[12, 13]]  # copied from the prompt
    assert lookup.propose([[12, 13, 4, 12, 13]], 3) == [[4, 12, 13]]  # from the text itself, not its own tail
    assert lookup.propose([[99]], 3) == [[]]
    ref = Reference([[1, 2, 3, 4, 5]])
    assert ref.propose([[]], 2) == [[1, 2]] and ref.propose([[7, 3]], 2) == [[4, 5]]
    assert ref.propose([[8, 8]], 2) == [[3, 4]]  # no tail found: by position


def test_option_checks(speech):
    model, text, x, mask = speech
    memory = model.encode(x, mask)
    for k in (0, 33):
        with pytest.raises(ValueError, match="draft tokens must be 1 .. 32"):
            speculative_decode(model, memory, mask, drafter=PromptLookup(), draft_tokens=k)

    class LastOnly:  # a decoder without every position's hidden states
        def __getattr__(self, name: str) -> Any:
            if name in ("decode_hidden", "head"):
                raise AttributeError(name)
            return getattr(model, name)

    with pytest.raises(ValueError, match="decode_hidden"):
        speculative_decode(LastOnly(), memory, mask, drafter=PromptLookup())

    class RingCache(Counted):  # a cache without rollback (a trunk with attention patterns keeps a ring)
        def new_cache(self, memory: torch.Tensor, max_length: int) -> object:
            return object()

    with pytest.raises(ValueError, match="rolls the KV cache back"):
        speculative_decode(RingCache(model), memory, mask, drafter=PromptLookup())


def test_kv_cache_rollback():
    """rollback keeps each row's first n real slots; compact moves them to the front, and the next token's output
    is the same either way (positions live in the keys)."""
    torch.manual_seed(0)
    trunk = Trunk(preset("tiny")).eval()
    x = torch.randn(2, 6, 64)
    cache = trunk.new_cache(2, 12)
    with torch.no_grad():
        trunk(x, cache=cache)
        cache.rollback(torch.tensor([4, 6]))
        assert cache.real_tokens().tolist() == [4, 6]
        assert cache.valid[0].tolist() == [True] * 4 + [False] * 8
        y = torch.randn(2, 1, 64)
        pos = torch.tensor([[4], [6]])
        slot = torch.tensor(6)
        a = trunk(y, pos, cache=cache, cache_position=slot)
        cache.rollback(cache.real_tokens() - 1)  # forget that token again
        cache.rollback(cache.real_tokens(), compact=True)
        assert cache.valid[0].tolist() == [True] * 4 + [False] * 8 and cache.real_tokens().tolist() == [4, 6]
        b = trunk(y, pos, cache=cache, cache_position=slot)
        fresh = trunk.new_cache(1, 12)
        trunk(x[:1, :4], cache=fresh)
        c = trunk(y[:1], pos[:1], cache=fresh)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a[:1], c)


def test_cli_generate_draft(tmp_path, capsys):
    """omni generate --draft ngram prints greedy's text (and its passes on stderr); bad draft options are one line,
    exit 2."""
    pytest.importorskip("transformers")
    import json

    from _interop import cli_error
    from test_interop_gpt2 import PROMPTS, hf_model

    from omni.cli import main
    from omni.interop import convert

    hf_dir = tmp_path / "hf"
    hf_model().save_pretrained(hf_dir)
    export = convert(hf_dir, tmp_path / "omni")
    base = ["generate", "--checkpoint", str(export), "--max-new-tokens", "12", "--format", "json"]
    assert main(base + PROMPTS) == 0
    greedy = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", "ngram", "--draft-tokens", "3"] + PROMPTS) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) == greedy
    assert "--draft ngram:" in out.err and "decoder passes for" in out.err
    assert "--draft-tokens" in cli_error(base + ["--draft", "ngram", "--draft-tokens", "0", "x"], capsys, prog=None)
    assert "--temperature" in cli_error(base + ["--draft", "ngram", "--temperature", "0.5", "x"], capsys, prog=None)


def test_cli_transcribe_draft(speech, tmp_path, capsys):
    """omni transcribe --draft ctc|ngram prints greedy's transcripts; --draft ctc on an export without a CTC head and
    --draft with --beam-size 2 are one line, exit 2."""
    import json

    import soundfile as sf

    from _interop import cli_error

    from omni.cli import main
    from omni.export import save_pretrained

    model, text, _, _ = speech
    audio = AudioTokenizer()
    config = {"builder": "omni.speech:build_speech_recognizer", "encoder": preset("tiny").to_dict(),
              "decoder": preset("tiny", cross_attention=True).to_dict()}
    ctc = save_pretrained(model, tmp_path / "ctc", {**config, "ctc": True}, tokenizers={"audio": audio, "text": text})
    plain = save_pretrained(tiny_model(audio, text), tmp_path / "plain", config,
                            tokenizers={"audio": audio, "text": text})
    g = torch.Generator().manual_seed(4)
    files = []
    for i, seconds in enumerate((0.8, 1.3)):
        files.append(str(tmp_path / f"clip{i}.wav"))
        sf.write(files[-1], (torch.randn(int(16000 * seconds), generator=g) * 0.1).numpy(), 16000)
    base = ["transcribe", "--checkpoint", str(ctc), "--device", "cpu", "--format", "json"]
    assert main(base + files) == 0
    greedy = json.loads(capsys.readouterr().out)
    assert any(row["text"] for row in greedy)
    for draft in ("ctc", "ngram"):
        assert main(base + ["--draft", draft, "--draft-tokens", "3"] + files) == 0
        assert json.loads(capsys.readouterr().out) == greedy
    err = cli_error(["transcribe", "--checkpoint", str(plain), "--draft", "ctc", files[0]], capsys, prog=None)
    assert "--draft ctc" in err and "CTC head" in err
    err = cli_error(base + ["--draft", "ngram", "--beam-size", "2", files[0]], capsys, prog=None)
    assert "--beam-size" in err


def test_benchmark_dry_run(tmp_path):
    """benchmarks/draft_decoding.py --dry-run: every row decodes greedy's ids and the JSON holds them."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "draft_decoding.py"
    spec = importlib.util.spec_from_file_location("draft_decoding", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    assert bench.main(["--dry-run", "--models", "speech", "--batches", "3", "--threads", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["drafter"] for r in rows} == {"greedy", "oracle", "wrong", "ctc"} and all(r["identical"] for r in rows)
    assert min(r["passes"] for r in rows if r["drafter"] == "oracle") < rows[0]["passes"]


def _swapped_vocabulary(text: TextTokenizer) -> TextTokenizer:
    """The same size of vocabulary, two tokens' ids swapped: another tokenizer a size check alone would let through."""
    from tokenizers import Tokenizer

    data = json.loads(text.hf.to_str())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[300], list(vocab)[301]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return TextTokenizer.from_hf(Tokenizer.from_str(json.dumps(data)))


def test_cli_transcribe_draft_model(speech, tmp_path, capsys):
    """omni transcribe --draft PATH (a smaller random speech export with the vocabulary) prints greedy's text; a
    draft with another vocabulary (size, or the same size with other tokens) or other audio features is one line."""
    import soundfile as sf

    from _interop import cli_error

    from omni.cli import main
    from omni.export import save_pretrained

    model, text, _, _ = speech
    audio = AudioTokenizer()
    config = {"builder": "omni.speech:build_speech_recognizer", "encoder": preset("tiny").to_dict(),
              "decoder": preset("tiny", cross_attention=True).to_dict(), "ctc": True}
    main_dir = save_pretrained(model, tmp_path / "main", config, tokenizers={"audio": audio, "text": text})
    small_enc, small_dec = preset("tiny", n_layers=1), preset("tiny", n_layers=1, cross_attention=True)
    small_config = {**config, "encoder": small_enc.to_dict(), "decoder": small_dec.to_dict(), "ctc": False}
    torch.manual_seed(3)
    small = perturbed(SpeechRecognizer(audio, text, small_enc, small_dec), 0.6)
    draft_dir = save_pretrained(small, tmp_path / "draft", small_config, tokenizers={"audio": audio, "text": text})
    other = _swapped_vocabulary(text)
    swapped = save_pretrained(SpeechRecognizer(audio, other, small_enc, small_dec), tmp_path / "swapped",
                              small_config, tokenizers={"audio": audio, "text": other})
    g = torch.Generator().manual_seed(4)
    files = []
    for i, seconds in enumerate((0.8, 1.3)):
        files.append(str(tmp_path / f"clip{i}.wav"))
        sf.write(files[-1], (torch.randn(int(16000 * seconds), generator=g) * 0.1).numpy(), 16000)
    base = ["transcribe", "--checkpoint", str(main_dir), "--device", "cpu", "--format", "json"]
    assert main(base + files) == 0
    greedy = json.loads(capsys.readouterr().out)
    assert any(row["text"] for row in greedy)
    for draft in (draft_dir, main_dir):  # a random small draft (few accepted) and a perfect one
        assert main(base + ["--draft", str(draft), "--draft-tokens", "3"] + files) == 0
        assert json.loads(capsys.readouterr().out) == greedy
    err = cli_error(base + ["--draft", str(swapped), files[0]], capsys, prog=None)
    assert "--draft" in err and "not this model's" in err
    stride3 = AudioTokenizer(stride=3)
    strided = save_pretrained(small, tmp_path / "strided", small_config, tokenizers={"audio": stride3, "text": text})
    err = cli_error(base + ["--draft", str(strided), files[0]], capsys, prog=None)
    assert "--draft" in err and "audio features" in err
    err = cli_error(base + ["--draft", str(tmp_path / "nowhere"), files[0]], capsys, prog=None)
    assert "--draft" in err and "ctc or ngram" in err


def test_draft_vocabulary_size(speech):
    """A draft tokenizer of another size is named with both sizes."""
    from omni.speculative import check_draft_vocabulary

    _, text, _, _ = speech
    small = TextTokenizer().fit(["the cat sat on the mat", "a red ball"] * 20, vocab_size=300)
    with pytest.raises(ValueError, match=rf"--draft d: its vocabulary has {small.vocab_size} tokens, this model's "
                                         rf"{text.vocab_size}"):
        check_draft_vocabulary(text, small, "d")
    check_draft_vocabulary(text, TextTokenizer(), "d")  # the same tokens: no error


def test_cli_generate_draft_model(tmp_path, capsys):
    """omni generate --draft PATH: a smaller random GPT-2 with the vocabulary drafts; the text is greedy's."""
    pytest.importorskip("transformers")
    from _interop import cli_error
    from test_interop_gpt2 import PROMPTS, hf_model

    from omni.cli import main
    from omni.interop import convert

    hf_model().save_pretrained(tmp_path / "hf")
    hf_model(seed=7, n_layer=1).save_pretrained(tmp_path / "hf_small")
    export = convert(tmp_path / "hf", tmp_path / "omni")
    small = convert(tmp_path / "hf_small", tmp_path / "omni_small")
    base = ["generate", "--checkpoint", str(export), "--max-new-tokens", "12", "--format", "json"]
    assert main(base + PROMPTS) == 0
    greedy = json.loads(capsys.readouterr().out)
    for draft in (small, export):
        assert main(base + ["--draft", str(draft), "--draft-tokens", "3"] + PROMPTS) == 0
        out = capsys.readouterr()
        assert json.loads(out.out) == greedy
        assert f"--draft {draft}:" in out.err
    assert "--draft" in cli_error(base + ["--draft", str(tmp_path / "nowhere"), "x"], capsys, prog=None)
