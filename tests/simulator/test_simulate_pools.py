"""`dcpserve simulate --pool` (dcpserve/simulator/build.py): an app of layout pools from the command line. Each pool's
text parsed or refused naming the value and the fix; pools that cannot be placed or budgeted refused before anything
runs; each pool built with its own layout's KV pool and step model and its own autoscaling; a pooled run through
the command's entry point reporting each pool and where the queue granted; without --pool, the setup as before."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dcpserve.cli import build_parser
from dcpserve.cluster.published_models import model_spec
from dcpserve.simulator.build import PoolOption, build, parse_pool, place_replicas
from dcpserve.simulator.gpus import H100
from dcpserve.simulator.step_fit import LinearStepModel
from dcpserve.simulator.step_time import RooflineModel
from dcpserve.simulator.trace import TraceRequest, expected_hash_ids, write_trace

from .test_simulation import simulate_cli

DSV2_ON_H100 = ("--model", "deepseek-v2-lite", "--gpu", "h100")


def simulate_args(*args: str) -> argparse.Namespace:
    """dcpserve simulate's parsed arguments."""
    return build_parser().parse_args(["simulate", "--quiet", *args])


# ---- the option's text ------------------------------------------------------------------------------------------

def test_a_pool_is_name_colon_layout_with_dcp_and_replicas_defaulting_to_one() -> None:
    assert parse_pool("long:tp=8,dcp=8,replicas=2") == PoolOption("long", 8, 8, 2)
    assert parse_pool("short-1:tp=8") == PoolOption("short-1", 8, 1, 1)
    assert parse_pool("b:replicas=3, dcp=2, tp=4") == PoolOption("b", 4, 2, 3)  # any order, spaces allowed
    assert str(PoolOption("long", 8, 8, 2)) == "long:tp=8,dcp=8,replicas=2"
    assert parse_pool(str(PoolOption("long", 8, 8, 2))) == PoolOption("long", 8, 8, 2)


@pytest.mark.parametrize("value,fragment", [
    ("tp=8,dcp=8", "pool 'tp=8,dcp=8' has no name: write it as NAME:tp=T,dcp=D[,replicas=N]"),
    ("Long:tp=8", "pool name 'Long': lower-case letters, digits and dashes, starting with a letter"),
    ("8k:tp=8", "pool name '8k'"),
    ("long:tp=8,dcp=x", "pool 'long:tp=8,dcp=x': 'dcp=x' is not tp=, dcp= or replicas= with a whole number >= 1"),
    ("long:tp=8,replicas=0", "'replicas=0' is not tp=, dcp= or replicas="),
    ("long:tp=8,nodes=2", "'nodes=2' is not tp=, dcp= or replicas="),
    ("long:tp=8,tp=4", "pool 'long:tp=8,tp=4' gives tp twice"),
    ("long:dcp=8", "pool 'long:dcp=8' names no tp"),
    ("long:", "pool 'long:': '' is not tp=, dcp= or replicas="),
])
def test_a_bad_pool_is_refused_by_the_parser_naming_the_value_and_the_form(value: str, fragment: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_pool(value)
    assert fragment in str(raised.value)
    assert "(for example long:tp=8,dcp=8,replicas=1)" in str(raised.value)
    status, stdout, stderr = simulate_cli("--trace", "chat", *DSV2_ON_H100, "--pool", value)
    assert status == 2 and "argument --pool: pool" in stderr and fragment in stderr and stdout == ""


@pytest.mark.parametrize("args,fragment", [
    (("--pool", "a:tp=1", "--layout", "tp=1"),
     "--layout with --pool: each --pool gives its own layout and replicas, as NAME:tp=T,dcp=D[,replicas=N]; "
     "drop --layout"),
    (("--pool", "a:tp=1", "--replicas", "1"), "--replicas with --pool"),
    (("--pool", "a:tp=1", "--pool", "b:tp=2", "--pool", "a:tp=2"),
     "--pool a given more than once: name each pool once"),
    (("--pool", "a:tp=4"), "pool a: tp=4 spans more than one node of 2 GPUs; a replica never spans nodes"),
    (("--pool", "a:tp=2,dcp=3"), "pool a: dcp=3 must divide tp=2"),
    (("--pool", "a:tp=2,replicas=2", "--pool", "b:tp=1,replicas=1"),
     "the pools' replicas do not fit 2 node(s) of 2 GPUs (a replica never spans nodes): a 2 x tp=2 + b 1 x tp=1 = 5 "
     "GPUs; lower replicas= or add --nodes"),
    (("--pool", "a:tp=1", "--gpu-budget", "5"),
     "--gpu-budget 5 is more than the 4 GPUs of --nodes 2 x --gpus-per-node 2"),
    (("--pool", "a:tp=2", "--pool", "b:tp=1,replicas=2", "--gpu-budget", "3"),
     "--gpu-budget 3 cannot hold the replicas (all of them: no --autoscale): a 1 x tp=2 + b 2 x tp=1 = 4 GPUs; raise "
     "--gpu-budget to 4 or run fewer replicas"),
    (("--pool", "a:tp=2,replicas=2", "--pool", "b:tp=2,replicas=2", "--autoscale", "--min-replicas", "2",
      "--gpu-budget", "4"),
     "--gpu-budget 4 cannot hold the --min-replicas: a 2 x tp=2 + b 2 x tp=2 = 8 GPUs; raise --gpu-budget to 8 or "
     "lower --min-replicas"),
    (("--pool", "a:tp=1", "--autoscale", "--min-replicas", "2"),
     "pool a: --min-replicas 2 is more than its replicas=1, the most it may reach with --autoscale; raise replicas= "
     "in --pool a:tp=1,dcp=1,replicas=1 or lower --min-replicas"),
    (("--pool", "a:tp=1", "--sweep", "layouts"), "--sweep layouts runs one layout at a time, --pool several at once"),
    (("--pool", "a:tp=1", "--gpu-budget", "0"), "argument --gpu-budget: must be a whole number >= 1, got 0"),
])
def test_pools_that_cannot_run_are_refused_before_anything_is_simulated(args: tuple[str, ...], fragment: str) -> None:
    status, stdout, stderr = simulate_cli("--trace", "chat", "--requests", "5", *DSV2_ON_H100, "--nodes", "2",
                                          "--gpus-per-node", "2", *args)
    assert status != 0 and fragment in stderr, stderr
    assert stdout == ""


def test_replicas_are_placed_whole_on_nodes_largest_first() -> None:
    assert place_replicas([4, 2, 2, 8], nodes=2, gpus_per_node=8)  # 8 | 4 + 2 + 2
    assert place_replicas([4, 4, 4, 2, 2], nodes=2, gpus_per_node=8)  # 4 + 4 | 4 + 2 + 2
    assert not place_replicas([4, 4, 4], nodes=2, gpus_per_node=6)  # 12 GPUs in all, but no node holds two 4s
    assert not place_replicas([8], nodes=1, gpus_per_node=4)
    assert place_replicas([], nodes=1, gpus_per_node=1)
    # With a budget the pools share it: each pool's replicas (the most it may reach) need only fit on their own.
    pools = ("--trace", "chat", *DSV2_ON_H100, "--nodes", "2", "--gpus-per-node", "2", "--pool", "a:tp=2,replicas=2",
             "--pool", "b:tp=1,replicas=2", "--autoscale")
    with pytest.raises(ValueError, match="a 2 x tp=2 \\+ b 2 x tp=1 = 6 GPUs"):
        build(simulate_args(*pools))
    simulation, _ = build(simulate_args(*pools, "--gpu-budget", "4"))
    assert simulation.config.gpu_budget == 4


# ---- what each pool is built as ---------------------------------------------------------------------------------

def test_each_pool_has_its_own_layouts_kv_and_roofline_and_its_own_autoscaling(tmp_path: Path) -> None:
    args = ("--trace", "chat", *DSV2_ON_H100, "--nodes", "2", "--gpus-per-node", "4", "--gpu-memory-utilization",
            "0.4", "--pool", "short:tp=1,replicas=3", "--pool", "long:tp=2,dcp=2,replicas=2")
    simulation, facts = build(simulate_args(*args))
    pools = simulation.config.pools
    assert [(p.name, p.shape.tp, p.shape.dcp, p.num_replicas) for p in pools] == [("short", 1, 1, 3),
                                                                                  ("long", 2, 2, 2)]
    spec = model_spec("deepseek-v2-lite")
    for pool in pools:
        roofline = RooflineModel(spec, H100, pool.shape.tp, pool.shape.dcp)
        assert pool.shape.num_blocks == roofline.kv_blocks_per_replica(16, 0.4)
        assert isinstance(pool.step_model, RooflineModel)
        assert (pool.step_model.tp, pool.step_model.dcp) == (pool.shape.tp, pool.shape.dcp)
        assert pool.autoscaling is None
    assert simulation.config.gpu_budget is None and simulation.config.autoscaling is None
    assert facts["pools"] == [
        {"name": "short", "layout": "tp=1 dcp=1", "replicas": 3, "kv_tokens_per_replica": 89_856,
         "step_model": pools[0].step_model.describe()},  # type: ignore[union-attr]  # set: asserted above
        {"name": "long", "layout": "tp=2 dcp=2", "replicas": 2, "kv_tokens_per_replica": 1_187_392,
         "step_model": pools[1].step_model.describe()},  # type: ignore[union-attr]  # set: asserted above
    ]
    assert (facts["gpus"], facts["replicas"], facts["layout"]) == (8, 5, "short tp=1 dcp=1 + long tp=2 dcp=2")

    # --autoscale: each pool's own policy, up to its replicas, within the budget; a fitted step model for all.
    fit = LinearStepModel(c0=2e-3, c_tok=20e-6, c_seq=0.0, c_ctx=1e-9, c_pair=0.0)
    (tmp_path / "fit.json").write_text(fit.to_json())
    simulation, facts = build(simulate_args(*args, "--autoscale", "--target-sequences-per-replica", "3",
                                            "--gpu-budget", "6", "--step-model", str(tmp_path / "fit.json")))
    assert simulation.config.gpu_budget == 6 and facts["gpu_budget"] == 6
    for pool in simulation.config.pools:
        assert pool.autoscaling is not None
        assert (pool.autoscaling.min_replicas, pool.autoscaling.max_replicas) == (1, pool.num_replicas)
        assert pool.autoscaling.target_sequences_per_replica == 3.0
        assert pool.step_model == fit
    assert [pool["min_replicas"] for pool in facts["pools"]] == [1, 1]
    assert facts["step_model"] == fit.describe()
    assert set(simulation.scaling) == {"short", "long"}  # both pools autoscale, sharing the budget's ledger


def test_without_pools_the_setup_is_what_it_was() -> None:
    simulation, facts = build(simulate_args("--trace", "chat", *DSV2_ON_H100, "--gpus-per-node", "2",
                                            "--layout", "tp=2,dcp=2"))
    assert set(facts) == {"model", "gpu", "gpus", "layout", "replicas", "kv_tokens_per_replica", "step_model"}
    assert simulation.config.pools == () and simulation.config.gpu_budget is None
    assert set(simulation.pools) == {"default"}


# ---- a pooled run -----------------------------------------------------------------------------------------------

def short_and_long(tmp_path: Path) -> tuple[Path, list[TraceRequest]]:
    """12 short requests (~1k tokens) and 3 of 100k tokens, 3 s apart: the load is light, so no grant is refused."""
    requests = []
    for index in range(15):
        length = 100_000 if index % 5 == 4 else 1_000 + 37 * index
        ids = tuple(range(index * 1000, index * 1000 + expected_hash_ids(length)))
        requests.append(TraceRequest(index * 3000.0, length, 20, ids))
    path = tmp_path / "trace.jsonl"
    write_trace(path, requests)
    return path, requests


def test_a_pooled_run_reports_each_pool_and_where_the_queue_granted(tmp_path: Path) -> None:
    """The short pool (tp=1 at utilization 0.4) holds 89,856 tokens per replica, the long one (tp=2 x dcp=2) 1.19M:
    the three 100k-token requests can go to the long pool only, the others to either."""
    path, trace = short_and_long(tmp_path)
    status, stdout, stderr = simulate_cli(
        "--trace", str(path), *DSV2_ON_H100, "--nodes", "2", "--gpus-per-node", "2", "--gpu-memory-utilization",
        "0.4", "--max-model-len", "131072", "--pool", "short:tp=1,replicas=2", "--pool", "long:tp=2,dcp=2",
        "--out", str(tmp_path / "out"))
    assert status == 0, stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["finished"] == len(trace) and summary["refused"] == {}
    assert summary["setup"]["pools"] == [
        {"name": "short", "layout": "tp=1 dcp=1", "replicas": 2, "kv_tokens_per_replica": 89_856,
         "step_model": RooflineModel(model_spec("deepseek-v2-lite"), H100, 1, 1).describe()},
        {"name": "long", "layout": "tp=2 dcp=2", "replicas": 1, "kv_tokens_per_replica": 1_187_392,
         "step_model": RooflineModel(model_spec("deepseek-v2-lite"), H100, 2, 2).describe()},
    ]
    grants = summary["pool_grants"]
    assert "refused_by_replica" not in summary["admission"]  # one grant per request
    assert sum(grants.values()) == summary["admission"]["admitted"] == len(trace)
    assert grants["long/only_pool"] == 3  # the 100k-token requests, and nothing the short pool could hold
    assert {key.split("/")[0] for key in grants} <= {"short", "long"}
    assert summary["replicas_over_time"][-1][1] == 3 and summary["gpu_seconds"] > 0

    rows = dict(line.split("  ", 1) for line in stdout.splitlines())
    assert rows["pool short"].strip() == "tp=1 dcp=1, 2 replicas, 89,856 KV tokens per replica"
    assert rows["pool long"].strip() == "tp=2 dcp=2, 1 replica, 1,187,392 KV tokens per replica"
    assert rows["GPU"].strip() == "H100 SXM 80GB x 4"
    assert rows["grants by pool/reason"].strip() == ", ".join(f"{key} {n}" for key, n in grants.items())
    assert "layout" not in rows and "replicas" not in rows
