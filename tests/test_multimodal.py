"""recipes/multimodal.py + omni/multitask.py on CPU: one trunk trained on image classification, speech
recognition, offline RL and text LM at once, every batch packing all four; packed == each document alone
(prefix-LM included); per-task metrics in TensorBoard; a plug-in modality joins by config only; 2 gloo ranks
end with identical parameters.

    torchrun --standalone --nproc-per-node 2 tests/test_multimodal.py CACHE OUT    # the 2-rank worker
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `omni` when run as the torchrun worker

from omni.multitask import MixedBatch, MixtureLoader, pack_mixed  # noqa: E402

MODALITIES = {"image", "audio", "text", "trajectory"}
TASKS = ("image", "asr", "rl", "text")


def load_recipe():
    spec = importlib.util.spec_from_file_location("multimodal_recipe", ROOT / "recipes" / "multimodal.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    """The tiny preset's data, built once (speech synthesised + encoded, CartPole recorded, Austen filtered)."""
    path = tmp_path_factory.mktemp("multimodal-cache")
    recipe = load_recipe()
    recipe.build_tasks(recipe.parse_args(["--preset", "tiny", "--set", f"cache={str(path)!r}"]))
    return path


@pytest.fixture(scope="session")
def tiny(cache):
    recipe = load_recipe()
    cfg = recipe.parse_args(["--preset", "tiny", "--set", f"cache={str(cache)!r}"])
    torch.set_num_threads(1)
    model, train, evaluation, tasks = recipe.build(cfg)
    return cfg, model, train, evaluation, tasks


def tiny_args(cache: Path, out: Path, *extra: str) -> list[str]:
    return ["--preset", "tiny", "--out", str(out), "--set", f"cache={str(cache)!r}", "progress=False", *extra]


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
    # deterministic per (seed, epoch, index, rank); ranks and indices differ
    assert train.batch(0, 0).keys == batch.keys
    assert train.batch(0, 1).keys != batch.keys
    other = MixtureLoader(train.tasks, row_length=cfg["row_length"], rows=cfg["rows"], seed=cfg["seed"], rank=1,
                          world_size=2)
    assert other.batch(0, 0).keys != batch.keys


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
        image_logits = model.omni.heads["image"](hidden, batch, "image")
        worst = 0.0
        for d, i in enumerate(order):
            alone = pack_mixed([samples[i]], [tasks[i]], names)
            h = model.omni(alone)
            mine = hidden[batch.document == d]
            assert mine.shape[0] == len(samples[i])
            worst = max(worst, (mine - h[alone.document == 0]).abs().max().item())
            if names[tasks[i]] == "image":
                seg = int((batch.segment_document["image"] == d).nonzero()[0])
                solo = model.omni.heads["image"](h, alone, "image")[0]
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


def test_tiny_preset_trains_every_task_with_per_task_metrics(cache, tmp_path):
    recipe = load_recipe()
    out = tmp_path / "run"
    metrics = recipe.main(tiny_args(cache, out, "steps=60", "log_every=4", "eval_batches=2"))
    for t in TASKS:
        for name in ("loss", "token_share", "documents"):
            assert f"train/{t}/{name}" in metrics and np.isfinite(metrics[f"train/{t}/{name}"])
        assert f"eval/{t}/loss" in metrics and np.isfinite(metrics[f"eval/{t}/loss"])
    assert {"train/image/accuracy", "train/rl/accuracy", "train/asr/token_accuracy", "train/text/token_accuracy"} \
        <= set(metrics)
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
    # The export is a plain OmniModel with every head, loadable without training code.
    from omni.export import load_pretrained

    model = load_pretrained(out / "final")
    assert set(model.heads) == set(TASKS) and set(model.embedders) == MODALITIES
    assert model.heads["asr"].proj.weight is model.embedders["text"].token.weight


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
    recipe = load_recipe()
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
    env = dict(os.environ, PYTHONPATH=str(ROOT), ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           str(cache), str(tmp_path / "ddp")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun timed out\n{out[-3000:]}\n{err[-5000:]}")
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
    recipe = load_recipe()
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
