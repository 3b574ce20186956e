"""The request fields that constrain the output (dcpserve/deployments/api/structured.py) and the tools
(dcpserve/deployments/api/tool_calls.py): which constraint each field makes, 400s that name the field, tool calls read
back (dcpserve/deployments/api/tool_parser.py) whole and as OpenAI's stream deltas."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dcpserve.deployments.api import protocol
from dcpserve.deployments.api.responses import ChatShaper
from dcpserve.deployments.api.structured import FieldError
from dcpserve.deployments.api.tool_calls import CALL_CLOSE, CALL_OPEN, builtin_messages
from dcpserve.deployments.api.tool_parser import ToolStream, parse_builtin
from dcpserve.engine.protocol import RequestDelta
from dcpserve.engine.structured_output import StructuredOutput

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "the weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}},
]


def chat(**fields: Any) -> protocol.ChatCompletionRequest:
    return protocol.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def completion(**fields: Any) -> protocol.CompletionRequest:
    return protocol.CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


@pytest.mark.parametrize("fields,expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput.json_object()),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutput.json(SCHEMA, strict=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     StructuredOutput.json(SCHEMA)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput.regex("[a-z]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput.choice(["a", "b"])),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput.json(SCHEMA)),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput.json_object()),
    ({"guided_json": SCHEMA}, StructuredOutput.json(SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput.json(SCHEMA)),
    ({"guided_regex": "x+", "guided_decoding_backend": "xgrammar"}, StructuredOutput.regex("x+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutput.choice(["yes", "no"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutput.grammar('root ::= "a"')),
])
def test_each_field_makes_its_constraint(fields: dict[str, Any], expected: StructuredOutput | None) -> None:
    for request in (completion(**fields), chat(**fields)):
        constraint, _ = request.constraint()
        assert constraint == expected
        assert request.sampling_params(context_left=10).structured_output == expected


@pytest.mark.parametrize("fields,param,match", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "x"}, "guided_regex",
     "response_format and guided_regex each constrain the output"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "give exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag is not supported"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown keys"),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "grammar engine is llguidance"),
    ({"guided_regex": "a" * 70000}, "guided_regex", "at most 65536"),
])
def test_bad_constraints_name_their_field(fields: dict[str, Any], param: str, match: str) -> None:
    with pytest.raises(FieldError, match=match) as caught:
        chat(**fields).constraint()
    assert caught.value.param == param


def test_tool_choice_makes_the_constraint() -> None:
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})
    assert named.constraint() == (StructuredOutput.json(SCHEMA), "tool_choice")
    required, _ = chat(tools=TOOLS, tool_choice="required").constraint()
    schema = json.loads(required.spec)  # type: ignore[union-attr]
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["weather", "time"]
    single, _ = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).constraint()
    assert json.loads(single.spec)["maxItems"] == 1  # type: ignore[union-attr]
    for choice in ("auto", "none", None):
        assert chat(tools=TOOLS, tool_choice=choice).constraint() == (None, None)


@pytest.mark.parametrize("fields,param,match", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "names function 'nope', which is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto', 'required'"),
    ({"tools": [{"type": "function"}]}, "tools", "function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "pattern"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "name a function twice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format and tool_choice each constrain"),
])
def test_bad_tools_name_their_field(fields: dict[str, Any], param: str, match: str) -> None:
    with pytest.raises(FieldError, match=match) as caught:
        chat(**fields).constraint()
    assert caught.value.param == param


def finished(body: protocol.ChatCompletionRequest, text: str, finish: str) -> tuple[dict[str, Any], str | None]:
    """The message and finish_reason of a JSON answer whose one choice generated `text`."""
    shaper = ChatShaper(body, "m", None, [1], body.tool_plan())
    shaper.add(0, RequestDelta("r", [2], text, True, finish, 1, 1))
    [choice] = shaper.body()["choices"]
    return choice["message"], choice["finish_reason"]


def test_finished_outputs_become_tool_calls() -> None:
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})
    message, finish = finished(named, '{"city":"Oslo"}', "stop")
    assert message["content"] is None and finish == "tool_calls"
    assert message["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city":"Oslo"}'}
    required = chat(tools=TOOLS, tool_choice="required")
    message, finish = finished(required, '[{"name":"time","arguments":{}},{"name":"weather","arguments":'
                                         '{"city":"Rome"}}]', "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["time", "weather"]
    assert json.loads(message["tool_calls"][1]["function"]["arguments"]) == {"city": "Rome"}
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    cut, finish = finished(required, '[{"name":"ti', "length")
    assert cut == {"role": "assistant", "content": '[{"name":"ti'} and finish == "length"


def test_auto_reads_builtin_calls_and_keeps_the_rest_as_content() -> None:
    text = ('Let me check.' + CALL_OPEN + '{"name": "weather", "arguments": {"city": "Oslo"}}' + CALL_CLOSE
            + CALL_OPEN + '{"name": "unknown", "arguments": {}}' + CALL_CLOSE)
    content, calls = parse_builtin(text, {"weather", "time"})
    assert [c["function"]["name"] for c in calls] == ["weather"]
    assert content == 'Let me check.' + CALL_OPEN + '{"name": "unknown", "arguments": {}}' + CALL_CLOSE
    assert parse_builtin("plain text", {"weather"}) == ("plain text", [])


def _replay(stream: ToolStream, pieces: list[str], finish: str) -> list[dict[str, Any]]:
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    return deltas + stream.finish(finish)


def test_stream_deltas_have_openais_shape() -> None:
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}}).tool_plan()
    assert named is not None
    deltas = _replay(ToolStream(named), ['{"ci', 'ty":"Os', 'lo"}'], "stop")
    first = deltas[0]["tool_calls"][0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"]["name"] == "weather"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city":"Oslo"}'
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:])
    auto = chat(tools=TOOLS).tool_plan()
    assert auto is not None
    stream = ToolStream(auto)
    deltas = _replay(stream, ["Hi <", "tool", "_call>", '{"name": "time", "arguments": {}}', CALL_CLOSE], "stop")
    assert deltas[0] == {"content": "Hi "}  # "<" held back: it could start a call
    assert deltas[-1]["tool_calls"][0]["function"] == {"name": "time", "arguments": "{}"}
    assert stream.num_calls == 1
    plain = ToolStream(auto)
    assert "".join(d["content"] for d in _replay(plain, ["a <b", "> c<"], "stop")) == "a <b> c<"
    assert plain.num_calls == 0


def test_builtin_messages_show_tools_and_past_calls() -> None:
    request = chat(tools=TOOLS, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    messages = builtin_messages(request.chat_messages(), request.tool_plan())
    assert messages[0]["role"] == "system" and '"name": "weather"' in messages[0]["content"]
    assert messages[2]["content"] == CALL_OPEN + '{"name": "weather", "arguments": {"city": "Oslo"}}' + CALL_CLOSE
    assert messages[3] == {"role": "tool", "content": "sunny"}
    with pytest.raises(ValueError, match="a user message needs content"):
        chat(messages=[{"role": "user", "content": None}])
