"""Every rank of a group issues the same collectives, at every layout the model tests run: the recorder's checks.

tests/engine/worker/collectives_recorder.py records each collective a rank issues (through the harness' observer,
bench/harness/model_harness.py) and checks the logs of all ranks: per group instance the same sequence of (op,
shape, dtype), NCCL's rules (no CPU tensor in an nccl group, contiguous inputs, all_to_all's leading dim = group
size). Here:
- the checker on hand-written logs: divergent shapes, a missing call, a CPU tensor in an nccl group, a
  non-contiguous all_reduce, a wrong all_to_all leading dim, ranks that disagree on the steps;
- a tiny spawned group on the gloo transport: the recorder forwards every op (results checked), logs a call before
  it runs (one that raises is logged), and a rank that really issues one all_reduce more than its peer (the peer's
  match goes past its recorder, so nothing hangs) is caught;
- every (tp, dcp, pcp) layout of test_model_vs_hf / test_mla_vs_hf / test_long_context, each with a tiny Llama (GQA:
  2 KV heads where the layout allows, else 1) and a tiny DeepSeek-V2 (MLA + MoE), over one batch whose steps are
  prefill only, mixed (decodes beside later chunks of a chunked prompt, which attend over its cached context) and
  decode only: the logs agree and break no rule (every buffer contiguous, none copied behind the caller's back);
  and the same logs with one call left out of one rank's log fail.
One spawn per layout; tiny models (2 layers, hidden 32).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from bench.harness.model_harness import Job, Scenario, free_port, run_rank
from dcpserve.engine.config import ModelConfig, ParallelConfig
from dcpserve.engine.worker.parallel import destroy_parallel_state, init_parallel_state
from tests.engine.worker.collectives_recorder import (
    CollectiveCall,
    LogEntry,
    Recorder,
    RecordingCollectives,
    StepStart,
    assert_logs_agree,
    check_logs,
    load_log,
    log_file,
    record_parallel,
    save_log,
    step_counts,
)
from tests.spawn_pool import SpawnPool

BLOCK_SIZE = 4
VOCAB = 301  # not divisible by 2 or 4: the vocabulary-parallel layers pad
# (tp, dcp, pcp, interleave): MULTI_RANK_LAYOUTS and PCP_LAYOUTS of the model tests.
LAYOUTS = [(2, 1, 1, 1), (2, 2, 1, 1), (4, 2, 1, 2), (4, 4, 1, 1),
           (1, 1, 2, 1), (1, 2, 2, 1), (2, 1, 2, 1), (2, 2, 2, 1), (2, 4, 2, 1)]


# Non-contiguous inputs the engine may hand an out-of-place collective: none (the DCP query gather makes its strided
# q contiguous itself, dcpserve/kernels/exchange.py).
ALLOWED_COPIES: set[tuple[str, str]] = set()


# ---- the checker on hand-written logs ---------------------------------------------------------------------------


def call(op: str = "all_reduce", shape: tuple[int, ...] = (3, 8), rank: int = 0, members: tuple[int, ...] = (0, 1),
         group: str = "tp", transport: str = "shm", device: str = "cpu", contiguous: bool = True,
         dtype: str = "float32") -> CollectiveCall:
    return CollectiveCall(group, members, members.index(rank), transport, op, shape, dtype, device, contiguous,
                          shape[0] if op == "all_to_all" else None)


def two_ranks(make: Callable[[int], list[LogEntry]]) -> dict[int, list[LogEntry]]:
    return {rank: make(rank) for rank in (0, 1)}


def test_agreeing_logs_pass() -> None:
    logs = two_ranks(lambda r: [StepStart(0, 0, 5), call(rank=r), call("all_to_all", (2, 4, 9), rank=r),
                                call("gather", (3, 76), rank=r)])
    assert check_logs(logs) == []


def test_divergent_shapes_name_group_ranks_index_and_both_calls() -> None:
    logs = two_ranks(lambda r: [call(rank=r), call("all_gather", (4 + r, 8), rank=r), call(rank=r)])
    [problem] = check_logs(logs)
    assert problem == ("the tp group [0, 1] diverges at call 1: rank 0 issued all_gather [4, 8] float32 on cpu, "
                       "rank 1 issued all_gather [5, 8] float32 on cpu")


def test_divergent_dtype_and_a_missing_call_fail() -> None:
    dtypes = two_ranks(lambda r: [call(rank=r, dtype="float32" if r == 0 else "bfloat16")])
    assert "diverges at call 0" in check_logs(dtypes)[0]
    missing = two_ranks(lambda r: [call(rank=r)] * (2 - r))
    [problem] = check_logs(missing)
    assert "diverges at call 1" in problem and "rank 1 issued nothing (its calls end here)" in problem


def test_groups_are_checked_per_instance() -> None:
    """Two DCP groups of a tp = 4, dcp = 2 replica: each agrees within itself though they differ from each other."""
    logs = {r: [call("all_to_all", (2, 3 + r // 2, 5), rank=r, group="dcp", members=(r // 2 * 2, r // 2 * 2 + 1))]
            for r in range(4)}
    assert check_logs(logs) == []
    logs[3] = [call("all_to_all", (2, 9, 5), rank=3, group="dcp", members=(2, 3))]
    [problem] = check_logs(logs)
    assert problem.startswith("the dcp group [2, 3] diverges at call 0")


def test_a_cpu_tensor_in_an_nccl_group_fails() -> None:
    logs = two_ranks(lambda r: [call(rank=r, transport="nccl", device="cuda"),
                                call("all_gather", rank=r, transport="nccl", device="cpu" if r else "cuda")])
    problems = check_logs(logs)
    assert any("rank 1's tp group [0, 1] call 1" in p and "a CPU tensor in an nccl group" in p for p in problems)
    assert not any("rank 0" in p and "CPU tensor" in p for p in problems)
    assert check_logs(two_ranks(lambda r: [call(rank=r, transport="shm", device="cpu")])) == []


def test_a_non_contiguous_all_reduce_fails_on_every_transport() -> None:
    for transport in ("shm", "gloo", "nccl"):
        logs = {r: [call(rank=r, transport=transport, device="cuda", contiguous=r == 0)] for r in (0, 1)}
        [problem] = check_logs(logs, copies_allowed={("tp", "all_gather")})
        assert "rank 1's tp group [0, 1] call 0 (all_reduce" in problem and "non-contiguous" in problem


def test_a_non_contiguous_out_of_place_input_fails_unless_its_copy_is_allowed() -> None:
    logs = two_ranks(lambda r: [call("all_gather", rank=r, group="dcp", contiguous=False)])
    assert len(check_logs(logs)) == 2
    assert check_logs(logs, copies_allowed={("dcp", "all_gather")}) == []
    assert len(check_logs(logs, copies_allowed={("tp", "all_gather")})) == 2
    with pytest.raises(ValueError, match="names all_reduce, which works in place"):
        check_logs(logs, copies_allowed={("tp", "all_reduce")})


def test_all_to_all_leading_dim_must_be_the_group_size() -> None:
    logs = two_ranks(lambda r: [call("all_to_all", (3, 4), rank=r)])
    problems = check_logs(logs)
    assert len(problems) == 2 and all("leading dim 3 is not the group size 2" in p for p in problems)


def test_ranks_that_disagree_on_the_steps_fail() -> None:
    logs = two_ranks(lambda r: [StepStart(0, r, 4), call(rank=r)])
    assert any("steps" in p for p in check_logs(logs))


def test_logs_round_trip_through_json(tmp_path: Path) -> None:
    log: list[LogEntry] = [StepStart(0, 2, 5), call("all_to_all", (2, 4, 9)), call(contiguous=False)]
    save_log(log, tmp_path / "log.json")
    assert load_log(tmp_path / "log.json") == log


# ---- every layout of the model tests ------------------------------------------------------------------------------


HIDDEN, HEADS, LAYERS = 32, 4, 2


def write_checkpoint(directory: Path, config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> Path:
    """config.json and random safetensors weights (norms near 1), written without importing transformers."""
    generator = torch.Generator().manual_seed(len(shapes))
    weights = {name: (1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(shape, generator=generator)
               for name, shape in shapes.items()}
    directory.mkdir(parents=True)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    common = dict(hidden_act="silu", hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  vocab_size=VOCAB, rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, torch_dtype="float32")
    (directory / "config.json").write_text(json.dumps({**common, **config}))
    return directory


def base_shapes(layer_shapes: Callable[[str, int], dict[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    shapes = {"lm_head.weight": (VOCAB, HIDDEN), "model.embed_tokens.weight": (VOCAB, HIDDEN),
              "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        shapes |= {f"{layer}.input_layernorm.weight": (HIDDEN,), f"{layer}.post_attention_layernorm.weight": (HIDDEN,)}
        shapes |= layer_shapes(layer, i)
    return shapes


def mlp_shapes(prefix: str, inner: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.gate_proj.weight": (inner, HIDDEN), f"{prefix}.up_proj.weight": (inner, HIDDEN),
            f"{prefix}.down_proj.weight": (HIDDEN, inner)}


def write_llama(directory: Path, num_kv_heads: int) -> Path:
    """A tiny LlamaForCausalLM: 4 heads of 8 over num_kv_heads KV heads, 2 layers."""
    head_dim, inter = 8, 48

    def layer(prefix: str, _: int) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}.self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
                f"{prefix}.self_attn.k_proj.weight": (num_kv_heads * head_dim, HIDDEN),
                f"{prefix}.self_attn.v_proj.weight": (num_kv_heads * head_dim, HIDDEN),
                f"{prefix}.self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim), **mlp_shapes(f"{prefix}.mlp", inter)}

    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=inter,
                  num_key_value_heads=num_kv_heads, head_dim=head_dim, attention_bias=False, mlp_bias=False)
    return write_checkpoint(directory, config, base_shapes(layer))


def write_mla(directory: Path) -> Path:
    """A tiny DeepseekV2ForCausalLM (MLA: latent 8 + rope 4, values 6; no q LoRA): a dense layer, then a MoE layer
    of 4 experts (2 per token) and a shared one."""
    nope, rope, v_dim, latent, inter, experts, moe_inter = 8, 4, 6, 8, 48, 4, 8

    def layer(prefix: str, index: int) -> dict[str, tuple[int, ...]]:
        attn = f"{prefix}.self_attn"
        shapes = {f"{attn}.q_proj.weight": (HEADS * (nope + rope), HIDDEN),
                  f"{attn}.kv_a_proj_with_mqa.weight": (latent + rope, HIDDEN),
                  f"{attn}.kv_a_layernorm.weight": (latent,),
                  f"{attn}.kv_b_proj.weight": (HEADS * (nope + v_dim), latent),
                  f"{attn}.o_proj.weight": (HIDDEN, HEADS * v_dim)}
        if index == 0:
            return shapes | mlp_shapes(f"{prefix}.mlp", inter)
        shapes[f"{prefix}.mlp.gate.weight"] = (experts, HIDDEN)
        shapes |= mlp_shapes(f"{prefix}.mlp.shared_experts", moe_inter)
        for e in range(experts):
            shapes |= mlp_shapes(f"{prefix}.mlp.experts.{e}", moe_inter)
        return shapes

    config = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", intermediate_size=inter,
                  num_key_value_heads=HEADS, q_lora_rank=None, kv_lora_rank=latent, qk_nope_head_dim=nope,
                  qk_rope_head_dim=rope, v_head_dim=v_dim, n_routed_experts=experts, num_experts_per_tok=2,
                  n_shared_experts=1, moe_intermediate_size=moe_inter, first_k_dense_replace=1, topk_method="greedy",
                  n_group=None, topk_group=None, routed_scaling_factor=1.0, norm_topk_prob=False,
                  attention_bias=False)
    return write_checkpoint(directory, config, base_shapes(layer))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recorder_checkpoints")
    return {"llama_gqa": write_llama(root / "llama_gqa", 2), "llama_mqa": write_llama(root / "llama_mqa", 1),
            "mla": write_mla(root / "mla")}


def scenario(dcp: int) -> Scenario:
    """Prompts of 1 token, one logical block and two blocks + 3, in chunks of block + 1: step 0 prefills only,
    steps 1-2 decode the short ones beside the long one's later chunks (over its cached context), then decodes."""
    block = BLOCK_SIZE * dcp
    generator = torch.Generator().manual_seed(dcp)
    lengths = (1, block, 2 * block + 3)
    prompts = tuple(tuple(torch.randint(0, VOCAB, (n,), generator=generator).tolist()) for n in lengths)
    return Scenario(prompts, prefill_chunk=block + 1, max_new_tokens=3)


def _valid(model_dir: Path, tp: int, dcp: int, pcp: int) -> bool:
    try:
        ParallelConfig(tp, dcp, pcp).validate(ModelConfig.from_pretrained(model_dir))
    except ValueError:
        return False
    return True


Layout = tuple[int, int, int, int]
RecordedRun = dict[str, dict[int, list[LogEntry]]]  # job name -> world rank -> log


@pytest.fixture(scope="module")
def recorded(checkpoints: dict[str, Path], spawn_pool: SpawnPool,
             tmp_path_factory: pytest.TempPathFactory) -> Callable[[Layout], RecordedRun]:
    """The logs of each layout's run (GQA, or MQA where GQA's 2 KV heads do not fit, and MLA), one spawn per layout
    for the whole module."""
    runs: dict[Layout, RecordedRun] = {}

    def run(layout: Layout) -> RecordedRun:
        if layout not in runs:
            tp, dcp, pcp, interleave = layout
            out = tmp_path_factory.mktemp(f"recorded_{tp}_{dcp}_{pcp}")
            llama = "llama_gqa" if _valid(checkpoints["llama_gqa"], tp, dcp, pcp) else "llama_mqa"
            names = [llama, "mla"]
            assert all(_valid(checkpoints[name], tp, dcp, pcp) for name in names)
            jobs = [Job(name, str(checkpoints[name]), (scenario(dcp),)) for name in names]
            spawn_pool.spawn(run_rank, (tp, dcp, interleave, free_port(), jobs, str(out), BLOCK_SIZE, pcp,
                                        Recorder(str(out))), tp * pcp)
            runs[layout] = {name: {r: load_log(log_file(out, name, r)) for r in range(tp * pcp)} for name in names}
        return runs[layout]

    return run


def layout_id(layout: Layout) -> str:
    tp, dcp, pcp, interleave = layout
    return f"tp{tp}-dcp{dcp}-pcp{pcp}" + (f"-interleave{interleave}" if interleave > 1 else "")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_every_layout_issues_the_same_collectives_on_every_rank(
    layout: Layout, recorded: Callable[[Layout], RecordedRun]
) -> None:
    tp, dcp, pcp, _ = layout
    for name, logs in recorded(layout).items():
        assert_logs_agree(logs, ALLOWED_COPIES)
        calls = [e for e in logs[0] if isinstance(e, CollectiveCall)]
        # Every group this rank is in was recorded (so the agreement above covers it).
        expected = {group for group, size in (("tp", tp), ("dcp", dcp), ("pcp", pcp)) if size > 1}
        assert {c.group for c in calls} == expected, name
        steps = step_counts(logs[0])
        assert {kind for kind, _ in steps} == {"prefill", "mixed", "decode"}, name
        assert all(sum(groups.values()) > 0 for _, groups in steps), f"{name}: a step issued no collective"


def test_a_rank_that_skips_one_collective_fails(recorded: Callable[[Layout], RecordedRun]) -> None:
    """The logs of a passing layout with one call left out on one rank (as a rank that skipped it would log)."""
    logs = recorded((2, 2, 2, 1))["mla"]
    assert check_logs(logs) == []
    rank_3 = list(logs[3])
    dcp_calls = [i for i, e in enumerate(rank_3) if isinstance(e, CollectiveCall) and e.group == "dcp"]
    dropped = rank_3.pop(dcp_calls[5])
    assert isinstance(dropped, CollectiveCall)
    assert dropped.members == (1, 3)  # the DCP group of TP rank 1 in both PCP groups
    [problem] = check_logs({**logs, 3: rank_3})
    assert problem.startswith("the dcp group [1, 3] diverges at call 5: rank 1 issued ")


# ---- a real gloo group (after the layouts: the pool's processes are up by then) -------------------------------------


def _gloo_rank(rank: int, port: int, out_dir: str) -> None:
    """Two ranks over gloo (transport "gloo": TorchCollectives): every op through the recorder, checked; an
    all_to_all the transport refuses (logged before it raised); then rank 1 issues one recorded all_reduce more,
    which rank 0 matches past its recorder."""
    base = init_parallel_state(2, rank, 1, 1, f"tcp://127.0.0.1:{port}", "gloo", 60.0, transport="gloo")
    try:
        log: list[LogEntry] = []
        parallel = record_parallel(base, log)
        comm = parallel.tp_comm
        assert comm is not None and base.tp_comm is not None
        assert RecordingCollectives(base.tp_comm, []).members == (0, 1)  # learned from the group itself
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
        summed = comm.all_reduce(x.clone())
        torch.testing.assert_close(summed, torch.arange(6.0).reshape(2, 3) * 2 + 10)
        torch.testing.assert_close(comm.all_gather(x), torch.stack([x - 10 * rank, x - 10 * rank + 10]))
        received = comm.all_to_all(x[:, :2].contiguous())
        torch.testing.assert_close(received[1 - rank], torch.arange(6.0).reshape(2, 3)[rank, :2] + 10 * (1 - rank))
        gathered = comm.gather(x)
        assert (gathered is None) == (rank == 1)
        try:
            comm.all_to_all(torch.zeros(3, 2))
        except ValueError:
            pass
        else:
            raise AssertionError("TorchCollectives took an all_to_all of 3 parts in a group of 2")
        extra = torch.ones(4)
        (comm if rank == 1 else base.tp_comm).all_reduce(extra)  # rank 0's goes past the recorder
        torch.testing.assert_close(extra, torch.full((4,), 2.0))
        save_log(log, Path(out_dir) / f"gloo_rank{rank}.json")
        torch.distributed.barrier()
    finally:
        destroy_parallel_state(base)


def test_gloo_group_forwards_records_and_catches_an_extra_all_reduce(tmp_path: Path, spawn_pool: SpawnPool) -> None:
    spawn_pool.spawn(_gloo_rank, (free_port(), str(tmp_path)), 2)
    logs = {r: load_log(tmp_path / f"gloo_rank{r}.json") for r in range(2)}
    calls = [[e for e in logs[r] if isinstance(e, CollectiveCall)] for r in range(2)]
    assert [c.op for c in calls[0]] == ["all_reduce", "all_gather", "all_to_all", "gather", "all_to_all"]
    assert [c.op for c in calls[1]] == [c.op for c in calls[0]] + ["all_reduce"]
    assert {(c.group, c.members, c.transport) for c in calls[0] + calls[1]} == {("tp", (0, 1), "gloo")}
    assert calls[0][4].lead == 3 and calls[0][2].lead == 2
    problems = check_logs(logs)
    assert sum("leading dim 3 is not the group size 2" in p for p in problems) == 2
    assert ("the tp group [0, 1] diverges at call 5: rank 0 issued nothing (its calls end here), rank 1 issued "
            "all_reduce [4] float32 on cpu") in problems
    assert len(problems) == 3
