"""Mask-CTC (#27 part 2): the masked-LM objective by hand, the decoder's two attention modes, CTC drafts with their
confidence, easy-first filling, batching, and `omni transcribe --decode ctc|mask-ctc` with its one-line errors."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from omni.asr_text import CTC_BLANK, ctc_greedy_decode
from omni.mask_ctc import Draft, MaskCTCStats, ctc_decode, ctc_tokens, mask_ctc, mask_ctc_decode
from omni.speech import (MASK_TOKEN, SpeechCollate, SpeechLoss, SpeechRecognizer, decode_batch, mask_tokens,
                         speech_example)
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import IGNORE_INDEX, TextTokenizer
from omni.trunk import preset

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

TEXTS = ["The cat sat down.", "Where is my hat?", "A red ball."]


@pytest.fixture(scope="module")
def toks():
    return AudioTokenizer(), TextTokenizer()


def mask_model(audio: AudioTokenizer, text: TextTokenizer, seed: int = 0, scale: float = 1.0) -> SpeechRecognizer:
    torch.manual_seed(seed)
    model = SpeechRecognizer(audio, text, preset("tiny"), preset("tiny", cross_attention=True), ctc=True,
                             mask_token=MASK_TOKEN).eval()
    with torch.no_grad():  # larger weights: varied, confident predictions from a random model
        for p in model.parameters():
            p.mul_(scale)
    return model


def batch_of(audio: AudioTokenizer, text: TextTokenizer, seconds=(0.6, 1.2, 0.9)):
    g = torch.Generator().manual_seed(0)
    items = [speech_example(audio, text, torch.randn(int(16000 * s), generator=g) * 0.1, t, key=str(i), mlm=True)
             for i, (s, t) in enumerate(zip(seconds, TEXTS))]
    return SpeechCollate(text.pad_id)(items)


def test_masked_lm_loss_by_hand(toks):
    """SpeechLoss(mask_weight=0.4): 0.6 x next-token CE + 0.4 x the CE of the masked positions of a bidirectional
    pass over the normalised transcript, computed here from the decoder's pieces."""
    audio, text = toks
    model = mask_model(audio, text)
    batch = batch_of(audio, text)
    assert text.decode(batch.mlm_text[0].tolist()) == "the cat sat down"  # normalised: the CTC head's units
    assert batch.mlm_body.sum(1).tolist() == [(batch.mlm_real[b].sum() - 3).item() for b in range(3)]
    torch.manual_seed(5)
    loss, metrics = SpeechLoss(0.0, 0.4, model.mask_id)(model, batch)
    torch.manual_seed(5)
    masked, chosen = mask_tokens(batch.mlm_text, batch.mlm_body, model.mask_id)
    assert (masked[chosen] == model.mask_id).all() and torch.equal(masked[~chosen], batch.mlm_text[~chosen])
    assert (chosen.sum(1) >= 1).all() and not (chosen & ~batch.mlm_body).any()
    memory = model.encode(batch.audio, batch.audio_mask)
    causal = model.head(model.decoder(model.text_embed(batch.text), None, "causal", memory=memory,
                                      memory_mask=batch.audio_mask))
    keep = batch.targets != IGNORE_INDEX
    ar = -causal.log_softmax(-1)[keep].gather(1, batch.targets[keep][:, None]).mean()
    key_mask = batch.mlm_real[:, None, None, :]
    full = model.head(model.decoder(model.text_embed(masked), None, key_mask, memory=memory,
                                    memory_mask=batch.audio_mask))
    mlm = -full.log_softmax(-1)[chosen].gather(1, batch.mlm_text[chosen][:, None]).mean()
    torch.testing.assert_close(metrics["mask_loss"], mlm.detach())
    torch.testing.assert_close(loss, 0.6 * ar + 0.4 * mlm)
    # with CTC the decoder's total is weighed as before
    torch.manual_seed(5)
    both, m2 = SpeechLoss(0.5, 0.4, model.mask_id)(model, batch)
    torch.testing.assert_close(both, 0.5 * (0.6 * ar + 0.4 * mlm) + 0.5 * m2["ctc_loss"])


def test_mask_count_is_uniform(toks):
    """n ~ Uniform{1 .. L}: over many draws every count from 1 to L turns up, about equally often."""
    body = torch.zeros(2000, 8, dtype=torch.bool)
    body[:, 2:7] = True  # L = 5
    _, chosen = mask_tokens(torch.zeros(2000, 8, dtype=torch.long), body, 7, torch.Generator().manual_seed(0))
    counts = torch.bincount(chosen.sum(1), minlength=7)
    assert counts[0] == 0 and counts[6] == 0
    assert ((counts[1:6].float() / 2000 - 0.2).abs() < 0.04).all(), counts


def test_bidirectional_sees_later_tokens(toks):
    """A later token changes an earlier position's hidden state without the causal mask, never with it."""
    audio, text = toks
    model = mask_model(audio, text)
    batch = batch_of(audio, text)
    memory = model.encode(batch.audio, batch.audio_mask)
    ids = batch.mlm_text[:1, :6].clone()
    other = ids.clone()
    other[0, 4] = 500
    bi = [model.decode_bidirectional(t, memory[:1], batch.audio_mask[:1]) for t in (ids, other)]
    causal = [model.decode_hidden(t, memory[:1], batch.audio_mask[:1]) for t in (ids, other)]
    assert (bi[0][0, 2] - bi[1][0, 2]).abs().max() > 1e-3
    torch.testing.assert_close(causal[0][0, :4], causal[1][0, :4])
    # padding hidden by text_mask: a pad tail changes nothing for the real tokens
    padded = torch.cat([ids, torch.full((1, 3), text.pad_id)], 1)
    real = torch.arange(9)[None] < 6
    torch.testing.assert_close(model.decode_bidirectional(padded, memory[:1], batch.audio_mask[:1], real)[:, :6],
                               bi[0], atol=1e-5, rtol=1e-5)


def test_ctc_tokens_confidence(toks):
    """A byte's confidence is the max over its frames, a token's the min over its bytes; the ids are the CTC text's."""
    _, text = toks
    frames = [(ord("h"), 0.9), (ord("h"), 0.6), (CTC_BLANK, 0.99), (ord("i"), 0.7), (ord(" "), 0.95), (ord("a"), 0.5),
              (ord("a"), 0.8), (ord("t"), 0.97)]
    logits = torch.full((1, len(frames), CTC_BLANK + 1), -1e4)
    for i, (c, p) in enumerate(frames):  # p on c, the rest spread evenly: p is the best path's probability
        rest = (1 - p) / CTC_BLANK
        logits[0, i] = torch.log(torch.full((CTC_BLANK + 1,), rest))
        logits[0, i, c] = torch.log(torch.tensor(p))
    (draft,) = ctc_tokens(logits, None, text)
    assert draft.text == "hi at" == ctc_greedy_decode(logits)[0]
    assert text.decode(draft.ids) == "hi at"
    pieces = [text.decode([i]) for i in draft.ids]
    want = {"h": 0.9, "i": 0.7, " ": 0.95, "a": 0.8, "t": 0.97}
    for piece, c in zip(pieces, draft.confidence):
        assert c == pytest.approx(min(want[ch] for ch in piece), abs=1e-5), (pieces, draft.confidence)


class Recorder:
    """A model whose bidirectional passes are recorded (inputs, and the logits the head gives)."""

    def __init__(self, model: SpeechRecognizer) -> None:
        self.model, self.inputs, self.logits = model, [], []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def decode_bidirectional(self, text, memory, audio_mask, text_mask=None):
        self.inputs.append(text.clone())
        return self.model.decode_bidirectional(text, memory, audio_mask, text_mask)

    def head(self, hidden):
        out = self.model.head(hidden)
        self.logits.append(out.float())
        return out


def _drafts(n: int = 3) -> list[Draft]:
    rows = [[400, 401, 402, 403, 404, 405, 406], [500, 501, 502, 503], [600, 601, 602, 603, 604, 605]]
    conf = [[0.99, 0.2, 0.5, 0.95, 0.1, 0.3, 0.97], [0.1, 0.2, 0.3, 0.4], [0.99, 0.98, 0.97, 0.5, 0.99, 0.99]]
    return [Draft(r, c, "") for r, c in zip(rows[:n], conf[:n])]


def test_all_confident_returns_the_draft(toks):
    audio, text = toks
    model = mask_model(audio, text)
    batch = batch_of(audio, text)
    memory = model.encode(batch.audio, batch.audio_mask)
    drafts = [Draft(d.ids, [1.0] * len(d.ids), "") for d in _drafts()]
    stats = MaskCTCStats()
    assert mask_ctc(model, memory, batch.audio_mask, drafts, iterations=3, stats=stats) == [d.ids for d in drafts]
    assert stats.passes == 0 and stats.masked == 0


@pytest.mark.parametrize("iterations", [1, 2, 3, 10])
def test_easy_first_iterations(toks, iterations):
    """Only the masked (unsure) positions change; a row with m masks runs min(N, m) passes, each but its last
    filling floor(m / passes) masks, the ones the decoder is surest of, the last all that remain."""
    audio, text = toks
    model = Recorder(mask_model(audio, text, scale=3.0))
    batch = batch_of(audio, text)
    memory = model.model.encode(batch.audio, batch.audio_mask)
    drafts = _drafts()
    specials = sorted({text.token_id(n) for n in text.special_tokens})
    stats = MaskCTCStats()
    out = mask_ctc(model, memory, batch.audio_mask, drafts, iterations=iterations, threshold=0.9, suppress=specials,
                   stats=stats)
    P = len(model.prompt)
    masks = [[c < 0.9 for c in d.confidence] for d in drafts]
    runs = [min(iterations, sum(m)) for m in masks]
    assert stats.passes == max(runs) == len(model.inputs) and stats.masked == sum(map(sum, masks))
    for b, (d, m) in enumerate(zip(drafts, masks)):
        assert [o for o, x in zip(out[b], m) if not x] == [i for i, x in zip(d.ids, m) if not x]
        assert all(o not in specials for o in out[b])
    for b in range(3):  # replay row b's passes: each fills its surest masks, with the decoder's choice
        per = sum(masks[b]) // runs[b]
        final = torch.tensor(model.prompt + out[b])
        for t in range(runs[b]):
            active = [r for r in range(3) if t < runs[r]]
            before = model.inputs[t][active.index(b)]
            following = [r for r in range(3) if t + 1 < runs[r]]
            after = final if t + 1 == runs[b] else model.inputs[t + 1][following.index(b)]
            remaining = [i for i in range(len(drafts[b].ids)) if int(before[P + i]) == model.mask_id]
            if t == 0:
                assert remaining == [i for i, x in enumerate(masks[b]) if x]
            filled = [i for i in remaining if int(after[P + i]) != model.mask_id]
            assert len(filled) == (len(remaining) if t + 1 == runs[b] else per)
            logits = model.logits[t][active.index(b)].clone()
            logits[:, specials] = float("-inf")
            score, choice = logits.softmax(-1).max(-1)
            left = [i for i in remaining if i not in filled]
            if left:
                assert min(float(score[P + i]) for i in filled) >= max(float(score[P + i]) for i in left)
            assert all(int(after[P + i]) == int(choice[P + i]) for i in filled)


def test_batched_equals_per_row(toks):
    audio, text = toks
    model = mask_model(audio, text, scale=3.0)
    batch = batch_of(audio, text)
    memory = model.encode(batch.audio, batch.audio_mask)
    drafts = _drafts()
    together = mask_ctc(model, memory, batch.audio_mask, drafts, iterations=3)
    alone = [mask_ctc(model, memory[b:b + 1], batch.audio_mask[b:b + 1], [drafts[b]], iterations=3)[0]
             for b in range(3)]
    assert together == alone
    # the decode_batch strategies: CTC alone is the CTC head's greedy text
    ids = decode_batch(model, batch.audio, batch.audio_mask, parallel=ctc_decode(model, text))
    heard = ctc_greedy_decode(model.ctc_head(memory), batch.audio_mask)
    assert [text.decode(r) for r in ids] == heard
    stats = MaskCTCStats()
    filled = decode_batch(model, batch.audio, batch.audio_mask, parallel=mask_ctc_decode(model, text, 2, stats=stats))
    assert [len(r) for r in filled] == [len(r) for r in ids] and stats.passes <= 2


def test_untrained_models_refused(toks):
    audio, text = toks
    plain = SpeechRecognizer(audio, text, preset("tiny"), preset("tiny", cross_attention=True), ctc=True)
    with pytest.raises(ValueError, match="--decode mask-ctc needs a decoder trained as a masked LM"):
        mask_ctc_decode(plain, text)
    no_ctc = SpeechRecognizer(audio, text, preset("tiny"), preset("tiny", cross_attention=True), mask_token=MASK_TOKEN)
    with pytest.raises(ValueError, match="no CTC head"):
        ctc_decode(no_ctc, text)
    with pytest.raises(ValueError, match="iterations must be 1 .. 64"):
        mask_ctc_decode(mask_model(audio, text), text, iterations=0)


def test_cli_decode_ctc_and_mask_ctc(toks, tmp_path, capsys):
    """--decode ctc prints the CTC head's greedy text (word times from CTC); --decode mask-ctc runs; each wrong use
    is one line, exit 2."""
    import soundfile as sf

    from _interop import cli_error

    from omni.cli import main
    from omni.export import save_pretrained
    from omni.pipelines.transcribe import read_audio_file

    audio, text = toks
    config = {"builder": "omni.speech:build_speech_recognizer", "encoder": preset("tiny").to_dict(),
              "decoder": preset("tiny", cross_attention=True).to_dict(), "ctc": True}
    model = mask_model(audio, text, scale=2.0)
    trained = save_pretrained(model, tmp_path / "mask", {**config, "mask_token": MASK_TOKEN, "mask_weight": 0.5},
                              tokenizers={"audio": audio, "text": text})
    plain = save_pretrained(model, tmp_path / "plain", config, tokenizers={"audio": audio, "text": text})
    no_ctc = save_pretrained(SpeechRecognizer(audio, text, preset("tiny"), preset("tiny", cross_attention=True)),
                             tmp_path / "noctc", {**config, "ctc": False}, tokenizers={"audio": audio, "text": text})
    g = torch.Generator().manual_seed(4)
    files = []
    for i, seconds in enumerate((0.8, 1.3)):
        files.append(str(tmp_path / f"clip{i}.wav"))
        sf.write(files[-1], (torch.randn(int(16000 * seconds), generator=g) * 0.1).numpy(), 16000)
    base = ["transcribe", "--checkpoint", str(trained), "--device", "cpu", "--format", "json"]
    assert main(base + ["--decode", "ctc"] + files) == 0
    rows = json.loads(capsys.readouterr().out)
    want = []
    for f in files:
        x, mask = audio.encode((read_audio_file(f, 16000), 16000)).tokens[None], None
        want.append(ctc_greedy_decode(model.ctc_head(model.encode(x, mask)))[0].strip())
    assert [r["text"] for r in rows] == want and any(want)
    assert all(r["method"] == "ctc" for r in rows)  # word times from the CTC forced alignment
    assert main(base + ["--decode", "mask-ctc", "--iterations", "2", "--mask-threshold", "0.9"] + files) == 0
    filled = json.loads(capsys.readouterr().out)
    assert len(filled) == 2 and all(isinstance(r["text"], str) for r in filled)
    for argv, words in (
        (["--decode", "mask-ctc", "--iterations", "0"], "--iterations"),
        (["--decode", "mask-ctc", "--iterations", "-3"], "--iterations"),
        (["--iterations", "3"], "--iterations 3"),
        (["--mask-threshold", "0.5"], "--mask-threshold"),
        (["--decode", "mask-ctc", "--mask-threshold", "-1"], "--mask-threshold"),
        (["--decode", "ctc", "--iterations", "3"], "--decode mask-ctc"),
        (["--draft", "ngram", "--draft-tokens", "33"], "--draft-tokens"),
        (["--decode", "ctc", "--draft", "ngram"], "--decode ctc"),
        (["--decode", "greedy", "--beam-size", "3"], "--beam-size 3"),
    ):
        assert words in cli_error(base + argv + files[:1], capsys, prog="omni transcribe")
    err = cli_error(["transcribe", "--checkpoint", str(plain), "--decode", "mask-ctc", files[0]], capsys, prog=None)
    assert "--decode mask-ctc" in err and "not trained" in err
    for mode in ("ctc", "mask-ctc"):
        err = cli_error(["transcribe", "--checkpoint", str(no_ctc), "--decode", mode, files[0]], capsys, prog=None)
        assert f"--decode {mode}" in err and "CTC head" in err
    err = cli_error(["transcribe", "--checkpoint", str(no_ctc), "--draft", "ctc", files[0]], capsys, prog=None)
    assert "--draft ctc" in err and "CTC head" in err


def test_recipe_mask_weight(toks, tmp_path):
    """recipes/whisper.py: mask_weight 0 leaves the export config as it was; > 0 records the mask token and weight
    (what `omni transcribe --decode mask-ctc` reads), needs the CTC head, and a mask token in the vocabulary."""
    from conftest import load_recipe

    whisper = load_recipe("whisper", "whisper_recipe_mask")
    audio, text = toks
    base = whisper.parse_args(["--preset", "tiny", "--set", f"out={tmp_path}"])
    assert base["mask_weight"] == 0.0 and "mask_token" not in whisper.from_scratch(base, audio, text)[1]
    cfg = whisper.parse_args(["--preset", "tiny", "--set", "mask_weight=0.5", "--set", f"out={tmp_path}"])
    model, export = whisper.from_scratch(cfg, audio, text)
    assert export["mask_token"] == MASK_TOKEN and export["mask_weight"] == 0.5 and model.mask_id == 7
    with pytest.raises(SystemExit):
        whisper.parse_args(["--preset", "tiny", "--set", "mask_weight=0.5", "--set", "ctc_weight=0.0"])
    with pytest.raises(SystemExit):
        whisper.parse_args(["--preset", "tiny", "--set", "mask_weight=1.0"])
    small = TextTokenizer().fit(["the cat sat on the mat"] * 10, vocab_size=300)
    from tokenizers import Tokenizer

    data = json.loads(small.hf.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != MASK_TOKEN]
    no_mask = TextTokenizer.from_hf(Tokenizer.from_str(json.dumps(data)))
    with pytest.raises(ValueError, match="mask_weight > 0 needs the mask token"):
        whisper.mask_settings(cfg, no_mask)
    # the masked LM's text, as prompted_example builds it for the batch
    example = whisper.prompted_example(audio, text, (1, 3), "keep", True, torch.zeros(8000).numpy(),
                                       "Hello, World!", mlm=True)
    assert text.decode(example["mlm"].tolist()) == "hello world" and example["mlm_start"] == 2


def test_recipe_scores_mask_ctc(toks):
    """The recipe's Scorer adds Mask-CTC's CER for a model trained for it (what --decode mask-ctc prints), the result
    line names it after the CTC head's and the decoder's."""
    from conftest import load_recipe

    whisper = load_recipe("whisper", "whisper_recipe_score")
    audio, text = toks
    model = mask_model(audio, text, scale=2.0)
    g = torch.Generator().manual_seed(0)
    items = [whisper.prompted_example(audio, text, tuple(model.prompt), "keep", True,
                                      (torch.randn(12000, generator=g) * 0.1).numpy(), t, key=str(i), mlm=True)
             for i, t in enumerate(TEXTS)]
    batch = SpeechCollate(text.pad_id)(items)
    scorer = whisper.Scorer(text, None, 8)
    scorer.eval_fn(model, batch)
    metrics = scorer.metrics(model, 0)
    ids = decode_batch(model, batch.audio, batch.audio_mask, parallel=mask_ctc_decode(model, text))
    from omni.speech import error_rates

    want = error_rates([text.decode(r) for r in batch.text.tolist()], [text.decode(r) for r in ids])["cer"]
    assert metrics["mask_ctc_cer"] == pytest.approx(want)
    line = whisper.result_line("ctc", {f"eval/{k}": v for k, v in metrics.items()}, scorer.last, "")
    assert line.index("CTC head") < line.index("decoder (greedy)") < line.index("Mask-CTC (3 passes)")
