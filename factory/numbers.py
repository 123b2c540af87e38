"""Numbers as a person reads them in a table or a summary: rounded to what they mean, by what their name says.

An accuracy or a reward is a fraction (3 decimals: 0.764); a duration in seconds is shown to 0.1 s below 100 s
and whole above; a rate (tokens/s) to 3 significant figures; anything else to 4 significant figures. Only text
for people is rounded: csv and json keep every digit for programs.
"""

from __future__ import annotations

import math
import re

# Matched against a lowercased column or field name, in this order (a rate's name also ends in `_s`).
_RATE = re.compile(r"(per_s|per_sec|/s$|tok_s$|throughput)")
_SECONDS = re.compile(r"(^|_)(s|sec|secs|seconds|elapsed|duration|wall)$")
_FRACTION = re.compile(r"(accuracy|(^|_)acc($|_)|pass@|pass_at|reward|goodput|fraction|(^|_)(ci|lo|hi|low|high|"
                       r"lower|upper|gain|win_rate)($|_))")


def kind_of(name: str) -> str:
    """'rate', 'seconds', 'fraction' or 'number': how a value named `name` is rounded (see the module docstring)."""
    low = name.lower()
    if _RATE.search(low):
        return "rate"
    if _SECONDS.search(low):
        return "seconds"
    if _FRACTION.search(low):
        return "fraction"
    return "number"


def shown(value: float, name: str = "") -> str:
    """`value` as text, rounded for the kind its `name` says (`kind_of`): shown(0.76400001, "accuracy") == "0.764",
    shown(93.46, "wall_s") == "93.5", shown(1234.5, "seconds") == "1234", shown(12345.6, "tokens_per_s") == "12300".
    NaN and infinities are shown as `nan`, `inf`, `-inf`."""
    if not math.isfinite(value):
        return str(value)
    kind = kind_of(name)
    if kind == "fraction":
        return f"{value:.3f}"
    if kind == "seconds":
        return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"
    if kind == "rate":
        return significant(value, 3)
    return f"{value:.4g}"


def significant(value: float, digits: int) -> str:
    """`value` to `digits` significant figures, without an exponent: 12345.6 -> "12300", 0.012345 -> "0.0123"."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    rounded = round(value, decimals)
    return f"{rounded:.{max(decimals, 0)}f}"
