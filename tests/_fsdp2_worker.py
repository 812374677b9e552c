"""Subprocess entry point of tests/test_fsdp2.py: omni.train.Trainer under FSDP2 on 2 CPU (gloo) ranks.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/accelerate_fsdp2.yaml --num_processes 2 \\
        --mixed_precision no tests/_fsdp2_worker.py vec OUT [MODEL_SEED]

The task is a tiny OmniModel (2 trunk Blocks, so two FSDP units below the root) classifying packed
4-d vector sequences; each rank takes its half of every global batch of 8 samples (``rank_batches``), so
a 1-process run on the whole batches (``make_trainer(..., world=1)``, in the test process) must end with
the same numbers.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # `omni` and `_train_worker` when run as a script

import _train_worker as W  # noqa: E402  (registers the test tokenizer W.VEC)
from omni.heads import ClassificationHead  # noqa: E402
from omni.model import OmniModel  # noqa: E402
from omni.packing import Packer  # noqa: E402
from omni.train import TrainConfig, Trainer, unwrap  # noqa: E402
from omni.trunk import TrunkConfig  # noqa: E402

torch.set_num_threads(1)

STEPS, GLOBAL_BATCH, N_SAMPLES = 6, 8, 48  # 6 global batches per epoch, 12 micro-batches: 2 epochs


def trunk_config() -> TrunkConfig:
    return TrunkConfig(d_model=16, n_layers=2, n_heads=1, mlp_ratio=2.0, dropout=0.0, positions="rope")


class VecTask(nn.Module):
    """OmniModel + classification head; loss (or logits) computed inside forward, as FSDP2 needs: the
    root unit's parameters are gathered only around the root module's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.model = OmniModel({W.VEC: W.TrainVecTokenizer()}, trunk_config(), heads={"cls": ClassificationHead(16, 3)})

    def forward(self, batch: Any, logits_only: bool = False) -> Any:
        logits = self.model.forward_head(self.model(batch), batch, "cls", W.VEC)
        if logits_only:
            return logits
        y = torch.tensor(batch.labels, device=logits.device)
        return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def export_config() -> dict:
    return {"builder": "omni", "trunk": trunk_config().to_dict(),
            "heads": {"cls": {"type": "classification", "n_classes": 3, "pool": "mean"}}}


def rank_batches(rank: int, world: int) -> list:
    """This rank's contiguous share of every global batch, packed (world 1: the whole global batches)."""
    samples, per, pack = W.vec_samples(N_SAMPLES), GLOBAL_BATCH // world, Packer(block_size=16)
    return [pack(samples[g * GLOBAL_BATCH + rank * per: g * GLOBAL_BATCH + (rank + 1) * per])
            for g in range(N_SAMPLES // GLOBAL_BATCH)]


def probe_batch() -> Any:
    return Packer(block_size=16)(W.vec_samples(6, seed=11))


class RecordingTrainer(Trainer):
    """Keeps every step's global numbers (loss, grad_norm, lr, ...)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[dict[str, float]] = []

    def _train_step(self) -> dict[str, float]:
        record = super()._train_step()
        self.records.append({"step": self.step + 1, **record})
        return record


def make_trainer(out: str | Path, *, rank: int = 0, world: int = 1, model_seed: int = 0) -> RecordingTrainer:
    torch.manual_seed(model_seed)
    config = TrainConfig(output_dir=str(out), steps=STEPS, lr=3e-3, warmup_steps=2, grad_accum=2, clip_norm=0.5,
                         checkpoint_every=3, keep_checkpoints=0, log_every=1, progress=False, mixed_precision="no",
                         report_to="none")
    return RecordingTrainer(VecTask(), None, rank_batches(rank, world), config, export_config=export_config(),
                            export_tokenizers={W.VEC: W.TrainVecTokenizer()}, export_module=lambda t: t.model)


def _vec(out: Path, model_seed: int = 0) -> None:
    """Train (or resume, if out/run holds a checkpoint) to STEPS; record numbers, sharding and the trained
    model's logits on a probe batch (a forward of the FSDP2 model itself, not of the export)."""
    from torch.distributed.tensor import DTensor

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainer = make_trainer(out / "run", rank=rank, world=world, model_seed=model_seed)
    acc = trainer.accelerator
    results = trainer.fit(finish=False)
    try:
        module = unwrap(trainer.model)
        shards = {n: [p.to_local().numel(), p.numel()] for n, p in module.named_parameters() if isinstance(p, DTensor)}
        fsdp_units = sorted(n for n, m in module.named_modules() if type(m).__name__.startswith("FSDP"))
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(probe_batch(), logits_only=True)
        record = {"rank": rank, "world": acc.num_processes, "distributed_type": str(acc.distributed_type),
                  "is_fsdp2": bool(acc.is_fsdp2), "records": trainer.records, "fit": results, "shards": shards,
                  "n_params": len(list(module.parameters())), "fsdp_units": fsdp_units}
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        if rank == 0:
            torch.save(logits.detach().cpu(), out / "logits.pt")
        acc.wait_for_everyone()
    finally:
        trainer.close()


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    {"vec": _vec}[scenario](out_dir, *[int(a) for a in sys.argv[3:]])
