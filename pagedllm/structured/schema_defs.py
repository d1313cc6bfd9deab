"""Several JSON schemas placed inside one, their definitions kept working.

A schema's `$ref`s are JSON pointers from its document's root ("#/$defs/Point"). A tool's
parameters schema nested in the schema of a call ("required" tool choice: an array of calls,
each with its tool's parameters under "parameters") is no longer at the root, so its refs would
point at nothing. `nest` moves its definitions ($defs and the older `definitions`) to the outer
schema's root $defs and rewrites its refs to match: a definition another nested schema defines
differently gets a name of its own, and a ref to the nested schema's own root ("#", recursion)
points at a copy of it kept among the definitions.
"""

from __future__ import annotations

import copy
from typing import Any

_DEF_KEYWORDS = ("$defs", "definitions")


class NestedSchemas:
    """The root definitions of one outer schema, gathered as nested schemas are placed in it."""

    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}

    def nest(self, schema: dict[str, Any], owner: str) -> dict[str, Any]:
        """schema (not changed) rewritten to sit anywhere inside the outer schema; owner names
        it in the definitions it adds (a tool's name)."""
        schema = copy.deepcopy(schema)
        own_defs = {(keyword, name): definition for keyword in _DEF_KEYWORDS
                    for name, definition in (schema.pop(keyword, None) or {}).items()}
        if not own_defs and not _refs_root(schema):
            return schema
        renamed = {key: self._free_name(key[1], owner, definition) for key, definition in own_defs.items()}
        root_name = self._free_name("parameters", owner, None) if _refs_root(schema, *own_defs.values()) \
            else None

        def rewrite(ref: str) -> str:
            for (keyword, name), new in renamed.items():
                prefix = f"#/{keyword}/{_pointer_escape(name)}"
                if ref == prefix or ref.startswith(prefix + "/"):
                    return f"#/$defs/{_pointer_escape(new)}" + ref[len(prefix):]
            if root_name is not None and (ref == "#" or ref.startswith("#/")):
                return f"#/$defs/{_pointer_escape(root_name)}" + ref[1:]
            return ref

        for key, new in renamed.items():
            self.defs[new] = _with_refs(own_defs[key], rewrite)
        schema = _with_refs(schema, rewrite)
        if root_name is not None:
            self.defs[root_name] = schema
        return schema

    def _free_name(self, name: str, owner: str, definition: Any) -> str:
        """name, unless the root holds a different definition by it: then a name of owner's."""
        if name not in self.defs or (definition is not None and self.defs[name] == definition):
            return name
        candidate, i = f"{owner}.{name}", 2
        while candidate in self.defs:
            candidate, i = f"{owner}.{name}.{i}", i + 1
        return candidate


def _refs_root(*schemas: Any) -> bool:
    """Whether any $ref in schemas points into its own document outside the definitions."""
    found = []
    for schema in schemas:
        _with_refs(schema, lambda ref: found.append(ref) or ref)
    return any((ref == "#" or ref.startswith("#/")) and not ref.startswith(("#/$defs/", "#/definitions/"))
               for ref in found)


def _with_refs(node: Any, rewrite) -> Any:
    """node with every "$ref" string passed through rewrite (a new structure)."""
    if isinstance(node, dict):
        return {key: rewrite(value) if key == "$ref" and isinstance(value, str)
                else _with_refs(value, rewrite) for key, value in node.items()}
    if isinstance(node, list):
        return [_with_refs(item, rewrite) for item in node]
    return node


def _pointer_escape(name: str) -> str:
    """A name as one JSON pointer step (RFC 6901: ~ and / escaped)."""
    return name.replace("~", "~0").replace("/", "~1")
