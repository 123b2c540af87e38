"""The `algorithm` section: which RL objective (the built-ins GRPO, Dr.GRPO, DAPO, CISPO, GSPO, or a registered one)
and its settings, each left unset taking that algorithm's published default (`Algorithm.defaults`)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from factory.config.bounds import MAX_GROUP_SIZE
from factory.config.section import LR_HELP, _Section
from factory.protocols.algorithm import ALGORITHMS, Algorithm

DUAL_CLIP_AUTO = 3.0  # verl's clip_ratio_c: the dual clip where staleness or a sampler/trainer gap can occur


class CorrectionSpec(_Section):
    """How the loss corrects for the gap between the sampler's log-probs and the trainer's own (recomputed) ones of
    the same tokens under the same weights (`algorithm.behavior: recompute`); see `core/correction.py`.

    With rho_t = exp(trainer_t - sampler_t) per token:
    - `tis`: truncated importance sampling: each token's policy-gradient term is weighted by min(rho_t, tis_cap)
      ("token"), or every token of a sequence by min(prod_t rho_t, tis_cap) ("sequence") ("Your Efficient RL
      Framework Secretly Brings You Off-Policy RL Training", 2025; verl's rollout_is). Unset: "token" where the run
      recomputes, off where it trusts the sampler.
    - `mis`: masked IS: a sequence whose geometric-mean ratio exp(mean_t log rho_t) leaves [lo, hi] leaves the loss
      ("When Speed Kills Stability", 2025; verl's rollout_rs "geometric").
    - `icepop`: a token whose rho_t leaves [alpha, beta] leaves the loss (IcePop, Ring-1T 2025; verl's rollout_rs
      "token"). The paper's M(k) = k on [alpha, beta], 0 outside, is this mask with `tis: token, tis_cap >= beta`.
    They compose: weights multiply, masks intersect, and both apply on top of the buffer's staleness weights.
    """

    tis: Literal["token", "sequence", "off"] | None = Field(
        None, description="truncated IS weights on the sampler/trainer ratio: per token, per sequence, or off; "
        "unset: token where the run recomputes the behaviour log-probs (algorithm.behavior), off otherwise")
    tis_cap: float = Field(2.0, ge=1, description="C: TIS weights are truncated at C; the gap's out-of-range share "
                           "counts tokens whose ratio leaves [1/C, C]")
    mis: tuple[float, float] | None = Field(
        None, description="[lo, hi]: sequences whose geometric-mean ratio leaves it are masked out of the loss; "
        "unset: off")
    icepop: tuple[float, float] | None = Field(
        None, description="[alpha, beta]: tokens whose ratio leaves it are masked out of the loss (IcePop: "
        "[0.5, 5.0]); unset: off")

    @field_validator("mis", "icepop")
    @classmethod
    def _range(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not 0 < v[0] < 1 < v[1]:
            raise ValueError(f"need [lo, hi] with 0 < lo < 1 < hi, got {list(v)}")
        return v

    def asked(self) -> bool:
        """Whether a correction is set explicitly (TIS's unset default left aside)."""
        return self.tis not in (None, "off") or self.mis is not None or self.icepop is not None

    def tis_mode(self, recompute: bool) -> str:
        """"token", "sequence" or "off", with the unset default resolved."""
        if self.tis is not None:
            return self.tis
        return "token" if recompute else "off"


class AlgorithmSpec(_Section):
    """The RL objective: advantages and policy loss. `name` picks the algorithm (`ALGORITHMS`: the built-ins are
    one module each under factory/core/algorithms/); fields left unset (None) take that algorithm's published
    default (its `AlgorithmDefaults`), so `name: dapo` alone is DAPO. The named algorithm validates the section too.

    `clip_eps` is the symmetric clip of GRPO and Dr.GRPO and DAPO's lower clip; `clip_eps_low` /
    `clip_eps_high` override either side for any algorithm (CISPO has no lower bound by default;
    GSPO's are sequence-level and tiny). `is_cap` truncates the importance weights the rollout buffer
    attaches to stale samples in its `importance` policy.

    `behavior` is whose log-probs the loss takes as the behaviour policy: the engine's as sampled, or the trainer's
    own recomputed (unset: recompute where the engine computes in another precision or backend, `engine_differs` of
    `spec.resolved`, config/resolved.py); `correction` corrects the sampler/trainer gap on top (TIS, MIS, IcePop;
    their weights multiply the staleness weights, their masks drop tokens from the policy term, the KL term and the
    aggregation).
    `dual_clip` unset is c = 3 on the PPO-clip losses where staleness or a gap can occur, off in a sync fp32 CPU run:
    a negative-advantage token far above its clip otherwise passes a gradient of |A| * ratio (1e3 at a ratio of 1e3).
    docs/algorithms.md has the formulas, the papers, suggested bounds and where factory differs from verl.
    """

    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("dual_clip", "behavior", "correction")
    # The rollout's max_new_tokens, the length constants' default: set once by ExperimentSpec's validation
    # (`resolve_lengths`), not a field, so no dump or fingerprint holds it.
    _rollout_max_new_tokens: int | None = PrivateAttr(None)

    name: str = Field(
        "grpo", description=f"the algorithm (factory/protocols/algorithm.py): one of the built-ins "
        f"{', '.join(ALGORITHMS.builtin_names())}, a plugin's name (entry point group {ALGORITHMS.group!r}) or an "
        "import path 'package.module:ATTR'", json_schema_extra={"examples": list(ALGORITHMS.builtin_names())})
    group_size: int = Field(8, ge=2, le=MAX_GROUP_SIZE, description="completions sampled per prompt")
    lr: float = Field(3e-4, gt=0, le=1e30, description=LR_HELP)
    clip_eps: float = Field(0.2, gt=0, lt=1)
    clip_eps_low: float | None = Field(None, gt=0, lt=1, description="lower clip: ratio >= 1 - clip_eps_low")
    clip_eps_high: float | None = Field(None, gt=0, description="upper clip: ratio <= 1 + clip_eps_high")
    kl_coef: float = Field(0.0, ge=0)
    scale_rewards: bool | None = Field(None, description="divide advantages by the group's reward std")
    loss_agg: Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"] | None = Field(
        None, description="seq_mean_token_mean: mean per sequence then over sequences; token_mean: over all "
                          "tokens of the batch; seq_mean_token_sum_norm: token sum / a constant max length",
    )
    max_len_norm: int | None = Field(
        None, ge=1, description="Dr.GRPO's constant divisor; unset: the rollout's max_new_tokens",
    )
    overlong_max_len: int | None = Field(
        None, ge=1, description="DAPO's L_max for overlong shaping; unset: the rollout's max_new_tokens",
    )
    overlong_buffer: int | None = Field(
        None, ge=0, description="DAPO's L_cache: lengths past overlong_max_len - overlong_buffer are penalized "
                                "linearly; 0 turns shaping off; unset: dapo uses a fifth of overlong_max_len "
                                "(the paper's 4096 of 20480), others 0",
    )
    overlong_penalty: float = Field(1.0, ge=0, description="scale of the overlong penalty (reaches -this)")
    dynamic_sampling: bool | None = Field(
        None, description="drop groups whose rewards are all equal and refill the batch (DAPO)",
    )
    is_cap: float = Field(2.0, ge=1, description="truncation of importance weights on stale samples")
    dual_clip: float | Literal["off"] | None = Field(
        None, description="dual-clip PPO's c (Ye et al. 2020; verl's clip_ratio_c, 3.0 there): a token with "
        "negative advantage loses at most -A * c, and past it passes no gradient; grpo, dr_grpo and dapo only; "
        "'off': never; unset: 3.0 where staleness or a sampler/trainer gap can occur (schedule.mode one_step_off or "
        "async, or a run that recomputes the behaviour log-probs), off otherwise")
    behavior: Literal["rollout", "recompute"] | None = Field(
        None, description="the behaviour policy of the loss: the rollout engine's log-probs as sampled, or the "
        "trainer's own recomputed before the update (under the weights that generated the batch where they are at "
        "hand, the proximal policy otherwise); unset: recompute where the engine computes in another precision or "
        "backend (a GPU, bf16, a rollout server or SGLang, rollout.round_weights) or a correction is set, rollout "
        "where it is the trainer's own fp32 CPU forward (the trainer then scores one row per group, to measure the "
        "gap)")
    correction: CorrectionSpec = Field(default_factory=CorrectionSpec, description="corrections of the "
                                       "sampler/trainer gap (need behavior recompute)")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return ALGORITHMS.spec_name(v)

    @field_validator("overlong_buffer")
    @classmethod
    def _buffer_fits(cls, v: int | None, info: ValidationInfo) -> int | None:
        max_len = info.data.get("overlong_max_len")
        if v is not None and max_len is not None and v >= max_len:
            raise ValueError(f"must be < overlong_max_len = {max_len}, got {v}")
        return v

    @field_validator("dual_clip", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML reads a bare `off` as false

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip_bound(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, float) and not v > 1:
            raise ValueError(f"must be > 1 (a bound on the ratio), or 'off', got {v}")
        return v

    @model_validator(mode="after")
    def _correction_needs_recompute(self) -> AlgorithmSpec:
        if self.behavior == "rollout" and self.correction.asked():
            raise ValueError("algorithm.correction: corrections weigh the trainer's recomputed log-probs against the "
                             "sampler's; they need algorithm.behavior: recompute (or unset), not rollout")
        return self

    @model_validator(mode="after")
    def _algorithm_accepts(self) -> AlgorithmSpec:
        # The named algorithm's own checks (dr_grpo refuses std scaling, cispo and gspo the dual clip, ...).
        validate = getattr(self.implementation(), "validate", None)
        if validate is not None:
            validate(self)
        return self

    def implementation(self) -> Algorithm:
        """The `Algorithm` `name` names (built-in, plugin or import path; resolved once per process)."""
        return ALGORITHMS.get(self.name)

    def resolve_lengths(self, max_new_tokens: int) -> None:
        """Take the rollout's generation budget as the default of the length constants (Dr.GRPO's divisor, DAPO's
        L_max): ExperimentSpec's validation calls this once. Held out of the dump, so fingerprints are unchanged."""
        self._rollout_max_new_tokens = max_new_tokens

    def for_rollout(self, max_new_tokens: int) -> AlgorithmSpec:
        """A copy of this section with the length constants' default resolved as within a spec whose
        rollout.max_new_tokens is `max_new_tokens` (a bare section: tests, benchmarks)."""
        copy = self.model_copy()
        copy.resolve_lengths(max_new_tokens)
        return copy

    def length_norm(self) -> int | None:
        """Dr.GRPO's constant divisor: `max_len_norm`, else the rollout's max_new_tokens (None in a bare section that
        was not resolved)."""
        return self.max_len_norm or self._rollout_max_new_tokens

    def recomputes(self, engine_differs: bool) -> bool:
        """Whether the loss's behaviour log-probs are the trainer's own: `behavior`, or unset, whether the engine
        computes in another precision or backend than the trainer (`engine_differs`, from the run's placement) or a
        correction is asked for (corrections weigh the trainer's log-probs against the sampler's)."""
        if self.behavior is not None:
            return self.behavior == "recompute"
        return engine_differs or self.correction.asked()

    def resolved_dual_clip(self, off_policy: bool) -> float | None:
        """The dual clip's c, or None (off): `dual_clip` when set, else DUAL_CLIP_AUTO for the PPO-clip losses
        where staleness or a sampler/trainer gap can occur (`off_policy`), else off."""
        if self.dual_clip == "off":
            return None
        if self.dual_clip is not None:
            return float(self.dual_clip)
        return DUAL_CLIP_AUTO if off_policy and self.implementation().defaults.auto_dual_clip else None

    def _default(self, key: str) -> Any:
        return getattr(self.implementation().defaults, key)

    def clip_bounds(self) -> tuple[float | None, float]:
        """(eps_low, eps_high): the ratio is kept in [1 - eps_low, 1 + eps_high]; eps_low None: no lower bound."""
        def side(value: float | None, key: str) -> float | None:
            if value is not None:
                return value
            d = self._default(key)
            return self.clip_eps if d == "clip_eps" else d
        high = side(self.clip_eps_high, "clip_eps_high")
        assert high is not None  # every algorithm has an upper clip
        return side(self.clip_eps_low, "clip_eps_low"), high

    def aggregation(self) -> str:
        return self.loss_agg or self._default("loss_agg")

    def scales_rewards(self) -> bool:
        return self._default("scale_rewards") if self.scale_rewards is None else self.scale_rewards

    def uses_dynamic_sampling(self) -> bool:
        return self._default("dynamic_sampling") if self.dynamic_sampling is None else self.dynamic_sampling

    def overlong(self) -> tuple[int, int] | None:
        """(L_max, L_cache) of DAPO's soft overlong punishment, or None when shaping is off.

        L_max is `overlong_max_len`, else the rollout's `max_new_tokens` (resolved at validation); L_cache is
        `overlong_buffer`, else (dapo) a fifth of L_max, the paper's 4096 of 20480.
        """
        if self.overlong_buffer == 0 or (self.overlong_buffer is None and not self._default("overlong")):
            return None
        max_len = self.overlong_max_len or self._rollout_max_new_tokens
        if max_len is None:
            raise ValueError("algorithm.overlong_max_len: overlong shaping needs a max length (set it, or validate "
                             "the section within a spec: it takes rollout.max_new_tokens)")
        buffer = self.overlong_buffer if self.overlong_buffer is not None else max(1, max_len // 5)
        if buffer >= max_len:
            raise ValueError(f"algorithm.overlong_buffer: must be < the max length {max_len}, got {buffer}")
        return max_len, buffer
