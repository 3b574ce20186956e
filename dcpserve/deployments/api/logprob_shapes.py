"""The logprobs objects of the OpenAI responses: the completions API's legacy shape and the chat API's, from the
entries dcpserve/deployments/api/choices.py's Tokens names (token text, or "bytes:\\xNN" for a token that is not UTF-8
alone)."""

from __future__ import annotations

import codecs
from typing import Any

# A token's logprob entry as the ingress hands it over: (token name, logprob or None, [(alternative name, logprob)]).
# A name is the token's text, or (dcpserve/deployments/api/choices.py's Tokens) "bytes:\\x87..." for a token whose own
# bytes are not UTF-8 on their own (OpenAI's naming: the name carries the bytes, so distinct byte tokens never share a
# name).
LogprobEntry = tuple[str, float | None, list[tuple[str, float]] | None]


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
