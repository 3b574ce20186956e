"""How to pick each next token of a request, what to report about it, and when to stop."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dcpserve.engine.protocol import RequestError
from dcpserve.engine.structured_output import StructuredOutput

# The most top-k alternatives a request may ask for per token (logprobs and prompt_logprobs; vLLM's default).
MAX_LOGPROBS = 20
# Penalty and bias limits (OpenAI's for presence / frequency and logit_bias; repetition as Hugging Face uses it).
MAX_ABS_PENALTY = 2.0
MAX_REPETITION_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-shaped sampling parameters; temperature 0 means greedy.

    Frozen and hashable: `logit_bias` may be given as a {token_id: bias} mapping (or (token_id, bias) pairs) and is
    stored as a tuple of (token_id, bias) pairs sorted by token id; `logit_bias_map()` gives it back as a dict.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    max_tokens: int = 16
    seed: int | None = None  # per-request: the same seed gives the same tokens whatever else is batched
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    # None: no logprobs; k: the sampled token's logprob (log_softmax of the raw logits) plus the top-k alternatives.
    logprobs: int | None = None
    # The same for every prompt token after the first (given the tokens before it), delivered with the first delta.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # tokens of prompt + output: a positive logit divided by it, a negative multiplied
    logit_bias: tuple[tuple[int, float], ...] | Mapping[int, float] | None = None  # added to the raw logits
    min_tokens: int = 0  # until this many outputs, EOS and stop_token_ids cannot be sampled (nor stop strings match)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # False: token ids only, no text (vLLM's option; offline batch work that reads ids, or benchmarks against
    # engines that do not detokenize). Stop strings need the text, so they need True.
    detokenize: bool = True
    # A constraint on the output text (JSON schema, regex, choice, grammar): tokens it forbids are never sampled.
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for s in self.stop or ():
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids or ():
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an integer in [0, {MAX_LOGPROBS}] (the number of top alternatives per "
                    f"token), got {value!r}; at most {MAX_LOGPROBS} are returned"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                limit = f"{MAX_ABS_PENALTY:g}"
                raise ValueError(f"{name} must be a number in [-{limit}, {limit}], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = none), got "
                f"{self.repetition_penalty!r}"
            )
        object.__setattr__(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput or None, got {self.structured_output!r}")
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings {list(self.stop)} are matched in the output text: they need "
                             f"detokenize=True (or use stop_token_ids)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the request's token history (presence / frequency / repetition penalties)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def logit_bias_map(self) -> dict[int, float]:
        return dict(self.logit_bias or ())

    def check_vocab(self, vocab_size: int) -> None:
        """Raises RequestError when a token id the request names (logit_bias) is outside the model's vocabulary."""
        bad = [token for token in self.logit_bias_map() if token >= vocab_size]
        if bad:
            raise RequestError(
                f"logit_bias names token ids {bad[:5]} outside the vocabulary: ids must be in [0, {vocab_size})"
            )


def _normalize_logit_bias(
    logit_bias: Mapping[int, float] | Iterable[tuple[int, float]] | None,
) -> tuple[tuple[int, float], ...] | None:
    """{token_id: bias} or (token_id, bias) pairs -> sorted pairs; each id an integer >= 0, each bias in [-100, 100]."""
    if logit_bias is None:
        return None
    try:
        pairs = list(logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias)
        pairs = [(token, bias) for token, bias in pairs]
    except (TypeError, ValueError):
        raise ValueError(
            f"logit_bias must be a {{token_id: bias}} mapping (or (token_id, bias) pairs), got {logit_bias!r}"
        ) from None
    seen: set[int] = set()
    for token, bias in pairs:
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if token in seen:
            raise ValueError(f"logit_bias names token id {token} twice")
        seen.add(token)
        if not _is_number(bias) or not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
            limit = f"{MAX_ABS_LOGIT_BIAS:g}"
            raise ValueError(f"logit_bias[{token}] must be a number in [-{limit}, {limit}], got {bias!r}")
    return tuple(sorted((token, float(bias)) for token, bias in pairs))
