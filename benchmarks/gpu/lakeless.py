"""Stand-ins for the lake's libraries (pyiceberg, duckdb, sqlalchemy) where they are not installed, so that
`check.py` imports Factory's training path (factory.core.loop pulls the data sources, which import the Iceberg
source and the lake's query module at import time) on the lent GPU machine, which has none of them and cannot
fetch them. Nothing in check.py touches the lake: a stand-in's names are inert classes whose instances take any
arguments (the lake's schemas are built at import time) and answer any attribute or call with another inert
object; nothing is read or written through them. Where the real library is installed it is used.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

ABSENT_OK = ("duckdb",)  # 25 MB: past the kit's 40 MiB; only the lake's SQL queries use it


class _Inert:
    """Takes any arguments; any attribute, call, item or iteration gives another inert object (or nothing)."""

    def __init__(self, *_a: object, **_k: object) -> None:
        pass

    def __getattr__(self, name: str) -> _Inert:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()

    def __call__(self, *_a: object, **_k: object) -> _Inert:
        return _Inert()

    def __getitem__(self, _key: object) -> _Inert:
        return _Inert()

    def __iter__(self):  # noqa: ANN204
        return iter(())

    def __class_getitem__(cls, _key: object) -> type:
        return cls


def _stub_class(module: str, name: str) -> type:
    return type(name, (_Inert,), {"__module__": module})


class _AbsentModule(types.ModuleType):
    """A package whose every attribute is a stand-in class (and whose submodules are stand-ins too)."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        cls = _stub_class(self.__name__, name)
        setattr(self, name, cls)
        return cls


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _AbsentModule(spec.name)
        module.__path__ = []  # a package: `from pyiceberg.io.pyarrow import X` finds the submodules here
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, tops: set[str]):
        self.tops = tops

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in self.tops:
            return importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)
        return None


def install() -> list[str]:
    """Stand in for each of ABSENT_OK that does not import here; returns their names (empty where all are real)."""
    missing = {m for m in ABSENT_OK if m not in sys.modules and importlib.util.find_spec(m) is None}
    if missing:
        sys.meta_path.append(_Finder(missing))  # last: a real installation always wins
    return sorted(missing)
