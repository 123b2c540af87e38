"""Heavy-tailed environment latency: a reproducible model of slow verifiers and long agent episodes.

The default shape follows agentic RL reports: about 40% of episodes are short, 50% medium and 10%
take twenty times as long as a short one. Latencies are drawn deterministically from an episode's
key, so every loop mode of a benchmark sees exactly the same environment.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyProfile:
    unit_s: float = 0.05  # a short episode's latency
    short: tuple[float, float] = (0.4, 1.0)  # (fraction, latency in units)
    medium: tuple[float, float] = (0.5, 3.0)
    long: tuple[float, float] = (0.1, 20.0)

    def __post_init__(self) -> None:
        total = self.short[0] + self.medium[0] + self.long[0]
        if abs(total - 1.0) > 1e-9:
            raise ValueError(f"latency fractions must sum to 1, got {total}")
        if self.unit_s < 0:
            raise ValueError(f"unit_s must be >= 0, got {self.unit_s}")

    def _buckets(self) -> list[tuple[float, float]]:
        return [self.short, self.medium, self.long]

    def sample(self, key: str) -> float:
        """Latency in seconds for the episode named `key` (same key, same latency)."""
        u = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64
        acc = 0.0
        for frac, units in self._buckets():
            acc += frac
            if u < acc:
                return units * self.unit_s
        return self.long[1] * self.unit_s

    def mean_s(self) -> float:
        return sum(f * x for f, x in self._buckets()) * self.unit_s

    def expected_max_s(self, batch: int) -> float:
        """E[latency of the slowest of `batch` independent episodes]."""
        buckets = sorted(self._buckets(), key=lambda b: b[1])
        total, below = 0.0, 0.0
        for frac, units in buckets:
            # P(max == this bucket) = P(all <= it) - P(all < it)
            total += ((below + frac) ** batch - below**batch) * units
            below += frac
        return total * self.unit_s

    def sync_limit(self, batch: int) -> float:
        """The most any overlap can gain over a batch barrier with `batch` episodes in flight:
        E[slowest in a batch] / E[mean]."""
        return self.expected_max_s(batch) / self.mean_s()
