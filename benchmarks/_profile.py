"""Where a GPU step's time goes: torch.profiler kernel times grouped into categories, plus idle time.

Used by the throughput benchmarks' ``--profile`` option, so a missed target comes with its breakdown
(GEMMs vs attention vs elementwise/norm vs optimizer vs copies, and how long the GPU sat idle waiting
for the host) from the same run.
"""

from __future__ import annotations

import re
import time
from typing import Callable

import torch

# First match wins; names are CUDA kernel names as the profiler records them.
CATEGORIES: list[tuple[str, re.Pattern]] = [
    ("attention", re.compile(r"flash|fmha|attention|cudnn.*(sdpa|mha)|flex", re.I)),
    ("GEMM", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|addmm|aten::mm\b|aten::bmm", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("norm / softmax / loss", re.compile(r"norm|softmax|cross_entropy|nll|log_softmax", re.I)),
    ("copy / cast / memset", re.compile(r"copy|memcpy|memset|cast|convert|fill", re.I)),
    ("elementwise / reduce (incl. fused triton)", re.compile(r"elementwise|vectorized|reduce|triton|unrolled", re.I)),
]


def kernel_breakdown(step: Callable[[], None], steps: int = 5, top: int = 12, device: str = "cuda") -> str:
    """Profile ``steps`` calls of ``step`` (already warmed up) and return a Markdown report: per-step wall
    time, GPU busy time by category, idle share and the ``top`` kernels by time. ``device="cpu"`` reports
    CPU operator self-times instead (same table; used by the test)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall_us = (time.perf_counter() - t0) * 1e6 / steps
    if cuda:
        kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
        per_step = {e.key: e.self_device_time_total / steps for e in kernels}
    else:  # operator self-times (children excluded), so nothing is counted twice
        kernels = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        per_step = {e.key: e.self_cpu_time_total / steps for e in kernels}
    busy = sum(per_step.values())
    groups: dict[str, float] = {}
    for name, us in per_step.items():
        cat = next((c for c, pat in CATEGORIES if pat.search(name)), "other")
        groups[cat] = groups.get(cat, 0.0) + us
    lines = [f"per step: wall {wall_us / 1e3:.2f} ms (profiled, so a little slower than timed), "
             f"{'GPU' if cuda else 'CPU operator'} busy "
             f"{busy / 1e3:.2f} ms, idle {max(wall_us - busy, 0.0) / 1e3:.2f} ms "
             f"({max(wall_us - busy, 0.0) / wall_us:.1%}); {len(per_step)} distinct kernels",
             "", "| category | ms / step | share of busy |", "|---|---|---|"]
    for cat, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {cat} | {us / 1e3:.3f} | {us / busy:.1%} |")
    lines += ["", "| kernel (top by time) | ms / step | calls / step |", "|---|---|---|"]
    calls = {e.key: e.count / steps for e in kernels}
    for name, us in sorted(per_step.items(), key=lambda kv: -kv[1])[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short}` | {us / 1e3:.3f} | {calls[name]:.0f} |")
    return "\n".join(lines)
