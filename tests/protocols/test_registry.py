"""factory/protocols/registry.py: a name resolves to an in-process registration, a built-in (imported only when
asked for), a plugin's entry point, or an import path; a wrong name or a broken plugin is one line naming the field."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from factory.protocols.registry import Registry, import_path


def _registry(**kw) -> Registry:
    return Registry("widget", "widgets.name", {"json": "json:dumps"}, group="factory.test_widgets", **kw)


def test_a_builtin_is_imported_only_when_asked_for(tmp_path, monkeypatch):
    (tmp_path / "lazy_widget_mod.py").write_text("LOADED = True\nWIDGET = object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = Registry("widget", "widgets.name", {"lazy": "lazy_widget_mod:WIDGET"}, group="factory.test_widgets")
    assert r.names() == ("lazy",) and "lazy" in r
    assert "lazy_widget_mod" not in sys.modules
    assert r.get("lazy") is sys.modules["lazy_widget_mod"].WIDGET
    assert r.get("lazy") is r.get("lazy")  # loaded once


def test_register_adds_a_name_and_refuses_to_shadow_a_builtin_unless_asked():
    r = _registry()
    thing = object()
    assert r.register("mine", thing) is thing
    assert r.get("mine") is thing and r.names() == ("json", "mine")
    with pytest.raises(ValueError, match="'json' is registered already"):
        r.register("json", object())
    other = object()
    r.register("json", other, replace=True)
    assert r.get("json") is other
    r.unregister("mine")
    assert "mine" not in r

    @r.register("decorated")
    def fn():
        return 1

    assert r.get("decorated") is fn
    with pytest.raises(ValueError, match="without ':'"):
        r.register("pkg.mod:attr", object())


def test_an_import_path_resolves_and_a_bad_one_names_the_field():
    r = _registry()
    assert r.get("json:loads") is import_path("json:loads", "x")
    assert r.check_name("os.path:join") == "os.path:join"
    with pytest.raises(ValueError, match=r"widgets.name: cannot import 'nope' from 'json'"):
        r.get("json:nope")
    with pytest.raises(ValueError, match=r"widgets.name: cannot import 'x' from 'no_such_module_here'"):
        r.get("no_such_module_here:x")


def test_an_unknown_name_lists_the_known_ones_and_the_import_path_form():
    with pytest.raises(ValueError) as e:
        _registry().get("jsno")
    msg = str(e.value)
    assert msg.startswith("widgets.name: unknown widget 'jsno'; one of json,") and "package.module:attr" in msg
    assert "\n" not in msg


def test_check_adapts_or_refuses_an_object_when_it_is_named():
    def check(name: str, obj: object):
        if not callable(obj):
            raise ValueError(f"widgets.name: {name!r} is not callable")
        return obj

    r = _registry(check=check)
    assert r.get("json") is import_path("json:dumps", "x")
    with pytest.raises(ValueError, match="'sys:maxsize' is not callable"):
        r.get("sys:maxsize")
    with pytest.raises(ValueError, match="'bad' is not callable"):
        r.register("bad", 3)


def test_a_plugin_entry_point_is_listed_without_importing_it_and_loaded_when_named(tmp_path, installed_plugin):
    """A package's entry point in the registry's group, as pip would install it (a .dist-info on sys.path)."""
    (tmp_path / "plugin_widget_mod.py").write_text("WIDGET = 'from the plugin'\n")
    (tmp_path / "plugin_broken_mod.py").write_text("raise RuntimeError('broken at import')\n")
    installed_plugin("factory.test_widgets", plugged="plugin_widget_mod:WIDGET", broken="plugin_broken_mod:WIDGET")
    r = _registry()
    assert r.names() == ("json", "plugged", "broken") and "plugged" in r
    assert "plugin_widget_mod" not in sys.modules
    assert r.get("plugged") == "from the plugin"
    with pytest.raises(ValueError, match=r"the plugin 'broken' \(plugin_broken_mod:WIDGET, entry point group "
                                         r"'factory.test_widgets'\) failed to load: RuntimeError: broken at import"):
        r.get("broken")


def test_spec_name_passes_builtins_unimported_and_resolves_the_rest_naming_no_field(tmp_path, monkeypatch):
    (tmp_path / "never_imported_widget.py").write_text("raise RuntimeError('imported at validation')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = Registry("widget", "widgets.name", {"lazy": "never_imported_widget:W"}, group="factory.test_widgets")
    assert r.spec_name("lazy") == "lazy" and "never_imported_widget" not in sys.modules
    assert r.spec_name("json:dumps") == "json:dumps"
    with pytest.raises(ValueError) as e:
        r.spec_name("x" * 5000)
    msg = str(e.value)
    assert msg.startswith("unknown widget 'xxx") and "…" in msg and len(msg) < 400  # the field is the spec's to name


def test_entry_points_are_read_once_per_sys_path(tmp_path, monkeypatch, installed_plugin):
    """Reading every installed package's metadata takes tens of ms and a verifier's op is looked up per completion
    scored: the registry reads it again only when sys.path changed (a plugin's path added)."""
    reads = []
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: reads.append(kw) or real(**kw))
    r = _registry()
    for _ in range(5):
        assert "nope" not in r
    assert len(reads) == 1
    (tmp_path / "late_widget_mod.py").write_text("WIDGET = 'late'\n")
    installed_plugin("factory.test_widgets", late="late_widget_mod:WIDGET")  # a new path on sys.path
    assert r.get("late") == "late" and len(reads) == 2
