"""The training loop: 2 ranks == 1 rank with the doubled batch, stop + resume == straight through
(bitwise on CPU, with dropout, for a stateful loader, an Accelerate-prepared DataLoader and the real
ShardLoader), a SIGKILL during a checkpoint write, NaN handling, schedule, logging and export."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import _train_worker as W
from _launch import gloo_env, run_group
from omni.packing import Packer
from omni.export import build_omni_model, load_config, load_pretrained, load_tokenizers, save_pretrained
from omni.train import (NonFiniteLossError, ResumeMismatchError, RunExistsError, TrainConfig, Trainer,
                        config_differences, default_param_groups, flatten_config, latest_checkpoint, list_checkpoints,
                        lr_multiplier)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = str(HERE / "_train_worker.py")


def _env() -> dict[str, str]:
    return gloo_env(PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}", ACCELERATE_USE_CPU="1")


def _torchrun(*args: str, extra_env: dict | None = None, timeout: int = 90,
              script: str = WORKER) -> subprocess.CompletedProcess:
    """torchrun with 2 gloo ranks in its own session, so a hang is killed whole (no orphaned ranks)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, *args]
    return run_group(cmd, {**_env(), **(extra_env or {})}, timeout, f"torchrun {args[0]}")


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs by {(a[k] - b[k]).abs().max().item():.3g}"


# ----------------------------------------------------------------------------------------------------
# Multi-process: 2 gloo ranks with half batches == 1 process with the whole batch


def test_two_ranks_equal_one_rank_with_doubled_batch(tmp_path):
    proc = _torchrun("ddp", str(tmp_path / "ddp"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ddp = json.loads((tmp_path / "ddp" / "results.json").read_text())

    x, y = W.mlp_data(10, seed=7)
    eval_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    trainer, _ = W.run_mlp(tmp_path / "one", steps=6, global_batch=8, fit=False, eval_data=eval_loader,
                           checkpoint_every=3)
    xl, yl = W.mlp_data(16, seed=8)
    before = trainer.evaluate(W.ListLoader(xl, yl, 8))
    one = trainer.fit()

    # Same parameters after 6 AdamW steps (grad_accum 2, clipping, warmup + cosine, weight decay):
    # only the order of the float32 sums differs (gloo all-reduce), so agree to 1e-6.
    a, b = _weights(tmp_path / "ddp" / "run" / "final"), _weights(tmp_path / "one" / "final")
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-6, worst
    assert max((a[k] - _weights(tmp_path / "one" / "checkpoints" / "step-000003")[k]).abs().max().item()
               for k in a) > 1e-3  # and training moved them
    # Eval: the prepared DataLoader (10 samples over 2 ranks: the padding duplicates dropped by
    # gather_for_metrics) and a rank-local loader (sums reduced over ranks) give the 1-process numbers.
    for key in ("eval/loss", "eval/acc"):
        assert ddp["fit"][key] == pytest.approx(one[key], abs=1e-6)
        assert ddp["before"][key] == pytest.approx(before[key], abs=1e-6)
    assert ddp["fit"]["train/loss"] == pytest.approx(one["train/loss"], abs=1e-6)
    assert ddp["fit"]["train/samples_per_s"] > 0
    # The checkpoints of the 2-rank run hold one RNG file and one data position per rank.
    ck = tmp_path / "ddp" / "run" / "checkpoints" / "step-000006"
    assert {p.name for p in ck.glob("data_state_rank*.json")} == {"data_state_rank0.json", "data_state_rank1.json"}
    assert len(list(ck.glob("random_states_*.pkl"))) == 2


def test_nan_on_one_rank_stops_every_rank(tmp_path):
    # Global batch 8 of step 3 = sorted permutation position 4..5 of epoch 0; find a key that rank 1 sees then.
    x, y = W.mlp_data(48)
    loader = W.ListLoader(x, y, 8, rank=1, world=2)
    batches = [b for _, b in zip(range(6), iter(loader))]
    poison = batches[4]["keys"][1]  # step 3, first micro-batch, rank 1
    proc = _torchrun("nan", str(tmp_path / "nan"), extra_env={"POISON_KEY": poison}, timeout=120)
    assert proc.returncode != 0
    for rank in (0, 1):
        msg = (tmp_path / "nan" / f"error_rank{rank}.txt").read_text()
        assert "non-finite loss at step 3" in msg
        assert "rank 1 micro-batch 0" in msg and poison in msg
    assert [s for s, _ in list_checkpoints(tmp_path / "nan" / "run")] == [2]
    assert not (tmp_path / "nan" / "run" / "final").exists()


# ----------------------------------------------------------------------------------------------------
# Exact resume


@pytest.mark.parametrize("n, stop_step", [(40, 3), (32, 2)], ids=["mid-epoch", "epoch-boundary"])
def test_resume_is_bitwise_identical(tmp_path, n, stop_step):
    """6 steps straight == 3 (or 2) steps, process stops, new Trainer resumes, 3 more. With dropout,
    grad_accum 2, epoch rollover (5 or 4 batches per epoch) and evaluation in between."""
    x, y = W.mlp_data(12, seed=9)
    ev = lambda: W.ListLoader(x, y, 4)  # noqa: E731
    straight, res = W.run_mlp(tmp_path / "a", steps=6, n=n, dropout=0.3, eval_data=ev(), eval_every=2)
    stopper = W.StopAfter(W.mlp_loss, calls=2 * stop_step)
    with pytest.raises(W.StopAfter.Stop):
        W.run_mlp(tmp_path / "b", steps=6, n=n, dropout=0.3, loss_fn=stopper, checkpoint_every=stop_step,
                  eval_data=ev(), eval_every=5)
    assert latest_checkpoint(tmp_path / "b").name == f"step-{stop_step:06d}"
    resumed, res_b = W.run_mlp(tmp_path / "b", steps=6, n=n, dropout=0.3, model_seed=123,
                               checkpoint_every=stop_step, eval_data=ev(), eval_every=5)
    assert resumed.step == 6
    _assert_equal(_weights(tmp_path / "a" / "final"), _weights(tmp_path / "b" / "final"))
    assert res_b["train/loss"] == res["train/loss"] and res_b["eval/loss"] == res["eval/loss"]
    assert resumed.scheduler.scheduler.last_epoch == 6  # one scheduler step per optimizer step


def test_resume_with_prepared_shuffled_dataloader(tmp_path):
    """A plain DataLoader (shuffle=True) is prepared by Accelerate: seeded per epoch, skipped on resume."""
    x, y = W.mlp_data(40)
    ds = torch.utils.data.TensorDataset(x, y)

    def loader():
        return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True)

    def loss(model, batch):
        xb, yb = batch
        return nn.functional.cross_entropy(model(xb), yb)

    W.run_mlp(tmp_path / "a", steps=6, loader=loader(), loss_fn=loss, dropout=0.3)
    with pytest.raises(W.StopAfter.Stop):
        W.run_mlp(tmp_path / "b", steps=6, loader=loader(), loss_fn=W.StopAfter(loss, 6), checkpoint_every=3,
                  dropout=0.3)
    W.run_mlp(tmp_path / "b", steps=6, loader=loader(), loss_fn=loss, checkpoint_every=3, dropout=0.3, model_seed=5)
    _assert_equal(_weights(tmp_path / "a" / "final"), _weights(tmp_path / "b" / "final"))
    state = json.loads((tmp_path / "b" / "checkpoints" / "step-000003" / "data_state_rank0.json").read_text())
    assert (state["epoch"], state["position"], state["loader"]) == (1, 1, None)  # 6 micro-batches, 5 per epoch


def _vec_trainer(out: Path, data, steps: int, loss_fn=None, **cfg) -> Trainer:
    torch.manual_seed(cfg.pop("model_seed", 0))
    task = W.VecClassifier(dropout=0.1)
    config = TrainConfig(output_dir=str(out), steps=steps, lr=3e-3, grad_accum=2, log_every=2, progress=False,
                         mixed_precision="no", report_to="none", **cfg)
    export = {"builder": "omni", "trunk": W.trunk_config(0.1).to_dict(),
              "heads": {"cls": {"type": "classification", "n_classes": 3, "pool": "mean"}}}
    return Trainer(task, loss_fn, data, config, export_config=export,
                   export_tokenizers={W.VEC: W.TrainVecTokenizer()}, export_module=lambda t: t.model)


def test_resume_with_shard_loader_and_packed_batches(tmp_path):
    """The real ShardLoader (rank-local, stateful) collating PackedBatches for an OmniModel task."""
    from omni.data.reader import ShardLoader

    urls = W.write_vec_shards(tmp_path / "shards")

    def loader():
        return ShardLoader(urls, W.decode_vec, Packer(block_size=16), batch_size=4, rank=0, world_size=1, seed=1)

    _vec_trainer(tmp_path / "a", loader(), 7).fit()
    stop = W.StopAfter(lambda m, b: m(b), calls=8)
    with pytest.raises(W.StopAfter.Stop):
        _vec_trainer(tmp_path / "b", loader(), 7, loss_fn=stop, checkpoint_every=4).fit()
    state = json.loads((tmp_path / "b" / "checkpoints" / "step-000004" / "data_state_rank0.json").read_text())
    # 8 batches per epoch, all used: the loader already names epoch 1 while our counter waits for the
    # end of the iterator; resume follows the loader.
    assert (state["epoch"], state["position"]) == (0, 8)
    assert state["loader"]["epoch"] == 1 and state["loader"]["batches_done"] == 0
    out = _vec_trainer(tmp_path / "b", loader(), 7, checkpoint_every=4, model_seed=9).fit()
    assert out["step"] == 7
    _assert_equal(_weights(tmp_path / "a" / "final"), _weights(tmp_path / "b" / "final"))


# ----------------------------------------------------------------------------------------------------
# Crash safety and NaN


def test_sigkill_during_checkpoint_write_keeps_previous_checkpoint(tmp_path):
    out = tmp_path / "kill"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, WORKER, "killsave", str(out)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (out / "hanging").exists():
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the worker never reached the checkpoint write"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    ckroot = out / "run" / "checkpoints"
    assert (ckroot / ".tmp-step-000004" / "model.safetensors").stat().st_size == 64  # the torn write
    assert [s for s, _ in list_checkpoints(out / "run")] == [2]
    # Resuming uses step 2 (the torn temp dir is ignored, then cleaned) and ends where a run that was
    # never killed ends.
    W.run_mlp(out / "run", steps=6, checkpoint_every=2, dropout=0.2, report_to="none", model_seed=77)
    W.run_mlp(tmp_path / "straight", steps=6, checkpoint_every=2, dropout=0.2, report_to="none")
    _assert_equal(_weights(out / "run" / "final"), _weights(tmp_path / "straight" / "final"))
    assert not any(p.name.startswith(".") for p in ckroot.iterdir())
    assert [s for s, _ in list_checkpoints(out / "run")] == [4, 6]  # keep_checkpoints=2


def test_nan_loss_raises_before_the_step_and_saves_nothing_corrupt(tmp_path):
    torch.manual_seed(0)
    task = W.VecClassifier(dropout=0.0)
    batches = W.packed_batches(W.vec_samples(40))  # 10 PackedBatches with keys v0..v39
    poison = "v21"  # batch 5 = step 3, micro-batch 1

    def loss(model, batch):
        value, metrics = model(batch)
        return (value * float("nan") if poison in batch.keys else value), metrics

    cfg = TrainConfig(output_dir=str(tmp_path), steps=6, grad_accum=2, checkpoint_every=2, progress=False,
                      mixed_precision="no", report_to="none")
    trainer = Trainer(task, loss, batches, cfg)
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit()
    msg = str(err.value)
    assert "non-finite loss at step 3" in msg and "micro-batch 1 (epoch 0, batch 5 of the epoch)" in msg
    assert "'v20', 'v21', 'v22', 'v23'" in msg and "step-000002" in msg
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2] and not (tmp_path / "final").exists()
    # The parameters are those of the step-2 checkpoint: the optimizer did not step on NaN gradients.
    saved = _weights(tmp_path / "checkpoints" / "step-000002")
    current = task.state_dict()
    for k, v in saved.items():
        assert torch.equal(current[k], v), k
    assert all(torch.isfinite(p).all() for p in task.parameters())


# ----------------------------------------------------------------------------------------------------
# Evaluation: whole-model metrics (model_metrics_fn)


def _mlp_trainer(out: Path, *, eval_data=None, model_metrics_fn=None, **config) -> Trainer:
    """W.run_mlp's Trainer (dropout 0.3), with a model_metrics_fn."""
    x, y = W.mlp_data(48)
    cfg = TrainConfig(output_dir=str(out), steps=6, lr=1e-2, warmup_steps=2, grad_accum=2, log_every=1,
                      progress=False, mixed_precision="no", **config)
    return Trainer(W.make_mlp(0, 0.3), W.mlp_loss, W.ListLoader(x, y, 8), cfg, eval_data=eval_data,
                   eval_fn=W.mlp_eval, model_metrics_fn=model_metrics_fn, export_config={"builder": "x"})


@pytest.mark.usefixtures("one_thread")
def test_model_metrics_fn_runs_at_each_eval_in_eval_mode_and_leaves_training_unchanged(tmp_path, capsys):
    import random

    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from omni.train import unwrap

    calls: list[dict] = []
    probe = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))

    def whole(model, step):
        m = unwrap(model)
        out = m(probe)
        calls.append({"step": step, "training": [k.training for k in m.modules()], "grad": torch.is_grad_enabled(),
                      "repeatable": torch.equal(out, m(probe))})  # dropout is off in eval mode
        # Draw from every global stream: the Trainer must restore them all, or training would change below.
        return {"whole/score": step + 0.5 + 0 * (torch.rand(()) + np.random.rand() + random.random()),
                "whole/norm": out.norm()}  # a 0-d Tensor is fine too

    x, y = W.mlp_data(12, seed=9)
    held_out = [{"x": x[i:i + 4], "y": y[i:i + 4]} for i in range(0, 12, 4)]  # the same order at every eval
    trainer = _mlp_trainer(tmp_path / "hook", eval_data=held_out, model_metrics_fn=whole, eval_every=2)
    results = trainer.fit(finish=False)
    assert [c["step"] for c in calls] == [2, 4, 6]  # every eval_every, the final eval not repeated
    assert all(not any(c["training"]) and not c["grad"] and c["repeatable"] for c in calls)
    assert results["eval/whole/score"] == 6.5 and math.isfinite(results["eval/whole/norm"])
    assert "eval/loss" in results and "eval/acc" in results  # next to eval_fn's batch metrics
    printed = capsys.readouterr().out
    assert "step 4: eval/acc" in printed and "eval/whole/score 4.5" in printed

    # Direct calls: the hook at the current step, RNG streams and train mode as they were; skippable.
    rng = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    direct = trainer.evaluate()
    assert calls[-1]["step"] == 6 and direct["eval/whole/score"] == 6.5 and direct["eval/loss"] == results["eval/loss"]
    assert random.getstate() == rng[0] and np.array_equal(np.random.get_state()[1], rng[1])
    assert torch.equal(torch.get_rng_state(), rng[2]) and trainer.model.training
    assert set(trainer.evaluate(model_metrics=False)) == {"eval/loss", "eval/acc"} and len(calls) == 4
    trainer.model_metrics_fn = lambda model, step: {"acc": 1.0}
    with pytest.raises(ValueError, match="eval_fn's metric name"):
        trainer.evaluate()
    trainer.close()

    # Logged with the other eval metrics.
    logs = EventAccumulator(str(tmp_path / "hook" / "logs" / "omni"))
    logs.Reload()
    assert [(e.step, e.value) for e in logs.Scalars("eval/whole/score")] == [(2, 2.5), (4, 4.5), (6, 6.5)]
    assert [e.step for e in logs.Scalars("eval/whole/norm")] == [2, 4, 6]

    # Training with no evaluation at all ends with bitwise the same parameters (dropout draws included).
    plain = _mlp_trainer(tmp_path / "plain", report_to="none")
    plain.fit()
    _assert_equal(_weights(tmp_path / "hook" / "final"), _weights(tmp_path / "plain" / "final"))

    # No eval data: the hook alone still makes an evaluation (here only at the end, eval_every 0).
    calls.clear()
    alone = _mlp_trainer(tmp_path / "alone", model_metrics_fn=whole, report_to="none").fit()
    assert [c["step"] for c in calls] == [6] and alone["eval/whole/score"] == 6.5
    assert not any(k.startswith("eval/") and "whole" not in k for k in alone)
    # An empty mapping (e.g. "only at the end") adds nothing.
    skipped = _mlp_trainer(tmp_path / "skip", eval_data=held_out, eval_every=3, report_to="none",
                           model_metrics_fn=lambda model, step: {} if step < 6 else {"late": 1.0}).fit()
    assert skipped["eval/late"] == 1.0


def test_model_metrics_fn_on_two_ranks_is_the_mean_over_ranks(tmp_path):
    """Every rank calls the hook (so it may use collectives); each name is averaged over the ranks that
    return it, and every rank gets the same result."""
    proc = _torchrun(str(tmp_path), script=__file__)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    evals = [{k: v for k, v in results.items() if k.startswith("eval/")} for results, _ in ranks]
    assert evals[0] == evals[1] and ranks[0][1] == ranks[1][1] == [3, 6]  # same values, hook at every eval
    results = ranks[0][0]
    assert results["eval/same"] == 1.5 and results["eval/rank"] == 0.5 and results["eval/only1"] == 7.0
    assert results["eval/all"] == 3.0 and math.isfinite(results["eval/loss"])


def _two_rank_model_metrics(out: str) -> None:
    """torchrun entry point (2 gloo ranks) of the test above."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, steps = int(os.environ["RANK"]), []

    def whole(model, step):
        steps.append(step)
        total = torch.tensor(float(rank + 1))
        dist.all_reduce(total)  # every rank is in the hook: collectives are fine
        return {"same": 1.5, "rank": float(rank), "all": total, **({"only1": 7.0} if rank == 1 else {})}

    x, y = W.mlp_data(48)
    xe, ye = W.mlp_data(16, seed=5)
    cfg = TrainConfig(output_dir=str(Path(out) / "run"), steps=6, lr=1e-2, grad_accum=2, eval_every=3,
                      progress=False, mixed_precision="no", report_to="none", export=False)
    trainer = Trainer(W.make_mlp(0, 0.3), W.mlp_loss, W.ListLoader(x, y, 8, rank, 2), cfg,
                      eval_data=W.ListLoader(xe, ye, 8, rank, 2), eval_fn=W.mlp_eval, model_metrics_fn=whole)
    results = trainer.fit()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps([results, steps]))


# ----------------------------------------------------------------------------------------------------
# Schedule, param groups, logging, export


def test_lr_schedule_values():
    m = lambda i: lr_multiplier(i, warmup=4, total=14, min_ratio=0.1)  # noqa: E731
    assert [m(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert m(4) == 1.0 and m(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert m(13) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.9)))
    assert m(14) == pytest.approx(0.1) and m(100) == pytest.approx(0.1)
    assert lr_multiplier(0, warmup=0, total=5, min_ratio=0.0) == 1.0


def test_param_groups_decay_matrices_only():
    torch.manual_seed(0)
    task = W.VecClassifier(positions="learned")
    groups = default_param_groups(task, 0.1)
    names = {id(p): n for n, p in task.named_parameters()}
    decay = sorted(names[id(p)] for p in groups[0]["params"])
    no_decay = sorted(names[id(p)] for p in groups[1]["params"])
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert all(task.get_parameter(n).ndim >= 2 for n in decay)
    assert "model.trunk.absolute.rows.weight" in no_decay and "model.trunk.absolute.cols.weight" in no_decay
    assert f"model.embedders.{W.VEC}.1.weight" in no_decay  # the type embedding
    assert "model.trunk.blocks.0.attn.qkv.weight" in decay and f"model.embedders.{W.VEC}.0.weight" in decay
    assert "model.heads.cls.norm.weight" in no_decay and "model.trunk.blocks.0.attn.qkv.bias" in no_decay
    assert len(decay) + len(no_decay) == len(list(task.parameters()))


def test_tensorboard_logs_flat_config_and_per_step_lr(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = W.mlp_data(12, seed=9)
    W.run_mlp(tmp_path, steps=6, eval_data=W.ListLoader(x, y, 4), eval_every=3)
    logdir = tmp_path / "logs" / "omni"
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/acc", "train/samples_per_s", "eval/loss", "eval/acc"):
        assert tag in tags, tags
    lrs = [(e.step, e.value) for e in acc.Scalars("train/lr")]
    assert [s for s, _ in lrs] == [1, 2, 3, 4, 5, 6]
    for step, value in lrs:  # the lr used for step s is lr * multiplier(s - 1): one scheduler step per step
        assert value == pytest.approx(1e-2 * lr_multiplier(step - 1, warmup=2, total=6, min_ratio=0.0))
    assert [e.step for e in acc.Scalars("eval/loss")] == [3, 6]
    hparams = next(logdir.rglob("hparams.yml")).read_text()
    assert "model.widths: '[8, 32, 4]'" in hparams and "model.kind: mlp" in hparams and "grad_accum: 2" in hparams


def test_flatten_config():
    flat = flatten_config({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None, "f": (0.9, 0.99), "g": "x", "h": True})
    assert flat == {"a.b": 1, "a.c.d": "[1, 2]", "e": "None", "f": "(0.9, 0.99)", "g": "x", "h": True}


def test_checkpoint_listing_ignores_incomplete_and_temp_dirs(tmp_path):
    root = tmp_path / "checkpoints"
    for name, complete in [("step-000002", True), ("step-000004", True), ("step-000006", False),
                           (".tmp-step-000008", True), ("step-x", True)]:
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / "COMPLETE").write_text("{}")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4]
    assert latest_checkpoint(tmp_path) == root / "step-000004"


def test_export_round_trip_omni_builder(tmp_path):
    """fit() exports an OmniModel + its tokenizer; load_pretrained rebuilds it with no training code."""
    batches = W.packed_batches(W.vec_samples(16))
    trainer = _vec_trainer(tmp_path, batches, 3)
    trainer.fit()
    model = load_pretrained(tmp_path / "final")
    assert type(model).__name__ == "OmniModel" and not model.training
    assert list(load_tokenizers(tmp_path / "final")) == [W.VEC]
    assert load_config(tmp_path / "final")["builder"] == "omni"
    trained = trainer.accelerator.unwrap_model(trainer.model).model.eval()
    with torch.no_grad():
        for b in batches[:2]:
            torch.testing.assert_close(model.forward_head(model(b), b, "cls", W.VEC),
                                       trained.forward_head(trained(b), b, "cls", W.VEC), rtol=0, atol=0)


def test_export_from_a_gathered_state_dict(tmp_path):
    """The FSDP path writes gathered full weights (keys relative to the exported module) instead of the
    module's own tensors, and mismatched keys are refused before anything is written."""
    config = {"builder": "omni", "trunk": {"preset": "tiny", "n_layers": 1},
              "heads": {"cls": {"type": "classification", "n_classes": 3}}}
    torch.manual_seed(0)
    model = build_omni_model(config, {W.VEC: W.TrainVecTokenizer()})
    full = {k: v.clone() + 1.0 for k, v in model.state_dict().items()}  # stands in for the gathered weights
    save_pretrained(model, tmp_path / "m", config, tokenizers={W.VEC: W.TrainVecTokenizer()}, state_dict=full)
    back = load_pretrained(tmp_path / "m")
    _assert_equal(full, back.state_dict())
    with pytest.raises(ValueError, match="missing"):
        save_pretrained(model, tmp_path / "bad", config, state_dict={k: v for k, v in list(full.items())[1:]})
    assert not (tmp_path / "bad").exists()


def test_export_tied_lm_head_and_import_path_builder(tmp_path):
    """Tied weights are stored once and come back tied; a "module:function" builder loads a custom model."""
    from omni.tokenizers.base import TypeEmbedding, register_tokenizer

    @register_tokenizer("train_test_ids")
    class Ids(W.Tokenizer):
        modality = "train_test_ids"

        def __init__(self, vocab: int = 11) -> None:
            self.vocab = vocab

        def config(self):
            return {"vocab": self.vocab}

        def encode(self, raw, *, key=""):
            raise NotImplementedError

        def embedder(self, d_model):
            return nn.Sequential(nn.Embedding(self.vocab, d_model), TypeEmbedding(d_model))

    config = {"builder": "omni", "trunk": {"preset": "tiny", "n_layers": 1},
              "heads": {"lm": {"type": "lm", "vocab_size": 11, "tie_to": "text"}}}
    torch.manual_seed(0)
    model = build_omni_model(config, {"text": Ids()})
    assert model.heads["lm"].proj.weight is model.embedders["text"][0].weight
    save_pretrained(model, tmp_path / "m", config, tokenizers={"text": Ids()})
    stored = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert len(stored) == len(model.state_dict()) - 1  # the tied table once
    back = load_pretrained(tmp_path / "m")
    assert back.heads["lm"].proj.weight is back.embedders["text"][0].weight
    _assert_equal(model.state_dict(), back.state_dict())
    assert load_tokenizers(tmp_path / "m")["text"].vocab == 11
    # A second export over the first replaces it whole.
    mlp = W.make_mlp(3)
    save_pretrained(mlp, tmp_path / "m", {"builder": "_train_worker:build_mlp", "dropout": 0.0})
    _assert_equal(load_pretrained(tmp_path / "m").state_dict(), mlp.state_dict())
    assert not (tmp_path / "m" / "tokenizers").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    with pytest.raises(KeyError, match="no_such_builder"):
        save_pretrained(mlp, tmp_path / "x", {"builder": "no_such_builder"})
        load_pretrained(tmp_path / "x")


if __name__ == "__main__":  # torchrun entry point of test_model_metrics_fn_on_two_ranks_is_the_mean_over_ranks
    _two_rank_model_metrics(sys.argv[1])


def test_progress_off_prints_one_line_per_log_step(tmp_path, capsys):
    """Without the tqdm bar (log files, CI) training still reports loss/lr every log_every steps."""
    from omni.data.reader import ShardLoader

    urls = W.write_vec_shards(tmp_path / "shards")
    loader = ShardLoader(urls, W.decode_vec, Packer(block_size=16), batch_size=4, rank=0, world_size=1, seed=1)
    _vec_trainer(tmp_path / "a", loader, 4, export=False).fit()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert [ln.split(":")[0] for ln in lines] == ["step 2/4", "step 4/4"]
    loss = float(lines[-1].split("loss ")[1].split(",")[0])
    assert math.isfinite(loss) and loss > 0


def test_compile_accepts_an_inductor_mode(tmp_path, monkeypatch):
    """compile=True -> torch.compile(model); a string -> torch.compile(model, mode=that string)."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: calls.append(kw) or model)
    W.run_mlp(tmp_path / "a", steps=1, compile=True, fit=False)
    W.run_mlp(tmp_path / "b", steps=1, compile="max-autotune-no-cudagraphs", fit=False)
    assert calls == [{}, {"mode": "max-autotune-no-cudagraphs"}]


# ----------------------------------------------------------------------------------------------------
# Config validation, resume modes, finished runs, logs without a terminal


@pytest.mark.parametrize("field, value, message", [
    ("steps", 0, "TrainConfig.steps must be >= 1, got 0"),
    ("steps", -5, "TrainConfig.steps must be >= 1, got -5"),
    ("steps", 2.5, "TrainConfig.steps must be an integer, got 2.5"),
    ("lr", 0.0, "TrainConfig.lr must be > 0, got 0.0"),
    ("lr", float("nan"), "TrainConfig.lr must be a finite number, got nan"),
    ("lr", float("inf"), "TrainConfig.lr must be a finite number, got inf"),
    ("grad_accum", 0, "TrainConfig.grad_accum must be >= 1, got 0"),
    ("warmup_steps", -1, "TrainConfig.warmup_steps must be >= 0, got -1"),
    ("min_lr_ratio", 1.5, "TrainConfig.min_lr_ratio must be <= 1, got 1.5"),
    ("weight_decay", -0.1, "TrainConfig.weight_decay must be >= 0, got -0.1"),
    ("beta1", 1.0, "TrainConfig.beta1 must be < 1, got 1.0"),
    ("beta2", -0.5, "TrainConfig.beta2 must be >= 0, got -0.5"),
    ("eps", 0.0, "TrainConfig.eps must be > 0, got 0.0"),
    ("clip_norm", float("nan"), "TrainConfig.clip_norm must be a finite number, got nan"),
    ("eval_every", -1, "TrainConfig.eval_every must be >= 0, got -1"),
    ("checkpoint_every", -2, "TrainConfig.checkpoint_every must be >= 0, got -2"),
    ("log_every", -1, "TrainConfig.log_every must be >= 0, got -1"),
    ("seed", -1, "TrainConfig.seed must be >= 0, got -1"),
    ("keep_checkpoints", "2", "TrainConfig.keep_checkpoints must be an integer, got '2'"),
    ("resume", "sometimes", "resume must be one of 'auto', 'force', 'never', got 'sometimes'"),
    ("resume", True, "resume must be one of 'auto', 'force', 'never', got True"),
])
def test_train_config_rejects_bad_values_naming_the_field(field, value, message):
    with pytest.raises(ValueError) as err:
        TrainConfig(**{field: value})
    assert str(err.value) == message


def test_train_config_takes_integral_floats_and_numpy_numbers():
    import numpy as np

    cfg = TrainConfig(steps=1e4, lr=np.float32(3e-4), grad_accum=np.int64(2), clip_norm=0.0)
    assert (cfg.steps, type(cfg.steps), cfg.grad_accum, type(cfg.grad_accum)) == (10_000, int, 2, int)
    assert isinstance(cfg.lr, float) and cfg.clip_norm == 0.0  # 0 still disables clipping
    json.dumps(cfg.to_dict())  # plain python numbers: checkpoints and trackers take them


def test_config_differences_flattened_keys_and_ignored_settings():
    old = {"train.lr": 1e-3, "train.output_dir": "a", "train.eval_every": 5, "hparams.out": "a",
           "hparams.model.dropout": 0.1, "hparams.nan": float("nan"), "export.trunk.d_model": 16,
           "export.compile": True, "hparams.gone": 1}
    new = {**old, "train.lr": 2e-3, "train.output_dir": "b", "train.eval_every": 7, "hparams.out": "b",
           "hparams.model.dropout": 0.2, "hparams.nan": float("nan"), "export.trunk.d_model": 32,
           "export.compile": False, "hparams.new": "x"}
    del new["hparams.gone"]
    assert config_differences(old, new) == [
        "export.compile: True -> False",  # the export config is the model: nothing in it is ignored
        "export.trunk.d_model: 16 -> 32", "hparams.gone: 1 -> (absent)", "hparams.model.dropout: 0.1 -> 0.2",
        "hparams.new: (absent) -> 'x'", "train.lr: 0.001 -> 0.002"]


def test_resume_refuses_another_config_and_force_resumes_it(tmp_path, capsys):
    W.run_mlp(tmp_path, steps=4, checkpoint_every=2, report_to="none")
    with pytest.raises(ResumeMismatchError) as err:  # another dropout (model + export config), seed and length
        W.run_mlp(tmp_path, steps=6, checkpoint_every=2, report_to="none", dropout=0.3, seed=1, eval_every=3)
    msg = str(err.value)
    for line in ("export.dropout: 0.0 -> 0.3", "hparams.model.dropout: 0.0 -> 0.3", "train.seed: 0 -> 1",
                 "train.steps: 4 -> 6", "resume='force' (recipes: --set resume=force)", "another output directory",
                 f"checkpoint {tmp_path / 'checkpoints' / 'step-000004'}"):
        assert line in msg, msg
    assert "eval_every" not in msg and "output_dir" not in msg  # settings a resumed run may change
    assert json.loads((tmp_path / "checkpoints" / "step-000004" / "trainer_state.json").read_text())[
        "run_config"]["hparams.model.widths"] == "[8, 32, 4]"
    capsys.readouterr()
    trainer, results = W.run_mlp(tmp_path, steps=6, checkpoint_every=2, report_to="none", dropout=0.3, seed=1,
                                 resume="force")
    out = capsys.readouterr().out
    assert "resume='force': resuming" in out and "train.steps: 4 -> 6" in out and "resumed from" in out
    assert results["step"] == 6 and [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]


def test_resume_force_still_refuses_another_architecture_naming_the_tensors(tmp_path):
    W.run_mlp(tmp_path, steps=2, checkpoint_every=2, report_to="none")
    wider = W.make_mlp(0)
    wider.net[0], wider.net[1], wider.net[4] = nn.Linear(8, 64), nn.LayerNorm(64), nn.Linear(64, 4)
    x, y = W.mlp_data(48)
    cfg = TrainConfig(output_dir=str(tmp_path), steps=2, lr=1e-2, warmup_steps=2, log_every=1, progress=False,
                      mixed_precision="no", report_to="none", resume="force", grad_accum=2, checkpoint_every=2)
    trainer = Trainer(wider, W.mlp_loss, W.ListLoader(x, y, 8), cfg)
    with pytest.raises(ResumeMismatchError) as err:
        trainer.fit()
    msg = str(err.value)
    assert f"the checkpoint {tmp_path / 'checkpoints' / 'step-000002'} does not fit this model" in msg
    assert "net.0.weight: checkpoint (32, 8), model (64, 8)" in msg and "net.4.bias" not in msg
    assert "net.1.weight: checkpoint (32,), model (64,)" in msg


def test_resume_never_refuses_a_directory_holding_a_run(tmp_path):
    W.run_mlp(tmp_path / "fresh", steps=2, report_to="none", resume="never")  # nothing there: trains
    with pytest.raises(RunExistsError, match=rf"{tmp_path / 'fresh'} already holds a run \({tmp_path / 'fresh'}/final\)"):
        W.run_mlp(tmp_path / "fresh", steps=2, report_to="none", resume="never")
    W.run_mlp(tmp_path / "ck", steps=2, checkpoint_every=2, report_to="none", export=False)
    with pytest.raises(RunExistsError, match="step-000002"):
        W.run_mlp(tmp_path / "ck", steps=2, checkpoint_every=2, report_to="none", resume="never", export=False)


def test_finished_run_is_reported_not_retrained_or_reexported(tmp_path, capsys):
    x, y = W.mlp_data(12, seed=9)
    _, first = W.run_mlp(tmp_path, steps=4, checkpoint_every=2, report_to="none", eval_data=W.ListLoader(x, y, 4))
    export = tmp_path / "final" / "model.safetensors"
    before = export.stat()
    capsys.readouterr()
    never = W.StopAfter(W.mlp_loss, 0)  # raises if anything is trained (or evaluated through the loss)
    _, again = W.run_mlp(tmp_path, steps=4, checkpoint_every=2, report_to="none", loss_fn=never,
                         eval_data=W.ListLoader(x, y, 4), keep_checkpoints=5)  # an ignored setting may differ
    assert "already finished" in capsys.readouterr().out
    assert again == first and again["step"] == 4 and "eval/loss" in again
    after = export.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # A damaged export of a finished run is reported and written again from the final checkpoint.
    data = bytearray(export.read_bytes())
    data[-1] ^= 1
    export.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="model.safetensors differs from the sha256.*exporting the final checkpoint"):
        W.run_mlp(tmp_path, steps=4, checkpoint_every=2, report_to="none", loss_fn=never,
                  eval_data=W.ListLoader(x, y, 4))
    _assert_equal(_weights(tmp_path / "final"), _weights(tmp_path / "checkpoints" / "step-000004"))
    load_pretrained(tmp_path / "final")


def test_no_terminal_logs_plain_lines_instead_of_a_bar(tmp_path, capsys, monkeypatch):
    """stderr redirected to a file (capsys: not a TTY): no tqdm carriage returns, one line per log step."""
    x, y = W.mlp_data(48)

    def fit(out: Path) -> None:
        cfg = TrainConfig(output_dir=str(out), steps=3, log_every=1, progress=True, mixed_precision="no",
                          report_to="none", export=False)
        Trainer(W.make_mlp(0), W.mlp_loss, W.ListLoader(x, y, 8), cfg).fit()

    fit(tmp_path / "file")
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "\r" not in captured.out
    lines = [ln for ln in captured.out.splitlines() if ln.startswith("step ")]
    assert [ln.split(":")[0] for ln in lines] == ["step 1/3", "step 2/3", "step 3/3"]
    assert all(" loss " in ln and ", it/s " in ln and ", left " in ln for ln in lines)
    assert lines[-1].endswith(", left 0s")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    fit(tmp_path / "tty")
    assert "\r" in sys.stderr.getvalue() and not any(ln.startswith("step ") for ln in capsys.readouterr().out.splitlines())


def test_resume_on_another_process_count_names_the_process_count_not_the_config(tmp_path):
    """A run written by 2 processes resumed by 1: the recipes derive steps / warmup from batches per rank, so
    the config differs too; the message must name the real cause (the process count), not those entries."""
    from omni.export import write_checksums

    W.run_mlp(tmp_path, steps=4, checkpoint_every=2, report_to="none")
    ckpt = tmp_path / "checkpoints" / "step-000004"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["world_size"] = 2
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    write_checksums(ckpt)  # as a real 2-process run would have written it
    with pytest.raises(ValueError, match=r"written by 2 processes; resume it with 2 \(now 1\)") as err:
        W.run_mlp(tmp_path, steps=6, checkpoint_every=2, report_to="none")
    assert not isinstance(err.value, ResumeMismatchError) and "train.steps" not in str(err.value)


def test_durations_read_as_people_write_them():
    from omni.progress import duration

    assert [duration(s) for s in (0, 41.6, 60, 190, 3599, 3600, 3900, 90061)] == \
        ["0s", "42s", "1m00s", "3m10s", "59m59s", "1h00m", "1h05m", "25h01m"]


def test_a_long_run_says_so_at_its_first_log_step(monkeypatch, capsys):
    """Progress estimates the time left from the steps so far; beyond LONG_RUN_SECONDS it says so once."""
    import omni.progress as P
    from omni.evaluation import MetricHistory

    class Acc:
        is_main_process = True

        def log(self, *a, **k):
            pass

    clock = iter(float(t) for t in range(0, 10_000, 10))  # every perf_counter call: 10 s later
    monkeypatch.setattr(P.time, "perf_counter", lambda: next(clock))
    cfg = TrainConfig(output_dir="unused", steps=200, log_every=1, progress=False)
    history = MetricHistory.__new__(MetricHistory)
    monkeypatch.setattr(MetricHistory, "append", lambda self, step, metrics: None)
    record = {"loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "samples": 4, "tokens": 0}
    with P.Progress(Acc(), cfg, 0, history) as progress:
        for step in (1, 2, 3):
            progress.step(step, record, 0)
    out = capsys.readouterr().out
    assert out.count("at this pace the run needs about") == 1, out
