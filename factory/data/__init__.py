"""Prompt data: named, versioned sources of tasks (`sources/`, their interface in `sources/base.py`), the
streaming blender that interleaves them with exact quotas (`blender.py`), the blend a spec describes
(`from_spec.py`), the feed a producer draws from (`feed.py`) and the curriculum (`curriculum.py`)."""
