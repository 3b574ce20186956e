"""What the driver rank returns for one step (ModelRunner.execute -> executor -> LLMEngine.step)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dcpserve.engine.protocol import TokenLogprob


@dataclass
class ModelRunnerOutput:
    """One step's results on the driver rank: the sampled token of every row that reached the end of its sequence,
    and logprobs only for the requests that asked for them (empty dicts otherwise, so the reply from a Ray rank
    stays as small as the tokens alone)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # request id -> its next token
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # request id -> its sampled token's logprob
    # request id -> one entry per prompt position this step's chunk completed, in order: the logprob of the prompt
    # token at position p given the tokens before it, for p in (start, start + chunk] (the chunk's last position
    # only when the prompt continues past it: the token there is known; the one after the prompt is sampled).
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
