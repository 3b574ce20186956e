"""The tools people point at a serving system on day one, unchanged, against the deployed app (tiny model, TP=1 x
PCP=2 x DCP=2 on logical GPUs: every prompt's prefill split across two PCP groups, the KV sharded over both; echo's
prompt logprobs gather the groups' hidden states): the official openai SDK with n, logprobs, echo, batched prompts
and stream_options;
guidellm (the vLLM project's benchmark client) with streaming chat and completions at a concurrent profile;
lm-evaluation-harness' `local-completions` on a log-likelihood task the test writes (nothing is downloaded), whose
per-sample log-likelihoods and accuracy equal lm-eval's own transformers run on the same weights.

guidellm and lm-eval live in .venv-clients (`make test` builds it): they pin dependency versions of their own.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from bench.harness.cluster import RayHead, ServeCluster, deploy_app, present, tiny_app_args

REPO = Path(__file__).resolve().parents[2]
CLIENTS = REPO / ".venv-clients" / "bin"
MODEL = "tiny-clients"

pytestmark = [pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster(ray_head: RayHead) -> Iterator[ServeCluster]:
    args = tiny_app_args(MODEL, tensor_parallel_size=1, prefill_context_parallel_size=2, kv_cache_memory_bytes=1 << 20,
                         max_num_seqs=16, max_queued_requests=64)
    with deploy_app(ray_head, args) as running:
        yield running


def api(cluster: ServeCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)


def needs_clients() -> None:
    if not (CLIENTS / "guidellm").exists() or not (CLIENTS / "lm_eval").exists():
        if os.environ.get("CI"):
            pytest.fail(".venv-clients is missing: `make test` builds it before running the suite")
        pytest.skip("guidellm / lm-eval are not installed in .venv-clients (`make test` builds it)")


def hf_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


# ---- the openai SDK ---------------------------------------------------------------------------------------------


def test_sdk_n_seeds_logprobs_and_batched_prompts(cluster: ServeCluster) -> None:
    client = api(cluster)
    prompts = [[10, 11, 12, 13], [40, 41]]
    reply = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=11,
                                      logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]  # prompt i, choice j -> i * n + j
    usage = present(reply.usage)
    assert usage.prompt_tokens == 6 and usage.completion_tokens == 24
    for choice in reply.choices:
        lp = present(choice.logprobs)
        assert len(present(lp.tokens)) == 6 and len(present(lp.top_logprobs)[0]) == 3
    # Each choice equals a one-choice request with the derived seed (seed + j).
    for i, prompt in enumerate(prompts):
        for j in range(2):
            alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0,
                                              seed=11 + j, logprobs=3, extra_body={"ignore_eos": True})
            assert alone.choices[0].text == reply.choices[i * 2 + j].text
            assert present(alone.choices[0].logprobs).token_logprobs == pytest.approx(
                present(reply.choices[i * 2 + j].logprobs).token_logprobs, abs=1e-5)


def test_the_choices_of_concurrent_requests_are_all_delivered(cluster: ServeCluster) -> None:
    """Every choice of concurrent requests with many choices is delivered (each its own Serve call: choices that
    shared their HTTP request's internal id waited out dispatch_timeout_s; tests/deployments/dispatch/test_sessions.py
    holds the mechanism)."""
    import asyncio

    async def one(i: int) -> int:
        body = {"model": MODEL, "prompt": [[10 + i, 11, 12, 13]] * 4, "n": 2, "max_tokens": 2, "echo": True,
                "logprobs": 1}
        async with httpx.AsyncClient(timeout=60) as http:
            return (await http.post(f"{cluster.url}/v1/completions", json=body)).status_code

    async def burst() -> list[int]:
        return list(await asyncio.gather(*(one(i) for i in range(3))))

    assert asyncio.run(burst()) == [200, 200, 200]


def test_sdk_echo_scores_the_prompt_as_transformers_does(cluster: ServeCluster) -> None:
    prompt = [5, 17, 99, 230, 7, 64]
    reply = api(cluster).completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    [choice] = reply.choices
    expected = hf_logprobs(cluster.model_dir, prompt)
    lp = present(choice.logprobs)
    token_logprobs, top_logprobs = present(lp.token_logprobs), present(lp.top_logprobs)
    assert token_logprobs[0] is None and len(token_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert token_logprobs[i] == pytest.approx(float(expected[i - 1, prompt[i]]), abs=1e-4)
        assert max(top_logprobs[i].values()) == pytest.approx(float(expected[i - 1].max()), abs=1e-4)
    assert present(reply.usage).completion_tokens == 0


def test_sdk_chat_logprobs_and_streams_with_usage(cluster: ServeCluster) -> None:
    client = api(cluster)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=2, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content == reply.choices[1].message.content  # greedy: the same
    content = present(present(reply.choices[0].logprobs).content)
    assert len(content) == 5 and all(len(item.top_logprobs) == 2 for item in content)
    assert all(item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5) for item in content)

    stream = client.completions.create(model=MODEL, prompt=["ab", "cd"], n=2, max_tokens=4, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices
    finished = {c.index: c.finish_reason for chunk in chunks[:-1] for c in chunk.choices if c.finish_reason}
    assert finished == {0: "length", 1: "length", 2: "length", 3: "length"}

    chat_stream = client.chat.completions.create(  # type: ignore[call-overload]  # continuous_usage_stats: vLLM's, not in the SDK's types
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(chat_stream)
    assert all(chunk.usage is not None for chunk in chunks) and present(chunks[-1].usage).completion_tokens == 3


def test_sdk_penalties_bias_and_bad_values(cluster: ServeCluster) -> None:
    client = api(cluster)
    with_ids = client.completions.create(model=MODEL, prompt=[10, 11], max_tokens=4, temperature=0,
                                         logit_bias={"77": 100}, logprobs=0,
                                         extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert present(with_ids.choices[0].logprobs).tokens == ["token_id:77"] * 4
    penalised = client.completions.create(model=MODEL, prompt=[10, 11], max_tokens=8, temperature=0,
                                          presence_penalty=2.0, frequency_penalty=2.0, logprobs=0,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert len(present(present(penalised.choices[0].logprobs).tokens)) == 8
    for bad, fragment in [({"n": 17}, "n"), ({"logprobs": 21}, "logprobs"), ({"presence_penalty": 9}, "presence"),
                          ({"logit_bias": {"99999": 1}}, "logit_bias")]:
        with pytest.raises(openai.BadRequestError, match=fragment):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, **bad)  # type: ignore[arg-type]  # values the API refuses


# ---- guidellm ------------------------------------------------------------------------------------------------------


STREAMS = 4  # guidellm's concurrent streams


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_streams_a_concurrent_profile_without_errors(cluster: ServeCluster, tmp_path: Path,
                                                             request_format: str) -> None:
    needs_clients()
    out = tmp_path / "guidellm.json"
    before = cluster.admission_stats()
    result = subprocess.run([
        str(CLIENTS / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={cluster.url},model={MODEL},request_format={request_format}",
        "--tokenizer", f"kind=hf_auto,model={cluster.model_dir}",
        "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
        "--profile", f"kind=concurrent,streams={STREAMS}",
        "--constraint", "kind=max_requests,count=16",
        "--disable-console-interactive",
        "--output", f"kind=json,path={out}",
    ], capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    totals = report["benchmarks"][0]["metrics"]["request_totals"]
    after = cluster.admission_stats()
    # The requests the app served: its grants, less those given back and granted again (a replica that refused one
    # or did not take it in time).
    served = ((after.num_granted - before.num_granted) - (after.num_refusals - before.num_refusals)
              - (after.num_unreachable - before.num_unreachable))
    # What the server controls: no error, nothing cut off, every request guidellm counted was one the app served, and
    # no KV held once guidellm is gone. How many requests guidellm sends before its max_requests constraint stops it,
    # and which of those it reports, is its own accounting: when the constraint hits it drops a stream's request in
    # flight, which the app served (or was serving) and guidellm does not count, so the app may have served up to one
    # more per stream than guidellm reports (a CI run: 15 successful of 16 served).
    print(f"guidellm {request_format}: {totals}; the app granted {served} requests")
    assert totals["errored"] == 0 and totals["incomplete"] == 0, totals
    assert 1 <= totals["successful"] <= served <= totals["successful"] + STREAMS, (totals, served)
    deadline = time.monotonic() + 60
    while (health := httpx.get(f"{cluster.url}/health", timeout=10).json())["kv_granted_blocks"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.25)


# ---- lm-evaluation-harness ---------------------------------------------------------------------------------------


TASK = """task: dcpserve_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(directory: Path) -> None:
    import random

    rng = random.Random(0)
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "bird"]
    with (directory / "data.jsonl").open("w") as f:
        for _ in range(12):
            f.write(json.dumps({"context": " ".join(rng.choice(words) for _ in range(6)),
                                "choices": [rng.choice(words) for _ in range(3)], "label": rng.randrange(3)}) + "\n")
    (directory / "tiny_choice.yaml").write_text(TASK.format(data=directory / "data.jsonl"))


def run_lm_eval(directory: Path, name: str, model: str, model_args: str) -> tuple[float, list[float]]:
    out = directory / name
    result = subprocess.run([
        str(CLIENTS / "lm_eval"), "--model", model, "--model_args", model_args, "--tasks", "dcpserve_tiny_choice",
        "--include_path", str(directory), "--batch_size", "4", "--device", "cpu", "--log_samples",
        "--output_path", str(out),
    ], capture_output=True, text=True, timeout=600, cwd=directory,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    (directory / f"{name}.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, f"lm_eval failed: {directory / name}.log\n" + result.stderr[:4000]
    [results] = list(out.rglob("results_*.json"))
    acc = json.loads(results.read_text())["results"]["dcpserve_tiny_choice"]["acc,none"]
    [samples] = list(out.rglob("samples_dcpserve_tiny_choice_*.jsonl"))
    logliks = []
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        logliks += [float(r[0][0]) for r in sample["resps"]]
    return acc, logliks


def test_lm_eval_local_completions_scores_as_transformers(cluster: ServeCluster, tmp_path: Path) -> None:
    needs_clients()
    write_task(tmp_path)
    served = run_lm_eval(tmp_path, "served", "local-completions",
                         f"model={MODEL},base_url={cluster.url}/v1/completions,tokenizer={cluster.model_dir},"
                         f"tokenizer_backend=huggingface,tokenized_requests=True,add_bos_token=True,num_concurrent=2,"
                         f"max_retries=1")
    # lm-eval's own transformers run on the same weights; both tokenize with BOS (API models default to none).
    reference = run_lm_eval(tmp_path, "reference", "hf",
                            f"pretrained={cluster.model_dir},dtype=float32,add_bos_token=True")
    assert served[0] == reference[0]
    assert len(served[1]) == len(reference[1]) == 36
    assert all(math.isclose(a, b, abs_tol=1e-3)
               for a, b in zip(served[1], reference[1], strict=True)), (served[1], reference[1])
