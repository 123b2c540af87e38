"""Rollout engines behind one interface (`RolloutEngine`, factory/protocols/engine.py; re-exported in `base.py`):
the embedded engines (`engines/`) and the OpenAI-compatible rollout server over them (`server/`). The SGLang backend
is its own package, `factory/core/sglang/`; the producers that drive an engine for the loop are
`factory/core/producers/`."""

from factory.core.rollout.base import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "RolloutEngine", "SamplingParams"]
