"""The home of the paged rollout engine (issue 33): a paged KV cache inside a memory budget, decode at fixed shapes.

Split by concern as nano-vllm splits its engine, one module each: the KV block manager (`blocks.py`: pages, their
refcounts and each sequence's block table, admission against the budget, pure Python), the page store
(`pages.py`: the preallocated K/V pages on the device, slot-mapped writes, block tables as a fixed-shape tensor),
the on-device sampler (`sampling.py`: counter-based seeded noise, top-k / top-p, no host sync), the model runner
(`runner.py`: a Llama-family model's own modules with attention over the page store), the weights in the
serving dtype (`serving.py`: bf16 on CUDA, a copy that follows a model shared with a trainer), the scheduler
(`scheduler.py`: queue, admission, GRPO forks, rows), the decode step (`decode_step.py`: runner + sampler over
static buffers, a CUDA graph per bucket), the pinned result copy (`host_copy.py`) and the engine (`engine.py`:
`PagedEngine` behind the `RolloutEngine` API and the control surface of `engine_control.py`, `make_engine`).
`factory serve` and the overlapped producers build it through `make_engine`; `continuous.py` serves the models it
cannot run (docs/engine.md).
"""
