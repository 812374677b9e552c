"""Models, data and scenarios shared by tests/test_train.py, and its subprocess entry point.

    torchrun --standalone --nproc-per-node 2 tests/_train_worker.py ddp OUT     # 2 gloo ranks
    python tests/_train_worker.py killsave OUT                                   # hangs in a checkpoint write

Everything here is tiny so the whole test file stays fast on 2 CPU cores.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `omni` when run as a script

from omni.heads import ClassificationHead  # noqa: E402
from omni.model import OmniModel  # noqa: E402
from omni.packing import Packer  # noqa: E402
from omni.segment import Role, Sample, Segment  # noqa: E402
from omni.tokenizers.base import Tokenizer, TypeEmbedding, register_tokenizer  # noqa: E402
from omni.train import TrainConfig, Trainer  # noqa: E402
from omni.trunk import TrunkConfig  # noqa: E402

torch.set_num_threads(1)

# ----------------------------------------------------------------------------------------------------
# A plain MLP task on dict batches


class MLP(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_mlp(seed: int = 0, dropout: float = 0.0) -> MLP:
    torch.manual_seed(seed)
    return MLP(dropout)


POISON = {"key": None}  # sample key whose loss becomes NaN (set by scenarios)


def mlp_loss(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    logits = model(batch["x"])
    loss = F.cross_entropy(logits, batch["y"])
    if POISON["key"] is not None and POISON["key"] in batch["keys"]:
        loss = loss * float("nan")
    return loss, {"acc": (logits.argmax(-1) == batch["y"]).float().mean()}


def mlp_eval(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
    logits = model(x)
    return {"loss": F.cross_entropy(logits, y, reduction="none"), "acc": (logits.argmax(-1) == y).float()}


def mlp_data(n: int = 96, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].argmax(-1) + (x[:, 4] > 1).long()) % 4
    return x, y


class ListLoader:
    """Rank-local stateful loader with ShardLoader's protocol and semantics: the global batches of an
    epoch come in an epoch-seeded order, this rank takes its contiguous slice of each; the position
    names the NEXT batch (after the last batch of an epoch it names the next epoch's start)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, global_batch: int, rank: int = 0, world: int = 1,
                 seed: int = 0) -> None:
        self.x, self.y, self.gb, self.rank, self.world, self.seed = x, y, global_batch, rank, world, seed
        self.n_batches = x.shape[0] // global_batch
        self.epoch, self.batches_done = 0, 0
        self.set_epoch_calls: list[int] = []

    def __len__(self) -> int:
        return self.n_batches

    def set_epoch(self, epoch: int) -> None:
        self.set_epoch_calls.append(epoch)
        if epoch != self.epoch:
            self.epoch, self.batches_done = epoch, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.batches_done}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batches_done = int(state["epoch"]), int(state["batches_done"])

    def __iter__(self):
        if self.batches_done >= self.n_batches:
            self.epoch, self.batches_done = self.epoch + 1, 0
        epoch = self.epoch
        order = torch.randperm(self.n_batches, generator=torch.Generator().manual_seed(self.seed + 1000 * epoch))
        per_rank = self.gb // self.world
        for j in range(self.batches_done, self.n_batches):
            b = int(order[j])
            idx = torch.arange(b * self.gb + self.rank * per_rank, b * self.gb + (self.rank + 1) * per_rank)
            last = j + 1 == self.n_batches
            self.epoch, self.batches_done = (epoch + 1, 0) if last else (epoch, j + 1)
            yield {"x": self.x[idx], "y": self.y[idx], "keys": [f"s{int(i)}" for i in idx]}


def run_mlp(out: str | Path, *, steps: int, rank: int = 0, world: int = 1, global_batch: int = 8, grad_accum: int = 2,
            n: int = 48, dropout: float = 0.0, model_seed: int = 0, eval_data: Any = None, loader: Any = None,
            loss_fn=mlp_loss, fit: bool = True, **config: Any) -> tuple[Trainer, dict]:
    x, y = mlp_data(n)
    data = loader if loader is not None else ListLoader(x, y, global_batch, rank, world)
    cfg = TrainConfig(output_dir=str(out), steps=steps, lr=1e-2, warmup_steps=2, grad_accum=grad_accum,
                      clip_norm=1.0, log_every=1, progress=False, mixed_precision="no", **config)
    trainer = Trainer(make_mlp(model_seed, dropout), loss_fn, data, cfg, eval_data=eval_data, eval_fn=mlp_eval,
                      export_config={"builder": "_train_worker:build_mlp", "dropout": dropout},
                      hparams={"model": {"kind": "mlp", "widths": [8, 32, 4], "dropout": dropout}})
    return trainer, (trainer.fit() if fit else {})


def build_mlp(config: dict, tokenizers: dict) -> nn.Module:
    return MLP(config["dropout"])


class StopAfter:
    """loss_fn wrapper raising on call number ``calls + 1``: simulates a process stopped mid-run."""

    class Stop(Exception):
        pass

    def __init__(self, fn: Any, calls: int) -> None:
        self.fn, self.calls, self.n = fn, calls, 0

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        self.n += 1
        if self.n > self.calls:
            raise StopAfter.Stop(f"stopped at call {self.n}")
        return self.fn(model, batch)


# ----------------------------------------------------------------------------------------------------
# An OmniModel task on PackedBatches (test modality: continuous 4-d vectors)

VEC = "train_test_vec"


@register_tokenizer()
class TrainVecTokenizer(Tokenizer):
    modality = VEC
    role = Role.BIDIRECTIONAL

    def encode(self, raw: Any, *, key: str = "") -> Segment:
        t = torch.as_tensor(np.asarray(raw), dtype=torch.float32)
        if t.dim() != 2 or t.shape[1] != 4:
            raise ValueError(f"sample {key!r}: expected (n, 4) vectors, got {tuple(t.shape)}")
        return Segment(VEC, t, torch.arange(t.shape[0]), self.role)

    def embedder(self, d_model: int) -> nn.Module:
        return nn.Sequential(nn.Linear(4, d_model), TypeEmbedding(d_model))


def trunk_config(dropout: float = 0.1, positions: str = "rope") -> TrunkConfig:
    # one head of 16: FlexAttention (the CUDA path) needs head_dim >= 16
    return TrunkConfig(d_model=16, n_layers=1, n_heads=1, mlp_ratio=2.0, dropout=dropout, positions=positions)


class VecClassifier(nn.Module):
    """OmniModel + classification head + loss in forward (the DDP/compile friendly task shape)."""

    def __init__(self, dropout: float = 0.1, positions: str = "rope") -> None:
        super().__init__()
        self.model = OmniModel({VEC: TrainVecTokenizer()}, trunk_config(dropout, positions),
                               heads={"cls": ClassificationHead(16, 3)})

    def logits(self, batch: Any) -> torch.Tensor:
        return self.model.forward_head(self.model(batch), batch, "cls", VEC)

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict]:
        logits = self.logits(batch)
        y = torch.tensor(batch.labels, device=logits.device)
        return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def vec_samples(n: int = 40, seed: int = 3) -> list[Sample]:
    rng = np.random.default_rng(seed)
    tok = TrainVecTokenizer()
    out = []
    for i in range(n):
        label = int(rng.integers(3))
        v = rng.normal(size=(int(rng.integers(2, 7)), 4)).astype(np.float32) + label
        out.append(Sample([tok.encode(v, key=f"v{i}")], key=f"v{i}", label=label))
    return out


def packed_batches(samples: list[Sample], batch_size: int = 4) -> list:
    pack = Packer(block_size=16)
    return [pack(samples[i:i + batch_size]) for i in range(0, len(samples), batch_size)]


def write_vec_shards(root: Path, n: int = 30, shards: int = 3, seed: int = 5) -> list[str]:
    import webdataset as wds

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    urls, i = [], 0
    for s in range(shards):
        url = str(root / f"train-{s:03d}.tar")
        with wds.TarWriter(url) as sink:
            for _ in range(n // shards):
                label = int(rng.integers(3))
                v = rng.normal(size=(int(rng.integers(2, 7)), 4)).astype(np.float32) + label
                buf = io.BytesIO()
                np.save(buf, v)
                sink.write({"__key__": f"w{i:03d}", "npy": buf.getvalue(), "cls": str(label)})
                i += 1
        urls.append(url)
    return urls


def decode_vec(sample: dict) -> Sample:
    v = np.load(io.BytesIO(sample["npy"]))
    key = sample["__key__"]
    return Sample([TrainVecTokenizer().encode(v, key=key)], key=key, label=int(sample["cls"].decode()))


# ----------------------------------------------------------------------------------------------------
# Subprocess scenarios


def _ddp(out: Path) -> None:
    """2 ranks x 4 samples per micro-batch; rank 0 records the eval results."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    x, y = mlp_data(10, seed=7)
    eval_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)  # prepared
    trainer, _ = run_mlp(out / "run", steps=6, rank=rank, world=world, global_batch=8, fit=False,
                         eval_data=eval_loader, checkpoint_every=3)
    xl, yl = mlp_data(16, seed=8)
    before = trainer.evaluate(ListLoader(xl, yl, 8, rank, world))  # rank-local eval: summed over ranks
    results = trainer.fit()
    if rank == 0:
        (out / "results.json").write_text(json.dumps({"before": before, "fit": results}))


def _nan(out: Path) -> None:
    """The poisoned sample sits on rank 1 only; both ranks must raise (no hang)."""
    from omni.train import NonFiniteLossError

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    POISON["key"] = os.environ["POISON_KEY"]
    try:
        run_mlp(out / "run", steps=6, rank=rank, world=world, global_batch=8, checkpoint_every=2, report_to="none")
    except NonFiniteLossError as exc:
        (out / f"error_rank{rank}.txt").write_text(str(exc))
        sys.exit(3)


def _killsave(out: Path) -> None:
    """Checkpoint step 2 completes; the write of step 4 leaves a truncated file and hangs."""
    from accelerate import Accelerator

    original = Accelerator.save_state

    def slow_save_state(self, output_dir=None, **kwargs):
        if str(output_dir).endswith("step-000004"):
            Path(output_dir, "model.safetensors").write_bytes(b"\x00" * 64)  # a torn write
            (out / "hanging").touch()
            time.sleep(600)
        return original(self, output_dir, **kwargs)

    Accelerator.save_state = slow_save_state
    run_mlp(out / "run", steps=6, checkpoint_every=2, dropout=0.2, report_to="none")


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    {"ddp": _ddp, "nan": _nan, "killsave": _killsave}[scenario](out_dir)
