"""Sane maxima of the sizes a spec sets.

These bounds do not depend on the machine: each is far past what published post-training runs use, and past it a
value is a typo (an extra zero, a paste of the wrong number) rather than an experiment. What the machine can hold is
checked apart, from the model's size and the machine's memory (`factory.infra.memory`), by `factory validate` and
`factory run` before any work starts. Without these maxima a spec with `algorithm.group_size: 1000000000` passed
validation and the run died of MemoryError in every attempt.

- group_size 1024: GRPO-family papers sample 4 to 64 completions per prompt (DeepSeekMath 64, DAPO 16, Dr.GRPO 8);
- prompts_per_step 65,536: the largest published batches are a few thousand prompts (DAPO 512);
- a step's samples (prompts_per_step x group_size) 2**20 (1,048,576): the batch is held on the host, whole;
- sft.batch_size 65,536; eval_pass_k 1,024 (pass@k is reported for k up to a few hundred); env_processes 256 (as
  task.sandbox_workers); rollout.concurrency and buffer.depth 65,536 prompt groups in flight or buffered;
  task.n_eval and data.held_out 100,000 problems (each is evaluated at every eval); task.n_train 1,000,000
  problems (the dataset is built and held whole; the largest open RL prompt sets hold a few hundred thousand);
  rollout.max_new_tokens 131,072 (the longest contexts of open models; the model's own positions bound it further).

A number given as `true`/`false` is refused everywhere (`factory.source_spec.NoBoolNumbers`): pydantic took `seed:
true` as seed 1.
"""

from __future__ import annotations

MAX_GROUP_SIZE = 1024
MAX_PROMPTS_PER_STEP = 65_536
MAX_STEP_SAMPLES = 1 << 20
MAX_SFT_BATCH = 65_536
MAX_PASS_K = 1024
MAX_ENV_PROCESSES = 256
MAX_IN_FLIGHT = 65_536
MAX_HELD_OUT = 100_000
MAX_TASK_PROBLEMS = 1_000_000
MAX_NEW_TOKENS = 131_072

