"""The offline batch API, shaped like vLLM's: LLM(model, ...).generate(prompts, sampling_params)."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any, Sequence

from engine.args import EngineArgs
from engine.engine import LLMEngine
from engine.request import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    """Generates for a batch of prompts on one replica (tp = 1 in process; tp > 1 on a Ray worker group)."""

    def __init__(self, model: str | Path, **engine_args: Any) -> None:
        """`engine_args` are EngineArgs' fields by keyword (engine/args.py); an unknown one is a TypeError that
        names it and lists the valid ones."""
        self.engine_args = EngineArgs.from_kwargs(model, **engine_args)
        if self.engine_args.backend == "vllm":
            # The vLLM backend replaces this branch: it builds vLLM's engine from self.engine_args.
            raise NotImplementedError(
                "backend='vllm' is not available yet in LLM: use backend='native' (the default) for now"
            )
        self.engine = LLMEngine(self.engine_args.create_engine_config())

    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.kv_capacity_tokens

    @property
    def tokenizer(self):  # noqa: ANN201 - engine.tokenizer.Tokenizer | None
        return self.engine.tokenizer

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
            list(prompt_token_ids[i]) if prompt_token_ids is not None else self.engine.tokenize(prompts[i])  # type: ignore[index]
            for i in range(count)
        ]
        for tokens, params in zip(token_lists, params_list):
            self.engine.scheduler.check_fits(len(tokens), params.max_tokens)
        ids = [
            self.engine.add_request(prompts[i] if prompts is not None else None, params_list[i], token_lists[i])
            for i in range(count)
        ]
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        reasons: dict[str, str | None] = {rid: None for rid in ids}
        pending = set(ids)
        while pending:
            for delta in self.engine.step():
                if delta.request_id not in pending:
                    continue
                tokens[delta.request_id].extend(delta.new_token_ids)
                texts[delta.request_id].append(delta.new_text)
                if delta.finished:
                    reasons[delta.request_id] = delta.finish_reason
                    pending.discard(delta.request_id)
        return [
            RequestOutput(
                request_id=rid,
                prompt=prompts[i] if prompts is not None else None,
                prompt_token_ids=token_lists[i],
                outputs=[CompletionOutput(0, "".join(texts[rid]), tokens[rid], reasons[rid])],
                finished=True,
            )
            for i, rid in enumerate(ids)
        ]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()
