"""Recipe-level checks of attention patterns (#26 part 4): what the recipe's tokens cannot take is refused in one
line while the config is validated, before any data is built."""

from __future__ import annotations

import pytest

from omni.config import Key, defaults, schema, sets_trunk, validate

WINDOW2D = {"kind": "window2d", "rows": 1, "cols": 1}
WINDOW = {"kind": "window", "before": 4, "after": 0}


def _config(check, attention) -> dict:
    common = dict(trunk="tiny", context=32, trunk_overrides=Key({}, check=check) if check is not None else {})
    cfg = defaults(common)
    cfg["trunk_overrides"] = {"attention": attention}
    return validate(cfg, schema(common))


@pytest.mark.parametrize("check", [None, sets_trunk(max_positions=("context", lambda c: c["context"]))],
                         ids=["plain-overrides", "sets-trunk"])
def test_window2d_without_a_grid_is_refused(check) -> None:
    with pytest.raises(ValueError, match=r"^trunk_overrides.attention: layer 0's window2d needs every segment's "
                                         r"tokens on a 2-D grid .*use \{'kind': 'window'") as err:
        _config(check, {"pattern": WINDOW2D})
    assert "\n" not in str(err.value)
    # the same pattern on every second layer only: still named, at the layer it is on
    with pytest.raises(ValueError, match="layer 0's window2d"):
        _config(check, {"pattern": WINDOW2D, "full_every": 2})


def test_window2d_on_a_grid_and_1d_windows_pass() -> None:
    grid = sets_trunk(grid=True, longest=("(image_size // patch)^2 + 1", lambda c: 17))
    cfg = _config(grid, {"pattern": WINDOW2D, "full_every": 2})
    assert cfg["trunk_overrides"]["attention"]["pattern"]["kind"] == "window2d"
    assert _config(None, {"pattern": WINDOW})["trunk_overrides"]["attention"] == {"pattern": WINDOW}


@pytest.mark.parametrize("first, ok", [(31, True), (32, False), (500, False)])
def test_global_count_against_the_longest_segment(first: int, ok: bool) -> None:
    check = sets_trunk(longest=("context", lambda c: c["context"]))  # context=32 tokens per segment at most
    attention = {"layers": [None, {"kind": "any", "of": [WINDOW, {"kind": "global", "first": first}]}]}
    if ok:
        assert _config(check, attention)["trunk_overrides"]["attention"]["layers"][0] is None
    else:
        with pytest.raises(ValueError, match=rf"^trunk_overrides.attention: layer 1's global first={first} covers "
                                             r"every token of a segment here \(at most 32, from context\)"):
            _config(check, attention)


def test_a_longest_that_cannot_be_computed_is_not_checked() -> None:
    check = sets_trunk(longest=("context", lambda c: c["missing"]))
    attention = {"pattern": {"kind": "any", "of": [WINDOW, {"kind": "global", "first": 1000}]}}
    assert _config(check, attention)["trunk_overrides"]["attention"]["pattern"]["kind"] == "any"
