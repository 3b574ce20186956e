"""A request's session key: OpenAI's prompt_cache_key, or the X-Session-Id header for clients that cannot send it (the
body wins), checked (400 naming the field, what it got and the fix) and carried to admission in the request's
ServiceLevel. Through OpenAIIngress made as Serve makes it, without Ray (a stand-in records each choice's level)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.deployments.api.ingress import OpenAIIngress
from dcpserve.deployments.api.protocol import (
    MAX_SESSION_KEY_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    session_key,
)
from dcpserve.deployments.config import parse_args
from dcpserve.deployments.messages import ServiceLevel
from dcpserve.engine.protocol import RequestDelta
from dcpserve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("value,fragment", [
    (7, "prompt_cache_key must be a string (a name for the conversation or agent the request belongs to), got int"),
    (["a"], "got list; send it as a string"),
    ("", "prompt_cache_key is empty; send a non-empty string"),
    ("k" * (MAX_SESSION_KEY_CHARS + 1), f"is {MAX_SESSION_KEY_CHARS + 1} characters, longer than the "
                                         f"{MAX_SESSION_KEY_CHARS} allowed; send a shorter key"),
])
def test_a_bad_key_is_refused_naming_the_field_what_it_got_and_the_fix(value: Any, fragment: str) -> None:
    with pytest.raises(ValueError, match=pytest.importorskip("re").escape(fragment)):
        session_key(value, "prompt_cache_key")


def test_the_body_key_wins_over_the_header_and_the_header_serves_clients_without_one() -> None:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "prompt_cache_key": "conv-1"})
    assert body.session("from-header") == "conv-1"
    plain = CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    assert plain.session("from-header") == "from-header" and plain.session(None) is None
    with pytest.raises(ValueError, match="the X-Session-Id header is empty"):
        plain.session("")
    assert session_key("k" * MAX_SESSION_KEY_CHARS, "x") == "k" * MAX_SESSION_KEY_CHARS  # the bound itself is fine


# ---- through the ingress --------------------------------------------------------------------------------------------

class RecordingReplica:
    """Admission and an engine replica in one stand-in: records each choice's ServiceLevel, answers one token."""

    def __init__(self) -> None:
        self.levels: list[ServiceLevel] = []

    def open(self, ticket: str, token_ids: list[int], params: SamplingParams, need: Any,
             level: ServiceLevel | None = None) -> AsyncGenerator[RequestDelta]:
        self.levels.append(level or ServiceLevel())
        return self._deltas(ticket, len(token_ids))

    async def _deltas(self, ticket: str, num_prompt: int) -> AsyncGenerator[RequestDelta]:
        yield RequestDelta(ticket, [], "", False, None, num_prompt, 0)
        yield RequestDelta(ticket, [7], "ok", True, "stop", num_prompt, 1)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("session") / "model")


def ingress(model: Path) -> tuple[Any, RecordingReplica]:
    async def make() -> Any:
        made = OpenAIIngress.__new__(OpenAIIngress)  # as Serve makes it: the wrapper's async __init__
        await made.__init__(parse_args({"model": str(model), "device": "cpu"}), None, None)  # type: ignore[misc]
        return made

    made = asyncio.run(make())
    replica = made.sessions = RecordingReplica()
    return made, replica


def call(route: Any, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    raw = json.dumps(body).encode()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def run() -> tuple[int, Any]:
        sent = [(b"content-type", b"application/json")]
        sent += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"", "headers": sent}
        response = await route(Request(scope, receive))
        return response.status_code, json.loads(response.body)

    return asyncio.run(run())


def test_the_session_reaches_admission_from_the_body_or_the_header(model_dir: Path) -> None:
    model, replica = ingress(model_dir)
    chat = {"model": model.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    completion = {"model": model.model_name, "prompt": "hi", "max_tokens": 2, "n": 2}
    assert call(model.chat_completions, {**chat, "prompt_cache_key": "conv-1"}, {"X-Session-Id": "h"})[0] == 200
    assert call(model.completions, completion, {"X-Session-Id": "agent-9"})[0] == 200
    assert call(model.completions, completion)[0] == 200
    assert [level.session for level in replica.levels] == ["conv-1", "agent-9", "agent-9", None, None]


@pytest.mark.parametrize("body,headers,param,fragment", [
    ({"prompt_cache_key": 12}, {}, "prompt_cache_key", "prompt_cache_key must be a string"),
    ({"prompt_cache_key": "x" * 300}, {}, "prompt_cache_key", "is 300 characters, longer than the 256 allowed"),
    ({}, {"X-Session-Id": "y" * 257}, "X-Session-Id", "the X-Session-Id header is 257 characters"),
])
def test_a_bad_session_key_is_a_400_naming_it(model_dir: Path, body: dict[str, Any], headers: dict[str, str],
                                              param: str, fragment: str) -> None:
    model, replica = ingress(model_dir)
    status, answer = call(model.completions, {"model": model.model_name, "prompt": "hi", "max_tokens": 2, **body},
                          headers)
    assert status == 400 and answer["error"]["param"] == param and fragment in answer["error"]["message"], answer
    assert not replica.levels
