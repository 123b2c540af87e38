"""The built-in algorithms as registry entries: one module each, their defaults (the table the spec used to hold),
their validation, and the length divisor resolved once when the spec is validated, out of its dump."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from factory.config import AlgorithmSpec, SpecError, parse_spec
from factory.core.algorithms import compute_advantages, make_loss
from factory.protocols import ALGORITHMS, Algorithm, AlgorithmDefaults
from tests.core.test_algorithms import batch_of

# The spec's per-algorithm defaults table as it was (AlgorithmSpec.DEFAULTS in factory/config/algorithm.py, efceeb9).
OLD_DEFAULTS = {
    "grpo": {"clip_eps_low": "clip_eps", "clip_eps_high": "clip_eps", "loss_agg": "seq_mean_token_mean",
             "scale_rewards": True, "dynamic_sampling": False, "overlong": False},
    "dr_grpo": {"clip_eps_low": "clip_eps", "clip_eps_high": "clip_eps", "loss_agg": "seq_mean_token_sum_norm",
                "scale_rewards": False, "dynamic_sampling": False, "overlong": False},
    "dapo": {"clip_eps_low": "clip_eps", "clip_eps_high": 0.28, "loss_agg": "token_mean",
             "scale_rewards": True, "dynamic_sampling": True, "overlong": True},
    "cispo": {"clip_eps_low": None, "clip_eps_high": 0.28, "loss_agg": "token_mean",
              "scale_rewards": True, "dynamic_sampling": False, "overlong": False},
    "gspo": {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "loss_agg": "seq_mean_token_mean",
             "scale_rewards": True, "dynamic_sampling": False, "overlong": False},
}


@pytest.mark.parametrize("name", list(OLD_DEFAULTS))
def test_each_builtin_is_one_module_with_the_old_defaults(name):
    algo = ALGORITHMS.get(name)
    assert isinstance(algo, Algorithm) and algo.name == name
    assert sys.modules[f"factory.core.algorithms.{name}"].ALGORITHM is algo
    assert ALGORITHMS._builtins[name] == f"factory.core.algorithms.{name}:ALGORITHM"
    assert {k: getattr(algo.defaults, k) for k in OLD_DEFAULTS[name]} == OLD_DEFAULTS[name]
    # The dual clip's automatic default is for the PPO-clip losses only, as the spec's name test had it.
    assert algo.defaults.auto_dual_clip == (name in ("grpo", "dr_grpo", "dapo"))
    assert AlgorithmSpec(name=name).resolved_dual_clip(off_policy=True) == (
        3.0 if name in ("grpo", "dr_grpo", "dapo") else None)


def test_builtins_are_listed_first_and_shown_in_the_schema():
    assert ALGORITHMS.builtin_names() == ("grpo", "dr_grpo", "dapo", "cispo", "gspo")
    field = AlgorithmSpec.model_json_schema()["properties"]["name"]
    assert field["examples"] == ["grpo", "dr_grpo", "dapo", "cispo", "gspo"] and field["default"] == "grpo"
    assert "grpo, dr_grpo, dapo, cispo, gspo" in field["description"]


@pytest.mark.parametrize(("algorithm", "line"), [
    ({"name": "grpoo"}, "algorithm.name: unknown algorithm 'grpoo'; one of grpo, dr_grpo, dapo, cispo, gspo, or an "
                        "import path 'package.module:attr' (or a plugin's entry point in group 'factory.algorithms')"),
    ({"name": "dr_grpo", "scale_rewards": True}, "algorithm.scale_rewards: dr_grpo does not divide advantages by the "
                                                 "reward std (that is its point); leave it unset or set false"),
    ({"name": "cispo", "dual_clip": 3.0}, "algorithm.dual_clip: the dual clip bounds the PPO-clip losses (grpo, "
                                          "dr_grpo, dapo), not cispo; leave it unset"),
    ({"name": "gspo", "dual_clip": 2.0}, "algorithm.dual_clip: the dual clip bounds the PPO-clip losses (grpo, "
                                         "dr_grpo, dapo), not gspo; leave it unset"),
    ({"dual_clip": 1.0}, "algorithm.dual_clip: must be > 1 (a bound on the ratio), or 'off', got 1.0"),
])
def test_bad_algorithm_settings_are_one_line_naming_the_field(algorithm, line):
    with pytest.raises(SpecError) as e:
        parse_spec({"algorithm": algorithm})
    assert e.value.errors == [line]


def test_dual_clip_off_is_accepted_everywhere():
    for name in OLD_DEFAULTS:
        assert parse_spec({"algorithm": {"name": name, "dual_clip": "off"}}).algorithm.resolved_dual_clip(True) is None


def test_length_divisor_is_resolved_once_at_validation_and_not_dumped():
    spec = parse_spec({"algorithm": {"name": "dr_grpo"}, "rollout": {"max_new_tokens": 5}})
    assert spec.algorithm.length_norm() == 5
    dapo = parse_spec({"algorithm": {"name": "dapo"}, "rollout": {"max_new_tokens": 10}}).algorithm
    assert dapo.overlong() == (10, 2)
    # max_len_norm / overlong_max_len, when set, win over the rollout's budget
    assert parse_spec({"algorithm": {"name": "dr_grpo", "max_len_norm": 7}}).algorithm.length_norm() == 7
    # Not a field: the dump, so the fingerprint, is what it was; a re-validated dump resolves it again.
    assert spec.algorithm.model_dump() == AlgorithmSpec(name="dr_grpo").model_dump()
    again = parse_spec(spec.model_dump(mode="json"))
    assert again.fingerprint() == spec.fingerprint() and again.algorithm.length_norm() == 5
    # An override of the rollout's budget re-resolves it (ExperimentSpec validates on assignment).
    spec.rollout = spec.rollout.model_copy(update={"max_new_tokens": 6})
    assert spec.algorithm.length_norm() == 6


def test_a_bare_section_has_no_length_until_resolved():
    bare = AlgorithmSpec(name="dr_grpo")
    assert bare.length_norm() is None and bare.for_rollout(4).length_norm() == 4 and bare.length_norm() is None
    with pytest.raises(ValueError, match="algorithm.max_len_norm"):
        make_loss(bare)
    with pytest.raises(ValueError, match="algorithm.overlong_max_len"):
        compute_advantages(AlgorithmSpec(name="dapo"), torch.ones(2), 2, torch.tensor([1, 2]))


def test_make_loss_reads_the_resolved_divisor():
    # One sequence of 2 tokens, advantage 1, on-policy: Dr.GRPO's loss is -(sum of ratios) / divisor = -2 / 8.
    spec = parse_spec({"algorithm": {"name": "dr_grpo"}, "rollout": {"max_new_tokens": 8}}).algorithm
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = make_loss(spec)(logp, batch_of(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2, dtype=bool)))
    assert loss.item() == pytest.approx(-0.25)


def test_defaults_must_be_algorithm_defaults():
    class Loose:
        name, defaults = "loose", {"loss_agg": "token_mean"}

        def loss(self, spec, off_policy):
            raise AssertionError

    with pytest.raises(ValueError, match="its defaults must be a factory.protocols.AlgorithmDefaults, got dict"):
        ALGORITHMS.register("loose", Loose())
    assert "loose" not in ALGORITHMS.names()
    assert AlgorithmDefaults().loss_agg == "seq_mean_token_mean"


def test_validating_a_spec_imports_no_torch():
    # `factory validate`, the Dagster resources and the eval client validate specs without torch (5 s of imports on
    # a loaded 2-core machine): the algorithm modules the validation reads import the maths only to build a loss.
    code = ("import sys; from factory.config import parse_spec\n"
            "for n in ('grpo', 'dr_grpo', 'dapo', 'cispo', 'gspo'): parse_spec({'algorithm': {'name': n}})\n"
            "import factory.core.algorithms\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr
