"""Prompt data: named, versioned sources of tasks (`source.py`, `sources.py`) and the streaming blender that
interleaves them with exact quotas (`blender.py`)."""
