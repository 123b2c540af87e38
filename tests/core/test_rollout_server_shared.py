"""The rollout server's shared-buffer weight handoff over real HTTP on 127.0.0.1 (`POST /attach_shared_weights`,
`POST /update_weights_from_shared`): the served weights equal the trainer's bit for bit, and a restarted server
re-attaches and takes the newest version without a new publish."""

from __future__ import annotations

import copy

import httpx
import pytest
import torch

from factory.core.rollout.engines.paged.engine import make_engine
from factory.core.rollout.server.app import launch_server
from factory.core.weights.shared import SharedWeightsWriter
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer


def bits(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.detach().contiguous().view(torch.uint8).numpy().tobytes() for k, v in state.items()}


def train_step(model: torch.nn.Module, seed: int) -> None:
    """A stand-in for an optimizer step: every weight moves by a seeded amount."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def post(url: str, path: str, **kw) -> httpx.Response:
    return httpx.post(url + path, timeout=30, **kw)


@pytest.mark.parametrize("engine", ["paged", "continuous"])
def test_shared_updates_serve_the_trainers_weights_bit_for_bit_and_survive_a_server_restart(engine):
    tok = build_tokenizer()
    trainer = build_model("micro", tok, seed=0)
    initial = copy.deepcopy(trainer)
    assert trainer.config.tie_word_embeddings  # the tied head travels once and lands in both names

    def launch():
        return launch_server(make_engine(copy.deepcopy(initial), tok, engine, max_batch=8, name="micro"))

    with SharedWeightsWriter.create(trainer.state_dict(), torch.float32, "cpu") as writer:
        handle = launch()
        try:
            url = handle.url
            assert post(url, "/update_weights_from_shared").status_code == 409  # nothing attached yet
            r = post(url, "/attach_shared_weights", json=writer.handle())
            assert r.status_code == 200 and r.json()["available_version"] is None, r.text
            r = post(url, "/update_weights_from_shared")
            assert r.status_code == 200 and r.json()["weight_version"] == 0  # nothing newer: nothing applied
            for version, mode in ((1, "finish_old"), (2, "in_flight"), (3, "in_flight")):
                train_step(trainer, version)
                writer.publish(trainer.state_dict(), version)
                r = post(url, "/update_weights_from_shared", params={"mode": mode})
                assert r.status_code == 200 and r.json()["weight_version"] == version, r.text
                assert bits(handle.engine.model.state_dict()) == bits(trainer.state_dict())
            r = post(url, "/v1/completions", json={"prompt": "1+2=", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["weight_version"] == 3
            assert post(url, "/update_weights_from_shared", params={"mode": "later"}).status_code == 400
        finally:
            handle.stop()
        assert bits(handle.engine.model.state_dict()) != bits(initial.state_dict())  # (it had moved)

        handle = launch()  # a restarted server: its initial weights, version 0, nothing attached
        try:
            url = handle.url
            assert post(url, "/update_weights_from_shared").status_code == 409
            r = post(url, "/attach_shared_weights", json=writer.handle())
            assert r.json()["available_version"] == 3
            r = post(url, "/update_weights_from_shared")
            assert r.json()["weight_version"] == 3
            assert bits(handle.engine.model.state_dict()) == bits(trainer.state_dict())
        finally:
            handle.stop()


@pytest.mark.parametrize(("body", "field"), [
    ({"kind": "factory.shared_weights"}, "field 'format' is missing"),
    ([1, 2], None),
    ("handle", None),
])
def test_a_bad_handle_is_a_400_naming_the_field(body, field):
    tok = build_tokenizer()
    with launch_server(make_engine(build_model("micro", tok, seed=0), tok, "continuous", max_batch=4)) as handle:
        r = post(handle.url, "/attach_shared_weights", json=body)
        assert r.status_code == 400, r.text
        if field is not None:
            assert field in r.json()["error"]["message"]
        assert post(handle.url, "/update_weights_from_shared").status_code == 409  # still nothing attached


def test_a_handle_of_another_model_is_refused_and_the_attached_one_kept():
    tok = build_tokenizer()
    served = build_model("micro", tok, seed=0)
    other = {"x.weight": torch.zeros(3)}
    with launch_server(make_engine(copy.deepcopy(served), tok, "continuous", max_batch=4)) as handle, \
            SharedWeightsWriter.create(served.state_dict(), torch.float32, "cpu") as good, \
            SharedWeightsWriter.create(other, torch.float32, "cpu") as bad:
        assert post(handle.url, "/attach_shared_weights", json=good.handle()).status_code == 200
        r = post(handle.url, "/attach_shared_weights", json=bad.handle())
        assert r.status_code == 400 and "not this server's model" in r.json()["error"]["message"]
        good.publish(served.state_dict(), 1)
        assert post(handle.url, "/update_weights_from_shared").json()["weight_version"] == 1
