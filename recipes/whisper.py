"""Whisper-style speech recognition on the shared trunk: log-mel audio tokens -> bidirectional encoder;
BPE text -> causal decoder with cross-attention -> tied LM head. Model, decoding and metrics: omni/speech.py.

    python recipes/whisper.py                          # eSpeak NG speech (built if missing); base on CUDA, else cpu
                                                       # (< 10 min on 2 cores, CTC head ~15% CER; runs/whisper-cpu)
    python recipes/whisper.py --preset tiny            # CPU smoke run (for the tests: it learns nothing)
    python recipes/whisper.py --preset tiny --set "text=['corpus.txt']"   # your own text instead of Austen's
    python recipes/whisper.py --preset base --data shards/librispeech --set steps=100000
    accelerate launch --num_processes 8 recipes/whisper.py --preset base --data ...
    python recipes/whisper.py --preset finetune --data shards/librispeech --set init=whisper-small \
        --set text_case=sentence                        # fine-tune a Whisper checkpoint (HF dir / openai .pt)

--data takes a dataset directory written by `omni data speech-synth` or `omni data librispeech` (webdataset
shards of <key>.flac|wav + <key>.txt + manifest.json). --set key=value overrides any config entry. Without
--data the recipe synthesises its dataset (needs `pip install -e ".[speech]"`) from the sentences of `text`:
Jane Austen's novels (`apt-get install r-cran-janeaustenr`) unless you give your own files or folders.

Text tokenizer: the shipped byte-level BPE `tokenizers/bpe-8k` by default (fitted on the same public-domain
Austen novels the synthetic speech reads, so it covers the transcripts; no fitting step, identical on every
rank). `--set bpe_vocab=N` instead fits an N-token BPE on the training transcripts, saved under
<out>/tokenizers/text (use it for other languages or domains). Either way the tokenizer is exported with the
model, so `omni transcribe --checkpoint <out>/final file.wav` needs nothing else.

Each evaluation (and the one at the end) transcribes the test split greedily and logs corpus WER / CER
(omni.speech.normalize_text), with a CTC head also the head's best-path CER, and writes every decoded clip to
<out>/samples/step_<N>.tsv (key, reference, CTC hypothesis, decoder hypothesis). The final ones are printed (the
CER `report` names first) with what trivial transcribers score on the same clips (an empty transcript: 100%; one
training sentence said every time) and written to <out>/eval.json with the time split (data build, evaluation). The model trains on
`train_split` ("train") and is scored on `eval_split` (default "test", else the first other split).

Fine-tuning: --set init=PATH starts from a model: an omni speech export (a run's <out>/final, `omni convert`'s
output) or a Whisper checkpoint that omni.interop converts (a Hugging Face whisper directory, an openai-whisper
.pt). Its tokenizers (Whisper's 51,865-token vocabulary and log-mel front end), its architecture and its decoder
prompt (Whisper's [<|startoftranscript|>, <|en|>, <|transcribe|>, <|notimestamps|>]) replace this config's
trunk, trunk_overrides, audio_positions, max_seconds and tokenizer. Every transcript is trained as prompt + text +
<|endoftext|>, the loss on the text and <|endoftext|> only; evaluation decodes as `omni transcribe` does
(omni.speech.transcribe_batch: the same prompt, stop rules and logit rules). A CTC head is kept when the init
has one (ctc_weight None: 0.3 then, a Whisper has none: 0); ctc_weight > 0 adds a new one. The `finetune` preset
holds Whisper-style fine-tuning settings (lr 1e-5, batch 16).

text_case: how transcripts are trained. LibriSpeech's are upper case, unlike anything Whisper was trained on:
"sentence" (lower case, first letter capitalised: close to Whisper's own style) or "lower" keep the first loss
near the pretrained model's; "keep" trains them as written. WER / CER ignore case either way.
"""

from __future__ import annotations

import sys

from omni.scripts import without_script_folder

sys.path[:] = without_script_folder(sys.path, __file__)  # first: recipes/whisper.py must not hide openai-whisper

import hashlib
import json
import math
import time
from functools import partial
from pathlib import Path

import torch
from rapidfuzz.distance import Levenshtein
from rapidfuzz.process import cdist

from omni.asr_text import normalize_text
from omni.config import POSITIVE, Check, Key, SetsTrunk, at_least, check_attention, keywords_of, one_of
from omni.recipe_runtime import check_corpus, rank_zero_first, recipe_config, recipe_parser, run_recipe, train_config
from omni.data.builders_speech import build_speech_synth, load_paragraphs
from omni.data.speech import extract_sentences
from omni.data.clips import AUDIO_FIELDS, DecodeClip
from omni.export import get_builder
from omni.files import write_atomic
from omni.init import SPEECH_BUILDER, load_init, read_init
from omni.data.reader import ShardLoader
from omni.data.remote import dataset_source
from omni.data.shards import read_manifest
from omni.deps import require
from omni.mask_ctc import mask_ctc_decode
from omni.speech import (MASK_TOKEN, SpeechCollate, SpeechLoss, SpeechRecognizer, ctc_greedy_decode, ctc_labels,
                         decode_batch, error_counts, masked_lm_text, transcribe_batch)
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import IGNORE_INDEX, TextTokenizer
from omni.train import Trainer, process_state, unwrap
from omni.trunk import TrunkConfig, preset

# ---------------------------------------------------------------------------------------------------
# Config. Every entry can be overridden with --set key=value.

COMMON = dict(
    data="data/speech-synth", out="runs/whisper",
    build=Key(dict(train=20000, test=500), (dict, None), keywords_of(build_speech_synth),
              help="build_speech_synth arguments for `data` when it is missing (None: never build)"),
    text=None,  # the corpus the synthetic speech reads (build only)
    trunk="whisper-base", trunk_overrides={},
    bpe_vocab=Key(None, (int, None), at_least(256), "None: the shipped tokenizers/bpe-8k; N: fit an N-token BPE "
                                                    "on the training transcripts"),
    max_seconds=Key(30.0, check=POSITIVE, help="longest clip (longer ones are dropped)"),
    ctc_weight=Key(None, (float, None), at_least(0), "hybrid CTC/attention: weight of the encoder's CTC loss (0: "
                   "decoder loss only, no CTC head; None: 0.3, with init 0.3 when the init has a CTC head, else 0)"),
    mask_weight=Key(0.0, float, Check(lambda v: 0 <= v < 1, "in [0, 1)"),
                    "Mask-CTC: weight of the decoder's masked-LM loss beside next-token prediction (0: off); needs "
                    "the CTC head (its text is what the masked LM edits: `omni transcribe --decode mask-ctc`)"),
    audio_positions=Key("none", check=one_of("none", "sinusoidal"),
                        help="'sinusoidal': Whisper's absolute positions added to the audio embeddings"),
    encoder_attention=Key(None, (dict, None), help="the encoder's attention patterns (TrunkConfig.attention, e.g. "
                          "{'pattern': {'kind': 'window', 'before': 64, 'after': 64}}; None: trunk_overrides'); a "
                          "local encoder reads a long recording in one pass (`omni transcribe --long-form one-pass`)"),
    audio_stride=Key(2, int, at_least(1), "one audio token every N 10-ms mel frames (2: 50 Hz, Whisper's rate; 3: "
                     "33 Hz, a third fewer encoder tokens); an init brings its own"),
    report=Key("decoder", check=one_of("decoder", "ctc"),
               help="which CER the result line gives first: the decoder's or the CTC head's (both are measured)"),
    batch_size=64, steps=6000, lr=1e-3, min_lr_ratio=0.02, warmup_steps=500, weight_decay=0.05, clip_norm=1.0,
    optimizer="adamw",
    workers=8, compile=False, eval_every=1000, checkpoint_every=1000,
    limit_eval=Key(None, help="greedy-decode (for WER / CER) only the first N samples of each evaluation"),
    eval_batch_size=64, max_new_tokens=Key(224, check=at_least(1), help="longest decoded transcript (tokens)"),
    seed=0, progress=True, log_every=10, max_corrupt_fraction=0.01, resume="auto",
    init=Key(None, (str, None), help="start from this model: an omni speech export or a Whisper checkpoint (HF "
                                     "directory / openai-whisper .pt); its tokenizers, architecture and prompt"),
    text_case=Key("keep", check=one_of("keep", "lower", "sentence"),
                  help="transcripts as trained: as written, lower case, or lower with the first letter capitalised"),
    train_split=Key("train", help="the dataset split trained on"),
    eval_split=Key(None, (str, None), help="the split scored (None: 'test', else the first split not trained on)"),
)
PRESETS: dict[str, dict] = {
    # CPU smoke test: a few steps of a tiny trunk on a few dozen synthesised utterances.
    "tiny": dict(data="data/speech-synth-tiny", build=dict(train=64, test=16), out="runs/whisper-tiny",
                 trunk="tiny", batch_size=16, steps=40, lr=3e-3, warmup_steps=5, workers=0, eval_every=0,
                 checkpoint_every=0, eval_batch_size=16, max_new_tokens=64),
    # The CPU default (no GPU): hybrid CTC/attention, width 128, 3 + 3 layers (2.5M parameters, most of them the
    # tied 8k-token embedding), on 6,000 synthesised sentences of 3-15 words, audio tokens at 33 Hz (stride 3: a
    # third fewer encoder tokens than 50 Hz, still more than the ~19 characters/s CTC must emit at eSpeak's fastest
    # rate). 1,600 steps of batch 16 at lr 3e-3, Muon on both trunks' matrices (omni.optimizers; AdamW on the
    # embedders and heads). Measured (2026-11-27, shared 2-core EPYC, 1 thread): CTC head 14.5% CER on the 200
    # held-out sentences (33.5 / 22.0 / 16.9% at steps 400 / 800 / 1200), decoder 34.5% (a constant training
    # sentence: 77.1%); seed 1: 15.0 / 35.1%. Muon at lr 2e-3: CTC 15.7%, decoder 42.0%; AdamW at 2e-3: CTC 19.0%,
    # decoder 68.1%. ~710 s of one-thread CPU for the training, ~750 s with the data build. On the CPU the CTC head
    # learns to transcribe before the decoder does, so the result line gives its CER first.
    "cpu": dict(data="data/speech-synth-cpu", build=dict(train=6000, test=200, max_words=15), out="runs/whisper-cpu",
                trunk="tiny", trunk_overrides=dict(d_model=128, n_layers=3), audio_stride=3, ctc_weight=0.5,
                batch_size=16, steps=1600, lr=3e-3, warmup_steps=200, workers=1, eval_every=400, checkpoint_every=400,
                eval_batch_size=50, max_new_tokens=48, report="ctc", optimizer="muon"),
    # cpu with a local encoder (64 audio tokens either side, +-1.9 s at 33 Hz; 3 layers reach +-5.8 s) and RoPE:
    # length-invariant, so `omni transcribe` reads a long recording in ONE encoder pass (omni.pipelines.long_audio).
    # 800 steps (2026-11-27, shared 2-core EPYC): CTC head 24.4% CER on the 200 held-out sentences; on synthesised
    # 1 / 10 / 60-minute recordings one pass scores 29.8 / 23.8 / 23.2%, 30 s windows 29.8 / 23.9 / 23.1%
    # (benchmarks/long_audio.py).
    "cpu-long": dict(data="data/speech-synth-cpu", build=dict(train=6000, test=200, max_words=15),
                     out="runs/whisper-cpu-long", trunk="tiny", trunk_overrides=dict(d_model=128, n_layers=3),
                     encoder_attention={"pattern": {"kind": "window", "before": 64, "after": 64}}, audio_stride=3,
                     ctc_weight=0.5, batch_size=16, steps=1600, lr=2e-3, warmup_steps=200, workers=1, eval_every=400,
                     checkpoint_every=400, eval_batch_size=50, max_new_tokens=48, report="ctc"),
    # Whisper-base shape: 6 encoder + 6 decoder layers, width 512, 8 heads (one GPU).
    # lr: Whisper-base's 1e-3 is for batch 256; at batch 64 it diverged on the H100 (non-finite gradients at
    # step 537, right after warm-up), so 5e-4 (the square-root batch rule).
    # 3,000 steps on the H100: test CER 2.67%, WER 4.95% in 463 s, compilation and evaluations included
    # (benchmarks/results.md, session 5).
    "base": dict(trunk="whisper-base", batch_size=64, steps=3000, lr=5e-4, warmup_steps=500, compile=True),
    # Fine-tuning a converted Whisper (needs --set init=...): the usual Whisper fine-tuning settings (lr 1e-5,
    # batch 16, a short warm-up, no weight decay on top of pretrained weights), evaluated every 500 steps.
    "finetune": dict(data=None, build=None, out="runs/whisper-finetune", batch_size=16, steps=4000, lr=1e-5,
                     min_lr_ratio=0.1, warmup_steps=500, weight_decay=0.0, eval_every=500, checkpoint_every=500,
                     eval_batch_size=16, limit_eval=2000),
}
DEFAULT_CTC_WEIGHT = 0.3


def parse_args(argv=None) -> dict:
    ap = recipe_parser(__doc__, COMMON, PRESETS, "base on CUDA, cpu otherwise",
                       data_help="dataset directory (manifest.json + shards with audio + .txt)")
    cfg = recipe_config(ap, ap.parse_args(argv), COMMON, PRESETS, "base" if torch.cuda.is_available() else "cpu")
    if cfg["init"] is not None and cfg["bpe_vocab"] is not None:
        ap.error("bpe_vocab fits a new tokenizer, init brings its own: set one of them")
    if cfg["mask_weight"] > 0 and cfg["ctc_weight"] == 0:
        ap.error("mask_weight > 0 trains the decoder to edit the CTC head's text (Mask-CTC): it needs the CTC head, "
                 "ctc_weight > 0 (or unset)")
    if cfg["encoder_attention"] is not None:
        if cfg["init"] is not None:
            ap.error("encoder_attention: init brings its own encoder; with init, trunk_overrides.attention sets the "
                     "patterns of both trunks")
        try:
            check_attention(encoder_trunk(cfg), cfg, SetsTrunk(lambda v: True, ""), name="encoder_attention")
        except (ValueError, TypeError) as exc:
            ap.error(f"encoder_attention: {exc}" if not str(exc).startswith("encoder_attention") else str(exc))
    if cfg["data"] is None:
        ap.error(f"preset {cfg['preset']!r} needs --data DIR (shards from `omni data librispeech` or "
                 "`omni data speech-synth`)")
    return cfg


# ---------------------------------------------------------------------------------------------------
# Data


def ensure_data(cfg: dict, rank: int, world: int) -> Path | str:
    """The dataset directory ``data`` (or its URL, read as it is: omni.data.remote); synthesised there (rank 0, the
    others wait) when missing and ``build`` is set."""
    data = dataset_source(cfg["data"])
    if not isinstance(data, Path):
        return data
    if not (data / "manifest.json").is_file() and not cfg["build"]:
        raise FileNotFoundError(f"{data}/manifest.json not found: build the dataset with "
                                "`omni data speech-synth` or `omni data librispeech`")
    rank_zero_first(lambda: synthesise(cfg, data), rank, world)
    return data


def synthesise(cfg: dict, data: Path) -> None:
    """Synthesise the speech dataset in ``data`` unless it is there. One that omni synthesised from another corpus
    than ``text`` names is refused in one line (it would train on the old sentences without a word); any other
    dataset already in ``data`` (LibriSpeech, your own) is read as it is."""
    if (data / "manifest.json").is_file():
        check_synthesised_corpus(read_manifest(data), cfg["text"], data)
        return
    build = {"text": cfg["text"], "seed": cfg["seed"], **cfg["build"]}
    check_corpus(build["text"])
    require("espeakng_loader")
    print(f"synthesising speech shards in {data} ...", flush=True)
    build_speech_synth(data, **build)


def check_synthesised_corpus(manifest: dict, text: list[str] | None, data: Path) -> None:
    """ValueError unless a speech-synth dataset was synthesised from the sentences ``text`` gives (None: Austen),
    cut with the dataset's own word limits and compared by the sha256 its manifest records."""
    source, args = manifest.get("source") or {}, manifest.get("args") or {}
    if manifest.get("builder") != "speech-synth" or "sha256" not in source:
        return
    check_corpus(text)
    paragraphs, corpus = load_paragraphs(text)
    sentences = extract_sentences(paragraphs, args.get("min_words", 3), args.get("max_words", 25))
    if hashlib.sha256("\n".join(sentences).encode()).hexdigest() != source["sha256"]:
        raise ValueError(f"{data} holds speech synthesised from {source.get('corpus')!r}, not from the text this run "
                         f"names ({corpus}): remove {data} to synthesise it again, or set data= to another folder")


def choose_splits(cfg: dict, data: Path, splits: dict) -> tuple[str, str | None]:
    """(the split trained on, the split scored or None): ``train_split`` and ``eval_split`` as set, checked to be
    in the dataset; an unset eval_split is "test", else the first other split."""
    names = ", ".join(splits)
    train = cfg["train_split"]
    if train not in splits:
        raise ValueError(f"{data}: no split {train!r} to train on (splits: {names}): set train_split=, or build "
                         "with `omni data librispeech --rename SUBSET=train,...`")
    scored = cfg["eval_split"]
    if scored is None:
        return train, "test" if "test" in splits else next((s for s in splits if s != train), None)
    if scored not in splits:
        raise ValueError(f"{data}: no split {scored!r} to evaluate on (splits: {names})")
    return train, scored


def recase(transcript: str, case: str) -> str:
    """``transcript`` as trained (config ``text_case``): "keep" as written, "lower" case, or "sentence" (lower
    case with the first letter capitalised, as Whisper writes, for LibriSpeech's upper case)."""
    if case == "lower":
        return transcript.lower()
    if case == "sentence":
        lower = transcript.lower()
        return lower[:1].upper() + lower[1:]
    return transcript


def prompted_example(audio_tok: AudioTokenizer, text_tok: TextTokenizer, prompt: tuple[int, ...], case: str,
                     ctc: bool, audio: bytes, transcript: str, key: str = "", mlm: bool = False) -> dict:
    """One (audio, transcript) pair -> the dict SpeechCollate batches. Decoder input: ``prompt`` (the model's:
    [bos, <|transcribe|>], or Whisper's four tokens) + the transcript's ids + eos; targets: the text and eos
    only, each predicted from the position before it (the prompt's last token predicts the first word), so the
    prompt is a given condition, never trained. With ``ctc`` also the CTC labels (omni.speech.ctc_labels), with
    ``mlm`` the masked LM's text (omni.speech.masked_lm_text: the normalised transcript, as the CTC head writes it)."""
    transcript = recase(transcript, case)
    body = text_tok.encode(transcript, key=key).tokens  # [bos] ids [eos]
    ids = body[1:] if text_tok.add_bos else body
    tokens = torch.cat([torch.tensor(prompt, dtype=torch.int64), ids])
    if tokens.shape[0] > text_tok.max_length:
        raise ValueError(f"text sample {key!r} has {tokens.shape[0]} tokens with the decoder prompt, more than the "
                         f"decoder's {text_tok.max_length}")
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[len(prompt) - 1:-1] = ids
    example = {"audio": audio_tok.encode(audio, key=key).tokens, "text": tokens, "targets": targets, "key": key}
    if ctc:
        example["ctc"] = ctc_labels(transcript)
    if mlm:
        example.update(mlm=masked_lm_text(text_tok, prompt, transcript, key), mlm_start=len(prompt))
    return example


def read_transcripts(data: Path, split: str, max_corrupt_fraction: float) -> list[str]:
    """Every transcript of a split (for fitting the BPE), read with the same loader on one process."""
    loader = ShardLoader(data, _transcript, list, batch_size=1024, split=split, rank=0, world_size=1,
                         shuffle=False, fields=("txt",), max_corrupt_fraction=max_corrupt_fraction,
                         kind="speech")
    return [t for batch in loader for t in batch][: loader.num_samples]


def _transcript(sample: dict) -> str:
    return sample["txt"].decode("utf-8").strip()


def make_text_tokenizer(cfg: dict, data: Path, rank: int, world: int) -> TextTokenizer:
    if cfg["bpe_vocab"] is None:
        return TextTokenizer()
    return rank_zero_first(lambda: fit_bpe(cfg, data, Path(cfg["out"]) / "tokenizers" / "text"), rank, world)


def fit_bpe(cfg: dict, data: Path, path: Path) -> TextTokenizer:
    """The ``bpe_vocab``-token BPE of the training transcripts, fitted and saved in ``path`` unless it is there."""
    if not (path / "tokenizer.json").is_file():
        transcripts = read_transcripts(data, "train", cfg["max_corrupt_fraction"])
        TextTokenizer().fit(transcripts, vocab_size=cfg["bpe_vocab"]).save(path)
    return TextTokenizer.load(path)


# ---------------------------------------------------------------------------------------------------
# Model


def encoder_trunk(cfg: dict) -> TrunkConfig:
    """The encoder's TrunkConfig: the ``trunk`` preset with ``trunk_overrides``, its attention ``encoder_attention``'s
    when set (the decoder keeps trunk_overrides')."""
    attention = {"attention": cfg["encoder_attention"]} if cfg["encoder_attention"] is not None else {}
    return preset(cfg["trunk"], **{**cfg["trunk_overrides"], **attention})


def from_scratch(cfg: dict, audio: AudioTokenizer, text: TextTokenizer) -> tuple[SpeechRecognizer, dict]:
    """A new model of the ``trunk`` preset and its export config."""
    encoder = encoder_trunk(cfg)
    decoder = preset(cfg["trunk"], cross_attention=True, **cfg["trunk_overrides"])
    ctc = cfg["ctc_weight"] is None or cfg["ctc_weight"] > 0
    mask = mask_settings(cfg, text)
    torch.manual_seed(cfg["seed"])
    model = SpeechRecognizer(audio, text, encoder, decoder, ctc=ctc, audio_positions=cfg["audio_positions"],
                             mask_token=mask.get("mask_token"))
    return model, {"builder": SPEECH_BUILDER, "encoder": encoder.to_dict(), "decoder": decoder.to_dict(), "ctc": ctc,
                   "audio_positions": cfg["audio_positions"], **mask}


def mask_settings(cfg: dict, text: TextTokenizer) -> dict:
    """The export config's Mask-CTC entries: {"mask_token", "mask_weight"} when the run trains the masked LM
    (mask_weight > 0: `omni transcribe --decode mask-ctc` reads them), else {} (the export as without it). The
    mask token is omni's reserved slot ``MASK_TOKEN``; a vocabulary without it is refused in one line."""
    if not cfg.get("mask_weight"):  # unset (a config written before mask_weight) or 0
        return {}
    if MASK_TOKEN not in text.special_tokens:
        raise ValueError(f"mask_weight > 0 needs the mask token {MASK_TOKEN} (a reserved slot of omni's text "
                         "tokenizers); this vocabulary has none (a converted Whisper's): set mask_weight=0")
    return {"mask_token": MASK_TOKEN, "mask_weight": float(cfg["mask_weight"])}


def from_init(cfg: dict) -> tuple[SpeechRecognizer, dict, dict]:
    """The ``init`` model (an omni export, or a Whisper checkpoint converted by omni.interop) with its weights, its
    export config (``ctc`` as this run trains it; the source and prompt kept) and its tokenizers. A CTC head the
    init lacks (ctc_weight > 0) starts from the seed; one this run drops (ctc_weight 0) is left out."""
    config, state_dict, tokenizers = read_init(cfg["init"], SPEECH_BUILDER, "recipes/whisper.py",
                                               "an omni speech export or a Whisper checkpoint (a Hugging Face "
                                               "whisper directory, an openai-whisper .pt)")
    if not {"audio", "text"} <= set(tokenizers):
        raise ValueError(f"init {cfg['init']}: a speech export without its audio and text tokenizers "
                         f"(it has {', '.join(tokenizers) or 'none'})")
    had = bool(config.get("ctc", False))
    ctc = had if cfg["ctc_weight"] is None else cfg["ctc_weight"] > 0
    # "long_form": `omni transcribe` decodes the tuned model as the eval does (omni's windows, no timestamp tokens)
    export = {k: v for k, v in config.items() if k not in ("omni_format", "tokenizers", "mask_token", "mask_weight")}
    export |= {"ctc": ctc, "long_form": "pauses", **mask_settings(cfg, tokenizers["text"])}
    torch.manual_seed(cfg["seed"])
    model = get_builder(SPEECH_BUILDER)(export, tokenizers)
    # a CTC head the init lacks starts from the seed; one this run drops is left out
    load_init(model, state_dict, cfg["init"], new=lambda key: key.startswith("ctc_head.") and ctc != had)
    return model, export, tokenizers


# ---------------------------------------------------------------------------------------------------
# Evaluation


class Scorer:
    """The Trainer's evaluation: ``eval_fn`` gives each sample's loss and greedy-decodes the first ``limit``
    samples of the pass (None: all) as `omni transcribe` does (``transcribe_batch``: the model's prompt, stop and
    logit rules), adding up word and character edits; ``metrics`` (the model_metrics_fn,
    run after the pass) turns every rank's sums into corpus WER and CER (with a CTC head also its best-path
    CER: what the encoder alone hears; trained with mask_weight also Mask-CTC's, as `omni transcribe --decode
    mask-ctc` gives it) and the number of reference words scored, then starts over.

    Alongside, so that no number is read alone: the character edits of two trivial transcribers on the same
    references (an empty transcript, 100% by definition; ``constant``, one training sentence said every time),
    and, with ``samples`` (a folder, main process only), every decoded clip of the pass as
    ``samples/step_<N>.tsv`` (key, reference, CTC hypothesis, decoder hypothesis). ``seconds`` adds up the
    wall time of the evaluation passes (first batch to metrics)."""

    HEADER = ("key", "reference", "ctc", "decoder")

    def __init__(self, text: TextTokenizer, limit: int | None, max_new_tokens: int, constant: str = "",
                 samples: Path | None = None) -> None:
        self.text, self.limit, self.max_new_tokens = text, limit, max_new_tokens
        self.constant, self.samples_dir = constant, samples
        # word edits, words, char edits, chars, CTC char edits, the constant transcript's char edits, Mask-CTC's
        self.sums, self.samples = torch.zeros(7, dtype=torch.float64), 0
        self.rows: list[tuple[str, ...]] = []
        self.seconds, self._started = 0.0, None  # type: float, float | None
        self.last: dict[str, float] = {}  # the latest metrics, with the baselines' CER

    def eval_fn(self, model, batch) -> dict[str, torch.Tensor]:
        if self._started is None:
            self._started = time.perf_counter()
        m = unwrap(model)
        ctc = m.ctc_head is not None
        logits, ctc_logits = m(batch.audio, batch.audio_mask, batch.text, ctc=True) if ctc else \
            (m(batch.audio, batch.audio_mask, batch.text), None)
        keep = batch.targets != IGNORE_INDEX
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), batch.targets, reduction="none")
        if self.limit is None or self.samples < self.limit:
            said = transcribe_batch(m, self.text, batch.audio, batch.audio_mask, max_new_tokens=self.max_new_tokens,
                                    check_every=8)
            refs = [self.text.decode(ref) for ref in batch.text.tolist()]  # the prompt's specials are dropped
            heard = ctc_greedy_decode(ctc_logits, batch.audio_mask) if ctc else refs
            filled = refs
            if ctc and m.mask_id is not None:  # trained for Mask-CTC: its text too (omni transcribe's defaults)
                ids = decode_batch(m, batch.audio, batch.audio_mask, parallel=mask_ctc_decode(m, self.text))
                filled = [self.text.decode(row) for row in ids]
            for key, ref, hyp, ctc_hyp, mask_hyp in zip(batch.keys, refs, said, heard, filled):
                counts = error_counts(ref, hyp)
                self.sums += torch.tensor([*counts, error_counts(ref, ctc_hyp)[2], error_counts(ref, self.constant)[2],
                                           error_counts(ref, mask_hyp)[2]], dtype=torch.float64)
                if self.samples_dir is not None:
                    self.rows.append((key, ref, ctc_hyp if ctc else "", hyp))
            self.samples += len(refs)
        return {"loss": (nll * keep).sum(1) / keep.sum(1)}

    def metrics(self, model, step: int) -> dict[str, float]:
        sums, self.sums, self.samples = self.sums, torch.zeros_like(self.sums), 0
        rows, self.rows = self.rows, []
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:  # every rank is here
            sums = sums.to(next(unwrap(model).parameters()).device)
            torch.distributed.all_reduce(sums)
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None
        word_edits, words, char_edits, chars, ctc_edits, constant_edits, mask_edits = sums.tolist()
        if not chars:
            return {}
        if self.samples_dir is not None:
            self.write_samples(step, rows)
        out = {"wer": word_edits / max(words, 1.0), "cer": char_edits / chars, "words": words}
        if unwrap(model).ctc_head is not None:
            out["ctc_cer"] = ctc_edits / chars
            if unwrap(model).mask_id is not None:
                out["mask_ctc_cer"] = mask_edits / chars
        self.last = {**out, "empty_cer": 1.0, "constant_cer": constant_edits / chars}
        return out

    def write_samples(self, step: int, rows: list[tuple[str, ...]]) -> Path:
        """``samples/step_<step>.tsv``: a header, then one decoded clip a line (tabs and newlines inside a
        transcript become spaces), written atomically."""
        lines = ["\t".join(" ".join(field.split()) for field in row) for row in [self.HEADER, *rows]]
        self.samples_dir.mkdir(parents=True, exist_ok=True)
        return write_atomic(self.samples_dir / f"step_{step}.tsv", "\n".join(lines) + "\n")


def constant_transcript(transcripts: list[str], candidates: int = 200) -> str:
    """The trivial transcriber's answer: of the first ``candidates`` training transcripts, the one with the
    fewest character edits to all of them (normalised as WER / CER count), said for every clip. Chosen on the
    training transcripts only, never on what is scored."""
    if not transcripts:
        return ""
    refs = [normalize_text(t) for t in transcripts]
    edits = cdist(refs[:candidates], refs, scorer=Levenshtein.distance, dtype="int32", workers=1).sum(1)
    return refs[int(edits.argmin())]


def first_clips(data: Path, split: str, n: int, max_corrupt_fraction: float) -> list[tuple[bytes, str, str]]:
    """The first ``n`` (audio bytes, transcript, key) of a split, in shard order (the clips TensorBoard plays)."""
    loader = ShardLoader(data, _raw_clip, list, batch_size=n, split=split, rank=0, world_size=1, shuffle=False,
                         max_corrupt_fraction=max_corrupt_fraction, kind="speech")
    return next(iter(loader), [])[:n]


def _raw_clip(sample: dict) -> tuple[bytes, str, str]:
    field = next((f for f in AUDIO_FIELDS if f in sample), None)
    if field is None or "txt" not in sample:
        raise ValueError(f"sample {sample.get('__key__')!r} needs an audio field and a .txt transcript")
    return sample[field], sample["txt"].decode("utf-8").strip(), sample.get("__key__", "")


class Listen:
    """The Trainer's samples_fn: the first ``n`` test clips with their reference and greedy transcript, for
    TensorBoard (audio + text). The clips are read at the first evaluation (main process only)."""

    def __init__(self, data: Path, split: str | None, audio: AudioTokenizer, text: TextTokenizer, cfg: dict,
                 n: int = 4) -> None:
        self.data, self.split, self.audio, self.text, self.cfg, self.n = data, split, audio, text, cfg, n
        self.clips: list[tuple[torch.Tensor, str, str]] | None = None

    def __call__(self, model, step: int) -> list:
        from omni.plots import Clip
        from omni.pipelines.transcribe import transcribe_waveforms
        from omni.tasks.transcribe import transcript_note
        from omni.tokenizers.audio import load_audio

        if self.split is None:
            return []
        if self.clips is None:
            rate = self.audio.sample_rate
            self.clips = [(load_audio(raw, sample_rate=rate, key=key), ref, key) for raw, ref, key in
                          first_clips(self.data, self.split, self.n, self.cfg["max_corrupt_fraction"])]
        heard = transcribe_waveforms(model, self.audio, self.text, [w for w, _, _ in self.clips],
                                     keys=[k for _, _, k in self.clips], max_new_tokens=self.cfg["max_new_tokens"])
        return [Clip(f"eval/clip{i}", wave.numpy(), self.audio.sample_rate, transcript_note(ref, hyp))
                for i, ((wave, ref, _), hyp) in enumerate(zip(self.clips, heard))]


def result_line(report: str, metrics: dict, baselines: dict, constant: str) -> str:
    """The run's result in one line: the CER ``report`` names first ("ctc": the CTC head's best path, else the
    decoder's greedy transcript), the other one after, WER, and what the trivial transcribers score on the same
    clips, so that the number is never read alone."""
    pct = lambda v: f"{100 * v:.1f}%" if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"
    decoder = f"decoder (greedy) {pct(metrics.get('eval/cer', math.nan))}"
    heads = [decoder]
    if "eval/ctc_cer" in metrics:
        ctc = f"CTC head (best path) {pct(metrics['eval/ctc_cer'])}"
        heads = [ctc, decoder] if report == "ctc" else [decoder, ctc]
        if "eval/mask_ctc_cer" in metrics:
            heads.append(f"Mask-CTC (3 passes) {pct(metrics['eval/mask_ctc_cer'])}")
    line = f"test CER: {heads[0]}" + "".join(f", {h}" for h in heads[1:])
    line += f"; test WER (decoder) {pct(metrics.get('eval/wer', math.nan))}"
    if "constant_cer" in baselines:
        words = len(constant.split())
        line += (f"; baselines on the same {baselines['words']:.0f} words: an empty transcript 100%, one training "
                 f"sentence every time ({words} words) {pct(baselines['constant_cer'])}")
    return line


# ---------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    if cfg["init"] is None and cfg["preset"] == "finetune":  # checked here: every preset parses on its own
        raise ValueError("preset 'finetune' fine-tunes a model: --set init=PATH (an omni speech export or a Whisper "
                         "checkpoint)")
    state = process_state()
    rank, world = state.process_index, state.num_processes
    started = time.time()
    data = ensure_data(cfg, rank, world)
    data_seconds = time.time() - started
    manifest = read_manifest(data, kind="speech")
    train_split, eval_split = choose_splits(cfg, data, manifest["splits"])
    if cfg["init"] is not None:
        model, export, tokenizers = from_init(cfg)
        audio, text = tokenizers["audio"], tokenizers["text"]
    else:
        audio = AudioTokenizer(max_seconds=cfg["max_seconds"], stride=cfg["audio_stride"])
        text = make_text_tokenizer(cfg, data, rank, world)
        model, export = from_scratch(cfg, audio, text)
    ctc = model.ctc_head is not None
    longest = ((manifest.get("split_stats") or {}).get(train_split) or {}).get("longest_seconds")
    if cfg["init"] is None and longest:
        # omni transcribe's windows: no longer than the longest clip trained on (a full-attention encoder trained
        # on <= 15 s clips read a 10-min recording at 34.8% CER in 30 s windows, 23.5% in 15 s ones:
        # benchmarks/results.md); a converted Whisper keeps its 30 s
        export["long_form_seconds"] = float(min(cfg["max_seconds"], math.ceil(longest)))
    if cfg["ctc_weight"] is None:  # the run's hparams record the weight it trained with
        cfg["ctc_weight"] = DEFAULT_CTC_WEIGHT if ctc else 0.0
    # A clip longer than the model's window is dropped (DecodeClip, with a warning), never cut: cut audio would not
    # say its transcript. (A converted Whisper's tokenizer cuts, as whisper.transcribe does, so train with a copy.)
    clips = audio if audio.truncation == "error" else AudioTokenizer(**{**audio.config(), "truncation": "error"})
    mlm = cfg["mask_weight"] > 0
    if mlm and not ctc:
        raise ValueError("mask_weight > 0 trains the decoder to edit the CTC head's text (Mask-CTC): this model has "
                         "no CTC head (ctc_weight=0)")
    decode = DecodeClip(partial(prompted_example, clips, text, tuple(model.prompt), cfg["text_case"], ctc, mlm=mlm))
    # Whisper's front end makes every clip its 1500 tokens, its encoder's whole position table: rounding batches up
    # to a multiple of 8 would add 4 masked tokens to every row, computed for nothing.
    collate = SpeechCollate(text.pad_id, pad_multiple=1 if audio.frontend == "whisper" else 8)
    workers = cfg["workers"] if state.device.type == "cuda" else min(cfg["workers"], 2)
    loader = dict(num_workers=workers, rank=rank, world_size=world, max_corrupt_fraction=cfg["max_corrupt_fraction"],
                  kind="speech")
    train_data = ShardLoader(data, decode, collate, cfg["batch_size"], split=train_split, shuffle=True, seed=cfg["seed"],
                             drop_last=True, **loader)
    eval_data = None
    if eval_split is not None:
        eval_data = ShardLoader(data, decode, collate, cfg["eval_batch_size"], split=eval_split, shuffle=False,
                                **loader)

    constant = constant_transcript(read_transcripts(data, train_split, cfg["max_corrupt_fraction"])) \
        if eval_split is not None else ""
    out = Path(cfg["out"])
    scorer = Scorer(text, cfg["limit_eval"], cfg["max_new_tokens"], constant,
                    samples=out / "samples" if state.is_main_process else None)
    config = train_config(cfg, run_name=f"whisper-{cfg['preset']}")
    loss = SpeechLoss(cfg["ctc_weight"], cfg["mask_weight"], model.mask_id)
    trainer = Trainer(model, loss, train_data, config, eval_data=eval_data,
                      eval_fn=scorer.eval_fn, model_metrics_fn=scorer.metrics,
                      samples_fn=Listen(data, eval_split, audio, text, cfg), hparams=cfg, export_config=export,
                      export_tokenizers={"audio": audio, "text": text})
    if state.is_main_process:
        n_params = sum(p.numel() for p in unwrap(trainer.model).parameters())
        start_from = f", from {cfg['init']}" if cfg["init"] else ""
        print(f"Whisper preset {cfg['preset']}: {n_params / 1e6:.2f}M parameters{start_from}, {cfg['steps']} steps "
              f"({len(train_data)} per epoch), vocab {text.vocab_size}, {trainer.accelerator.device}", flush=True)
    start = time.time()
    metrics = trainer.fit()
    if state.is_main_process:
        seconds = time.time() - start
        result = {"seconds": round(seconds, 1), "data_seconds": round(data_seconds, 1),
                  "eval_seconds": round(scorer.seconds, 1), **{k: v for k, v in metrics.items()
                                                                 if isinstance(v, (int, float))}}
        result.update({f"baseline/{k}": scorer.last[k] for k in ("empty_cer", "constant_cer") if k in scorer.last})
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "eval.json", json.dumps(result, indent=2, sort_keys=True))
        print(result_line(cfg["report"], metrics, scorer.last, constant) + f"; {data_seconds:.0f} s data build, "
              f"{seconds - scorer.seconds:.0f} s training, {scorer.seconds:.0f} s evaluation; model exported to "
              f"{trainer.export_dir}", flush=True)
    return metrics


if __name__ == "__main__":
    run_recipe(main)
