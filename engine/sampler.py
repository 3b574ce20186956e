"""Picks each sampling row's next token from its logits, per request's SamplingParams.

A request with a seed draws from its own generator, created at its first token and kept until it finishes, so
its tokens depend only on its own logits and seed, never on what else is in the batch. Requests without a
seed share the engine's generator (seeded from the engine's seed).
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to one row of fp32 logits; filtered entries become -inf."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop_sorted = probs.cumsum(-1) - probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    """Greedy or random sampling per row; per-request generators make seeded requests reproducible."""

    def __init__(self, seed: int) -> None:
        self._shared = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator().manual_seed(params.seed)
            self._generators[request_id] = generator
        return generator

    def sample(self, logits: torch.Tensor, rows: list[tuple[str, SamplingParams]]) -> list[int]:
        """logits [num_rows, vocab] fp32 (any device); rows: (request_id, params) in the same order."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} requests")
        logits = logits.float().cpu()
        tokens: list[int] = []
        for row, (request_id, params) in zip(logits, rows):
            if params.greedy:
                tokens.append(int(torch.argmax(row)))
                continue
            probs = torch.softmax(filter_logits(row, params), dim=-1)
            token = torch.multinomial(probs, 1, generator=self._generator(request_id, params))
            tokens.append(int(token))
        return tokens
