"""The strict-by-default rewrite of JSON schemas (no_additional_properties): a plain object gets additionalProperties:
false, but a schema it could make unsatisfiable is compiled as sent (required properties declared in allOf, through a
$ref, by patternProperties, or not listed at all); OpenAI's strict: true rewrites every object as OpenAI does. Checked
on llguidance itself: the grammar compiled for each constraint accepts an instance of the original schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.structured_output import (
    GrammarError,
    Grammars,
    StructuredOutput,
    allowed_tokens,
    no_additional_properties,
)
from dcpserve.engine.tokenizer import Tokenizer, load_tokenizer

INTEGER = {"type": "integer"}
# (schema, an instance that satisfies it, written as the grammar's compact JSON)
COMPOSED: dict[str, tuple[dict[str, Any], str]] = {
    "required in allOf": ({"type": "object", "allOf": [
        {"properties": {"a": INTEGER}, "required": ["a"]},
        {"type": "object", "properties": {"b": INTEGER}, "required": ["b"]}]}, '{"a":1,"b":2}'),
    "required through $ref": ({
        "$defs": {"base": {"type": "object", "properties": {"a": INTEGER}, "required": ["a"]}},
        "$ref": "#/$defs/base", "properties": {"b": INTEGER}, "required": ["a", "b"]}, '{"a":1,"b":2}'),
    "required in patternProperties": ({"type": "object", "patternProperties": {"^x_": INTEGER},
                                       "required": ["x_1"]}, '{"x_1":3}'),
    "required, not listed": ({"type": "object", "properties": {"a": INTEGER}, "required": ["a", "z"]},
                             '{"a":1,"z":2}'),
    "anyOf beside properties": ({"type": "object", "properties": {"kind": {"const": "x"}}, "required": ["kind"],
                                 "anyOf": [{"properties": {"kind": {}, "v": INTEGER}, "required": ["v"]}]},
                                '{"kind":"x","v":1}'),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    loaded = load_tokenizer(write_tiny_model(tmp_path_factory.mktemp("schemas") / "model"))
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> Grammars:
    return Grammars.for_tokenizer(tokenizer, 512)


def accepts(grammars: Grammars, tokenizer: Tokenizer, constraint: StructuredOutput, text: str) -> bool:
    """Whether the constraint's grammar takes `text`, token by token, and may then end."""
    state = grammars.start(constraint)
    if not all(state.accept(token) for token in tokenizer.encode(text, add_special_tokens=False)):
        return False
    return bool(allowed_tokens(state.allowed(), 512)[sorted(tokenizer.eos_token_ids)].any())


@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_a_schema_the_rewrite_could_break_is_compiled_as_sent(grammars: Grammars, tokenizer: Tokenizer,
                                                              name: str) -> None:
    schema, instance = COMPOSED[name]
    jsonschema.validate(json.loads(instance), schema)  # the instance is one of the schema's
    assert no_additional_properties(schema) == schema
    assert StructuredOutput.json(schema).json_schema() == schema
    assert accepts(grammars, tokenizer, StructuredOutput.json(schema), instance)


@pytest.mark.parametrize("name", ["required in allOf", "required through $ref", "required, not listed"])
def test_strict_true_applies_openais_rule_as_it_is(grammars: Grammars, name: str) -> None:
    """strict: every object gets additionalProperties: false, which these schemas cannot survive (OpenAI refuses
    them in strict mode too): the rewrite above is what keeps them from being refused."""
    schema, _ = COMPOSED[name]
    with pytest.raises(GrammarError, match="Unsatisfiable schema"):
        grammars.compile(StructuredOutput.json(schema, strict=True))


def test_a_plain_object_still_gets_the_rewrite(grammars: Grammars, tokenizer: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"a": INTEGER, "inner": {"type": "object", "properties": {
        "b": INTEGER}}}, "required": ["a"]}
    rewritten = no_additional_properties(schema)
    assert rewritten["additionalProperties"] is False and rewritten["properties"]["inner"]["additionalProperties"] \
        is False
    constraint = StructuredOutput.json(schema)
    assert accepts(grammars, tokenizer, constraint, '{"a":1}')
    assert not accepts(grammars, tokenizer, constraint, '{"a":1,"q":2}')  # an extra property: refused
    assert not accepts(grammars, tokenizer, constraint, '{"a":1,"inner":{"b":1,"q":2}}')


def test_only_what_could_break_is_left_alone() -> None:
    """Inside an object left as sent (an unlisted required name), its plain properties are still rewritten; a top
    anyOf of alternatives rewrites each; a $defs entry named by a bare $ref is rewritten, one named by a composing
    $ref is not."""
    unlisted: dict[str, Any] = {"type": "object", "required": ["z"], "properties": {"p": {"type": "object",
                                                                                        "properties": {}}}}
    out = no_additional_properties(unlisted)
    assert "additionalProperties" not in out and out["properties"]["p"]["additionalProperties"] is False
    alternatives = {"anyOf": [{"type": "object", "properties": {"a": INTEGER}}, {"type": "string"}]}
    assert no_additional_properties(alternatives)["anyOf"][0]["additionalProperties"] is False
    composing_ref = {"$ref": "#/$defs/composed", "properties": {"extra": INTEGER}}
    defs: dict[str, Any] = {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/bare"}, "y": composing_ref},
        "$defs": {"bare": {"type": "object", "properties": {}},
                  "composed": {"type": "object", "properties": {"c": INTEGER}}}}
    out = no_additional_properties(defs)
    assert out["$defs"]["bare"]["additionalProperties"] is False
    assert out["$defs"]["composed"] == defs["$defs"]["composed"]
    assert out["additionalProperties"] is False
