"""One trunk, four tasks at once: Fashion-MNIST classification, speech recognition (synthesised speech),
offline RL (a Gymnasium dataset) and text language modelling, every batch PACKING samples of different
modalities and lengths into fixed rows with the modality-aware mask (omni/packing.py): bidirectional
inside image/audio spans, causal inside text/action spans, prefix-LM where a transcript follows its audio,
never across samples. The task kinds (heads, losses, evaluation options, results row; looked up by kind name):
omni/tasks/; the mixing loader: omni/mixture.py; the model: omni/multitask.py.

    python recipes/multimodal.py                          # preset for the device (base on CUDA, cpu-default on CPU)
    python recipes/multimodal.py --preset tiny            # CPU smoke run (small data, built on first use)
    python recipes/multimodal.py --set "weights={'image': 2.0, 'rl': 0.5}" steps=20000
    python recipes/multimodal.py --preset small --set "only='image'"     # ONE task through the same recipe
    accelerate launch --num_processes 8 recipes/multimodal.py --preset base                     # DDP
    accelerate launch --config_file recipes/accelerate_fsdp2.yaml --num_processes 8 recipes/multimodal.py --preset base

Multi-GPU. ``accelerate launch --num_processes N`` (or ``torchrun --nproc-per-node N``) runs DDP: each rank
draws its own batches (the mixture is seeded by rank), gradients are averaged. FSDP2 (parameters, gradients
and optimizer state sharded over ranks, one ``fully_shard`` per trunk ``Block``) comes from the shipped
Accelerate config ``recipes/accelerate_fsdp2.yaml`` (``distributed_type: FSDP``, ``fsdp_version: 2``,
transformer-based wrap of ``Block``, bf16): pass it with ``--config_file`` and set ``--num_processes`` to
the GPU count. Embedders and heads stay in the root FSDP unit, so the LM head tied to the text embedding
stays one parameter; checkpoints are sharded (torch.distributed.checkpoint, one file per rank, resume with
the same process count), the export in <out>/final is the gathered full model. The same command runs FSDP2
on CPU processes over gloo (omni.train switches Accelerate to FSDP there, which it only does on GPUs by
itself; tests/test_fsdp2.py runs it with 2 processes):

    accelerate launch --config_file recipes/accelerate_fsdp2.yaml --num_processes 2 recipes/multimodal.py --preset tiny

On CPU, ``accelerate launch --cpu --num_processes 2`` starts ONE process; for DDP over 2 CPU processes use
``ACCELERATE_USE_CPU=1 torchrun --nproc-per-node 2 recipes/multimodal.py`` (gloo).

Tasks (``tasks`` config entry; ``weight`` = sampling weight, ``loss_weight`` = factor on its loss):

  image  classify   Fashion-MNIST (Debian ``dataset-fashion-mnist`` IDX files, or $OMNI_FASHION_MNIST_DIR), patches of
                    ``patch`` px -> mean-pooled classification head. (A caption-style prefix-LM target would
                    also work; a head keeps the metric comparable with recipes/vit.py.)
  asr    transcribe eSpeak NG speech of public-domain Austen sentences -> [audio, <bos><|transcribe|> text
                    <eos>] as a prefix-LM -> LM head tied to the text embedding; ``ctc_weight`` > 0 adds a
                    byte-level CTC head on the audio span (hybrid CTC/attention, as recipes/whisper.py, whose
                    cross-attention decoder needs it; the prefix-LM listens without it, so default 0). Default source
                    ``speech-shards``: recipes/whisper.py's own dataset (``shards``, data/speech-synth, built
                    with its settings if missing), so both train and score on the same clips; the tiny preset
                    synthesises a few dozen clips itself (``speech-synth``).
  rl     action     a Gymnasium dataset recorded by ``omni data gym`` (CartPole-v1 by default, built with
                    recipes/decision_transformer.py's settings; 10% of episodes held out for the eval loss)
                    -> windows of ``context`` steps -> action head.
  text   lm         Austen paragraphs (janeaustenr) up to ``max_tokens`` BPE tokens -> the tied LM head.

The text task and synthesised speech read Jane Austen's novels (``apt-get install r-cran-janeaustenr``) unless
``text`` names your own files or folders: ``--set "text=['corpus.txt']"``.

--set init=PATH starts from a recipes/multimodal.py export: its trunk replaces this config's; the tasks both
have start from its embedders and heads (their tokenizers must agree), a task it has not (or a classify task
with another class count) starts with a new head, its tasks this run leaves out are not used. A GPT-2 or other
text LM export cannot start it: its vocabulary is not the bpe-8k the text and speech tasks share, and its
learned 1-D position table does not index packed multimodal rows (refused in one line).

A fifth modality needs a config change only: a registered tokenizer (built in or an installed plug-in,
found through the ``omni.tokenizers`` entry point) and a data callable ``"module:function"`` returning
``(items, labels)`` for a split, e.g.

    --set "extra_tasks={'ts': {'kind': 'classify', 'tokenizer': 'timeseries', 'tokenizer_kwargs': {'patch': 8},
           'data': 'my_pkg.data:series', 'data_kwargs': {'n': 512}, 'n_classes': 2, 'weight': 1.0}}"

``function(split="train"|"test", seed=int, **data_kwargs)``; kinds ``classify`` (items: raw inputs for the
tokenizer, labels: ints) and ``lm`` (items: strings, labels ignored).

Per-task metrics (loss, accuracy / token_accuracy, token_share, documents) are logged to TensorBoard as
``train/<task>/<metric>`` and ``eval/<task>/<metric>`` (held-out data: Fashion-MNIST test, unseen sentences,
held-out episodes and paragraphs). The final OmniModel (every head) is exported to <out>/final.

Task metrics (``eval_tasks``: True = at every eval and at the end, "end" = at the end only, False = never).
Each task is scored as its single-task recipe scores it, on the same held-out data (``Task.evaluate`` in
omni/tasks/):

  image  top-1 accuracy on the Fashion-MNIST test split (all 10k; ``limit_eval`` cuts it)   = recipes/vit.py
  asr    CER / WER of greedy transcripts of the test clips, omni.speech.greedy_decode's rules and
         normalize_text (KV-cached prefix-LM decoding); with a CTC head also its best-path CER = recipes/whisper.py
  rl     rollouts in the env, target return = the dataset's expert reference, ``eval_seeds`` seeds
         (10000..), normalised score 100 (R - R_random) / (R_expert - R_random)  = recipes/decision_transformer.py
  text   held-out token perplexity and bits per UTF-8 byte (no single-task recipe; the LM baseline is ``only``)

They are measured by the Trainer's ``model_metrics_fn`` hook (after the eval batches, RNG untouched), logged
to TensorBoard as ``eval/<task>/test_<metric>``, printed as a Markdown table (one row per task) and written
to <out>/results.json. Under FSDP (sharded parameters) they are measured once, at the end, on the exported
model in the main process.

Each row of the table also says what chance or a simple baseline scores on that metric, so that no number is
read alone: image, chance (1 / classes) and the train split's majority class; asr, the empty transcript (CER
100%) and a blind in-domain guess (each clip "transcribed" as the next test clip's sentence); rl, the random
(score 0) and expert (100) policies' returns; text, an add-one unigram model of the train split (perplexity and
bits per byte). The run ends with its time split: data build, training, task metrics, baselines.

The CPU default (``cpu-default``, what ``python recipes/multimodal.py`` runs without CUDA) trains all four tasks
on a width-128 trunk, 8 x 512 tokens per step, in about ten minutes on two cores, data build included (the
speech, CartPole and text caches are built on first use under data/multimodal-cpu, shared with the cpu presets).

Equal-compute comparison: same trunk, same steps, same tokens per step (``rows x row_length``), all tasks vs
one task (``only`` drops every other task: its data, embedders and heads):

    python recipes/multimodal.py --preset small --out runs/mm-all
    python recipes/multimodal.py --preset small --out runs/mm-image --set "only='image'"
    python recipes/multimodal.py --preset small --out runs/mm-asr   --set "only='asr'"
    python recipes/multimodal.py --preset small --out runs/mm-rl    --set "only='rl'"
    python recipes/multimodal.py --preset small --out runs/mm-text  --set "only='text'"

On a CPU, ``--preset cpu`` (image, rl and text on a width-128 trunk, 1,200 steps of 2 x 1024 tokens) runs
the same comparison in minutes per run; ``--preset cpu-4tasks`` adds speech (3,000 synthesised clips) at 2,000
steps of 4 x 1024 tokens, about 45 minutes per run on one thread. Each single-task run above spends as much
compute (trunk tokens) as the whole joint run. To split the joint run's compute instead (the four single runs
together = one joint run), give each its share of the steps from the joint run's realised token shares
(``train/<task>/token_share`` in runs/mm-all/metrics.json), e.g. ``--set "only='asr'" steps=4000`` for a 0.40
share of 10000 steps. Compare <out>/results.json of each run. The joint loss is the sum of the tasks' MEAN losses
(times ``loss_weight``), so a task's pull on the shared trunk does not grow with its token share; rebalance with
e.g. ``--set tasks.text.loss_weight=2``.
The single-task recipes themselves (their own trunks and schedules) give the reference numbers:

    python recipes/vit.py --preset fmnist
    python recipes/whisper.py --preset base
    python recipes/decision_transformer.py --env CartPole-v1 --set "methods=['dt']" "target_fractions=[1.0]"
"""

from __future__ import annotations

import sys

from omni.scripts import without_script_folder

sys.path[:] = without_script_folder(sys.path, __file__)  # first: recipes/whisper.py must not hide openai-whisper

import hashlib
import importlib
import json
import math
import os
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from omni.config import NON_EMPTY, Check, Key, at_least, keywords_of, one_of
from omni.recipe_runtime import check_corpus, rank_zero_first, recipe_config, recipe_parser, run_recipe, train_config
from omni.data.builders_speech import build_speech_synth
from omni.data.clips import DecodeClip, log_mel_tokens
from omni.deps import require
from omni.files import write_atomic
from omni.init import OMNI_BUILDER, init_multitask, load_init, new_multitask_tensor, read_init
from omni.mixture import MixtureLoader
from omni.multitask import MultitaskModel, merge_tokenizers, multitask_loss
from omni.segment import Segment
from omni.tasks import TASK_KINDS, Task, task_class, task_samples
from omni.train import Trainer, process_state, unwrap
from omni.trunk import preset

# ---------------------------------------------------------------------------------------------------
# Config. Every entry can be overridden with --set key=value, one task's entry with a dotted key
# (--set tasks.text.loss_weight=2).

TASKS: dict[str, dict[str, Any]] = {
    "image": dict(kind="classify", source="fashion-mnist", weight=1.0, loss_weight=1.0, patch=4, limit_train=None,
                  limit_eval=None),
    # recipes/whisper.py's dataset and decoding limit (max_new_tokens), so CER/WER compare on the same clips
    "asr": dict(kind="transcribe", source="speech-shards", weight=1.0, loss_weight=1.0, shards="data/speech-synth",
                build=dict(train=20000, test=500), max_new_tokens=224, eval_batch_size=64,
                # 0: no CTC head. Unlike recipes/whisper.py's cross-attention decoder, the prefix-LM's text attends
                # to the audio tokens directly and listens without CTC (CPU A/B in benchmarks/results.md).
                ctc_weight=0.0),
    "rl": dict(kind="action", source="gym", env="CartPole-v1", episodes=1000, mix=None, context=20, weight=0.5,
               loss_weight=1.0, reference_episodes=10, eval_seeds=5, target=None),  # target None: the expert reference
    "text": dict(kind="lm", source="austen", weight=1.0, loss_weight=1.0, max_tokens=256, eval_fraction=0.02,
                 limit=None),
}
# Speech synthesised by the recipe itself (a few dozen clips for the tiny preset; no shards written).
SYNTH_ASR = dict(kind="transcribe", source="speech-synth", weight=1.0, loss_weight=1.0, train=20000, test=500,
                 max_words=25, voices=["en-us", "en", "en-us+f3", "en+m3", "en-gb-x-rp"], rates=[140, 210],
                 max_new_tokens=224, eval_batch_size=64, ctc_weight=0.0)
COUNT = Key(type=int, check=at_least(1))
# What a task entry takes (each kind reads its own entries; `tokenizer` ... `n_classes`: a user task).
TASK = Key(type=dict, entries=dict(
    kind=Key(type=str, check=one_of(*TASK_KINDS)), source=Key(type=str),
    weight=Key(type=float, check=at_least(0), help="sampling weight"),
    loss_weight=Key(type=float, check=at_least(0), help="factor on the task's mean loss"),
    patch=COUNT, limit_train=Key(), limit_eval=Key(), limit=Key(type=(int, None), check=at_least(1)),
    shards=Key(type=str), build=Key(type=(dict, None), check=keywords_of(build_speech_synth)),
    train=COUNT, test=COUNT, max_words=COUNT, voices=Key(type=list, check=NON_EMPTY, each=Key(type=str)),
    rates=Key(type=list, check=Check(lambda v: len(v) == 2 and v[0] <= v[1], "[low, high]"), each=COUNT),
    max_new_tokens=COUNT, eval_batch_size=Key(), ctc_weight=Key(type=float, check=at_least(0)),
    env=Key(type=str), episodes=COUNT, mix=Key(type=(str, None)), context=COUNT, reference_episodes=COUNT,
    eval_seeds=COUNT, target=Key(type=(float, None)), max_tokens=COUNT,
    eval_fraction=Key(type=float, check=Check(lambda v: 0 < v < 1, "in (0, 1)")),
    tokenizer=Key(type=str), tokenizer_kwargs=Key(type=dict), data=Key(type=str), data_kwargs=Key(type=dict),
    n_classes=Key(type=int, check=at_least(2)),
))
COMMON = dict(
    out="runs/multimodal", cache=Key("data/multimodal", help="where the tasks' data are built and cached"),
    tasks=Key(TASKS, each=TASK, help="name -> task entry (module docstring); one entry: tasks.NAME.ENTRY=VALUE"),
    extra_tasks=Key({}, each=TASK, help="more tasks: a registered tokenizer + a data callable"),
    weights=Key({}, each=Key(type=float, check=at_least(0)), help="task name -> sampling weight (over its own)"),
    text=None,  # the corpus of the text task and of synthesised speech
    trunk="S", trunk_overrides={}, positions="rope2d",
    row_length=Key(4096, check=at_least(1), help="tokens per packed row"), rows=Key(8, check=at_least(1)),
    batches_per_epoch=Key(1000, check=at_least(1)), max_misses=Key(4, check=at_least(0)),
    steps=20000, lr=1e-3, min_lr_ratio=0.02, warmup_steps=1000, weight_decay=0.05, clip_norm=1.0,
    workers=8, compile=False, eval_every=2000,
    eval_batches=Key(50, check=at_least(0), help="held-out mixture batches per evaluation (0: none)"),
    checkpoint_every=2000, log_every=50, seed=0, progress=True, report_to="tensorboard",
    eval_tasks=Key(True, (bool, str), one_of(True, False, "end"),
                   "task metrics (accuracy, CER/WER, rollout score, perplexity): at every eval, at the end, never"),
    only=Key(None, (str, list, None), each=Key(type=str),
             help="a task name (or list of names) to train alone: the single-task baseline, same trunk and budget"),
    max_corrupt_fraction=0.01, resume="auto",
    init=Key(None, (str, None), help="start from this model: a recipes/multimodal.py export (module docstring)"),
)
PRESETS: dict[str, dict[str, Any]] = {
    # CPU smoke run: a tiny trunk, a few hundred samples per task, two rows of 512 tokens.
    "tiny": dict(out="runs/multimodal-tiny", cache="data/multimodal-tiny", trunk="tiny", row_length=512, rows=2,
                 tasks={"image": dict(TASKS["image"], patch=7, limit_train=2048, limit_eval=256, weight=2.0),
                        "asr": dict(SYNTH_ASR, train=48, test=8, max_words=8, voices=["en-us", "en-us+f3"],
                                    max_new_tokens=64, eval_batch_size=8, ctc_weight=0.3),  # every code path
                        "rl": dict(TASKS["rl"], episodes=40, context=5, weight=4.0, reference_episodes=2,
                                   mix="expert:0.5,medium:0.3,random:0.2"),
                        "text": dict(TASKS["text"], max_tokens=96, limit=3000)},
                 batches_per_epoch=100, steps=60, lr=3e-3, warmup_steps=5, workers=0, eval_every=0, eval_batches=4,
                 checkpoint_every=0, log_every=10),
    # Equal-compute comparison that fits a 2-core CPU (image, rl, text; speech does not train to a usable
    # CER at this budget): a width-128 trunk, 2 rows of 1024 tokens, 1,200 steps, task metrics at the end.
    "cpu": dict(out="runs/multimodal-cpu", cache="data/multimodal-cpu", trunk="tiny",
                trunk_overrides=dict(d_model=128, n_layers=4, n_heads=4), row_length=1024, rows=2,
                tasks={"image": dict(TASKS["image"], patch=7), "rl": dict(TASKS["rl"]),
                       "text": dict(TASKS["text"], max_tokens=128)},
                batches_per_epoch=500, steps=1200, lr=2e-3, warmup_steps=100, workers=0, eval_every=0,
                eval_batches=8, checkpoint_every=0, log_every=100, eval_tasks="end"),
    # All four tasks on a 2-core CPU: the cpu preset's trunk with speech added (3,000 synthesised clips of <= 10
    # words, the CPU A/B's set) and twice the rows for 2,000 steps (8.2 M tokens), about 45 min per run.
    "cpu-4tasks": dict(out="runs/multimodal-cpu-4tasks", cache="data/multimodal-cpu", trunk="tiny",
                       trunk_overrides=dict(d_model=128, n_layers=4, n_heads=4), row_length=1024, rows=4,
                       tasks={"image": dict(TASKS["image"], patch=7),
                              "asr": dict(SYNTH_ASR, train=3000, test=100, max_words=10, max_new_tokens=64,
                                          eval_batch_size=50),
                              "rl": dict(TASKS["rl"]), "text": dict(TASKS["text"], max_tokens=128)},
                       batches_per_epoch=500, steps=2000, lr=2e-3, warmup_steps=100, workers=0, eval_every=0,
                       eval_batches=4, checkpoint_every=0, log_every=200, eval_tasks="end"),
    # The CPU default: all four tasks in about 10 minutes on 2 cores, every one well above chance (benchmarks/
    # results.md). Rows of 512 tokens (the documents are short: attention costs less than in 1024-token rows);
    # the byte-level CTC head makes the audio span hear within a few hundred steps (omni.speech's reason).
    "cpu-default": dict(out="runs/multimodal-cpu-default", cache="data/multimodal-cpu", trunk="tiny",
                        trunk_overrides=dict(d_model=128, n_layers=4, n_heads=4), row_length=512, rows=8,
                        tasks={"image": dict(TASKS["image"], patch=7),
                               "asr": dict(SYNTH_ASR, train=3000, test=100, max_words=10, max_new_tokens=64,
                                           eval_batch_size=50, ctc_weight=0.3),
                               # weight 1 (0.5 elsewhere): at 300 steps rl weight 0.5 rolled out at the random
                               # policy's return, weight 1 above it (results_multimodal.md); its windows are cheap
                               "rl": dict(TASKS["rl"], weight=1.0), "text": dict(TASKS["text"], max_tokens=128)},
                        batches_per_epoch=500, steps=900, lr=2e-3, warmup_steps=50, workers=0, eval_every=0,
                        eval_batches=4, checkpoint_every=0, log_every=50, eval_tasks="end"),
    # One GPU, small trunk: quick quality checks against the single-task recipes.
    "small": dict(trunk="S", trunk_overrides=dict(d_model=256, n_layers=8, n_heads=8), row_length=2048, rows=8,
                  steps=10000, lr=1e-3, warmup_steps=500, compile=True),
    # Full run: ViT-S width trunk, 8 x 4096-token rows per GPU.
    "base": dict(compile=True),
}


def parse_args(argv=None) -> dict:
    ap = recipe_parser(__doc__, COMMON, PRESETS, "base on CUDA, cpu-default otherwise", data_help=None)
    cfg = recipe_config(ap, ap.parse_args(argv), COMMON, PRESETS,
                        "base" if torch.cuda.is_available() else "cpu-default")
    tasks = {**cfg["tasks"], **cfg["extra_tasks"]}
    for name_, w in cfg["weights"].items():
        if name_ not in tasks:
            ap.error(f"weights: unknown task {name_!r}; tasks are {', '.join(tasks)}")
        tasks[name_] = {**tasks[name_], "weight": w}
    if cfg["only"] is not None:  # the single-task baseline: every other task leaves the run entirely
        only = [cfg["only"]] if isinstance(cfg["only"], str) else cfg["only"]
        unknown = [n for n in only if n not in tasks]
        if unknown or not only:
            ap.error(f"only: unknown task(s) {unknown}; tasks are {', '.join(tasks)}")
        tasks = {n: tasks[n] for n in only}
    missing = [name_ for name_, spec in tasks.items() if "kind" not in spec]
    if missing:
        ap.error(f"tasks.{missing[0]} has no 'kind'")
    for name_, spec in tasks.items():  # Fashion-MNIST's 28 x 28 images are cut into patch x patch squares
        patch = spec.get("patch")
        if spec.get("source") == "fashion-mnist" and isinstance(patch, int) and patch > 0 and 28 % patch:
            ap.error(f"tasks.{name_}.patch {patch} must divide the 28-pixel Fashion-MNIST images: 1, 2, 4, 7, 14 or 28")
    defaults = {**PRESETS[cfg["preset"]].get("tasks", TASKS), **COMMON["extra_tasks"].default}
    for name_, spec in tasks.items():  # an entry the task never reads is a mistake, not a setting
        read = task_entries(spec)
        given = [e for e in spec if e not in read and defaults.get(name_, {}).get(e, object()) != spec[e]]
        if given:
            ap.error(f"tasks.{name_}.{given[0]}: a {spec['kind']} task "
                     + (f"from source {spec.get('source')!r} " if "data" not in spec else "with a data callable ")
                     + f"does not read it; it reads {', '.join(sorted(read))}")
    cfg["tasks"] = tasks
    return cfg


# What each task reads: the entries every task has, its kind's evaluation options, and its data source's entries.
COMMON_ENTRIES = {"kind", "source", "weight", "loss_weight"}
KIND_ENTRIES = {"transcribe": {"eval_batch_size", "max_new_tokens"}, "action": {"eval_seeds", "target"}}
SOURCE_ENTRIES = {
    "fashion-mnist": {"patch", "limit_train", "limit_eval"},
    "speech-synth": {"train", "test", "max_words", "voices", "rates", "ctc_weight"},
    "speech-shards": {"shards", "build", "ctc_weight"},
    "gym": {"env", "episodes", "mix", "context", "reference_episodes"},
    "austen": {"max_tokens", "eval_fraction", "limit"},
}
USER_DATA_ENTRIES = {"data", "data_kwargs", "tokenizer", "tokenizer_kwargs", "n_classes"}


def task_entries(spec: dict) -> set[str]:
    """The entries a task entry is read for (an unknown source reads only the common ones: task_source names it)."""
    own = USER_DATA_ENTRIES if "data" in spec else SOURCE_ENTRIES.get(spec.get("source"), set())
    return COMMON_ENTRIES | KIND_ENTRIES.get(spec["kind"], set()) | own


# ---------------------------------------------------------------------------------------------------
# Data: each source (SOURCES) returns {"train": data, "test": data}, the keyword arguments of its kind's Task
# (omni.tasks); rank 0 builds caches under cfg["cache"]. ``text``: the shipped bpe-8k BPE, shared by every
# text-using task (one embedder, one tied LM head).


def fashion_mnist(spec: dict, cfg: dict, text) -> dict[str, dict[str, Any]]:
    from omni.data.builders_vision import FASHION_MNIST_CLASSES, locate_fashion_mnist, read_idx
    from omni.tokenizers.image import ImageTokenizer

    image = ImageTokenizer(patch_size=spec["patch"], channels=1, image_size=28, policy="resize")
    folder = locate_fashion_mnist(None, Path(cfg["cache"]) / "fashion-mnist")
    out = {}
    for split, stem, limit in (("train", "train", spec.get("limit_train")), ("test", "t10k", spec.get("limit_eval"))):
        images = read_idx(next(folder.glob(f"{stem}-images-idx3-ubyte*")))[:limit]
        labels = read_idx(next(folder.glob(f"{stem}-labels-idx1-ubyte*")))[:limit]
        out[split] = {"tokenizer": image, "items": [torch.from_numpy(x.copy())[None] for x in images],
                      "labels": labels.astype(np.int64).tolist(), "n_classes": 10,
                      "class_names": list(FASHION_MNIST_CLASSES)}  # the export records them: omni predict names them
    out["test"]["attention"] = 4  # the samples (TensorBoard) show 4 held-out images' attention rollout too
    return out


def corpus_tag(text: list[str] | None) -> str:
    """'' for the default corpus, else '-<digest of the files' paths, sizes and times>' (cache names)."""
    from omni.data.builders_text import expand_inputs

    if text is None:
        return ""
    # a folder stands for the text files inside it (expand_inputs), so editing one of them is a new corpus
    stats = [(os.path.abspath(p), *((os.stat(p).st_size, os.stat(p).st_mtime_ns) if os.path.isfile(p) else ()))
             for p in expand_inputs(text)]
    return "-" + hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:12]


def speech_synth(spec: dict, cfg: dict, text) -> dict[str, dict[str, Any]]:
    """Synthesised utterances of the corpus (``text``), encoded once to log-mel tokens and cached (the mel
    extraction is the CPU cost)."""
    from omni.tokenizers.audio import AudioTokenizer

    seed, audio = cfg["seed"], AudioTokenizer()

    def build() -> dict[str, dict[str, list]]:
        from omni.data.builders_speech import load_paragraphs, split_sentences_by_seed
        from omni.data.speech import extract_sentences, render_utterance

        check_corpus(cfg["text"])
        require("espeakng_loader")
        paragraphs, _ = load_paragraphs(cfg["text"])
        sentences = extract_sentences(paragraphs, 3, spec["max_words"])
        train, test = split_sentences_by_seed(sentences, spec["test"], seed)
        rng = np.random.default_rng(seed)
        data = {}
        for split, pool, n in (("train", train, spec["train"]), ("test", test, spec["test"])):
            tokens, texts = [], []
            for i in range(n):
                sentence = pool[int(rng.integers(len(pool)))]
                voice = spec["voices"][int(rng.integers(len(spec["voices"])))]
                rate = int(rng.integers(spec["rates"][0], spec["rates"][1] + 1))
                _, flac, _, transcript = render_utterance((f"{split}{i}", sentence, voice, rate, 50, None,
                                                           "white", seed * 1000 + i, audio.sample_rate))
                tokens.append(audio.encode(flac, key=f"{split}{i}").tokens)
                texts.append(transcript)
            data[split] = {"tokens": tokens, "text": texts}
        return data

    name = f"speech-{spec['train']}-{spec['test']}-{spec['max_words']}{corpus_tag(cfg['text'])}.pt"
    return _cached_audio(Path(cfg["cache"]) / name, build, spec, audio, text)


def _cached_audio(path: Path, build: Callable[[], dict[str, dict[str, list]]], spec: dict, audio,
                  text) -> dict[str, dict[str, Any]]:
    """``build()``'s {split: {"tokens": [log-mel tokens], "text": [...]}} computed once and saved atomically to
    ``path`` (temp file, then rename), then loaded as the transcribe task's data (audio Segments, transcripts)."""
    if not path.is_file():
        data = build()
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, str(path) + ".tmp")
        Path(str(path) + ".tmp").replace(path)
    data = torch.load(path)
    return {split: {"audio": audio, "text": text, "transcripts": d["text"],
                    "clips": [Segment("audio", t, torch.arange(t.shape[0]), audio.role) for t in d["tokens"]],
                    "ctc_weight": float(spec.get("ctc_weight", 0.0))} for split, d in data.items()}


def speech_shards(spec: dict, cfg: dict, text) -> dict[str, dict[str, Any]]:
    """recipes/whisper.py's dataset (``spec["shards"]``, built with ``spec["build"]`` as that recipe builds it if
    missing): the same train and test clips, encoded once to log-mel tokens and cached under ``cache``. Clips
    longer than the audio tokenizer's max_seconds are dropped, as recipes/whisper.py drops them."""
    import warnings

    from omni.data.reader import ShardLoader
    from omni.tokenizers.audio import AudioTokenizer

    audio, data = AudioTokenizer(), Path(spec["shards"])
    if not (data / "manifest.json").is_file():
        if not spec.get("build"):
            raise FileNotFoundError(f"{data}/manifest.json not found: build it with `omni data speech-synth`")
        build = {"text": cfg["text"], "seed": cfg["seed"], "quiet": True, **spec["build"]}
        check_corpus(build["text"])
        require("espeakng_loader")
        print(f"synthesising speech shards in {data} (as recipes/whisper.py) ...", flush=True)
        build_speech_synth(data, **build)
    digest = hashlib.sha256((data / "manifest.json").read_bytes()).hexdigest()[:12]

    def build() -> dict[str, dict[str, list]]:
        decode = DecodeClip(partial(log_mel_tokens, audio), warn=False)
        out = {}
        for split in ("train", "test"):
            loader = ShardLoader(data, decode, list, batch_size=256, split=split, rank=0, world_size=1,
                                 shuffle=False, max_corrupt_fraction=cfg["max_corrupt_fraction"], kind="speech")
            items = [it for batch in loader for it in batch]  # (a None from decode is dropped by the loader)
            if len(items) < loader.num_samples:
                warnings.warn(f"{data} {split}: dropped {loader.num_samples - len(items)} clips longer than "
                              f"{audio.max_seconds} s")
            out[split] = {"tokens": [t for t, _ in items], "text": [x for _, x in items]}
        return out

    return _cached_audio(Path(cfg["cache"]) / f"speech-shards-{digest}.pt", build, spec, audio, text)


def gym_episodes(spec: dict, cfg: dict, text) -> dict[str, dict[str, Any]]:
    gym = require("gymnasium")
    from omni.data.builders_rl import build_gym
    from omni.data.shards import read_manifest
    from omni.rl import SpaceSpec, load_episodes, make_tokenizer, reference_returns

    mix = spec.get("mix")
    tag = "" if mix is None else "-" + "".join(c if c.isalnum() else "_" for c in mix)
    data = Path(cfg["cache"]) / f"gym-{spec['env']}-{spec['episodes']}{tag}"
    if not (data / "manifest.json").is_file():
        build_gym(data, env=spec["env"], episodes=spec["episodes"], mix=mix, seed=cfg["seed"], minari=False, quiet=True,
                  reference_episodes=spec.get("reference_episodes", 10))
    manifest = read_manifest(data, kind="episodes")
    episodes = load_episodes(data, "train", max_corrupt_fraction=cfg["max_corrupt_fraction"])
    n_eval = max(1, len(episodes) // 10)
    # timestep table up to the env's step limit, so rollouts run whole episodes (as the DT recipe does)
    longest = max(len(ep["actions"]) for ep in episodes)
    limit = gym.spec(spec["env"]).max_episode_steps or longest
    tok = make_tokenizer(episodes[:-n_eval], SpaceSpec.from_manifest(manifest), context=spec["context"],
                         max_timestep=max(limit, longest) + 1)
    reference = reference_returns(manifest, episodes)[0]
    return {split: {"tokenizer": tok, "episodes": eps, "env_id": spec["env"], "reference": reference}
            for split, eps in (("train", episodes[:-n_eval]), ("test", episodes[-n_eval:]))}


def text_corpus(spec: dict, cfg: dict, text) -> dict[str, list[str]]:
    """The corpus's paragraphs (``text``, default Austen's novels) of 4+ words that fit in ``max_tokens``;
    the last ``eval_fraction`` of them held out."""
    path = Path(cfg["cache"]) / f"austen-{spec['max_tokens']}{corpus_tag(cfg['text'])}.json"
    if not path.is_file():
        from omni.data.builders_speech import load_paragraphs

        check_corpus(cfg["text"])
        paragraphs = [p for p in load_paragraphs(cfg["text"])[0] if len(p.split()) >= 4]
        lengths = [len(e.ids) + 2 for e in text.hf.encode_batch(paragraphs, add_special_tokens=False)]
        keep = [p for p, n in zip(paragraphs, lengths) if n <= spec["max_tokens"]]
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(keep))  # a half-written cache would break every later run
    keep = json.loads(path.read_text())
    n_eval = max(1, int(len(keep) * spec["eval_fraction"]))
    train = keep[:-n_eval][: spec.get("limit")]
    return {"train": train, "test": keep[-n_eval:]}


def austen(spec: dict, cfg: dict, text) -> dict[str, dict[str, Any]]:
    """The lm task's data: ``text_corpus`` on the shared text tokenizer."""
    return {split: {"tokenizer": text, "texts": texts} for split, texts in text_corpus(spec, cfg, text).items()}


def import_callable(path: str):
    module, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"data {path!r}: expected 'module:function'")
    return getattr(importlib.import_module(module), attr)


def user_data(spec: dict, cfg: dict, text) -> dict[str, dict[str, Any]]:
    """A user task (config only): ``data``, a 'module:function' returning (items, labels) for a split, read as
    the task's kind reads them."""
    fn, read = import_callable(spec["data"]), task_class(spec["kind"]).from_items
    return {split: read(spec, *fn(split=split, seed=cfg["seed"], **spec.get("data_kwargs", {})), text)
            for split in ("train", "test")}


Source = Callable[[dict, dict, Any], dict[str, dict[str, Any]]]  # (task entry, cfg, text tokenizer) -> split data
SOURCES: dict[str, tuple[str, Source]] = {  # a task entry's `source` -> (the kind it feeds, its data)
    "fashion-mnist": ("classify", fashion_mnist),
    "speech-synth": ("transcribe", speech_synth),
    "speech-shards": ("transcribe", speech_shards),
    "gym": ("action", gym_episodes),
    "austen": ("lm", austen),
}


def task_source(name: str, spec: dict) -> Source:
    """Where a task's data come from: ``user_data`` for a task with a data callable, else its ``source``."""
    kind = spec["kind"]
    if "data" in spec:
        if not task_class(kind).reads_items():
            takes = " or ".join(k for k, c in TASK_KINDS.items() if c.reads_items())
            raise ValueError(f"task {name!r}: kind {kind!r} with a data callable must be {takes}")
        return user_data
    feeds, source = SOURCES.get(spec.get("source"), (None, None))
    if feeds != kind:
        built_in = ", ".join(f"{k}/{s}" for s, (k, _) in SOURCES.items())
        raise ValueError(f"task {name!r}: unknown kind/source {kind!r}/{spec.get('source')!r} (built in: {built_in}; "
                         "or give tokenizer + data)")
    return source


def build_tasks(cfg: dict) -> dict[str, list[Task]]:
    """{"train": tasks, "test": tasks} (the same tokenizers, held-out data for test)."""
    from omni.tokenizers.text import TextTokenizer

    text = TextTokenizer()
    out: dict[str, list[Task]] = {"train": [], "test": []}
    for name, spec in cfg["tasks"].items():
        make = task_class(spec["kind"])
        for split, data in task_source(name, spec)(spec, cfg, text).items():
            out[split].append(make(name, weight=float(spec.get("weight", 1.0)),
                                   loss_weight=float(spec.get("loss_weight", 1.0)), **data))
    return out


# ---------------------------------------------------------------------------------------------------


def build(cfg: dict, rank: int = 0, world: int = 1):
    """(model, train loader, eval loader, tasks) for a config: what main trains, and what tests inspect."""
    tasks = rank_zero_first(lambda: build_tasks(cfg), rank, world)
    trunk = preset(cfg["trunk"], positions=cfg["positions"], **cfg["trunk_overrides"])
    source = None
    if cfg["init"]:  # its trunk replaces this config's; the tokenizers of the tasks both have must agree
        source = read_init(cfg["init"], OMNI_BUILDER, "recipes/multimodal.py", "a recipes/multimodal.py export")
        trunk = init_multitask(source, cfg["init"], merge_tokenizers(tasks["train"]))
    torch.manual_seed(cfg["seed"])
    model = MultitaskModel(tasks["train"], trunk)
    if source is not None:
        fresh = load_init(model.omni, source[1], cfg["init"], new=new_multitask_tensor)
        if fresh and rank == 0:
            print(f"init {cfg['init']}: new (not in it, or another shape): {', '.join(fresh)}", flush=True)
    common = dict(row_length=cfg["row_length"], rows=cfg["rows"], max_misses=cfg["max_misses"], rank=rank,
                  world_size=world)
    train = MixtureLoader(tasks["train"], batches_per_epoch=cfg["batches_per_epoch"], seed=cfg["seed"],
                          num_workers=cfg["workers"], **common)
    evaluation = MixtureLoader(tasks["test"], batches_per_epoch=cfg["eval_batches"], seed=cfg["seed"] + 10_007,
                               **common) if cfg["eval_batches"] else None
    return model, train, evaluation, tasks


# ---------------------------------------------------------------------------------------------------
# Task metrics: every task scored as its single-task recipe scores it (module docstring)


def task_metrics(model, tasks: list[Task], cfg: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value, "seconds": time taken}} on the held-out tasks, for every task kind that has a
    metric (``Task.evaluate``); ``model`` is the OmniModel."""
    out: dict[str, dict[str, float]] = {}
    for t in tasks:
        if type(t).evaluate is Task.evaluate:  # a plug-in Task subclass without a held-out metric
            continue
        t0 = time.time()
        result = t.evaluate(model, **t.eval_options(cfg["tasks"][t.name], cfg))
        out[t.name] = {**result, "seconds": round(time.time() - t0, 2)}
    return out


def baseline(train: Task, test: Task) -> dict[str, Any]:
    """What chance or a simple baseline scores on a task's held-out metric, so that a number is never read
    alone: {"text": the table cell, ...: the numbers}; {} for a plug-in kind without one."""
    from omni.asr_text import error_rates
    from omni.tasks import ActionTask, ClassifyTask, LMTask, TranscribeTask

    if isinstance(test, ClassifyTask):
        majority = int(np.bincount(train.labels, minlength=test.n_classes).argmax())  # the train split's commonest
        share = test.labels.count(majority) / len(test)
        return {"chance": 1 / test.n_classes, "majority": share,
                "text": f"chance {100 / test.n_classes:.2f} ({test.n_classes} classes); majority class {100 * share:.2f}"}
    if isinstance(test, TranscribeTask):
        # an in-domain guess that does not listen: each clip "transcribed" as the next test clip's sentence
        refs = list(test.transcripts)
        other = error_rates(refs, refs[1:] + refs[:1])["cer"] if len(refs) > 1 else math.nan
        return {"empty_cer": 1.0, "other_sentence_cer": other,
                "text": f"empty transcript 100.00; another test sentence {100 * other:.2f}"}
    if isinstance(test, ActionTask) and test.reference is not None:
        lo, hi = test.reference
        return {"random_return": lo, "expert_return": hi,
                "text": f"random policy 0 (return {lo:.1f}); expert 100 (return {hi:.1f})"}
    if isinstance(test, LMTask):
        nll, bits = unigram_nll(train, test)
        return {"unigram_ppl": math.exp(nll), "unigram_bpb": bits,
                "text": f"unigram {math.exp(nll):.2f} ({bits:.4f} bits/byte)"}
    return {}


def unigram_nll(train, test) -> tuple[float, float]:
    """(held-out NLL per token in nats, bits per byte) of a unigram model of the train split's tokens (add-one
    smoothing over the vocabulary), counted over the tokens LMTask.evaluate predicts (after bos, through eos)."""
    def targets(task) -> np.ndarray:
        return np.concatenate([task.tokenizer.encode(t, key="unigram").tokens[1:].numpy() for t in task.texts])

    counts = np.bincount(targets(train), minlength=train.tokenizer.vocab_size) + 1.0
    held = targets(test)
    nll = float(-np.log(counts[held] / counts.sum()).sum())
    return nll / len(held), nll / math.log(2) / sum(len(t.encode("utf-8")) for t in test.texts)


def task_baselines(train: list[Task], test: list[Task]) -> dict[str, dict[str, Any]]:
    """{task: baseline(...)} for every task with a held-out metric."""
    return {b.name: baseline(a, b) for a, b in zip(train, test)}


def results_table(results: dict[str, dict[str, float]], tasks: list[Task],
                  baselines: dict[str, dict[str, Any]] | None = None) -> str:
    """One Markdown row per task: the headline metric as the single-task recipe reports it (percent points
    for accuracy and CER), what chance or a simple baseline scores on it, the secondary metric, and what it
    was measured on."""
    lines = ["| task | metric | value | chance / baseline | also | held-out data |", "|---|---|---|---|---|---|"]
    for t in tasks:
        r = results.get(t.name)
        if r is None:
            continue
        metric, value, also, data = t.result_row(r)
        base = (baselines or {}).get(t.name, {}).get("text", "")
        lines.append(f"| {t.name} | {metric} | {value} | {base} | {also} | {data} |")
    return "\n".join(lines)


# What curves.png draws of each task (omni.plots.training_curves draws a dozen eval metrics): its training and
# held-out loss and its headline test metrics, by task kind; a plug-in kind: all of its test metrics.
CURVE_METRICS = {"classify": ("accuracy",), "transcribe": ("cer", "ctc_cer"), "action": ("score_mean", "score_std"),
                 "lm": ("bpb",)}


class CurveRecords:
    """The run's metric history as curves.png should see it: the total loss, each task's loss and its
    headline test metrics (``CURVE_METRICS``), not token shares, counts or every secondary metric, so that every
    task has its panels. history.jsonl and TensorBoard keep everything."""

    def __init__(self, history, tasks: list[Task]) -> None:
        self.history = history
        self.keep = {"step", "train/loss", "train/loss_per_step", "eval/loss"}
        self.tasks = {}
        for t in tasks:
            self.keep |= {f"train/{t.name}/loss", f"eval/{t.name}/loss"}
            self.tasks[t.name] = CURVE_METRICS.get(t.kind)

    def shown(self, name: str) -> bool:
        if name in self.keep:
            return True
        task, _, metric = name.removeprefix("eval/").partition("/test_")
        return task in self.tasks and (self.tasks[task] is None or metric in self.tasks[task])

    @property
    def records(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if self.shown(k)} for r in self.history.records]


def eval_fn(model, batch) -> dict[str, torch.Tensor]:
    """Trainer eval_fn: the loss and per-task batch metrics of a held-out mixture batch."""
    loss, metrics = model(batch)
    return {"loss": loss, **metrics}


def make_model_metrics_fn(tasks: list[Task], cfg: dict, record: dict[str, dict[str, float]]):
    """Trainer model_metrics_fn: every task's metrics (``task_metrics``) at each evaluation (``eval_tasks``
    True) or at the final one only ("end": ``step >= steps``), logged as ``eval/<task>/test_<metric>`` and
    kept in ``record`` for the final table. Every rank measures the same held-out items with the same seeds
    on its local, unwrapped OmniModel (no collectives: identical under DDP, so the Trainer's mean over
    ranks is that value). Not for FSDP (``main`` measures the exported model there)."""

    def model_metrics(model, step: int) -> dict[str, float]:
        if cfg["eval_tasks"] is not True and step < cfg["steps"]:
            return {}
        results = task_metrics(unwrap(model).omni, tasks, cfg)
        record.clear()
        record.update(results)
        return {f"{name}/test_{k}": float(v) for name, r in results.items() for k, v in r.items() if k != "seconds"}

    return model_metrics


def time_split(data: float, fit: float, record: dict[str, dict[str, float]], baselines: float) -> dict[str, Any]:
    """Where a run's time went, in seconds: building the data, training (with the held-out loss batches,
    sample pictures and the export), the task metrics (per task) and the baselines."""
    per_task = {name: float(r.get("seconds", 0.0)) for name, r in record.items()}
    metrics = sum(per_task.values())
    return {"data_build": round(data, 1), "training": round(fit - metrics, 1), "task_metrics": round(metrics, 1),
            "baselines": round(baselines, 1), "total": round(data + fit + baselines, 1), "per_task": per_task}


def main(argv=None, *, on_trained=None) -> dict:
    """Train; ``on_trained(trainer)`` (if given) runs on every rank after training, while the process group
    is still up (tests compare the ranks' parameters there)."""
    from accelerate.utils import parse_flag_from_env

    cfg = parse_args(argv)
    state = process_state()
    began = time.time()
    model, train, losses, tasks = build(cfg, state.process_index, state.num_processes)
    data_seconds = time.time() - began  # the tasks' data built (or read from the cache) and the model
    # Sharded parameters (FSDP) cannot run the decoding / rollout loops outside the root forward: measure
    # the task metrics once, at the end, on the exported model instead.
    sharded = parse_flag_from_env("ACCELERATE_USE_FSDP")
    in_training = bool(cfg["eval_tasks"]) and not sharded
    record: dict[str, dict[str, float]] = {}
    config = train_config(cfg, warmup_steps=min(cfg["warmup_steps"], cfg["steps"]),
                          run_name=f"multimodal-{cfg['preset']}")
    export = model.export_config()
    trainer = Trainer(model, multitask_loss, train, config, eval_data=losses, eval_fn=eval_fn,
                      model_metrics_fn=make_model_metrics_fn(tasks["test"], cfg, record) if in_training else None,
                      samples_fn=lambda model, step: task_samples(model.omni, tasks["test"]), hparams=cfg,
                      export_config=export, export_tokenizers=merge_tokenizers(tasks["train"]),
                      export_module=lambda m: m.omni)
    trainer.pictures.history = CurveRecords(trainer.history, tasks["test"])  # what curves.png draws
    if state.is_main_process:
        acc = trainer.accelerator
        n_params = sum(p.numel() for p in unwrap(trainer.model).parameters())  # DTensor: the global count
        mix = ", ".join(f"{t.name} ({t.kind}, w={t.weight:g}, {len(t)} items)" for t in tasks["train"])
        mode = "FSDP2" if acc.is_fsdp2 else "FSDP" if acc.distributed_type == "FSDP" else "DDP"
        where = f"{acc.device}, {mode} x {acc.num_processes} processes" if acc.num_processes > 1 else str(acc.device)
        print(f"multimodal preset {cfg['preset']}: {n_params / 1e6:.2f}M parameters, {cfg['steps']} steps of "
              f"{cfg['rows']} x {cfg['row_length']} tokens, tasks: {mix}; {where}", flush=True)
    start = time.time()
    metrics = trainer.fit(finish=on_trained is None)
    if on_trained is not None:
        try:
            on_trained(trainer)
        finally:
            trainer.close()
    # Measured on the exported model, once, on the main process: under FSDP, and on a re-run of a finished run
    # (fit evaluated nothing: a kill may have taken results.json after the export landed; it is written again).
    if cfg["eval_tasks"] and (sharded or not record) and state.is_main_process:
        from omni.export import load_pretrained

        record.update(task_metrics(load_pretrained(trainer.export_dir, device=state.device), tasks["test"], cfg))
        metrics.update({f"eval/{name}/test_{k}": v for name, r in record.items() for k, v in r.items()
                        if k != "seconds"})
    if state.is_main_process:
        out = Path(cfg["out"])
        result = {"seconds": round(time.time() - start, 1),
                  **{k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}}
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "metrics.json", json.dumps(result, indent=2, sort_keys=True))
        per_task = "; ".join(f"{t.name} loss {metrics.get(f'train/{t.name}/loss', math.nan):.3f}" for t in tasks["train"])
        print(f"done in {result['seconds']:.0f} s: {per_task}; model exported to {trainer.export_dir}", flush=True)
        if record:
            t0 = time.time()
            baselines = task_baselines(tasks["train"], tasks["test"])
            table = results_table(record, tasks["test"], baselines)
            print(table, flush=True)
            timing = time_split(data_seconds, result["seconds"], record, time.time() - t0)
            print("time: " + ", ".join(f"{k.replace('_', ' ')} {v:.0f} s" for k, v in timing.items()
                                       if not isinstance(v, dict))
                  + " (task metrics: " + ", ".join(f"{k} {v:.0f} s" for k, v in timing["per_task"].items()) + ")",
                  flush=True)
            payload = {"preset": cfg["preset"], "tasks": [t.name for t in tasks["train"]], "steps": metrics.get("step"),
                       "tokens_per_step": cfg["rows"] * cfg["row_length"] * state.num_processes,  # all ranks
                       "results": record, "baselines": baselines, "table": table, "time": timing, "config": cfg}
            write_atomic(out / "results.json", json.dumps(payload, indent=2, default=str))
    return metrics


if __name__ == "__main__":
    run_recipe(main)
