"""The request fields that constrain what is generated, turned into one engine constraint (StructuredOutput).

Sources, at most one per request (two are a 400 naming both): OpenAI's `response_format` (json_object, json_schema
with or without strict), vLLM's `structured_outputs` ({json | regex | choice | grammar | json_object}) and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and the constraint a chat request's
`tool_choice` implies (dcpserve/deployments/api/tool_calls.py). A constraint the grammar engine refuses is a 400 naming
the field, raised before admission (`check_constraint`, in the ingress, on the same compiler and vocabulary as the
engine's).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dcpserve.engine.structured_output import GrammarError, Grammars, StructuredOutput

# vLLM's structured_outputs keys this server implements, and the ones it refuses (not implemented here).
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
UNSUPPORTED_STRUCTURED_OUTPUT_KEYS = ("structural_tag", "whitespace_pattern")
# Accepted as vLLM accepts them: the grammar engine is llguidance either way (dcpserve/engine/structured_output.py).
# "xgrammar" is accepted too, as the name clients send by default, and means the same constraint.
GRAMMAR_BACKENDS = (None, "auto", "guidance", "llguidance", "xgrammar")


class FieldError(ValueError):
    """A 400 that names the request field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's {name, schema, strict, description}."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    json_schema: JsonSchemaFormat | None = None


def response_format_constraint(value: dict[str, Any]) -> StructuredOutput | None:
    """OpenAI's response_format: text (none), json_object, json_schema. strict or not, the grammar enforces the
    schema: an output always validates against it; strict: true also gives every object that does not say otherwise
    additionalProperties: false (OpenAI's strict mode; without it, only where that leaves the schema satisfiable:
    dcpserve.engine.structured_output.no_additional_properties)."""
    try:
        fmt = ResponseFormat.model_validate(value)
    except ValueError as err:
        raise FieldError("response_format", f"response_format is malformed: {err}") from None
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput.json_object()
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise FieldError("response_format", "response_format type json_schema needs json_schema: {name, schema}")
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {"type": "object"}
        strict = bool(fmt.json_schema.strict)
        return _build("response_format", lambda value: StructuredOutput.json(value, strict=strict), schema)
    raise FieldError("response_format", f"response_format type must be text, json_object or json_schema, got "
                     f"{fmt.type!r}")


def structured_outputs_constraint(value: dict[str, Any]) -> StructuredOutput | None:
    """vLLM's structured_outputs object: exactly one of json, regex, choice, grammar, json_object."""
    refused = [k for k in UNSUPPORTED_STRUCTURED_OUTPUT_KEYS if value.get(k) is not None]
    if refused:
        raise FieldError("structured_outputs", f"structured_outputs.{refused[0]} is not supported; use one of "
                         f"{list(STRUCTURED_OUTPUT_KEYS)}")
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUT_KEYS) - set(UNSUPPORTED_STRUCTURED_OUTPUT_KEYS)
                     - {"disable_any_whitespace", "disable_additional_properties", "disable_fallback"})
    if unknown:
        raise FieldError("structured_outputs", f"structured_outputs has unknown keys {unknown}; it takes one of "
                         f"{list(STRUCTURED_OUTPUT_KEYS)}")
    given = [k for k in STRUCTURED_OUTPUT_KEYS if value.get(k) not in (None, False)]
    if len(given) > 1:
        raise FieldError("structured_outputs", f"structured_outputs sets {given}: give exactly one constraint")
    if not given:
        return None
    return _guided("structured_outputs", given[0], value[given[0]])


def _guided(param: str, kind: str, value: Any) -> StructuredOutput:
    if kind == "json":
        return _build(param, StructuredOutput.json, value)
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind == "choice":
        return _build(param, StructuredOutput.choice, value)
    if not isinstance(value, str):
        raise FieldError(param, f"{param} ({kind}) must be a string, got {type(value).__name__}")
    return _build(param, StructuredOutput.regex if kind == "regex" else StructuredOutput.grammar, value)


def _build(param: str, make: Any, value: Any) -> StructuredOutput:
    try:
        constraint: StructuredOutput = make(value)
    except ValueError as err:
        raise FieldError(param, f"{param}: {err}") from None
    return constraint


def request_constraint(fields: dict[str, Any], tool_constraint: StructuredOutput | None = None
                       ) -> tuple[StructuredOutput | None, str | None]:
    """The one constraint a request's fields ask for, and the field it came from (None, None: unconstrained).

    fields: response_format, structured_outputs, guided_json, guided_regex, guided_choice, guided_grammar,
    guided_decoding_backend, as sent (None when absent); tool_constraint: what tool_choice required / named implies
    (its field is tool_choice)."""
    backend = fields.get("guided_decoding_backend")
    if backend not in GRAMMAR_BACKENDS:
        raise FieldError("guided_decoding_backend", f"guided_decoding_backend {backend!r} is not available: this "
                         f"server's grammar engine is llguidance (send 'guidance', 'auto' or omit it)")
    found: list[tuple[str, StructuredOutput]] = []
    if fields.get("response_format") is not None:
        constraint = response_format_constraint(fields["response_format"])
        if constraint is not None:
            found.append(("response_format", constraint))
    if fields.get("structured_outputs") is not None:
        constraint = structured_outputs_constraint(fields["structured_outputs"])
        if constraint is not None:
            found.append(("structured_outputs", constraint))
    for kind in ("json", "regex", "choice", "grammar"):
        value = fields.get(f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", _guided(f"guided_{kind}", kind, value)))
    if tool_constraint is not None:
        found.append(("tool_choice", tool_constraint))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise FieldError(names[1], f"{' and '.join(names)} each constrain the output: send only one of them")
    return (found[0][1], found[0][0]) if found else (None, None)


def check_constraint(grammars: Grammars, constraint: StructuredOutput, param: str) -> None:
    """Compiles the constraint (cached): FieldError naming `param` and the grammar engine's reason when it fails."""
    try:
        grammars.compile(constraint)
    except GrammarError as err:
        raise FieldError(param, f"{param}: {err}") from None
