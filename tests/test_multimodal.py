"""recipes/multimodal.py with omni/multitask.py, omni/tasks/ and omni/mixture.py on CPU: one trunk trained on image
classification, speech recognition, offline RL and text LM at once, every batch packing all four; packed == each
document alone (prefix-LM included); per-task metrics in TensorBoard; a plug-in modality joins by config only; 2
gloo ranks end with identical parameters. Task metrics as the single-task recipes measure them: image accuracy and text
perplexity == a per-item computation; prefix-LM greedy decoding with the KV cache == the packed forward, and
recovers overfit transcripts exactly (CER 0); the optional CTC head reads each clip's own audio span of a packed
batch and round-trips through the export; rollouts through the shared trunk == re-encoding per step; the
tiny preset prints one table row per task; ``only`` trains one task through the same recipe.

    torchrun --standalone --nproc-per-node 2 tests/test_multimodal.py CACHE OUT    # the 2-rank worker
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _launch import gloo_env, run_group

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `omni` when run as the torchrun worker

from omni.mixture import MixedBatch, MixtureLoader, eval_batches, pack_mixed  # noqa: E402
from omni.multitask import MultitaskModel  # noqa: E402
from omni.tasks import ClassifyTask, LMTask, PrefixLMTranscriber, TrajectoryPolicy, TranscribeTask  # noqa: E402
from conftest import load_recipe  # noqa: E402

MODALITIES = {"image", "audio", "text", "trajectory"}
TASKS = ("image", "asr", "rl", "text")


def load_multimodal():
    return load_recipe("multimodal", "multimodal_recipe")


# conftest.py: one torch thread; no Debian data package needed: Fashion-MNIST is conftest's tiny stand-in through
# OMNI_FASHION_MNIST_DIR (the recipe has no entry for its folder), the text corpus goes in by the `text` entry.
pytestmark = pytest.mark.usefixtures("one_thread", "fashion_mnist_env")


def data_sets(cache: Path) -> list[str]:
    """``--set`` entries for the tiny preset's data: the cache folder and the text corpus kept in it (so the
    torchrun workers, given the folder, pass the same corpus)."""
    corpus = [str(p) for p in sorted((cache / "corpus").glob("*.txt"))]
    return [f"cache={str(cache)!r}", f"text={corpus!r}"]


@pytest.fixture(scope="module")
def cache(fashion_mnist_env, tmp_path_factory) -> Path:
    """The tiny preset's data, built once (speech synthesised + encoded, CartPole recorded, text filtered)."""
    path = tmp_path_factory.mktemp("multimodal-cache")
    shutil.copytree(fashion_mnist_env.text, path / "corpus")
    recipe = load_multimodal()
    recipe.build_tasks(recipe.parse_args(["--preset", "tiny", "--set", *data_sets(path)]))
    return path


@pytest.fixture(scope="module")
def tiny(cache):
    recipe = load_multimodal()
    cfg = recipe.parse_args(["--preset", "tiny", "--set", *data_sets(cache)])
    torch.set_num_threads(1)
    model, train, evaluation, tasks = recipe.build(cfg)
    return cfg, model, train, evaluation, tasks


def tiny_args(cache: Path, out: Path, *extra: str) -> list[str]:
    return ["--preset", "tiny", "--out", str(out), "--set", *data_sets(cache), "progress=False", *extra]


def scalars(out: Path, run: str = "multimodal-tiny") -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "logs" / run), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# ----------------------------------------------------------------------------------------------------


def test_mixed_batch_packs_every_modality_and_task(tiny):
    cfg, _, train, _, _ = tiny
    batch = train.batch(0, 0)
    assert isinstance(batch, MixedBatch)
    assert set(batch.tokens) == MODALITIES
    assert batch.shape == (cfg["rows"], cfg["row_length"])
    counts = torch.bincount(batch.document_task, minlength=4).tolist()
    assert all(c >= 1 for c in counts), counts
    assert batch.num_tokens > 0.9 * cfg["rows"] * cfg["row_length"]  # the budget is (nearly) filled
    # ASR documents are [audio, text] with the text causal after the bidirectional audio (prefix-LM)
    asr = batch.task_names.index("asr")
    doc = int((batch.document_task == asr).nonzero()[0])
    where = batch.document == doc
    assert batch.causal[where].float().mean() < 1 and batch.causal[where].any()
    # the tiny preset's asr task trains a CTC head too: its byte labels ride along as the audio targets
    assert task_named(train.tasks, "asr").ctc_weight == 0.3 and "audio" in batch.targets
    # deterministic per (seed, epoch, index, rank); ranks and indices differ
    assert train.batch(0, 0).keys == batch.keys
    assert train.batch(0, 1).keys != batch.keys
    other = MixtureLoader(train.tasks, row_length=cfg["row_length"], rows=cfg["rows"], seed=cfg["seed"], rank=1,
                          world_size=2)
    assert other.batch(0, 0).keys != batch.keys


def test_text_losses_on_their_own_rows_equal_the_static_shape_losses(tiny, monkeypatch):
    """Eager, a text task's LM head runs on its own target rows only (the vocabulary-wide matmul was the largest
    cost of a CPU step, run once per text task on every text token); the same loss and token accuracy as the
    static-shape path torch.compile takes (every text token, others weighted 0)."""
    _, model, train, _, _ = tiny
    batch = train.batch(0, 0)
    with torch.no_grad():
        loss, metrics = model(batch)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        static_loss, static = model(batch)
    torch.testing.assert_close(loss, static_loss, atol=1e-5, rtol=1e-5)
    for name in ("asr/loss", "asr/token_accuracy", "text/loss", "text/token_accuracy"):
        torch.testing.assert_close(metrics[name], static[name], atol=1e-5, rtol=1e-5)
    assert float(metrics["text/loss"]) > 5 and float(metrics["asr/loss"]) > 5  # untrained: near ln(8192) = 9


def test_loader_resumes_exactly(tiny):
    cfg, _, train, _, _ = tiny
    a = MixtureLoader(train.tasks, row_length=cfg["row_length"], rows=cfg["rows"], batches_per_epoch=4, seed=3)
    it = iter(a)
    first = [next(it).keys for _ in range(3)]
    state = a.state_dict()
    rest = [b.keys for b in it]
    b = MixtureLoader(train.tasks, row_length=cfg["row_length"], rows=cfg["rows"], batches_per_epoch=4, seed=3)
    b.load_state_dict(state)
    assert state == {"epoch": 0, "batches_done": 3}
    assert [x.keys for x in b] == rest and len(rest) == 1
    assert b.state_dict() == {"epoch": 1, "batches_done": 0}
    b.set_epoch(0)
    assert [x.keys for x in b][:3] == first


def test_packed_documents_equal_each_document_alone(tiny):
    cfg, model, train, _, _ = tiny
    model.eval()
    samples, tasks, rows = train.draw(0, 5)
    names = train.task_names
    batch = pack_mixed(samples, tasks, names, cfg["row_length"], rows)
    order = [i for row in rows for i in row]
    with torch.no_grad():
        hidden = model.omni(batch)
        loss, metrics = model(batch)
        assert torch.isfinite(loss)
        image_logits = model.omni.forward_head(hidden, batch, "image", "image")
        worst = 0.0
        for d, i in enumerate(order):
            alone = pack_mixed([samples[i]], [tasks[i]], names)
            h = model.omni(alone)
            mine = hidden[batch.document == d]
            assert mine.shape[0] == len(samples[i])
            worst = max(worst, (mine - h[alone.document == 0]).abs().max().item())
            if names[tasks[i]] == "image":
                seg = int((batch.segment_document["image"] == d).nonzero()[0])
                solo = model.omni.forward_head(h, alone, "image", "image")[0]
                torch.testing.assert_close(image_logits[seg], solo, atol=1e-5, rtol=1e-5)
    assert worst < 1e-4, worst
    # The prefix-LM: a transcript token sees the whole clip; the clip never sees its transcript.
    asr = next(i for i in order if names[tasks[i]] == "asr")
    ref = pack_mixed([samples[asr]], [0], names)
    changed = pack_mixed([samples[asr]], [0], names)
    audio_n = changed.tokens["audio"].shape[0]
    changed.tokens["audio"] = changed.tokens["audio"].clone()
    changed.tokens["audio"][-1] += 1.0  # the LAST audio frame: bidirectional, so every token of the clip moves
    text_changed = pack_mixed([samples[asr]], [0], names)
    text_changed.tokens["text"] = text_changed.tokens["text"].clone()
    text_changed.tokens["text"][-1] = 7  # the last text token: nothing before it may move
    with torch.no_grad():
        h0, h1, h2 = (model.omni(b).reshape(-1, model.omni.trunk_config.d_model) for b in (ref, changed, text_changed))
    a_idx, t_idx = ref.index["audio"], ref.index["text"]
    assert (h1[a_idx[0]] - h0[a_idx[0]]).abs().max() > 1e-4  # first frame sees the last one
    assert (h1[t_idx] - h0[t_idx]).abs().amax(-1).min() > 1e-4  # every text token sees the audio
    torch.testing.assert_close(h2[a_idx], h0[a_idx], atol=0, rtol=0)  # audio never sees the text
    torch.testing.assert_close(h2[t_idx[:-1]], h0[t_idx[:-1]], atol=0, rtol=0)  # text is causal
    assert audio_n == a_idx.numel()
    model.train()


def test_tiny_preset_trains_every_task_with_per_task_metrics(cache, tmp_path, capsys):
    recipe = load_multimodal()
    out = tmp_path / "run"
    metrics = recipe.main(tiny_args(cache, out, "steps=60", "log_every=4", "eval_batches=2"))
    # One Markdown row per task with its held-out metric, also in results.json and TensorBoard.
    printed = capsys.readouterr().out.splitlines()
    rows = [line for line in printed if line.startswith("| ")]
    # Log lines stay readable: a step's ~20 per-task metrics are one line per task (omni.progress.metric_lines).
    steps = [i for i, line in enumerate(printed) if line.startswith("step 60/60: ")]
    assert len(steps) == 1 and [line.split(":")[0] for line in printed[steps[0] + 1:steps[0] + 5]] == \
        [f"  {t}" for t in sorted(TASKS)]
    assert max(len(line) for line in printed if not line.startswith("| ")) < 250
    assert rows[0].startswith("| task | metric | value")
    assert [r.split("|")[1].strip() for r in rows[1:]] == list(TASKS)
    assert [r.split("|")[2].strip() for r in rows[1:]] == ["top-1 accuracy (%)", "CER (%)", "normalised score",
                                                           "perplexity (token)"]
    results = json.loads((out / "results.json").read_text())
    r = results["results"]
    assert results["table"].splitlines()[2:] == rows[1:] and results["tasks"] == list(TASKS)
    assert r["image"]["items"] == 256 and 0.1 < r["image"]["accuracy"] <= 1  # 10 classes: above chance
    assert r["asr"]["utterances"] == 8 and 0 <= r["asr"]["cer"] and np.isfinite(r["asr"]["wer"])
    assert r["rl"]["episodes"] == 5 and np.isfinite(r["rl"]["score_mean"]) and r["rl"]["return_mean"] >= 8
    assert 1 < r["text"]["ppl"] < 8192 and 0 < r["text"]["bpb"] < 8  # below uniform over the vocabulary
    assert metrics["eval/image/test_accuracy"] == pytest.approx(r["image"]["accuracy"], rel=1e-6)
    assert metrics["eval/asr/test_cer"] == pytest.approx(r["asr"]["cer"], rel=1e-6)
    for t in TASKS:
        for name in ("loss", "token_share", "documents"):
            assert f"train/{t}/{name}" in metrics and np.isfinite(metrics[f"train/{t}/{name}"])
        assert f"eval/{t}/loss" in metrics and np.isfinite(metrics[f"eval/{t}/loss"])
    assert {"train/image/accuracy", "train/rl/accuracy", "train/asr/token_accuracy", "train/text/token_accuracy",
            "train/asr/ctc_loss", "eval/asr/ctc_loss"} <= set(metrics)
    assert 0 <= r["asr"]["ctc_cer"] and metrics["eval/asr/test_ctc_cer"] == pytest.approx(r["asr"]["ctc_cer"], rel=1e-6)
    assert "CTC CER" in rows[2].split("|")[5]
    # Each row says what chance or a simple baseline scores, so a number is never read alone.
    assert rows[0].startswith("| task | metric | value | chance / baseline |")
    assert [r.split("|")[4].split()[0] for r in rows[1:]] == ["chance", "empty", "random", "unigram"]
    b = results["baselines"]
    assert b["image"]["chance"] == 0.1 and b["asr"]["empty_cer"] == 1.0 and 0.3 < b["asr"]["other_sentence_cer"] < 1
    assert b["rl"]["expert_return"] == 500 and b["rl"]["random_return"] < 50
    # the run's time split: data build, training, task metrics (per task), baselines, and their total
    tm = results["time"]
    assert set(tm["per_task"]) == set(TASKS) and tm["task_metrics"] == pytest.approx(sum(tm["per_task"].values()), abs=0.2)
    assert tm["training"] > 0 and min(tm["data_build"], tm["baselines"]) >= 0  # rounded: 0.0 when fast
    assert tm["total"] == pytest.approx(tm["data_build"] + tm["training"] + tm["task_metrics"] + tm["baselines"], abs=0.5)
    assert any(line.startswith("time: data build ") for line in printed)
    # the unigram counts the tokens LMTask.evaluate predicts: bits/byte = log2(ppl) x tokens / bytes
    assert 1 < b["text"]["unigram_ppl"] < 8192
    assert b["text"]["unigram_bpb"] == pytest.approx(np.log2(b["text"]["unigram_ppl"]) * r["text"]["tokens"]
                                                     / r["text"]["bytes"], rel=1e-9)
    logged = scalars(out)  # the per-task curves are in TensorBoard
    # Every task learns. Measured (60 steps, 2 x 512 tokens): image 2.29 -> 1.81, asr 8.9 -> 5.0,
    # rl 0.69 -> 0.64 (CartPole; RL-only batches reach 0.54), text 8.9 -> 6.4.
    factor = {"image": 0.9, "asr": 0.7, "rl": 0.96, "text": 0.8}
    for t in TASKS:
        curve = logged[f"train/{t}/loss"]
        assert len(curve) == 15 and all(np.isfinite(curve))
        assert np.mean(curve[-4:]) < factor[t] * curve[0], (t, curve)
    shares = sum(logged[f"train/{t}/token_share"][-1] for t in TASKS)
    assert 0.9 < shares <= 1.0
    for tag in ("image/test_accuracy", "asr/test_cer", "asr/test_wer", "rl/test_score_mean", "text/test_ppl",
                "text/test_bpb"):
        assert len(logged[f"eval/{tag}"]) == 1  # eval_every=0: the final evaluation only
    # The export is a plain OmniModel with every head, loadable without training code.
    from omni.export import load_pretrained

    model = load_pretrained(out / "final")
    assert set(model.heads) == {*TASKS, "asr_ctc"} and set(model.embedders) == MODALITIES
    assert model.heads["asr"].proj.weight is model.embedders["text"].token.weight
    assert model.heads["asr_ctc"].proj.weight.shape == (257, model.trunk_config.d_model)
    # Predictions name the classes: the export records them (omni predict prints them) and the samples show them.
    exported = json.loads((out / "final" / "config.json").read_text())
    assert exported["tasks"]["image"]["class_names"][:2] == ["T-shirt/top", "Trouser"]
    assert (out / "samples" / "image_predictions.png").is_file()


# ----------------------------------------------------------------------------------------------------
# Task metrics: each task measured as its single-task recipe measures it


def task_named(tasks, name: str):
    return next(t for t in tasks if t.name == name)


@pytest.fixture(scope="module")
def asr_overfit(tiny):
    """A fresh tiny trunk trained on three training clips alone (60 full-batch steps, about 2 s): every
    transcript token right under teacher forcing."""
    _, _, _, _, tasks = tiny
    asr = task_named(tasks["train"], "asr")
    three = TranscribeTask("asr", asr.audio, asr.text, asr.clips[:3], asr.transcripts[:3])
    torch.manual_seed(0)
    model = MultitaskModel([three], preset_tiny())
    batch = pack_mixed([three.sample(i, None) for i in range(3)], [0, 0, 0], ("asr",))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(60):
        loss, metrics = model(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return three, model, metrics


def preset_tiny():
    from omni.trunk import preset

    return preset("tiny", positions="rope2d")


def test_asr_greedy_decoding_recovers_overfit_transcripts(asr_overfit):
    three, model, metrics = asr_overfit
    assert metrics["asr/token_accuracy"] == 1.0 and metrics["asr/loss"] < 0.2
    assert three.evaluate(model.omni, batch_size=3, max_new_tokens=64) == {"cer": 0.0, "wer": 0.0, "utterances": 3.0}
    assert three.transcribe(model.omni, batch_size=2, max_new_tokens=64) == list(three.transcripts)
    # The token limit stops a row that never says eos: at most max_new_tokens ids, the rest cut.
    short = three.transcribe(model.omni, max_new_tokens=3)
    assert all(0 < len(s) < len(t) and t.startswith(s) for s, t in zip(short, three.transcripts)), short


def test_asr_cached_decoding_equals_the_packed_forward(asr_overfit, tiny):
    """The three training clips and three held-out ones, all of different lengths, in one padded batch: the
    KV-cached prefix-LM (audio written once, bidirectional, pads invisible; text positions continuing at each
    clip's own length) gives the hidden states of the training computation (Packer + packed mask) and the
    same greedy tokens, batched or alone."""
    from omni.speech import greedy_decode, pad_audio

    three, model, _ = asr_overfit
    test = task_named(tiny[4]["test"], "asr")
    clips = TranscribeTask("asr", test.audio, test.text, [*three.clips, *test.clips[:3]],
                           [*three.transcripts, *test.transcripts[:3]])
    n = len(clips)
    assert len({len(clips.audio_segment(i)) for i in range(n)}) == n  # padding differs per row
    model.eval()
    dec = PrefixLMTranscriber.for_task(model.omni, clips)
    frames, mask = pad_audio([clips.audio_segment(i).tokens for i in range(n)])
    memory = dec.encode(frames, mask)
    text = torch.tensor([dec.prompt + [100, 2000, 37, 512]] * n)
    with torch.no_grad():
        reference = dec.decode_hidden(text, memory, mask)  # packed, no cache
        cache = dec.new_cache(memory, text.shape[1])
        first = dec.decode_hidden(text[:, :3], memory, mask, cache)  # audio prefix + 3 text tokens
        rest = [dec.decode_hidden(text[:, t:t + 1], None, mask, cache) for t in range(3, text.shape[1])]
    torch.testing.assert_close(torch.cat([first, *rest], 1), reference, atol=2e-5, rtol=1e-4)
    guards = dict(max_new_tokens=12)
    with torch.no_grad():
        cached = greedy_decode(dec, dec.encode(frames, mask), mask, **guards)
        packed = greedy_decode(dec, dec.encode(frames, mask), mask, use_cache=False, **guards)
    assert cached == packed
    assert len({tuple(row) for row in cached[:3]}) == 3 and min(map(len, cached)) >= 5, cached  # real transcripts
    assert all(len(row) <= 12 for row in cached)
    texts = [test.text.decode(row) for row in cached]
    assert clips.transcribe(model.omni, batch_size=1, **guards) == texts  # alone == in a padded batch
    model.train()


def test_image_accuracy_and_text_perplexity_equal_per_item_computation(tiny):
    import copy

    _, model, _, _, tasks = tiny
    omni = copy.deepcopy(model.omni)
    torch.manual_seed(1)
    torch.nn.init.normal_(omni.heads["image"].proj.weight, std=1.0)  # the zero-init head predicts class 0 only
    test = task_named(tasks["test"], "image")
    image = ClassifyTask("image", test.tokenizer, test.items[:64], test.labels[:64], 10)
    got = image.evaluate(omni, row_length=512, rows=1)  # 64 images of 16 patches: two packed batches
    batches = list(eval_batches([image.sample(i, None) for i in range(40)], 256, 2))  # 16 per row
    assert [b.shape for b in batches] == [(2, 256), (2, 256)]  # the training shape, also when partly padding
    assert [b.num_documents for b in batches] == [32, 8] and batches[0].keys[:2] == ["image/0", "image/1"]
    predicted, nll = [], 0.0
    with torch.no_grad():
        for i in range(64):
            alone = pack_mixed([image.sample(i, None)], [0], ("image",))
            logits = omni.forward_head(omni(alone), alone, "image", "image")
            predicted.append(int(logits.argmax(-1)[0]))
            nll += F.cross_entropy(logits, torch.tensor([image.labels[i]])).item()
    correct = sum(p == y for p, y in zip(predicted, image.labels))
    assert len(set(predicted)) >= 3 and correct > 0, predicted  # a non-trivial classifier
    assert got["accuracy"] == correct / 64 and got["items"] == 64
    assert got["loss"] == pytest.approx(nll / 64, rel=1e-5)
    # Text: perplexity over every predicted token (bos given), bits per UTF-8 byte of the raw paragraphs.
    corpus = task_named(tasks["test"], "text")
    docs = LMTask("text", corpus.tokenizer, corpus.texts[:6])
    got = docs.evaluate(omni, row_length=512, rows=1)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(6):
            alone = pack_mixed([docs.sample(i, None)], [0], ("text",))
            logits = omni.heads["text"](omni(alone)[0, :len(alone.tokens["text"])])
            total += F.cross_entropy(logits, alone.targets["text"], ignore_index=-100, reduction="sum").item()
            tokens += len(alone.tokens["text"]) - 1  # every token but bos is predicted
    n_bytes = sum(len(t.encode("utf-8")) for t in docs.texts)
    assert got["tokens"] == tokens and got["documents"] == 6 and got["bytes"] == n_bytes
    assert got["ppl"] == pytest.approx(np.exp(total / tokens), rel=1e-5)
    assert got["bpb"] == pytest.approx(total / np.log(2) / n_bytes, rel=1e-5)


def test_rl_rollouts_with_the_mixed_model(tiny):
    from omni.rl import make_envs, normalized_score, rollout

    _, model, _, _, tasks = tiny
    rl = task_named(tasks["test"], "rl")
    assert rl.env_id == "CartPole-v1" and rl.reference[0] < rl.reference[1]
    got = rl.evaluate(model.omni, seeds=range(10_000, 10_005))
    assert got["episodes"] == 5 and got["target"] == rl.reference[1]  # the expert reference return
    assert all(np.isfinite(v) for v in got.values())
    assert got["score_mean"] == pytest.approx(normalized_score(got["return_mean"], *rl.reference))
    # The policy adapter reads the trunk as training does: its output on a window == the packed forward's.
    policy = TrajectoryPolicy(model.omni, rl)
    sample = rl.sample(0, np.random.default_rng(0))
    batch = pack_mixed([sample], [0], ("rl",))
    with torch.no_grad():
        packed = rl.predict(model.omni, model.omni(batch), batch)
        alone = policy(sample.segments[0].tokens[None])[0]
    torch.testing.assert_close(alone, packed, atol=1e-5, rtol=1e-4)
    # KV-cached rollouts (window sliding past context=5) == re-encoding the running context every step.
    runs = [rollout(policy, rl.tokenizer, make_envs("CartPole-v1", 2), [3, 4], targets=[rl.reference[1]] * 2,
                    max_steps=30, cache=c, record=True) for c in (True, False)]
    assert runs[0].lengths.max() > rl.tokenizer.context
    np.testing.assert_array_equal(runs[0].returns, runs[1].returns)
    np.testing.assert_allclose(np.stack(runs[0].outputs), np.stack(runs[1].outputs), atol=1e-5)


def test_only_trains_one_task_through_the_same_recipe(cache, tmp_path, monkeypatch):
    recipe = load_multimodal()
    cfg = recipe.parse_args(tiny_args(cache, tmp_path / "x", "only='rl'"))
    assert list(cfg["tasks"]) == ["rl"]
    model, train, _, _ = recipe.build(cfg)
    assert set(model.omni.heads) == {"rl"} and set(model.omni.embedders) == {"trajectory"}
    batch = train.batch(0, 0)
    assert batch.task_names == ("rl",) and set(batch.tokens) == {"trajectory"}
    assert batch.shape == (cfg["rows"], cfg["row_length"])  # the same token budget per step as the mix
    with pytest.raises(SystemExit):
        recipe.parse_args(tiny_args(cache, tmp_path / "x", "only='video'"))
    # One command: train the image task alone; eval_tasks="end" measures task metrics at the last eval only.
    calls = []
    measure = recipe.task_metrics
    monkeypatch.setattr(recipe, "task_metrics", lambda *a: calls.append(1) or measure(*a))
    out = tmp_path / "image"
    metrics = recipe.main(tiny_args(cache, out, "only='image'", "steps=4", "log_every=2", "eval_every=2",
                                    "eval_batches=1", "eval_tasks='end'", "report_to='none'"))
    assert len(calls) == 1 and "eval/image/loss" in metrics
    assert "eval/image/test_accuracy" in metrics and not any(k.startswith("eval/asr") for k in metrics)
    assert list(json.loads((out / "results.json").read_text())["results"]) == ["image"]


def test_every_preset_parses_and_a_dotted_override_reaches_one_task(cache):
    recipe = load_multimodal()
    for name in recipe.PRESETS:
        cfg = recipe.parse_args(["--preset", name])
        assert cfg["tasks"] and all("loss_weight" in spec for spec in cfg["tasks"].values()), name
    assert set(recipe.parse_args(["--preset", "cpu-4tasks"])["tasks"]) == {"image", "asr", "rl", "text"}
    cfg = recipe.parse_args(["--preset", "tiny", "--set", *data_sets(cache), "tasks.text.loss_weight=2"])
    assert cfg["tasks"]["text"]["max_tokens"] == 96  # the preset's other entries of that task stay
    tasks = {t.name: t for t in recipe.build_tasks(cfg)["train"]}
    assert tasks["text"].loss_weight == 2.0 and tasks["image"].loss_weight == 1.0


def test_joint_loss_is_the_loss_weighted_sum_of_task_mean_losses(tiny):
    _, model, train, _, _ = tiny
    batch = train.batch(0, 0)
    with torch.no_grad():
        total, metrics = model(batch)
        losses = {t.name: metrics[f"{t.name}/loss"] for t in model.tasks}
        assert torch.allclose(total, sum(losses.values()), rtol=1e-6)
        text = next(t for t in model.tasks if t.name == "text")
        text.loss_weight = 2.0
        try:
            doubled, _ = model(batch)
        finally:
            text.loss_weight = 1.0
    assert torch.allclose(doubled, total + losses["text"], rtol=1e-6) and losses["text"] > 0


def test_speech_shards_source_reads_the_whisper_dataset(tmp_path, tiny_corpora):
    """The default asr source: recipes/whisper.py's shards (here 3 + 2 clips), the same clips and transcripts."""
    from omni.data.builders_speech import build_speech_synth
    from omni.data.reader import ShardLoader

    recipe = load_multimodal()
    shards = tmp_path / "speech"
    build_speech_synth(shards, train=3, test=2, text=tiny_corpora.text_files(), seed=0, workers=1, quiet=True)
    cfg = recipe.parse_args(["--preset", "tiny", "--set", f"cache={str(tmp_path / 'cache')!r}"])
    assert recipe.TASKS["asr"]["source"] == "speech-shards"
    cfg["tasks"] = {"asr": dict(recipe.TASKS["asr"], shards=str(shards))}
    tasks = recipe.build_tasks(cfg)
    for split, n in (("train", 3), ("test", 2)):
        loader = ShardLoader(shards, lambda s: s["txt"].decode().strip(), list, 8, split=split, rank=0, world_size=1,
                             shuffle=False)
        (asr,) = tasks[split]
        assert len(asr) == n and list(asr.transcripts) == [t for b in loader for t in b]
        assert all(len(asr.audio_segment(i)) > 20 for i in range(n))
    assert len(list((tmp_path / "cache").glob("speech-shards-*.pt"))) == 1  # encoded once, cached


# ----------------------------------------------------------------------------------------------------
# Hybrid CTC/attention for the prefix-LM ASR task (synthetic log-mel tokens: no data, fast)

CTC_TEXTS = ["The cat sat.", "A red ball!", "Where is my hat?"]


@pytest.fixture(scope="module")
def speech_toks():
    from omni.tokenizers.audio import AudioTokenizer
    from omni.tokenizers.text import TextTokenizer

    return AudioTokenizer(), TextTokenizer()


def audio_clip(audio, n: int, seed: int):
    from omni.segment import Segment

    g = torch.Generator().manual_seed(seed)
    return Segment("audio", torch.randn(n, audio.n_mels * audio.kernel, generator=g), torch.arange(n), audio.role)


def ctc_model(speech_toks, ctc_weight: float, frames=(60, 45, 52), texts=CTC_TEXTS):
    """(asr task, text task, model): three synthetic clips, an LM task beside them, a tiny trunk (seed 0)."""
    audio, text = speech_toks
    clips = [audio_clip(audio, n, seed) for seed, n in enumerate(frames)]
    asr = TranscribeTask("asr", audio, text, clips, texts, ctc_weight=ctc_weight)
    lm = LMTask("text", text, ["Some words of a paragraph.", "More text here, and more."])
    torch.manual_seed(0)
    return asr, lm, MultitaskModel([asr, lm], preset_tiny())


def ctc_reference(model, asr, hidden, batch, docs):
    """Mean over asr documents ``docs`` of F.ctc_loss / label length, each read straight off its own audio span
    (the first tokens of its document in the packed row), one document at a time: no padding, no indices."""
    from omni.speech import CTC_BLANK, ctc_labels

    per = []
    for d, i in docs:
        n = len(asr.audio_segment(i))
        h = hidden[batch.document == d][:n]  # the document's tokens in row order: its audio span comes first
        lp = model.omni.heads["asr_ctc"](h).float().log_softmax(-1)[:, None]  # (n, 1, 257)
        ids = ctc_labels(asr.transcripts[i])[None]
        nll = F.ctc_loss(lp, ids, torch.tensor([n]), torch.tensor([ids.shape[1]]), blank=CTC_BLANK,
                         reduction="sum", zero_infinity=True)
        per.append(nll / ids.shape[1])
    return torch.stack(per).mean()


def test_ctc_weight_zero_is_the_plain_prefix_lm(speech_toks):
    """ctc_weight=0 (the default): no CTC head, no labels on the audio, today's parameters and metrics; > 0 adds
    exactly one head (Linear d -> 257, untied) and leaves every other parameter as it was."""
    from omni.speech import CTC_BLANK

    asr, lm, plain = ctc_model(speech_toks, 0.0)
    audio, text = speech_toks
    torch.manual_seed(0)
    default = MultitaskModel([TranscribeTask("asr", audio, text, asr.clips, asr.transcripts), lm], preset_tiny())
    assert set(plain.omni.heads) == set(default.omni.heads) == {"asr", "text"}
    assert plain.export_config()["heads"] == default.export_config()["heads"]
    a, b = plain.state_dict(), default.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert asr.metric_names == ("token_accuracy",) and asr.sample(0, None).segments[0].targets is None
    batch = pack_mixed([asr.sample(0, None), lm.sample(0, None)], [0, 1], ("asr", "text"))
    _, metrics = plain(batch)
    assert "audio" not in batch.targets and "asr/ctc_loss" not in metrics

    asr_ctc, _, model = ctc_model(speech_toks, 0.3)
    assert asr_ctc.metric_names == ("token_accuracy", "ctc_loss")
    assert set(model.omni.heads) == {"asr", "asr_ctc", "text"}
    head = model.omni.heads["asr_ctc"].proj
    assert head.weight.shape == (CTC_BLANK + 1, model.omni.trunk_config.d_model) and head.bias is None
    assert head.weight is not model.omni.embedders["text"].token.weight
    assert model.export_config()["heads"]["asr_ctc"] == {"type": "lm", "vocab_size": 257}
    c = model.state_dict()
    assert set(c) - set(a) == {"omni.heads.asr_ctc.proj.weight"} and set(a) <= set(c)
    assert all(torch.equal(a[k], c[k]) for k in a)  # the head is made last: the rest is the plain model
    with pytest.raises(ValueError, match="ctc_weight"):
        TranscribeTask("asr", audio, text, asr.clips, asr.transcripts, ctc_weight=-0.1)


def test_ctc_loss_reads_each_asr_audio_span_of_a_packed_batch(speech_toks):
    """Two clips of different lengths packed in one row with a text document between them: the task's CTC term
    equals F.ctc_loss on each clip's own audio hidden states (nothing of the other documents, no padding), its
    labels the normalised transcript's bytes, and the task loss = 0.7 x text cross-entropy + 0.3 x CTC."""
    from omni.speech import ctc_labels
    from omni.tokenizers.text import IGNORE_INDEX

    asr, lm, model = ctc_model(speech_toks, 0.3)
    _, _, plain = ctc_model(speech_toks, 0.0)  # same seed: the same parameters but the CTC head
    samples = [asr.sample(0, None), lm.sample(1, None), asr.sample(1, None)]
    batch = pack_mixed(samples, [0, 1, 0], ("asr", "text"), row_length=256, rows=[[0, 1, 2]])
    assert batch.shape == (1, 256) and batch.document[0, :60].eq(0).all() and batch.num_documents == 3
    labels = batch.targets["audio"]
    for seg, (i, n) in enumerate([(0, 60), (1, 45)]):
        want = ctc_labels(CTC_TEXTS[i])
        mine = labels[batch.segment_of["audio"] == seg]
        assert mine.shape == (n,) and torch.equal(mine[:len(want)], want) and (mine[len(want):] == IGNORE_INDEX).all()
    assert bytes(ctc_labels(CTC_TEXTS[1]).tolist()) == b"a red ball"
    loss, metrics = model(batch)
    hidden = model.omni(batch)
    ref = ctc_reference(model, asr, hidden, batch, [(0, 0), (2, 1)])
    assert 10 < ref.item() < 60  # untrained: ~ (frames / label bytes) x ln 257 per byte
    torch.testing.assert_close(metrics["asr/ctc_loss"], ref.detach(), rtol=1e-5, atol=1e-5)
    _, plain_metrics = plain(batch)
    torch.testing.assert_close(metrics["asr/loss"], 0.7 * plain_metrics["asr/loss"] + 0.3 * ref.detach(), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(metrics["text/loss"], plain_metrics["text/loss"], rtol=0, atol=0)
    torch.testing.assert_close(loss.detach(), metrics["asr/loss"] + metrics["text/loss"], rtol=1e-6, atol=1e-6)
    # Gradients reach the CTC head, and the audio embedder through the trunk, as the per-clip reference's do.
    head = model.omni.heads["asr_ctc"].proj.weight
    embed = next(model.omni.embedders["audio"].parameters())
    got = torch.autograd.grad(asr.ctc_loss(model.omni, hidden, batch, 0), [head, embed], retain_graph=True)
    want = torch.autograd.grad(ref, [head, embed])
    for g, w in zip(got, want):
        assert torch.isfinite(g).all() and g.abs().sum() > 0
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    model.zero_grad()
    loss.backward()
    assert head.grad is not None and head.grad.abs().sum() > 0


def test_ctc_unalignable_samples_warn_and_stay_finite(speech_toks):
    """A clip with fewer audio tokens than label bytes is named in a warning and trains without a CTC term; one
    long enough in tokens but not for its repeats (a blank must separate "aa") costs 0 (zero_infinity) and
    counts in the mean, as F.ctc_loss's own "mean" counts it."""
    asr, lm, model = ctc_model(speech_toks, 0.3, frames=(60, 8, 2), texts=[CTC_TEXTS[0], "far too long", "aa"])
    with pytest.warns(UserWarning, match="'asr/1' has 12 CTC label bytes but only 8 audio tokens"):
        short = asr.sample(1, None)
    assert (short.segments[0].targets == -100).all()
    batch = pack_mixed([asr.sample(0, None), short, asr.sample(2, None), lm.sample(0, None)], [0, 0, 0, 1],
                       ("asr", "text"))
    loss, metrics = model(batch)
    hidden = model.omni(batch)
    ref = ctc_reference(model, asr, hidden, batch, [(0, 0)])
    assert torch.isfinite(loss) and torch.isfinite(metrics["asr/ctc_loss"])
    torch.testing.assert_close(metrics["asr/ctc_loss"], ref.detach() / 2, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_ctc_head_export_round_trip_and_ctc_cer(speech_toks, tmp_path):
    """The CTC head is rebuilt from the export's head specs with the same weights (same CTC loss on a batch);
    ``evaluate`` adds ``ctc_cer``: the CER of best-path decoding of clips padded together (by length), equal
    to decoding each clip's packed forward alone."""
    from omni.export import load_pretrained, save_pretrained
    from omni.multitask import merge_tokenizers
    from omni.segment import Sample
    from omni.speech import ctc_greedy_decode, error_rates

    asr, lm, model = ctc_model(speech_toks, 0.3)
    torch.nn.init.normal_(model.omni.heads["asr_ctc"].proj.weight, std=0.5)  # a head that says something
    save_pretrained(model.omni, tmp_path / "final", model.export_config(), tokenizers=merge_tokenizers([asr, lm]))
    loaded = load_pretrained(tmp_path / "final")
    assert set(loaded.heads) == {"asr", "asr_ctc", "text"}
    assert loaded.heads["asr"].proj.weight is loaded.embedders["text"].token.weight
    assert loaded.heads["asr_ctc"].proj.weight is not loaded.embedders["text"].token.weight
    a, b = model.omni.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    batch = pack_mixed([asr.sample(i, None) for i in range(3)], [0, 0, 0], ("asr", "text"))
    model.eval()
    with torch.no_grad():
        before = asr.ctc_loss(model.omni, model.omni(batch), batch, 0)
        after = asr.ctc_loss(loaded, loaded(batch), batch, 0)
    torch.testing.assert_close(after, before, rtol=0, atol=0)

    alone = []
    with torch.no_grad():
        for i in range(3):
            one = pack_mixed([Sample([asr.audio_segment(i)], key=f"asr/{i}")], [0], ("asr",))
            h = loaded.heads["asr_ctc"](loaded(one)[0, :len(asr.audio_segment(i))])
            alone.extend(ctc_greedy_decode(h[None]))
    assert loaded.heads["asr_ctc"] is not None and asr.ctc_transcribe(loaded, batch_size=3) == alone
    assert len(set(alone)) == 3 and min(map(len, alone)) > 5, alone  # real (random) transcripts, all different
    got = asr.evaluate(loaded, batch_size=2, max_new_tokens=4)
    assert set(got) == {"cer", "wer", "utterances", "ctc_cer"}
    assert got["ctc_cer"] == error_rates(CTC_TEXTS, alone)["cer"] and got["ctc_cer"] > 0
    plain_asr, _, plain = ctc_model(speech_toks, 0.0)
    assert "ctc_cer" not in plain_asr.evaluate(plain.omni, batch_size=3, max_new_tokens=4)


# ----------------------------------------------------------------------------------------------------
# A fifth modality through the plug-in API, by config only


@pytest.fixture
def plugin_with_data(installed_plugin, monkeypatch):
    """The time-series plug-in (tests/conftest.py) plus this module on sys.path for its data callable."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def sine_series(split: str, seed: int, n: int = 256) -> tuple[list[np.ndarray], list[int]]:
    """Data callable for the plug-in task: class 0 slow sine (period 32), class 1 fast (period 6)."""
    rng = np.random.default_rng([seed, split == "test"])
    items, labels = [], []
    for _ in range(n):
        y = int(rng.integers(2))
        t = np.arange(int(rng.integers(48, 97)))
        wave = np.sin(2 * np.pi * t / [32, 6][y] + rng.uniform(0, 2 * np.pi)) + 0.1 * rng.standard_normal(t.size)
        items.append(wave.astype(np.float32)[:, None])
        labels.append(y)
    return items, labels


def test_plugin_modality_joins_the_mix_by_config_only(plugin_with_data, cache, tmp_path):
    recipe = load_multimodal()
    task = {"kind": "classify", "tokenizer": "timeseries", "tokenizer_kwargs": {"channels": 1, "patch": 8},
            "data": "test_multimodal:sine_series", "data_kwargs": {"n": 128}, "n_classes": 2, "weight": 1.0}
    args = tiny_args(cache, tmp_path / "run", f"extra_tasks={{'ts': {task!r}}}", "steps=40", "log_every=4",
                     "eval_batches=1", "weights={'ts': 2.0}")
    cfg = recipe.parse_args(args)
    _, train, _, _ = recipe.build(cfg)
    batch = train.batch(0, 0)
    assert set(batch.tokens) == MODALITIES | {"timeseries"}
    metrics = recipe.main(args)
    curve = scalars(tmp_path / "run")["train/ts/loss"]
    assert np.isfinite(metrics["eval/ts/loss"]) and "train/ts/accuracy" in metrics
    assert np.mean(curve[-3:]) < 0.6 * curve[0], curve
    assert metrics["train/ts/accuracy"] > 0.8


# ----------------------------------------------------------------------------------------------------
# 2 gloo ranks (torchrun; `accelerate launch --cpu --num_processes 2` would start ONE process)


def test_two_ranks_end_with_identical_parameters(cache, tmp_path):
    env = gloo_env(PYTHONPATH=str(ROOT), ACCELERATE_USE_CPU="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           str(cache), str(tmp_path / "ddp")]
    proc = run_group(cmd, env, 150, "torchrun")
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    ranks = [json.loads((tmp_path / "ddp" / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world"] == ranks[1]["world"] == 2
    assert ranks[0]["params"] == ranks[1]["params"]  # bitwise-equal parameters on both ranks
    assert ranks[0]["params"] != ranks[0]["init"]  # and training moved them
    assert ranks[0]["first_keys"] != ranks[1]["first_keys"]  # each rank drew its own batches
    assert (tmp_path / "ddp" / "run" / "final" / "model.safetensors").is_file()


def test_fsdp2_accelerate_config_parses():
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(ROOT / "recipes" / "accelerate_fsdp2.yaml"))
    assert cfg.distributed_type == "FSDP" and cfg.mixed_precision == "bf16"
    assert cfg.fsdp_config["fsdp_version"] == 2
    assert cfg.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "Block"
    from omni import trunk

    assert isinstance(getattr(trunk, "Block"), type)  # the class the config wraps exists under that name


def _params_digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _worker(cache: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    recipe = load_multimodal()
    out_dir = Path(out)
    record: dict = {}
    original = recipe.build

    def build(cfg, rank=0, world=1):  # note the initial parameters and this rank's first batch
        model, train, evaluation, tasks = original(cfg, rank, world)
        record["init"] = _params_digest(model)
        record["first_keys"] = train.batch(0, 0).keys
        return model, train, evaluation, tasks

    recipe.build = build

    def on_trained(trainer) -> None:
        from omni.train import unwrap

        record.update(params=_params_digest(unwrap(trainer.model)), world=dist.get_world_size())
        dist.barrier()

    recipe.main(tiny_args(Path(cache), out_dir / "run", "steps=6", "log_every=3", "eval_batches=1",
                          "report_to='none'"), on_trained=on_trained)
    rank = int(os.environ["RANK"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])


def test_a_run_killed_after_its_export_writes_its_results_on_a_rerun(cache, tmp_path, capsys):
    """A kill after the export landed but before the recipe wrote results.json / metrics.json (or, from an older
    omni, before train_results.json and curves.png): every re-run reported "image loss nan" and never wrote
    results.json. Now the re-run measures the tasks on the export (or evaluates the final checkpoint again) and
    writes them, with the numbers of the uninterrupted run."""
    recipe = load_multimodal()
    out = tmp_path / "run"
    args = tiny_args(cache, out, "only='image'", "steps=2", "eval_batches=1", "eval_tasks='end'", "checkpoint_every=2",
                     "report_to='none'")
    recipe.main(args)
    first = json.loads((out / "results.json").read_text())["results"]
    first_metrics = json.loads((out / "metrics.json").read_text())
    assert (out / "curves.png").is_file() and 0 < first["image"]["accuracy"] <= 1
    capsys.readouterr()
    for lost in (("results.json", "metrics.json"),  # killed between the Trainer's export and the recipe's files
                 ("results.json", "metrics.json", "train_results.json", "curves.png")):  # an older omni's order
        for name in lost:
            (out / name).unlink()
        metrics = recipe.main(args)
        printed = capsys.readouterr().out
        assert "nan" not in printed and f"image loss {first_metrics['train/image/loss']:.3f}" in printed, printed
        again = json.loads((out / "results.json").read_text())["results"]
        assert {k: v for k, v in again["image"].items() if k != "seconds"} == \
            {k: v for k, v in first["image"].items() if k != "seconds"}
        assert metrics["eval/image/test_accuracy"] == first["image"]["accuracy"]
        assert all((out / name).is_file() for name in lost)
        written = json.loads((out / "metrics.json").read_text())
        assert {k: written[k] for k in first_metrics if k != "seconds"} == \
            {k: v for k, v in first_metrics.items() if k != "seconds"}


def test_an_image_patch_that_does_not_divide_28_is_one_line(cache, capsys):
    recipe = load_multimodal()
    with pytest.raises(SystemExit) as stop:
        recipe.parse_args(["--preset", "tiny", "--set", *data_sets(cache), "tasks.image.patch=5"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "tasks.image.patch 5 must divide the 28-pixel Fashion-MNIST images" in err
    assert recipe.parse_args(["--preset", "tiny", "--set", *data_sets(cache), "tasks.image.patch=14"])[
        "tasks"]["image"]["patch"] == 14


def test_evaluations_score_the_same_held_out_batches_after_a_resume(cache, tmp_path):
    """The held-out MixtureLoader draws each epoch's batches anew: every evaluation now reads its first epoch
    (omni.evaluation.held_position), so a run stopped at step 2 and resumed logs the eval losses of an
    uninterrupted run. Before, the straight run's evaluation k scored epoch k - 1 while the resumed run started
    over at epoch 0: its last two evaluations differed."""
    import signal

    from omni.evaluation import read_history
    from omni.train import Trainer, TrainingInterrupted

    recipe = load_multimodal()

    def run(out):
        return recipe.main(tiny_args(cache, out, "only='image'", "steps=4", "eval_every=1", "eval_batches=1",
                                     "eval_tasks=False", "log_every=1", "report_to='none'"))

    def evaluations(out):
        return [(r["step"], r["eval/loss"]) for r in read_history(out / "history.jsonl") if "eval/loss" in r]

    run(tmp_path / "straight")
    straight = evaluations(tmp_path / "straight")
    assert [s for s, _ in straight] == [1, 2, 3, 4]
    real_step = Trainer._train_step

    def stop_at_2(self):  # a Ctrl-C during step 2: it finishes, checkpoints and stops
        record = real_step(self)
        if self.step + 1 == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return record

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "_train_step", stop_at_2)
        with pytest.raises(TrainingInterrupted):
            run(tmp_path / "resumed")
    run(tmp_path / "resumed")
    assert evaluations(tmp_path / "resumed") == straight


def test_a_task_entry_the_task_never_reads_is_one_line(capsys):
    """tasks.image.env='x' (dict or dotted form) was silently ignored; an entry left over from a preset when the
    user switches a task's source is not the user's mistake and stays accepted."""
    mm = load_multimodal()
    for argv in (["--set", "tasks.image.env=x"],
                 ["--set", "tasks={'image': {'kind': 'classify', 'source': 'fashion-mnist', 'patch': 7, 'env': 'x'}}"]):
        with pytest.raises(SystemExit) as exc:
            mm.parse_args(["--preset", "tiny", *argv])
        assert exc.value.code == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert "tasks.image.env: a classify task from source 'fashion-mnist' does not read it" in line, line
    cfg = mm.parse_args(["--preset", "tiny", "--set", "tasks.asr.source=speech-shards", "tasks.asr.shards=x"])
    assert cfg["tasks"]["asr"]["source"] == "speech-shards"


def test_the_corpus_cache_tag_follows_the_files_of_a_text_folder(tmp_path):
    mm = load_multimodal()
    (tmp_path / "corpus").mkdir()
    page = tmp_path / "corpus" / "a.txt"
    page.write_text("One two three four.\n")
    before = mm.corpus_tag([str(tmp_path / "corpus")])
    assert mm.corpus_tag([str(tmp_path / "corpus")]) == before
    page.write_text("One two three four five six.\n")
    assert mm.corpus_tag([str(tmp_path / "corpus")]) != before
