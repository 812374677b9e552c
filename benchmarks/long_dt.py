"""Long trajectories (#26): a Decision Transformer's KV-cached rollout, time per step and memory vs context length
(steps the model sees), full attention vs a causal window, on the CPU.

    python benchmarks/long_dt.py                        # contexts 20, 100, 500 steps; full vs window 60 tokens
    python benchmarks/long_dt.py --contexts 20 500 --window 30 --envs 8 --steps 200 --json out.json

Each (attention, context) point runs in its own process: the cpu preset's trunk (width 64, 2 layers, 2 heads,
timestep embedding, no token positions) with random weights (the cost does not depend on them), ``--envs``
CartPole-shaped envs that never end (random states; so every rollout runs ``--steps`` steps) stepped together by
``omni.rl.rollout`` (cache=True, the recipe's default). The cache: full attention keeps 3 x context tokens per
layer (omni.trunk.KVCache); a windowed trunk a RingKVCache of ``--window`` tokens per layer. Once the context is
full the rollout refills it every step with the last context - 1 steps (as the model was trained on windows of
``context`` steps), so a context shorter than the episode costs a (3 x context)-token forward per step.
Reported: seconds per rollout step (all envs), the cache's bytes, and peak memory = the process's peak RSS during
the rollout minus its RSS before (/proc/self/clear_refs resets the peak; MALLOC_MMAP_THRESHOLD_=65536, so
glibc returns freed tensors and the peak is what was live, not the allocator's high-water mark).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _memory import reset_peak, rss_kb  # benchmarks/_memory.py: this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class EndlessCartPole:
    """CartPole's spaces, random states, reward 1, never done: every rollout runs its max_steps."""

    def __init__(self) -> None:
        import gymnasium as gym
        import numpy as np

        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.spec = None
        self._rng = np.random.default_rng(0)

    def reset(self, seed: int | None = None):
        import numpy as np

        self._rng = np.random.default_rng(seed)
        return self._rng.normal(size=4).astype(np.float32), {}

    def step(self, action):
        return self._rng.normal(size=4).astype("float32"), 1.0, False, False, {}

    def close(self) -> None:
        pass


def point(attention: str, context: int, window: int, envs: int, steps: int) -> dict:
    import torch

    from omni.rl import DecisionTransformer, rollout
    from omni.tokenizers.trajectory import TrajectoryTokenizer
    from omni.trunk import preset

    torch.manual_seed(0)
    tok = TrajectoryTokenizer(4, n_actions=2, rtg_scale=100.0, max_timestep=max(steps, 500) + 1, context=context)
    pattern = None if attention == "full" else {"kind": "window", "before": window, "after": 0}
    trunk = preset("dt", d_model=64, n_layers=2, n_heads=2, positions="none", dropout=0.0,
                   max_positions=3 * context, attention=pattern)
    model = DecisionTransformer(tok, trunk)
    cache_bytes = model.new_cache(envs).nbytes() if pattern else sum(
        t.numel() * t.element_size() for t in (model.new_cache(envs).k + model.new_cache(envs).v))
    warm = [EndlessCartPole() for _ in range(envs)]
    rollout(model, tok, warm, list(range(envs)), targets=[500.0] * envs, max_steps=3, cache=True)  # first calls
    base = rss_kb("VmRSS")
    reset_peak()  # the peak RSS (VmHWM) from here
    start, cpu = time.perf_counter(), time.process_time()
    res = rollout(model, tok, [EndlessCartPole() for _ in range(envs)], list(range(envs)), targets=[500.0] * envs,
                  max_steps=steps, cache=True)
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    assert int(res.lengths.min()) == steps
    return {"attention": attention, "context": context, "window": window if pattern else None, "envs": envs,
            "steps": steps, "ms_per_step": 1000 * seconds / steps, "cpu_ms_per_step": 1000 * cpu_s / steps,
            "cache_kib": cache_bytes / 1024, "peak_mib": (rss_kb("VmHWM") - base) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[20, 100, 500])
    ap.add_argument("--window", type=int, default=60, help="tokens before the query (3 per step)")
    ap.add_argument("--envs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--json", default=None)
    ap.add_argument("--point", nargs=2, metavar=("ATTENTION", "CONTEXT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        print(json.dumps(point(args.point[0], int(args.point[1]), args.window, args.envs, args.steps)))
        return
    # glibc: allocations over 64 KiB straight from mmap and back on free, so the peak RSS is what was live
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = []
    for context in args.contexts:
        for attention in ("full", "window"):
            cmd = [sys.executable, __file__, "--point", attention, str(context), "--window", str(args.window),
                   "--envs", str(args.envs), "--steps", str(args.steps)]
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if res.returncode != 0:
                raise SystemExit(f"{attention} context {context} failed: {res.stderr.strip().splitlines()[-1]}")
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n| context (steps) | attention | ms / rollout step ({args.envs} envs) | CPU ms / step | KV cache | "
          "peak extra memory |\n|---|---|---|---|---|---|")
    for r in rows:
        name = "full" if r["window"] is None else f"window {r['window']} tokens"
        print(f"| {r['context']} | {name} | {r['ms_per_step']:.2f} | {r['cpu_ms_per_step']:.2f} | "
              f"{r['cache_kib']:.0f} KiB | {r['peak_mib']:.1f} MiB |")
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": env["OMP_NUM_THREADS"], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
