"""30 JSON schemas of growing complexity for the structured-output tests and the structured and grammar_engines
benchmarks: scalars, enums, bounded numbers, required and optional fields, arrays, nested objects, anyOf, references.

The tiny test model's free text is random, so every free-form string here has a maxLength and every array a
maxItems: the grammar then forces an end within max_tokens whatever the model prefers, and 100% of outputs must
validate. (A schema with an unbounded string is valid too; the model just may not close it within max_tokens, and
that output ends with finish_reason "length" as a valid prefix.)
"""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
_SHORT = {"type": "string", "maxLength": 8}

SCHEMAS: list[dict[str, Any]] = [
    # 1-6: one value
    {"type": "boolean"},
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "string", "maxLength": 6},
    {"enum": ["red", "green", "blue"]},
    {"type": "null"},
    # 7-12: flat objects
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": _SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
     "required": ["city", "zip"]},
    {"type": "object", "properties": {"level": {"enum": ["low", "mid", "high"]},
                                      "score": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["level"]},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 3},
                                      "b": {"type": "boolean"}, "c": {"type": "null"}},
     "required": ["a", "b", "c"]},
    {"type": "object", "properties": {"title": _NAME, "draft": {"type": "boolean"}, "tag": _SHORT},
     "required": ["title"]},
    # 13-18: arrays
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4},
    {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": _SHORT, "maxItems": 3},
    {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                            "maximum": 9}, "maxItems": 5}},
     "required": ["ids"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}}},
     "required": ["points"]},
    # 19-24: nested objects
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": _NAME},
                                               "required": ["name"]}}, "required": ["user"]},
    {"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
                "sku": _SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"]}}},
            "required": ["id", "items"]}},
     "required": ["order"]},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {
        "version": {"type": "integer", "minimum": 1, "maximum": 3},
        "flags": {"type": "object", "properties": {"beta": {"type": "boolean"}}, "required": ["beta"]}},
        "required": ["version", "flags"]}}, "required": ["meta"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "object", "properties": {"d": {"enum": [1, 2, 3]}}, "required": ["d"]}},
        "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"name": _NAME, "address": {"type": "object", "properties": {
        "street": _NAME, "number": {"type": "integer", "minimum": 1, "maximum": 500}, "unit": _SHORT},
        "required": ["street", "number"]}}, "required": ["name", "address"]},
    {"type": "object", "properties": {"matrix": {"type": "object", "properties": {
        "rows": {"type": "integer", "minimum": 1, "maximum": 3}, "cols": {"type": "integer", "minimum": 1,
                                                                          "maximum": 3},
        "cells": {"type": "array", "maxItems": 4, "items": {"type": "integer", "minimum": -9, "maximum": 9}}},
        "required": ["rows", "cols", "cells"]}}, "required": ["matrix"]},
    # 25-30: unions, references, mixed
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    {"type": "object", "properties": {"value": {"anyOf": [_SHORT, {"type": "integer", "minimum": 0,
                                                                   "maximum": 99}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100,
                                                                                    "maximum": 599},
                                      "detail": _SHORT},
     "required": ["status", "code"]},
    {"$defs": {"person": {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 99}},
                          "required": ["name"]}},
     "type": "object", "properties": {"owner": {"$ref": "#/$defs/person"},
                                      "friends": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/person"}}},
     "required": ["owner", "friends"]},
    {"type": "object", "properties": {
        "event": {"enum": ["create", "update", "delete"]},
        "target": {"type": "object", "properties": {"kind": {"enum": ["file", "dir"]}, "path": _NAME},
                   "required": ["kind", "path"]},
        "changes": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "field": _SHORT, "old": {"anyOf": [_SHORT, {"type": "null"}]}, "new": _SHORT},
            "required": ["field", "new"]}},
        "dry_run": {"type": "boolean"}},
     "required": ["event", "target", "changes"]},
    {"type": "object", "properties": {
        "tool": {"const": "search"},
        "query": {"type": "object", "properties": {
            "text": _NAME, "limit": {"type": "integer", "minimum": 1, "maximum": 50},
            "filters": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
                "key": {"enum": ["lang", "year", "author"]}, "value": _SHORT}, "required": ["key", "value"]}}},
            "required": ["text", "limit", "filters"]},
        "options": {"type": "object", "properties": {"safe": {"type": "boolean"},
                                                     "rank": {"enum": ["date", "relevance"]}}}},
     "required": ["tool", "query"]},
]

assert len(SCHEMAS) == 30
