"""Structured outputs in the native engine (dcpserve/engine/structured_output.py): the tiny random model's outputs are
100% valid under every constraint kind, the grammar survives preemption and recompute, max_tokens cuts a valid prefix,
an allow-everything constraint changes nothing, and a constraint the grammar engine refuses is a clear error before
anything is queued."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from bench.harness.json_schemas import SCHEMAS
from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.structured_output import (
    MAX_SPEC_BYTES,
    GrammarError,
    Grammars,
    StructuredOutput,
    allowed_tokens,
    bitmask_words,
    fill_bitmasks,
    no_additional_properties,
)
from dcpserve.engine.worker.sampler import Sampler, SamplingRow, unpack_bitmask
from tests.engine.llm_parts import engine_of

MAX_TOKENS = 300  # every schema's longest output (bounded strings and arrays) fits well within it


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def llm(tiny: Path):
    with LLM(tiny) as engine:
        yield engine


def _params(constraint: StructuredOutput, seed: int | None, **overrides: object) -> SamplingParams:
    options: dict[str, object] = dict(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=MAX_TOKENS,
                                      structured_output=constraint)
    options.update(overrides)
    return SamplingParams(**options)  # type: ignore[arg-type]


def test_thirty_schemas_give_valid_json_greedy_and_sampled(llm: LLM) -> None:
    params = [_params(StructuredOutput.json(schema), seed) for seed in (None, 1, 2) for schema in SCHEMAS]
    outputs = llm.generate(["Answer in JSON:"] * len(params), params)
    for p, out in zip(params, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        schema = json.loads(p.structured_output.spec)  # type: ignore[union-attr]
        jsonschema.validate(json.loads(completion.text), schema)  # strict json.loads: no raw control characters


def test_regex_choice_grammar_and_json_object_are_matched(llm: LLM) -> None:
    cases = [
        (StructuredOutput.regex(r"[a-z]{3}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
        (StructuredOutput.choice(["yes", "no", "it depends"]), lambda t: t in ("yes", "no", "it depends")),
        (StructuredOutput.grammar('root ::= "(" [0-9]{1,4} ")"'), lambda t: re.fullmatch(r"\([0-9]{1,4}\)", t)),
        (StructuredOutput.grammar('start: "sum(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'),
         lambda t: re.fullmatch(r"sum\([0-9]{1,3}(,[0-9]{1,3})*\)", t)),
        (StructuredOutput.json_object(), lambda t: isinstance(json.loads(t), dict)),
    ]
    for seed in (None, 3, 4, 5):
        outputs = llm.generate(["x"] * len(cases), [_params(c, seed, max_tokens=60) for c, _ in cases])
        for (constraint, matches), out in zip(cases, outputs, strict=True):
            text = out.outputs[0].text
            if constraint.kind == "json_object" and out.outputs[0].finish_reason == "length":
                continue  # any object: a random model may keep adding members until max_tokens
            assert matches(text), (constraint, text)


def test_grammar_state_survives_preemption_and_recompute(tiny: Path) -> None:
    """Under a KV pool too small for all of them, constrained requests are preempted and recomputed: their outputs
    equal a roomy run's and are valid (the grammar state lives in the scheduler, untouched by recompute)."""
    schemas = [SCHEMAS[19], SCHEMAS[27], SCHEMAS[29], SCHEMAS[22]]
    params = [_params(StructuredOutput.json(s), seed, ignore_eos=False) for s in schemas for seed in (None, 7)]
    prompts = [[(13 * i + j) % 300 + 10 for j in range(40)] for i in range(len(params))]
    with LLM(tiny, block_size=4) as roomy:
        expected = [o.outputs[0].text for o in roomy.generate(prompt_token_ids=prompts, sampling_params=params)]
    tight = {"block_size": 4, "kv_cache_memory_bytes": 128 << 10, "admission": "usage", "kv_headroom": 0.0}
    with LLM(tiny, **tight) as llm:
        outputs = [o.outputs[0].text for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert engine_of(llm).stats().num_preemptions > 0
    assert outputs == expected
    for p, text in zip(params, outputs, strict=True):
        jsonschema.validate(json.loads(text), json.loads(p.structured_output.spec))  # type: ignore[union-attr]


def test_max_tokens_cuts_a_valid_prefix(llm: LLM, tiny: Path) -> None:
    constraint = StructuredOutput.json(SCHEMAS[29])
    out = llm.generate(["x"], _params(constraint, None, max_tokens=6))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    state = engine_of(llm).grammars().start(constraint)
    assert all(state.accept(t) for t in out.token_ids)  # every token a step of the grammar: a valid prefix


def test_min_tokens_yields_to_a_grammar_that_can_only_end(llm: LLM) -> None:
    out = llm.generate(["x"], _params(StructuredOutput.choice(["ok"]), None, min_tokens=10, max_tokens=20))[0]
    assert out.outputs[0].text == "ok" and out.outputs[0].finish_reason == "stop"


def test_an_allow_everything_mask_changes_nothing_bit_for_bit() -> None:
    """The sampler with an all-ones bitmask on every row gives exactly the tokens and logprobs it gives without:
    greedy, seeded, unseeded, penalized and biased rows."""
    vocab = 300
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    rows = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.8, seed=5, logprobs=2),
            SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=0.7, top_p=0.9,
                                                                     repetition_penalty=1.3, seed=9),
            SamplingParams(temperature=0.0, logit_bias={3: 5.0})]
    everything = np.full(bitmask_words(vocab), -1, dtype=np.int32)
    results = []
    for mask in (None, everything):
        sampler = Sampler(seed=11)
        for i in (3,):
            sampler.record(f"r{i}", 0, [1, 2, 3, 4])
        results.append(sampler.sample(logits, [SamplingRow(f"r{i}", p, 0, (), mask) for i, p in enumerate(rows)]))
    assert results[0].token_ids == results[1].token_ids
    assert results[0].logprobs == results[1].logprobs


def test_an_allow_everything_constraint_keeps_the_engines_greedy_tokens(llm: LLM) -> None:
    """Through the whole engine: a regex that takes any text changes no greedy token of an output it allows. (No
    constraint allows everything a random model writes: grammars produce valid UTF-8 and no special tokens, so the
    outputs compared are those whose every token the grammar accepts.)"""
    anything = StructuredOutput.regex(r"(?s:.*)")
    grammars = engine_of(llm).grammars()
    free_params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5 + i, 6 + 2 * i, 7 + 3 * i] for i in range(40)]
    compared = 0
    for prompt, free in zip(prompts, llm.generate(prompt_token_ids=prompts, sampling_params=free_params),
                            strict=True):
        state = grammars.start(anything)
        if not all(state.accept(t) for t in free.outputs[0].token_ids):
            continue
        constrained = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, structured_output=anything))[0]
        assert constrained.outputs[0].token_ids == free.outputs[0].token_ids
        compared += 1
        if compared == 3:
            break
    assert compared == 3


def test_bitmasks_unpack_the_same_on_host_and_device_side() -> None:
    rng = np.random.default_rng(0)
    masks = rng.integers(-(2**31), 2**31 - 1, size=(3, bitmask_words(100)), dtype=np.int64).astype(np.int32)
    unpacked = unpack_bitmask(torch.from_numpy(masks), 100).numpy()
    for row, mask in zip(unpacked, masks, strict=True):
        assert (row == allowed_tokens(mask, 100)).all()
    assert unpack_bitmask(torch.from_numpy(masks), 130)[:, 96:].sum() == unpack_bitmask(
        torch.from_numpy(masks), 96 + 32)[:, 96:].sum()  # past the words: nothing allowed


def test_min_tokens_clears_stop_tokens_unless_nothing_would_be_left(tiny: Path) -> None:
    from dcpserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny)
    assert tokenizer is not None
    grammars = Grammars.for_tokenizer(tokenizer, 512)
    eos = sorted(tokenizer.eos_token_ids)
    done = grammars.start(StructuredOutput.choice(["a"]))
    assert done.accept(tokenizer.encode("a", add_special_tokens=False)[0])
    fresh = grammars.start(StructuredOutput.json_object())
    masks = fill_bitmasks([done, fresh, grammars.start(StructuredOutput.json_object())], [eos, eos, ()])
    only_stop = allowed_tokens(masks[0], 512)
    assert set(np.flatnonzero(only_stop)) == set(eos)  # nothing else could follow: the stop tokens stay
    assert not allowed_tokens(masks[1], 512)[eos].any()
    assert (masks[2] == fresh.allowed()).all()


def test_refused_constraints_are_clear_errors_before_queueing(llm: LLM) -> None:
    bad = [
        (StructuredOutput.json({"type": "objectx"}), "json constraint cannot be compiled.*objectx"),
        (StructuredOutput.regex("a(b"), "regex constraint cannot be compiled.*unclosed group"),
        (StructuredOutput.grammar('root ::= "(" [0-9+'), "grammar constraint cannot be parsed"),
        (StructuredOutput.grammar("start: undefined_rule"), "grammar constraint cannot be compiled"),
    ]
    for constraint, match in bad:
        with pytest.raises(GrammarError, match=match):
            llm.generate(["x"], _params(constraint, None))
    assert not engine_of(llm).scheduler.has_unfinished
    with pytest.raises(GrammarError, match=f"at most {MAX_SPEC_BYTES} are accepted"):
        StructuredOutput.regex("a" * (MAX_SPEC_BYTES + 1))
    with pytest.raises(GrammarError, match="not valid JSON"):
        StructuredOutput.json("{nope")
    with pytest.raises(GrammarError, match="non-empty list of strings"):
        StructuredOutput.choice([])


def test_compiled_grammars_are_cached_by_constraint(llm: LLM) -> None:
    grammars = engine_of(llm).grammars()
    constraint = StructuredOutput.json({"type": "object", "properties": {"cached": {"type": "boolean"}}})
    compiles, hits = grammars.stats.compiles, grammars.stats.cache_hits  # earlier tests of the module count too
    llm.generate(["x", "y"], [_params(constraint, None), _params(constraint, 1)])
    assert (grammars.stats.compiles, grammars.stats.cache_hits) == (compiles + 1, hits + 1)


def test_objects_get_no_additional_properties_unless_they_say() -> None:
    schema = {"type": "object", "properties": {"properties": {"type": "object"}, "open": {
        "type": "object", "additionalProperties": True}}, "$defs": {"x": {"properties": {}}},
        "items": [{"type": "object"}]}
    out = no_additional_properties(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]  # the property map itself is not a schema
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["$defs"]["x"]["additionalProperties"] is False
    assert out["items"][0]["additionalProperties"] is False


def test_the_grammar_sees_the_whole_vocabulary_special_tokens_included(tiny: Path) -> None:
    """Special tokens other than the stop tokens are never allowed; the stop tokens exactly when the grammar is
    satisfied; ids past the tokenizer's vocabulary (the model's padding rows) never."""
    from dcpserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny)
    assert tokenizer is not None
    grammars = Grammars.for_tokenizer(tokenizer, 512 + 64)  # 64 padding rows past the tokenizer's 512
    state = grammars.start(StructuredOutput.json_object())
    start = allowed_tokens(state.allowed(), 512 + 64)
    specials = set(tokenizer.hf_tokenizer.all_special_ids) | set(tokenizer.eos_token_ids)
    assert not start[sorted(specials)].any() and not start[512:].any()
    for token in tokenizer.encode("{}", add_special_tokens=False):
        assert state.accept(token)
    assert set(np.flatnonzero(allowed_tokens(state.allowed(), 512 + 64))) == set(tokenizer.eos_token_ids)


def test_a_template_that_takes_tools_gets_them(tiny: Path, tmp_path: Path) -> None:
    import shutil

    from dcpserve.engine.tokenizer import load_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if tools %}TOOLS{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
                               "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer is not None and tokenizer.template_renders_tools
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = tokenizer.decode(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools))
    assert text.startswith("TOOLS get_weather") and "user: hi" in text
    plain = load_tokenizer(tiny)
    assert plain is not None and not plain.template_renders_tools
