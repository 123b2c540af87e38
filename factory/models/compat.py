"""What differs between the transformers releases Factory runs on, in one place.

A causal LM's KV-cache argument and output field were renamed from `past_key_values` to `cache` in transformers
5.2x (the old name still works there, with a deprecation warning); 5.17 and earlier know only `past_key_values`
and silently ignore a `cache=` keyword. The engines pass and read the cache through these two functions, which
ask the model's own `forward` which name it takes.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any


@cache
def _cache_name(model_type: type) -> str:
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def cache_kwargs(model: Any, kv_cache: Any) -> dict[str, Any]:
    """The keyword that hands `kv_cache` to `model`'s forward, under the name its transformers release uses."""
    return {_cache_name(type(model)): kv_cache}


def returned_cache(model: Any, out: Any) -> Any:
    """The KV cache `model`'s forward returned in `out`."""
    return getattr(out, _cache_name(type(model)))
