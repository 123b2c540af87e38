"""The `ops` section: checkpoints, restarts, evals and the run's health bounds (the log-prob gap gate among them)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from factory.config.section import _Section

# The step-0 gate's and the run's default bounds on the mean |engine - trainer| log-prob of the same tokens. Same
# numerics (fp32 on the CPU, one process): float noise, 1e-7 to 3e-6 measured (the quickstart's SFT model, SmolLM2);
# an engine on fp16-rounded weights was 3.2e-4 off on the quickstart's SFT model, 1.6e-3 on SmolLM2: 1e-4 stops both
# with a 30x margin over the noise. Another precision or backend (bf16 engines, SGLang): SkyRL's CI holds 0.0104
# (sync) and 0.0193 (fully async) on a 1.5B model; 0.1 leaves room for smaller models and stops what is broken.
GAP_BOUND_SAME_NUMERICS = 1e-4
GAP_BOUND_OTHER_NUMERICS = 0.1


class OpsSpec(_Section):
    """Surviving faults: resume points, automatic restarts, hang detection, circuit breakers, the preflight gate
    (see factory/ops/)."""

    resume_every: int = Field(
        10, ge=0, description="write a full-state resume point (model, optimizer, RNGs, data position, buffered "
        "and in-flight rollouts) every N steps, in the background; also at every schedule.checkpoint_every, on "
        "SIGTERM/SIGINT and at the end; 0: only those")
    keep_resume: int = Field(2, ge=1, description="resume points kept per run (older ones are deleted)")
    max_restarts: int = Field(3, ge=0, description="automatic resumes after a crash, a kill or a hang before the "
                              "run is marked failed")
    hang_timeout_s: float = Field(60.0, gt=0, description="a run whose trainer makes no progress (no step, no "
                                  "sign of life) for this long is treated as crashed: killed and resumed")
    max_nonfinite_steps: int = Field(3, ge=1, description="steps in a row skipped for a non-finite loss or "
                                     "gradient before the run stops at its last good state")
    breaker_restarts: int = Field(3, ge=1, description="a service (rollout server, environment workers, sandbox "
                                  "pool) restarted this many times within breaker_window_s trips the breaker: the "
                                  "run checkpoints and stops, naming the service")
    breaker_window_s: float = Field(60.0, gt=0)
    preflight: Literal["gate", "off"] = Field(
        "gate", description="gate: a node whose latest preflight failed gets no training run (one missing or older "
        "than preflight_max_age_s is run first, quick mode); off: no gate (env FACTORY_PREFLIGHT=off also)")
    preflight_max_age_s: float = Field(86400.0, gt=0)
    lake_outage_s: float = Field(300.0, ge=0, description="how long the lake/catalog may be unreachable while the "
                                 "run keeps training (rows are spooled under the run's directory and flushed when "
                                 "it returns); past that the run stops at a resume point (exit code 5)")

    max_logprob_gap: float | None = Field(
        None, gt=0, description="bound on the mean |engine log-prob - trainer log-prob| of the same tokens under the "
        "same weights: the step-0 gate (and `factory preflight`) stop a run past it, and a gap past it for "
        "max_gap_steps steps in a row stops the run at its last good resume point (exit code 8); unset: 1e-4 where "
        "the engine should compute as the trainer does (fp32 on the CPU, in-process), 0.1 where it computes in "
        "another precision or backend")
    max_gap_steps: int = Field(3, ge=1, description="steps in a row with the gap past max_logprob_gap before the run "
                               "stops at its last good state")

    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("lake_outage_s", "max_logprob_gap", "max_gap_steps")

    def logprob_gap_bound(self, engine_differs: bool) -> float:
        """`max_logprob_gap`, or its default for an engine that does (not) compute as the trainer does."""
        if self.max_logprob_gap is not None:
            return self.max_logprob_gap
        return GAP_BOUND_OTHER_NUMERICS if engine_differs else GAP_BOUND_SAME_NUMERICS

    @field_validator("preflight", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML reads a bare `off` as false (and `on` as true): take them as meant.
        return {False: "off", True: "gate"}.get(v, v) if isinstance(v, bool) else v
