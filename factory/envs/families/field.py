"""The field's verifiers, which score rows of data sources of those kinds (or any source naming them) and belong
to no task family: reasoning-gym's own scorers and math-verify in this process (each loads its package only when
such a row is scored), HumanEval's unit tests in the sandbox pool through the trusted harness."""

from __future__ import annotations

from factory.envs.humaneval import humaneval_detail
from factory.envs.math_answers import math_verify_reward
from factory.envs.pool import sandbox_pool
from factory.envs.reasoning_gym_tasks import rg_reward
from factory.problem import Problem
from factory.protocols.task import RewardVerifier

REASONING_GYM = RewardVerifier(rg_reward)
MATH_VERIFY = RewardVerifier(math_verify_reward)


class HumanEvalVerifier:
    detects_hacks = True

    def detail(self, completion: str, problem: Problem) -> tuple[float, frozenset[str]]:
        return humaneval_detail(completion, problem, sandbox_pool())  # the harness's verdict


HUMANEVAL = HumanEvalVerifier()
