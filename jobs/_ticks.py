"""Where a sensor's or schedule's reason for a tick that starts nothing shows in the Dagster UI.

Every tick of Factory's sensors and schedules that starts no run says why (its skip reason). Dagster 1.13's tick lists
show such a tick as a fixed "0 runs requested" tag and its reason only in that tag's tooltip and in the tick's details
(ticks/TickStatusTag.tsx, instigation/TickHistory.tsx of its UI): no column of the list can hold it. So each
description, shown at the top of the sensor's page, says where to look.
"""

WHY_NONE = "A tick that starts nothing says why: hover its '0 runs requested' tag."


def described(text: str) -> str:
    """A sensor's or schedule's description, with where its skip reasons show."""
    return f"{text} {WHY_NONE}"
