"""Hybrid CTC/attention training of the speech recogniser: byte CTC labels, the joint loss against a per-row
reference, export round trip of the CTC head, and that CTC makes the encoder learn an alignment."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni.export import save_pretrained
from omni.pipelines.transcribe import load_recognizer
from omni.speech import (CTC_BLANK, SpeechCollate, SpeechLoss, SpeechRecognizer, ctc_greedy_decode, ctc_labels,
                         speech_example)
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import IGNORE_INDEX, TextTokenizer
from omni.trunk import preset

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SR = 16000
TEXTS = ["The cat sat down.", "Where is my hat?", "A red ball."]


@pytest.fixture(scope="module")
def toks():
    return AudioTokenizer(), TextTokenizer()


def ctc_model(audio: AudioTokenizer, text: TextTokenizer, seed: int = 0) -> SpeechRecognizer:
    torch.manual_seed(seed)
    return SpeechRecognizer(audio, text, preset("tiny"), preset("tiny", cross_attention=True), ctc=True)


def noise_batch(audio: AudioTokenizer, text: TextTokenizer, seconds=(0.6, 1.2, 0.9)):
    g = torch.Generator().manual_seed(0)
    items = [speech_example(audio, text, torch.randn(int(SR * s), generator=g) * 0.1, t, key=str(i))
             for i, (s, t) in enumerate(zip(seconds, TEXTS))]
    return SpeechCollate(text.pad_id)(items)


def test_ctc_labels_are_normalised_transcript_bytes(toks):
    audio, text = toks
    assert bytes(ctc_labels("Où est-il? Don't!").tolist()) == "où est il don't".encode()
    batch = noise_batch(audio, text)
    want = ["the cat sat down", "where is my hat", "a red ball"]
    assert batch.ctc_lengths.tolist() == [len(w) for w in want]
    for row, w in enumerate(want):
        assert bytes(batch.ctc_labels[row, :len(w)].tolist()).decode() == w
        assert (batch.ctc_labels[row, len(w):] == 0).all()
    moved = batch.to("cpu")
    assert torch.equal(moved.ctc_labels, batch.ctc_labels) and torch.equal(moved.ctc_lengths, batch.ctc_lengths)


def test_joint_loss_matches_per_row_reference(toks):
    audio, text = toks
    model = ctc_model(audio, text)
    batch = noise_batch(audio, text)
    loss, metrics = SpeechLoss(ctc_weight=0.3)(model, batch)
    logits, ctc_logits = model(batch.audio, batch.audio_mask, batch.text, ctc=True)
    keep = batch.targets != IGNORE_INDEX
    ce = F.cross_entropy(logits[keep], batch.targets[keep])
    assert ctc_logits.shape[-1] == CTC_BLANK + 1
    per_row = []
    for row, transcript in enumerate(TEXTS):  # one row at a time, unpadded: no masks involved
        n = int(batch.audio_mask[row].sum())
        ids = ctc_labels(transcript)[None]
        lp = ctc_logits[row, :n].log_softmax(-1)[:, None]  # (S, 1, 257)
        nll = F.ctc_loss(lp, ids, torch.tensor([n]), torch.tensor([ids.shape[1]]), blank=CTC_BLANK,
                         reduction="sum")
        per_row.append(nll / ids.shape[1])
    ctc = torch.stack(per_row).mean()
    torch.testing.assert_close(metrics["ctc_loss"], ctc.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, 0.7 * ce + 0.3 * ctc, rtol=1e-5, atol=1e-5)
    # without CTC the loss is the decoder's cross-entropy alone, on the same model
    plain, plain_metrics = SpeechLoss()(model, batch)
    torch.testing.assert_close(plain, ce, rtol=1e-6, atol=1e-6)
    assert "ctc_loss" not in plain_metrics


def test_ctc_needs_a_head(toks):
    audio, text = toks
    torch.manual_seed(0)
    model = SpeechRecognizer(audio, text, preset("tiny"), preset("tiny", cross_attention=True))
    assert model.ctc_head is None
    with pytest.raises(ValueError, match="no CTC head"):
        SpeechLoss(ctc_weight=0.5)(model, noise_batch(audio, text))
    unlabelled = noise_batch(audio, text)
    unlabelled.ctc_labels = None
    with pytest.raises(ValueError, match="needs CTC labels"):
        SpeechLoss(ctc_weight=0.5)(ctc_model(audio, text), unlabelled)


def test_ctc_head_survives_export(toks, tmp_path):
    audio, text = toks
    model = ctc_model(audio, text).eval()
    batch = noise_batch(audio, text)
    path = save_pretrained(model, tmp_path / "final",
                           {"builder": "omni.speech:build_speech_recognizer", "encoder": preset("tiny").to_dict(),
                            "decoder": preset("tiny", cross_attention=True).to_dict(), "ctc": True},
                           tokenizers={"audio": audio, "text": text})
    loaded, _, _ = load_recognizer(path, device="cpu")
    assert loaded.ctc_head is not None
    with torch.no_grad():
        want = model(batch.audio, batch.audio_mask, batch.text, ctc=True)
        got = loaded(batch.audio, batch.audio_mask, batch.text, ctc=True)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)


def test_ctc_alone_learns_to_align(toks):
    """Two clips of different lengths with tones where their words are: trained on the CTC loss only, the
    encoder's greedy CTC path (blanks and repeats removed) reads back each transcript."""
    audio, text = toks
    model = ctc_model(audio, text)
    t = torch.arange(int(SR * 1.5)) / SR
    clips = [torch.sin(2 * torch.pi * 440 * t) * (t < 0.7) * 0.3, torch.sin(2 * torch.pi * 880 * t) * 0.3]
    items = [speech_example(audio, text, c, s, key=str(i)) for i, (c, s) in enumerate(zip(clips, ["ab", "cd"]))]
    batch = SpeechCollate(text.pad_id)(items)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    loss_fn = SpeechLoss(ctc_weight=1.0)
    first = None
    for _ in range(150):
        loss, metrics = loss_fn(model, batch)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        _, ctc_logits = model(batch.audio, batch.audio_mask, batch.text, ctc=True)
    assert ctc_greedy_decode(ctc_logits, batch.audio_mask) == ["ab", "cd"]
    assert metrics["ctc_loss"].item() < first / 50


def test_sinusoidal_audio_positions(toks, tmp_path):
    """Whisper's absolute positions on the audio embeddings: the table, its effect, the export round trip."""
    from omni.speech import sinusoid

    table = sinusoid(5, 8)
    assert table.shape == (5, 8)
    torch.testing.assert_close(table[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    torch.testing.assert_close(table[3, 0], torch.tensor(3.0).sin())  # timescale 1 on the first channel
    torch.testing.assert_close(table[3, 3], torch.tensor(3e-4).sin())  # 10,000 on the last sin channel
    audio, text = toks
    batch = noise_batch(audio, text)
    torch.manual_seed(0)
    with_pos = SpeechRecognizer(audio, text, preset("tiny"), preset("tiny", cross_attention=True),
                                audio_positions="sinusoidal").eval()
    torch.manual_seed(0)
    plain = SpeechRecognizer(audio, text, preset("tiny"), preset("tiny", cross_attention=True)).eval()
    with torch.no_grad():
        a, b = with_pos.encode(batch.audio, batch.audio_mask), plain.encode(batch.audio, batch.audio_mask)
    assert (a - b).abs().max() > 1e-3  # same weights, the positions change the encoding
    path = save_pretrained(with_pos, tmp_path / "final",
                           {"builder": "omni.speech:build_speech_recognizer", "encoder": preset("tiny").to_dict(),
                            "decoder": preset("tiny", cross_attention=True).to_dict(),
                            "audio_positions": "sinusoidal"}, tokenizers={"audio": audio, "text": text})
    loaded, _, _ = load_recognizer(path, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode(batch.audio, batch.audio_mask), a)
    with pytest.raises(ValueError, match="audio_positions"):
        SpeechRecognizer(audio, text, preset("tiny"), preset("tiny", cross_attention=True), audio_positions="rope")
