"""The offline batch API, shaped like vLLM's: LLM(model, ...).generate(prompts, sampling_params)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from dcpserve.engine.args import EngineArgs
from dcpserve.engine.core.engine import LLMEngine
from dcpserve.engine.core.request import CompletionOutput, RequestOutput
from dcpserve.engine.protocol import RequestDelta, TokenLogprob
from dcpserve.engine.sampling_params import SamplingParams


class _Collected:
    """One request's deltas put together: tokens, text, finish reason, logprobs."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] | None = None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, delta: RequestDelta) -> None:
        self.token_ids.extend(delta.new_token_ids)
        self.text.append(delta.new_text)
        if delta.finished:
            self.finish_reason = delta.finish_reason
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    def completion(self) -> CompletionOutput:
        return CompletionOutput(0, "".join(self.text), self.token_ids, self.finish_reason, self.logprobs)


class LLM:
    """Generates for a batch of prompts on one replica: the native engine (tp = 1 in process; tp > 1 on a Ray worker
    group) or, with backend="vllm", vLLM's engine behind dcpserve.engine.backends.vllm.engine."""

    def __init__(self, model: str | Path, **engine_args: Any) -> None:
        """`engine_args` are EngineArgs' fields by keyword (dcpserve/engine/args.py); an unknown one is a TypeError that
        names it and lists the valid ones."""
        self.engine_args = EngineArgs.from_kwargs(model, **engine_args)
        self.engine: LLMEngine | None = None
        self._ids = itertools.count()
        self._vllm: Any = None  # dcpserve.engine.backends.vllm.engine.VllmEngine, on an event loop of this LLM's own
        self._loop: asyncio.AbstractEventLoop | None = None
        if self.engine_args.backend == "vllm":
            from dcpserve.engine.backends.vllm.engine import VllmEngine

            self._loop = asyncio.new_event_loop()

            async def start() -> VllmEngine:  # vLLM binds its output handler to the loop it first runs on
                return VllmEngine(self.engine_args)

            self._vllm = self._loop.run_until_complete(start())
        else:
            self.engine = LLMEngine(self.engine_args.create_engine_config())

    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.kv_capacity_tokens if self.engine is not None else self._vllm.kv_capacity_tokens

    @property
    def tokenizer(self):
        return self.engine.tokenizer if self.engine is not None else self._vllm.tokenizer

    def _tokenize(self, prompt: str) -> list[int]:
        if self.engine is not None:
            return self.engine.tokenize(prompt)
        if self._vllm.tokenizer is None:
            raise ValueError(f"the model directory {self.engine_args.model} has no tokenizer: pass prompt_token_ids")
        return self._vllm.tokenizer.encode(prompt)

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if self.engine is not None:
            self.engine.scheduler.check_fits(num_prompt_tokens, max_tokens)
        else:
            self._vllm.check_request(num_prompt_tokens, max_tokens)

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is None and prompt_token_ids is None:
            raise ValueError("pass prompts or prompt_token_ids")
        if prompts is not None and prompt_token_ids is not None and len(prompts) != len(prompt_token_ids):
            raise ValueError(f"{len(prompts)} prompts but {len(prompt_token_ids)} prompt_token_ids lists")
        count = len(prompts) if prompts is not None else len(prompt_token_ids or [])
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * count
        else:
            params_list = list(sampling_params)
            if len(params_list) != count:
                raise ValueError(f"{len(params_list)} sampling_params for {count} prompts")
        # Validate and tokenize everything before queueing anything: a bad prompt fails the call cleanly.
        token_lists = [
            list(prompt_token_ids[i]) if prompt_token_ids is not None else self._tokenize(prompts[i])  # type: ignore[index]
            for i in range(count)
        ]
        vocab_size = self.engine.model_config.vocab_size if self.engine is not None else self._vllm.vocab_size
        for tokens, params in zip(token_lists, params_list, strict=True):
            self._check_fits(len(tokens), params.max_tokens)
            params.check_vocab(vocab_size)
        if self.engine is None:
            results = self._loop.run_until_complete(self._run_vllm(token_lists, params_list))  # type: ignore[union-attr]
        else:
            results = self._run_native(self.engine, prompts, token_lists, params_list)
        return [
            RequestOutput(request_id=rid, prompt=prompts[i] if prompts is not None else None,
                          prompt_token_ids=token_lists[i], outputs=[collected.completion()], finished=True,
                          prompt_logprobs=collected.prompt_logprobs)
            for i, (rid, collected) in enumerate(results)
        ]

    @staticmethod
    def _run_native(engine: LLMEngine, prompts: Sequence[str] | None, token_lists: list[list[int]],
                    params_list: list[SamplingParams]) -> list[tuple[str, _Collected]]:
        """Every request through the native engine, stepping until all finish; (id, what it got) in input order."""
        ids = [
            engine.add_request(prompts[i] if prompts is not None else None, params_list[i], token_lists[i])
            for i in range(len(token_lists))
        ]
        collected = {rid: _Collected() for rid in ids}
        pending = set(ids)
        while pending:
            for delta in engine.step():
                if delta.request_id in pending:
                    collected[delta.request_id].add(delta)
                    if delta.finished:
                        pending.discard(delta.request_id)
        return [(rid, collected[rid]) for rid in ids]

    async def _run_vllm(self, token_lists: list[list[int]],
                        params_list: list[SamplingParams]) -> list[tuple[str, _Collected]]:
        """Every request through the vLLM engine at once; (id, what it got) in input order."""
        start = next(self._ids)

        async def one(i: int) -> tuple[str, _Collected]:
            rid = f"req-{start}-{i}"
            collected = _Collected()
            stream = await self._vllm.submit(sampling_params=params_list[i], prompt_token_ids=token_lists[i],
                                             request_id=rid)
            async for delta in stream:
                collected.add(delta)
            return rid, collected

        return list(await asyncio.gather(*(one(i) for i in range(len(token_lists)))))

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        elif self._vllm is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.run_until_complete(self._vllm.shutdown())
            self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()
