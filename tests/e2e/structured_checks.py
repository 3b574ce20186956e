"""Structured outputs and tools through a deployed app, with the official openai client: shared by the native app
(tests/e2e/test_structured_outputs.py, tp=2 x dcp=2) and the vLLM app (tests/e2e/test_vllm_app.py). The tiny
model's free text is random, so every output below is valid only because the constraint made it so."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, cast

import jsonschema
import pytest
from pydantic import BaseModel, Field

from bench.harness.json_schemas import SCHEMAS

MESSAGES: Any = [{"role": "user", "content": "Answer in JSON."}]  # the openai client's message params
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "a city's forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=99)
    member: bool


def check_thirty_schemas(base_url: str, model: str, concurrency: int = 30) -> None:
    """Every one of the 30 schemas, sampled at temperature 1 with a seed, validates; `concurrency` requests at a
    time (an app that queues nothing takes only what its KV holds)."""
    import openai

    gate = asyncio.Semaphore(concurrency)

    async def one(client: openai.AsyncOpenAI, i: int, schema: dict[str, Any]) -> None:
        async with gate:
            response = await client.chat.completions.create(
                model=model, messages=MESSAGES, temperature=1.0, seed=i, max_tokens=300,
                response_format=cast(Any, {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                                  "strict": True}}))
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (i, choice)
        jsonschema.validate(json.loads(choice.message.content or ""), schema)

    async def run() -> None:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300) as client:
            await asyncio.gather(*(one(client, i, s) for i, s in enumerate(SCHEMAS)))

    asyncio.run(run())


def check_constraints_and_tools(api: Any, model: str) -> None:
    """parse() with a pydantic model, regex / choice / json_object, named and required tool calls (whole and
    streamed), and tool_choice auto leaving text alone."""
    parsed = api.chat.completions.parse(model=model, messages=MESSAGES, response_format=Person, max_tokens=200,
                                        temperature=1.0, seed=3)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 99

    regex = api.completions.create(model=model, prompt="id:", max_tokens=30, temperature=1.0, seed=1,
                                   extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", regex.choices[0].text)
    choice = api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=2,
                                         extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.choices[0].message.content in ("yes", "no", "maybe")
    obj = api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=200, temperature=0,
                                      response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)

    named = api.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=100, seed=4,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and named.choices[0].message.content is None
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)

    required = api.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=1.0, seed=5, parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "get_time")
    if calls[0].function.name == "get_weather":
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)

    stream = api.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=100, seed=4,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         stream=True)
    arguments, names, finish = [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            assert call.index == 0
            if call.function.name:
                names.append(call.function.name)
            arguments.append(call.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert "".join(arguments) == named.choices[0].message.tool_calls[0].function.arguments  # same seed

    auto = api.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length")  # random text: no call in the built-in format


def check_bad_constraints_are_400s(api: Any, model: str) -> None:
    """A schema, regex or grammar the engine refuses, an unknown tool, a spec past the size limit, two
    constraints at once: 400s naming the field, before admission."""
    import openai

    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
         "response_format", "objectx"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs", "unclosed group"),
        ({"extra_body": {"guided_grammar": "start: missing_rule"}}, "guided_grammar", "cannot be compiled"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "not among the tools"),
        ({"extra_body": {"guided_regex": "a" * 70000}}, "guided_regex", "at most 65536"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "x"}}, "guided_regex",
         "send only one"),
    ]
    for fields, param, match in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, **fields)
        body = caught.value.body
        assert isinstance(body, dict) and body.get("param") == param, body
        assert match in body.get("message", ""), body
