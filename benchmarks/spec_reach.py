"""How far the whole `ExperimentSpec` travels: followed statically from `run_experiment` (factory/runs/experiment.py)
through every function it is handed to, module by module, to where its fields are read. A count, not a timing.

The walk parses the tree's `factory/` (no import: any checkout, e.g. a worktree of an older commit, is read as text).
From `run_experiment`'s `spec` it follows each call that passes the spec (a name holding it, or `self.<attr>` where an
object stored it) as an argument, to the function the call resolves to statically: a function or class of the module,
one imported by name or through a module alias (re-exports followed), `self.method`, a class (its `__init__`, or a
dataclass's fields: the spec then lives on as `self.<field>` in every method), and a registry's lookup
(`PRODUCERS.get(name)(spec, ...)`, directly or through a name bound to it) to every built-in of that registry whose
import path is written as a string literal (`Registry(kind, field, {name: "module:attr", ...})`). Calls it cannot
resolve statically (methods of objects of unknown type, callbacks, plugins) are not followed: the counts are a floor.

Figures:
- modules: the modules the spec reaches (a function of the module is handed it);
- reading: those among them that read one of its fields (`spec.<section>`), not only pass it on;
- climbs: the walk in call order (depth first, each function once) lists the modules the spec is in; a climb is a
  step of that list from a module to one of a higher layer (layers as pyproject.toml's import-linter contract
  "factory's layers point one way" orders them, the root's loose modules lowest): the spec went down to a lower layer
  and came back up to be handed down again, i.e. the higher layer worked out what the lower needed piecemeal;
- signatures: functions anywhere in factory/ with a parameter annotated `ExperimentSpec` (the whole spec taken).

Usage: `python benchmarks/spec_reach.py [ROOT ...]` (default: this checkout). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

START = ("factory.runs.experiment", "run_experiment", "spec")
CONTRACT = "factory's layers point one way"


@dataclass
class Module:
    name: str
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)  # local name -> 'module' or 'module:attr'
    defs: dict[str, ast.AST] = field(default_factory=dict)  # top-level functions and classes
    registries: dict[str, list[str]] = field(default_factory=dict)  # a Registry's name -> its built-ins' paths


@dataclass
class Reach:
    order: list[str] = field(default_factory=list)  # modules in the walk's call order (consecutive repeats merged)
    modules: set[str] = field(default_factory=set)
    reading: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)


class Tree:
    """The modules of `root`/factory by dotted name, each parsed when first asked for (a walk reads a few dozen)."""

    def __init__(self, root: Path):
        self.paths: dict[str, Path] = {}
        for path in sorted((root / "factory").rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            self.paths[".".join(parts)] = path
        self.parsed: dict[str, Module] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.paths

    def get(self, name: str) -> Module | None:
        return self[name] if name in self.paths else None

    def __getitem__(self, name: str) -> Module:
        if name not in self.parsed:
            self.parsed[name] = _parse(name, self.paths[name])
        return self.parsed[name]


def _parse(name: str, path: Path) -> Module:
    tree = ast.parse(path.read_text(), str(path))
    m = Module(name, tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                m.imports[a.asname or a.name] = f"{base}:{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    m.imports[a.asname] = a.name
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            m.defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            builtins = _registry_builtins(node.value)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if builtins is not None:
                for t in targets:
                    if isinstance(t, ast.Name):
                        m.registries[t.id] = builtins
    return m


def _registry_builtins(call: ast.Call) -> list[str] | None:
    """The built-ins' import paths of `Registry(kind, field, {name: "module:attr", ...}, ...)`, where they are string
    literals (None: not a registry, or its built-ins are computed)."""
    if not (isinstance(call.func, ast.Name) and call.func.id == "Registry" and len(call.args) >= 3):
        return None
    table = call.args[2]
    if not isinstance(table, ast.Dict):
        return None
    paths = [v.value for v in table.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return paths if len(paths) == len(table.values) else None


def layers(root: Path) -> list[list[str]]:
    """The contract's layers, highest first, each a list of module prefixes."""
    cfg = tomllib.loads((root / "pyproject.toml").read_text())
    for c in cfg["tool"]["importlinter"]["contracts"]:
        if c["name"] == CONTRACT:
            return [[p.strip() for p in layer.replace("|", ":").split(":")] for layer in c["layers"]]
    raise SystemExit(f"pyproject.toml: no import-linter contract named {CONTRACT!r}")


def layer_of(module: str, order: list[list[str]]) -> int:
    """0 is the highest layer; a module the contract does not name sits lowest."""
    for i, prefixes in enumerate(order):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return len(order)


class Walker:
    def __init__(self, mods: Tree):
        self.mods, self.reach, self.seen = mods, Reach(), set()

    def target(self, ref: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """A 'module:attr' reference to its definition, following re-exports."""
        if depth > 10:
            return None
        mod, _, attr = ref.partition(":")
        if not attr:
            return None
        if f"{mod}.{attr}" in self.mods:  # a submodule imported by name
            return None
        m = self.mods.get(mod)
        if m is None:
            return None
        if attr in m.defs:
            return mod, m.defs[attr]
        if attr in m.imports:
            return self.target(m.imports[attr], depth + 1)
        return None

    def member(self, modname: str, cls: ast.ClassDef, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """`cls`'s method `name`, its own or the nearest base class's (bases resolved statically)."""
        found = _member(cls, name)
        if found is not None:
            return modname, found
        for base in cls.bases if depth < 10 else ():
            b = self.resolve(self.mods[modname], None, base, {})
            if b is not None and isinstance(b[1], ast.ClassDef):
                got = self.member(b[0], b[1], name, depth + 1)
                if got is not None:
                    return got
        return None

    def resolve(self, mod: Module, cls: ast.ClassDef | None, func: ast.expr,
                local: dict[str, list[ast.expr]]) -> tuple[str, ast.AST] | None:
        """The definition `func` names, `local` the function's plain assignments (name -> values): a name bound to
        one of several classes resolves to the first that resolves (see `enter`, which tries each)."""
        if isinstance(func, ast.Name):
            if func.id in mod.defs:
                return mod.name, mod.defs[func.id]
            if func.id in mod.imports:
                return self.target(mod.imports[func.id])
            return None
        if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in local):
            for value in local[func.value.id]:  # x = Cls(...); x.method(spec)
                if isinstance(value, ast.Call):
                    c = self.resolve(mod, cls, value.func, {})
                    if c is not None and isinstance(c[1], ast.ClassDef):
                        return self.member(c[0], c[1], func.attr)
            return None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            base = func.value.id
            if base in ("self", "cls") and cls is not None:
                return self.member(mod.name, cls, func.attr)
            ref = mod.imports.get(base)
            if ref is not None:
                modname = ref.replace(":", ".") if ":" in ref and ref.replace(":", ".") in self.mods else ref
                if ":" not in modname and modname in self.mods:
                    return self.target(f"{modname}:{func.attr}")
                found = self.target(ref)
                if found and isinstance(found[1], ast.ClassDef):
                    return self.member(found[0], found[1], func.attr)
            if base in mod.defs and isinstance(mod.defs[base], ast.ClassDef):
                return self.member(mod.name, mod.defs[base], func.attr)
        return None

    def enter(self, modname: str, node: ast.AST, held: frozenset[str], cls: ast.ClassDef | None = None) -> None:
        """Follow the spec into `node` (a function, or a class it is constructed with), held in names `held`
        (plain names, or 'self.x')."""
        if isinstance(node, ast.ClassDef):
            init = self.member(modname, node, "__init__")
            if init is not None:
                return self.enter(init[0], init[1], held, node)
            # a dataclass: the spec is a field; its methods hold it as self.<field>
            return self.object(modname, node, frozenset(f"self.{h}" for h in held))
        key = (modname, getattr(node, "lineno", 0), held)
        if key in self.seen:
            return
        self.seen.add(key)
        self.reach.functions.add(f"{modname}:{node.name}")
        self.reach.modules.add(modname)
        if not self.reach.order or self.reach.order[-1] != modname:
            self.reach.order.append(modname)
        mod = self.mods[modname]
        names = set(held)
        stored: set[str] = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Assign):
                for target, value in _pairs(sub):
                    if not _holds(value, names):
                        continue
                    if isinstance(target, ast.Name):
                        names.add(target.id)
                    elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                          and target.value.id == "self"):
                        stored.add(f"self.{target.attr}")
            if isinstance(sub, ast.Attribute) and _holds(sub.value, names) and not _is_call_target(sub, node):
                self.reach.reading.add(modname)
        local: dict[str, list[ast.expr]] = {}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Assign):
                for target, value in _pairs(sub):
                    if isinstance(target, ast.Name):
                        local.setdefault(target.id, []).extend(
                            [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value])
        calls = sorted((n for n in ast.walk(node) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
        for sub in calls:  # in source order: the walk's order is the order the calls are written in
            callees = [self.resolve(mod, cls, sub.func, local)]
            if isinstance(sub.func, ast.Name) and callees[0] is None:  # cls = A if ... else B; cls(spec)
                callees = [self.resolve(mod, cls, v, {}) for v in local.get(sub.func.id, [])]
            callees += self.looked_up(mod, sub.func, local)
            for callee in callees:
                if callee is not None:
                    self.call(mod, cls, sub, callee, names)
        if stored and cls is not None:
            self.object(modname, cls, frozenset(stored))

    def looked_up(self, mod: Module, func: ast.expr, local: dict[str, list[ast.expr]]) -> list[tuple[str, ast.AST]]:
        """The built-ins a registry lookup may call: `REG.get(name)(...)`, or `f = REG.get(name); f(...)`."""
        lookups = [func] if isinstance(func, ast.Call) else local.get(func.id, []) if isinstance(func, ast.Name) else []
        out = []
        for look in lookups:
            if not (isinstance(look, ast.Call) and isinstance(look.func, ast.Attribute) and look.func.attr == "get"
                    and isinstance(look.func.value, ast.Name)):
                continue
            where: Module | None = mod
            name = look.func.value.id
            for _ in range(10):  # re-exports followed (factory.protocols re-exports each registry)
                if where is None or name in where.registries or name not in where.imports:
                    break
                ref_mod, _, name = where.imports[name].partition(":")
                where = self.mods.get(ref_mod)
            for path in where.registries.get(name, []) if where is not None else []:
                found = self.target(path)
                if found is not None:
                    out.append(found)
        return out

    def call(self, mod: Module, cls: ast.ClassDef | None, sub: ast.Call, callee: tuple[str, ast.AST],
             names: set[str]) -> None:
        """Follow call `sub` into `callee` with the parameters that receive the spec."""
        cmod, cnode = callee
        params = _params(cnode)
        if isinstance(cnode, ast.ClassDef):
            init = self.member(cmod, cnode, "__init__")
            params = _params(init[1])[1:] if init is not None else _fields(cnode)
        elif isinstance(sub.func, ast.Attribute) and params[:1] in (["self"], ["cls"]):
            params = params[1:]
        got = {params[i] for i, a in enumerate(sub.args) if _holds(a, names) and i < len(params)}
        got |= {kw.arg for kw in sub.keywords if kw.arg and _holds(kw.value, names)}
        if got:
            self.enter(cmod, cnode, frozenset(got), self.owner(cmod, cnode))

    def owner(self, modname: str, node: ast.AST) -> ast.ClassDef | None:
        """The class `node` (a method) is defined in, if any."""
        for top in self.mods[modname].tree.body:
            if isinstance(top, ast.ClassDef) and any(item is node for item in top.body):
                return top
        return None

    def object(self, modname: str, cls: ast.ClassDef, held: frozenset[str]) -> None:
        """The spec stored on an object as `held` ('self.x'): every method of its class (and its bases') holds it."""
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name != "__init__":
                self.enter(modname, item, held, cls)
        for base in cls.bases:
            b = self.resolve(self.mods[modname], None, base, {})
            if b is not None and isinstance(b[1], ast.ClassDef) and b[1] is not cls:
                self.object(b[0], b[1], held)


def _pairs(assign: ast.Assign) -> list[tuple[ast.expr, ast.expr]]:
    """(target, value) of `a = x` and of `a, b = x, y`."""
    out = []
    for t in assign.targets:
        if isinstance(t, ast.Tuple) and isinstance(assign.value, ast.Tuple) and len(t.elts) == len(assign.value.elts):
            out += list(zip(t.elts, assign.value.elts, strict=True))
        else:
            out.append((t, assign.value))
    return out


def _member(cls: ast.ClassDef, name: str) -> ast.AST | None:
    for item in cls.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
            return item
    return None


def _params(node: ast.AST | None) -> list[str]:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    a = node.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


def _fields(cls: ast.ClassDef) -> list[str]:
    return [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]


def _holds(expr: ast.expr, names: set[str]) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in names
    return (isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name)
            and f"{expr.value.id}.{expr.attr}" in names)


def _is_call_target(attr: ast.Attribute, scope: ast.AST) -> bool:
    """`spec.fingerprint()` and the like: a method of the spec, not a field read."""
    return any(isinstance(n, ast.Call) and n.func is attr for n in ast.walk(scope))


def signatures(mods: Tree) -> int:
    """Functions in factory/ with a parameter annotated ExperimentSpec (only files naming it are parsed)."""
    n = 0
    for name, path in mods.paths.items():
        if "ExperimentSpec" not in path.read_text():
            continue
        for node in ast.walk(mods[name].tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                if any(p.annotation is not None and ast.unparse(p.annotation).strip("'\"") == "ExperimentSpec"
                       for p in a.posonlyargs + a.args + a.kwonlyargs):
                    n += 1
    return n


def measure(root: Path) -> dict:
    mods = Tree(root)
    order = layers(root)
    w = Walker(mods)
    mod, func, param = START
    w.enter(mod, mods[mod].defs[func], frozenset({param}))
    r = w.reach
    climbs = [(a, b) for a, b in zip(r.order, r.order[1:], strict=False)
              if layer_of(b, order) < layer_of(a, order)]
    return {"root": str(root), "modules": len(r.modules), "reading": len(r.reading), "climbs": len(climbs),
            "functions": len(r.functions), "signatures": signatures(mods), "module_list": sorted(r.modules),
            "climb_list": [f"{a} -> {b}" for a, b in climbs]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("roots", nargs="*", type=Path, default=[Path(__file__).resolve().parents[1]])
    p.add_argument("-v", "--verbose", action="store_true", help="list the modules and the climbs")
    args = p.parse_args(argv)
    rows = [measure(root) for root in args.roots]
    print(f"{'tree':40} {'modules':>8} {'reading':>8} {'climbs':>7} {'functions':>10} {'spec sigs':>10}")
    for r in rows:
        print(f"{r['root'][-40:]:40} {r['modules']:>8} {r['reading']:>8} {r['climbs']:>7} {r['functions']:>10} "
              f"{r['signatures']:>10}")
        if args.verbose:
            print("  modules: " + ", ".join(r["module_list"]))
            print("  climbs: " + "; ".join(r["climb_list"]))
    print(json.dumps([{k: v for k, v in r.items() if k not in ("module_list", "climb_list")} for r in rows]))


if __name__ == "__main__":
    main(sys.argv[1:])
