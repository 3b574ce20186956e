"""Logprob token names of tokens that are part of a character: a byte-level BPE token holding one byte of a multi-byte
character (the tiny model's tokenizer splits every non-ASCII character into such tokens) decodes to U+FFFD alone, so
each is named "bytes:\\xNN" by its own bytes, as OpenAI does: distinct alternatives keep distinct names in the
completions API's top_logprobs dict, and the chat API's `bytes` are the token's bytes. No Ray cluster, no weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dcpserve.cluster.tiny_model import BOS_TOKEN, END_OF_TURN_TOKEN, EOS_TOKEN, train_tokenizer
from dcpserve.deployments.api import protocol
from dcpserve.deployments.api.logprobs import Tokens, _byte_level_bytes, chat_logprobs, completion_logprobs
from dcpserve.deployments.api.responses import ChatShaper, CompletionShaper, ResponseShaper
from dcpserve.engine.protocol import RequestDelta, TokenLogprob
from dcpserve.engine.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny model's tokenizer files (dcpserve/cluster/tiny_model.py writes the same two; the weights are not
    needed), loaded as the ingress loads them."""
    directory: Path = tmp_path_factory.mktemp("tiny-tokenizer")
    train_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False}))
    loaded = load_tokenizer(directory)
    assert loaded is not None
    return loaded


def byte_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids `text` encodes to, one token per UTF-8 byte (checked: the tiny vocabulary merges no non-ASCII)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8")), f"{text!r} no longer encodes to one token per byte"
    return ids


def escaped(raw: bytes) -> str:
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def one_token_body(shaper: ResponseShaper, token_id: int, logprob: float,
                   top: list[tuple[int, float]]) -> dict[str, Any]:
    """The JSON answer of a request whose one choice generated one token."""
    shaper.add(0, RequestDelta("r", [token_id], "", True, "length", 1, 1,
                               logprobs=[TokenLogprob(token_id, logprob, 1, tuple(top))]))
    return shaper.body()


def test_byte_tokens_are_named_by_their_own_bytes(tokenizer: Tokenizer) -> None:
    text = "é€😀"  # 2, 3 and 4 bytes: lead and continuation bytes
    ids = byte_tokens(tokenizer, text)
    tokens = Tokens(tokenizer, as_ids=False)
    assert [tokenizer.decode([t], skip_special_tokens=False) for t in ids] == ["\ufffd"] * 9  # the old names
    assert [tokens.name(t) for t in ids] == [escaped(bytes([b])) for b in text.encode("utf-8")]
    assert tokens.name(ids[1]) == "bytes:\\xa9" and len(tokens.name(ids[1])) == 10
    assert b"".join(tokens.token_bytes(t) for t in ids) == text.encode("utf-8")


def test_every_continuation_byte_token_gets_its_own_name(tokenizer: Tokenizer) -> None:
    # U+0080..U+00BF are C2 80..C2 BF: the second token of each is the single-byte token of 0x80..0xBF.
    ids = [byte_tokens(tokenizer, chr(c))[1] for c in range(0x80, 0xC0)]
    tokens = Tokens(tokenizer, as_ids=False)
    assert [tokens.token_bytes(t) for t in ids] == [bytes([b]) for b in range(0x80, 0xC0)]
    assert [tokens.name(t) for t in ids] == [escaped(bytes([b])) for b in range(0x80, 0xC0)]
    assert len({tokens.name(t) for t in ids}) == 64


def test_the_byte_table_is_gpt2s() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert _byte_level_bytes() == {char: byte for byte, char in bytes_to_unicode().items()}


def test_text_special_and_id_names_are_unchanged(tokenizer: Tokenizer) -> None:
    tokens = Tokens(tokenizer, as_ids=False)
    ids = tokenizer.encode("def main():\n    return 1", add_special_tokens=False)
    assert [tokens.name(t) for t in ids] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert "".join(tokens.name(t) for t in ids) == "def main():\n    return 1"
    assert all(tokens.token_bytes(t) == tokens.name(t).encode("utf-8") for t in ids)
    for special in (BOS_TOKEN, EOS_TOKEN, END_OF_TURN_TOKEN):
        [special_id] = tokenizer.encode(special, add_special_tokens=False)
        assert tokens.name(special_id) == special and tokens.token_bytes(special_id) == special.encode("utf-8")
    [byte] = byte_tokens(tokenizer, "é")[1:]
    assert Tokens(tokenizer, as_ids=True).name(byte) == f"token_id:{byte}"


def test_chat_bytes_are_the_tokens_own_bytes(tokenizer: Tokenizer) -> None:
    lead, tail = byte_tokens(tokenizer, "é")
    [letter] = tokenizer.encode("a", add_special_tokens=False)
    body = protocol.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3})
    shaper = ChatShaper(body, "m", tokenizer, [5], None)
    [out] = one_token_body(shaper, tail, -0.5, [(tail, -0.5), (lead, -1.0), (letter, -2.0)])["choices"]
    [content] = out["logprobs"]["content"]
    assert (content["token"], content["bytes"]) == ("bytes:\\xa9", [0xA9])  # not U+FFFD's [239, 191, 189]
    assert [(t["token"], t["bytes"]) for t in content["top_logprobs"]] == [
        ("bytes:\\xa9", [0xA9]), ("bytes:\\xc3", [0xC3]), ("a", [97])]


def test_completions_top_logprobs_keep_k_distinct_byte_tokens(tokenizer: Tokenizer) -> None:
    ids = byte_tokens(tokenizer, "😀")  # f0 9f 98 80: four tokens that all decoded to U+FFFD
    top = [(t, -0.25 * (i + 1)) for i, t in enumerate(ids)]
    body = protocol.CompletionRequest.model_validate({"model": "m", "prompt": "p", "logprobs": 3, "max_tokens": 1})
    [out] = one_token_body(CompletionShaper(body, "m", tokenizer, [[5]], []), ids[0], -0.25, top)["choices"]
    logprobs = out["logprobs"]
    assert logprobs["tokens"] == ["bytes:\\xf0"] and logprobs["token_logprobs"] == [-0.25]
    assert logprobs["top_logprobs"] == [{"bytes:\\xf0": -0.25, "bytes:\\x9f": -0.5, "bytes:\\x98": -0.75}]
    # The sampled (greedy) token's logprob is the highest shown.
    assert max(logprobs["top_logprobs"][0].values()) == logprobs["token_logprobs"][0]


def test_alternatives_sharing_a_name_keep_the_highest_logprob() -> None:
    shaped = completion_logprobs([("\ufffd", -0.1, [("\ufffd", -0.1), ("a", -0.5), ("\ufffd", -0.7)])])
    assert shaped["top_logprobs"] == [{"\ufffd": -0.1, "a": -0.5}]
    # Not in top-k order: still the higher one.
    shaped = completion_logprobs([("x", -0.1, [("a", -2.0), ("a", -1.0)])])
    assert shaped["top_logprobs"] == [{"a": -1.0}]


def test_text_offsets_index_the_decoded_text(tokenizer: Tokenizer) -> None:
    tokens = Tokens(tokenizer, as_ids=False)
    ids = tokenizer.encode("aé€b", add_special_tokens=False)
    names = [tokens.name(t) for t in ids]
    assert names == ["a", "bytes:\\xc3", "bytes:\\xa9", "bytes:\\xe2", "bytes:\\x82", "bytes:\\xac", "b"]
    offsets = completion_logprobs([(name, -1.0, None) for name in names], text_offset=2)["text_offset"]
    # A character's bytes all sit at its offset, and it counts once, after its last byte: a, é, €, b at 2, 3, 4, 5.
    assert offsets == [2, 3, 3, 4, 4, 4, 5]

    def offsets_of(*parts: str) -> list[int]:
        return completion_logprobs([(part, -1.0, None) for part in parts])["text_offset"]

    # Bytes that make no character count as the U+FFFD the detokenizer writes for them ("\ufffdbc", "\ufffda",
    # "\ufffd\u00e9b"), and a token of two bytes of one character is at that character's offset.
    assert offsets_of("bytes:\\xe2", "b", "c") == [0, 1, 2]
    assert offsets_of("bytes:\\x80", "a") == [0, 1]
    assert offsets_of("bytes:\\xc3", "bytes:\\xc3", "bytes:\\xa9", "b") == [0, 1, 1, 2]
    assert offsets_of("bytes:\\xe2\\x82", "bytes:\\xac", "x") == [0, 0, 1]


def test_a_byte_fallback_tokens_name_is_its_byte() -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<0x87>": 1, "<0xE2>": 2, "<0x41>": 3, "▁the": 4}
    raw = RawTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokens = Tokens(Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw)), as_ids=False)
    assert [tokens.name(t) for t in (1, 2, 3)] == ["bytes:\\x87", "bytes:\\xe2", "A"]
    assert [tokens.token_bytes(t) for t in (1, 2, 3)] == [b"\x87", b"\xe2", b"A"]
    assert tokens.name(4).strip() == "the"  # an ordinary piece: its decoded text, as before


def test_chat_bytes_of_a_plain_name_are_its_utf8() -> None:
    shaped = chat_logprobs([("é", -0.5, [("é", -0.5), ("bytes:\\xc3\\xa9x", -1.0)])])
    [content] = shaped["content"]
    assert content["bytes"] == [0xC3, 0xA9]
    # Not a run of \xNN escapes: a name like any other.
    assert content["top_logprobs"][1]["bytes"] == list(b"bytes:\\xc3\\xa9x")
