"""FSDP2 on 2 CPU (gloo) processes, launched the documented way:

    accelerate launch --config_file recipes/accelerate_fsdp2.yaml --num_processes 2 SCRIPT

Accelerate itself applies FSDP only on GPUs; omni.train switches a CPU run that asked for it to FSDP2
(``_fsdp_on_cpu``). Checked: every parameter is sharded over the 2 ranks, every step's loss / gradient norm
matches 1 process without FSDP on the same global batches (1e-5), the export is the gathered full model
(loads with omni.export.load_pretrained and gives the sharded model's logits), the sharded checkpoint
resumes bitwise exactly, and recipes/multimodal.py --preset tiny trains and exports under the shipped
config as it is (bf16, tied LM head).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import _fsdp2_worker as F  # noqa: E402
from _launch import gloo_env, run_group  # noqa: E402
from omni.export import load_pretrained, tied_names  # noqa: E402
from omni.train import use_cpu  # noqa: E402
from conftest import load_recipe  # noqa: E402

CONFIG = str(ROOT / "recipes" / "accelerate_fsdp2.yaml")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _launch(*args: str, cpu_flag: bool = True, timeout: int = 90) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file recipes/accelerate_fsdp2.yaml --num_processes 2 ...`` in its own
    session (a hang is killed whole). ``cpu_flag=False`` leaves ACCELERATE_USE_CPU unset, as a user on a
    CPU-only machine would (omni.train.use_cpu then picks the CPU); set anyway where an accelerator exists,
    tests stay on the CPU."""
    env = gloo_env(PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}")
    if cpu_flag or torch.accelerator.is_available():
        env["ACCELERATE_USE_CPU"] = "1"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG, "--num_processes", "2",
           "--main_process_port", "0", *args]
    proc = run_group(cmd, env, timeout, "accelerate launch", cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _worker(out: Path, *extra: str) -> tuple[list[dict], str]:
    proc = _launch("--mixed_precision", "no", str(HERE / "_fsdp2_worker.py"), "vec", str(out), *extra)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], proc.stdout


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """6 steps (grad_accum 2, clipping, warmup + cosine) on 2 FSDP2 ranks, checkpoints at 3 and 6, export."""
    out = tmp_path_factory.mktemp("fsdp2")
    ranks, _ = _worker(out)
    return out, ranks


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The same training in this process, no FSDP, each micro-batch the whole global batch."""
    out = tmp_path_factory.mktemp("one")
    trainer = F.make_trainer(out / "run")
    trainer.fit()
    return out, trainer.records


def test_fsdp2_shards_every_parameter_over_two_cpu_ranks(fsdp_run):
    _, ranks = fsdp_run
    for r in ranks:
        assert r["distributed_type"] == "DistributedType.FSDP" and r["is_fsdp2"] and r["world"] == 2
        assert r["fsdp_units"] == ["", "model.trunk.blocks.0", "model.trunk.blocks.1"]  # root + one per Block
        assert len(r["shards"]) == r["n_params"]  # every parameter is a DTensor
    for name, (local0, total) in ranks[0]["shards"].items():
        local1, _ = ranks[1]["shards"][name]
        assert local0 + local1 == total and local0 < total, name  # split over the ranks, not replicated


def test_fsdp2_matches_one_process_without_fsdp(fsdp_run, one_process):
    (out, ranks), (one, records) = fsdp_run, one_process
    assert ranks[0]["records"] == ranks[1]["records"]  # every rank reports the global numbers
    fsdp = ranks[0]["records"]
    assert [r["step"] for r in fsdp] == [r["step"] for r in records] == list(range(1, F.STEPS + 1))
    for a, b in zip(fsdp, records):
        assert (a["samples"], a["tokens"], a["lr"]) == (b["samples"], b["tokens"], b["lr"])
        for key in ("loss", "grad_norm", "acc"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)
    assert fsdp[0]["grad_norm"] > 0.5  # clip_norm 0.5: clipping was active
    # Same weights after 6 AdamW steps; only the float32 summation order differs (reduce-scatter).
    final, reference = _weights(out / "run" / "final"), _weights(one / "run" / "final")
    assert _max_diff(final, reference) < 1e-5
    torch.manual_seed(0)
    init = F.VecTask().model.state_dict()
    assert _max_diff(final, {k: init[k] for k in final}) > 1e-3  # and training moved them
    assert ranks[0]["fit"]["train/loss"] == pytest.approx(records[-1]["loss"], abs=1e-5)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_fsdp2_export_is_the_gathered_model(fsdp_run, one_process):
    (out, _), (one, _) = fsdp_run, one_process
    model = load_pretrained(out / "run" / "final")
    assert set(model.state_dict()) == set(_weights(out / "run" / "final"))
    batch = F.probe_batch()
    with torch.no_grad():
        logits = model.forward_head(model(batch), batch, "cls", F.W.VEC)
        reference = load_pretrained(one / "run" / "final")
        ref_logits = reference.forward_head(reference(batch), batch, "cls", F.W.VEC)
    sharded = torch.load(out / "logits.pt")  # the FSDP2 model's own forward on both ranks, after training
    torch.testing.assert_close(logits, sharded, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)


def test_fsdp2_checkpoint_is_sharded_and_resumes_exactly(fsdp_run, tmp_path):
    out, ranks = fsdp_run
    ck = out / "run" / "checkpoints" / "step-000003"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):  # torch.distributed.checkpoint, one file per rank
        assert {p.name for p in (ck / part).iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert not (ck / "model.safetensors").exists()
    # New processes, another init seed: everything must come from the step-3 checkpoint.
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    shutil.copytree(ck, tmp_path / "run" / "checkpoints" / ck.name)
    resumed, stdout = _worker(tmp_path, "123")
    assert "resumed from" in stdout and "step-000003 at step 3" in stdout
    assert resumed[0]["records"] == ranks[0]["records"][3:]  # steps 4-6, bitwise
    a, b = _weights(out / "run" / "final"), _weights(tmp_path / "run" / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------------
# The recipe, as documented (bf16 from the shipped config; no ACCELERATE_USE_CPU on a CPU-only machine)


def _load_recipe():
    return load_recipe("multimodal", "multimodal_recipe_fsdp2")


def test_multimodal_recipe_trains_under_fsdp2(tmp_path, fashion_mnist_env):
    """conftest.py's tiny data: Fashion-MNIST by OMNI_FASHION_MNIST_DIR, the text corpus by the `text` entry."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    cache, out = tmp_path / "cache", tmp_path / "run"
    data = [f"cache={str(cache)!r}", f"text={fashion_mnist_env.text_files()!r}"]
    recipe = _load_recipe()
    recipe.build_tasks(recipe.parse_args(["--preset", "tiny", "--set", *data]))  # data, once
    proc = _launch(str(ROOT / "recipes" / "multimodal.py"), "--preset", "tiny", "--out", str(out), "--set",
                   *data, "steps=2", "checkpoint_every=2", "eval_batches=1", "report_to='none'",
                   "progress=False", cpu_flag=False, timeout=120)
    assert "FSDP2 x 2 processes" in proc.stdout, proc.stdout[-2000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 2
    for task in ("image", "asr", "rl", "text"):
        assert math.isfinite(metrics[f"train/{task}/loss"]) and math.isfinite(metrics[f"eval/{task}/loss"])
    # The export loads, with the LM heads tied to the text embedding again, and holds exactly the weights of
    # the sharded step-2 checkpoint, merged offline from its per-rank files (a second gather path).
    model = load_pretrained(out / "final")
    ties = tied_names(model)
    assert len(ties) == 1 and {n for n in ties[0] if n.startswith("heads.")} == {"heads.asr.proj.weight",
                                                                                 "heads.text.proj.weight"}
    assert len(ties[0]) == 3 and ties[0][0].startswith("embedders.text.")
    ck = out / "checkpoints" / "step-000002"
    assert {p.name for p in (ck / "pytorch_model_fsdp_0").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    dcp_to_torch_save(ck / "pytorch_model_fsdp_0", tmp_path / "merged.pt")
    merged = {k.removeprefix("omni."): v for k, v in torch.load(tmp_path / "merged.pt")["model"].items()}
    assert set(merged) == set(model.state_dict())
    for group in tied_names(model):  # the tie held through training under FSDP2: one tensor, equal values
        assert all(torch.equal(merged[n], merged[group[0]]) for n in group), group
    exported = model.state_dict()
    for name, value in merged.items():
        assert torch.equal(exported[name], value), name


def test_use_cpu(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert use_cpu()  # a multi-process launch on a machine without GPUs: CPU (gloo), not N lone runs
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not use_cpu()
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    assert use_cpu()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not use_cpu()


def test_export_of_a_gathered_state_dict_stores_tied_weights_once(tmp_path):
    """FSDP2's gathered state dict holds a tied weight under each of its names, as separate tensors;
    save_pretrained stores it once (the name save_model keeps), so load_pretrained re-ties it."""
    from torch import nn

    from omni.export import save_pretrained

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight

    torch.manual_seed(0)
    model = Tied()
    assert tied_names(model) == [["emb.weight", "head.weight"]]
    full = {k: v.clone() + 1.0 for k, v in model.state_dict().items()}  # separate tensors, as gathered
    save_pretrained(model, tmp_path / "m", {"builder": "none"}, state_dict=full)
    assert set(load_file(str(tmp_path / "m" / "model.safetensors"))) == {"emb.weight"}
    back = load_pretrained(tmp_path / "m", build=lambda config, tokenizers: Tied())
    assert back.head.weight is back.emb.weight and torch.equal(back.emb.weight, full["emb.weight"])
    full["head.weight"] = full["head.weight"] + 1.0  # a broken tie is refused, nothing written
    with pytest.raises(ValueError, match="tied"):
        save_pretrained(model, tmp_path / "bad", {"builder": "none"}, state_dict=full)
    assert not (tmp_path / "bad").exists()
