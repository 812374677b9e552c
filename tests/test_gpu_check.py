"""benchmarks/gpu_check.sh stays runnable while no GPU is lent: its --dry-run runs every part at toy sizes on the
CPU (the CUDA-only tests collected and skipped), and the report it writes is checked here: every part's exit
status and JSON fields, and the results.md section (a Markdown table with a row per test, per benchmark row and
per standing goal). The section writer's goal logic is checked on a made-up report without running anything."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_report  # noqa: E402

CUDA_TESTS = ["tests/test_cuda_graphs.py::test_cuda_graph_matches_eager",
              "tests/test_cuda_graphs.py::test_cuda_graph_compiled_bf16_matches_compiled_eager",
              "tests/test_cuda_graphs.py::test_graphed_decoding_with_logit_rules[cuda]",
              "tests/test_whisper_decode_graph.py::test_cuda_graph_equals_eager"]
GOALS = ["ViT-B/16 train: omni / timm (same process, same mode)", "Whisper-base train: omni / HF (eager)",
         "Whisper-base greedy decoding b16 x 128 (best omni row)", "Decision Transformer train: omni best / HF best",
         "packed Flex / padded SDPA (pad to max), useful tok/s",
         "converted timm ViT-B/16 fine-tuning: omni / timm (best modes)",
         "converted Whisper-base fine-tuning: omni / HF (best modes)"]


def script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**__import__("os").environ, "PYTHON": sys.executable})


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    t0 = time.perf_counter()
    proc = script("--dry-run", "--out", str(out))
    seconds = time.perf_counter() - t0
    print(f"gpu_check.sh --dry-run: {seconds:.0f} s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return out, proc, seconds


def test_dry_run_runs_every_part(dry_run):
    out, proc, seconds = dry_run
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log", "results_section.md"]
    doc = json.loads((out / "gpu_check.json").read_text())
    meta, parts = doc["meta"], doc["parts"]
    assert meta["dry_run"] == "1" and meta["command"] == "bash benchmarks/gpu_check.sh --dry-run"
    assert meta["torch"].startswith("2.") and meta["device"].startswith("CPU")
    assert list(parts) == gpu_report.PARTS
    for name, p in parts.items():
        assert p["rc"] == 0 and not p["timed_out"], (name, p)
        assert 0 < p["seconds"] <= p["budget_s"]
    assert sum(p["seconds"] for p in parts.values()) <= seconds
    r = {name: p["results"] for name, p in parts.items()}
    tests = r["cuda-tests"]["pytest"]["tests"]
    assert [t["id"] for t in tests] == CUDA_TESTS  # collected (a renamed test would be missing) and skipped
    assert {t["outcome"] for t in tests} == {"skipped"}
    rank0 = r["fsdp2"]["rank0"]
    assert rank0["is_fsdp2"] and rank0["world"] == 1 and len(rank0["records"]) == 6 and rank0["shards"]
    checks = r["cuda-checks"]["cuda_checks"]["rows"]
    assert len(checks) == 4 and all(c["ok"] in (True, None) for c in checks)
    assert checks[0]["out_diff"] < 1e-5  # packed Flex (eager on the CPU) vs dense SDPA
    train = r["train-check"]["stdout"]
    assert train["eager.resume_max_param_diff"] == 0 and train["compile.resume_max_param_diff"] == 0
    assert [(x["model"], x["mode"]) for x in r["vit"]["vit"]["rows"]] == [("omni", "eager"), ("timm", "eager")]
    assert all(x["train_img_s"] > 0 for x in r["vit"]["vit"]["rows"])
    whisper = {x["row"]: x for x in r["whisper"]["whisper"]["rows"]}
    assert list(whisper) == ["train/hf/eager", "train/omni/eager", "decode/omni/eager", "decode/omni/graph"]
    assert whisper["decode/omni/graph"]["same_tokens"] == 1.0 and whisper["train/omni/eager"]["samples_per_s"] > 0
    dt = r["dt"]["dt"]["rows"]
    assert [x["row"] for x in dt] == ["hf-eager", "omni-graph"] and all(x["samples_per_s"] > 0 for x in dt)
    packing = r["packing"]["packing"]
    assert packing["check"]["passed"] and [x["variant"] for x in packing["results"]] == ["packed-flex", "padded-max"]
    interop = r["interop"]["interop"]
    for family in ("vit", "whisper"):
        assert interop[family]["max_abs_diff"] < 1e-5 and {x["side"] for x in interop[family]["rows"]} >= {"omni"}


def test_dry_run_section_is_a_markdown_table(dry_run):
    out, proc, _ = dry_run
    text = (out / "results_section.md").read_text()
    assert text in proc.stdout  # printed too: the device call's output tail carries it
    heading, _, command = text.splitlines()[:3]
    assert heading.startswith("## GPU check (dry run on the CPU: toy sizes, no measurement) — 20")
    assert command == "`bash benchmarks/gpu_check.sh --dry-run`"
    rows = gpu_report.parse_table(text)
    assert set(rows[0]) == set(gpu_report.HEADER)
    assert [r["part"] for r in rows] == sorted((r["part"] for r in rows), key=gpu_report.PARTS.index)
    assert {r["part"] for r in rows} == set(gpu_report.PARTS)
    assert [r["row"].strip("`") for r in rows if r["part"] == "cuda-tests"] == CUDA_TESTS
    goals = [r for r in rows if r["goal"].startswith(">=")]
    assert [r["row"] for r in goals] == GOALS
    assert all(r["met"] == "dry run" for r in goals)  # a dry run claims no goal
    assert not any(r["result"].startswith("not measured") for r in goals)


def fake_report(**rates) -> dict:
    """A report shaped like a GPU run's, with chosen numbers (not a measurement: the writer's logic only)."""
    vit = [{"model": "omni", "mode": "compile", "train_img_s": rates["omni_vit"]},
           {"model": "timm", "mode": "compile", "train_img_s": 3000.0}]
    whisper = [{"row": "train/hf/compile", "samples_per_s": 600.0},
               {"row": "train/omni/compile", "samples_per_s": rates["omni_whisper"]},
               {"row": "decode/omni/graph+compile", "tokens_per_s_memory": rates["decode"],
                "tokens_per_s_audio": 1.0, "same_tokens": 1.0}]
    parts = {"vit": {"rc": 0, "seconds": 60.0, "budget_s": 70, "timed_out": False, "results": {"vit": {"rows": vit}}},
             "whisper": {"rc": 0, "seconds": 70.0, "budget_s": 75, "timed_out": False,
                         "results": {"whisper": {"rows": whisper}}},
             "dt": {"rc": 124, "seconds": 35.0, "budget_s": 35, "timed_out": True, "results": {"dt": {"missing": "x"}}}}
    return {"meta": {"date": "2026-01-01 00:00 UTC", "device": "GPU X", "torch": "2.11.0", "command": "cmd",
                     "dry_run": "0"}, "parts": parts}


def test_section_checks_the_goals():
    rows = gpu_report.parse_table(gpu_report.section(fake_report(omni_vit=4000.0, omni_whisper=900.0, decode=6e4)))
    met = {r["row"]: (r["result"].split()[0], r["met"]) for r in rows if r["goal"].startswith(">=")}
    assert met["ViT-B/16 train: omni / timm (same process, same mode)"] == ("1.33x", "yes")
    assert met["Whisper-base train: omni / HF (compile)"] == ("1.50x", "**no**")  # goal 1.6x
    assert met["Whisper-base greedy decoding b16 x 128 (best omni row)"] == ("60,000", "yes")
    assert met["Decision Transformer train: omni best / HF best"] == ("not", "no")  # nothing measured
    timed_out = [r for r in rows if r["part"] == "dt" and r["row"] == "exit status"]
    assert timed_out and timed_out[0]["result"] == "timed out"
    assert [r["part"] for r in rows if r["part"] not in ("vit", "whisper", "dt")] == []
    lower = gpu_report.parse_table(gpu_report.section(fake_report(omni_vit=3800.0, omni_whisper=990.0, decode=4e4)))
    met = {r["row"]: r["met"] for r in lower if r["goal"].startswith(">=")}
    assert met["ViT-B/16 train: omni / timm (same process, same mode)"] == "**no**"  # 1.27x
    assert met["Whisper-base train: omni / HF (compile)"] == "yes"  # 1.65x
    assert met["Whisper-base greedy decoding b16 x 128 (best omni row)"] == "**no**"


def test_report_add_reads_junit_and_printed_json(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="test_x" time="1.5"/>'
                     '<testcase classname="tests.test_a" name="test_y[cuda]" time="0">'
                     '<skipped message="needs CUDA">s</skipped></testcase>'
                     '<testcase classname="tests.test_b" name="test_z" time="2"><failure message="assert 1 == 2">'
                     'tb</failure></testcase></testsuite></testsuites>')
    printed = tmp_path / "out.txt"
    printed.write_text('step 1\n{"a": 1}\nnoise {not json}\n{\n  "a": 2,\n  "b": {"c": 3}\n}\ntail\n')
    report = tmp_path / "r.json"
    gpu_report.main(["add", str(report), "cuda-tests", "--rc", "1", "--seconds", "3.25", "--budget", "90",
                     "--junit", str(junit), "--meta", "device=GPU X"])
    gpu_report.main(["add", str(report), "train-check", "--rc", "0", "--seconds", "9", "--budget", "40",
                     "--stdout-json", str(printed), "--json", str(tmp_path / "absent.json")])
    doc = json.loads(report.read_text())
    tests = doc["parts"]["cuda-tests"]["results"]["pytest"]
    assert [(t["id"], t["outcome"]) for t in tests["tests"]] == [
        ("tests/test_a.py::test_x", "passed"), ("tests/test_a.py::test_y[cuda]", "skipped"),
        ("tests/test_b.py::test_z", "failed")]
    assert tests["tests"][2]["message"] == "assert 1 == 2" and tests["counts"] == {"passed": 1, "skipped": 1,
                                                                                   "failed": 1}
    train = doc["parts"]["train-check"]
    assert train["results"]["stdout"] == {"a": 2, "b": {"c": 3}}  # the last object printed
    assert train["results"]["absent"]["missing"].startswith("FileNotFoundError")
    assert doc["meta"] == {"device": "GPU X"} and doc["parts"]["cuda-tests"]["seconds"] == 3.2


@pytest.mark.parametrize("args, message", [
    (["--only", "vit,nope"], "--only: unknown part 'nope'"),
    (["--budget", "soon"], "--budget must be whole seconds"),
    (["--fast"], "unknown argument --fast"),
])
def test_bad_arguments_one_line_exit_2(args, message):
    proc = script(*args, timeout=30)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
