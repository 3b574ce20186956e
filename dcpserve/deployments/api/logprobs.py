"""Logprobs in the OpenAI responses: token names (`Tokens`), the completions API's legacy logprobs object, the chat
API's, and vLLM's prompt_logprobs. Only dcpserve/deployments/api/responses.py shapes responses with them."""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from dcpserve.engine.protocol import TokenLogprob

# A token's logprob entry: (token name, logprob or None, [(alternative name, logprob)]). A name is the token's text, or
# (Tokens below) "bytes:\\x87..." for a token whose own bytes are not UTF-8 on their own (OpenAI's naming: the name
# carries the bytes, so distinct byte tokens never share a name).
LogprobEntry = tuple[str, float | None, list[tuple[str, float]] | None]


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

    def entries(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None], k: int) -> list[LogprobEntry]:
        """(name, logprob, top-k alternatives) per token, paired in order (tokens past the last logprob are left
        out); a None logprob (the first prompt token has none) gives (name, None, None)."""
        out: list[LogprobEntry] = []
        for token_id, logprob in zip(token_ids, logprobs, strict=False):
            if logprob is None:
                out.append((self.name(token_id), None, None))
            else:
                top = [(self.name(t), lp) for t, lp in logprob.top[:k]]
                out.append((self.name(token_id), logprob.logprob, top))
        return out

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


def logprob_token_bytes(token: str) -> bytes:
    """A logprob token name's bytes: those a "bytes:\\xNN..." name spells out, else the name's UTF-8."""
    if token.startswith("bytes:\\x"):
        pieces = token[len("bytes:\\x"):].split("\\x")
        if all(len(p) == 2 and all(c in "0123456789abcdefABCDEF" for c in p) for p in pieces):
            return bytes(int(p, 16) for p in pieces)
    return token.encode("utf-8")


def completion_logprobs(entries: list[LogprobEntry], text_offset: int = 0) -> dict[str, Any]:
    """The completions API's (legacy) logprobs object; text_offset of each token counts from `text_offset`.

    Offsets index the text the tokens decode to: tokens that are parts of one character ("bytes:" names) are at the
    character's offset, and the character counts once, when its last byte comes; bytes that no later token completes
    count as the one U+FFFD the detokenizer writes for them. In top_logprobs ({name: logprob}) two alternatives that
    still share a name (decoded text only) keep the higher logprob, the one listed first."""
    def continues(partial: bytes) -> bool:
        try:
            codecs.utf_8_decode(partial, "strict", False)  # not final: an unfinished character is no error
        except UnicodeDecodeError:
            return False
        return True

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, position = [], text_offset
    for token, _, _ in entries:
        raw = logprob_token_bytes(token)
        pending = decoder.getstate()[0]
        # An unfinished character this token does not continue ends before it, as one U+FFFD.
        offsets.append(position + (1 if pending and raw and not continues(pending + raw[:1]) else 0))
        position += len(decoder.decode(raw))

    def best(top: list[tuple[str, float]]) -> dict[str, float]:
        named: dict[str, float] = {}
        for token, logprob in top:
            if token not in named or logprob > named[token]:
                named[token] = logprob
        return named

    return {
        "tokens": [token for token, _, _ in entries],
        "token_logprobs": [logprob for _, logprob, _ in entries],
        "top_logprobs": [best(top) if top is not None else None for _, _, top in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """The chat API's logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}; `bytes` is the token's
    own bytes (those of a "bytes:\\x.." name, not the UTF-8 of the name)."""
    def item(token: str, logprob: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(logprob_token_bytes(token))}

    return {"content": [{**item(token, logprob), "top_logprobs": [item(t, lp) for t, lp in top or []]}
                        for token, logprob, top in entries]}
