"""Factory: an RL post-training experiment factory (the engine; imports no dagster)."""

__version__ = "0.1.0"
