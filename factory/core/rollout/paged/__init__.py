"""The paged rollout engine (issue 33), split by concern."""
