"""Long inputs (#26): time and peak memory of one attention layer, forward + backward, windowed vs full, as the
sequence grows, on the CPU.

    python benchmarks/long_inputs.py                    # the table in benchmarks/results.md (minutes on 2 cores)
    python benchmarks/long_inputs.py --dry-run          # toy size (512 tokens): every method once, ~1 min
    python benchmarks/long_inputs.py --lengths 1024 4096 --methods banded_local full_sdpa --json out.json

Methods (q, k, v (1, H, T, D) fp32, bidirectional, as an audio encoder or image grid; the mask is built inside the
measured region, as the trunk builds it per batch):
  full_sdpa            SDPA with no mask: full attention (the CPU's flash kernel: memory O(T), time O(T^2))
  dense_local          SDPA with the window as a dense (T x T) bool mask: what a masked CPU batch cost before
  banded_local         the window's BlockMask through omni's eager banded path (omni.attention_patterns)
  banded_local_global  window + the first 16 tokens global, banded path
  flex_local           the window's BlockMask through torch.compile'd FlexAttention (the CPU backward is the
                       banded path's)
  flex_local_global    window + global, compiled Flex
Each (method, length) runs in its own process, one warm-up call (compiled Flex: its compile) then --repeats
measured calls (the median time is reported); peak memory = the process's peak RSS during the measured call
minus its RSS before it (Linux /proc/self/clear_refs resets the peak). A point that passes --limit seconds or
needs more memory than --max-gb is reported as not run, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from _memory import reset_peak, rss_kb  # benchmarks/_memory.py: this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("full_sdpa", "dense_local", "banded_local", "banded_local_global", "flex_local", "flex_local_global")
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


def measure(method: str, T: int, heads: int, head_dim: int, window: int, n_global: int, repeats: int) -> dict:
    """One (method, length) point in this process: median seconds of fwd + bwd, peak extra MiB."""
    import torch
    import torch.nn.functional as F

    from omni.attention_patterns import Global, Layout, Window, block_mask, dense
    from omni.trunk import attend, flex_mode

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, T, head_dim, requires_grad=True) for _ in range(3))
    pos = torch.arange(T).expand(1, T)
    layout = Layout.single(torch.stack([pos, pos], -1), causal=False)
    half = window // 2
    pattern = Window(before=half, after=half)
    if method.endswith("_global"):
        pattern = pattern | Global(first=n_global)

    def run() -> None:
        if method == "full_sdpa":
            out = F.scaled_dot_product_attention(q, k, v)
        elif method == "dense_local":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense(layout, pattern))
        else:
            with flex_mode("compiled" if method.startswith("flex") else "eager"):
                out = attend(q, k, v, block_mask(layout, pattern))
        out.square().mean().backward()
        q.grad = k.grad = v.grad = None

    run()  # warm-up, not measured: first-call costs (kernel choice, allocator; compiled Flex: the compile)
    times, peaks = [], []
    for _ in range(repeats):
        base = rss_kb("VmRSS")
        reset_peak()  # the peak RSS (VmHWM) from here
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        peaks.append((rss_kb("VmHWM") - base) / 1024)
    times.sort()
    return {"seconds": times[len(times) // 2], "peak_mib": max(peaks)}


def point(args: argparse.Namespace, method: str, T: int) -> dict:
    """One point in a fresh process, within the time and memory limits."""
    if method == "dense_local" and 4 * T * T * args.heads * 3 > args.max_gb * 2 ** 30:  # scores, probs, grads
        return {"skipped": f"needs > {args.max_gb} GB (dense T x T scores per head)"}
    cmd = [sys.executable, __file__, "--one", method, str(T), "--heads", str(args.heads), "--head-dim",
           str(args.head_dim), "--window", str(args.window), "--global-tokens", str(args.global_tokens),
           "--repeats", str(args.repeats)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit,
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    except subprocess.TimeoutExpired:
        return {"skipped": f"over {args.limit:.0f} s"}
    if done.returncode:
        return {"skipped": f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict, methods: list[str], lengths: list[int]) -> str:
    rows = ["| method | " + " | ".join(f"{T:,}" for T in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for m in methods:
        cells = []
        for T in lengths:
            r = results[m].get(str(T), {})
            cells.append(r.get("skipped", "") if "seconds" not in r else f"{r['seconds']:.3g} s / {r['peak_mib']:,.0f} MiB")
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def growth(results: dict, method: str, lengths: list[int], window: int) -> str:
    """Time ratio per doubling past the window, geometric mean."""
    pts = [(T, results[method][str(T)]["seconds"]) for T in lengths
           if "seconds" in results[method].get(str(T), {}) and T >= 4 * window]
    if len(pts) < 2:
        return "n/a"
    (t0, s0), (t1, s1) = pts[0], pts[-1]
    import math
    return f"{(s1 / s0) ** (1 / math.log2(t1 / t0)):.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=256, help="window width: window/2 tokens each side")
    ap.add_argument("--global-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=float, default=300.0, help="seconds per point (compile included)")
    ap.add_argument("--max-gb", type=float, default=8.0, help="dense masks needing more are not run")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--dry-run", action="store_true", help="toy size (512 tokens, H2 D16): every method once")
    ap.add_argument("--one", nargs=2, metavar=("METHOD", "T"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        method, T = args.one[0], int(args.one[1])
        print(json.dumps(measure(method, T, args.heads, args.head_dim, args.window, args.global_tokens, args.repeats)))
        return
    if args.dry_run:
        args.lengths, args.heads, args.head_dim, args.window, args.repeats = [512], 2, 16, 64, 1
        args.global_tokens = 4
    for n, what in ((args.window, "--window"), (args.global_tokens, "--global-tokens")):
        if n < 2 and what == "--window" or n < 1:
            ap.error(f"{what} must be >= {2 if what == '--window' else 1}, got {n}")
    results: dict = {m: {} for m in args.methods}
    for T in args.lengths:
        for m in args.methods:
            results[m][str(T)] = point(args, m, T)
            print(f"{m:>20} T={T:>6}: {results[m][str(T)]}", flush=True)
    import torch
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; H{args.heads} D{args.head_dim}, window {args.window}, "
          f"{args.global_tokens} global tokens, fp32, fwd + bwd; cell = median seconds / peak extra MiB\n")
    print(table(results, args.methods, args.lengths))
    print("\ntime per doubling past the window: " + ", ".join(
        f"{m} {growth(results, m, args.lengths, args.window)}" for m in args.methods))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
