"""The OpenAI ingress' routes on a Qwen3-shaped model directory, without Ray: OpenAIIngress made as Serve makes it,
with a scripted stand-in for admission and the engine replica (it records the prompt and SamplingParams each choice
is sent with, and answers with fixed text). What is checked is the ingress' own work: the model's
generation_config.json sampling defaults in the SamplingParams the engine receives (a request's own values winning),
chat_template_kwargs reaching the chat template (and its 400s), reasoning_content through a whole request, and
/v1/models' cards."""

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
from dcpserve.deployments.config import parse_args
from dcpserve.engine.protocol import RequestDelta
from dcpserve.engine.sampling_params import SamplingParams

# Qwen3's template in what matters here: <think> opened by the model, closed empty by the template when thinking is
# off, and a template that refuses an enable_thinking that is not a boolean.
QWEN3_TEMPLATE = (
    "{%- if enable_thinking is defined and enable_thinking is not boolean %}"
    "{{ raise_exception('enable_thinking must be true or false') }}{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{%- endif %}"
)
QWEN3_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
ANSWER = ["<think>\nThe user", " says hi.</th", "ink>\n\nHello", "!"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = write_tiny_model(tmp_path_factory.mktemp("qwen3") / "model")
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, **QWEN3_SAMPLING}))
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = QWEN3_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name in ("chat_template.jinja", "chat_template.json"):
        (model / name).unlink(missing_ok=True)  # the template above is the one
    return model


class ScriptedReplica:
    """Admission and an engine replica in one stand-in: records (prompt ids, SamplingParams) per choice and answers
    each with the scripted text pieces."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.sent: list[tuple[list[int], SamplingParams]] = []

    def open(self, ticket: str, token_ids: list[int], params: SamplingParams, need: Any,
             level: Any = None) -> AsyncGenerator[RequestDelta]:
        self.sent.append((token_ids, params))
        return self._deltas(ticket, len(token_ids))

    async def _deltas(self, ticket: str, num_prompt: int) -> AsyncGenerator[RequestDelta]:
        yield RequestDelta(ticket, [], "", False, None, num_prompt, 0)  # admitted
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield RequestDelta(ticket, [7], piece, last, "stop" if last else None, num_prompt, i + 1)

    def close(self) -> None:
        pass


def ingress(model: Path, **args: Any) -> tuple[Any, ScriptedReplica]:
    async def make() -> Any:
        made = OpenAIIngress.__new__(OpenAIIngress)  # as Serve makes it: the wrapper's async __init__
        await made.__init__(parse_args({"model": str(model), "device": "cpu", **args}), None, None)  # type: ignore[misc]
        return made

    made = asyncio.run(make())
    replica = made.sessions = ScriptedReplica(ANSWER)
    return made, replica


def call(route: Any, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """(status, JSON body or the list of SSE events) of one request to a route."""
    raw = json.dumps(body).encode() if body is not None else b""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def run() -> tuple[int, Any]:
        scope = {"type": "http", "method": "POST" if body is not None else "GET", "path": "/", "query_string": b"",
                 "headers": [(b"content-type", b"application/json")]}
        response = await route(Request(scope, receive))
        if hasattr(response, "body_iterator"):
            events = [chunk async for chunk in response.body_iterator]
            return response.status_code, [json.loads(e[len("data: "):]) for e in events if "[DONE]" not in e]
        return response.status_code, json.loads(response.body)

    return asyncio.run(run())


def chat(model: Any, **fields: Any) -> dict[str, Any]:
    return {"model": model.model_name, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_the_models_sampling_defaults_reach_the_engine_unless_the_request_sets_its_own(qwen3_dir: Path) -> None:
    model, replica = ingress(qwen3_dir)
    assert call(model.chat_completions, chat(model))[0] == 200
    assert call(model.completions, {"model": model.model_name, "prompt": "hi", "max_tokens": 4})[0] == 200
    for _, params in replica.sent:
        assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
        assert (params.repetition_penalty, params.presence_penalty) == (1.0, 0.0)  # the model sets none
    replica.sent.clear()
    assert call(model.chat_completions, chat(model, temperature=1.0, top_k=0, n=2, seed=3))[0] == 200
    assert [(p.temperature, p.top_p, p.top_k, p.seed) for _, p in replica.sent] == [(1.0, 0.95, 0, 3),
                                                                                      (1.0, 0.95, 0, 4)]

    neutral, sent = ingress(qwen3_dir, generation_config="vllm")
    assert call(neutral.chat_completions, chat(neutral))[0] == 200
    assert (sent.sent[0][1].temperature, sent.sent[0][1].top_p, sent.sent[0][1].top_k) == (1.0, 1.0, 0)


def test_chat_template_kwargs_reach_the_template(qwen3_dir: Path) -> None:
    model, replica = ingress(qwen3_dir)
    call(model.chat_completions, chat(model))
    call(model.chat_completions, chat(model, chat_template_kwargs={"enable_thinking": False}))
    thinking, quiet = (model.tokenizer.decode(ids) for ids, _ in replica.sent)
    assert thinking.endswith("assistant\n") and "<think>" not in thinking
    assert quiet == thinking + "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("kwargs,match", [
    ("yes", "chat_template_kwargs: Input should be a valid dictionary"),
    ({"enable_thinking": "no"}, "the chat template cannot render with them.*enable_thinking must be true or false"),
    ({"tokenize": True}, "chat_template_kwargs may not set tokenize"),
])
def test_chat_template_kwargs_the_template_cannot_take_are_a_400_naming_the_field(
        qwen3_dir: Path, kwargs: Any, match: str) -> None:
    model, replica = ingress(qwen3_dir)
    status, body = call(model.chat_completions, chat(model, chat_template_kwargs=kwargs))
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs", body
    assert pytest.importorskip("re").search(match, body["error"]["message"]), body
    assert not replica.sent


def test_reasoning_content_through_a_request_whole_and_streamed(qwen3_dir: Path) -> None:
    model, _ = ingress(qwen3_dir, reasoning_parser="qwen3")
    status, body = call(model.chat_completions, chat(model))
    message = body["choices"][0]["message"]
    assert status == 200 and (message["reasoning_content"], message["content"]) == ("\nThe user says hi.",
                                                                                   "\n\nHello!")
    status, events = call(model.chat_completions, chat(model, stream=True))
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "\nThe user says hi."
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nHello!"
    plain, _ = ingress(qwen3_dir)  # no reasoning_parser: all of it is content
    assert call(plain.chat_completions, chat(plain))[1]["choices"][0]["message"] == {
        "role": "assistant", "content": "".join(ANSWER)}


def test_model_cards_carry_vllms_fields(qwen3_dir: Path) -> None:
    model, _ = ingress(qwen3_dir, max_model_len=1024, served_model_name="qwen3-tiny")
    status, body = call(model.models)
    assert status == 200 and body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == "qwen3-tiny" and card["object"] == "model" and card["owned_by"] == "dcpserve"
    assert card["root"] == str(qwen3_dir) and card["parent"] is None and card["max_model_len"] == 1024
    assert isinstance(card["created"], int) and card["created"] > 0
