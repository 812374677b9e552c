"""A causal text language model: BPE text -> causal trunk -> LM head, documents packed into fixed rows.

    python recipes/lm.py                                      # preset for the device (cpu without CUDA)
    python recipes/lm.py --preset tiny                        # CPU smoke run: seconds of training
    python recipes/lm.py --set "text=['a.txt', 'b.txt']"      # your own UTF-8 text instead of Austen
    python recipes/lm.py --preset gpt2-finetune --set init=hf-gpt2/ --set "text=['my.txt']"   # fine-tune GPT-2

Data. The paragraphs (blank-line separated; Austen's novels from Debian's r-cran-janeaustenr, or
$OMNI_AUSTEN_DIR, unless ``text`` names files or folders) of at least ``min_words`` words are the documents; a
paragraph longer than ``context`` tokens is cut into pieces that fit. The last ``eval_fraction`` of them are
held out. Each batch packs documents into ``rows`` x ``row_length`` tokens (omni.mixture.MixtureLoader, one task);
attention never crosses documents, and positions restart at each one.

From scratch the tokenizer is omni's BPE (``omni.tokenizers.text``, bpe-8k, bos and eos around each document)
and the trunk a ``trunk`` preset with ``positions`` (learned_1d: GPT-2's table, sized ``context``).
``optimizer='muon'`` (the cpu preset's, with positions='rope') trains the trunk's attention and MLP matrices with
Muon and the embedding table (the tied head), positions, norms and biases with AdamW, one lr and schedule
(omni.optimizers).

--set init=PATH starts from a text LM: an omni text-LM export (this recipe's, a converted GPT-2, a multimodal run
with only='text') or a Hugging Face GPT-2 directory (converted on the fly, omni.interop.gpt2). Its tokenizer,
trunk and LM head replace the recipe's (``trunk``, ``positions`` are not used); an untied head (GPT-2's
tie_word_embeddings=False) trains as its own weight. ``context`` may not exceed its learned position table.
``dropout`` None keeps the model's own (GPT-2: resid_pdrop). The export in <out>/final is again a text LM:
``omni generate --checkpoint <out>/final "prompt"``, and a GPT-2 goes back with ``omni convert --to hf``.

Long texts. ``documents='stream'`` trains on whole ``context``-token windows of the text run on (the paragraphs joined
by blank lines, the held-out ones apart), not on paragraphs, so a model sees every distance up to ``context``.
``eval_lengths=[1024, 2048, 8192, 32768]`` then scores, after training, the same held-out tokens (the held-out
paragraphs run on, the first max(eval_lengths) - 1 tokens) read in windows of each length, bos first, one document
per forward (``long_text_bpb``): full attention on SDPA's causal path (no T x T mask), attention patterns
(``--set trunk_overrides.attention=...``) on the banded path, so a window's memory grows linearly. Bits per byte per
length go to the result line, the metrics (eval/bpb@<L>) and <out>/eval_lengths.json. A length past a learned
position table is refused before any data is built (the trunk would repeat the table's last row); use
positions='rope'. ``eval_window=256`` reads those lengths with a causal window imposed on the trained weights
(``windowed``): a RoPE model trained with full attention at 1,024 then stays flat to 32k, where its own full
attention loses 0.07-0.25 bits/byte (benchmarks/long_text.py).

Metrics: train/lm/loss (nats per token), and at each evaluation the held-out bits per UTF-8 byte (eval/bpb),
token perplexity (eval/ppl) and mean NLL (eval/loss) over every held-out document (omni.tasks.LMTask.evaluate),
plus ``samples`` continuations of held-out openings logged to TensorBoard as text (lm/sample<i>) and written to
<out>/samples/step_<N>.txt. The result line puts the bits/byte next to a unigram baseline: the held-out tokens'
cross-entropy under the training tokens' frequencies (add-one smoothed, eos counted as the model predicts it), over
the held-out UTF-8 bytes, so the number is never read alone; and, tokenizer-free, the held-out bytes under the
training bytes' frequencies.
"""

from __future__ import annotations

import sys

from omni.scripts import without_script_folder

sys.path[:] = without_script_folder(sys.path, __file__)  # first: recipes/whisper.py must not hide openai-whisper

import copy
import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from omni.attention_patterns import check_causal
from omni.config import Check, Key, at_least, between, one_of, sets_trunk
from omni.files import write_atomic
from omni.recipe_runtime import check_corpus, recipe_config, recipe_parser, run_recipe, train_config
from omni.init import OMNI_BUILDER, load_init, read_init
from omni.mixture import MixtureLoader
from omni.multitask import MultitaskModel, multitask_loss
from omni.packing import BLOCK_SIZE
from omni.tasks import LMTask
from omni.tokenizers.text import TextTokenizer
from omni.train import Trainer, process_state, unwrap
from omni.trunk import TrunkConfig, preset

# ---------------------------------------------------------------------------------------------------
# Config. Every entry can be overridden with --set key=value.

COMMON = dict(
    out="runs/lm", text=None,
    init=Key(None, (str, None), help="start from this text LM: an omni text-LM export or a Hugging Face GPT-2 "
                                     "directory (module docstring)"),
    context=Key(512, check=at_least(2), help="most tokens of one document (the tokenizer's max_length); longer "
                                            "paragraphs are cut"),
    row_length=Key(2048, check=Check(lambda v: v >= BLOCK_SIZE and v % BLOCK_SIZE == 0,
                                     f"a positive multiple of {BLOCK_SIZE}"), help="tokens per packed row"),
    rows=Key(8, check=at_least(1), help="packed rows per batch and process"),
    min_words=Key(4, check=at_least(1), help="shorter paragraphs (headings) are dropped"),
    eval_fraction=Key(0.02, check=Check(lambda v: 0 < v < 1, "in (0, 1)"), help="held-out share of documents"),
    limit_train=None, limit_eval=None,
    trunk="S", trunk_overrides=Key({}, check=sets_trunk(max_positions=("context", lambda c: c["context"]),
                                                        longest=("context", lambda c: c["context"]))),
    positions=Key("learned_1d", str, one_of("learned_1d", "rope", "sinusoidal", "none"),
                  "token positions (from scratch)"),
    dropout=Key(None, (float, None), between(0, 0.99), "residual dropout; None: 0 from scratch, the init's own"),
    steps=5000, lr=1e-3, min_lr_ratio=0.1, warmup_steps=200, weight_decay=0.1, clip_norm=1.0, optimizer="adamw",
    mixed_precision=Key("auto", str, one_of("auto", "no", "bf16"), "auto: bf16 on a CUDA GPU that has it, else "
                        "fp32; bf16 on a CPU with AVX-512 BF16 (Zen 4, Sapphire Rapids) makes the matmuls ~2x faster"),
    workers=0, compile=False, eval_every=1000, checkpoint_every=1000, log_every=50, seed=0, progress=True,
    report_to="tensorboard", resume="auto",
    samples=Key(4, check=at_least(0), help="held-out openings whose continuations are logged at each evaluation"),
    documents=Key("paragraphs", str, one_of("paragraphs", "stream"),
                  "paragraphs: each paragraph (cut at context) is a document; stream: the text run on, cut into "
                  "context-token documents (long-context training)"),
    eval_lengths=Key([], list, each=Key(type=int, check=at_least(2)),
                     help="after training: held-out bits/byte read in windows of each length (module docstring)"),
    eval_window=Key(None, (int, None), at_least(1), "eval_lengths read with a causal window of this many tokens "
                    "on every layer, imposed on the trained weights (None: the model's own attention)"),
)
PRESETS: dict[str, dict[str, Any]] = {
    # CPU smoke run: a tiny trunk on short documents, a few dozen steps.
    "tiny": dict(out="runs/lm-tiny", trunk="tiny", context=64, row_length=256, rows=2, steps=40, lr=3e-3,
                 warmup_steps=5, eval_every=20, checkpoint_every=0, log_every=10, limit_train=2000, limit_eval=40,
                 samples=2),
    # The CPU default (no CUDA): a width-256, 4-layer GPT on paragraph pieces of 128 tokens, 500 steps of 8 x 256
    # tokens (~1.1 epochs), bf16 autocast (1.4x the fp32 step on an AVX-512 BF16 CPU), Muon on the trunk's matrices
    # (held out at step 500: AdamW 1.68 bits/byte, Muon 1.49; Muon costs ~6% more CPU), RoPE positions (Muon with
    # learned positions: 1.556 at step 300 of 300, with RoPE 1.518). Measured (2026-11-27, 2-core EPYC, 1 thread):
    # held out 1.45 bits/byte vs 2.08 for the token unigram (0.63 below), 451 CPU-s in all (~4 min on 2 idle cores).
    "cpu": dict(out="runs/lm-cpu", trunk="tiny", trunk_overrides={"d_model": 256, "n_layers": 4, "n_heads": 4},
                context=128, row_length=256, rows=8, steps=500, lr=4e-3, warmup_steps=30, eval_every=100,
                checkpoint_every=0, log_every=25, mixed_precision="bf16", samples=3, optimizer="muon",
                positions="rope"),
    # From scratch on one GPU: a width-384 GPT on the corpus, 512-token documents.
    "small": dict(trunk="S", context=512, row_length=2048, rows=16, steps=5000, lr=1e-3, compile=True),
    # Fine-tune a GPT-2 (--set init=...) on one GPU: its 1024 positions, a small lr, light weight decay.
    "gpt2-finetune": dict(out="runs/lm-gpt2", context=1024, row_length=1024, rows=8, steps=1000, lr=5e-5,
                          min_lr_ratio=0.1, warmup_steps=50, weight_decay=0.01, eval_every=200,
                          checkpoint_every=500, log_every=10),
}


def parse_args(argv=None) -> dict:
    ap = recipe_parser(__doc__, COMMON, PRESETS, "small on CUDA, cpu otherwise", data_help=None)
    cfg = recipe_config(ap, ap.parse_args(argv), COMMON, PRESETS, "small" if torch.cuda.is_available() else "cpu")
    if cfg["context"] > cfg["row_length"]:
        ap.error(f"context {cfg['context']} is longer than row_length {cfg['row_length']}: a document must fit a row")
    return cfg


# ---------------------------------------------------------------------------------------------------
# Data


def documents(cfg: dict, tok: TextTokenizer) -> dict[str, Any]:
    """{"train", "test"}: the corpus's paragraphs of ``min_words``+ words (the last ``eval_fraction`` held out),
    each cut into pieces of at most ``context`` tokens (specials included) at token boundaries; with
    ``documents='stream'`` each split's paragraphs are first run on (joined by blank lines) and the pieces are
    ``context``-token windows of that text. "stream": the held-out paragraphs run on (``long_text_bpb`` reads it)."""
    from omni.data.builders_speech import load_paragraphs

    check_corpus(cfg["text"])
    paragraphs = [p for p in load_paragraphs(cfg["text"])[0] if len(p.split()) >= cfg["min_words"]]
    room = cfg["context"] - int(tok.add_bos) - int(tok.add_eos)
    if cfg["documents"] == "stream":
        if len(paragraphs) < 2:
            raise ValueError(f"text: {len(paragraphs)} paragraphs of {cfg['min_words']}+ words; need a training and "
                             "a held-out one")
        n_eval = max(1, int(len(paragraphs) * cfg["eval_fraction"]))
        held = "\n\n".join(paragraphs[-n_eval:])
        train, test = (_pieces(tok, ["\n\n".join(part)], room) for part in (paragraphs[:-n_eval], [held]))
        if not train or not test:
            raise ValueError(f"text: the run-on text makes {len(train)} training and {len(test)} held-out pieces of "
                             f"{cfg['context']} tokens; need one of each")
        return {"train": train[:cfg["limit_train"]], "test": test[:cfg["limit_eval"]], "stream": held}
    docs = _pieces(tok, paragraphs, room)
    if len(docs) < 2:
        raise ValueError(f"text: {len(docs)} paragraphs of {cfg['min_words']}+ words; need a training and a "
                         "held-out one")
    n_eval = max(1, int(len(docs) * cfg["eval_fraction"]))
    test = docs[-n_eval:][:cfg["limit_eval"]]
    return {"train": docs[:-n_eval][:cfg["limit_train"]], "test": test, "stream": "\n\n".join(test)}


def _pieces(tok: TextTokenizer, texts: Sequence[str], room: int) -> list[str]:
    """Each text kept whole when it has at most ``room`` tokens, else cut into decoded pieces of ``room`` tokens;
    a piece that re-encodes to more than ``room`` (or to none) is dropped."""
    docs: list[str] = []
    for p, enc in zip(texts, tok.hf.encode_batch(list(texts), add_special_tokens=False)):
        ids = enc.ids
        if len(ids) <= room:
            docs.append(p)
        else:  # decoded pieces re-encode to about as many tokens; one that grew past room is dropped below
            docs += [tok.decode(ids[i:i + room]) for i in range(0, len(ids), room)]
    lengths = [len(e.ids) for e in tok.hf.encode_batch(docs, add_special_tokens=False)]
    return [d for d, n in zip(docs, lengths) if 0 < n <= room]


def check_lengths(trunk: TrunkConfig, lengths: Sequence[int], what: str) -> None:
    """A learned position table cannot read a window longer than itself: refused (one line) before data."""
    if lengths and trunk.positions in ("learned", "learned_1d") and max(lengths) > trunk.max_positions:
        raise ValueError(f"eval_lengths: {max(lengths)} tokens is longer than {what}'s learned position table "
                         f"(max_positions {trunk.max_positions}); past it every position would read the table's "
                         f"last row. Give lengths <= {trunk.max_positions}, or train with positions='rope'")


def stream_ids(tok: TextTokenizer, text: str, n: int) -> tuple[list[int], int]:
    """(the first ``n`` token ids of ``text``, no specials; the UTF-8 bytes they decode to): what
    ``long_text_bpb`` scores. ValueError in one line when the text has fewer tokens."""
    ids = tok.hf.encode(text, add_special_tokens=False).ids
    if len(ids) < n:
        raise ValueError(f"eval_lengths: the held-out text has {len(ids)} tokens, fewer than the {n} the longest "
                         "length scores: raise eval_fraction (or limit_eval) or give shorter lengths")
    ids = ids[:n]
    return ids, len(tok.decode(ids).encode("utf-8"))


def windowed(omni: Any, before: int) -> Any:
    """A copy of a text LM whose every layer attends through a causal window of ``before`` tokens, same weights
    (the original is untouched). A RoPE model trained with full attention at its length reads longer texts so
    without meeting a distance it never saw (benchmarks/long_text.py: flat to 32x, where full attention fails)."""
    from omni.trunk import Trunk

    out = copy.deepcopy(omni)
    out.trunk = Trunk(replace(omni.trunk_config, attention={"kind": "window", "before": before, "after": 0}))
    out.trunk.load_state_dict(omni.trunk.state_dict())
    out.trunk_config = out.trunk.cfg
    return out.to(next(omni.parameters()).device).train(omni.training)


@torch.no_grad()
def long_text_bpb(omni: Any, head: str, tok: TextTokenizer, ids: Sequence[int], n_bytes: int, length: int,
                  chunk: int = 2048) -> dict[str, float]:
    """Bits per byte of ``ids`` read in windows of ``length`` tokens: each window is bos + the next length - 1
    ids (the last one shorter), one document per forward, so every length scores the same tokens (each predicted
    from bos and the ids before it in its window) over the same ``n_bytes``. The mask is "causal": SDPA's causal
    kernel for full layers (no T x T mask), a BlockMask on the banded path for attention-pattern layers (linear
    memory). The LM head runs ``chunk`` tokens at a time (a 32k x vocab logit matrix would be gigabytes)."""
    was = omni.training
    omni.eval()
    embed, lm, dev = omni.embedders["text"], omni.heads[head], next(omni.parameters()).device
    nll, windows = 0.0, 0
    try:
        for s in range(0, len(ids), length - 1):
            piece = torch.tensor([tok.bos_id, *ids[s:s + length - 1]], device=dev)
            hidden = omni.trunk(embed(piece)[None], mask="causal")[0]
            for c in range(0, len(piece) - 1, chunk):
                logits = lm(hidden[c:c + chunk][:len(piece) - 1 - c]).float()
                nll += float(F.cross_entropy(logits, piece[c + 1:c + 1 + chunk], reduction="sum"))
            windows += 1
    finally:
        omni.train(was)
    return {"bpb": nll / math.log(2) / max(n_bytes, 1), "nll": nll / max(len(ids), 1), "tokens": float(len(ids)),
            "bytes": float(n_bytes), "windows": float(windows)}


def unigram_bpb(tok: TextTokenizer, train: Sequence[str], test: Sequence[str]) -> float:
    """The baseline of the result line: bits per held-out UTF-8 byte of a unigram model of the training tokens
    (add-one smoothed over the vocabulary), scoring the tokens the LM predicts (each document's tokens, then eos)."""
    tail = [tok.eos_id] if tok.add_eos else []
    counts = Counter(i for e in tok.hf.encode_batch(list(train), add_special_tokens=False) for i in e.ids + tail)
    total = sum(counts.values()) + tok.vocab_size
    bits = -sum(math.log2((counts[i] + 1) / total)
                for e in tok.hf.encode_batch(list(test), add_special_tokens=False) for i in e.ids + tail)
    return bits / max(1, sum(len(t.encode("utf-8")) for t in test))


def byte_unigram_bpb(train: Sequence[str], test: Sequence[str]) -> float:
    """A second, tokenizer-free baseline: bits per held-out UTF-8 byte of a unigram model of the training bytes
    (add-one smoothed over the 256 byte values)."""
    counts = Counter(b"".join(t.encode("utf-8") for t in train))
    held = Counter(b"".join(t.encode("utf-8") for t in test))
    total = sum(counts.values()) + 256
    return -sum(n * math.log2((counts[b] + 1) / total) for b, n in held.items()) / max(1, sum(held.values()))


def samples_text(notes: Sequence[Any], step: int, steps: int, bpb: float | None, baseline: float) -> str:
    """samples/step_<N>.txt: a header with the step's held-out bits/byte and the baseline, then each held-out
    opening in [brackets] followed by the model's continuation (the notes' Markdown is **opening**continuation)."""
    scored = f"held-out {bpb:.4f} bits/byte, " if bpb is not None else ""
    lines = [(f"step {step} of {steps}: {scored}unigram baseline {baseline:.4f} bits/byte. Continuations of held-out "
              "openings (the opening in [brackets]; sampled at temperature 0.8, top-k 40, seed 0):"), ""]
    for note in notes:
        text = note.text
        end = text.find("**", 2) if text.startswith("**") else -1
        lines += [f"[{text[2:end]}]{text[end + 2:]}" if end >= 0 else text, ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Model


def from_init(cfg: dict) -> tuple[TextTokenizer, TrunkConfig, str, bool, dict[str, Any]]:
    """(tokenizer at ``context``, trunk, LM head name, tied, the source) of ``init``: one line when it is no
    text LM or its learned position table is shorter than ``context``."""
    path = cfg["init"]
    source = read_init(path, OMNI_BUILDER, "recipes/lm.py", "a text language model (an omni text-LM export or a "
                       "Hugging Face GPT-2 directory)")
    config, _, toks = source
    heads = config.get("heads", {})
    head = next(iter(heads), "")
    if set(toks) != {"text"} or not isinstance(toks["text"], TextTokenizer) or len(heads) != 1 \
            or heads[head].get("type") != "lm":  # as `omni convert --to hf` and `omni generate` read a text LM
        raise ValueError(f"init {path}: not a text language model (one text tokenizer and one LM head; it has "
                         f"tokenizers {', '.join(toks) or 'none'}, heads {', '.join(heads) or 'none'}); "
                         "recipes/lm.py starts from a text LM")
    trunk = TrunkConfig(**config["trunk"])
    if cfg["dropout"] is not None:
        trunk = replace(trunk, dropout=cfg["dropout"])
    tok = copy.copy(toks["text"])  # its vocabulary and specials, this run's document length
    tok.max_length = cfg["context"]
    return tok, trunk, head, "tie_to" in config["heads"][head], source


def check_context(trunk: TrunkConfig, context: int, what: str) -> None:
    """A learned position table must cover a whole document (beyond it, positions would repeat its last row)."""
    if trunk.positions in ("learned", "learned_1d") and trunk.max_positions < context:
        raise ValueError(f"context {context} is longer than {what}'s learned position table ({trunk.max_positions} "
                         f"positions): set context={trunk.max_positions} or less")


def build(cfg: dict, rank: int = 0, world: int = 1):
    """(model, train loader, train task, held-out task, export config) for a config: what main trains and
    what tests inspect."""
    source = None
    if cfg["init"]:
        tok, trunk, name, tied, source = from_init(cfg)
        check_context(trunk, cfg["context"], f"init {cfg['init']}")
    else:
        tok, name, tied = TextTokenizer(max_length=cfg["context"]), "lm", True
        trunk = preset(cfg["trunk"], **{"positions": cfg["positions"], "max_positions": cfg["context"],
                                        "dropout": cfg["dropout"] or 0.0, **cfg["trunk_overrides"]})
        check_context(trunk, cfg["context"], "the trunk")
    check_lengths(trunk, cfg["eval_lengths"], f"init {cfg['init']}" if cfg["init"] else "the trunk")
    check_causal(trunk.attention, trunk.n_layers)
    docs = documents(cfg, tok)
    train, test = (LMTask(name, tok, docs[split], tied=tied) for split in ("train", "test"))
    test.stream = docs["stream"]  # the held-out text run on, for eval_lengths
    torch.manual_seed(cfg["seed"])
    model = MultitaskModel([train], trunk)
    export = model.export_config()
    if source is not None:
        load_init(model.omni, source[1], cfg["init"])
        if "source" in source[0]:  # the HF config it came from: `omni convert --to hf` writes it back
            export["source"] = source[0]["source"]
    loader = MixtureLoader([train], row_length=cfg["row_length"], rows=cfg["rows"], seed=cfg["seed"], rank=rank,
                           world_size=world, num_workers=cfg["workers"])
    return model, loader, train, test, export


# ---------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    state = process_state()
    model, loader, train, test, export = build(cfg, state.process_index, state.num_processes)

    lengths = sorted(set(cfg["eval_lengths"]))
    long_ids = stream_ids(test.tokenizer, test.stream, max(lengths) - 1) if lengths else None  # before training
    baseline = unigram_bpb(train.tokenizer, train.texts, test.texts)
    byte_baseline = byte_unigram_bpb(train.texts, test.texts)
    scored: dict[int, float] = {}  # step -> held-out bits/byte, for the samples' header

    def held_out(model, step: int) -> dict[str, float]:
        """Bits per byte, perplexity and NLL over every held-out document (the same on every rank)."""
        r = test.evaluate(unwrap(model).omni, row_length=cfg["row_length"], rows=cfg["rows"])
        scored[step] = r["bpb"]
        return {"bpb": r["bpb"], "ppl": r["ppl"], "loss": r["nll"]}

    def samples(model, step: int) -> list[Any]:
        """The held-out continuations (TensorBoard text), also written to <out>/samples/step_<N>.txt (main
        process only: the Trainer calls this there)."""
        notes = test.samples(model.omni, cfg["samples"])
        if notes:
            folder = Path(cfg["out"]) / "samples"
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(folder / f"step_{step:0{len(str(cfg['steps']))}d}.txt",
                         samples_text(notes, step, cfg["steps"], scored.get(step), baseline))
        return notes

    config = train_config(cfg, warmup_steps=min(cfg["warmup_steps"], cfg["steps"]), run_name=f"lm-{cfg['preset']}")
    trainer = Trainer(model, multitask_loss, loader, config, model_metrics_fn=held_out,
                      samples_fn=samples, hparams=cfg,
                      export_config=export, export_tokenizers={"text": train.tokenizer},
                      export_module=lambda m: m.omni)
    if state.is_main_process:
        n_params = sum(p.numel() for p in unwrap(trainer.model).parameters())
        start_from = f"init {cfg['init']}" if cfg["init"] else "from scratch"
        print(f"LM preset {cfg['preset']} ({start_from}): {n_params / 1e6:.2f}M parameters, vocabulary "
              f"{train.tokenizer.vocab_size}, {len(train)} training / {len(test)} held-out documents, {cfg['steps']} "
              f"steps of {cfg['rows']} x {cfg['row_length']} tokens, {trainer.accelerator.device}; held-out unigram "
              f"baseline {baseline:.4f} bits/byte", flush=True)
    start = time.time()
    metrics = trainer.fit()
    if state.is_main_process:
        bpb = metrics.get("eval/bpb", float("nan"))

        def gap(base: float) -> str:
            return f"{abs(base - bpb):.4f} {'below' if bpb <= base else 'ABOVE'} it"

        print(f"done in {time.time() - start:.0f} s: train loss {metrics.get('train/loss', float('nan')):.4f}; held "
              f"out {bpb:.4f} bits/byte vs unigram baselines {baseline:.4f} (training-token frequencies; "
              f"{gap(baseline)}) and {byte_baseline:.4f} (training-byte frequencies; {gap(byte_baseline)}), token "
              f"perplexity {metrics.get('eval/ppl', float('nan')):.2f}; samples in "
              f"{Path(cfg['out']) / 'samples'}; model exported to {trainer.export_dir}", flush=True)
        metrics.update(unigram_bpb=baseline, byte_unigram_bpb=byte_baseline)
        if long_ids is not None:
            metrics.update(eval_lengths(cfg, unwrap(trainer.model).omni, train.name, test.tokenizer, *long_ids,
                                        lengths))
    return metrics


def eval_lengths(cfg: dict, omni: Any, head: str, tok: TextTokenizer, ids: list[int], n_bytes: int,
                 lengths: Sequence[int]) -> dict[str, float]:
    """``long_text_bpb`` at each length (with ``eval_window``: on ``windowed(omni, eval_window)``): printed, written
    to <out>/eval_lengths.json, returned as eval/bpb@<L>."""
    if cfg["eval_window"]:
        omni = windowed(omni, cfg["eval_window"])
    rows = []
    for n in lengths:
        start, cpu = time.time(), time.process_time()
        r = long_text_bpb(omni, head, tok, ids, n_bytes, n)
        rows.append({"length": n, **r, "seconds": time.time() - start, "cpu_seconds": time.process_time() - cpu})
        print(f"eval at {n} tokens: {r['bpb']:.4f} bits/byte ({r['windows']:.0f} windows, {rows[-1]['seconds']:.1f} s)",
              flush=True)
    write_atomic(Path(cfg["out"]) / "eval_lengths.json",
                 json.dumps({"context": cfg["context"], "documents": cfg["documents"], "window": cfg["eval_window"],
                             "tokens": len(ids),
                             "bytes": n_bytes, "rows": rows}, indent=1) + "\n")
    return {f"eval/bpb@{r['length']}": r["bpb"] for r in rows}


if __name__ == "__main__":
    run_recipe(main)
