"""What the recipes do when something is the user's to fix: one line ``recipes/X.py: error: ...`` and exit status
2 (user errors, missing optional packages naming the extra, a missing text corpus naming the recipe's ``text``
entry), tracebacks only for bugs; the entries that reach the data builders (text, max_corrupt_fraction); the
DT recipe's checkpoints, TensorBoard logs and resume; the whisper recipe's WER / CER at evaluation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from omni.recipe_runtime import TEXT_OPTION, run_recipe
from omni.deps import MissingDependency, install_hint, require
from conftest import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    return load_recipe(name, f"recipe_errors_{name}")


class Stop(Exception):
    """Raised by the fakes below once they have seen what they were given."""


def run(script: str, *args: str, missing: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python recipes/<script> args`` from the repository root; ``missing``: a module made unimportable
    (sys.modules[name] = None, as when it is not installed)."""
    code = ("import runpy, sys\n"
            + (f"sys.modules[{missing!r}] = None\n" if missing else "")
            + f"sys.argv = {[f'recipes/{script}', *args]!r}\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def one_line_error(proc: subprocess.CompletedProcess, script: str) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"recipes/{script}: error: "), proc.stderr
    return line


# ----------------------------------------------------------------------------------------------------
# run_recipe: user errors are one line and exit 2, bugs keep their traceback


def user_errors():
    from omni.data.shards import DatasetError
    from omni.export import DiskFullError
    from omni.lock import LockedError
    from omni.train import ResumeMismatchError, RunExistsError

    return [ValueError("bad value"), FileNotFoundError("data/x/manifest.json not found"),
            LockedError("runs/x is held by pid 7"), DatasetError("shard 3 does not match its manifest"),
            ResumeMismatchError("runs/x holds another run: lr: 0.1 -> 0.2"), RunExistsError("runs/x exists"),
            DiskFullError("no space left on the device writing runs/x/checkpoints/step-000010")]


@pytest.mark.parametrize("error", user_errors(), ids=lambda e: type(e).__name__)
def test_user_errors_are_one_line_and_exit_2(error, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["recipes/vit.py"])
    monkeypatch.delenv("OMNI_TRACEBACK", raising=False)

    def main():
        raise error

    with pytest.raises(SystemExit) as exc:
        run_recipe(main)
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"recipes/vit.py: error: {error}\n"


def test_bugs_keep_their_traceback_and_results_set_the_status(monkeypatch):
    monkeypatch.delenv("OMNI_TRACEBACK", raising=False)
    for bug in (RuntimeError("a bug"), KeyError("x"), TypeError("y")):
        with pytest.raises(type(bug)):
            run_recipe(lambda: (_ for _ in ()).throw(bug))
    for result, status in (({"step": 3}, 0), (None, 1)):
        with pytest.raises(SystemExit) as exc:
            run_recipe(lambda: result)
        assert exc.value.code == status
    monkeypatch.setenv("OMNI_TRACEBACK", "1")  # the traceback of a user error, on request
    with pytest.raises(ValueError):
        run_recipe(lambda: (_ for _ in ()).throw(ValueError("bad")))


def test_a_recipe_user_error_is_one_line():
    line = one_line_error(run("vit.py", "--preset", "tiny", "--data", "/nonexistent/fmnist", "--set", "build=None"),
                          "vit.py")
    assert "/nonexistent/fmnist/manifest.json not found" in line


# ----------------------------------------------------------------------------------------------------
# Missing optional packages: one line naming the extra that installs them


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    with pytest.raises(MissingDependency) as err:
        require("gymnasium")
    assert str(err.value) == 'gymnasium is not installed: pip install -e ".[rl]" (from the omni checkout)'
    assert isinstance(err.value, ModuleNotFoundError)  # `except ImportError` still catches it
    assert require("json").dumps([1]) == "[1]"


def test_install_hint_finds_the_missing_module_behind_other_errors(monkeypatch):
    from omni.data.speech import ESpeak

    monkeypatch.setitem(sys.modules, "espeakng_loader", None)
    with pytest.raises(ImportError) as err:  # omni's own wrapper of the ModuleNotFoundError
        ESpeak()
    assert install_hint(err.value) == 'espeakng-loader is not installed: pip install -e ".[speech]" (from the omni ' \
                                      'checkout)'
    for module, extra in (("mujoco", "mujoco: pip install -e \".[rl]\""), ("h5py", "minari[hdf5]"),
                          ("minari.storage", "minari[hdf5]")):
        try:  # as gymnasium reports a missing MuJoCo: its own error, raised from the ModuleNotFoundError
            try:
                raise ModuleNotFoundError(f"No module named {module!r}", name=module)
            except ImportError as exc:
                raise RuntimeError("MuJoCo is not installed") from exc
        except RuntimeError as exc:
            hint = install_hint(exc)
        assert hint is not None and extra.split(":")[0] in hint and '".[rl]"' in hint, hint
    assert install_hint(ModuleNotFoundError("No module named 'numpy'", name="numpy")) is None  # not optional: a bug
    assert install_hint(ValueError("x")) is None


def test_dt_recipe_without_gymnasium_says_what_to_install(tmp_path):
    proc = run("decision_transformer.py", "--preset", "tiny", "--data", str(tmp_path / "data"), "--out",
               str(tmp_path / "out"), missing="gymnasium")
    assert one_line_error(proc, "decision_transformer.py").endswith('gymnasium is not installed: pip install -e '
                                                                    '".[rl]" (from the omni checkout)')
    assert not (tmp_path / "data").exists()  # stopped before building anything


def test_whisper_recipe_without_espeak_says_what_to_install(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("It was a fine day. The sun was out.\n")
    proc = run("whisper.py", "--preset", "tiny", "--out", str(tmp_path / "out"), "--set",
               f"data={str(tmp_path / 'data')!r}", f"text=[{str(corpus)!r}]", missing="espeakng_loader")
    assert one_line_error(proc, "whisper.py").endswith('espeakng-loader is not installed: pip install -e ".[speech]" '
                                                       '(from the omni checkout)')


# ----------------------------------------------------------------------------------------------------
# The text corpus: the recipes' `text` entry


def test_whisper_missing_corpus_names_the_text_entry(tmp_path):
    proc = run("whisper.py", "--preset", "tiny", "--out", str(tmp_path / "out"), "--set",
               f"data={str(tmp_path / 'data')!r}", env={"OMNI_AUSTEN_DIR": str(tmp_path / "no-austen")})
    line = one_line_error(proc, "whisper.py")
    assert TEXT_OPTION in line and "--text" not in line, line
    assert TEXT_OPTION == '--set "text=[\'corpus.txt\']"'
    proc = run("whisper.py", "--preset", "tiny", "--out", str(tmp_path / "out"), "--set",
               f"data={str(tmp_path / 'data')!r}", f"text=[{str(tmp_path / 'missing.txt')!r}]")
    assert one_line_error(proc, "whisper.py").endswith(f"text: {tmp_path / 'missing.txt'}: no such file or folder")


def test_whisper_text_reaches_the_speech_builder(tmp_path, monkeypatch):
    recipe = load("whisper")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Some text.\n")
    seen = {}
    monkeypatch.setattr(recipe, "require", lambda *a, **k: None)
    monkeypatch.setattr(recipe, "build_speech_synth", lambda data, **kw: seen.update(kw, data=data))
    cfg = recipe.parse_args(["--preset", "tiny", "--set", f"data={str(tmp_path / 'd')!r}", f"text={str(corpus)!r}"])
    recipe.ensure_data(cfg, 0, 1)
    assert seen == {"data": tmp_path / "d", "text": [str(corpus)], "seed": 0, "train": 64, "test": 16}


def test_multimodal_text_task_reads_the_text_entry(tmp_path, monkeypatch):
    from omni.tokenizers.text import TextTokenizer

    recipe = load("multimodal")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Paragraph number {i} has a few words in it." for i in range(50)))
    cfg = recipe.parse_args(["--preset", "tiny", "--set", f"cache={str(tmp_path / 'cache')!r}",
                             f"text=[{str(corpus)!r}]"])
    texts = recipe.text_corpus(cfg["tasks"]["text"], cfg, TextTokenizer())
    assert len(texts["train"]) + len(texts["test"]) == 50 and texts["test"] == ["Paragraph number 49 has a few "
                                                                                "words in it."]
    assert [p.name for p in (tmp_path / "cache").iterdir()][0].startswith("austen-96-")  # not the Austen cache
    monkeypatch.setenv("OMNI_AUSTEN_DIR", str(tmp_path / "no-austen"))
    cfg = recipe.parse_args(["--preset", "tiny", "--set", f"cache={str(tmp_path / 'cache2')!r}"])
    with pytest.raises(FileNotFoundError, match=r"text=\['corpus.txt'\]"):
        recipe.text_corpus(cfg["tasks"]["text"], cfg, TextTokenizer())
    seen = {}  # and the speech it synthesises reads the same corpus

    def build(data, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(recipe, "require", lambda *a, **k: None)
    monkeypatch.setattr(recipe, "build_speech_synth", build)
    cfg = recipe.parse_args(["--preset", "tiny", "--set", f"text=[{str(corpus)!r}]"])
    with pytest.raises(Stop):
        recipe.speech_shards(dict(recipe.TASKS["asr"], shards=str(tmp_path / "shards")), cfg, None)
    assert seen["text"] == [str(corpus)]


# ----------------------------------------------------------------------------------------------------
# max_corrupt_fraction reaches the shard readers


def fake_loader(seen: dict):
    def loader(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    return loader


def test_max_corrupt_fraction_reaches_the_shard_readers(tmp_path, monkeypatch):
    manifest = {"splits": {"train": {}, "test": {}}, "class_names": ["a", "b"]}
    (tmp_path / "manifest.json").write_text("{}")
    for name, call in (("vit", lambda r, cfg: r.build_data(cfg, 0, 1, __import__("torch").device("cpu"))),
                       ("whisper", lambda r, cfg: r.main(["--preset", "tiny", "--data", str(tmp_path), "--set",
                                                          "max_corrupt_fraction=0.25"]))):
        recipe, seen = load(name), {}
        monkeypatch.setattr(recipe, "read_manifest", lambda path, **kw: manifest)
        monkeypatch.setattr(recipe, "ShardLoader", fake_loader(seen))
        cfg = recipe.parse_args(["--preset", "tiny", "--data", str(tmp_path), "--set", "max_corrupt_fraction=0.25"])
        with pytest.raises(Stop):
            call(recipe, cfg)
        assert seen["max_corrupt_fraction"] == 0.25, name
    dt, seen = load("decision_transformer"), {}
    monkeypatch.setattr(dt, "read_manifest", lambda path, **kw: {})
    monkeypatch.setattr(dt, "load_episodes", fake_loader(seen))
    with pytest.raises(Stop):
        dt.load_data(dt.parse_args(["--preset", "tiny", "--data", str(tmp_path), "--set", "max_corrupt_fraction=0.25"]))
    assert seen["max_corrupt_fraction"] == 0.25
    mm, seen = load("multimodal"), {}
    import omni.data.reader

    monkeypatch.setattr(omni.data.reader, "ShardLoader", fake_loader(seen))
    cfg = mm.parse_args(["--preset", "tiny", "--set", f"cache={str(tmp_path / 'cache')!r}",
                         "max_corrupt_fraction=0.25"])
    with pytest.raises(Stop):
        mm.speech_shards(dict(mm.TASKS["asr"], shards=str(tmp_path)), cfg, None)
    assert seen["max_corrupt_fraction"] == 0.25


# ----------------------------------------------------------------------------------------------------
# The DT recipe: checkpoints, TensorBoard logs, resume


def test_dt_recipe_checkpoints_logs_and_resumes(tmp_path, capsys):
    pytest.importorskip("gymnasium")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from omni.data.builders_rl import build_gym

    data, out = tmp_path / "cartpole", tmp_path / "run"
    build_gym(data, env="CartPole-v1", episodes=10, mix="expert:0.5,medium:0.3,random:0.2", seed=0,
              reference_episodes=2, minari=False, quiet=True)
    recipe = load("decision_transformer")
    args = ["--preset", "tiny", "--data", str(data), "--out", str(out), "--set", "steps=4", "checkpoint_every=2",
            "methods=['dt']", "eval_seeds=1", "progress=False"]
    first = recipe.main(args)
    run_dir = out / "dt-seed0"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000002", "step-000004"]
    logs = EventAccumulator(str(run_dir / "logs" / "dt-0"), size_guidance={"scalars": 0})
    logs.Reload()
    tags = logs.Tags()["scalars"]
    assert "train/loss" in tags and "eval/target500/score_mean" in tags, tags  # training curve and rollout score
    assert [e.step for e in logs.Scalars("eval/target500/score_mean")] == [4]

    # killed after step 2: its newest checkpoint and the export never written; the re-run continues from step 2
    shutil.rmtree(run_dir / "checkpoints" / "step-000004")
    shutil.rmtree(run_dir / "final")
    capsys.readouterr()
    second = recipe.main(args)
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "step-000002" in printed, printed
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert second["results"] == first["results"]  # resumed exactly: the same policy, the same rollouts
    # a finished run is not trained again; its rollouts are still scored and reported
    third = recipe.main(args)
    assert "already finished" in capsys.readouterr().out and third["results"] == first["results"]


# ----------------------------------------------------------------------------------------------------
# The whisper recipe's evaluation prints WER / CER


def test_whisper_evaluation_logs_wer_and_cer(tmp_path, capsys):
    pytest.importorskip("espeakng_loader")
    recipe = load("whisper")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"The {w} cat sat on the mat near the door." for w in
                                  "red green blue black white brown grey pink".split()))
    build = {"train": 6, "test": 3, "workers": 1, "quiet": True}
    metrics = recipe.main(["--preset", "tiny", "--out", str(tmp_path / "run"), "--set", f"data='{tmp_path / 'data'}'",
                           f"build={build!r}", f"text=[{str(corpus)!r}]", "steps=2", "batch_size=3",
                           "eval_batch_size=3", "max_new_tokens=4", "progress=False"])
    printed = capsys.readouterr().out
    evaluation = [line for line in printed.splitlines() if line.startswith("step 2: eval/")]
    assert len(evaluation) == 1, printed
    assert "eval/cer " in evaluation[0] and "eval/wer " in evaluation[0] and "eval/ctc_cer " in evaluation[0]
    assert "char_edits" not in printed and "eval/chars" not in printed
    assert 0 <= metrics["eval/cer"] and 0 <= metrics["eval/wer"] and metrics["eval/words"] == 30  # 3 x 10 words
