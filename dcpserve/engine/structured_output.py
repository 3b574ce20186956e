"""Structured outputs: a request's constraint (JSON schema, any JSON object, regex, one of fixed strings, EBNF grammar),
compiled by llguidance against the model's vocabulary, and the grammar state that gives each step's allowed tokens.

Why llguidance (bench/grammar_engines.py measures it against xgrammar on the same vocabulary and schemas, numbers
in docs/benchmarks.md): with random logits over the 30 test schemas, every string llguidance let through was valid
JSON, while xgrammar 0.2.8 let raw control characters (U+0000-U+001F) into JSON strings, which RFC 8259 and
Python's json.loads refuse. xgrammar's masks are faster (about 4 against 15 us per token on the tiny vocabulary),
which is well inside a decode step either way. The vLLM backend is told to use llguidance too, so a constraint
means the same thing on both backends.

Objects follow vLLM's default: a schema object that does not say otherwise gets additionalProperties: false (a model
that may add properties can add them forever), except where that could make the schema unsatisfiable (an object
that requires properties it does not list, or composes others: `no_additional_properties`); with OpenAI's strict:
true, every object that does not say otherwise gets it. Both backends compile the schema so rewritten.

Where it runs: the scheduler (engine core) keeps one `GrammarState` per constrained request, fills the request's
bitmask when it schedules the request's sampling row, and advances the state with each accepted token. The bitmask
rides on the step to the sampling rank (rank 0 after the logits gather), which masks the logits before sampling.
A preempted request keeps its state: recompute replays its prompt and outputs through the model, never through the
grammar, so the state stays where its accepted outputs left it.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dcpserve.engine.protocol import RequestError
from dcpserve.engine.schema_rewrite import no_additional_properties

# The largest constraint text (a schema's JSON, a regex, a grammar, the choices' JSON) a request may send. A schema
# this size compiles in well under a second against a 128k vocabulary; the request body limit bounds it too.
MAX_SPEC_BYTES = 64 * 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Compiled grammars kept per process (most recently used first out of the cache when it is full).
DEFAULT_CACHE_SIZE = 256


class GrammarError(RequestError):
    """A constraint the grammar engine refuses (bad schema, regex, grammar): the client's error, a 400."""


@dataclass(frozen=True)
class StructuredOutput:
    """One request's constraint on its output text. Frozen and hashable: the compiled grammar is cached by it.

    kind "json": spec is a JSON schema's text; "json_object": any JSON object (spec empty); "regex": a regular
    expression the whole output matches; "choice": spec is a JSON list of the allowed output strings; "grammar": an
    EBNF (GBNF) grammar whose `root` rule the output matches. The output always ends with a stop token once the
    constraint is satisfied (EOS), so its text is exactly a match."""

    kind: str
    spec: str = ""
    strict: bool = False  # json: OpenAI's strict: true (every object without additionalProperties gets false)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {list(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output spec must be a string, got {type(self.spec).__name__}")
        size = len(self.spec.encode("utf-8"))
        if size > MAX_SPEC_BYTES:
            raise GrammarError(f"the {self.kind} constraint is {size} bytes; at most {MAX_SPEC_BYTES} are accepted: "
                               f"split the schema or drop descriptions")
        if self.strict and self.kind != "json":
            raise ValueError(f"strict applies to json constraints, not {self.kind}")
        if self.kind == "json_object" and self.spec:
            raise ValueError("a json_object constraint takes no spec")
        if self.kind != "json_object" and not self.spec:
            raise GrammarError(f"the {self.kind} constraint is empty")

    @classmethod
    def json(cls, schema: dict[str, Any] | str, strict: bool = False) -> StructuredOutput:
        """A JSON schema (a dict, or its JSON text), stored compactly (key order kept: it is the output's property
        order); strict: OpenAI's strict mode for its objects (no_additional_properties)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise GrammarError(f"the JSON schema is not valid JSON: {err}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return cls("json", json.dumps(schema, separators=(",", ":")), strict=strict)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        if isinstance(choices, str) or not all(isinstance(c, str) for c in choices) or not choices:
            raise GrammarError(f"choices must be a non-empty list of strings, got {choices!r}")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        return cls("grammar", text)

    def choices(self) -> list[str]:
        return list(json.loads(self.spec)) if self.kind == "choice" else []

    def json_schema(self) -> dict[str, Any]:
        """A json constraint's schema as both backends compile it: no_additional_properties applied."""
        if self.kind != "json":
            raise ValueError(f"a {self.kind} constraint has no JSON schema")
        schema: dict[str, Any] = no_additional_properties(json.loads(self.spec), strict=self.strict)
        return schema


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's allowed-token bitmask (bit t of word t // 32: token t allowed)."""
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The bool [vocab_size] mask of one bitmask row (tests and tools; the sampler unpacks on the device)."""
    bits = np.unpackbits(bitmask.astype("<i4").view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def fill_bitmasks(states: Sequence[GrammarState], blocked: Sequence[Sequence[int]]) -> np.ndarray:
    """The bitmasks of a step's constrained sampling rows, one row per state, written in place into one array. Row
    i's `blocked` tokens (the stop tokens min_tokens forbids) are cleared unless that would leave none: a grammar that
    can only end now ends the output, min_tokens or not.

    One after another, on this thread: llguidance's parallel fill (its own thread pool) measured slower inside the
    engine on a 2-core machine, its threads competing with the model's (bench/structured.py: 0.63x against 0.70x of
    the unconstrained tokens/s), though faster alone."""
    if not states:
        return np.zeros((0, 0), dtype=np.int32)
    masks = np.zeros((len(states), bitmask_words(states[0].vocab_size)), dtype=np.int32)
    row_bytes = masks.shape[1] * 4
    base = masks.ctypes.data
    for i, state in enumerate(states):
        state.matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
    for i, tokens in enumerate(blocked):
        if tokens:
            words = masks[i].copy().view(np.uint32)
            for token in tokens:
                if token // 32 < len(words):
                    words[token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)
            if words.any():
                masks[i] = words.view(np.int32)
    return masks


class GrammarState:
    """One request's position in its grammar: its allowed next tokens, advanced by each accepted token."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> np.ndarray:
        """int32 [bitmask_words(vocab_size)]: the tokens the grammar allows next (EOS once it is satisfied)."""
        row: np.ndarray = fill_bitmasks([self], [()])[0]
        return row

    def accept(self, token_id: int) -> bool:
        """Advances by a sampled token; False when the grammar does not allow it."""
        return bool(self.matcher.consume_token(int(token_id)))

    @property
    def is_terminated(self) -> bool:
        """Nothing more may be generated: the grammar is satisfied and took a stop token, or cannot continue."""
        return bool(self.matcher.is_stopped())


@dataclass
class CompileStats:
    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0


class Grammars:
    """Compiles constraints against one model's vocabulary (llguidance), caches the checked grammars by constraint,
    and starts a GrammarState per request. Thread-safe: the ingress compiles off its event loop."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        # The tokenizer's own vocabulary (special tokens included; ids past it are the model's padding rows and never
        # allowed); the stop tokens are the model's EOS ids, so a satisfied grammar ends the request.
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                       eos_token=self.stop_token_ids)
        self._cache: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = CompileStats()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE) -> Grammars:
        """For an dcpserve.engine.tokenizer.Tokenizer (its Hugging Face tokenizer and EOS ids)."""
        return cls(tokenizer.hf_tokenizer, vocab_size, sorted(tokenizer.eos_token_ids), cache_size)

    def compile(self, constraint: StructuredOutput) -> str:
        """The constraint's grammar, checked against the vocabulary (cached); GrammarError naming the engine's reason
        when it refuses."""
        with self._lock:
            grammar = self._cache.get(constraint)
            if grammar is not None:
                self._cache.move_to_end(constraint)
                self.stats.cache_hits += 1
                return grammar
        start = time.perf_counter()
        try:
            grammar = self._grammar(constraint)
            matcher = self._llg.LLMatcher(self._tokenizer, grammar)
        except GrammarError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError, RecursionError) as err:
            # The converters' own errors (a schema or grammar they cannot read): the client's input, not a fault.
            raise GrammarError(f"the {constraint.kind} constraint cannot be compiled: {_reason(str(err))}") from None
        if matcher.is_error():
            raise GrammarError(f"the {constraint.kind} constraint cannot be compiled: {_reason(matcher.get_error())}")
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - start
            self._cache[constraint] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _grammar(self, constraint: StructuredOutput) -> str:
        """llguidance's grammar text of a constraint (not yet checked against the vocabulary)."""
        matcher, kind, spec = self._llg.LLMatcher, constraint.kind, constraint.spec
        options: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions (a TypedDict)
        if kind == "json":
            return str(matcher.grammar_from_json_schema(constraint.json_schema(), defaults=options))
        if kind == "json_object":
            return str(matcher.grammar_from_json_schema({"type": "object"}, defaults=options))
        if kind == "regex":
            return str(matcher.grammar_from_regex(spec))
        if kind == "choice":
            return str(matcher.grammar_from_lark(choice_grammar(constraint.choices())))
        if "::=" in spec:  # GBNF (vLLM's guided_grammar examples); anything else is read as Lark
            from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

            try:
                spec = gbnf_to_lark(spec)
            except GbnfToLarkError as err:
                raise GrammarError(f"the grammar constraint cannot be parsed: {_reason(str(err))}") from None
        return str(matcher.grammar_from_lark(spec))

    def start(self, constraint: StructuredOutput) -> GrammarState:
        """A fresh state at the start of the constraint's grammar."""
        matcher = self._llg.LLMatcher(self._tokenizer, self.compile(constraint))
        return GrammarState(matcher, self.vocab_size)


def _reason(message: str) -> str:
    return " ".join(message.split())[:500]


def choice_grammar(choices: Sequence[str]) -> str:
    """A Lark grammar whose start rule is exactly one of the strings (JSON's string escapes are Lark's)."""
    return "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
