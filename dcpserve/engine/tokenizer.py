"""Text <-> token ids for the engine: a transformers tokenizer loaded offline, plus incremental detokenization.

Decoding never applies `clean_up_tokenization_spaces`: the cleanup rewrites text across token boundaries
(" ." -> "."), so streamed deltas would stop adding up to the full decode. Full and incremental decodes here agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcpserve.engine.sampling_params import SamplingParams

# Any of these in a model directory means it ships a tokenizer (loading it must then succeed).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

REPLACEMENT_CHAR = "\ufffd"
# Arguments of the chat template call that the server sets itself: a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "chat_template", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class ChatTemplateKwargsError(ValueError):
    """A request's chat_template_kwargs that the chat template cannot take (the client's error, named by field)."""


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
    def from_pretrained(cls, model_dir: str | Path, extra_eos_ids: Iterable[int] = (),
                        trust_remote_code: bool = False) -> Tokenizer:
        """Loads with transformers.AutoTokenizer from local files only (no download is ever attempted); the
        directory's own tokenizer code runs only with trust_remote_code."""
        from transformers import AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True,
                                                     trust_remote_code=trust_remote_code)
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
    def hf_tokenizer(self) -> Any:
        """The Hugging Face tokenizer (the grammar engine reads its vocabulary)."""
        return self._tokenizer

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

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` of a fast tokenizer (incremental decoding in Rust), else None."""
        return getattr(self._tokenizer, "backend_tokenizer", None)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    @property
    def template_renders_tools(self) -> bool:
        """The chat template takes a `tools` list (Hugging Face's convention): tools go through it."""
        return self.has_chat_template and "tools" in str(self._tokenizer.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation rendered by the tokenizer's chat template (BOS comes from the template);
        `tools` (OpenAI's definitions) are passed to a template that renders them, `template_kwargs` (a request's
        chat_template_kwargs, e.g. {"enable_thinking": false}) as the template's variables. ValueError when the
        template cannot render: ChatTemplateKwargsError when it is template_kwargs that it cannot take."""
        if not self.has_chat_template:
            raise ValueError(
                f"{self._source}: the tokenizer has no chat template, so chat messages cannot be turned into a "
                f"prompt; send a plain-text prompt (completions) or use a model whose tokenizer_config.json "
                f"has a chat_template"
            )
        _check_messages(messages)
        extra = dict(template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(extra))
        if reserved:
            raise ChatTemplateKwargsError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets "
                f"{'it' if len(reserved) == 1 else 'them'} from the request's own fields; drop "
                f"{'it' if len(reserved) == 1 else 'them'} from chat_template_kwargs")
        if tools:
            extra["tools"] = tools
        try:
            text = self._render(messages, add_generation_prompt, extra)
        except ValueError as err:
            if not template_kwargs:
                raise
            try:  # the same conversation without the request's kwargs: if it renders, they are at fault
                self._render(messages, add_generation_prompt, {"tools": tools} if tools else {})
            except ValueError:
                raise err from None
            raise ChatTemplateKwargsError(f"chat_template_kwargs {template_kwargs!r}: the chat template cannot "
                                          f"render with them ({err})") from None
        # The template writes BOS itself, as Hugging Face's own tokenize=True path assumes.
        return self.encode(text, add_special_tokens=False)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: dict[str, Any]) -> str:
        """The template's text; any failure of the template itself (its raise_exception, an undefined variable, a
        type it cannot iterate) is a ValueError with the template's reason."""
        import jinja2

        try:
            text: str = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise ValueError(f"the chat template cannot render this conversation: {type(err).__name__}: "
                             f"{' '.join(str(err).split())[:300]}") from None
        return text


def load_tokenizer(model_dir: str | Path, extra_eos_ids: Iterable[int] = (),
                   trust_remote_code: bool = False) -> Tokenizer | None:
    """The tokenizer of a model directory (or of a config.json's directory); None when it ships no tokenizer files.
    A tokenizer whose class is the directory's own code (tokenizer_config.json's auto_map) loads only with
    trust_remote_code; without it the error names the argument."""
    path = Path(model_dir)
    directory = path.parent if path.is_file() else path
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {directory} does not exist; pass the directory holding config.json")
    present = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    if not present:
        return None
    custom = _custom_tokenizer_code(directory)
    if custom is not None and not trust_remote_code:
        raise ValueError(
            f"{directory}: the tokenizer is the model's own code ({custom}, tokenizer_config.json's auto_map), which "
            f"runs only with trust_remote_code: set trust_remote_code: true (--trust-remote-code) if you trust "
            f"this model directory's Python files"
        )
    try:
        return Tokenizer.from_pretrained(directory, extra_eos_ids, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises many types for broken files
        hint = "repair or re-copy them, or remove them to serve token ids only"
        tokenizer_class = _tokenizer_config(directory).get("tokenizer_class")
        if not trust_remote_code and isinstance(tokenizer_class, str) and tokenizer_class in str(err):
            hint = (f"the tokenizer_class {tokenizer_class!r} is not one of transformers': if the model ships its code "
                    f"(auto_map), set trust_remote_code: true; else {hint}")
        raise ValueError(
            f"{directory}: tokenizer files {present} are present but could not be loaded "
            f"({type(err).__name__}: {err}); {hint}"
        ) from err


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json as a dict ({} when absent or unreadable: loading reports a broken file itself)."""
    import json

    try:
        raw = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _custom_tokenizer_code(directory: Path) -> str | None:
    """The class a tokenizer_config.json's auto_map names for AutoTokenizer (the directory's own code), or None."""
    auto_map = _tokenizer_config(directory).get("auto_map")
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    if isinstance(entry, list):
        entry = next((e for e in entry if isinstance(e, str)), None)
    return entry if isinstance(entry, str) and entry else None


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {messages!r}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict with 'role' and 'content', got {message!r}")
        for key in ("role", "content"):
            if key == "content" and message.get("tool_calls") and message.get(key) is None:
                continue  # an assistant's turn of tool calls
            if not isinstance(message.get(key), str):
                raise ValueError(f"messages[{index}][{key!r}] must be a string, got {message.get(key)!r}")


class IncrementalDetokenizer:
    """Turns one request's generated ids into text deltas, holding back bytes of an unfinished UTF-8 character.

    Fast tokenizers (a `tokenizers.Tokenizer` backend) decode with the library's `DecodeStream`: constant work per
    token, in Rust. It is primed with the last prompt tokens (their text discarded), so a decoder that treats the
    first token of a window specially (SentencePiece dropping a leading space) sees the same context as a full
    decode; a prompt that ends inside a character primes nothing, so its stray bytes are not emitted as output.

    Other tokenizers use vLLM's offsets: `read_offset` is a token boundary where the text so far is complete, and
    `prefix_offset` an earlier one. Each push decodes tokens[prefix_offset:] and tokens[prefix_offset:read_offset]
    and emits the difference; while the decoded window ends in U+FFFD nothing is emitted.
    """

    # Context tokens kept before the first generated token.
    _PROMPT_CONTEXT = 6

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._generated: list[int] = []
        self._pending: list[int] = []  # generated ids whose text is still held back
        self._text_parts: list[str] = []
        context = list(prompt_ids[-self._PROMPT_CONTEXT:])
        self._backend = tokenizer.backend
        self._stream = self._primed_stream(context) if self._backend is not None else None
        # The offsets of the fallback path (over context + generated ids).
        self._ids: list[int] = context
        self._read_offset = len(context)
        self._prefix_offset = 0

    def _primed_stream(self, context: list[int]) -> Any:
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        last: str | None = ""
        for token in context:
            last = stream.step(self._backend, token)
        if last is None:  # the prompt ends inside a character: do not let its bytes leak into the output
            stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        return stream

    @property
    def text(self) -> str:
        """All completed text of the generated ids so far (the sum of the deltas returned)."""
        return "".join(self._text_parts)

    @property
    def token_ids(self) -> list[int]:
        """The generated ids pushed so far (prompt ids excluded)."""
        return list(self._generated)

    def push(self, token_id: int) -> str:
        """Adds one generated id; returns the text it completes ("" while a character is still incomplete)."""
        token_id = int(token_id)
        self._generated.append(token_id)
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id)
            if delta is None:
                self._pending.append(token_id)
                return ""
            self._pending.clear()
        else:
            delta = self._push_with_offsets(token_id)
        if delta:
            self._text_parts.append(delta)
        return delta

    def _push_with_offsets(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Emits what is still held back (an unfinished character decodes to U+FFFD); call when the request ends."""
        if self._stream is not None:
            delta = self._decode(self._pending)
            self._pending.clear()
        else:
            if self._read_offset == len(self._ids):
                return ""
            prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            delta = self._decode(self._ids[self._prefix_offset:])[len(prefix_text):]
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
    `include_stop_str_in_output` the text keeps the stop string (cut after it) and nothing is held back.
    Work per push is constant in the length of the text: only the new text and the few characters before it (a stop
    string may start there) are searched, and only the text not yet returned is kept apart."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: Sequence[int], stop: Sequence[str] = (), *,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        self._detokenizer = (IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
                             if tokenizer is not None else None)
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._lookback = max((len(s) - 1 for s in self._stop), default=0)
        self._hold = 0 if include_stop_str_in_output else self._lookback
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._stop_from: int | None = 0 if min_tokens == 0 else None  # text offset a stop string must end after
        self._length = 0  # characters of text so far
        self._unsent = ""  # the text after what was returned (held back: it may start a stop string)
        self._recent = ""  # the last _lookback characters of the text

    @classmethod
    def for_params(cls, tokenizer: Tokenizer | None, prompt_ids: Sequence[int], params: SamplingParams) -> TextStream:
        """The stream a request with these SamplingParams gets (stop strings, min_tokens, include_stop_str_in_output,
        skip_special_tokens; no text with detokenize=False)."""
        return cls(tokenizer if params.detokenize else None, prompt_ids, params.stop or (),
                   include_stop_str_in_output=params.include_stop_str_in_output,
                   skip_special_tokens=params.skip_special_tokens, min_tokens=params.min_tokens)

    def push(self, token_ids: Sequence[int], finished: bool) -> tuple[str, bool]:
        """Adds generated tokens; returns (the text now safe to send, whether a stop string was found). A found stop
        string ends the request: the text is cut before it (after it with include_stop_str_in_output) and
        everything up to there is returned."""
        if (not self._stop and not finished and self._stop_from is not None and len(token_ids) == 1
                and self._detokenizer is not None):  # the common step: one token, no stop string to look for
            delta = self._detokenizer.push(token_ids[0])
            self._num_tokens += 1
            self._length += len(delta)
            return delta, False
        pieces: list[str] = []
        for token in token_ids:
            if self._detokenizer is not None:
                pieces.append(self._detokenizer.push(token))
            self._num_tokens += 1
            if self._stop_from is None and self._num_tokens >= self._min_tokens:
                # The text of the first min_tokens tokens (what the detokenizer could complete of it).
                self._stop_from = self._length + sum(len(p) for p in pieces)
        if self._detokenizer is not None and finished:
            pieces.append(self._detokenizer.flush())
        new = "".join(pieces)
        start = self._length - len(self._recent)  # text offset of the search window
        window = self._recent + new
        self._length += len(new)
        self._unsent += new
        stop_end = self._find_stop(window, start)
        if stop_end is not None:
            # Cut the text at stop_end (a text offset) and return everything before it.
            keep = stop_end - (self._length - len(self._unsent))
            text, self._unsent = self._unsent[:keep], ""
            return text, True
        if self._lookback:
            self._recent = window[-self._lookback:]
        upto = len(self._unsent) if finished else max(0, len(self._unsent) - self._hold)
        text, self._unsent = self._unsent[:upto], self._unsent[upto:]
        return text, False

    def _find_stop(self, window: str, start: int) -> int | None:
        """Where the text ends once cut at the first stop string found in `window` (which starts at text offset
        `start`): before the stop string, or after it with include_stop_str_in_output. None when there is none.
        Earlier pushes searched the text before the window, so only a stop string ending in the new text counts."""
        if not self._stop or self._stop_from is None:
            return None
        found: list[tuple[int, int]] = []
        for stop in self._stop:
            at = window.find(stop, max(0, self._stop_from - len(stop) + 1 - start))
            if at >= 0:
                found.append((start + at, len(stop)))
        if not found:
            return None
        at, length = min(found)
        return at + length if self._include_stop else at
