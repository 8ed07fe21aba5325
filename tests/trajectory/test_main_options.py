"""The trajectory service's options (GYRE_TRAJECTORY_*): out-of-range and unknown values
are refused at start, naming the variable."""

from __future__ import annotations

import pytest

from services.trajectory.main import ledger_config


@pytest.mark.parametrize("name, value, variable", [
    ("micro_step_tokens", "-5", "GYRE_TRAJECTORY_MICRO_STEP_TOKENS"),
    ("micro_step_tokens", "abc", "GYRE_TRAJECTORY_MICRO_STEP_TOKENS"),
    ("budget", "0", "GYRE_TRAJECTORY_BUDGET"),
    ("budget", "abc", "GYRE_TRAJECTORY_BUDGET"),
    ("max_piece_tokens", "0", "GYRE_TRAJECTORY_MAX_PIECE_TOKENS"),
    ("group_size", "0", "GYRE_TRAJECTORY_GROUP_SIZE"),
    ("seed", "x", "GYRE_TRAJECTORY_SEED"),
    ("advantage_scale", "bogus", "GYRE_TRAJECTORY_ADVANTAGE_SCALE"),
    ("train_undelivered", "maybe", "GYRE_TRAJECTORY_TRAIN_UNDELIVERED"),
])
def test_a_bad_option_is_refused_naming_its_variable(name, value, variable) -> None:
    with pytest.raises(ValueError, match=variable) as info:
        ledger_config("r", {name: value})
    assert repr(value) in str(info.value)


def test_good_options_are_read() -> None:
    config = ledger_config("r", {"budget": "3", "micro_step_tokens": 4096, "advantage_scale": "None",
                                 "train_undelivered": "on", "seed": "-1", "group_size": "", "max_piece_tokens": None})
    assert (config.budget, config.micro_step_tokens, config.advantage.scale, config.train_undelivered) == (3, 4096, "none", True)
    assert config.seed == -1 and config.group_size is None and config.max_piece_tokens is None
    defaults = ledger_config("r", {})
    assert (defaults.budget, defaults.micro_step_tokens, defaults.advantage.scale, defaults.train_undelivered) == (5, 65536, "std", False)
