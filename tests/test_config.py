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
