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
                         train_config, validate)


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
    assert expectation(resolve("compile", False)) == "True, False or a string"
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
