"""The four recipes' command lines: every preset parses and is valid; every --set counts, in order; a bad value
stops the recipe before any data is built with one line naming the entry (exit status 2); --help lists every
entry with its default and the presets; text / max_corrupt_fraction / resume entries everywhere they apply."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("vit", "whisper", "decision_transformer", "multimodal")


def load(name: str):
    return load_recipe(name, f"recipe_config_{name}")


@pytest.fixture(scope="module")
def recipes():
    return {name: load(name) for name in RECIPES}


def parse(recipe, *items: str, preset: str = "tiny", data: bool = True) -> dict:
    """parse_args, with --data where the recipe has it (the ViT's B/16 preset needs one; none is read) unless
    ``data`` is False (--data turns a ``build`` entry off)."""
    data = ["--data", "/nonexistent/data"] if data and "data" in recipe.COMMON else []
    return recipe.parse_args(["--preset", preset, *data, *items])


def rejected(recipe, capsys, *items: str, data: bool = True) -> str:
    """The one error line of a refused command line (exit status 2, as argparse's errors)."""
    with pytest.raises(SystemExit) as exc:
        parse(recipe, *items, data=data)
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
    ("trunk_overrides={'dmodel': 8}", "trunk_overrides has no entry 'dmodel'; entries: activation, attention, bias, "),
    # issue 29: values that were never checked
    ("steps=1e100", "steps must be an integer >= 1, got 1e+100: integers must fit in 64 bits (|n| < 2**63)"),
    ("compile='nonsense'", "compile must be True, False, 'default', 'reduce-overhead', 'max-autotune' or "
                           "'max-autotune-no-cudagraphs', got 'nonsense'"),
    ("lr=1e308", "lr must be a finite number > 0, got 1e+308: numbers must be within +-1e+15"),
    ("seed=-1", "seed must be an integer in [0, 2147483647], got -1"),
    ("seed=2147483648", "seed must be an integer in [0, 2147483647], got 2147483648"),
    ("seed=1180591620717411303424", "seed must be an integer in [0, 2147483647], got 1180591620717411303424: "
                                    "integers must fit in 64 bits"),
    ("trunk_overrides.d_model=-1", "trunk_overrides.d_model must be an integer >= 1, got -1"),
    ("trunk_overrides={'d_model': -1}", "trunk_overrides.d_model must be an integer >= 1, got -1"),
    ("trunk_overrides.n_layers=0", "trunk_overrides.n_layers must be an integer >= 1, got 0"),
    ("trunk_overrides.d_model=1.5", "trunk_overrides.d_model must be an integer >= 1, got 1.5"),
    ("trunk_overrides.d_model='big'", "trunk_overrides.d_model must be an integer >= 1, got 'big'"),
    ("trunk_overrides.n_heads=True", "trunk_overrides.n_heads must be an integer >= 1, got True"),
    ("trunk_overrides.bias=1", "trunk_overrides.bias must be True or False, got 1"),
    ("trunk_overrides.norm='batch'", "trunk_overrides.norm must be 'layernorm' or 'rmsnorm', got 'batch'"),
    ("trunk_overrides.mlp_ratio=1e309", "trunk_overrides.mlp_ratio must be a finite number > 0, got inf"),
    ("trunk_overrides.d_modle=8", "--set 'trunk_overrides.d_modle=8': trunk_overrides has no entry 'd_modle'; "
                                  "entries: activation, attention, bias, d_model, dropout, final_norm, "
                                  "max_positions, mlp_ratio, n_heads, n_kv_heads, n_layers, norm, norm_eps, "
                                  "positions, rope_base"),
    ("trunk_overrides.n_heads=7", " is not divisible by n_heads 7"),
    # the model decides it: whisper's decoder passes it (a TypeError traceback), a decoder-only model cannot use it
    ("trunk_overrides.cross_attention=True", "--set 'trunk_overrides.cross_attention=True': trunk_overrides has no "
                                             "entry 'cross_attention'; entries: activation, attention, bias, "
                                             "d_model, "),
    ("text=[]", "text must be a non-empty list of strings or None, got []"),
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
        "build has no entry 'trian'; entries: force, max_words, min_words, noise_kinds, per_sentence, pitches, quiet, "
        "rates, seed, shard_size, snrs, test, test_sentences, text, train, variants, voices, workers")
    # the dotted form: any declared entry, typed from build_speech_synth's annotations, checked as the dict form
    assert rejected(whisper, capsys, "--set", "build.trian=5", data=False).endswith(
        "--set 'build.trian=5': build has no entry 'trian'; entries: force, max_words, min_words, noise_kinds, "
        "per_sentence, pitches, quiet, rates, seed, shard_size, snrs, test, test_sentences, text, train, variants, "
        "voices, workers")
    for item in ("build.train='many'", "build={'train': 'many'}"):
        assert rejected(whisper, capsys, "--set", item, data=False).endswith(
            "build.train must be an integer, got 'many'")
    assert rejected(whisper, capsys, "--set", "build.voices=3", data=False).endswith(
        "build.voices must be a list, got 3")
    assert rejected(whisper, capsys, "--set", "build.seed=-1", data=False).endswith(
        "build.seed must be an integer in [0, 2147483647], got -1")
    assert rejected(whisper, capsys, "--set", "build.test=1e100", data=False).endswith(
        "build.test must be an integer, got 1e+100: integers must fit in 64 bits (|n| < 2**63)")
    assert parse(whisper, "--set", "build.voices=['en-us']", "build.workers=None", data=False)["build"] == \
        {"train": 64, "test": 16, "voices": ["en-us"], "workers": None}
    assert "build is None here: give the whole dict, --set build={...}" in \
        rejected(whisper, capsys, "--set", "build=None", "build.train=5")
    assert rejected(whisper, capsys, "--set", "audio_positions='learned'").endswith(
        "audio_positions must be 'none' or 'sinusoidal', got 'learned'")
    assert rejected(dt, capsys, "--set", "methods=['dt', 'xx']").endswith("methods[1] must be 'dt', 'bc' or 'fbc', "
                                                                          "got 'xx'")
    assert rejected(dt, capsys, "--set", "methods=[]").endswith("methods must be a non-empty list of 'dt', 'bc', "
                                                                "'fbc', got []")
    assert rejected(dt, capsys, "--set", "train_seeds=[0.5]").endswith("train_seeds[0] must be an integer in "
                                                                       "[0, 2147483647], got 0.5")
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
    from omni.recipe_runtime import train_config

    cfg = parse(recipes[name], "--set", "resume='never'", "out='/tmp/x'")
    assert train_config(cfg).resume == "never"


# ----------------------------------------------------------------------------------------------------
# Issue 29: every entry of every recipe against hostile values, and the trunk the entries make

ALL_RECIPES = (*RECIPES, "lm")
HOSTILE = ("-1", "0", "1.5", "1e100", "1e308", "-1e308", "1e999", "2**64", "18446744073709551616", "True", "'nonsense'",
           "[]", "{}", "None", "[1e308]", "{'x': 1e308}", "''")


@pytest.mark.parametrize("name", ALL_RECIPES)
def test_every_entry_takes_hostile_values_in_one_line_or_within_bounds(capsys, name):
    """Each COMMON entry with each hostile value: a one-line refusal (exit 2), or a value within the bounds every
    entry has (integers of 64 bits, numbers finite and within +-1e15, nested ones included), never a traceback."""
    from omni.config import FLOAT_LIMIT, INT_LIMIT

    recipe = load(name)

    def bounded(value) -> bool:
        if isinstance(value, dict):
            return all(map(bounded, value.values()))
        if isinstance(value, list):
            return all(map(bounded, value))
        if isinstance(value, float):
            return abs(value) <= FLOAT_LIMIT
        return not isinstance(value, int) or isinstance(value, bool) or abs(value) < INT_LIMIT

    refused = 0
    for key in recipe.COMMON:
        for value in HOSTILE:
            try:
                cfg = parse(recipe, "--set", f"{key}={value}", data=False)
            except SystemExit as exc:
                assert exc.code == 2, (key, value)
                lines = capsys.readouterr().err.strip().splitlines()
                assert ": error: " in lines[-1] and key in lines[-1] and "Traceback" not in "\n".join(lines), lines
                refused += 1
                continue
            assert bounded(cfg[key]), (key, value, cfg[key])
    assert refused > len(recipe.COMMON) * 4  # most hostile values are refused


def test_target_fractions_beyond_the_bound_never_reach_results(capsys):
    dt = load("decision_transformer")
    for item, line in [("target_fractions=[1e308]", "target_fractions[0] must be a finite number, got 1e+308: "
                                                    "numbers must be within +-1e+15"),
                       ("target_fractions=[-1e308]", "target_fractions[0] must be a finite number, got -1e+308"),
                       ("target_fractions=[1e999]", "target_fractions[0] must be a finite number, got inf"),
                       ("targets=[1e308]", "targets[0] must be a finite number, got 1e+308")]:
        assert line in rejected(dt, capsys, "--set", item)


@pytest.mark.parametrize("name, derived", [("vit", "image_size // patch"), ("decision_transformer", "3 x context"),
                                           ("lm", "context")])
def test_trunk_fields_a_recipe_sets_itself_are_refused_as_overrides(capsys, name, derived):
    """max_positions (and positions / dropout where the recipe has those entries) would reach omni.trunk.preset
    twice: a TypeError traceback before; now one line that says where the value comes from."""
    recipe = load(name)
    line = rejected(recipe, capsys, "--set", "trunk_overrides.max_positions=8")
    assert f"(without max_positions: max_positions comes from {derived})" in line
    assert rejected(recipe, capsys, "--set", "trunk_overrides={'positions': 'rope'}").endswith(
        "trunk_overrides.positions: this recipe sets the trunk's positions from its own entry: --set positions=...")
    if "dropout" in recipe.COMMON:
        assert "trunk_overrides.dropout: this recipe sets" in rejected(recipe, capsys, "--set",
                                                                       "trunk_overrides.dropout=0.1")


def test_a_trunk_too_big_for_the_machine_is_refused_with_its_estimate(capsys, monkeypatch):
    import omni.config

    vit = load("vit")
    monkeypatch.setattr(omni.config, "machine_memory", lambda: 8 * 10**9)
    line = rejected(vit, capsys, "--set", "trunk_overrides={'d_model': 100_000, 'n_layers': 100}")
    # 100 layers of 12 d^2 (+ biases and norms) = 1.2e13 parameters, x 16 bytes
    assert line.endswith("trunk 'tiny' with trunk_overrides {'d_model': 100000, 'n_layers': 100} and max_positions 4 "
                         "(from image_size // patch): about 1.2e+13 "
                         "parameters, which need about 192 TB to train (48 TB of fp32 weights, as much again for "
                         "gradients and twice for AdamW's moments): more than this machine's 8 GB of memory"), line
    # a field the recipe derives counts too: lm's learned position table is context x d_model
    line = rejected(load("lm"), capsys, "--set", "context=1099511627776")
    assert line.endswith("trunk 'tiny' and max_positions 1099511627776 (from context): about 7.04e+13 parameters, "
                         "which need about 1.13 PB to train (281 TB of fp32 weights, as much again for gradients and "
                         "twice for AdamW's moments): more than this machine's 8 GB of memory"), line
    cfg = parse(vit, "--set", "trunk_overrides={'d_model': 256, 'n_layers': 8, 'n_heads': 8}")
    assert cfg["trunk_overrides"] == {"d_model": 256, "n_layers": 8, "n_heads": 8}  # a real size passes
