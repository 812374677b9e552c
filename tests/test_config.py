"""--set overrides: literals, strings, dotted keys into nested dicts, and errors that name the known keys."""

import pytest

from omni.config import apply_overrides


def config():
    return {"lr": 1e-3, "name": "run", "tasks": {"text": {"weight": 1.0, "loss_weight": 1.0}, "image": {"patch": 4}}}


def test_literals_and_strings():
    cfg = apply_overrides(config(), ["lr=3e-4", "name=other", "tasks={'text': {'weight': 2.0}}"])
    assert cfg["lr"] == 3e-4 and cfg["name"] == "other"
    assert cfg["tasks"] == {"text": {"weight": 2.0}}  # a whole-entry override replaces it


def test_dotted_key_sets_one_nested_entry_and_keeps_siblings():
    cfg = apply_overrides(config(), ["tasks.text.loss_weight=2", "tasks.image.patch=7"])
    assert cfg["tasks"] == {"text": {"weight": 1.0, "loss_weight": 2}, "image": {"patch": 7}}


@pytest.mark.parametrize("item, message", [
    ("lrate=1", "KEY one of lr, name, tasks"),
    ("tasks.txt.weight=2", "'txt' is not a dict entry of tasks; entries: image, text"),
    ("tasks.text.wieght=2", "tasks.text has no entry 'wieght'; entries: loss_weight, weight"),
    ("lr.x=1", "'lr' is not a dict entry of the config"),
    ("lr", "expected KEY=VALUE"),
])
def test_unknown_keys_name_the_known_ones(item, message):
    cfg = config()
    with pytest.raises(ValueError) as err:
        apply_overrides(cfg, [item])
    assert message in str(err.value)
    assert cfg == config()  # nothing half-applied


# ----------------------------------------------------------------------------------------------------
# The typed layer: Key, RULES, validate


from omni.config import (FRACTION, NON_EMPTY, Key, RULES, at_least, expectation, one_of, resolve, schema,  # noqa: E402
                         validate)
from omni.recipe_runtime import train_config  # noqa: E402


def check(value, key, name="k"):
    return validate({name: value}, {name: resolve(name, key)})[name]


@pytest.mark.parametrize("value, key, message", [
    ("abc", 3, "k must be an integer, got 'abc'"),
    (1.5, 3, "k must be an integer, got 1.5"),
    (True, 3, "k must be an integer, got True"),
    ("nan", 0.1, "k must be a finite number, got 'nan'"),
    (float("inf"), 0.1, "k must be a finite number, got inf"),
    (True, 0.1, "k must be a finite number, got True"),
    ("yes", True, "k must be True or False, got 'yes'"),
    (1, True, "k must be True or False, got 1"),
    (1.5, True, "k must be True or False, got 1.5"),
    (3, "name", "k must be a string, got 3"),
    (None, 3, "k must be an integer, got None"),
    ([1, "a"], [0], "k[1] must be an integer, got 'a'"),
    ("x", {}, "k must be a dict, got 'x'"),
    (0, Key(3, check=at_least(1)), "k must be an integer >= 1, got 0"),
    (1.5, Key(0.5, check=FRACTION), "k must be a finite number in [0, 1], got 1.5"),
    ([], Key([1], check=NON_EMPTY), "k must be a non-empty list of integers, got []"),
    ("b", Key("a", check=one_of("a", "c")), "k must be 'a' or 'c', got 'b'"),
    (0, Key(None, (int, None), at_least(1)), "k must be an integer >= 1 or None, got 0"),
])
def test_bad_values_name_the_key_and_what_it_takes(value, key, message):
    with pytest.raises(ValueError) as err:
        check(value, key)
    assert str(err.value) == message


def test_values_are_normalised_to_their_type():
    assert check(1e4, 3) == 10000 and type(check(1e4, 3)) is int  # an integral float for an int: steps=1e4
    assert check(2, 0.1) == 2.0 and type(check(2, 0.1)) is float
    assert check((1, 2), [0]) == [1, 2]
    assert check(None, Key(None, (int, None))) is None
    assert check("corpus.txt", None, name="text") == ["corpus.txt"]  # one file for a list of files
    assert check({"a": 1}, {}) == {"a": 1}  # a dict without declared entries takes any


def test_types_come_from_the_shared_rules_or_the_default():
    steps = resolve("steps", 100)  # the rule: an int >= 1, the recipe gives the default only
    assert steps.default == 100 and steps.types == (int,) and expectation(steps) == "an integer >= 1"
    assert resolve("steps", Key(None, (int, None))).check is RULES["steps"].check  # a Key keeps the rule's range
    assert expectation(resolve("lr", 1e-3)) == "a finite number > 0"
    assert expectation(resolve("resume", "auto")) == "'auto', 'force' or 'never'"
    assert expectation(resolve("compile", False)) == \
        "True, False, 'default', 'reduce-overhead', 'max-autotune' or 'max-autotune-no-cudagraphs'"
    assert expectation(resolve("methods", ["dt"])) == "a list of strings"  # items typed by the default's
    with pytest.raises(TypeError, match="give its type"):
        resolve("threshold", None)  # a None default says nothing about the type: a recipe bug


def test_nested_entries_and_dicts_of_entries_are_checked():
    task = Key(type=dict, entries={"weight": Key(type=float, check=at_least(0)), "kind": Key(type=str)})
    keys = schema({"tasks": Key({"text": {"kind": "lm", "weight": 1.0}}, each=task)})
    cfg = {"tasks": {"text": {"kind": "lm", "weight": 2}}, "preset": "x"}
    assert validate(cfg, keys)["tasks"]["text"]["weight"] == 2.0
    with pytest.raises(ValueError, match=r"^tasks.text.weight must be a finite number >= 0, got -1$"):
        validate({"tasks": {"text": {"kind": "lm", "weight": -1}}}, keys)
    with pytest.raises(ValueError, match=r"^tasks.text has no entry 'wieght'; entries: kind, weight$"):
        validate({"tasks": {"text": {"wieght": 1.0}}}, keys)
    with pytest.raises(ValueError, match="unknown config entry 'tasksx'"):
        validate({"tasksx": {}}, keys)


def test_train_config_takes_the_entries_named_like_its_fields():
    cfg = {"out": "runs/x", "steps": 5, "lr": 0.1, "resume": "never", "batch_size": 3, "checkpoint_every": 2}
    config = train_config(cfg, run_name="r", steps=7)
    assert (config.output_dir, config.steps, config.lr, config.resume, config.checkpoint_every, config.run_name) == \
        ("runs/x", 7, 0.1, "never", 2, "r")


# ----------------------------------------------------------------------------------------------------
# Issue 29: bounds every value has, dotted keys checked like the dict form, the trunk a config makes


import dataclasses  # noqa: E402

from omni.config import (RULES as _RULES, TRACKERS, TRUNK_RANGES, check_trunk, keywords_of,  # noqa: E402
                         trunk_keys, trunk_parameters)
from omni.trunk import PRESETS as TRUNK_PRESETS, Trunk, TrunkConfig  # noqa: E402


@pytest.mark.parametrize("value, key, message", [
    (1e100, 3, "k must be an integer, got 1e+100: integers must fit in 64 bits (|n| < 2**63)"),
    (2**63, 3, "k must be an integer, got 9223372036854775808: integers must fit in 64 bits (|n| < 2**63)"),
    (-(2**63), 3, "k must be an integer, got -9223372036854775808: integers must fit in 64 bits (|n| < 2**63)"),
    (1e308, 0.1, "k must be a finite number, got 1e+308: numbers must be within +-1e+15 (larger ones overflow what "
                 "is computed from them)"),
    (-1e16, 0.1, "k must be a finite number, got -1e+16: numbers must be within +-1e+15 (larger ones overflow what "
                 "is computed from them)"),
    ([1.0, 1e308], [0.5], "k[1] must be a finite number, got 1e+308: numbers must be within +-1e+15 (larger ones "
                          "overflow what is computed from them)"),
    ({"a": {"b": [float("nan")]}}, {}, "k.a.b[0] must be a finite number, got nan"),  # undeclared, still bounded
    ({"a": 2**70}, {}, "k.a must be an integer, got 1180591620717411303424: integers must fit in 64 bits "
                       "(|n| < 2**63)"),
    ("", "name", "k must be a string, not empty"),
])
def test_every_value_is_within_the_bounds_of_every_entry(value, key, message):
    with pytest.raises(ValueError) as err:
        check(value, key)
    assert str(err.value) == message


def test_the_bounds_themselves_pass():
    assert check(2**63 - 1, 3) == 2**63 - 1 and check(-(2**63) + 1, 3) == -(2**63) + 1
    assert check(1e15, 0.1) == 1e15 and check(-1e15, 0.1) == -1e15
    assert check({"a": [1e15, 2**62]}, {}) == {"a": [1e15, 2**62]}


def test_seed_compile_report_to_and_text_take_only_what_works():
    for name, value, message in [
        ("seed", 2**31, "seed must be an integer in [0, 2147483647], got 2147483648"),
        ("seed", -1, "seed must be an integer in [0, 2147483647], got -1"),
        ("compile", "fast", "compile must be True, False, 'default', 'reduce-overhead', 'max-autotune' or "
                            "'max-autotune-no-cudagraphs', got 'fast'"),
        ("report_to", "tensorbored", "report_to must be 'tensorboard', 'none', 'wandb', 'mlflow', 'comet_ml', 'aim', "
                                     "'clearml', 'dvclive', 'swanlab', 'trackio' or 'all', got 'tensorbored'"),
        ("text", [], "text must be a non-empty list of strings or None, got []"),
        ("text", [""], "text[0] must be a string, not empty"),
    ]:
        with pytest.raises(ValueError) as err:
            validate({name: value}, {name: resolve(name, _RULES[name])})
        assert str(err.value) == message
    assert check(2**31 - 1, None, name="seed") == 2**31 - 1
    assert check("max-autotune", None, name="compile") == "max-autotune"


def test_report_to_lists_exactly_accelerates_trackers():
    from accelerate.utils import LoggerType

    assert set(TRACKERS) == {t.value for t in LoggerType} | {"none"}


def schema_config():
    """A config with a trunk, its overrides, a declared-entries dict and a dict of like values."""
    keys = schema({"trunk": "tiny", "trunk_overrides": {}, "positions": "rope",
                   "build": Key({"a": 1}, (dict, None), keywords_of(lambda out, a=1, b=None: None)),
                   "weights": Key({}, each=Key(type=float, check=at_least(0)))})
    return {"trunk": "tiny", "trunk_overrides": {}, "positions": "rope", "build": {"a": 1}, "weights": {}}, keys


@pytest.mark.parametrize("item, message", [
    ("trunk_overrides.d_model=-1", "trunk_overrides.d_model must be an integer >= 1, got -1"),
    ("trunk_overrides.d_model=1.5", "trunk_overrides.d_model must be an integer >= 1, got 1.5"),
    ("trunk_overrides.n_kv_heads=True", "trunk_overrides.n_kv_heads must be an integer >= 1 or None, got True"),
    ("trunk_overrides.activation='tanh'", "trunk_overrides.activation must be 'gelu', 'gelu_tanh', 'relu' or "
                                          "'swiglu', got 'tanh'"),
    ("trunk_overrides.rope_base=1", "trunk_overrides.rope_base must be a finite number > 1, got 1"),
    ("trunk_overrides.dropout=1", "trunk_overrides.dropout must be a finite number in [0, 0.99], got 1"),
    ("weights.image=-2", "weights.image must be a finite number >= 0, got -2"),
])
def test_a_dotted_key_is_checked_exactly_like_the_dict_form(item, message):
    leaf, _, value = item.partition("=")
    outer, _, inner = leaf.partition(".")
    for form in (item, f"{outer}={{{inner!r}: {value}}}"):
        cfg, keys = schema_config()
        with pytest.raises(ValueError) as err:
            validate(apply_overrides(cfg, [form], keys), keys)
        assert str(err.value) == message, form


def test_a_dotted_key_adds_a_declared_entry_and_lists_the_real_ones_when_unknown():
    cfg, keys = schema_config()
    validate(apply_overrides(cfg, ["trunk_overrides.d_model=32", "build.b=3", "weights.text=2"], keys), keys)
    assert cfg["trunk_overrides"] == {"d_model": 32} and cfg["build"] == {"a": 1, "b": 3}
    assert cfg["weights"] == {"text": 2.0}
    fields = ", ".join(sorted(f.name for f in dataclasses.fields(TrunkConfig) if f.name != "cross_attention"))
    for item, message in [("trunk_overrides.d_modle=3", f"trunk_overrides has no entry 'd_modle'; entries: {fields}"),
                          ("build.c=1", "build has no entry 'c'; entries: a, b")]:
        with pytest.raises(ValueError) as err:
            apply_overrides(schema_config()[0], [item], keys)
        assert str(err.value) == f"--set {item!r}: {message}"
    cfg["build"] = None
    with pytest.raises(ValueError, match=r"build is None here: give the whole dict, --set build=\{\.\.\.\}"):
        apply_overrides(cfg, ["build.a=2"], keys)


def test_keywords_of_types_the_entries_from_the_annotations():
    def build(out: str, *, n: int = 1, rate: float | None = None, names: list[str] = (), flag: bool = False,
              anything=None) -> None: ...

    entries = keywords_of(build).entries
    assert {n: k.type for n, k in entries.items()} == \
        {"n": (int,), "rate": (float, None), "names": (list,), "flag": (bool,), "anything": object}
    keys = schema({"build": Key({}, dict, keywords_of(build))})
    assert validate({"build": {"n": 2.0, "anything": "x"}}, keys)["build"] == {"n": 2, "anything": "x"}
    with pytest.raises(ValueError, match=r"^build.flag must be True or False, got 1$"):
        validate({"build": {"flag": 1}}, keys)
    with pytest.raises(ValueError, match=r"^build.anything.x must be a finite number, got 1e\+300"):
        validate({"build": {"anything": {"x": 1e300}}}, keys)


def test_every_trunk_field_has_a_typed_entry():
    keys = trunk_keys()
    assert list(keys) == [f.name for f in dataclasses.fields(TrunkConfig) if f.name != "cross_attention"]
    assert set(TRUNK_RANGES) <= set(keys)
    assert keys["n_kv_heads"].type == (int, None) and keys["final_norm"].type == (bool,)
    assert keys["positions"].check.choices == ("rope", "rope2d", "learned", "learned_1d", "sinusoidal", "none")


@pytest.mark.parametrize("fields", [
    {}, {"n_kv_heads": 2}, {"activation": "swiglu", "mlp_ratio": 2.5}, {"norm": "rmsnorm", "bias": False},
    {"cross_attention": True, "final_norm": False}, {"positions": "learned", "max_positions": 9},
    {"positions": "learned_1d", "max_positions": 33, "n_kv_heads": 1}, {"positions": "sinusoidal"},
])
def test_trunk_parameters_counts_what_the_trunk_builds(fields):
    cfg = TrunkConfig(**{**TRUNK_PRESETS["tiny"], **fields})
    assert trunk_parameters(cfg) == sum(p.numel() for p in Trunk(cfg).parameters())


def test_check_trunk_refuses_what_does_not_make_a_trunk_in_one_line(monkeypatch):
    import omni.config

    keys = schema({"trunk": "tiny", "trunk_overrides": {}, "positions": "rope"})
    for overrides, message in [
        ({"d_model": 30}, "trunk 'tiny' with trunk_overrides {'d_model': 30}: d_model 30 is not divisible by "
                          "n_heads 4"),
        ({"n_kv_heads": 3}, "n_heads 4 is not divisible by n_kv_heads 3"),
        ({"d_model": 8, "n_heads": 8}, "RoPE needs an even head_dim, got 1"),
        ({"positions": "none"}, "trunk_overrides.positions: this recipe sets the trunk's positions from its own "
                                "entry: --set positions=..."),
        ({"mlp_ratio": 0.001}, "mlp_ratio 0.001 x d_model 64 leaves the MLP no hidden unit"),
    ]:
        with pytest.raises(ValueError) as err:
            validate({"trunk": "tiny", "trunk_overrides": overrides, "positions": "rope"}, keys)
        assert str(err.value).endswith(message), str(err.value)
    with pytest.raises(ValueError, match="sinusoidal positions need d_model divisible by 4, got 6"):
        check_trunk({"trunk": "tiny", "trunk_overrides": {"d_model": 6, "n_heads": 1}, "positions": "sinusoidal"},
                    keys)
    monkeypatch.setattr(omni.config, "machine_memory", lambda: 10**9)
    with pytest.raises(ValueError) as err:  # 2 x 1.2 M x 64 ... : about 1e8 parameters, 1.6 GB to train
        check_trunk({"trunk": "tiny", "trunk_overrides": {"n_layers": 2000}, "positions": "rope"}, keys)
    assert str(err.value) == ("trunk 'tiny' with trunk_overrides {'n_layers': 2000}: about 1e+08 parameters, which "
                              "need about 1.6 GB to train (400 MB of fp32 weights, as much again for gradients and "
                              "twice for AdamW's moments): more than this machine's 1 GB of memory")
    assert check_trunk({"trunk": "tiny", "trunk_overrides": {"n_layers": 100}, "positions": "rope"}, keys).n_layers \
        == 100
