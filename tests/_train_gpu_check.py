"""GPU check of omni/train.py (not collected by pytest; run by hand on a CUDA machine):

    python tests/_train_gpu_check.py OUT_DIR

1. OmniModel task on PackedBatches (FlexAttention BlockMask path), mixed_precision="auto" (bf16),
   fused AdamW: 6 steps straight vs 3 + stop + resume + 3; prints the largest parameter difference.
2. torch.compile=True (Accelerate's dynamo plugin) on the same task: trains, checkpoints, resumes,
   exports clean parameter names (no "_orig_mod.").
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _train_worker as W  # noqa: E402
from omni.export import load_pretrained  # noqa: E402
from omni.train import TrainConfig, Trainer  # noqa: E402


def trainer(out: Path, steps: int, loss_fn=None, **cfg) -> Trainer:
    torch.manual_seed(cfg.pop("model_seed", 0))
    config = TrainConfig(output_dir=str(out), steps=steps, lr=3e-3, grad_accum=2, log_every=1, progress=False,
                         report_to="none", **cfg)
    export = {"builder": "omni", "trunk": W.trunk_config(0.1).to_dict(),
              "heads": {"cls": {"type": "classification", "n_classes": 3, "pool": "mean"}}}
    return Trainer(W.VecClassifier(dropout=0.1), loss_fn, W.packed_batches(W.vec_samples(40)), config,
                   export_config=export, export_tokenizers={W.VEC: W.TrainVecTokenizer()},
                   export_module=lambda t: t.model)


def max_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys(), (sorted(wa)[:3], sorted(wb)[:3])
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


def main(out: Path) -> None:
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for compile_ in (False, True):
        tag = "compile" if compile_ else "eager"
        t0 = time.perf_counter()
        a = trainer(out / tag / "a", 6, compile=compile_)
        report[f"{tag}.mixed_precision"] = a.accelerator.mixed_precision
        report[f"{tag}.fused_adamw"] = bool(a.optimizer.optimizer.defaults.get("fused"))
        res = a.fit()
        report[f"{tag}.straight_s"] = round(time.perf_counter() - t0, 1)
        report[f"{tag}.loss"] = res["train/loss"]
        stop = W.StopAfter(lambda m, b: m(b), calls=6)
        try:
            trainer(out / tag / "b", 6, loss_fn=stop, checkpoint_every=3, compile=compile_).fit()
        except W.StopAfter.Stop:
            pass
        res_b = trainer(out / tag / "b", 6, checkpoint_every=3, compile=compile_, model_seed=7).fit()
        report[f"{tag}.resumed_loss"] = res_b["train/loss"]
        report[f"{tag}.resume_max_param_diff"] = max_diff(out / tag / "a" / "final", out / tag / "b" / "final")
        model = load_pretrained(out / tag / "a" / "final", device=a.accelerator.device)
        report[f"{tag}.export_loads"] = type(model).__name__
        print(json.dumps(report, indent=2), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
