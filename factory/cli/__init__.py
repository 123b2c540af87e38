"""The `factory` command (`main`). parser.py holds every command's arguments; each command group's implementation
is a module of its own, imported only when one of its commands runs: spec.py (validate), run.py (run, resume,
train-grpo, attempt), lake.py (query, runs, best, compare), serve.py (serve), env_serve.py (env-serve,
sandbox-serve, eval-serve), models.py (bpe-model), preflight.py, deploy.py."""

from factory.cli.app import main
from factory.cli.parser import build_parser

__all__ = ["build_parser", "main"]
