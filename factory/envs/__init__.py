"""Environments: tasks, verifiers and rewards."""
