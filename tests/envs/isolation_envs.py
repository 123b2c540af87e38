"""User environments that misbehave on request, loaded by import path (`tests.envs.isolation_envs:...`) in
tests/envs/test_isolation.py, in the test's process and in env-serve worker processes.

Each does what its input says: a single-turn completion or a multi-turn task's "do" names the failure. Hangs
wait on `RELEASE`, which a test in this process sets when done so abandoned threads end; in a worker process
nobody sets it and they hang until the worker is stopped.
"""

import asyncio
import sys
import threading

import numpy as np

from factory.envs.protocol import EpisodeResult, RewardResult

RELEASE = threading.Event()


def hang() -> None:
    RELEASE.wait()


def moody_reward(prompt: str, completion: str, **meta):
    """A number for a numeric completion; otherwise the misbehaviour the completion names."""
    match completion:
        case "raise":
            raise ValueError(f"cannot score {prompt!r}")
        case "hang":
            hang()
            return 1.0
        case "exit":
            sys.exit(3)
        case "nan":
            return float("nan")
        case "inf":
            return float("inf")
        case "str":
            return "abc"
        case "none":
            return None
        case "list":
            return [1.0]
        case "true":
            return True
        case "numpy":
            return np.float32(0.25)
        case "result-nan":
            return RewardResult(float("nan"))
    return float(completion)


async def scripted_episode(task: dict, client) -> EpisodeResult | float:
    """Asks the model once (a real rollout server), then does what task["do"] says."""
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}],
                                                 max_tokens=2, temperature=0.0)
    match task["do"]:
        case "raise":
            raise ValueError("the episode broke")
        case "hang":
            await asyncio.sleep(3600)
        case "block":  # blocking code in an async episode: the event loop stops with it
            hang()
        case "nan":
            return float("nan")
        case "str":
            return "abc"
        case "none":
            return None
    return EpisodeResult(1.0, info={"answer": reply.choices[0].message.content})


class MoodyGym:
    """A reset/step environment that hangs, raises or returns a bad reward where the task says so."""

    def reset(self, task: dict) -> str:
        self.do = task["do"]
        if self.do == "hang_reset":
            hang()
        return task["prompt"]

    def step(self, action: str):
        if self.do == "hang_step":
            hang()
        if self.do == "raise_step":
            raise KeyError("no such state")
        reward = {"nan_step": float("nan"), "str_step": "1"}.get(self.do, 1.0)
        return "", reward, True, {"answer": action}
