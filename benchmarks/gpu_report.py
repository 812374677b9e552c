"""The bookkeeping of benchmarks/gpu_check.sh: one JSON file for every part, and the dated results.md section.

  python benchmarks/gpu_report.py add REPORT.json PART --rc RC --seconds S --budget B [--json F] [--junit F] \\
      [--stdout-json F] [--meta k=v ...]
  python benchmarks/gpu_report.py section REPORT.json [--out SECTION.md]

``add`` folds one finished part into REPORT.json (rewritten atomically after every part, so a run cut short keeps
what finished): its exit status, seconds, time budget, and its result, read from the part's own JSON file
(--json), a pytest JUnit XML file (--junit) or the last JSON object a script printed (--stdout-json). ``section``
turns REPORT.json into a Markdown section for benchmarks/results.md: a heading with the date, device and torch
version, the exact command, and one table | part | row | result | goal | met | with a row per test and per
benchmark row, the standing goals (issue #25) checked against the side-by-side ratios.

One JSON file and one section file, not one file per part: the device tool brings back at most 8 files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

HEADER = ["part", "row", "result", "goal", "met"]
PARTS = ["cuda-tests", "fsdp2", "cuda-checks", "train-check", "vit", "whisper", "dt", "packing", "interop"]


# ----------------------------------------------------------------------------------------------------
# Reading a part's result


def junit_result(path: Path) -> dict[str, Any]:
    """pytest --junitxml -> {"tests": [{"id", "outcome", "seconds", "message"}], "counts": {outcome: n}}."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or node.text or "").strip().splitlines()[0][:160] if (
                    node.get("message") or node.text) else ""
                break
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        tests.append({"id": name, "outcome": outcome, "seconds": float(case.get("time", 0.0)), "message": message})
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {"tests": tests, "counts": counts}


def last_json_object(text: str) -> Any:
    """The last top-level JSON object printed in ``text`` (a script that prints json.dumps(..., indent=2))."""
    decoder = json.JSONDecoder()
    found, i = None, 0
    while (start := text.find("{", i)) >= 0:
        try:
            found, end = decoder.raw_decode(text, start)
            i = end
        except json.JSONDecodeError:
            i = start + 1
    return found


def write_atomic(path: Path, text: str) -> None:
    """Write beside and rename: a run killed mid-write leaves the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def add(report: Path, part: str, rc: int, seconds: float, budget: float, json_files: list[Path],
        junit: Path | None, stdout_json: Path | None, meta: dict[str, str]) -> dict[str, Any]:
    """Fold one part into ``report``; returns the whole report."""
    doc = json.loads(report.read_text()) if report.exists() else {"meta": {}, "parts": {}}
    doc["meta"].update(meta)
    entry: dict[str, Any] = {"rc": rc, "seconds": round(seconds, 1), "budget_s": budget,
                             "timed_out": rc in (124, 137), "results": {}}
    for f in json_files:
        try:
            entry["results"][f.stem] = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:  # a part killed before it wrote: say so, keep the rest
            entry["results"][f.stem] = {"missing": f"{type(e).__name__}: {e}"[:200]}
    if junit is not None:
        entry["results"]["pytest"] = junit_result(junit) if junit.exists() else {"missing": str(junit)}
    if stdout_json is not None:
        entry["results"]["stdout"] = (last_json_object(stdout_json.read_text()) if stdout_json.exists() else None) \
            or {"missing": f"no JSON object in {stdout_json.name}"}
    doc["parts"][part] = entry
    write_atomic(report, json.dumps(doc, indent=2, default=str))
    return doc


# ----------------------------------------------------------------------------------------------------
# The section

Row = tuple[str, str, str, str, str]  # (part, row, result, goal, met)


def fmt(x: float, digits: int = 0) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def goal_row(part: str, name: str, ratio: float | None, goal: float, unit: str, detail: str, dry: bool) -> Row:
    if ratio is None:
        return (part, name, f"not measured ({detail})", f">= {goal:g}{unit}", "no")
    met = "dry run" if dry else ("yes" if ratio >= goal else "**no**")
    value = f"{ratio:.2f}{unit}" if unit == "x" else f"{ratio:,.0f}{unit}"
    return (part, name, f"{value} ({detail})", f">= {goal:g}{unit}", met)


def best(rows: list[dict], key: str, pick: Callable[[dict], bool]) -> float | None:
    values = [r[key] for r in rows if pick(r) and isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
    return max(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def rows_cuda_tests(part: str, res: dict, dry: bool) -> list[Row]:
    out: list[Row] = []
    for t in res.get("pytest", {}).get("tests", []):
        out.append((part, f"`{t['id']}`", t["outcome"] + (f": {t['message']}" if t["message"] else ""), "passed",
                    "dry run" if dry else ("yes" if t["outcome"] == "passed" else "**no**")))
    return out


def rows_fsdp2(part: str, res: dict, dry: bool) -> list[Row]:
    r = res.get("rank0", {})
    if "records" not in r:
        return [(part, "FSDP2, 1 process", f"no result ({r.get('missing', 'rank0.json not written')})", "trains",
                 "no")]
    losses = [x.get("loss") for x in r["records"]]
    sharded = len(r.get("shards", {}))
    text = (f"{r['distributed_type']}, is_fsdp2 {r['is_fsdp2']}, {sharded} DTensor parameters, "
            f"{len(r.get('fsdp_units', []))} FSDP units, loss {fmt(losses[0], 4)} -> {fmt(losses[-1], 4)}")
    ok = r["is_fsdp2"] and all(isinstance(x, float) and math.isfinite(x) for x in losses)
    return [(part, f"FSDP2, {r['world']} process", text, "FSDP2, finite losses", "dry run" if dry else
             ("yes" if ok else "**no**"))]


def rows_cuda_checks(part: str, res: dict, dry: bool) -> list[Row]:
    out: list[Row] = []
    for r in res.get("cuda_checks", {}).get("rows", []):
        ok = r.get("ok")
        out.append((part, r["check"], r["result"], r.get("goal", "-"),
                    "dry run" if dry else ("-" if ok is None else "yes" if ok else "**no**")))
    return out


def rows_train_check(part: str, res: dict, dry: bool) -> list[Row]:
    r = res.get("stdout", {})
    out: list[Row] = []
    for tag in ("eager", "compile"):
        if f"{tag}.loss" not in r:
            continue
        diff = r.get(f"{tag}.resume_max_param_diff")
        out.append((part, f"Trainer {tag}: 6 steps vs 3 + resume + 3",
                    f"loss {fmt(r[f'{tag}.loss'], 4)}, resumed {fmt(r.get(f'{tag}.resumed_loss'), 4)}, max param "
                    f"diff {diff:.1e}, {r.get(f'{tag}.mixed_precision')}, fused AdamW "
                    f"{r.get(f'{tag}.fused_adamw')}, export loads as {r.get(f'{tag}.export_loads')}",
                    "resume exact (0)", "dry run" if dry else ("yes" if diff == 0 else "**no**")))
    if not out:
        out.append((part, "Trainer eager / compile", f"no result ({r.get('missing', 'nothing printed')})",
                    "resume exact (0)", "no"))
    return out


def rows_vit(part: str, res: dict, dry: bool) -> list[Row]:
    rows = res.get("vit", {}).get("rows", [])
    out: list[Row] = [(part, f"{r['model']} {r['mode']}", f"{fmt(r['train_img_s'])} img/s train", "-", "-")
                      for r in rows]
    omni, timm = best(rows, "train_img_s", lambda r: r["model"] == "omni"), best(
        rows, "train_img_s", lambda r: r["model"] == "timm")
    modes = ",".join(sorted({r["mode"] for r in rows})) or "none"
    out.append(goal_row(part, "ViT-B/16 train: omni / timm (same process, same mode)", ratio(omni, timm), 1.3, "x",
                        f"modes {modes}; 1.14x before", dry))
    return out


def rows_whisper(part: str, res: dict, dry: bool) -> list[Row]:
    rows = res.get("whisper", {}).get("rows", [])
    out: list[Row] = []
    for r in rows:
        if r["row"].startswith("train"):
            out.append((part, r["row"], f"{fmt(r['samples_per_s'], 1)} samples/s", "-", "-"))
        else:
            same = f", same tokens as eager {r['same_tokens']:.1%}" if "same_tokens" in r else ""
            out.append((part, r["row"], f"{fmt(r['tokens_per_s_memory'])} tok/s memory given, "
                        f"{fmt(r['tokens_per_s_audio'])} audio in{same}", "-", "-"))
    train = {r["row"]: r.get("samples_per_s") for r in rows if r["row"].startswith("train")}
    mode = "compile" if "train/omni/compile" in train else "eager"
    out.append(goal_row(part, f"Whisper-base train: omni / HF ({mode})",
                        ratio(train.get(f"train/omni/{mode}"), train.get(f"train/hf/{mode}")), 1.6, "x",
                        "1.36x before", dry))
    decode = best(rows, "tokens_per_s_memory", lambda r: r["row"].startswith("decode/omni"))
    out.append(goal_row(part, "Whisper-base greedy decoding b16 x 128 (best omni row)", decode, 50000, " tok/s",
                        "31,346 before", dry))
    return out


def rows_dt(part: str, res: dict, dry: bool) -> list[Row]:
    rows = res.get("dt", {}).get("rows", [])
    out: list[Row] = []
    for r in rows:
        out.append((part, r["row"], f"failed: {r['error']}" if "error" in r else
                    f"{fmt(r['samples_per_s'])} samples/s", "-", "-" if "error" not in r else "**no**"))
    omni = best(rows, "samples_per_s", lambda r: r["row"].startswith("omni"))
    hf = best(rows, "samples_per_s", lambda r: r["row"].startswith("hf"))
    out.append(goal_row(part, "Decision Transformer train: omni best / HF best", ratio(omni, hf), 8.0, "x",
                        f"rows {', '.join(r['row'] for r in rows) or 'none'}; 8.81x before", dry))
    return out


def rows_packing(part: str, res: dict, dry: bool) -> list[Row]:
    doc = res.get("packing", {})
    out: list[Row] = []
    check = doc.get("check")
    if check:
        out.append((part, "equality check, fp32", f"max abs out diff {max(v for k, v in check.items() if k.startswith('max_abs_out_diff')):.1e}, "
                    f"loss {check['loss/packed-flex']:.6f} vs {check['loss/padded-max']:.6f}", "<= tolerance",
                    "dry run" if dry else ("yes" if check["passed"] else "**no**")))
    results = [r for r in doc.get("results", []) if not r.get("oom")]
    for r in results:
        out.append((part, r["variant"], f"{fmt(r['useful_tokens_per_s'])} useful tok/s, step {fmt(r['step_ms'], 1)} ms, "
                    f"padding {r['padding_fraction']:.1%}", "-", "-"))
    speed = next((r.get("packed_flex_speedup") for r in results if r["variant"] == "padded-max"), None)
    out.append(goal_row(part, "packed Flex / padded SDPA (pad to max), useful tok/s", speed, 3.0, "x",
                        "3.44x before", dry))
    return out


def rows_interop(part: str, res: dict, dry: bool) -> list[Row]:
    out: list[Row] = []
    for family, goal, peer in (("vit", 1.2, "timm"), ("whisper", 1.5, "HF")):
        doc = res.get("interop", {}).get(family, {})
        rows = doc.get("rows", [])
        for r in rows:
            out.append((part, f"{doc['model']}: {r['side']} {r['mode']}", f"{fmt(r['rate'], 1)} {r['unit']}/s", "-",
                        "-"))
        name = "converted timm ViT-B/16" if family == "vit" else "converted Whisper-base"
        diff = f"fp32 max |diff| {doc['max_abs_diff']:.1e}" if "max_abs_diff" in doc else "no result"
        omni = best(rows, "rate", lambda r: r["side"] == "omni")
        other = best(rows, "rate", lambda r: r["side"] != "omni")
        out.append(goal_row(part, f"{name} fine-tuning: omni / {peer} (best modes)", ratio(omni, other), goal, "x",
                            diff, dry))
    return out


ROWS: dict[str, Callable[[str, dict, bool], list[Row]]] = {
    "cuda-tests": rows_cuda_tests, "fsdp2": rows_fsdp2, "cuda-checks": rows_cuda_checks,
    "train-check": rows_train_check, "vit": rows_vit, "whisper": rows_whisper, "dt": rows_dt,
    "packing": rows_packing, "interop": rows_interop,
}


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def section(doc: dict[str, Any]) -> str:
    """REPORT.json -> the Markdown section (heading, command, status line, one table)."""
    meta, parts = doc["meta"], doc["parts"]
    dry = meta.get("dry_run") == "1"
    title = "GPU check (dry run on the CPU: toy sizes, no measurement)" if dry else "GPU check"
    lines = [f"## {title} — {meta.get('date', time.strftime('%Y-%m-%d'))}, {meta.get('device', '?')}, "
             f"torch {meta.get('torch', '?')}", "",
             f"`{meta.get('command', 'bash benchmarks/gpu_check.sh')}`", ""]
    status = []
    for name in PARTS:
        if name in parts:
            p = parts[name]
            state = "timed out" if p["timed_out"] else ("ok" if p["rc"] == 0 else f"exit {p['rc']}")
            status.append(f"{name} {p['seconds']:.0f}/{p['budget_s']:.0f} s {state}")
        else:
            status.append(f"{name} not run")
    lines += ["Parts (seconds used / budget): " + "; ".join(status) + ".", ""]
    lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for name in PARTS:
        if name not in parts:
            continue
        p = parts[name]
        rows = ROWS[name](name, p["results"], dry)
        if p["rc"] != 0:
            rows.insert(0, (name, "exit status", "timed out" if p["timed_out"] else f"exit {p['rc']} (see the log)",
                            "0", "**no**"))
        lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def parse_table(markdown: str) -> list[dict[str, str]]:
    """The section's table as dicts keyed by its header (what tests/test_gpu_check.py reads back)."""
    lines = [ln for ln in markdown.splitlines() if ln.startswith("|")]
    split = lambda ln: [c.strip() for c in ln.strip().strip("|").split(" | ")]  # noqa: E731
    header = split(lines[0])
    if set(lines[1]) - set("|-: "):
        raise ValueError(f"second table line is not a separator: {lines[1]!r}")
    return [dict(zip(header, split(ln), strict=True)) for ln in lines[2:]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add")
    a.add_argument("report", type=Path)
    a.add_argument("part", choices=PARTS)
    a.add_argument("--rc", type=int, required=True)
    a.add_argument("--seconds", type=float, required=True)
    a.add_argument("--budget", type=float, required=True)
    a.add_argument("--json", type=Path, action="append", default=[])
    a.add_argument("--junit", type=Path)
    a.add_argument("--stdout-json", type=Path)
    a.add_argument("--meta", action="append", default=[], help="key=value for the report's meta")
    s = sub.add_parser("section")
    s.add_argument("report", type=Path)
    s.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "add":
        meta = dict(kv.split("=", 1) for kv in args.meta)
        add(args.report, args.part, args.rc, args.seconds, args.budget, args.json, args.junit, args.stdout_json, meta)
        return 0
    text = section(json.loads(args.report.read_text()))
    if args.out:
        write_atomic(args.out, text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
