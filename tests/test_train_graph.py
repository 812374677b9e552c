"""TrainConfig(cuda_graph=True): the Trainer's whole-step graph path. On CPU GraphedTrainStep runs the captured
step eagerly on its static buffers, so these tests check the plumbing the GPU uses: identical training to the
plain loop, exact resume, layout errors and the non-finite check (CUDA capture itself: test_cuda_graphs.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import _train_worker as W
from omni.train import NonFiniteLossError, TrainConfig, latest_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def _assert_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs by {(a[k] - b[k]).abs().max().item():.3g}"


def test_graph_step_trains_exactly_like_the_plain_loop(tmp_path):
    """Dropout, warm-up + cosine schedule, clipping, AdamW, evaluation in between: same weights, loss, lr,
    metrics."""
    x, y = W.mlp_data(12, seed=9)
    plain, res_plain = W.run_mlp(tmp_path / "plain", steps=7, grad_accum=1, dropout=0.3,
                                 eval_data=W.ListLoader(x, y, 4), eval_every=3)
    graph, res_graph = W.run_mlp(tmp_path / "graph", steps=7, grad_accum=1, dropout=0.3, cuda_graph=True,
                                 eval_data=W.ListLoader(x, y, 4), eval_every=3)
    assert graph.stepper.graph is not None and not graph.stepper.graph.graphed  # CPU: the eager path of the graph step
    _assert_equal(_weights(tmp_path / "plain" / "final"), _weights(tmp_path / "graph" / "final"))
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/acc", "eval/loss"):
        assert res_graph[key] == res_plain[key], key


def test_graph_step_resumes_exactly(tmp_path):
    W.run_mlp(tmp_path / "a", steps=6, grad_accum=1, dropout=0.3, cuda_graph=True)
    with pytest.raises(W.StopAfter.Stop):
        # 3 warm-up calls when the graph step is built, then one call per step: stop during step 4
        W.run_mlp(tmp_path / "b", steps=6, grad_accum=1, dropout=0.3, cuda_graph=True, checkpoint_every=3,
                  loss_fn=W.StopAfter(W.mlp_loss, calls=3 + 3))
    assert latest_checkpoint(tmp_path / "b").name == "step-000003"
    resumed, _ = W.run_mlp(tmp_path / "b", steps=6, grad_accum=1, dropout=0.3, cuda_graph=True, checkpoint_every=3,
                           model_seed=42)
    assert resumed.step == 6
    _assert_equal(_weights(tmp_path / "a" / "final"), _weights(tmp_path / "b" / "final"))


def test_graph_config_errors(tmp_path):
    with pytest.raises(ValueError, match="cuda_graph needs grad_accum 1"):
        TrainConfig(output_dir=str(tmp_path), steps=2, grad_accum=2, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph needs grad_accum 1"):
        TrainConfig(output_dir=str(tmp_path), steps=2, mixed_precision="fp16", cuda_graph=True)


def test_graph_step_rejects_a_batch_of_another_shape(tmp_path):
    x, y = W.mlp_data(20)  # 8 + 8 + a short batch of 4 (ListLoader keeps it)
    class Short(W.ListLoader):
        def __iter__(self):
            for i, b in enumerate(super().__iter__()):
                yield b if i < 1 else {**b, "x": b["x"][:4], "y": b["y"][:4]}

    short = Short(x, y, 8)
    with pytest.raises(ValueError, match=r"cuda_graph: batch 1 of epoch 0: .*shape \(4, 8\).*\(8, 8\)"):
        W.run_mlp(tmp_path / "s", steps=3, grad_accum=1, loader=short, cuda_graph=True)


def test_graph_step_non_finite_loss_says_the_step_was_taken(tmp_path):
    W.POISON["key"] = None

    def poisoned(model, batch):  # the loss sees tensors only: poison through the data instead
        loss, metrics = W.mlp_loss(model, batch)
        return loss * torch.where(batch["x"].abs().max() > 50, float("nan"), 1.0), metrics

    x, y = W.mlp_data(48)
    x[20] = 100.0  # in batch 2 (samples 16..23)
    loader = W.ListLoader(x, y, 8)
    trainer, _ = W.run_mlp(tmp_path / "n", steps=6, grad_accum=1, loader=loader, loss_fn=poisoned,
                           cuda_graph=True, fit=False)
    with pytest.raises(NonFiniteLossError, match="already taken inside the CUDA graph"):
        trainer.fit()
