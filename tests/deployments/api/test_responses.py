"""The response shapers (dcpserve/deployments/api/responses.py) without a server: the JSON bodies and every SSE chunk
of both endpoints (role chunks, text and logprobs deltas, echo, scoring, tool-call deltas, finish reasons, usage and
continuous usage, the error event), best_of's pick and its indexes."""

from __future__ import annotations

from typing import Any

import pytest

from dcpserve.deployments.api import protocol
from dcpserve.deployments.api.logprobs import chat_logprobs
from dcpserve.deployments.api.responses import ChatShaper, CompletionShaper, ResponseShaper, finish_reason
from dcpserve.deployments.messages import ApiError
from dcpserve.engine.protocol import RequestDelta, TokenLogprob

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def completion(**fields: Any) -> protocol.CompletionRequest:
    return protocol.CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields: Any) -> protocol.ChatCompletionRequest:
    return protocol.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def delta(ids: list[int], text: str, num_output: int, finish: str | None = None, logprob: float | None = None,
          prompt_logprobs: list[TokenLogprob | None] | None = None) -> RequestDelta:
    """A delta of `ids`; with `logprob`, each token's logprob is that, with token 0 as its one alternative."""
    logprobs = [TokenLogprob(t, logprob, 1, ((t, logprob), (0, -9.0))) for t in ids] if logprob is not None else None
    return RequestDelta("r", ids, text, finish is not None, finish, 2, num_output, logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs)


def stream(shaper: ResponseShaper, deltas: list[tuple[int, RequestDelta]]) -> list[dict[str, Any]]:
    """Every chunk of a stream of (choice, delta)s, as the ingress sends them."""
    chunks = shaper.first_chunks()
    for k, d in deltas:
        chunks += shaper.chunks(k, d)
    return chunks + shaper.last_chunks()


def choices(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for chunk in chunks for c in chunk["choices"]]


PROMPT_LOGPROBS = [None, TokenLogprob(4, -1.5, 2, ((7, -0.5), (4, -1.5)))]


@pytest.mark.parametrize("reason,num_calls,expected", [
    (None, 0, None), ("stop", 0, "stop"), ("abort", 0, "stop"), ("length", 0, "length"), ("length", 2, "length"),
    ("stop", 1, "tool_calls"),
])
def test_finish_reasons_in_openais_words(reason: str | None, num_calls: int, expected: str | None) -> None:
    assert finish_reason(reason, num_calls) == expected


def test_a_completion_body_has_openais_envelope_and_usage() -> None:
    shaper = CompletionShaper(completion(n=2), "m", None, [[3, 4, 5]], [])
    shaper.add(0, delta([8], "a", 1))
    shaper.add(1, delta([9, 9], "bc", 2, "abort"))
    shaper.add(0, delta([8], "b", 2, "stop"))
    body = shaper.body()
    assert body["id"] == shaper.request_id and shaper.request_id.startswith("cmpl-")
    assert (body["object"], body["model"], type(body["created"])) == ("text_completion", "m", int)
    assert body["choices"] == [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": "stop"},
                               {"index": 1, "text": "bc", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_best_of_keeps_the_n_most_likely_per_prompt_and_indexes_them_i_times_n_plus_j() -> None:
    shaper = CompletionShaper(completion(prompt=["a", "b"], n=2, best_of=3), "m", None, [[1], [2, 3]], [])
    for k, logprob in enumerate([-3.0, -1.0, -2.0, -0.5, -4.0, -0.1]):
        shaper.add(k, delta([5 + k], f"t{k}", 1, "length", logprob))
    body = shaper.body()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "t1"), (1, "t2"), (2, "t5"), (3, "t3")]
    assert all(c["logprobs"] is None for c in body["choices"])  # best_of asked the engine for them, not the client
    # Prompt tokens once per prompt; every sequence generated counts, the ones best_of dropped too.
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_echo_with_logprobs_puts_the_scored_prompt_first() -> None:
    shaper = CompletionShaper(completion(prompt=[3, 4], echo=True, max_tokens=0, logprobs=1), "m", None, [[3, 4]],
                              ["ab"])
    shaper.add(0, delta([5], "xy", 1, "length", -0.25, PROMPT_LOGPROBS))
    body = shaper.body()
    [out] = body["choices"]
    assert out["text"] == "ab" and out["finish_reason"] == "length"  # scoring only: nothing generated shown
    assert out["logprobs"] == {
        "tokens": ["token_id:3", "token_id:4"], "token_logprobs": [None, -1.5],
        "top_logprobs": [None, {"token_id:7": -0.5}], "text_offset": [0, 10],
    }
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}


def test_echo_without_scoring_shows_prompt_then_text_and_vllms_prompt_logprobs() -> None:
    body = completion(prompt=[3, 4], echo=True, logprobs=0, prompt_logprobs=1, max_tokens=1)
    shaper = CompletionShaper(body, "m", None, [[3, 4]], ["ab"])
    shaper.add(0, delta([5], "c", 1, "stop", -0.25, PROMPT_LOGPROBS))
    [out] = shaper.body()["choices"]
    assert out["text"] == "abc"
    assert out["logprobs"]["tokens"] == ["token_id:3", "token_id:4", "token_id:5"]
    assert out["logprobs"]["top_logprobs"] == [None, {}, {}]  # logprobs=0: the sampled token only
    assert out["prompt_logprobs"] == [None, {
        "7": {"logprob": -0.5, "rank": 1, "decoded_token": "token_id:7"},
        "4": {"logprob": -1.5, "rank": 2, "decoded_token": "token_id:4"}}]


def test_a_completion_stream_sends_echo_first_then_each_delta_with_its_own_offsets() -> None:
    body = completion(prompt=[3, 4], echo=True, logprobs=1, max_tokens=4, stream=True,
                      stream_options={"include_usage": True})
    shaper = CompletionShaper(body, "m", None, [[3, 4]], ["ab"])
    chunks = stream(shaper, [(0, delta([5], "x", 1, logprob=-0.5, prompt_logprobs=PROMPT_LOGPROBS)),
                             (0, delta([], "", 1)),  # nothing new: no chunk
                             (0, delta([6], "y", 2, "length", -0.75))])
    assert all(c["id"] == shaper.request_id and c["object"] == "text_completion" for c in chunks)
    echo, first, last = choices(chunks)
    assert (echo["text"], echo["finish_reason"], echo["logprobs"]["token_logprobs"]) == ("ab", None, [None, -1.5])
    assert (first["text"], first["logprobs"]["tokens"], first["logprobs"]["text_offset"]) == ("x", ["token_id:5"], [0])
    assert (last["text"], last["finish_reason"], last["logprobs"]["text_offset"]) == ("y", "length", [0])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert all("usage" not in c for c in chunks[:-1])


def test_a_scoring_stream_sends_the_prompt_and_a_length_finish_only() -> None:
    body = completion(prompt="ab", echo=True, max_tokens=0, stream=True,
                      stream_options={"include_usage": True, "continuous_usage_stats": True})
    shaper = CompletionShaper(body, "m", None, [[3, 4]], ["ab"])
    chunks = stream(shaper, [(0, delta([5], "x", 1, "length"))])
    assert [(c["text"], c["finish_reason"]) for c in choices(chunks)] == [("ab", None), ("", "length")]
    assert all(c["usage"]["completion_tokens"] == 0 for c in chunks)


def test_a_chat_stream_starts_with_a_role_chunk_per_choice_and_counts_usage_continuously() -> None:
    body = chat(n=2, logprobs=True, top_logprobs=1, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    shaper = ChatShaper(body, "m", None, [1, 2, 3], None)
    chunks = stream(shaper, [(1, delta([7], "a", 1, logprob=-0.5)), (0, delta([], "", 0)),
                             (0, delta([8], "", 1, "abort", -0.25)), (1, delta([], "", 1, "length"))])
    assert shaper.request_id.startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == shaper.request_id for c in chunks)
    shown = [(c["index"], c["delta"], c["finish_reason"]) for c in choices(chunks)]
    assert shown == [(0, {"role": "assistant", "content": ""}, None), (1, {"role": "assistant", "content": ""}, None),
                     (1, {"content": "a"}, None), (0, {}, "stop"), (1, {}, "length")]
    logprobs = [c["logprobs"] for c in choices(chunks)]
    assert logprobs[:2] == [None, None] and logprobs[4] == {"content": []}
    assert logprobs[3] == chat_logprobs([("token_id:8", -0.25, [("token_id:8", -0.25)])])
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 0, 1, 2, 2, 2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5


def test_a_chat_body_has_messages_logprobs_and_no_stream_only_parts() -> None:
    shaper = ChatShaper(chat(logprobs=True), "m", None, [1], None)
    shaper.add(0, delta([7, 8], "hi", 2, "stop", -0.5))
    body = shaper.body()
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 2
    [out] = body["choices"]
    assert out["message"] == {"role": "assistant", "content": "hi"} and out["finish_reason"] == "stop"
    assert [c["top_logprobs"] for c in out["logprobs"]["content"]] == [[], []]  # top_logprobs unset: 0


def test_a_named_tool_streams_its_arguments_as_tool_call_deltas() -> None:
    body = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}}, stream=True)
    shaper = ChatShaper(body, "m", None, [1], body.tool_plan())
    chunks = stream(shaper, [(0, delta([5], '{"ci', 1)), (0, delta([6], 'ty":"X"}', 2, "stop"))])
    role, first, last = choices(chunks)
    call = first["delta"]["tool_calls"][0]
    assert (call["index"], call["type"], call["function"]) == (0, "function", {"name": "weather", "arguments": '{"ci'})
    assert call["id"].startswith("call_") and first["finish_reason"] is None
    assert last["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"X"}'}}]}
    assert last["finish_reason"] == "tool_calls"


def test_auto_tools_hold_back_a_call_and_send_it_whole_with_the_finish() -> None:
    body = chat(tools=TOOLS, stream=True)
    shaper = ChatShaper(body, "m", None, [1], body.tool_plan())
    [first] = shaper.chunks(0, delta([5], "Hi <tool", 1))
    assert first["choices"][0]["delta"] == {"content": "Hi "}  # "<tool" held back: it could start a call
    assert shaper.chunks(0, delta([6], "_call>", 2)) == []  # a call in progress: nothing yet
    last = shaper.chunks(0, delta([7], '{"name": "weather", "arguments": {}}</tool_call> ok', 3, "stop"))
    content, calls = (c["choices"][0] for c in last)
    assert (content["delta"], content["finish_reason"]) == ({"content": " ok"}, None)
    [call] = calls["delta"]["tool_calls"]
    assert (call["index"], call["function"]) == (0, {"name": "weather", "arguments": "{}"})
    assert calls["finish_reason"] == "tool_calls"


def test_tool_deltas_carry_logprobs_even_while_the_text_is_held() -> None:
    body = chat(tools=TOOLS, logprobs=True, stream=True)
    shaper = ChatShaper(body, "m", None, [1], body.tool_plan())
    shaper.chunks(0, delta([5], "<tool", 1, logprob=-0.5))
    [held] = shaper.chunks(0, delta([6], "_call>", 2, logprob=-0.5))
    assert held["choices"][0]["delta"] == {} and held["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
    parts = shaper.chunks(0, delta([7], '{"name": "weather", "arguments": {}}</tool_call> ok', 3, "stop", -0.25))
    assert [p["choices"][0]["logprobs"] is not None for p in parts] == [True, False]  # on the first part only


def test_the_error_event_is_openais_error_body() -> None:
    err = ApiError(504, "the request passed its deadline", code="timeout")
    assert ResponseShaper.error_chunk(err) == {"error": {
        "message": "the request passed its deadline", "type": "timeout", "param": None, "code": "timeout"}}


def test_chat_logprobs_shape() -> None:
    shaped = chat_logprobs([("a", -0.5, [("a", -0.5), ("b", -1.0)])])
    assert shaped == {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "b", "logprob": -1.0, "bytes": [98]}]}]}
