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


def test_both_engines_decode_on_the_installed_transformers_without_a_deprecation_warning() -> None:
    """The `past_key_values` keyword printed a FutureWarning per decode site (about 90 in `make demo`, issue 24):
    on the transformers installed here both engines pass the cache under the name it takes, silently."""
    import warnings

    import torch

    from factory.core.rollout.base import SamplingParams
    from factory.core.rollout.engines.continuous import ContinuousEngine
    from factory.core.rollout.engines.embedded import EmbeddedEngine
    from factory.models.build import build_model
    from factory.models.tokenizer import build_tokenizer

    torch.set_num_threads(1)
    tok = build_tokenizer()
    model = build_model("micro", tok, seed=0)
    prompts = [tok("12+34=").input_ids, tok("5+6=").input_ids]
    params = SamplingParams(n=2, max_new_tokens=4, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning raised while decoding fails the test
        for engine in (EmbeddedEngine(model, tok), ContinuousEngine(model, tok)):
            groups = engine.generate(prompts, params)
            assert [len(g) for g in groups] == [2, 2]
