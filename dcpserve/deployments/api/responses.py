"""The response side of one OpenAI request: every body and stream chunk it is answered with, shaped in one place.

One shaper per endpoint (vLLM's serving_completion / serving_chat split): `CompletionShaper`, `ChatShaper`, over a
shared `ResponseShaper`. A shaper takes what the answer depends on from the request once, when the route makes it (the
model name, a new response id, n / best_of, logprobs k, echo, the usage options, the tool plan), and the ingress then
hands it each choice's deltas:

- a JSON answer: `add(k, delta)` for every delta of every choice, then `body()`;
- an SSE stream: `first_chunks()`, `chunks(k, delta)` per delta as it comes, `last_chunks()`; `error_chunk(err)` ends
  a stream that failed.

Choice k of a request is its k-th sequence, in the ingress' plan: prompt k // per_prompt (per_prompt: n, or best_of
where it is larger), index k; with best_of > n the n kept per prompt (the highest cumulative logprob) are indexed
prompt * n + j. Token names and the logprobs objects: dcpserve/deployments/api/logprobs.py; tool calls read back from
the text: dcpserve/deployments/api/tool_parser.py.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dcpserve.deployments.api.http_edge import error_body
from dcpserve.deployments.api.logprobs import LogprobEntry, Tokens, chat_logprobs, completion_logprobs
from dcpserve.deployments.api.protocol import ChatCompletionRequest, CompletionRequest
from dcpserve.deployments.api.reasoning import ReasoningFormat, ReasoningStream, split_reasoning
from dcpserve.deployments.api.tool_calls import ToolPlan
from dcpserve.deployments.api.tool_parser import ToolStream, parse_output
from dcpserve.deployments.messages import ApiError
from dcpserve.engine.protocol import RequestDelta, TokenLogprob


def finish_reason(reason: str | None, num_calls: int = 0) -> str | None:
    """The engine's finish reason (stop, length, abort) in OpenAI's vocabulary, for a choice that made num_calls tool
    calls: "length" stays, a choice with calls ends in "tool_calls", any other in "stop"."""
    if reason is None:
        return None
    if reason == "length":
        return "length"
    return "tool_calls" if num_calls else "stop"


@dataclass
class _Output:
    """What one choice produced: all of it for a JSON answer (`add`), only the token count for a stream."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish: str | None = None
    num_output: int = 0

    def add(self, delta: RequestDelta) -> None:
        self.text.append(delta.new_text)
        self.token_ids += delta.new_token_ids
        self.logprobs += delta.logprobs or []
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_output = delta.num_output_tokens
        if delta.finished:
            self.finish = delta.finish_reason

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(entry.logprob for entry in self.logprobs))


class ResponseShaper(ABC):
    """The bodies and chunks of one request's answer, from what the request asked, taken once."""

    id_prefix: ClassVar[str]
    body_object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(self, body: CompletionRequest | ChatCompletionRequest, model: str, tokenizer: Any,
                 prompts: list[list[int]], score_only: bool = False) -> None:
        """score_only: the request scores its prompts (completions' max_tokens 0) and generates nothing to show."""
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self._model = model
        self._tokens = Tokens(tokenizer, body.return_tokens_as_token_ids)
        self._prompts = prompts
        self._per_prompt = body.num_choices()
        self._num_prompt_tokens = sum(len(p) for p in prompts)
        self._include_usage = body.include_usage
        self._continuous_usage = body.continuous_usage
        self._score_only = score_only
        self._outputs = [_Output() for _ in range(len(prompts) * self._per_prompt)]

    # ---- a JSON answer ----------------------------------------------------------------------------------------

    def add(self, k: int, delta: RequestDelta) -> None:
        """One delta of choice k, kept for body()."""
        self._outputs[k].add(delta)

    def body(self) -> dict[str, Any]:
        """The whole answer, once every choice has finished."""
        return self._envelope(self.body_object, choices=self._choices(), usage=self.usage())

    # ---- an SSE stream ----------------------------------------------------------------------------------------

    def first_chunks(self) -> list[dict[str, Any]]:
        """What a stream starts with, before any delta."""
        return []

    def chunks(self, k: int, delta: RequestDelta) -> list[dict[str, Any]]:
        """The chunks one delta of choice k makes (possibly none), each with the usage so far under
        continuous_usage_stats (vLLM's extension)."""
        self._outputs[k].num_output = delta.num_output_tokens
        return [self._with_usage(chunk) for chunk in self._delta_chunks(k, delta)]

    def last_chunks(self) -> list[dict[str, Any]]:
        """What a stream ends with once every choice finished: with include_usage, a chunk of no choices and the
        usage."""
        return [self._envelope(self.chunk_object, choices=[], usage=self.usage())] if self._include_usage else []

    @staticmethod
    def error_chunk(err: ApiError) -> dict[str, Any]:
        """A stream's error event: the error body an HTTP error would have (its status is sent already)."""
        return error_body(err.status, err.message, err.param, err.code)

    # ---- shared -----------------------------------------------------------------------------------------------

    def usage(self) -> dict[str, int]:
        """Prompt tokens once per prompt; completion tokens of every sequence generated so far (best_of's extra ones
        too: they were computed)."""
        generated = 0 if self._score_only else sum(o.num_output for o in self._outputs)
        return {"prompt_tokens": self._num_prompt_tokens, "completion_tokens": generated,
                "total_tokens": self._num_prompt_tokens + generated}

    def _envelope(self, obj: str, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        out = {"id": self.request_id, "object": obj, "created": int(time.time()), "model": self._model,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def _with_usage(self, chunk: dict[str, Any]) -> dict[str, Any]:
        if self._continuous_usage:
            chunk["usage"] = self.usage()
        return chunk

    @abstractmethod
    def _choices(self) -> list[dict[str, Any]]:
        """The body's choices."""

    @abstractmethod
    def _delta_chunks(self, k: int, delta: RequestDelta) -> list[dict[str, Any]]:
        """The chunks of one delta of choice k, before any usage is added."""


class CompletionShaper(ResponseShaper):
    """/v1/completions: text choices, echo, the legacy logprobs object, vLLM's prompt_logprobs, best_of's pick."""

    id_prefix = "cmpl"
    body_object = chunk_object = "text_completion"

    def __init__(self, body: CompletionRequest, model: str, tokenizer: Any, prompts: list[list[int]],
                 echo_texts: list[str]) -> None:
        """echo_texts: each prompt's text as echo shows it (the string sent, or the token ids sent, decoded); empty
        without echo."""
        super().__init__(body, model, tokenizer, prompts, score_only=body.max_tokens == 0)
        self._n = body.n
        self._echo = body.echo
        self._echo_texts = echo_texts
        self._logprobs_k = body.logprobs
        self._vllm_prompt_logprobs = body.prompt_logprobs is not None
        self._echoed: set[int] = set()

    def _choices(self) -> list[dict[str, Any]]:
        out = []
        for position, k in enumerate(self._kept()):
            output, prompt_index = self._outputs[k], k // self._per_prompt
            generated = "" if self._score_only else "".join(output.text)
            prompt_text = self._echo_texts[prompt_index] if self._echo else ""
            logprobs, top_k = None, self._logprobs_k
            if top_k is not None:
                entries = self._prompt_entries(k, output.prompt_logprobs, top_k) if self._echo else []
                if not self._score_only:
                    entries += self._tokens.entries(output.token_ids, output.logprobs, top_k)
                logprobs = completion_logprobs(entries)
            prompt_logprobs = None
            if self._vllm_prompt_logprobs and output.prompt_logprobs is not None:
                prompt_logprobs = self._tokens.vllm_prompt_logprobs(self._prompts[prompt_index],
                                                                    output.prompt_logprobs)
            out.append(self._choice(prompt_index * self._n + position % self._n, prompt_text + generated,
                                    "length" if self._score_only else output.finish, logprobs, prompt_logprobs))
        return out

    def _kept(self) -> list[int]:
        """The choices the body shows: all of them, or with best_of > n each prompt's n with the highest cumulative
        logprob (stable), in that order."""
        if self._per_prompt == self._n:
            return list(range(len(self._outputs)))
        kept: list[int] = []
        for start in range(0, len(self._outputs), self._per_prompt):
            group = range(start, start + self._per_prompt)
            kept += sorted(group, key=lambda k: -self._outputs[k].cumulative_logprob)[:self._n]
        return kept

    def _delta_chunks(self, k: int, delta: RequestDelta) -> list[dict[str, Any]]:
        out, top_k = [], self._logprobs_k
        if self._echo and k not in self._echoed:
            # The prompt first: its text and (with logprobs) its tokens' logprobs, from the first delta.
            self._echoed.add(k)
            logprobs = None
            if top_k is not None:
                logprobs = completion_logprobs(self._prompt_entries(k, delta.prompt_logprobs, top_k))
            out.append(self._chunk(k, self._echo_texts[k // self._per_prompt], None, logprobs))
        finish = delta.finish_reason if delta.finished else None
        if self._score_only:
            if finish is not None:
                out.append(self._chunk(k, "", "length", None))
            return out
        if not delta.new_text and finish is None and not delta.logprobs:
            return out
        logprobs = None
        if top_k is not None:
            logprobs = completion_logprobs(self._tokens.entries(delta.new_token_ids, delta.logprobs or [], top_k))
        out.append(self._chunk(k, delta.new_text, finish, logprobs))
        return out

    def _prompt_entries(self, k: int, prompt_logprobs: list[TokenLogprob | None] | None,
                        top_k: int) -> list[LogprobEntry]:
        """Choice k's prompt tokens with their logprobs (echo); every one without when the engine sent none."""
        prompt = self._prompts[k // self._per_prompt]
        return self._tokens.entries(prompt, prompt_logprobs or [None] * len(prompt), top_k)

    def _chunk(self, k: int, text: str, finish: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return self._envelope(self.chunk_object, choices=[self._choice(k, text, finish, logprobs)])

    @staticmethod
    def _choice(index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None,
                prompt_logprobs: list[Any] | None = None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(finish)}
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs  # vLLM's extension
        return choice


def reasoning_fields(text: str | None) -> dict[str, str | None]:
    """The reasoning of a message or delta under both its names: reasoning_content (DeepSeek's API, vLLM before
    0.11) and reasoning (vLLM's name now)."""
    return {"reasoning_content": text, "reasoning": text}


class ChatShaper(ResponseShaper):
    """/v1/chat/completions: assistant messages (reasoning split out with a reasoning format, tool calls read back
    with a tool plan), the chat logprobs object; streamed as reasoning, content or tool_calls deltas after a first
    role chunk per choice."""

    id_prefix = "chatcmpl"
    body_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, body: ChatCompletionRequest, model: str, tokenizer: Any, prompt: list[int],
                 plan: ToolPlan | None, reasoning: ReasoningFormat | None = None) -> None:
        super().__init__(body, model, tokenizer, [prompt])
        self._logprobs_k = (body.top_logprobs or 0) if body.logprobs else None
        self._plan = plan
        # With tools, each streamed choice's text goes through its ToolStream (content or tool_calls deltas).
        self._tool_streams = [ToolStream(plan) for _ in self._outputs] if plan is not None else []
        # With a reasoning format, each choice's text is split first: its reasoning, then the rest as above.
        self._reasoning = reasoning
        self._thinking = not body.thinking_disabled()
        self._reasoning_streams = ([ReasoningStream(reasoning, self._thinking) for _ in self._outputs]
                                   if reasoning is not None else [])

    def _choices(self) -> list[dict[str, Any]]:
        out = []
        for k, output in enumerate(self._outputs):
            logprobs = self._logprobs(output.token_ids, output.logprobs)
            message, finish = self._message("".join(output.text), output.finish)
            out.append({"index": k, "message": message, "logprobs": logprobs, "finish_reason": finish})
        return out

    def _message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A finished choice's message (its reasoning split out, with a tool plan its calls read back) and OpenAI's
        finish_reason."""
        reasoning: dict[str, Any] = {}
        content: str | None = text
        if self._reasoning is not None:
            thought, content = split_reasoning(self._reasoning, text, self._thinking)
            reasoning = reasoning_fields(thought)
        if self._plan is None:
            return {"role": "assistant", "content": content, **reasoning}, finish_reason(finish)
        content, calls = parse_output(self._plan, content or "", finish)
        message: dict[str, Any] = {"role": "assistant", "content": content, **reasoning}
        if calls:
            message["tool_calls"] = calls
        return message, finish_reason(finish, len(calls))

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._with_usage(self._chunk(k, {"role": "assistant", "content": ""}, None, None))
                for k in range(len(self._outputs))]

    def _delta_chunks(self, k: int, delta: RequestDelta) -> list[dict[str, Any]]:
        finish = delta.finish_reason if delta.finished else None
        if not delta.new_text and finish is None and not delta.logprobs:
            return []
        logprobs = self._logprobs(delta.new_token_ids, delta.logprobs or [])
        thought, text = "", delta.new_text
        if self._reasoning_streams:
            thought, text = self._reasoning_streams[k].feed(text)
            if finish is not None:
                more_thought, more_text = self._reasoning_streams[k].finish()
                thought, text = thought + more_thought, text + more_text
        reasoning = [reasoning_fields(thought)] if thought else []
        if self._plan is None:
            part = {**(reasoning[0] if reasoning else {}), **({"content": text} if text else {})}
            if not part and finish is None and logprobs is None:
                return []  # a tag held back: nothing to send yet
            return [self._chunk(k, part, finish_reason(finish), logprobs)]
        stream = self._tool_streams[k]
        parts = reasoning + stream.feed(text) + (stream.finish(finish) if finish is not None else [])
        if not parts and finish is None and logprobs is None:
            return []  # text held back (a call in progress): nothing to send yet
        parts = parts or [{}]
        # The logprobs ride on the first part, the finish_reason on the last.
        return [self._chunk(k, part, finish_reason(finish, stream.num_calls) if i == len(parts) - 1 else None,
                            logprobs if i == 0 else None) for i, part in enumerate(parts)]

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        if self._logprobs_k is None:
            return None
        return chat_logprobs(self._tokens.entries(token_ids, logprobs, self._logprobs_k))

    def _chunk(self, k: int, delta: dict[str, Any], finish: str | None,
               logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """finish: OpenAI's finish_reason already."""
        return self._envelope(self.chunk_object, choices=[
            {"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])
