"""The strict-by-default rewrite of a JSON schema's objects (additionalProperties: false where a schema says nothing),
for structured outputs (dcpserve/engine/structured_output.py) on both backends.

A model that may add properties to an object can add them forever, so vLLM (and OpenAI's strict mode) close objects
by default. Closing an object is only safe where its instances need nothing beyond its own `properties`: a schema
that requires a property it does not list, or that intersects the object with other schemas (allOf, $ref, ...),
would become unsatisfiable, and the grammar engine would refuse a request the client wrote correctly.
"""

from __future__ import annotations

from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalItems", "prefixItems", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
                  "contains", "unevaluatedItems", "propertyNames")
# Keywords by which an object schema composes others: its instances must satisfy those too, so "no property beyond
# my own `properties`" could contradict them. Such an object, and everything under it, is left as sent.
_COMPOSING = ("allOf", "anyOf", "oneOf", "$ref", "patternProperties", "dependentSchemas", "dependencies", "if",
              "then", "else", "not", "unevaluatedProperties")
# Keywords that make a schema one about objects (an anyOf beside them is intersected with them).
_OBJECT_KEYWORDS = ("properties", "required", "patternProperties", "additionalProperties", "minProperties",
                    "maxProperties", "propertyNames", "dependentRequired")


def no_additional_properties(schema: Any, strict: bool = False) -> Any:
    """The schema with additionalProperties: false on the object schemas that do not set it (vLLM's default with
    llguidance and xgrammar: a model that may add properties can add them forever), without ever turning a
    satisfiable schema into an unsatisfiable one. Left as sent:

    - an object that requires a property its own `properties` does not list (false would forbid it);
    - an object that composes others (allOf / anyOf / oneOf, $ref, patternProperties, dependentSchemas, if / then /
      else, not, unevaluatedProperties), with everything under it: the subschemas it is intersected with;
    - the $defs / definitions that a composing $ref (one beside other keywords, or under a composing object) names.

    An anyOf / oneOf of alternatives under a schema that says nothing of objects is no intersection: each branch is
    rewritten on its own. strict=True (OpenAI's response_format strict: true): every object schema that does not
    set additionalProperties gets false, as OpenAI's strict mode has it."""
    if strict:
        return _strict(schema)
    left_alone = _composed_definitions(schema)
    return _rewrite(schema, left_alone, "#")


def _strict(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_VALUES:
        if key in out:
            out[key] = _strict(out[key])
    if _is_object(out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _is_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema


def _composes(schema: dict[str, Any]) -> bool:
    """Whether the schema's instances must also satisfy other schemas it names or holds (beyond its properties)."""
    if any(key in schema for key in _COMPOSING if key not in ("anyOf", "oneOf")):
        return True
    return any(key in schema for key in ("anyOf", "oneOf")) and (
        _is_object(schema) or any(key in schema for key in _OBJECT_KEYWORDS))


def _rewrite(schema: Any, left_alone: set[str], pointer: str) -> Any:
    if isinstance(schema, list):
        return [_rewrite(item, left_alone, f"{pointer}/{i}") for i, item in enumerate(schema)]
    if not isinstance(schema, dict) or _composes(schema):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: sub if f"#/{key}/{name}" in left_alone and pointer == "#"
                        else _rewrite(sub, left_alone, f"{pointer}/{key}/{name}")
                        for name, sub in out[key].items()}
    for key in _SCHEMA_VALUES:
        if key in out:
            out[key] = _rewrite(out[key], left_alone, f"{pointer}/{key}")
    if _is_object(out) and "additionalProperties" not in out and _needs_only_listed(out):
        out["additionalProperties"] = False
    return out


def _needs_only_listed(schema: dict[str, Any]) -> bool:
    """Whether an instance with no property beyond the schema's own `properties` can satisfy it: every required
    (and dependentRequired) name listed, minProperties no more than the listed ones."""
    properties = schema.get("properties")
    listed: dict[str, Any] = properties if isinstance(properties, dict) else {}
    names = list(schema.get("required") or []) if isinstance(schema.get("required"), list) else []
    dependent = schema.get("dependentRequired")
    if isinstance(dependent, dict):
        names += [name for group in dependent.values() if isinstance(group, list) for name in group]
    least = schema.get("minProperties", 0)
    return all(name in listed for name in names) and (not isinstance(least, int) or least <= len(listed))


def _composed_definitions(schema: Any) -> set[str]:
    """The "#/$defs/x" / "#/definitions/x" pointers that a $ref names where it is composed with other keywords, or
    from inside a composing object: the rewrite leaves those definitions as sent."""
    found: set[str] = set()

    def walk(node: Any, composed: bool) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item, composed)
            return
        if not isinstance(node, dict):
            return
        here = composed or _composes(node)
        ref = node.get("$ref")
        if isinstance(ref, str) and (here and (composed or len(node) > 1)):
            found.add(ref)
        for value in node.values():
            if isinstance(value, (dict, list)):
                walk(value, here)

    walk(schema, False)
    # A left-alone definition's own $refs are composed too (its instances are intersected with them).
    defs = {f"#/{key}/{name}": sub for key in ("$defs", "definitions") if isinstance(schema, dict)
            and isinstance(schema.get(key), dict) for name, sub in schema[key].items()}
    pending = list(found)
    while pending:
        target = defs.get(pending.pop())
        for ref in _refs(target):
            if ref not in found:
                found.add(ref)
                pending.append(ref)
    return found


def _refs(node: Any) -> list[str]:
    if isinstance(node, list):
        return [ref for item in node for ref in _refs(item)]
    if not isinstance(node, dict):
        return []
    own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
    return own + [ref for value in node.values() if isinstance(value, (dict, list)) for ref in _refs(value)]
