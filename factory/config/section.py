"""What every section of a spec shares: unknown keys refused, no inf/NaN, no `true`/`false` taken for a number,
and fields added late left out of dumps while they hold their default."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import ConfigDict, SerializerFunctionWrapHandler, model_serializer

from factory.source_spec import NoBoolNumbers


class _Section(NoBoolNumbers):
    # No inf/NaN anywhere: an infinite learning rate or timeout validates against gt=0 but wrecks the run. No
    # true/false for a number (NoBoolNumbers).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # Fields added after specs were first fingerprinted: left out of dumps while they hold their default, so an
    # older spec's dump, fingerprint and warm-start cache key stay what they were.
    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_late_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self._LATE_FIELDS:
            if name in data and getattr(self, name) == type(self).model_fields[name].get_default(
                    call_default_factory=True):
                data.pop(name)
        return data


LR_HELP = "AdamW learning rate (torch holds it as a float32: far past 1e30 the optimizer step overflows)"
