"""Operations: supervised service processes; later preflight node tests, health and quarantine."""
