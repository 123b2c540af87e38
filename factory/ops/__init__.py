"""Operations: preflight node tests and their gate (preflight/), node health, the UI launcher (cockpit,
instance), and a run's restarts. Process supervision and the other low-level utilities are in factory/infra/."""
