"""recipes/lm.py: the tiny preset trains a text LM from scratch (the loss falls, held-out bits/byte and generated
continuations are logged, each evaluation's continuations written to samples/step_<N>.txt with its bits/byte and the
unigram baseline, which matches a hand count); started from a Hugging Face GPT-2 directory (tied or untied head) its
first training loss is HF's on the same packed batch and a few steps lower it, an untied head trains apart from the
table, the export goes back to HF with the same logits and `omni generate` runs on it; a bad init is one line."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import _interop
from _interop import o1_weights

from omni.cli import main as omni_main
from omni.export import load_config, load_pretrained

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
SIZE = dict(vocab_size=50257, n_positions=64, n_embd=64, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: train-mode losses are HF's eval losses
SENTENCES = ["It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
             "in want of a wife.", "The family of Dashwood had long been settled in Sussex.",
             "Emma Woodhouse, handsome, clever, and rich, seemed to unite some of the best blessings of existence.",
             "Sir Walter Elliot never took up any book but the Baronetage.",
             "No one who had ever seen Catherine Morland in her infancy would have supposed her born to be a heroine."]


def load_recipe():
    spec = importlib.util.spec_from_file_location("lm_recipe_test", ROOT / "recipes" / "lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recipe = load_recipe()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """60 paragraphs of two or three of the sentences, blank-line separated."""
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    paragraphs = [" ".join(SENTENCES[(i + k) % 5] for k in range(2 + i % 2)) for i in range(60)]
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def args(out: Path, corpus: Path, *extra: str) -> list[str]:
    return ["--preset", "tiny", "--out", str(out), "--set", "progress=False", f"text={[str(corpus)]!r}",
            "eval_fraction=0.1", *extra]


def step_losses(out: Path) -> list[float]:
    """Every step's training loss, from <out>/history.jsonl."""
    rows = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    return [x for r in rows for x in r.get("train/loss_per_step", [])]


def test_tiny_preset_from_scratch(corpus, tmp_path):
    out = tmp_path / "run"
    metrics = recipe.main(args(out, corpus, "steps=12", "log_every=4", "eval_every=6"))
    losses = step_losses(out)
    print(f"from scratch: loss {losses[0]:.3f} -> {losses[-1]:.3f}; held out {metrics['eval/bpb']:.3f} bits/byte, "
          f"perplexity {metrics['eval/ppl']:.1f}; unigram baseline {metrics['unigram_bpb']:.3f}")
    assert len(losses) == 12 and losses[-1] < losses[0] - 1.0
    assert 0 < metrics["eval/bpb"] and metrics["eval/ppl"] < 8192  # better than uniform over the vocabulary
    assert metrics["eval/bpb"] < metrics["byte_unigram_bpb"]  # 12 steps on five repeated sentences beat byte counts

    # samples/step_<N>.txt at each evaluation: that step's held-out bits/byte (as history.jsonl has it) and the
    # baseline in the header, then each held-out opening in [brackets] and a continuation
    rows = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    bpb = {r["step"]: r["eval/bpb"] for r in rows if "eval/bpb" in r}
    assert sorted(bpb) == [6, 12] and sorted(p.name for p in (out / "samples").iterdir()) == ["step_06.txt",
                                                                                                "step_12.txt"]
    held_out = recipe.documents(recipe.parse_args(args(out, corpus)), recipe.TextTokenizer(max_length=64))["test"]
    for step, value in bpb.items():
        text = (out / "samples" / f"step_{step:02d}.txt").read_text()
        header, *samples = [block for block in text.split("\n\n") if block.strip()]
        assert header.startswith(f"step {step} of 12: held-out {value:.4f} bits/byte, unigram baseline "
                                 f"{metrics['unigram_bpb']:.4f} bits/byte"), header
        assert len(samples) == 2
        for sample, doc in zip(samples, held_out):
            opening, continuation = sample[1:].split("]", 1)
            assert sample.startswith("[") and doc.startswith(opening) and len(opening) > 10 and continuation.strip()
    config = load_config(out / "final")
    assert config["heads"]["lm"]["tie_to"] == "text" and config["trunk"]["positions"] == "learned_1d"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    texts = {}
    for events in (out / "logs").rglob("events.out.tfevents*"):
        acc = EventAccumulator(str(events), size_guidance={"tensors": 0})
        acc.Reload()
        texts.update({t: acc.Tensors(t)[-1].tensor_proto.string_val[0].decode() for t in acc.Tags()["tensors"]
                      if t.startswith("lm/sample")})
    assert sorted(texts) == ["lm/sample0/text_summary", "lm/sample1/text_summary"]
    assert all(t.startswith("**") and len(t.split("**")[2]) > 0 for t in texts.values())  # prompt, continuation


def test_unigram_baselines_by_hand():
    """Training tokens "the", " the", " the" | "the", each document then eos: counts 2, 2, 2 of 6, add-one over
    the 8192-id vocabulary; the held-out "the" + eos cost -2 log2(3 / 8198) bits over its 3 bytes."""
    tok = recipe.TextTokenizer(max_length=64)
    assert [len(tok.hf.encode(t, add_special_tokens=False).ids) for t in ("the", " the")] == [1, 1]
    value = recipe.unigram_bpb(tok, ["the the the", "the"], ["the"])
    assert value == pytest.approx(-2 * math.log2(3 / (6 + 8192)) / 3, rel=1e-12)
    assert recipe.unigram_bpb(tok, ["the the the", "the"], ["the the"]) < value  # " the" is as likely, 4 bytes
    # over bytes: "aab" gives a 2 + 1, b 1 + 1 of 3 + 256
    assert recipe.byte_unigram_bpb(["aab"], ["ab"]) == pytest.approx(-(math.log2(3 / 259) + math.log2(2 / 259)) / 2)


def hf_dir(tmp_path: Path, tied: bool) -> tuple[GPT2LMHeadModel, Path]:
    """A random GPT-2 (O(1) weights, as tests/test_interop_gpt2.py's) saved with save_pretrained."""
    hf = GPT2LMHeadModel(GPT2Config(**SIZE, tie_word_embeddings=tied))
    o1_weights(hf, 0, embedding_std=lambda table: table.shape[1] ** -0.5)
    hf.save_pretrained(tmp_path / "hf")
    return hf, tmp_path / "hf"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_fine_tunes_a_hf_gpt2(corpus, tmp_path, capsys, tied):
    """First loss = HF's on the same batch; a few steps lower it; an untied head moves apart from the table; the
    export converts back to HF with its logits and generates."""
    from omni.pipelines.generate import load_lm
    from omni.mixture import MixtureLoader
    from omni.tasks import LMTask
    from omni.tokenizers.ranks import gpt2_tokenizer

    hf, path = hf_dir(tmp_path, tied)
    out = tmp_path / "run"
    argv = args(out, corpus, f"init={str(path)!r}", "context=64", "row_length=128", "steps=6", "log_every=3",
                "lr=2e-3", "warmup_steps=0", "samples=1")
    recipe.main(argv)
    losses = step_losses(out)

    # the same first batch: the recipe's documents, drawn by the mixture loader the recipe builds
    cfg = recipe.parse_args(argv)
    docs = recipe.documents(cfg, gpt2_tokenizer(max_length=64))
    task = LMTask("lm", gpt2_tokenizer(max_length=64), docs["train"])
    samples = MixtureLoader([task], row_length=128, rows=cfg["rows"], seed=cfg["seed"]).draw(0, 0)[0]
    nll, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids = s.segments[0].tokens[None]
            nll += hf(ids, labels=ids).loss.item() * (ids.shape[1] - 1)  # HF's mean over the predicted tokens
            count += ids.shape[1] - 1
    report = (f"GPT-2 init ({'tied' if tied else 'untied'}): first loss recipe {losses[0]:.6f}, HF {nll / count:.6f} "
          f"({len(samples)} documents); after 6 steps {losses[-1]:.4f}")
    assert abs(losses[0] - nll / count) <= 1e-4
    assert losses[-1] < losses[0] - 0.5

    export = out / "final"
    tuned = load_pretrained(export).state_dict()
    head, table = tuned["heads.lm.proj.weight"], tuned["embedders.text.token.weight"]
    if tied:
        assert torch.equal(head, table)
    else:  # its own weight, trained by its own gradient
        hf_head, hf_table = hf.lm_head.weight.detach(), hf.transformer.wte.weight.detach()
        assert not torch.equal(head, hf_head) and not torch.equal(table, hf_table)
        assert (head - hf_head - (table - hf_table)).abs().max() > 1e-4
        assert "tie_to" not in load_config(export)["heads"]["lm"]

    assert omni_main(["convert", "--to", "hf", str(export), str(tmp_path / "back")]) == 0
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    assert back.config.tie_word_embeddings == tied
    lm = load_lm(export)
    ids = samples[0].segments[0].tokens[None]
    with torch.no_grad():
        ours = lm.head(lm.features(ids, torch.arange(ids.shape[1])[None]))
        diff = (ours - back(ids).logits).abs().max().item()
    with capsys.disabled():  # (capsys holds the run's output)
        print(f"{report}; tuned export -> GPT2LMHeadModel: logits |omni - HF| max {diff:.2e}")
    assert diff <= 1e-4

    capsys.readouterr()
    assert omni_main(["generate", "--checkpoint", str(export), "--max-new-tokens", "5", "Emma Woodhouse"]) == 0
    assert capsys.readouterr().out.startswith("Emma Woodhouse")


def test_bad_inits_are_one_line(corpus, tmp_path, capsys, monkeypatch):
    from omni.export import save_pretrained
    from omni.tokenizers.image import ImageTokenizer
    from omni.trunk import TrunkConfig
    from omni.vision import ImageClassifier

    image = ImageTokenizer(4, image_size=8, policy="resize")
    vit = ImageClassifier(image, TrunkConfig(d_model=16, n_layers=1, n_heads=2), 3)
    save_pretrained(vit, tmp_path / "vit", vit.export_config(), tokenizers={"image": image})
    _, path = hf_dir(tmp_path, True)
    monkeypatch.setattr(sys, "argv", ["recipes/lm.py"])
    monkeypatch.delenv("OMNI_TRACEBACK", raising=False)
    capsys.readouterr()  # what writing the checkpoints printed
    for init, words in [(tmp_path / "vit", "a 'omni.vision:build_image_classifier' model; recipes/lm.py starts from "
                                           "a text language model"),
                        (path, "context 128 is longer than init")]:
        extra = ["context=128", "row_length=128"]
        with pytest.raises(SystemExit) as exc:
            recipe.run_recipe(lambda: recipe.main(args(tmp_path / "o", corpus, f"init={str(init)!r}", *extra)))
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    assert "learned position table (64 positions)" in err


def test_muon_trains_the_trunk_matrices_and_adamw_the_tied_table(corpus, tmp_path, capsys, monkeypatch):
    """optimizer=muon (the cpu preset's): Muon takes the trunk's attention and MLP matrices, AdamW the embedding
    table (the tied LM head), positions, norms and biases; a few tiny steps lower the loss as AdamW's do. A bad
    optimizer name is argparse's usage and one error line, exit 2."""
    from omni.optimizers import muon_parameters

    cpu = recipe.parse_args(["--preset", "cpu"])
    assert (cpu["optimizer"], cpu["positions"]) == ("muon", "rope")
    cfg = recipe.parse_args(args(tmp_path / "b", corpus, "optimizer=muon"))
    model = recipe.build(cfg)[0]
    ids = muon_parameters(model)
    muon = sorted(n for n, p in model.named_parameters() if id(p) in ids)
    n_layers = model.omni.trunk_config.n_layers
    assert muon == sorted(f"omni.trunk.blocks.{i}.{m}.weight" for i in range(n_layers)
                          for m in ("attn.qkv", "attn.out", "mlp.up", "mlp.down"))
    table = model.omni.embedders["text"].token.weight
    assert model.omni.heads["lm"].proj.weight is table and id(table) not in ids  # the tied head stays on AdamW
    out = tmp_path / "run"
    metrics = recipe.main(args(out, corpus, "steps=12", "log_every=4", "eval_every=12", "optimizer=muon"))
    losses = step_losses(out)
    assert len(losses) == 12 and losses[-1] < losses[0] - 1.0
    assert metrics["eval/bpb"] < metrics["byte_unigram_bpb"]
    monkeypatch.setattr(sys, "argv", ["recipes/lm.py"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        recipe.run_recipe(lambda: recipe.main(args(tmp_path / "o", corpus, "optimizer=sgd")))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.strip().splitlines()[-1] == ("recipes/lm.py: error: optimizer must be 'adamw' "
                                                                   "or 'muon', got 'sgd'"), err
