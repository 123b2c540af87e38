"""A registry of one extension point: a name the spec says -> the object that implements it.

A name resolves, in order, to: an object registered in this process (`register`), a built-in (an import path
held as a string, so the registry imports nothing until a name is asked for and the layers stay one-way), a
plugin's entry point in the registry's group (a third-party package declares
`[project.entry-points."factory.algorithms"] my_algo = "my_pkg.algo:ALGORITHM"`), or an import path
`package.module:attr` written in the spec itself (as `task.environment` takes). An unknown name is a
`ValueError` naming the spec field, the names known and the import-path form.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from factory.text import clip

T = TypeVar("T")


def import_path(path: str, what: str) -> object:
    """The object at `package.module:attr` (attr may be dotted); a one-line ValueError naming `what` otherwise."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{what}: {path!r} is not an import path 'package.module:attr'")
    try:
        obj: object = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what}: cannot import {attr!r} from {module!r}: {e}") from e
    return obj


class Registry(Generic[T]):
    """Names -> implementations of one extension point (`kind`), as the spec field `field` names them.

    `builtins` maps each built-in name to the import path of its object, imported on first use. `group` is the
    entry-point group plugins register in. `check` (optional) validates or adapts an object as it is resolved, so
    a wrong object fails when it is named, with the name in the message, not deep inside a run."""

    def __init__(self, kind: str, field: str, builtins: Mapping[str, str], group: str,
                 check: Callable[[str, object], T] | None = None):
        self.kind, self.field, self.group = kind, field, group
        self._builtins = dict(builtins)
        self._registered: dict[str, T] = {}
        self._loaded: dict[str, T] = {}
        self._check = check
        self._plugins: tuple[tuple[str, ...], dict[str, importlib.metadata.EntryPoint]] | None = None

    # ------------------------------------------------------------------ registration

    def register(self, name: str, obj: T | None = None, *, replace: bool = False):
        """Register `obj` under `name` (in this process); without `obj`, a decorator. A built-in name, or one
        registered already, is refused unless `replace`: a plugin cannot silently shadow grpo."""
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r}: a non-empty name without ':' (':' marks an import path)")

        def add(o: T) -> T:
            if not replace and (name in self._builtins or name in self._registered):
                raise ValueError(f"{self.kind} {name!r} is registered already; pass replace=True to override it")
            self._registered[name] = self._checked(name, o)
            self._loaded.pop(name, None)
            return o

        return add if obj is None else add(obj)

    def unregister(self, name: str) -> None:
        """Forget a name registered with `register` (tests; a built-in cannot be removed)."""
        self._registered.pop(name, None)
        self._loaded.pop(name, None)

    # ------------------------------------------------------------------ lookup

    def _entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        # Reading every installed package's metadata takes tens of ms, and names are looked up per completion
        # scored: read once per sys.path (a path added later, e.g. a plugin's, is read then).
        path = tuple(sys.path)
        if self._plugins is None or self._plugins[0] != path:
            self._plugins = (path, {ep.name: ep for ep in importlib.metadata.entry_points(group=self.group)})
        return self._plugins[1]

    def names(self) -> tuple[str, ...]:
        """Every name this registry resolves without an import path: built-ins first, then plugins (entry
        points, read from package metadata without importing them) and names registered in this process."""
        out = list(self._builtins)
        for name in [*self._entry_points(), *self._registered]:
            if name not in out:
                out.append(name)
        return tuple(out)

    def builtin_names(self) -> tuple[str, ...]:
        return tuple(self._builtins)

    def is_builtin(self, name: str) -> bool:
        return name in self._builtins

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._registered or name in self._builtins
                                          or name in self._entry_points())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def check_name(self, name: str) -> str:
        """`name` if it resolves (an import path is imported to check it); the one-line error otherwise. For a
        spec validator: a typo fails at validation, naming the field."""
        self.get(name)
        return name

    def spec_name(self, name: str) -> str:
        """`name` as a spec validator takes it: a built-in or a name registered in this process passes by name
        (importing a built-in here would pull its module into every spec validation); a plugin's or an import path
        is resolved now, so a typo or a broken plugin fails at validation. The error leaves out the field (the
        spec's error line names it) and clips a huge name."""
        if name in self._builtins or name in self._registered:
            return name
        try:
            return self.check_name(name)
        except ValueError as e:
            echo = clip(repr(name), 100, mark="…", unit="chars", size=len(name))
            raise ValueError(str(e).removeprefix(f"{self.field}: ").replace(repr(name), echo)) from None

    def get(self, name: str) -> T:
        """The object registered under `name` (see the module docstring for the order)."""
        if name in self._registered:
            return self._registered[name]
        if name in self._loaded:
            return self._loaded[name]
        if name in self._builtins:
            obj = import_path(self._builtins[name], f"{self.field} {name!r} (built-in)")
        elif (ep := self._entry_points().get(name)) is not None:
            try:
                obj = ep.load()
            except Exception as e:  # a broken plugin names itself rather than failing somewhere later
                raise ValueError(f"{self.field}: the plugin {name!r} ({ep.value}, entry point group "
                                 f"{self.group!r}) failed to load: {type(e).__name__}: {e}") from e
        elif ":" in name:
            obj = import_path(name, self.field)
        else:
            raise ValueError(f"{self.field}: unknown {self.kind} {name!r}; one of {', '.join(self.names())}, or an "
                             f"import path 'package.module:attr' (or a plugin's entry point in group "
                             f"{self.group!r})")
        checked = self._checked(name, obj)
        self._loaded[name] = checked
        return checked

    def _checked(self, name: str, obj: object) -> T:
        return self._check(name, obj) if self._check is not None else obj  # type: ignore[return-value]
