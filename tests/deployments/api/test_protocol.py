"""The OpenAI request models, without a server: which fields are supported, ignored or refused (docs/operations.md's
table), batched prompts, n / best_of, seeds per choice (the responses' shapes: test_responses.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dcpserve.deployments.api import protocol


def completion(**fields: object) -> protocol.CompletionRequest:
    return protocol.CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields: object) -> protocol.ChatCompletionRequest:
    return protocol.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("prompt,expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_every_prompt_shape_is_a_batch(prompt: object, expected: list) -> None:
    assert completion(prompt=prompt).prompts() == expected


def test_seeded_choices_get_consecutive_seeds_and_every_field_reaches_sampling() -> None:
    body = completion(n=3, seed=7, max_tokens=5, logprobs=2, presence_penalty=0.5, frequency_penalty=-0.5,
                      repetition_penalty=1.2, logit_bias={"5": 10.0}, min_tokens=2, stop_token_ids=[9],
                      include_stop_str_in_output=True, skip_special_tokens=False, top_k=4)
    params = [body.sampling_params(context_left=100, choice=j) for j in range(3)]
    assert [p.seed for p in params] == [7, 8, 9]
    first = params[0]
    assert (first.max_tokens, first.logprobs, first.presence_penalty, first.frequency_penalty) == (5, 2, 0.5, -0.5)
    assert first.repetition_penalty == 1.2 and dict(first.logit_bias or {}) == {5: 10.0} and first.min_tokens == 2
    assert first.stop_token_ids == (9,) and first.include_stop_str_in_output and not first.skip_special_tokens
    assert first.top_k == 4
    assert completion(n=2).sampling_params(context_left=10, choice=1).seed is None  # unseeded: random per choice


def test_echo_scoring_and_best_of_ask_the_engine_for_what_they_need() -> None:
    scoring = completion(echo=True, max_tokens=0, logprobs=1)
    params = scoring.sampling_params(context_left=100)
    assert params.max_tokens == 1 and params.prompt_logprobs == 1  # one token generated, dropped by the ingress
    best = completion(n=1, best_of=3)
    assert best.num_choices() == 3 and best.sampling_params(context_left=10).logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).sampling_params(context_left=10).logprobs == 3
    assert chat().sampling_params(context_left=10).logprobs is None


@pytest.mark.parametrize("fields,fragment", [
    ({"n": 17}, "less than or equal to 16"),
    ({"logprobs": 21}, "less than or equal to 20"),
    ({"presence_penalty": 2.5}, "less than or equal to 2"),
    ({"frequency_penalty": -3}, "greater than or equal to -2"),
    ({"repetition_penalty": 0}, "greater than 0"),
    ({"logit_bias": {"abc": 1}}, "logit_bias keys are token ids"),
    ({"logit_bias": {"5": 101}}, "[-100, 100]"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens (9) exceeds max_tokens (4)"),
    ({"best_of": 2, "n": 3}, "best_of (2) must be >= n (3)"),
    ({"best_of": 3, "stream": True}, "cannot be streamed"),
    ({"prompt": [[1]] * 65}, "at most 64 prompts"),
    ({"prompt": [[1]] * 5, "n": 16}, "at most 64 per request"),
    ({"max_tokens": 0}, "use it with echo=true"),
    ({"suffix": "x"}, "suffix is not supported"),
    ({"store": True}, "store=true is not supported"),
    ({"priority": "5"}, "Input should be a valid integer"),
    ({"priority": 1.5}, "Input should be a valid integer"),
    ({"priority": True}, "Input should be a valid integer"),
    ({"priority": 1001}, "less than or equal to 1000"),
    ({"deadline": "tomorrow"}, "neither Unix seconds nor an ISO 8601 time"),
    ({"deadline": "2026-12-05T12:00:00"}, "has no UTC offset"),
    ({"deadline": -5}, "is not a Unix time in seconds"),
    ({"deadline": [1]}, "Input should be a valid"),
    ({"guided_whitespace_pattern": " "}, "Extra inputs are not permitted"),
    ({"use_beam_search": True}, "Extra inputs are not permitted"),
])
def test_completions_refuse_what_they_cannot_honour(fields: dict, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        completion(**fields)


@pytest.mark.parametrize("fields,fragment", [
    ({"top_logprobs": 2}, "top_logprobs needs logprobs=true"),
    ({"logprobs": True, "top_logprobs": 21}, "less than or equal to 20"),
    ({"continue_final_message": True}, "continue_final_message=false"),
    ({"echo": True}, "Extra inputs are not permitted"),
])
def test_chat_refuses_what_it_cannot_honour(fields: dict, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        chat(**fields)


def test_fields_that_do_not_change_generation_are_accepted() -> None:
    body = completion(user="u", metadata={"k": "v"}, store=False, service_tier="auto", request_id="r", priority=0,
                      spaces_between_special_tokens=True,
                      stream_options={"include_usage": True, "continuous_usage_stats": True}, stream=True)
    assert body.include_usage and body.continuous_usage
    chat(parallel_tool_calls=False, tool_choice="none", response_format={"type": "text"}, add_generation_prompt=True)


def test_priority_and_deadline_set_the_service_level() -> None:
    body = completion(priority=-3, deadline="2026-12-05T12:00:10+00:00")
    assert body.priority == -3
    now = 1796472000.0  # 2026-12-05T12:00:00Z
    assert body.deadline_s(now) == pytest.approx(10.0)
    assert completion(deadline=now + 2.5).deadline_s(now) == pytest.approx(2.5)
    assert completion().priority is None and completion().deadline_s(now) is None  # the key's default; no deadline
    with pytest.raises(ValueError, match=r"deadline: '2026-12-05T12:00:10\+00:00' passed 5.000s ago"):
        body.deadline_s(now + 15)
