"""Dagster asset definitions, grouped by domain; each asset is a short call into `factory`."""
