"""recipes/whisper.py fine-tunes a model given as --set init= on LibriSpeech-layout shards: the init's own
tokenizers (Whisper's vocabulary), architecture and decoder prompt; the loss on the text after the prompt only;
its first step's loss is the init model's own loss on that batch, and a few steps lower it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from omni.data.builders_speech import build_librispeech
from omni.export import load_pretrained, save_pretrained
from omni.pipelines.transcribe import load_recognizer, transcribe_files
from omni.speech import SpeechRecognizer, error_rates
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import IGNORE_INDEX
from omni.trunk import preset
from tests._librispeech import transcript, write_tree

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("whisper", reason="Whisper's vocabulary ships in openai-whisper (pip install -e '.[interop]')")


def load_recipe():
    spec = importlib.util.spec_from_file_location("whisper_recipe_finetune", ROOT / "recipes" / "whisper.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def whisper_text():
    from omni.tokenizers.ranks import whisper_tokenizer

    return whisper_tokenizer()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """8 train utterances (train-clean-5) and 2 test ones (dev-clean-2), upper-case transcripts; the tree is
    ``shards/../LibriSpeech``."""
    tmp = tmp_path_factory.mktemp("libri")
    write_tree(tmp / "LibriSpeech", {"train-clean-5": (19, 26)}, utterances=4)
    write_tree(tmp / "LibriSpeech", {"dev-clean-2": (84,)}, utterances=2)
    build_librispeech(tmp / "shards", src=tmp / "LibriSpeech", quiet=True,
                      rename={"train-clean-5": "train", "dev-clean-2": "test"})
    return tmp / "shards"


@pytest.fixture(scope="module")
def omni_init(tmp_path_factory, whisper_text) -> Path:
    """An omni speech export with Whisper's text tokenizer and no CTC head (as a converted Whisper has none)."""
    audio = AudioTokenizer(max_seconds=30.0)
    torch.manual_seed(1)
    model = SpeechRecognizer(audio, whisper_text, preset("tiny"), preset("tiny", cross_attention=True))
    out = tmp_path_factory.mktemp("init") / "export"
    config = {"builder": "omni.speech:build_speech_recognizer", "encoder": preset("tiny").to_dict(),
              "decoder": preset("tiny", cross_attention=True).to_dict(), "ctc": False, "audio_positions": "none"}
    save_pretrained(model, out, config, tokenizers={"audio": audio, "text": whisper_text})
    return out


def fine_tune(recipe, monkeypatch, shards: Path, init: Path, out: Path, *extra: str):
    """Run the recipe's tiny preset from ``init`` for 4 steps; -> (metrics, [(loss, batch) of every step])."""
    seen: list = []

    class Recorded(recipe.SpeechLoss):
        def __call__(self, model, batch):
            loss, metrics = super().__call__(model, batch)
            seen.append((loss.item(), batch))
            return loss, metrics

    monkeypatch.setattr(recipe, "SpeechLoss", Recorded)
    metrics = recipe.main(["--preset", "tiny", "--data", str(shards), "--out", str(out), "--set", f"init='{init}'",
                           "steps=4", "batch_size=4", "lr=3e-3", "warmup_steps=0", "eval_batch_size=2",
                           "max_new_tokens=6", "progress=False", "log_every=1", *extra])
    return metrics, seen


def init_loss(model, batch) -> float:
    with torch.no_grad():
        logits = model(batch.audio, batch.audio_mask, batch.text)
    keep = batch.targets != IGNORE_INDEX
    return F.cross_entropy(logits[keep].float(), batch.targets[keep]).item()


def test_finetune_an_omni_export_with_whisper_tokens(shards, omni_init, whisper_text, tmp_path, monkeypatch):
    recipe = load_recipe()
    metrics, seen = fine_tune(recipe, monkeypatch, shards, omni_init, tmp_path / "run", "text_case='sentence'")
    assert len(seen) == 4
    first = seen[0][1]
    # the prompt is the init's ([<|startoftranscript|>, <|transcribe|>]) and is never a target
    prompt = [whisper_text.token_id("<|startoftranscript|>"), whisper_text.token_id("<|transcribe|>")]
    assert (first.text[:, :2] == torch.tensor(prompt)).all() and (first.targets[:, 0] == IGNORE_INDEX).all()
    assert (first.targets[:, 1] == first.text[:, 2]).all()  # the prompt's last token predicts the first word
    said = [whisper_text.decode(row) for row in first.text]
    assert all(s[0].isupper() and s[1:] == s[1:].lower() for s in said), said  # text_case='sentence'
    assert first.ctc_labels is None  # the init has no CTC head, so none is trained
    before = load_pretrained(omni_init)
    assert seen[0][0] == pytest.approx(init_loss(before, first), rel=1e-5)
    after = load_pretrained(tmp_path / "run" / "final")
    assert init_loss(after, first) < init_loss(before, first) - 0.1
    # the export is the init's model: Whisper's vocabulary, no CTC head, loadable by omni transcribe
    model, audio, text = load_recognizer(tmp_path / "run" / "final", device="cpu")
    assert text.vocab_size == 51865 and model.ctc_head is None and model.prompt == prompt
    assert {"eval/wer", "eval/cer", "eval/loss"} <= set(metrics) and "eval/ctc_cer" not in metrics
    assert metrics["eval/words"] == sum(len(transcript(84, u).split()) for u in (0, 1))  # the 2 test clips


def test_finetune_refusals(shards, omni_init, tmp_path, monkeypatch, capsys):
    recipe = load_recipe()
    with pytest.raises(ValueError, match=r"preset 'finetune' fine-tunes a model: --set init=PATH"):
        recipe.main(["--preset", "finetune", "--data", str(shards), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit):
        recipe.parse_args(["--preset", "tiny", "--set", f"init='{omni_init}'", "bpe_vocab=300"])
    assert "bpe_vocab fits a new tokenizer, init brings its own" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"no split 'train-clean-100' to train on \(splits: test, train\): set train_split="):
        recipe.main(["--preset", "tiny", "--data", str(shards), "--out", str(tmp_path / "x"), "--set",
                     "train_split='train-clean-100'"])
    with pytest.raises(ValueError, match=r"^init.*nowhere does not exist$"):
        recipe.main(["--preset", "tiny", "--data", str(shards), "--out", str(tmp_path / "x"), "--set",
                     f"init='{tmp_path / 'nowhere'}'"])
    with pytest.raises(ValueError, match=r"no split 'dev' to evaluate on"):
        recipe.main(["--preset", "tiny", "--data", str(shards), "--out", str(tmp_path / "x"), "--set",
                     "eval_split='dev'"])


# ----------------------------------------------------------------------------------------------------
# A Hugging Face Whisper (tiny, random weights, Whisper's real 51,865-token vocabulary) as init


@pytest.fixture(scope="module")
def hf_whisper(tmp_path_factory) -> Path:
    """A random tiny HF WhisperForConditionalGeneration saved as a hub directory (no download)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.WhisperConfig(vocab_size=51865, num_mel_bins=80, d_model=64, encoder_layers=2,
                                        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                        encoder_ffn_dim=256, decoder_ffn_dim=256, max_source_positions=1500,
                                        max_target_positions=448)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("hf") / "whisper-tiny-random"
    transformers.WhisperForConditionalGeneration(config).save_pretrained(out)
    return out


def hf_features(tree: Path, keys: list[str]) -> torch.Tensor:
    """HF's own front end (WhisperFeatureExtractor: 30 s padded log-mel) of the clips named by ``keys``."""
    import soundfile as sf
    from transformers import WhisperFeatureExtractor

    waves = [sf.read(next(tree.rglob(f"{key}.flac")), dtype="float32")[0] for key in keys]
    return WhisperFeatureExtractor()(waves, sampling_rate=16000, return_tensors="pt").input_features


def test_finetune_a_hugging_face_whisper(shards, hf_whisper, whisper_text, tmp_path, monkeypatch):
    from transformers import WhisperForConditionalGeneration

    recipe = load_recipe()
    metrics, seen = fine_tune(recipe, monkeypatch, shards, hf_whisper, tmp_path / "run", "text_case='lower'")
    first = seen[0][1]
    # Whisper's prompt, from the converted config; the loss starts after it
    prompt = [whisper_text.token_id(t) for t in ("<|startoftranscript|>", "<|en|>", "<|transcribe|>",
                                                   "<|notimestamps|>")]
    assert (first.text[:, :4] == torch.tensor(prompt)).all()
    assert (first.targets[:, :3] == IGNORE_INDEX).all() and (first.targets[:, 3] == first.text[:, 4]).all()
    assert first.audio.shape[1:] == (1500, 160) and bool(first.audio_mask.all())  # every clip 30 s, no padding
    said = [whisper_text.decode(row) for row in first.text]
    assert all(s == s.lower() and s.split()[0].isalpha() for s in said), said  # text_case='lower'
    # the first step's loss is HF's loss of the same batch: same weights, features and tokens
    peer = WhisperForConditionalGeneration.from_pretrained(hf_whisper).eval()
    features = first.audio.reshape(len(first.keys), 3000, 80).transpose(1, 2)  # frame pairs -> HF's (B, 80, 3000)
    with torch.no_grad():
        hf_loss = peer(input_features=features, decoder_input_ids=first.text, labels=first.targets).loss.item()
        # ... and of HF's whole pipeline: its feature extractor on the raw FLACs
        theirs = hf_features(shards.parent / "LibriSpeech", first.keys)
        piped = peer(input_features=theirs, decoder_input_ids=first.text, labels=first.targets).loss.item()
    assert (features - theirs).abs().max() < 1e-4  # measured: 3.1e-6
    assert abs(seen[0][0] - hf_loss) < 1e-5 * hf_loss, (seen[0][0], hf_loss)  # measured: 0
    assert abs(seen[0][0] - piped) < 1e-5 * piped, (seen[0][0], piped)  # measured: 0
    # a few steps lower it, on that same batch
    after = load_pretrained(tmp_path / "run" / "final")
    assert init_loss(after, first) < seen[0][0] - 0.1
    # the tuned export is a Whisper again: its prompt and rules, and HF reads it back (omni convert --to hf)
    model, _, text = load_recognizer(tmp_path / "run" / "final", device="cpu")
    assert model.prompt == prompt and text.vocab_size == 51865 and model.ctc_head is None
    assert model.decoding.suppress_tokens and {"eval/wer", "eval/cer"} <= set(metrics)
    # the recipe's WER / CER are those of `omni transcribe` on the test FLACs: the same decoding
    tree = shards.parent / "LibriSpeech" / "dev-clean-2"
    flacs = sorted(tree.rglob("*.flac"))
    heard = transcribe_files(tmp_path / "run" / "final", flacs, device="cpu", max_new_tokens=6)
    refs = [transcript(84, int(f.stem.split("-")[-1])) for f in flacs]
    rates = error_rates(refs, heard)
    assert (rates["wer"], rates["cer"]) == pytest.approx((metrics["eval/wer"], metrics["eval/cer"]), abs=1e-12)
    from omni.interop import to_peer

    back = WhisperForConditionalGeneration.from_pretrained(to_peer(tmp_path / "run" / "final", tmp_path / "hf", "hf"))
    with torch.no_grad():
        tuned = back(input_features=features, decoder_input_ids=first.text, labels=first.targets).loss.item()
    assert tuned == pytest.approx(init_loss(after, first), rel=1e-4)


def test_ctc_head_added_to_an_init_without_one(omni_init):
    """ctc_weight > 0 with an init that has no CTC head: a new head; every other weight is the init's."""
    recipe = load_recipe()
    model, export, tokenizers = recipe.from_init({"init": str(omni_init), "ctc_weight": 0.3, "seed": 0})
    assert model.ctc_head is not None and export["ctc"] is True and set(tokenizers) == {"audio", "text"}
    plain = load_pretrained(omni_init).state_dict()
    tuned = model.state_dict()
    assert set(tuned) - set(plain) == {"ctc_head.weight", "ctc_head.bias"}
    assert all(torch.equal(plain[k], tuned[k]) for k in plain)
    same, _, _ = recipe.from_init({"init": str(omni_init), "ctc_weight": None, "seed": 0})
    assert same.ctc_head is None


def test_every_whisper_source_gives_one_model(hf_whisper, tmp_path):
    """init= an HF directory, its omni export (omni convert) or its openai-whisper .pt: the same model, prompt and
    tokenizers (the recipe then trains them alike)."""
    from omni.interop import convert, to_peer

    recipe = load_recipe()
    export = convert(hf_whisper, tmp_path / "export")
    pt = to_peer(export, tmp_path / "openai" / "tiny.pt", "openai-whisper")
    models = [recipe.from_init({"init": str(src), "ctc_weight": None, "seed": 0}) for src in (hf_whisper, export, pt)]
    (first, config, toks), *others = models
    for model, other_config, other_toks in others:
        assert model.prompt == first.prompt and other_config["decoding"] == config["decoding"]
        assert other_toks["audio"].config() == toks["audio"].config() and other_toks["text"].vocab_size == 51865
        own = first.state_dict()
        assert all(torch.equal(own[k], v) for k, v in model.state_dict().items())
