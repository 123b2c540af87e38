"""The KV-cache keyword follows the model's transformers release (`cache`, or `past_key_values` before 5.2x)."""

from __future__ import annotations

from types import SimpleNamespace

from factory.models.compat import cache_kwargs, returned_cache


class NewStyle:
    def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs): ...


class OldStyle:  # transformers 5.17: a `cache=` keyword would vanish into **kwargs and the cache be dropped
    def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs): ...


def test_the_cache_goes_under_the_name_the_models_forward_takes() -> None:
    kv = object()
    assert cache_kwargs(NewStyle(), kv) == {"cache": kv}
    assert cache_kwargs(OldStyle(), kv) == {"past_key_values": kv}
    assert returned_cache(NewStyle(), SimpleNamespace(cache=kv)) is kv
    assert returned_cache(OldStyle(), SimpleNamespace(past_key_values=kv)) is kv
