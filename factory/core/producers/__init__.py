"""Rollout producers: where each trainer step's prompt groups come from, one module per concern.

- `sync.py`, `SyncProducer` (mode `sync`): generate a batch with the trainer's own model, score it, return it.
- `overlapped.py`, `OverlappedProducer` (modes `one_step_off`, `async`): producer threads, an embedded engine with its
  own copy of the weights, the rollout buffer between them and the trainer.
- `server.py`, `ServerProducer` (`rollout.engine: server`): the same, the engine a supervised rollout server process.
- `common.py`: what they share (sampling parameters, the environment, prompt tokens, scored groups).
- `builders.py`: the built-in `rollout.engine` backends of `factory.protocols.PRODUCERS` (`embedded`, `server`; the
  SGLang one is `factory/core/sglang/producer.py`).

All draw prompts from one deterministic prompt feed (`data/feed.py`: the blend of the spec's sources and its
curriculum) and score episodes through one environment medium (`envs/workers.py`: threads of this process, or
environment-worker processes over HTTP, per `rollout.environment`), so a benchmark compares modes on identical work.
"""
