"""The extension points of factory, in one place: what a new algorithm, task family, rollout backend, trainer
backend, rollout engine or prompt source must provide (a `typing.Protocol` each), and the registry that maps the
spec's name to it (a `Registry` each). A new one is one module plus one registration: `REGISTRY.register(name,
obj)` in-process, an entry point in the registry's group for a package, or an import path `package.module:attr`
in the spec. docs/extending.md walks through each with a worked example (tests/extending/ runs them).

| extension point | protocol | registry | spec field | entry-point group |
| --- | --- | --- | --- | --- |
| RL objective | `Algorithm` | `ALGORITHMS` | `algorithm.name` | `factory.algorithms` |
| task family | `TaskFamily` | `TASK_FAMILIES` | `task.name` | `factory.task_families` |
| verifier | `Verifier` (`RewardVerifier` wraps a function) | `VERIFIERS` | a problem's `op` | `factory.verifiers` |
| environment | `Environment` (envs/protocol.py) | `ENVIRONMENTS` (envs) | `task.environment` | `factory.environments` |
| rollout backend | `Producer` | `PRODUCERS` | `rollout.engine` | `factory.producers` |
| trainer backend | `Trainer` | `TRAINERS` | `trainer.backend` | `factory.trainers` |
| rollout engine | `RolloutEngine` | (chosen by the producer) | | |
| prompt source | `PromptSource` | (data.sources kinds) | | |

This package sits low in the layers (below `factory.config`, which validates names against the registries):
its modules import only the standard library and the leaves; the types they mention from higher layers are
imported under `TYPE_CHECKING` only, and built-ins are named by import path, imported when first asked for.
"""

from factory.protocols.algorithm import ALGORITHMS, Algorithm, AlgorithmDefaults, LossFn
from factory.protocols.engine import Completion, RolloutEngine, SamplingParams
from factory.protocols.producer import PRODUCERS, Producer
from factory.protocols.registry import Registry, import_path
from factory.protocols.source import PromptSource
from factory.protocols.task import TASK_FAMILIES, VERIFIERS, RewardVerifier, TaskFamily, Verifier
from factory.protocols.trainer import TRAINERS, Trainer

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmDefaults", "Completion", "LossFn", "PRODUCERS", "Producer",
           "PromptSource", "Registry", "RewardVerifier", "RolloutEngine", "SamplingParams", "TASK_FAMILIES", "TRAINERS",
           "TaskFamily", "Trainer", "VERIFIERS", "Verifier", "import_path"]
