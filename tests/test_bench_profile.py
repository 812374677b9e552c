"""benchmarks/_profile.py: kernel names land in the right category and the report adds up."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _profile import CATEGORIES, kernel_breakdown  # noqa: E402


def _category(name: str) -> str:
    return next((c for c, pat in CATEGORIES if pat.search(name)), "other")


def test_kernel_names_are_categorised() -> None:
    assert _category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "GEMM"
    assert _category("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "GEMM"
    assert _category("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>") == "attention"
    assert _category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert _category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>") \
        == "optimizer"
    assert _category("triton_per_fused_native_layer_norm_0") == "norm / softmax / loss"
    assert _category("triton_poi_fused_add_mul_3") == "elementwise / reduce (incl. fused triton)"
    assert _category("Memcpy HtoD (Pageable -> Device)") == "copy / cast / memset"


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_cpu_breakdown_adds_up() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    step()
    report = kernel_breakdown(step, steps=3, device="cpu")
    rows = re.findall(r"^\| ([^|`]+) \| ([\d.]+) \| ([\d.]+)% \|$", report, re.M)
    shares = {cat.strip(): float(share) for cat, _, share in rows}
    assert "GEMM" in shares and "norm / softmax / loss" in shares
    assert abs(sum(shares.values()) - 100.0) < 0.5
    busy = float(re.search(r"busy ([\d.]+) ms", report).group(1))
    assert abs(sum(float(ms) for _, ms, _ in rows) - busy) < 0.01 + 0.01 * busy
