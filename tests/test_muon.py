"""optimizer="muon" (omni.optimizers.MuonAdamW): the trunk's nn.Linear weights train with Muon and everything else
with AdamW, each exactly as torch's own optimizer would; the schedule drives both halves; training lowers the loss;
stop + resume from a checkpoint == straight through, bitwise; what cannot work is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import _train_worker as W
from omni.optimizers import MuonAdamW, muon_parameters, split_groups
from omni.packing import Packer
from omni.train import TrainConfig, Trainer, build_optimizer, default_param_groups, latest_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

MUON = ["model.trunk.blocks.0.attn.out.weight", "model.trunk.blocks.0.attn.qkv.weight",
        "model.trunk.blocks.0.mlp.down.weight", "model.trunk.blocks.0.mlp.up.weight"]


def _names(model: nn.Module, params) -> list[str]:
    ids = {id(p) for p in params}
    return sorted(n for n, p in model.named_parameters() if id(p) in ids)


def test_split_trunk_linears_to_muon_the_rest_to_adamw():
    """Muon: the trunk's 4 Linear weights. AdamW: the embedder's Linear (a tokenizer's projection), the head's
    Linear, every norm and bias; decay stays on matrices only (the embedder's and head's weight) and Muon's."""
    torch.manual_seed(0)
    model = W.VecClassifier()
    config = TrainConfig(optimizer="muon", lr=1e-2, weight_decay=0.1, warmup_steps=4, steps=10)
    opt, sched = build_optimizer(default_param_groups(model, 0.1), config, torch.device("cpu"),
                                 muon_parameters(model))
    assert isinstance(opt, MuonAdamW)
    muon = [g for g in opt.param_groups if g["muon"]]
    adam = [g for g in opt.param_groups if not g["muon"]]
    assert _names(model, [p for g in muon for p in g["params"]]) == MUON
    assert [g["weight_decay"] for g in muon] == [0.1] and [g["weight_decay"] for g in adam] == [0.1, 0.0]
    assert _names(model, adam[0]["params"]) == ["model.embedders.train_test_vec.0.weight",
                                                "model.heads.cls.proj.weight"]
    assert len(adam[1]["params"]) == sum(1 for _ in model.parameters()) - 6  # every norm and bias
    assert muon[0]["adjust_lr_fn"] == "match_rms_adamw" and adam[0]["betas"] == (0.9, 0.999)
    for _ in range(3):  # the LambdaLR warmup reaches both halves: lr * (i + 1) / 4 on every group
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-2 * (sched.last_epoch + 1) / 4] * 3)
        opt.step()
        sched.step()


def test_a_group_flag_wins_and_non_matrices_are_refused():
    lin, norm = nn.Linear(3, 4), nn.LayerNorm(4)
    assert split_groups([{"params": [lin.weight], "muon": True}], set())[0]["muon"] is True
    with pytest.raises(ValueError, match=r"^optimizer 'muon': a param group marked muon holds parameters of "
                                         r"shapes \[\(4,\)\]; Muon trains 2-D matrices only$"):
        split_groups([{"params": [lin.weight, lin.bias], "muon": True}], set())
    kept = split_groups([{"params": [lin.weight, norm.weight], "weight_decay": 0.3}], {id(lin.weight)})
    assert [(g["muon"], len(g["params"]), g["weight_decay"]) for g in kept] == [(True, 1, 0.3), (False, 1, 0.3)]


def test_each_half_steps_as_torchs_own_optimizer():
    """One MuonAdamW step == torch.optim.Muon (match_rms_adamw) on the trunk matrices and torch.optim.AdamW on
    the rest, from the same weights and gradients: bitwise."""
    torch.manual_seed(0)
    model = W.VecClassifier(dropout=0.0)
    batch = W.packed_batches(W.vec_samples(8), 8)[0]
    ref = copy.deepcopy(model)
    for m in (model, ref):  # the same gradients (no dropout) on both
        m(batch)[0].backward()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = [p.grad for p in model.parameters()]
    groups = split_groups(default_param_groups(model, 0.1), muon_parameters(model))
    MuonAdamW(groups, lr=3e-3, weight_decay=0.1).step()
    ids = muon_parameters(ref)
    ref_groups = split_groups(default_param_groups(ref, 0.1), ids)
    torch.optim.Muon([g for g in ref_groups if g["muon"]], lr=3e-3, weight_decay=0.1,
                     adjust_lr_fn="match_rms_adamw").step()
    torch.optim.AdamW([g for g in ref_groups if not g["muon"]], lr=3e-3, weight_decay=0.1).step()
    for (name, p), q, g in zip(model.named_parameters(), ref.parameters(), grads):
        assert torch.equal(p, q), name
        assert not torch.equal(p, start[name]) or not g.any(), name  # every parameter with a gradient moved
    assert all(not torch.equal(p, start[n]) for n, p in model.named_parameters() if n in MUON)


def test_training_lowers_the_loss():
    torch.manual_seed(0)
    model = W.VecClassifier(dropout=0.0)
    batch = W.packed_batches(W.vec_samples(32), 32)[0]
    opt = MuonAdamW(split_groups(default_param_groups(model, 0.0), muon_parameters(model)), lr=1e-2)
    losses = []
    for _ in range(15):
        loss, _ = model(batch)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 0.5 * losses[0], losses


def _trainer(out, loader, steps: int, loss_fn=None, **cfg) -> Trainer:
    torch.manual_seed(cfg.pop("model_seed", 0))
    task = W.VecClassifier(dropout=0.1)
    config = TrainConfig(output_dir=str(out), steps=steps, lr=3e-3, warmup_steps=2, grad_accum=2, log_every=2,
                         progress=False, mixed_precision="no", report_to="none", optimizer="muon", **cfg)
    export = {"builder": "omni", "trunk": W.trunk_config(0.1).to_dict(),
              "heads": {"cls": {"type": "classification", "n_classes": 3, "pool": "mean"}}}
    return Trainer(task, loss_fn, loader, config, export_config=export,
                   export_tokenizers={W.VEC: W.TrainVecTokenizer()}, export_module=lambda t: t.model)


def test_resume_is_bitwise_identical(tmp_path):
    """7 steps straight == 4 steps, stop, a new Trainer (other init seed) resumes the checkpoint, 3 more: the
    Muon momentum buffers and Adam moments come back from the checkpoint."""
    from omni.data.reader import ShardLoader

    urls = W.write_vec_shards(tmp_path / "shards")

    def loader():
        return ShardLoader(urls, W.decode_vec, Packer(block_size=16), batch_size=4, rank=0, world_size=1, seed=1)

    straight = _trainer(tmp_path / "a", loader(), 7)
    assert isinstance(straight.optimizer.optimizer, MuonAdamW)
    straight.fit()
    stop = W.StopAfter(lambda m, b: m(b), calls=8)
    with pytest.raises(W.StopAfter.Stop):
        _trainer(tmp_path / "b", loader(), 7, loss_fn=stop, checkpoint_every=4).fit()
    assert latest_checkpoint(tmp_path / "b").name == "step-000004"
    resumed = _trainer(tmp_path / "b", loader(), 7, checkpoint_every=4, model_seed=9)
    out = resumed.fit()
    assert out["step"] == 7
    state = resumed.optimizer.optimizer.state
    assert sum("momentum_buffer" in s for s in state.values()) == 4  # Muon's, one per trunk matrix
    assert sum("exp_avg" in s for s in state.values()) == 17  # Adam's, every other parameter
    a, b = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in "ab")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_what_cannot_work_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError) as err:
        TrainConfig(optimizer="muon", cuda_graph=True)
    assert str(err.value) == ("optimizer 'muon' cannot run under cuda_graph (the captured step replays AdamW only): "
                              "set cuda_graph=False or optimizer='adamw'")
    with pytest.raises(ValueError, match=r"^optimizer must be adamw or muon, got 'sgd'$"):
        TrainConfig(optimizer="sgd")
    x, y = W.mlp_data(8)
    config = TrainConfig(output_dir=str(tmp_path / "mlp"), steps=2, optimizer="muon", report_to="none",
                         progress=False, mixed_precision="no")
    with pytest.raises(ValueError) as err:  # a plain MLP has no trunk: nothing is a hidden matrix by the rule
        Trainer(W.make_mlp(0, 0.0), W.mlp_loss, W.ListLoader(x, y, 4), config)
    assert str(err.value) == ("optimizer 'muon' found no hidden matrices to train: Muon takes the nn.Linear weights "
                              "inside an omni Trunk (or param groups marked 'muon': True); use optimizer='adamw'")
