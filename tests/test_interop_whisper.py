"""Whisper (openai-whisper and Hugging Face) <-> omni's SpeechRecognizer (omni.interop.whisper): the Whisper
front-end equals whisper's log-mel, converted models give the peers' logits and openai-whisper's greedy tokens
(suppress rules included), peer -> omni -> peer is bit-exact, an omni model written back loads in the peer
library with the same logits (key biases dropped and the type embedding folded in, exactly), the CLI converts
both ways with one-line errors, and fine-tuning starts at the peer's loss. Peers are built from their own
configs with O(1) random weights (no download); the vocabulary is Whisper's real one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from _interop import cli_error, o1_weights

from omni.cli import main as omni_main
from omni.export import load_pretrained, save_pretrained
from omni.interop import ConversionError, convert, read_model, to_peer
from omni.interop.whisper import from_hf, from_openai, non_speech_tokens, to_hf, to_openai
from omni.pipelines.transcribe import transcribe_waveforms
from omni.speech import GraphedGreedyDecoder, SpeechLoss, SpeechRecognizer, build_speech_recognizer, greedy_decode
from omni.tokenizers.audio import AudioTokenizer

whisper = pytest.importorskip("whisper")
transformers = pytest.importorskip("transformers")
from whisper.audio import N_FRAMES, N_SAMPLES, log_mel_spectrogram  # noqa: E402
from whisper.model import ModelDimensions, Whisper  # noqa: E402
import whisper.tokenizer as whisper_tokenizer_module  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SMALL = dict(n_mels=80, n_audio_ctx=1500, n_audio_state=64, n_audio_head=4, n_audio_layer=2, n_vocab=51865,
             n_text_ctx=448, n_text_state=64, n_text_head=4, n_text_layer=2)
TINY = dict(SMALL, n_audio_state=384, n_audio_head=6, n_audio_layer=4, n_text_state=384, n_text_head=6,
            n_text_layer=4)  # whisper-tiny's dims
BASE = dict(SMALL, n_audio_state=512, n_audio_head=8, n_audio_layer=6, n_text_state=512, n_text_head=8,
            n_text_layer=6)  # whisper-base's dims


def o1(model: nn.Module, seed: int = 0) -> nn.Module:
    """Weights at O(1) scale (_interop.o1_weights), in eval mode; position tables ~ N(0, 1) (the decoder's is a
    bare Parameter in openai-whisper); the token table is also the LM head's matrix: N(0, 1/d), so that logits are
    O(1) too."""
    return o1_weights(model, seed, embedding_std=lambda table: table.shape[1] ** -0.5 if table.shape[0] > 50000 else 1,
                      named={"positional_embedding": 1.0})


def openai_model(dims: dict, seed: int = 0) -> Whisper:
    return o1(Whisper(ModelDimensions(**dims)), seed)


def hf_model(dims: dict, seed: int = 0) -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    d = dims["n_audio_state"]
    config = WhisperConfig(vocab_size=dims["n_vocab"], num_mel_bins=dims["n_mels"], d_model=d,
                           encoder_layers=dims["n_audio_layer"], decoder_layers=dims["n_text_layer"],
                           encoder_attention_heads=dims["n_audio_head"], decoder_attention_heads=dims["n_text_head"],
                           encoder_ffn_dim=4 * d, decoder_ffn_dim=4 * d, max_source_positions=dims["n_audio_ctx"],
                           max_target_positions=dims["n_text_ctx"])
    return o1(WhisperForConditionalGeneration(config), seed)


def omni_model(export) -> SpeechRecognizer:
    config, sd, toks = export
    model = build_speech_recognizer(config, toks)
    model.load_state_dict(sd, strict=True)
    return model.eval()


def wave(seconds: float, seed: int = 0) -> torch.Tensor:
    """A speech-like test signal: noise under a slow envelope (loud and quiet stretches)."""
    gen = torch.Generator().manual_seed(seed)
    n = int(seconds * 16000)
    t = torch.arange(n) / 16000
    return 0.1 * torch.randn(n, generator=gen) * (1.2 + torch.sin(2 * torch.pi * 1.3 * t))


def whisper_mel(audio: torch.Tensor, n_mels: int = 80) -> torch.Tensor:
    """What whisper.transcribe gives whisper.decode for a clip of at most 30 s."""
    return log_mel_spectrogram(audio, n_mels, padding=N_SAMPLES)[:, :N_FRAMES]


def omni_audio(model: SpeechRecognizer, tok: AudioTokenizer, clips: list[torch.Tensor]):
    tokens = torch.stack([tok.encode(c).tokens for c in clips])
    return tokens, torch.ones(tokens.shape[:2], dtype=torch.bool)


def teacher_text(model: SpeechRecognizer, n: int = 12, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    body = torch.randint(0, 50257, (2, n), generator=gen)
    return torch.cat([torch.tensor([model.prompt] * 2), body], 1)


def report(name: str, diff: float, capsys, scale: torch.Tensor | None = None) -> None:
    size = "" if scale is None else f" (values up to {scale.abs().max().item():.1f})"
    with capsys.disabled():
        print(f"\n{name}: max |diff| {diff:.2e}{size}")


@pytest.fixture(scope="module")
def small():
    """openai-whisper model (SMALL dims, O(1) weights) and its conversion."""
    peer = openai_model(SMALL)
    return peer, from_openai(peer.state_dict(), SMALL)


# ----------------------------------------------------------------------------------------------------
# Front-end


@pytest.mark.parametrize("seconds,n_mels", [(0.4, 80), (7.3, 80), (30.0, 80), (0.0, 80), (11.0, 128)])
def test_log_mel_equals_whispers(seconds, n_mels, capsys):
    audio = wave(seconds) if seconds else torch.zeros(3 * 16000)  # 0.0: three seconds of silence
    tok = AudioTokenizer(n_mels=n_mels, frontend="whisper")
    tokens = tok.encode(audio).tokens
    assert tokens.shape == (1500, 2 * n_mels)
    ours = tokens.reshape(N_FRAMES, n_mels).T  # frame pairs back to (n_mels, 3000)
    diff = (ours - whisper_mel(audio, n_mels)).abs().max().item()
    report(f"log-mel {seconds} s, {n_mels} mels", diff, capsys)
    assert diff <= 1e-4


def test_conv_stem_padded_batch_equals_alone():
    tok = AudioTokenizer(frontend="whisper")
    stem = o1(tok.embedder(32))
    clip = torch.randn(1, 40, 160)
    batch = torch.cat([clip, torch.randn(1, 8, 160)], 1)  # 8 padding tokens of garbage
    mask = torch.arange(48)[None] < 40
    assert torch.equal(stem(batch, mask)[:, :40], stem(clip))
    assert torch.equal(stem(clip, torch.ones(1, 40, dtype=torch.bool)), stem(clip))


# ----------------------------------------------------------------------------------------------------
# Logits


@pytest.mark.parametrize("dims", [SMALL, TINY, BASE, dict(SMALL, n_vocab=51864)], ids=["small", "tiny", "base", "english"])
def test_logits_equal_openai_whisper(dims, capsys):
    peer = openai_model(dims)
    model = omni_model(from_openai(peer.state_dict(), dims))
    tok = AudioTokenizer(frontend="whisper")
    clips = [wave(4.2, 1), wave(17.0, 2)]
    text = teacher_text(model)
    with torch.no_grad():
        expected = peer.logits(text, peer.embed_audio(torch.stack([whisper_mel(c) for c in clips])))
        got = model(*omni_audio(model, tok, clips), text)
    diff = (got - expected).abs().max().item()
    report(f"openai-whisper logits {dims['n_audio_state']}d vocab {dims['n_vocab']}", diff, capsys, expected)
    assert diff <= 1e-4


@pytest.mark.parametrize("dims", [SMALL, TINY, BASE], ids=["64d", "tiny", "base"])
def test_logits_equal_hf(dims, capsys):
    peer = hf_model(dims)
    model = omni_model(from_hf(peer.state_dict(), peer.config.to_dict()))
    tok = AudioTokenizer(frontend="whisper")
    clips = [wave(9.0, 3), wave(0.7, 4)]
    text = teacher_text(model)
    with torch.no_grad():
        expected = peer(input_features=torch.stack([whisper_mel(c) for c in clips]), decoder_input_ids=text).logits
        got = model(*omni_audio(model, tok, clips), text)
    diff = (got - expected).abs().max().item()
    report(f"HF WhisperForConditionalGeneration logits {dims['n_audio_state']}d", diff, capsys, expected)
    assert diff <= 1e-4


# ----------------------------------------------------------------------------------------------------
# Decoding


def test_suppress_sets_equal_whispers(small):
    peer, (config, _, toks) = small
    from whisper.decoding import DecodingOptions, DecodingTask, SuppressBlank, SuppressTokens
    from whisper.tokenizer import get_tokenizer

    assert non_speech_tokens(toks["text"]) == list(get_tokenizer(multilingual=True).non_speech_tokens)
    task = DecodingTask(peer, DecodingOptions(temperature=0, without_timestamps=True, language="en", fp16=False))
    filters = {type(f): f for f in task.logit_filters}
    assert config["decoding"]["suppress_tokens"] == list(filters[SuppressTokens].suppress_tokens)
    blank = filters[SuppressBlank].tokenizer
    assert config["decoding"]["suppress_at_start"] == sorted(blank.encode(" ") + [blank.eot])
    assert config["decoding"]["max_new_tokens"] == task.sample_len == 224
    assert omni_model(small[1]).prompt == list(task.initial_tokens)


@pytest.mark.parametrize("dims", [SMALL, dict(SMALL, n_vocab=51864)], ids=["multilingual", "english"])
def test_greedy_tokens_equal_whisper_decode(dims, capsys):
    peer = openai_model(dims, seed=1)
    tok = AudioTokenizer(frontend="whisper")
    clips = [wave(6.0, 5), wave(21.0, 6)]
    mel = torch.stack([whisper_mel(c) for c in clips])
    options = whisper.DecodingOptions(temperature=0, without_timestamps=True, language="en", fp16=False)
    text_tok = whisper_text(dims)
    # Random weights rarely choose a suppressed token: make eot, " " and a non-speech token outscore the token
    # the model chooses most, so that the rules decide (eot may then end a row after the first token).
    with torch.no_grad():
        first = whisper.decode(peer, mel, options)
        winner = max(set(first[0].tokens), key=first[0].tokens.count)
        table = peer.decoder.token_embedding.weight
        for i, boost in ((text_tok.eos_id, 1.3), (220, 1.4), (non_speech_tokens(text_tok)[5], 1.5)):
            table[i] = boost * table[winner]
    model = omni_model(from_openai(peer.state_dict(), dims))
    with torch.no_grad():
        expected = whisper.decode(peer, mel, options)
        audio, mask = omni_audio(model, tok, clips)
        memory = model.encode(audio, mask)
        got = greedy_decode(model, memory, mask, **dict(model.decoding.guards))
        # the fixed-shape step a CUDA graph replays (run eagerly here) applies the same rules
        stepped = GraphedGreedyDecoder(model, **dict(model.decoding.guards), graph=False)(memory, mask)
        rules, model.logit_filters = model.logit_filters, nn.ModuleList()
        unruled = greedy_decode(model, memory, mask, **dict(model.decoding.guards))
        model.logit_filters = rules
    report(f"greedy tokens vocab {dims['n_vocab']}: lengths {[len(r) for r in got]}, identical "
           f"{[g == r.tokens for g, r in zip(got, expected)]}", 0.0, capsys)
    assert got == [r.tokens for r in expected]
    assert unruled != got  # the suppress rules were exercised
    assert stepped == got
    # omni's own transcription path (pad_audio pads 1500 tokens to 1504: the stem and masks keep it exact)
    texts = transcribe_waveforms(model, tok, text_tok, clips)
    assert texts == [text_tok.decode(r.tokens).strip() for r in expected]  # whisper's .text keeps specials


def whisper_text(dims: dict):
    from omni.interop.whisper import text_tokenizer

    return text_tokenizer(dims["n_vocab"])


# ----------------------------------------------------------------------------------------------------
# Round trips


def test_peer_omni_peer_bit_exact(small):
    peer, export = small
    dims, sd = to_openai(*export)
    expected = peer.state_dict()
    assert dims == SMALL and set(sd) == set(expected)
    assert all(torch.equal(sd[k], expected[k]) and sd[k].dtype == expected[k].dtype for k in sd)
    hf = hf_model(SMALL, seed=2)
    hf_config, hf_sd = to_hf(*from_hf(hf.state_dict(), hf.config.to_dict()))
    expected = hf.state_dict()
    assert set(hf_sd) == set(expected)
    assert all(torch.equal(hf_sd[k], expected[k]) for k in hf_sd)
    assert hf_config["d_model"] == 64 and hf_config["vocab_size"] == 51865


def perturbed(export):
    """The converted model after 'fine-tuning': non-zero key biases (self and cross) and text type embedding."""
    model = omni_model(export)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("attn.qkv.bias"):
                d = p.shape[0] // 3
                p[d:2 * d] = 0.1 * torch.randn(d, generator=gen)
            elif name.endswith("cross.kv.bias"):
                p[:p.shape[0] // 2] = 0.1 * torch.randn(p.shape[0] // 2, generator=gen)
            elif name == "text_embed.type_embedding.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


def test_omni_to_peers_load_with_same_logits(small, tmp_path, capsys):
    config, _, toks = small[1]
    model = perturbed(small[1])
    export = save_pretrained(model, tmp_path / "export", config, tokenizers=toks)
    clips = [wave(5.0, 8)]
    text = teacher_text(model)[:1]
    with torch.no_grad():
        ours = model(*omni_audio(model, toks["audio"], clips), text)
        mel = torch.stack([whisper_mel(c) for c in clips])
        pt = to_peer(export, tmp_path / "whisper.pt", "openai-whisper")
        peer = whisper.load_model(str(pt), device="cpu")
        openai_logits = peer.logits(text, peer.embed_audio(mel))
        from transformers import WhisperForConditionalGeneration

        hf = WhisperForConditionalGeneration.from_pretrained(to_peer(export, tmp_path / "hf", "hf")).eval()
        hf_logits = hf(input_features=mel, decoder_input_ids=text).logits
    for name, theirs in (("openai-whisper (whisper.load_model)", openai_logits),
                         ("HF (from_pretrained)", hf_logits)):
        diff = (ours - theirs).abs().max().item()
        report(f"omni -> {name}, key biases dropped, type embedding folded", diff, capsys, theirs)
        assert diff <= 1e-5


# ----------------------------------------------------------------------------------------------------
# CLI


def test_cli_both_ways(small, tmp_path, capsys):
    peer, _ = small
    torch.save({"dims": SMALL, "model_state_dict": peer.state_dict()}, tmp_path / "small.pt")
    assert omni_main(["convert", str(tmp_path / "small.pt"), str(tmp_path / "omni")]) == 0
    assert omni_main(["convert", "--to", "hf", str(tmp_path / "omni"), str(tmp_path / "hf")]) == 0
    assert omni_main(["convert", str(tmp_path / "hf"), str(tmp_path / "omni2")]) == 0
    assert omni_main(["convert", "--to", "openai-whisper", str(tmp_path / "omni2"), str(tmp_path / "back.pt")]) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back["dims"] == SMALL
    assert all(torch.equal(v, peer.state_dict()[k]) for k, v in back["model_state_dict"].items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "whisper"
    model = load_pretrained(tmp_path / "omni2")
    assert isinstance(model, SpeechRecognizer) and model.prompt == [50258, 50259, 50359, 50363]
    # --language / --task choose the prompt omni transcribe uses (ids as openai-whisper's tokenizer has them)
    assert omni_main(["convert", str(tmp_path / "small.pt"), str(tmp_path / "de"), "--language", "de",
                      "--task", "translate"]) == 0
    reference = whisper_tokenizer_module.get_tokenizer(True, language="de", task="translate")
    assert load_pretrained(tmp_path / "de").prompt == [*reference.sot_sequence, reference.no_timestamps]


def test_cli_errors_are_one_line(small, tmp_path, capsys):
    peer, export = small
    sd = peer.state_dict()
    torch.save({"model_state_dict": sd}, tmp_path / "nodims.pt")
    assert "not an openai-whisper checkpoint: no 'dims'" in cli_error(
        ["convert", str(tmp_path / "nodims.pt"), str(tmp_path / "a")], capsys)
    bad = dict(sd, **{"decoder.blocks.1.mlp.0.weight": torch.zeros(8, 64)})
    torch.save({"dims": SMALL, "model_state_dict": bad}, tmp_path / "bad.pt")
    assert "decoder.blocks.1.mlp.0.weight: shape (8, 64)" in cli_error(
        ["convert", str(tmp_path / "bad.pt"), str(tmp_path / "b")], capsys)
    hf = hf_model(SMALL)
    hf.save_pretrained(tmp_path / "hf")
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(settings, activation_function="relu")))
    assert "activation_function 'relu'" in cli_error(["convert", str(tmp_path / "hf"), str(tmp_path / "c")], capsys)
    bad_hf = {k: v for k, v in hf.state_dict().items() if k != "model.encoder.layers.0.fc2.bias"}
    with pytest.raises(ConversionError, match="missing model.encoder.layers.0.fc2.bias"):
        from_hf(bad_hf, hf.config.to_dict())
    # an omni model Whisper cannot express: the default front-end
    config, sd_omni, toks = export
    plain = save_pretrained(omni_model(export), tmp_path / "plain", dict(config, ctc=False),
                            tokenizers={**toks, "audio": AudioTokenizer()})
    assert "front-end" in cli_error(["convert", "--to", "openai-whisper", str(plain), str(tmp_path / "d.pt")], capsys)
    torch.save({"dims": SMALL, "model_state_dict": sd}, tmp_path / "small.pt")
    assert "language 'xx' is not one of this model's language tokens" in cli_error(
        ["convert", str(tmp_path / "small.pt"), str(tmp_path / "e"), "--language", "xx"], capsys)
    english = dict(SMALL, n_vocab=51864)
    torch.save({"dims": english, "model_state_dict": openai_model(english).state_dict()}, tmp_path / "en.pt")
    assert "an English-only Whisper has no language or task tokens" in cli_error(
        ["convert", str(tmp_path / "en.pt"), str(tmp_path / "f"), "--language", "de"], capsys)


# ----------------------------------------------------------------------------------------------------
# Fine-tuning


def test_fine_tuning_starts_at_the_peers_loss(small, capsys):
    peer, export = small
    model = omni_model(export).train()
    tok = AudioTokenizer(frontend="whisper")
    clips = [wave(3.0, 9), wave(8.0, 10)]
    text = teacher_text(model, n=10, seed=3)
    targets = torch.cat([text[:, 1:], torch.full((2, 1), model.eos_id)], 1)
    targets[:, :len(model.prompt) - 1] = -100  # the prompt is given
    audio, mask = omni_audio(model, tok, clips)
    batch = type("Batch", (), dict(audio=audio, audio_mask=mask, text=text, targets=targets))()
    with torch.no_grad():
        logits = peer.logits(text, peer.embed_audio(torch.stack([whisper_mel(c) for c in clips])))
    keep = targets != -100
    expected = nn.functional.cross_entropy(logits[keep], targets[keep]).item()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(4):
        loss, _ = SpeechLoss()(model, batch)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    report(f"fine-tuning: first loss {losses[0]:.4f} vs openai-whisper {expected:.4f}; losses {losses}",
           abs(losses[0] - expected), capsys)
    assert abs(losses[0] - expected) <= 1e-4 and losses[-1] < losses[0]


def test_read_model_and_convert_hf_directory(tmp_path):
    hf = hf_model(SMALL, seed=4)
    hf.save_pretrained(tmp_path / "hf")
    config, sd, toks = read_model(tmp_path / "hf")
    assert config["source"]["format"] == "transformers:whisper" and toks["audio"].frontend == "whisper"
    out = convert(tmp_path / "hf", tmp_path / "omni")
    assert isinstance(load_pretrained(out), SpeechRecognizer)
    assert Path(out, "config.json").is_file()
