"""Checks of strategy options from a config, shared by the strategies' `__post_init__`.

TOML and JSON give `true` where a number was meant without complaint, and Python's bool is an
int, so a plain `isinstance(v, int)` would accept `local_steps = true` as 1; these reject it.
"""

from __future__ import annotations

import math


def is_int_at_least(value: object, minimum: int) -> bool:
    """`value` is an int (not a bool) >= `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_number_at_least(value: object, minimum: float) -> bool:
    """`value` is an int or float (not a bool), finite and >= `minimum`."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and minimum <= value < math.inf)
