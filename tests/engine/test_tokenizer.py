"""Tokenizer wrapper and incremental detokenization, on the tiny model's byte-level BPE tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer, load_tokenizer

TEXTS = [
    "def main():\n    return 1  # ascii",
    "héllo wörld ✓ 日本",
    "emoji 👍🏽 and 𝄞 clef, ZWJ 👩‍💻, combining e\u0301",
    "Ελληνικά, русский, العربية, עברית, हिन्दी, 한국어",
    "  leading spaces, trailing\t\n",
    "",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tok") / "model")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Tokenizer:
    loaded = load_tokenizer(tiny_dir)
    assert loaded is not None
    return loaded


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id == 0
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


def test_multibyte_text_spans_tokens(tokenizer: Tokenizer) -> None:
    # The test of the detokenizer below is only meaningful if some character is split across tokens.
    ids = tokenizer.encode("日本", add_special_tokens=False)
    assert len(ids) > 2
    assert REPLACEMENT_CHAR in tokenizer.decode(ids[:1])


def test_sizes_and_eos(tiny_dir: Path, tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 512
    assert tokenizer.eos_token_ids == frozenset({1})  # the tokenizer's own <|end_of_text|>
    merged = load_tokenizer(tiny_dir / "config.json", extra_eos_ids=(1, 4))  # a config.json path works too
    assert merged is not None and merged.eos_token_ids == frozenset({1, 4})


def test_chat_template(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi ✓"}]
    ids = tokenizer.apply_chat_template(messages)
    assert ids[0] == 0 and ids.count(0) == 1  # BOS once, from the template
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi ✓<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert tokenizer.decode(without, skip_special_tokens=False).endswith("hi ✓<|eot_id|>")
    assert tokenizer.decode(ids) == "system\n\nBe brief.user\n\nhi ✓assistant\n\n"


@pytest.mark.parametrize("messages,message", [
    ([], "non-empty list"),
    ([{"role": "user"}], r"messages\[0\]\['content'\] must be a string"),
    (["hi"], r"messages\[0\] must be a dict"),
])
def test_chat_template_rejects_bad_messages(tokenizer: Tokenizer, messages: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tokenizer.apply_chat_template(messages)


def test_no_chat_template_is_a_clear_error(tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    bare = load_tokenizer(tmp_path)
    assert bare is not None and not bare.has_chat_template
    assert bare.decode(bare.encode("héllo")) == "héllo"
    with pytest.raises(ValueError, match="has no chat template.*plain-text prompt"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_load_tokenizer_none_missing_and_broken(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer files \['tokenizer.json'\] are present but could not be loaded"):
        load_tokenizer(tmp_path)


def _assert_prefix_consistent(tokenizer: Tokenizer, ids: list[int], detok: IncrementalDetokenizer) -> None:
    """detok.text is the full decode of the prefix, minus a trailing unfinished character."""
    full = tokenizer.decode(ids)
    if full.endswith(REPLACEMENT_CHAR):
        assert full.startswith(detok.text)
        assert set(full[len(detok.text):]) == {REPLACEMENT_CHAR}
    else:
        assert detok.text == full


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_matches_full_decode_at_every_prefix(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = []
    for k, token_id in enumerate(ids, start=1):
        delta = detok.push(token_id)
        assert REPLACEMENT_CHAR not in delta
        deltas.append(delta)
        _assert_prefix_consistent(tokenizer, ids[:k], detok)
    assert "".join(deltas) == detok.text == text
    assert detok.flush() == ""
    assert detok.token_ids == ids


def test_incremental_detokenizer_with_prompt_and_special_tokens(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "日本?"}])
    answer = tokenizer.encode("はい、日本です ✓", add_special_tokens=False) + [4]  # ends with <|eot_id|>
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    text = "".join(detok.push(t) for t in answer)
    assert text == detok.text == "はい、日本です ✓"  # the prompt is context only; <|eot_id|> is skipped
    keep = IncrementalDetokenizer(tokenizer, prompt_ids=prompt, skip_special_tokens=False)
    assert "".join(keep.push(t) for t in answer) == "はい、日本です ✓<|eot_id|>"


def test_flush_emits_an_unfinished_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 日", add_special_tokens=False)
    assert tokenizer.decode(ids[:-1]).endswith(REPLACEMENT_CHAR)  # the last token completes 日
    detok = IncrementalDetokenizer(tokenizer)
    pushed = "".join(detok.push(t) for t in ids[:-1])
    assert pushed.startswith("ok") and REPLACEMENT_CHAR not in pushed
    tail = detok.flush()
    assert REPLACEMENT_CHAR in tail
    assert pushed + tail == detok.text == tokenizer.decode(ids[:-1])
    assert detok.flush() == ""


def test_a_tokenizer_of_the_models_own_code_needs_trust_remote_code(tiny_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """tokenizer_config.json's auto_map names a class the directory ships (Kimi-K2's way): refused naming
    trust_remote_code, loaded (that class) with it."""
    import json

    import transformers.dynamic_module_utils

    model = tmp_path / "model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, model / name)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": [None, "tokenization_own.OwnTokenizer"]}, tokenizer_class="OwnTokenizer")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "tokenization_own.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass OwnTokenizer(PreTrainedTokenizerFast):\n"
        "    ships_its_code = True\n")
    with pytest.raises(ValueError, match=r"tokenization_own.OwnTokenizer.*set trust_remote_code: true"):
        load_tokenizer(model)
    # transformers copies the code to its modules cache: a temporary one here
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    trusted = load_tokenizer(model, trust_remote_code=True)
    assert trusted is not None and getattr(trusted.hf_tokenizer, "ships_its_code", False)
    assert trusted.decode(trusted.encode("héllo")) == "héllo"
