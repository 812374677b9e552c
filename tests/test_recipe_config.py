"""The four recipes' command lines: every preset parses and is valid; every --set counts, in order; a bad value
stops the recipe before any data is built with one line naming the entry (exit status 2); --help lists every
entry with its default and the presets; text / max_corrupt_fraction / resume entries everywhere they apply."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("vit", "whisper", "decision_transformer", "multimodal")


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_config_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recipes():
    return {name: load(name) for name in RECIPES}


def parse(recipe, *items: str, preset: str = "tiny") -> dict:
    """parse_args, with --data where the recipe has it (the ViT's B/16 preset needs one; none is read)."""
    data = [] if recipe.__name__.endswith("multimodal") else ["--data", "/nonexistent/data"]
    return recipe.parse_args(["--preset", preset, *data, *items])


def rejected(recipe, capsys, *items: str) -> str:
    """The one error line of a refused command line (exit status 2, as argparse's errors)."""
    with pytest.raises(SystemExit) as exc:
        parse(recipe, *items)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("name", RECIPES)
def test_every_preset_parses_into_valid_values(recipes, name):
    recipe = recipes[name]
    for preset in recipe.PRESETS:
        cfg = parse(recipe, preset=preset)
        assert cfg["preset"] == preset and cfg["resume"] == "auto" and cfg["max_corrupt_fraction"] == 0.01


@pytest.mark.parametrize("name", RECIPES)
def test_repeated_set_flags_all_count_in_order(recipes, name):
    cfg = parse(recipes[name], "--set", "steps=7", "--set", "lr=0.5", "min_lr_ratio=0.5", "--set", "steps=9")
    assert (cfg["steps"], cfg["lr"], cfg["min_lr_ratio"]) == (9, 0.5, 0.5)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("item, line", [
    ("steps=abc", "steps must be an integer >= 1, got 'abc'"),
    ("steps=0", "steps must be an integer >= 1, got 0"),
    ("steps=1.5", "steps must be an integer >= 1, got 1.5"),
    ("lr=nan", "lr must be a finite number > 0, got 'nan'"),
    ("lr=1e999", "lr must be a finite number > 0, got inf"),
    ("lr=0", "lr must be a finite number > 0, got 0"),
    ("batch_size=0", "batch_size must be an integer >= 1, got 0"),
    ("batch_size=-4", "batch_size must be an integer >= 1, got -4"),
    ("progress='yes'", "progress must be True or False, got 'yes'"),
    ("progress=1.5", "progress must be True or False, got 1.5"),
    ("min_lr_ratio=2", "min_lr_ratio must be a finite number in [0, 1], got 2"),
    ("max_corrupt_fraction=-0.1", "max_corrupt_fraction must be a finite number in [0, 1], got -0.1"),
    ("resume=maybe", "resume must be 'auto', 'force' or 'never', got 'maybe'"),
    ("workers=-1", "workers must be an integer >= 0, got -1"),
    ("trunk='XL'", "trunk must be 'tiny', "),
    ("trunk_overrides={'dmodel': 8}", "trunk_overrides must be a dict (keyed by TrunkConfig fields: d_model, "),
])
def test_bad_values_stop_at_parsing_with_one_line(recipes, capsys, name, item, line):
    if name == "vit" and item.startswith("steps="):  # the ViT's steps may be None (epochs decide)
        line = line.replace(">= 1,", ">= 1 or None,")
    if item.partition("=")[0] not in recipes[name].COMMON:  # the DT has no data workers, multimodal no batch_size
        pytest.skip(f"{name} has no {item.partition('=')[0]}")
    message = rejected(recipes[name], capsys, "--set", item)
    assert f"error: {line}" in message, message


def test_recipe_specific_entries_are_checked(recipes, capsys):
    vit, whisper, dt, mm = (recipes[n] for n in RECIPES)
    assert rejected(vit, capsys, "--set", "channels=2").endswith("channels must be 1 or 3, got 2")
    assert rejected(vit, capsys, "--set", "steps=None", "epochs=None").endswith("error: set steps or epochs")
    assert rejected(whisper, capsys, "--set", "build={'trian': 5}").endswith(
        "build must be a dict (keyed by build_speech_synth's parameters: train, test, test_sentences, per_sentence, "
        "text, voices, variants, rates, pitches, snrs, noise_kinds, min_words, max_words, seed, workers, shard_size, "
        "quiet, force) or None, got {'trian': 5}")
    assert rejected(whisper, capsys, "--set", "audio_positions='learned'").endswith(
        "audio_positions must be 'none' or 'sinusoidal', got 'learned'")
    assert rejected(dt, capsys, "--set", "methods=['dt', 'xx']").endswith("methods[1] must be 'dt', 'bc' or 'fbc', "
                                                                          "got 'xx'")
    assert rejected(dt, capsys, "--set", "methods=[]").endswith("methods must be a non-empty list of 'dt', 'bc', "
                                                                "'fbc', got []")
    assert rejected(dt, capsys, "--set", "train_seeds=[0.5]").endswith("train_seeds[0] must be an integer >= 0, "
                                                                       "got 0.5")
    assert rejected(dt, capsys, "--set", "targets=[1, 'a']").endswith("targets[1] must be a finite number, got 'a'")
    assert rejected(dt, capsys, "--set", "cuda_graph='yes'").endswith("cuda_graph must be True, False or 'auto', "
                                                                      "got 'yes'")
    # nested entries of the multimodal tasks, by dotted key or as a whole task
    assert rejected(mm, capsys, "--set", "tasks.text.loss_weight=-1").endswith(
        "tasks.text.loss_weight must be a finite number >= 0, got -1")
    assert rejected(mm, capsys, "--set", "tasks.rl.context=0").endswith("tasks.rl.context must be an integer >= 1, "
                                                                        "got 0")
    assert "tasks.text has no entry 'wieght'" in rejected(mm, capsys, "--set",
                                                          "tasks={'text': {'kind': 'lm', 'wieght': 2.0}}")
    assert rejected(mm, capsys, "--set", "tasks={'text': {'weight': 2.0}}").endswith("tasks.text has no 'kind'")
    assert rejected(mm, capsys, "--set", "weights={'image': 'a'}").endswith(
        "weights.image must be a finite number >= 0, got 'a'")
    assert rejected(mm, capsys, "--set", "eval_tasks='x'").endswith("eval_tasks must be True, False or 'end', got 'x'")


def test_good_values_are_normalised(recipes):
    vit, whisper, dt, mm = (recipes[n] for n in RECIPES)
    cfg = parse(vit, "--set", "steps=1e2", "lr=1", "resize=None", "epochs=3")
    assert cfg["steps"] == 100 and type(cfg["steps"]) is int and cfg["lr"] == 1.0 and type(cfg["lr"]) is float
    assert parse(whisper, "--set", "text=corpus.txt")["text"] == ["corpus.txt"]  # one file: a list of one
    assert parse(dt, "--set", "methods=('dt',)", "resume=never")["methods"] == ["dt"]
    cfg = parse(mm, "--set", "tasks.text.loss_weight=2", "text=['a.txt', 'b']", "only='text'")
    assert cfg["tasks"]["text"]["loss_weight"] == 2.0 and cfg["text"] == ["a.txt", "b"]


@pytest.mark.parametrize("name", RECIPES)
def test_help_lists_every_entry_with_its_default_and_the_presets(recipes, capsys, name):
    recipe = recipes[name]
    with pytest.raises(SystemExit) as exc:
        recipe.parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    from omni.config import defaults

    for key, value in defaults(recipe.COMMON).items():
        assert f"\n  {key} = " in out, key
        if not isinstance(value, dict):
            assert f"\n  {key} = {value!r}\n" in out, key
    for preset in recipe.PRESETS:
        assert f"\n  {preset}: " in out, preset
    assert "takes an integer >= 1" in out  # what each entry takes


def test_a_bad_value_from_the_command_line_is_one_line_and_exit_2_before_any_data():
    """The real command: no traceback, no dataset built (the data folder does not exist), status 2."""
    proc = subprocess.run([sys.executable, "recipes/vit.py", "--preset", "tiny", "--data", "/nonexistent/data",
                           "--set", "steps=0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == \
        "recipes/vit.py: error: steps must be an integer >= 1 or None, got 0"
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("name", RECIPES)
def test_resume_reaches_the_train_config(recipes, name):
    from omni.config import train_config

    cfg = parse(recipes[name], "--set", "resume='never'", "out='/tmp/x'")
    assert train_config(cfg).resume == "never"
