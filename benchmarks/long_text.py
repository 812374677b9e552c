"""Text past its training length (#26): bits per byte of held-out Austen at 1k, 2k, 8k and 32k tokens for LMs
trained at 1,024 tokens with learned positions, RoPE + full attention and RoPE + a causal window; time and peak
memory of each evaluation, on the CPU.

    python benchmarks/long_text.py                       # train the three models (recipes/lm.py), then the table
    python benchmarks/long_text.py --dry-run             # the commands it would run, nothing else
    python benchmarks/long_text.py --skip-train          # the table from the exports already in --out
    python benchmarks/long_text.py --steps 600 --lengths 1024 4096
    python benchmarks/long_text.py --skip-train --models rope-full+window256     # one row

Training: ``recipes/lm.py --preset cpu`` on the text run on (``documents='stream'``), 1,024-token documents,
2 rows of 1,024 tokens per step (the preset's 2,048 tokens), ``eval_fraction=0.04`` (the held-out paragraphs then
hold ~37k tokens: 2% would hold 19k, too few for 32k), ``--steps`` steps; the recipe's own ``eval_lengths`` scores
each model at the shortest length after training, a cross-check of the table (the recipe scores any length itself,
but a learned table only up to its 1,024 positions: longer is refused in one line).
The table: each (model, length) in its own process (``--point``): the export, the same held-out tokens
(``recipes/lm.py: stream_ids``, saved once to <out>/heldout.json), ``long_text_bpb`` (windows of the length, bos
first, one document per forward: SDPA's causal kernel for full attention, the banded path for the window), fp32.
The learned-positions model past its table is forced through the trunk, which reads the table's last row for
every later position (what the recipe refuses): the measured failure. ``rope-full+window256``: the RoPE
full-attention export read through a causal window of 256 imposed on its weights (the recipe's ``eval_window=256``).
Peak memory = the process's peak RSS during scoring minus its RSS before (/proc/self/clear_refs resets the peak; MALLOC_MMAP_THRESHOLD_=65536: glibc returns
freed tensors, so the peak is what was live).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

from _memory import reset_peak, rss_kb  # benchmarks/_memory.py: this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

LENGTHS = (1024, 2048, 8192, 32768)
WINDOW = 256
MODELS: dict[str, list[str]] = {  # name -> the recipe's --set entries beyond COMMON_SETS
    "learned": ["positions=learned_1d"],
    "rope-full": ["positions=rope"],
    f"rope-window{WINDOW}": ["positions=rope",
                             f"trunk_overrides.attention={{'kind': 'window', 'before': {WINDOW}, 'after': 0}}"],
}
IMPOSED = {f"rope-full+window{WINDOW}": ("rope-full", WINDOW)}  # trained full, read through a window (eval_window)
COMMON_SETS = ["documents=stream", "context=1024", "row_length=1024", "rows=2", "eval_fraction=0.04", "samples=0",
               "report_to=none", "progress=False", "checkpoint_every=0"]


def recipe_command(name: str, args: argparse.Namespace) -> list[str]:
    lengths = [min(args.lengths)]  # a cross-check of the points (the recipe can score every length itself)
    sets = COMMON_SETS + MODELS[name] + [f"steps={args.steps}", f"eval_every={args.steps}",
                                         f"out={args.out}/{name}", f"eval_lengths={lengths}"]
    return [sys.executable, str(ROOT / "recipes/lm.py"), "--preset", "cpu", *[a for s in sets for a in ("--set", s)]]


def point(export: str, heldout: str, length: int, window: int = 0) -> dict:
    """One (model, length) in this process (``window``: a causal window imposed on it, recipes/lm.py: windowed):
    bits/byte, seconds, CPU seconds, peak extra MiB."""
    import torch

    import lm
    from omni.export import load_pretrained
    from omni.tokenizers.text import TextTokenizer

    torch.manual_seed(0)
    model = load_pretrained(export)
    if window:
        model = lm.windowed(model, window)
    tok = TextTokenizer.load(Path(export) / "tokenizers" / "text")
    held = json.loads(Path(heldout).read_text())
    base = rss_kb("VmRSS")
    reset_peak()  # the peak RSS (VmHWM) from here
    start, cpu = time.perf_counter(), time.process_time()
    r = lm.long_text_bpb(model, "lm", tok, held["ids"], held["bytes"], length)
    return {**r, "length": length, "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
            "peak_mib": (rss_kb("VmHWM") - base) / 1024,
            "past_table": model.trunk_config.positions.startswith("learned")
            and length > model.trunk_config.max_positions}


def save_heldout(args: argparse.Namespace, path: Path) -> None:
    """The held-out tokens every point scores (the recipe's split, its tokenizer)."""
    import lm
    from omni.tokenizers.text import TextTokenizer

    cfg = lm.parse_args(["--preset", "cpu", *[a for s in COMMON_SETS for a in ("--set", s)]])
    tok = TextTokenizer.load(Path(args.out) / "rope-full" / "final" / "tokenizers" / "text")
    ids, n_bytes = lm.stream_ids(tok, lm.documents(cfg, tok)["stream"], max(args.lengths) - 1)
    path.write_text(json.dumps({"ids": ids, "bytes": n_bytes}))


def table(rows: list[dict], args: argparse.Namespace) -> str:
    head = ["model"] + [f"{n} tokens" for n in args.lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in [*MODELS, *IMPOSED]:
        if name not in args.models:
            continue
        cells = [name]
        for n in args.lengths:
            r = next((r for r in rows if r["model"] == name and r["length"] == n), None)
            if r is None or "error" in r:
                cells.append("not run" + (f" ({r['error']})" if r else ""))
                continue
            forced = " (forced past the table)" if r["past_table"] else ""
            cells.append(f"{r['bpb']:.4f} bpb{forced}; {r['cpu_seconds']:.1f} CPU-s, {r['peak_mib']:.0f} MiB")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/long-text")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--models", nargs="+", default=[*MODELS, *IMPOSED], choices=[*MODELS, *IMPOSED])
    ap.add_argument("--skip-train", action="store_true", help="use the exports already in --out")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--point", nargs=4, metavar=("EXPORT", "HELDOUT", "LENGTH", "WINDOW"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        print(json.dumps(point(args.point[0], args.point[1], int(args.point[2]), int(args.point[3]))))
        return
    out = Path(args.out)
    # glibc: allocations over 64 KiB straight from mmap and back on free, so the peak RSS is what was live
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "MALLOC_MMAP_THRESHOLD_": "65536"}
    train_cpu: dict[str, float] = {}
    for name in [m for m in args.models if m in MODELS]:
        cmd = recipe_command(name, args)
        if args.dry_run:
            print(shlex.join(cmd))
            continue
        if args.skip_train and (out / name / "final").is_dir():
            continue
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True, env=env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        train_cpu[name] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if args.dry_run:
        return
    heldout = out / "heldout.json"
    if not heldout.is_file():
        save_heldout(args, heldout)
    rows = []
    for name in args.models:
        trained, window = IMPOSED.get(name, (name, 0))
        for n in args.lengths:
            cmd = [sys.executable, __file__, "--point", str(out / trained / "final"), str(heldout), str(n), str(window)]
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
            r = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else \
                {"error": (res.stderr.strip().splitlines() or ["?"])[-1][:120]}
            rows.append({"model": name, "length": n, **r})
            print(json.dumps(rows[-1]), flush=True)
    text = table(rows, args)
    print(text)
    (out / "long_text.json").write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                                    "threads": env["OMP_NUM_THREADS"], "steps": args.steps,
                                                    "train_cpu_seconds": train_cpu, "rows": rows}, indent=1))
    (out / "long_text.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
