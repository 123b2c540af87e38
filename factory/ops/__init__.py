"""Operations: supervised service processes, preflight node tests and their gate (preflight/); later health and
quarantine."""
