"""The YAML a spec is read from: `load_yaml` refuses a key given twice in one mapping and a document whose aliases
expand past MAX_YAML_NODES nodes (an alias bomb) before anything is built from it."""

from __future__ import annotations

from typing import Any

import yaml

from factory.config.errors import _clip


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping names a key twice (PyYAML would silently keep the last)."""

    def __init__(self, key: Any, line: int, first: int):
        self.key, self.line, self.first = key, line, first
        super().__init__(f"duplicate key {_clip(key)} at line {line} (first at line {first})")


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping. Merge keys (`<<: *base`) may still be
    overridden: only a mapping's own keys are compared."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not None:
                raise DuplicateKeyError(key, key_node.start_mark.line + 1, first)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


# The most nodes a spec document may hold once its aliases are expanded. A spec is a few hundred nodes; an alias
# bomb (each level a list of 9 aliases to the one before) is 9**levels, and pydantic walks the expanded tree.
MAX_YAML_NODES = 100_000


class YAMLBombError(yaml.YAMLError):
    """A YAML document whose aliases expand past MAX_YAML_NODES nodes, or refer to themselves."""


def _expanded_nodes(root: yaml.Node) -> int:
    """How many nodes `root` holds with every alias expanded, counted without expanding (an anchored node's size is
    computed once); YAMLBombError past MAX_YAML_NODES or on an alias inside the node it names."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise YAMLBombError(f"a recursive alias at line {node.start_mark.line + 1} (an anchor used inside "
                                f"itself)")
        open_.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > MAX_YAML_NODES:
                raise YAMLBombError(f"the document expands to more than {MAX_YAML_NODES} nodes through its aliases "
                                    f"(*name); a spec needs far fewer: write the repeated parts out or use fewer "
                                    f"aliases")
        open_.discard(key)
        sizes[key] = total
        return total

    return size(root)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, but a key given twice in a mapping raises DuplicateKeyError, and a document whose aliases
    expand past MAX_YAML_NODES nodes (an alias bomb) or recurse raises YAMLBombError (both YAMLErrors), before
    anything is built from it."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()  # composed: aliases are shared nodes here, not yet copies
        if node is None:
            return None
        _expanded_nodes(node)
        return loader.construct_document(node)
    except RecursionError:  # composing and constructing recurse once per nesting level
        raise YAMLBombError("the document nests too deeply (thousands of levels); a spec needs a handful") from None
    finally:
        loader.dispose()
