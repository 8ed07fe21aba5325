"""Reading a service's numeric options (run config values or ``GYRE_*`` strings) with one
clear error: the option's name, what it must be, and the value given."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def number_option(options: Mapping[str, Any], name: str, *, default: float | int, label: str, must_be: str,
                  integer: bool = False, minimum: float | None = None, above: float | None = None) -> Any:
    """``options[name]`` as an int (``integer``) or a finite float; ``default`` when unset or
    empty. Below ``minimum``, not above ``above``, a bool or unreadable: ``ValueError``
    ("<label> must be <must_be>, not <value>")."""
    value = options.get(name)
    if value is None or value == "":
        return default
    try:
        x = int(value) if integer else float(value)
    except (TypeError, ValueError, OverflowError):
        x = None
    if (x is None or isinstance(value, bool) or not math.isfinite(x)
            or (minimum is not None and x < minimum) or (above is not None and x <= above)):
        raise ValueError(f"{label} must be {must_be}, not {value!r}")
    return x
