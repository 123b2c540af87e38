"""The `factory` command (`main`), one module per command group: run.py (validate, run, resume, train-grpo,
attempt), lake.py (query, runs, best, compare), serve.py (serve, env-serve, sandbox-serve), models.py (bpe-model),
preflight.py, deploy.py; app.py assembles the parser."""

from factory.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
