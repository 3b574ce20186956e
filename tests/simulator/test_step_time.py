"""Step-time models and GPU specs: StepWork arithmetic, the roofline's regimes and layout effects, KV capacity against
the planner, and the linear fit (pure CPU, no Ray)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dcpserve.cluster.model_specs import GqaSpec, MlaSpec, model_spec_from_dict
from dcpserve.cluster.planner import PlanRequest, plan_layouts
from dcpserve.cluster.published_models import DEEPSEEK_V3, KIMI_K2
from dcpserve.simulator.gpus import GPUS, gpu_spec
from dcpserve.simulator.step_fit import FitReport, LinearStepModel
from dcpserve.simulator.step_time import RooflineModel, StepTimeModel, StepWork, expected_experts_touched

H100, H200, B200 = gpu_spec("h100"), gpu_spec("h200"), gpu_spec("b200")
LLAMA_8B_RAW: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def gqa(**overrides: Any) -> GqaSpec:
    spec = model_spec_from_dict({**LLAMA_8B_RAW, **overrides})
    assert isinstance(spec, GqaSpec)
    return spec


def mla(raw: dict[str, Any]) -> MlaSpec:
    spec = model_spec_from_dict(raw)
    assert isinstance(spec, MlaSpec)
    return spec


LLAMA_8B = gqa()
LLAMA_8B_2KV = gqa(num_key_value_heads=2)  # Llama-3-8B's shape with 2 KV heads, so that tp=8 allows dcp up to 4
K2, V3 = mla(KIMI_K2), mla(DEEPSEEK_V3)


def decode(num_seqs: int, context: int) -> StepWork:
    """num_seqs decode rows, each attending to `context` tokens after the step."""
    return StepWork.from_rows([(context - 1, 1)] * num_seqs)


# ---- StepWork ------------------------------------------------------------------------------------------------------


def test_from_rows_counts_a_mixed_step_by_hand() -> None:
    # A first prefill chunk of 5, a decode after 10, a second chunk of 3 after 7, a one-token prompt.
    work = StepWork.from_rows([(0, 5), (10, 1), (7, 3), (0, 1)])
    assert (work.num_seqs, work.num_tokens, work.num_decode) == (4, 10, 2)
    assert work.context_tokens == 5 + 11 + 10 + 1
    assert work.attention_pairs == 15 + 11 + (3 * 7 + 6) + 1
    assert work.decode_context_tokens == 11 + 1
    assert work.prefill_context_queries == 3  # the first chunk attends to no cached context
    assert StepWork.from_rows([]) == StepWork(0, 0, 0, 0, 0, 0, 0)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: StepWork(-1, 0, 0, 0, 0, 0, 0), "num_seqs"),
    (lambda: StepWork(1, 1, 1, 1, -5, 1, 0), "attention_pairs"),
    (lambda: StepWork(1, 1, 1, 0, 0, 0, 0), "inconsistent"),  # a decode row attends to at least its own token
    (lambda: StepWork.from_rows([(-1, 1)]), "start_position"),
    (lambda: StepWork.from_rows([(4, 0)]), "num_new_tokens"),
])
def test_step_work_rejects_bad_counts(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


# ---- GPUs and inputs -----------------------------------------------------------------------------------------------


def test_gpu_specs_are_dense_and_sourced() -> None:
    assert set(GPUS) == {"h100", "h200", "b200"} and gpu_spec("H200") is H200
    for spec in GPUS.values():
        assert spec.sources and spec.fp8_flops_per_s == pytest.approx(2 * spec.bf16_flops_per_s, rel=0.01)
    assert H100.bf16_flops_per_s == pytest.approx(1979e12 / 2, rel=0.001)  # the datasheet's "with sparsity" halved
    assert (H100.fp4_flops_per_s, H200.fp4_flops_per_s, B200.fp4_flops_per_s) == (None, None, 9e15)
    assert (H100.nvlink_bytes_per_s, B200.nvlink_bytes_per_s) == (900e9 / 2, 1.8e12 / 2)  # per direction
    with pytest.raises(ValueError, match="unknown GPU 'a100'; choose one of h100, h200, b200"):
        gpu_spec("a100")


def test_bad_dtypes_and_layouts_name_the_choices() -> None:
    with pytest.raises(ValueError, match="weight_dtype 'int4' is not supported; choose one of .*float8, nvfp4"):
        RooflineModel(LLAMA_8B, H100, 1, weight_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype 'nvfp4' is not supported"):
        RooflineModel(LLAMA_8B, H100, 1, kv_dtype="nvfp4")
    with pytest.raises(ValueError, match="dcp=2 needs tp > kv_heads"):  # the spec's own layout rule
        RooflineModel(LLAMA_8B, H100, 8, 2)
    with pytest.raises(ValueError, match="mbu must be in"):
        RooflineModel(LLAMA_8B, H100, 1, mbu=1.5)


def test_weights_that_do_not_fit_raise_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"weights need 2\d\d\.\d\d GiB per rank at tp=8 \(bfloat16\) but an "
                                         r"H100 SXM 80GB holds 79\.65 GiB; raise tp"):
        RooflineModel(K2, H100, 8)
    RooflineModel(K2, B200, 8, weight_dtype="nvfp4")  # ~1.03T parameters at 4.5 bits: ~67 GiB per rank


# ---- Roofline regimes ----------------------------------------------------------------------------------------------


def test_large_decode_batch_is_memory_bound_and_dcp_divides_the_kv_read() -> None:
    work = decode(256, 8192)
    parts = {dcp: RooflineModel(LLAMA_8B_2KV, H100, 8, dcp).breakdown(work) for dcp in (1, 2, 4)}
    assert parts[1]["weights"] + parts[1]["kv"] > 3 * parts[1]["compute"]
    assert parts[2]["kv"] == pytest.approx(parts[1]["kv"] / 2, rel=1e-12)
    assert parts[4]["kv"] == pytest.approx(parts[1]["kv"] / 4, rel=1e-12)
    assert parts[1]["weights"] == parts[2]["weights"] == parts[4]["weights"]
    assert parts[1]["compute"] == pytest.approx(parts[4]["compute"], rel=1e-12)  # DCP moves FLOPs, adds none
    assert parts[1]["dcp_comm"] == 0 < parts[2]["dcp_comm"] < parts[4]["dcp_comm"]
    assert parts[1]["total"] > parts[2]["total"] > parts[4]["total"]


def test_mla_dcp8_cuts_the_kv_read_8x_and_adds_the_exchange() -> None:
    work = decode(64, 67_000)
    dcp1 = RooflineModel(K2, B200, 8, 1, weight_dtype="nvfp4").breakdown(work)
    dcp8 = RooflineModel(K2, B200, 8, 8, weight_dtype="nvfp4").breakdown(work)
    assert dcp1["kv"] / dcp8["kv"] == pytest.approx(8, rel=1e-12)
    assert dcp1["dcp_comm"] == 0 < dcp8["dcp_comm"]
    assert (dcp1["weights"], dcp1["tp_comm"]) == (dcp8["weights"], dcp8["tp_comm"])
    assert dcp1["compute"] == pytest.approx(dcp8["compute"], rel=1e-12)
    assert dcp1["kv"] > dcp1["weights"] + dcp1["compute"]  # 64 x 67k of latents dominates at dcp=1
    assert dcp8["total"] < dcp1["total"] / 2


def test_dcp_exchange_of_one_decode_row_by_hand() -> None:
    model = RooflineModel(K2, B200, 8, 8, weight_dtype="nvfp4")
    # Per layer: 7 peers x 8 heads per rank x (a 576-value bf16 absorbed query + a 512-value fp32 output and its lse).
    exchanged = 7 * 8 * (576 * 2 + 513 * 4)
    expected = 61 * (exchanged / (900e9 * 0.8) + 2 * 7 * B200.nvlink_latency_s)
    assert model.breakdown(decode(1, 1000))["dcp_comm"] == pytest.approx(expected, rel=1e-12)
    assert model.breakdown(StepWork.from_rows([(0, 4096)]))["dcp_comm"] == 0  # a first chunk: no cached context


def test_tp_comm_is_zero_at_tp1_and_counted_by_hand_at_tp2() -> None:
    work = decode(1, 100)
    single = RooflineModel(LLAMA_8B, H100, 1).breakdown(work)
    assert single["tp_comm"] == single["dcp_comm"] == 0
    pair = RooflineModel(LLAMA_8B, H100, 2).breakdown(work)
    bandwidth, alpha = 450e9 * 0.8, H100.nvlink_latency_s
    all_reduce = 2 * 1 / 2 * 4096 * 2 / bandwidth + 2 * 1 * alpha  # one token's bf16 hidden state
    gather = 1 / 2 * 128256 * 2 / bandwidth + alpha  # its bf16 logits
    assert pair["tp_comm"] == pytest.approx((2 * 32 + 1) * all_reduce + gather, rel=1e-12)


def test_long_prefill_chunks_are_compute_bound() -> None:
    dense = RooflineModel(LLAMA_8B, H100, 1).breakdown(StepWork.from_rows([(0, 8192)]))
    assert dense["compute"] > 10 * (dense["weights"] + dense["kv"])
    later_chunk = RooflineModel(K2, B200, 8, 8, weight_dtype="nvfp4").breakdown(StepWork.from_rows([(60_000, 8192)]))
    assert later_chunk["compute"] > 5 * (later_chunk["weights"] + later_chunk["kv"])
    assert later_chunk["total"] == pytest.approx(
        later_chunk["compute"] + later_chunk["tp_comm"] + later_chunk["dcp_comm"] + later_chunk["overhead"])


def test_mla_attention_flops_by_hand_absorbed_decode_and_non_absorbed_prefill() -> None:
    # Kimi K2 at tp=8: 8 heads per rank, 61 layers, latent 512 + rope 64, nope 128, v 128. Differences of two steps
    # with the same linear work leave the attention alone.
    model = RooflineModel(K2, B200, 8, weight_dtype="nvfp4", mfu=1.0)
    decode_extra = model.breakdown(decode(1, 8192))["compute"] - model.breakdown(decode(1, 1))["compute"]
    absorbed = 8191 * 8 * 61 * (2 * (512 + 64) + 2 * 512)
    assert decode_extra * B200.bf16_flops_per_s == pytest.approx(absorbed, rel=1e-9)
    chunk = model.breakdown(StepWork.from_rows([(1000, 2048)]))["compute"]
    first_chunk = model.breakdown(StepWork.from_rows([(0, 2048)]))["compute"]
    non_absorbed = 2048 * 1000 * 8 * 61 * (2 * (128 + 64) + 2 * 128)
    up_projection = 1000 * 8 * 61 * 2 * 512 * (128 + 128)  # kv_b_proj over the 1000 cached latents
    assert (chunk - first_chunk) * B200.bf16_flops_per_s == pytest.approx(non_absorbed + up_projection, rel=1e-9)


def test_moe_expert_touch_formula_and_weight_read() -> None:
    assert expected_experts_touched(1, 8, 384) == pytest.approx(8, rel=1e-12)
    assert expected_experts_touched(0, 8, 384) == 0
    assert expected_experts_touched(100_000, 8, 384) == pytest.approx(384, rel=1e-12)
    touched = [expected_experts_touched(t, 8, 384) for t in (1, 2, 16, 256, 4096)]
    assert touched == sorted(touched) and len(set(touched)) == len(touched)
    model = RooflineModel(K2, B200, 8, weight_dtype="nvfp4")
    hbm = B200.hbm_bytes_per_s * model.mbu
    read = {t: model.breakdown(StepWork.from_rows([(0, t)] if t > 1 else [(5, 1)]))["weights"] * hbm
            for t in (1, 64, 100_000)}
    assert read[1] < 0.1 * model.weight_bytes_per_rank < read[64] < read[100_000]
    # Every expert touched: all weights but the input embedding (a lookup) are read.
    assert read[100_000] == pytest.approx(model.weight_bytes_per_rank, rel=0.005)
    assert read[100_000] < model.weight_bytes_per_rank


def test_empty_step_takes_no_time() -> None:
    models: list[StepTimeModel] = [RooflineModel(LLAMA_8B, H100, 1), LinearStepModel(1e-3, 1e-5, 1e-6, 1e-9, 1e-12)]
    for model in models:
        assert model.step_seconds(StepWork.from_rows([])) == 0
        assert model.step_seconds(decode(4, 100)) > 0
        assert "\n" not in model.describe() and model.name in model.describe()


# ---- KV capacity ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "gpu", "weight_dtype", "block_size", "tp", "dcp"), [
    (V3, H200, "float8", 64, 8, 1),
    (V3, H200, "float8", 64, 8, 8),
    (LLAMA_8B, H100, "bfloat16", 16, 1, 1),
    (LLAMA_8B_2KV, H100, "bfloat16", 16, 8, 4),
])
def test_kv_blocks_agree_with_the_planner(spec: GqaSpec | MlaSpec, gpu: Any, weight_dtype: str, block_size: int,
                                          tp: int, dcp: int) -> None:
    request = PlanRequest(8, gpu.memory_bytes, 131072, block_size=block_size, weight_dtype=weight_dtype,
                          kv_dtype="bfloat16")
    row = next(r for r in plan_layouts(spec, request) if (r.tp, r.dcp) == (tp, dcp))
    model = RooflineModel(spec, gpu, tp, dcp, weight_dtype=weight_dtype)
    blocks = model.kv_blocks_per_replica(block_size)
    assert blocks * block_size * dcp == row.kv_tokens_per_replica > 0


def test_activation_reserve_and_no_room_for_a_block() -> None:
    model = RooflineModel(V3, H200, 8, 8, weight_dtype="float8")
    page = 64 * model.kv_bytes_per_token_per_rank
    reserve = 4 << 30
    fewer = model.kv_blocks_per_replica(64) - model.kv_blocks_per_replica(64, activation_reserve_bytes=reserve)
    assert fewer in (reserve // page, reserve // page + 1)
    with pytest.raises(ValueError, match=r"no KV block fits tp=8 dcp=8 on H200 SXM 141GB: 0.5 of 140.40 GiB is "
                                         r"70.20 GiB per rank, weights take 7\d\.\d\d GiB"):
        model.kv_blocks_per_replica(64, gpu_memory_utilization=0.5)


# ---- Linear fit ----------------------------------------------------------------------------------------------------


def synthetic_steps() -> list[StepWork]:
    steps = [decode(seqs, context) for seqs in (1, 8, 64, 256) for context in (128, 4096, 65536)]
    steps += [StepWork.from_rows([(start, chunk)]) for start in (0, 8192, 60000) for chunk in (512, 2048, 8192)]
    steps += [StepWork.from_rows([(1000, 1)] * 32 + [(start, 1024)]) for start in (0, 20000)]
    return steps


def test_fit_recovers_known_constants_and_round_trips_json() -> None:
    truth = LinearStepModel(c0=1.5e-3, c_tok=2.0e-5, c_seq=4.0e-6, c_ctx=3.0e-9, c_pair=8.0e-13)
    samples = [(work, truth.step_seconds(work)) for work in synthetic_steps()]
    fitted, report = LinearStepModel.fit(samples)
    for name in ("c0", "c_tok", "c_seq", "c_ctx", "c_pair"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.01), name
    assert report.num_samples == len(samples) and report.p90_relative_error < 1e-6
    assert fitted.report == report and f"fit on {len(samples)} steps" in report.format()
    assert LinearStepModel.from_json(fitted.to_json()) == fitted
    assert LinearStepModel.from_json(truth.to_json()) == truth  # no report


def test_fit_of_noisy_steps_adds_up_to_the_measured_time() -> None:
    # Every fourth step slowed 3x (another process on the host): the relative-error fit alone follows the fast
    # ones; the fitted steps must still add up to the measured total, which is what the simulated clock runs on.
    truth = LinearStepModel(c0=1.5e-3, c_tok=2.0e-5, c_seq=4.0e-6, c_ctx=3.0e-9, c_pair=8.0e-13)
    samples = [(work, truth.step_seconds(work) * (3.0 if i % 4 == 0 else 1.0))
               for i, work in enumerate(synthetic_steps() * 4)]
    fitted, _ = LinearStepModel.fit(samples)
    assert sum(fitted.step_seconds(work) for work, _ in samples) == pytest.approx(sum(s for _, s in samples))
    assert fitted.c0 / truth.c0 == pytest.approx(fitted.c_tok / truth.c_tok, rel=0.05)  # the shape kept


def test_fit_keeps_constants_non_negative() -> None:
    # Seconds that fall with num_seqs: plain least squares would give c_seq < 0.
    samples = [(work, 1e-3 + 2e-5 * work.num_tokens - 2e-6 * work.num_seqs) for work in synthetic_steps()]
    fitted, report = LinearStepModel.fit(samples)
    constants = [fitted.c0, fitted.c_tok, fitted.c_seq, fitted.c_ctx, fitted.c_pair]
    assert min(constants) >= 0 and fitted.c_seq == 0
    errors = [abs(fitted.step_seconds(work) - seconds) / seconds for work, seconds in samples]
    assert report.median_relative_error == pytest.approx(float(np.median(errors)), rel=1e-9)
    assert report.p90_relative_error == pytest.approx(float(np.percentile(errors, 90)), rel=1e-9)
    assert 0 < report.median_relative_error < report.p90_relative_error < 0.2


def test_fit_and_json_reject_bad_input() -> None:
    work = decode(1, 10)
    with pytest.raises(ValueError, match="at least 5 samples"):
        LinearStepModel.fit([(work, 1e-3)] * 4)
    with pytest.raises(ValueError, match="finite and > 0"):
        LinearStepModel.fit([(work, 1e-3)] * 5 + [(work, 0.0)])
    with pytest.raises(ValueError, match="c_tok must be a finite number >= 0"):
        LinearStepModel(1e-3, -1e-5, 0, 0, 0)
    text = LinearStepModel(1e-3, 1e-5, 0, 0, 0, FitReport(7, 0.01, 0.02)).to_json()
    with pytest.raises(ValueError, match=r"lacks constants \['c_pair'\]"):
        LinearStepModel.from_json(text.replace('"c_pair"', '"c_pairs"'))
    with pytest.raises(ValueError, match="not a LinearStepModel JSON"):
        LinearStepModel.from_json("[]")


def test_scaled_model_takes_factor_times_as_long_for_every_step() -> None:
    model = LinearStepModel(1.5e-3, 2.0e-5, 4.0e-6, 3.0e-9, 8.0e-13, FitReport(9, 0.05, 0.1))
    slower = model.scaled(2.5)
    for work in synthetic_steps():
        assert slower.step_seconds(work) == pytest.approx(2.5 * model.step_seconds(work), rel=1e-12)
    assert slower.report == model.report
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale factor must be a finite number > 0"):
            model.scaled(bad)
