"""The `arithmetic` task family (generated from the seed: factory/envs/arithmetic.py) and its exact verifier,
which also scores any problem whose op has no verifier of its own."""

from __future__ import annotations

from factory.config import DataSpec, TaskSpec
from factory.envs.arithmetic import OPS, arithmetic_capacity, make_splits, reward
from factory.problem import Splits
from factory.protocols.task import RewardVerifier

VERIFIER = RewardVerifier(reward)


class ArithmeticFamily:
    name = "arithmetic"
    verifier = VERIFIER

    def capacity(self, task: TaskSpec) -> tuple[int, int]:
        """Half of the generated problems may be drawn (see `arithmetic.make_splits`)."""
        space = arithmetic_capacity(task.operations, task.digits)
        return space, space // 2

    def describe(self, task: TaskSpec) -> str:
        return f"task arithmetic with operations {task.operations} and digits {task.digits}"

    def longest_prompts(self, task: TaskSpec, data: DataSpec | None) -> list[str]:
        """Prompts with operands of the most digits (each op), of the task and of the data section's generated
        arithmetic sources (file sources are checked as they are read)."""
        digits = [max(task.digits)]
        if data is not None:
            digits += [s["digits"] for s in data.sources if s["kind"] == "arithmetic"]
        out = []
        for d in sorted(set(digits)):
            for sym in OPS.values():
                out += [f"{'9' * d}{sym}{'9' * d}=", f"1{'0' * (d - 1)}{sym}1{'0' * (d - 1)}="]
        return out

    def splits(self, task: TaskSpec, seed: int) -> Splits:
        return make_splits(task, seed)


FAMILY = ArithmeticFamily()
