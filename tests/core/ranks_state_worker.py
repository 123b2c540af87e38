"""A rank of tests/core/test_ranks_run.py's resume-state test: rank 0 leads 2 FSDP ranks (make_trainer), trains, runs
a forward (the loop's probe), and with ROUNDTRIP=1 takes the resume point's optimizer state and loads it back; then
one more step. Prints JSON on rank 0."""

import json
import os

import torch.distributed as dist

from factory.config import parse_spec
from factory.core import algorithms
from factory.core.batch import pack
from factory.core.trainer.distributed import init_ranks
from factory.core.trainer.ranks import follow, leading, make_trainer
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer

rank, world = init_ranks(1, 120)
spec = parse_spec({"model": {"preset": "micro"}, "algorithm": {"group_size": 2}, "rollout": {"prompts_per_step": 2},
                   "trainer": {"world_size": 2, "strategy": "fsdp"}})
model = build_model("micro", build_tokenizer(), seed=0)
if rank == 0:
    with leading():
        trainer = make_trainer(spec, model)
        batch = pack([[1, 5, 6], [1, 7]] * 2, [[8, 9], [10, 2, 11]] * 2, 0,
                     {"old_logprobs": [[-1.0, -1.0], [-1.0, -1.0, -1.0]] * 2}, {"advantages": [1.0, -1.0, 0.5, -0.5]})
        loss_fn = algorithms.make_loss(spec.algorithm)
        losses = [trainer.step(batch, loss_fn, 2)["loss"] for _ in range(2)]
        trainer.logprobs(batch)
        keys = []
        if os.environ.get("ROUNDTRIP") == "1":
            state = trainer.optimizer.state_dict()
            keys = sorted(state["state"])[:2]
            trainer.optimizer.load_state_dict(state)
        losses.append(trainer.step(batch, loss_fn, 2)["loss"])
        weight = float(model.model.embed_tokens.weight.sum())  # the loop's full replica, gathered after each step
        print(json.dumps({"losses": losses, "keys": keys, "weight": weight}))
else:
    follow(spec, model)
dist.destroy_process_group()
