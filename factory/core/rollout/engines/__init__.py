"""The embedded rollout engines, in the caller's process or behind the rollout server: the simple batched engine
(`embedded.py`), the continuous-batching one (`continuous.py`, its slot cache, sampler and sequence state) and the
paged one (`paged/`), with what they share (`engine_control.py`, `kv_budget.py`, `rounding.py`). They import no
server code: the server (`factory/core/rollout/server/`) serves them."""
