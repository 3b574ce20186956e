"""The choices of one OpenAI request: every prompt of a completions batch times n (or best_of) sequences.

Each choice is its own engine sequence with its own ticket, admitted by its own KV need (admission counts each
choice; they share no blocks until prefix caching exists). `plan_choices` builds them (choice j of a seeded request
samples with seed + j, so it equals a one-choice request with that seed); `collect` gathers a finished choice;
`completion_choices` / `chat_choices` turn results into OpenAI's choice objects (echo, logprobs in both APIs'
shapes, best_of ranking by cumulative logprob); `Tokens` names tokens for logprobs.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from dcpserve.deployments.api import protocol
from dcpserve.deployments.api.logprob_shapes import LogprobEntry, chat_logprobs, completion_logprobs
from dcpserve.deployments.messages import Need
from dcpserve.engine.protocol import RequestDelta, TokenLogprob
from dcpserve.engine.sampling_params import SamplingParams


@dataclass
class Choice:
    """One sequence of a request and, once it ran, what it produced."""

    index: int  # generation order: prompt i, sequence j -> i * sequences_per_prompt + j
    prompt_index: int
    prompt_ids: list[int]
    prompt_text: str | None  # the prompt as the client sent it, when it was a string
    params: SamplingParams
    need: Need  # KV blocks admission counts for it (per pool with layout pools: admission/pools.py)
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


async def collect(choice: Choice, session: AsyncIterator[RequestDelta]) -> Choice:
    async for delta in session:
        choice.add(delta)
    return choice


@functools.cache
def _byte_level_bytes() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table reversed: byte-level BPE writes every byte as one printable character (bytes
    that are printable already as themselves, the others shifted past 255), so a token's string maps back to its
    raw bytes character by character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


# A SentencePiece byte-fallback token: one raw byte, written "<0x87>".
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokens:
    """Token names for logprobs: the token's own text (special tokens included), 'bytes:\\x..' for a token whose
    own bytes are not UTF-8 on their own (as OpenAI names them: decoding would give U+FFFD, so distinct tokens would
    share one name), or 'token_id:<id>'."""

    def __init__(self, tokenizer: Any, as_ids: bool) -> None:
        self._tokenizer = tokenizer
        self._as_ids = as_ids or tokenizer is None
        self._names: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        # The Hugging Face tokenizer, whether it is byte-level and its added token ids: looked up on first use.
        self._looked_up = False
        self._hf: Any = None
        self._byte_level = False
        self._added: set[int] = set()

    def name(self, token_id: int) -> str:
        if self._as_ids:
            return f"token_id:{token_id}"
        name = self._names.get(token_id)
        if name is None:
            raw = self.token_bytes(token_id)
            try:
                raw.decode("utf-8")
                name = self._decode(token_id)
            except UnicodeDecodeError:
                name = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._names[token_id] = name
        return name

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: from a byte-level BPE token's characters or a byte-fallback token's "<0xNN>";
        for any other token (special and added tokens included) its decoded text's UTF-8."""
        raw = self._bytes.get(token_id)
        if raw is None:
            own = self._own_bytes(token_id)
            raw = own if own is not None else self._decode(token_id).encode("utf-8")
            self._bytes[token_id] = raw
        return raw

    def _decode(self, token_id: int) -> str:
        text: str = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _own_bytes(self, token_id: int) -> bytes | None:
        """The bytes the tokenizer's vocabulary gives the token, or None where it gives none of its own."""
        if not self._looked_up:
            self._look_up()
        if self._hf is None or token_id in self._added:
            return None
        try:
            piece = self._hf.convert_ids_to_tokens(token_id)
        except (IndexError, KeyError, OverflowError, TypeError, ValueError):
            return None
        if not isinstance(piece, str):
            return None
        if self._byte_level:
            table = _byte_level_bytes()
            if piece and all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return None
        match = _BYTE_FALLBACK.fullmatch(piece)
        return bytes([int(match.group(1), 16)]) if match else None

    def _look_up(self) -> None:
        """The Hugging Face tokenizer (dcpserve.engine.tokenizer.Tokenizer keeps it in `_tokenizer`; a bare one is used
        as it is), whether its decoder is byte-level (a ByteLevel decoder, alone or in a Sequence) and its added tokens
        (their text is not byte-level encoded, so it is never mapped through the byte table)."""
        self._looked_up = True
        candidates = (getattr(self._tokenizer, "hf_tokenizer", None), getattr(self._tokenizer, "_tokenizer", None),
                      self._tokenizer)
        hf = next((t for t in candidates if hasattr(t, "convert_ids_to_tokens")), None)
        if hf is None:
            return
        self._hf = hf
        self._added = {int(i) for i in getattr(hf, "added_tokens_decoder", {}) or {}}
        self._added.update(int(i) for i in getattr(hf, "all_special_ids", []) or [])
        if isinstance(getattr(hf, "byte_decoder", None), dict):  # a slow GPT-2 style tokenizer
            self._byte_level = True
            return
        decoder = getattr(getattr(hf, "backend_tokenizer", None), "decoder", None)
        try:
            state = json.loads(decoder.__getstate__()) if decoder is not None else {}
        except (AttributeError, TypeError, ValueError):
            state = {}
        parts = state.get("decoders", [state]) if isinstance(state, dict) else []
        self._byte_level = any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)

    def entry(self, logprob: TokenLogprob | None, token_id: int, k: int) -> LogprobEntry:
        """(name, logprob, top-k alternatives); logprob None (the first prompt token has none) gives (name, None,
        None)."""
        if logprob is None:
            return self.name(token_id), None, None
        top = [(self.name(t), lp) for t, lp in logprob.top[:k]]
        return self.name(token_id), logprob.logprob, top

    def vllm_prompt_logprobs(self, prompt_ids: list[int], entries: list[TokenLogprob | None]) -> list[Any]:
        """vLLM's prompt_logprobs shape: per prompt token None or {token_id: {logprob, rank, decoded_token}}."""
        out: list[Any] = []
        for token_id, entry in zip(prompt_ids, entries, strict=False):
            if entry is None:
                out.append(None)
                continue
            item = {str(t): {"logprob": lp, "rank": r + 1, "decoded_token": self.name(t)}
                    for r, (t, lp) in enumerate(entry.top)}
            item[str(token_id)] = {"logprob": entry.logprob, "rank": entry.rank,
                                   "decoded_token": self.name(token_id)}
            out.append(item)
        return out


def pick_best(choices: list[Choice], per_prompt: int, n: int) -> list[Choice]:
    """best_of: of each prompt's `per_prompt` sequences, the n with the highest cumulative logprob (stable)."""
    if per_prompt == n:
        return choices
    picked: list[Choice] = []
    for start in range(0, len(choices), per_prompt):
        group = choices[start:start + per_prompt]
        picked += sorted(group, key=lambda c: -c.cumulative_logprob)[:n]
    return picked


def completion_choices(body: protocol.CompletionRequest, choices: list[Choice], tokens: Tokens,
                       prompt_texts: list[str]) -> list[dict[str, Any]]:
    """OpenAI completions choices: index i * n + j, echo (the prompt's text, and with logprobs its tokens'
    logprobs first), logprobs, vLLM's prompt_logprobs."""
    n = body.n
    picked = pick_best(choices, body.num_choices(), n)
    score_only = body.max_tokens == 0
    out = []
    for position, choice in enumerate(picked):
        generated = "" if score_only else "".join(choice.text)
        prompt_text = prompt_texts[choice.prompt_index] if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            k = body.logprobs
            entries: list[LogprobEntry] = []
            if body.echo:
                prompt_lp = choice.prompt_logprobs or [None] * len(choice.prompt_ids)
                entries += [tokens.entry(lp, t, k) for t, lp in zip(choice.prompt_ids, prompt_lp, strict=False)]
            if not score_only:
                entries += [tokens.entry(lp, t, k) for t, lp in zip(choice.token_ids, choice.logprobs, strict=False)]
            logprobs = completion_logprobs(entries)
        prompt_logprobs = None
        if body.prompt_logprobs is not None and choice.prompt_logprobs is not None:
            prompt_logprobs = tokens.vllm_prompt_logprobs(choice.prompt_ids, choice.prompt_logprobs)
        out.append(protocol.completion_choice(
            choice.prompt_index * n + position % n, prompt_text + generated,
            "length" if score_only else choice.finish, logprobs, prompt_logprobs))
    return out


def chat_choices(body: protocol.ChatCompletionRequest, choices: list[Choice], tokens: Tokens) -> list[dict[str, Any]]:
    out = []
    for choice in choices:
        logprobs = None
        if body.logprobs:
            k = body.top_logprobs or 0
            logprobs = chat_logprobs([tokens.entry(lp, t, k)
                                               for t, lp in zip(choice.token_ids, choice.logprobs, strict=False)])
        out.append(protocol.chat_choice(choice.index, "".join(choice.text), choice.finish, logprobs))
    return out


def usage(prompts: list[list[int]], choices: list[Choice], score_only: bool) -> dict[str, int]:
    """Prompt tokens once per prompt; completion tokens of every sequence generated (best_of's extra ones too: they
    were computed). Scoring a prompt (max_tokens 0) generates nothing."""
    generated = 0 if score_only else sum(c.num_output for c in choices)
    return protocol.usage(sum(len(p) for p in prompts), generated)
