"""Reasoning split out of chat choices (dcpserve/deployments/api/reasoning.py and the chat shaper): vLLM's
deepseek_r1 / qwen3 rules on whole outputs, the same split however the text is cut into deltas (tags split across
them included), and the message / delta fields the chat shaper sends."""

from __future__ import annotations

from typing import Any

import pytest

from dcpserve.deployments.api import protocol
from dcpserve.deployments.api.reasoning import FORMATS, ReasoningStream, reasoning_format, split_reasoning
from dcpserve.deployments.api.responses import ChatShaper
from dcpserve.engine.protocol import RequestDelta

R1, QWEN3 = FORMATS["deepseek_r1"], FORMATS["qwen3"]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("name,text,thinking,expected", [
    ("deepseek_r1", "<think>\nstep 1</think>\n\nThe answer", True, ("\nstep 1", "\n\nThe answer")),
    ("deepseek_r1", "step 1 (the template opened it)</think>answer", True, ("step 1 (the template opened it)",
                                                                             "answer")),
    ("deepseek_r1", "<think>never finished", True, ("never finished", None)),
    ("deepseek_r1", "<think>all thought</think>", True, ("all thought", None)),
    ("deepseek_r1", "a < b, <thin and </thinking> are text", True, ("a < b, <thin and </thinking> are text", None)),
    ("deepseek_r1", "x</think>y</think>z", True, ("x", "y</think>z")),  # only the first end counts
    ("qwen3", "<think>\nhmm\n</think>\n\nHi", True, ("\nhmm\n", "\n\nHi")),
    ("qwen3", "\n\nHi", False, (None, "\n\nHi")),  # enable_thinking false: all content
    ("qwen3", "<think>call it<tool_call>{\"name\": \"f\"}", True, ("call it", "<tool_call>{\"name\": \"f\"}")),
    ("deepseek_r1", "\n\nHi", False, ("\n\nHi", None)),  # R1 ignores enable_thinking, as vLLM's parser
])
def test_whole_outputs_split_as_vllms_parsers(name: str, text: str, thinking: bool,
                                              expected: tuple[str | None, str | None]) -> None:
    fmt = reasoning_format(name)
    assert fmt is not None
    assert split_reasoning(fmt, text, thinking) == expected


def test_unknown_parser_names_the_choices() -> None:
    assert reasoning_format(None) is None
    with pytest.raises(ValueError, match=r"reasoning_parser must be one of \['deepseek_r1', 'qwen3'\]"):
        reasoning_format("granite")


def _streamed(fmt: Any, pieces: list[str], thinking: bool = True) -> tuple[str, str, list[tuple[str, str]]]:
    stream = ReasoningStream(fmt, thinking)
    parts = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts), parts


@pytest.mark.parametrize("text", [
    "<think>\nA < B and </th are text</think>\n\nAnswer <think> stays",
    "no start tag</think>rest",
    "<think>cut off <",
    "<think>x<tool_call>{}</tool_call>",
])
@pytest.mark.parametrize("fmt", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
def test_any_cut_into_deltas_gives_the_whole_outputs_split(fmt: Any, text: str) -> None:
    """Every two-way cut and the one-character-a-delta stream: the same reasoning and content as the whole text,
    so a tag split across deltas is never sent as text of the wrong part."""
    whole_reasoning, whole_content = split_reasoning(fmt, text)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        reasoning, content, _ = _streamed(fmt, pieces)
        assert (reasoning, content or None) == (whole_reasoning, whole_content), pieces


def test_a_split_end_tag_is_held_back_until_it_is_known() -> None:
    reasoning, content, parts = _streamed(R1, ["<think>plan", " done</th", "ink>\n\nHi", " there"])
    assert parts == [("plan", ""), (" done", ""), ("", "\n\nHi"), ("", " there"), ("", "")]
    assert (reasoning, content) == ("plan done", "\n\nHi there")
    # "</th" then something else: the held text was reasoning after all
    assert _streamed(R1, ["a</th", "ought b"])[2][:2] == [("a", ""), ("</thought b", "")]


def chat(**fields: Any) -> protocol.ChatCompletionRequest:
    return protocol.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def delta(text: str, num_output: int, finish: str | None = None) -> RequestDelta:
    return RequestDelta("r", [5], text, finish is not None, finish, 2, num_output)


PIECES = ["<think>\nThe user", " greets.</th", "ink>\n\nHello", "!"]


def test_the_chat_body_carries_reasoning_content_beside_the_content() -> None:
    shaper = ChatShaper(chat(), "m", None, [1, 2], None, R1)
    for i, piece in enumerate(PIECES):
        shaper.add(0, delta(piece, i + 1, "stop" if i == len(PIECES) - 1 else None))
    message = shaper.body()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "\n\nHello!", "reasoning_content": "\nThe user greets.",
                       "reasoning": "\nThe user greets."}
    plain = ChatShaper(chat(), "m", None, [1, 2], None)  # no reasoning parser: the text as it is
    plain.add(0, delta("".join(PIECES), 4, "stop"))
    assert plain.body()["choices"][0]["message"] == {"role": "assistant", "content": "".join(PIECES)}


def test_a_chat_stream_sends_reasoning_deltas_then_content_deltas() -> None:
    shaper = ChatShaper(chat(stream=True), "m", None, [1, 2], None, QWEN3)
    chunks = shaper.first_chunks()
    for i, piece in enumerate(PIECES):
        chunks += shaper.chunks(0, delta(piece, i + 1, "stop" if i == len(PIECES) - 1 else None))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d.get("reasoning_content") for d in deltas[1:]] == ["\nThe user", " greets.", None, None]
    assert [d.get("content") for d in deltas[1:]] == [None, None, "\n\nHello", "!"]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_qwen3_with_thinking_off_streams_only_content() -> None:
    shaper = ChatShaper(chat(stream=True, chat_template_kwargs={"enable_thinking": False}), "m", None, [1], None,
                        QWEN3)
    chunks = shaper.chunks(0, delta("Hello", 1)) + shaper.chunks(0, delta("!", 2, "stop"))
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "Hello"}, {"content": "!"}]


def test_reasoning_comes_before_the_tool_calls_it_leads_to() -> None:
    body = chat(tools=TOOLS, tool_choice="auto")
    plan = body.tool_plan()
    text = '<think>need weather</think>\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    shaper = ChatShaper(body, "m", None, [1], plan, R1)
    shaper.add(0, delta(text, 9, "stop"))
    choice = shaper.body()["choices"][0]
    assert choice["message"]["reasoning_content"] == "need weather"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["weather"]
    assert choice["finish_reason"] == "tool_calls"
    streamed = ChatShaper(chat(tools=TOOLS, tool_choice="auto", stream=True), "m", None, [1], plan, R1)
    chunks = [c for i in range(0, len(text), 7)
              for c in streamed.chunks(0, delta(text[i:i + 7], i + 1, "stop" if i + 7 >= len(text) else None))]
    parts = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(p.get("reasoning_content") or "" for p in parts) == "need weather"
    assert [call["function"]["name"] for p in parts for call in p.get("tool_calls", [])] == ["weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
