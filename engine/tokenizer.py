"""Text <-> token ids for the engine: a transformers tokenizer loaded offline, plus incremental detokenization.

Decoding never applies `clean_up_tokenization_spaces`: the cleanup rewrites text across token boundaries
(" ." -> "."), so streamed deltas would stop adding up to the full decode. Full and incremental decodes here agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams

# Any of these in a model directory means it ships a tokenizer (loading it must then succeed).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """One model's tokenizer: encode, decode, chat template and the set of ids that end generation."""

    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Iterable[int] = (), source: str = "tokenizer") -> None:
        self._tokenizer = hf_tokenizer
        self._source = source
        eos = {int(i) for i in extra_eos_ids}
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self._eos_token_ids = frozenset(eos)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """Loads with transformers.AutoTokenizer from local files only (no download is ever attempted)."""
        from transformers import AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        return cls(hf_tokenizer, extra_eos_ids, source=str(model_dir))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added and special tokens included."""
        return len(self._tokenizer)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's EOS id merged with the extra ids given (the model's generation_config EOS ids)."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._tokenizer.bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered by the tokenizer's chat template (BOS comes from the template)."""
        if not self.has_chat_template:
            raise ValueError(
                f"{self._source}: the tokenizer has no chat template, so chat messages cannot be turned into a "
                f"prompt; send a plain-text prompt (completions) or use a model whose tokenizer_config.json "
                f"has a chat_template"
            )
        _check_messages(messages)
        text = self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        # The template writes BOS itself, as Hugging Face's own tokenize=True path assumes.
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(model_dir: str | Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer | None:
    """The tokenizer of a model directory (or of a config.json's directory); None when it ships no tokenizer files."""
    path = Path(model_dir)
    directory = path.parent if path.is_file() else path
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {directory} does not exist; pass the directory holding config.json")
    present = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    if not present:
        return None
    try:
        return Tokenizer.from_pretrained(directory, extra_eos_ids)
    except Exception as err:  # transformers raises many types for broken files
        raise ValueError(
            f"{directory}: tokenizer files {present} are present but could not be loaded "
            f"({type(err).__name__}: {err}); repair or re-copy them, or remove them to serve token ids only"
        ) from err


def _check_messages(messages: list[dict[str, str]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {messages!r}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict with 'role' and 'content', got {message!r}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"messages[{index}][{key!r}] must be a string, got {message.get(key)!r}")


class IncrementalDetokenizer:
    """Turns one request's generated ids into text deltas, holding back bytes of an unfinished UTF-8 character.

    Invariant (vLLM's): `read_offset` is a token boundary where the text so far is complete, and `prefix_offset`
    an earlier one. Each push decodes tokens[prefix_offset:] and tokens[prefix_offset:read_offset] and emits the
    difference, so a decoder that treats the first token of a window specially (SentencePiece dropping a leading
    space) sees the same context both times. While the decoded window ends in U+FFFD the last token ends inside a
    multi-byte character: nothing is emitted until a later token completes it.
    """

    # Context tokens kept before the read offset when seeding from a prompt.
    _PROMPT_CONTEXT = 6

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)
        self._num_prompt_ids = len(self._ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - self._PROMPT_CONTEXT)
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        """All completed text of the generated ids so far (the sum of the deltas returned)."""
        return "".join(self._text_parts)

    @property
    def token_ids(self) -> list[int]:
        """The generated ids pushed so far (prompt ids excluded)."""
        return self._ids[self._num_prompt_ids:]

    def push(self, token_id: int) -> str:
        """Adds one generated id; returns the text it completes ("" while a character is still incomplete)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text_parts.append(delta)
        return delta

    def flush(self) -> str:
        """Emits what is still held back (an unfinished character decodes to U+FFFD); call when the request ends."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if delta:
            self._text_parts.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""


class TextStream:
    """One request's output text for either engine backend: incremental detokenization (seeded with the prompt) and
    stop strings, found in the text, cut there, and held back while the text might still be the start of one.

    As vLLM: a stop string only counts when it ends after the text of the first `min_tokens` tokens; with
    `include_stop_str_in_output` the text keeps the stop string (cut after it) and nothing is held back."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: Sequence[int], stop: Sequence[str] = (), *,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        self._detokenizer = (IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
                             if tokenizer is not None else None)
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._hold = 0 if include_stop_str_in_output else max((len(s) - 1 for s in self._stop), default=0)
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._stop_from: int | None = 0 if min_tokens == 0 else None  # text offset a stop string must end after
        self._emitted = 0  # characters of text already returned
        self.text = ""

    @classmethod
    def for_params(cls, tokenizer: Tokenizer | None, prompt_ids: Sequence[int], params: SamplingParams) -> TextStream:
        """The stream a request with these SamplingParams gets (stop strings, min_tokens, include_stop_str_in_output,
        skip_special_tokens)."""
        return cls(tokenizer, prompt_ids, params.stop or (),
                   include_stop_str_in_output=params.include_stop_str_in_output,
                   skip_special_tokens=params.skip_special_tokens, min_tokens=params.min_tokens)

    def push(self, token_ids: Sequence[int], finished: bool) -> tuple[str, bool]:
        """Adds generated tokens; returns (the text now safe to send, whether a stop string was found). A found stop
        string ends the request: the text is cut before it (after it with include_stop_str_in_output) and
        everything up to there is returned."""
        for token in token_ids:
            if self._detokenizer is not None:
                self._detokenizer.push(token)
            self._num_tokens += 1
            if self._stop_from is None and self._num_tokens >= self._min_tokens:
                # The text of the first min_tokens tokens (what the detokenizer could complete of it).
                self._stop_from = len(self._detokenizer.text) if self._detokenizer is not None else 0
        if self._detokenizer is not None:
            if finished:
                self._detokenizer.flush()
            self.text = self._detokenizer.text
        stop_at, stop_len = self._find_stop()
        if stop_at >= 0:
            self.text = self.text[:stop_at + stop_len] if self._include_stop else self.text[:stop_at]
        hold = 0 if finished or stop_at >= 0 else self._hold
        upto = max(self._emitted, len(self.text) - hold)
        new_text = self.text[self._emitted:upto]
        self._emitted = upto
        return new_text, stop_at >= 0

    def _find_stop(self) -> tuple[int, int]:
        """(where the first stop string in the text starts, its length), or (-1, 0)."""
        if not self._stop or self._stop_from is None:
            return -1, 0
        found = [(at, len(stop)) for stop in self._stop
                 if (at := self.text.find(stop, max(0, self._stop_from - len(stop) + 1))) >= 0]
        return min(found, default=(-1, 0))
