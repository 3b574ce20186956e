"""The simulation `dcpserve simulate`'s arguments describe (`build`): each replica's shape (its KV pool as the
roofline sizes it, the scheduler's limits), the step-time model, the replicas and their autoscaling; or, with
--pool, an app of layout pools (`PoolOption`, `parse_pool`), each pool a layout of its own, placed on the nodes
(`place_replicas`: a replica never spans nodes) within --gpu-budget. Bad input raises ValueError naming the value and
the fix; dcpserve/simulator/cli.py turns it into the command's error.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dcpserve.cluster.generic_spec import GenericSpec
from dcpserve.cluster.model_specs import GqaSpec, MlaSpec
from dcpserve.cluster.published_models import model_spec
from dcpserve.deployments.config import POOL_NAME, AutoscalingArgs
from dcpserve.engine.config import SchedulerConfig
from dcpserve.simulator.gpus import GpuSpec, gpu_spec
from dcpserve.simulator.host_tier import HostKvOption, host_tier_shape
from dcpserve.simulator.replica import ReplicaShape
from dcpserve.simulator.run import ServeSettings, SimPool, Simulation, SimulationConfig
from dcpserve.simulator.step_fit import LinearStepModel
from dcpserve.simulator.step_time import RooflineModel, StepTimeModel
from dcpserve.simulator.trace import MOONCAKE_BLOCK_TOKENS

POOL_FORM = "NAME:tp=T,dcp=D[,replicas=N]"
POOL_SYNTAX = f"{POOL_FORM} (for example long:tp=8,dcp=8,replicas=1)"


@dataclass(frozen=True)
class PoolOption:
    """One --pool: a layout pool's name, layout and replicas (with --autoscale, the most it may reach)."""

    name: str
    tp: int
    dcp: int = 1
    replicas: int = 1

    @property
    def layout(self) -> str:
        return f"tp={self.tp} dcp={self.dcp}"

    def __str__(self) -> str:
        """The option's own text: name:tp=T,dcp=D,replicas=N."""
        return f"{self.name}:tp={self.tp},dcp={self.dcp},replicas={self.replicas}"


def parse_pool(value: str) -> PoolOption:
    """"long:tp=8,dcp=8,replicas=2" -> PoolOption("long", 8, 8, 2); dcp defaults to 1, replicas to 1."""
    name, colon, layout = value.partition(":")
    if not colon:
        raise ValueError(f"pool {value!r} has no name: write it as {POOL_SYNTAX}")
    if re.fullmatch(POOL_NAME, name) is None:
        raise ValueError(f"pool name {name!r}: lower-case letters, digits and dashes, starting with a letter, at most "
                         f"32 (a serve config's pool name); write the pool as {POOL_SYNTAX}")
    fields: dict[str, int] = {}
    for part in layout.split(","):
        key, _, number = (text.strip() for text in part.partition("="))
        if key in fields:
            raise ValueError(f"pool {value!r} gives {key} twice: write it as {POOL_SYNTAX}")
        if key not in ("tp", "dcp", "replicas") or not number.isdigit() or int(number) < 1:
            raise ValueError(f"pool {value!r}: {part.strip()!r} is not tp=, dcp= or replicas= with a whole number "
                             f">= 1; write it as {POOL_SYNTAX}")
        fields[key] = int(number)
    if "tp" not in fields:
        raise ValueError(f"pool {value!r} names no tp: write it as {POOL_SYNTAX}")
    return PoolOption(name, fields["tp"], fields.get("dcp", 1), fields.get("replicas", 1))


def build(args: argparse.Namespace) -> tuple[Simulation, dict[str, Any]]:
    """The simulation the arguments describe, and the facts of its setup for the table (raises ValueError)."""
    spec = model_spec(args.model)
    gpu = gpu_spec(args.gpu)
    serve = ServeSettings(max_queued_requests=args.max_queued_requests, queue_timeout_s=args.queue_timeout_s,
                          prefix_routing=not args.no_prefix_routing,
                          admission_ttft_bound_s=args.admission_ttft_bound_s,
                          admission_prefix_hold=not args.no_admission_prefix_hold)
    if args.pool:
        return _build_pools(args, spec, gpu, serve)
    tp, dcp = args.layout if args.layout is not None else (args.gpus_per_node, 1)
    shape, roofline = _replica_shape(args, spec, gpu, tp, dcp)
    step_model: StepTimeModel = _fitted_step_model(args) or roofline
    gpus = args.nodes * args.gpus_per_node
    fit = (args.gpus_per_node // tp) * args.nodes
    if fit < 1:
        raise ValueError(f"no replica of tp={tp} fits {args.nodes} node(s) of {args.gpus_per_node} GPUs")
    replicas = args.replicas or fit
    if replicas > fit:
        raise ValueError(f"--replicas {replicas} of tp={tp} need {replicas * tp} GPUs; {args.nodes} node(s) of "
                         f"{args.gpus_per_node} hold {fit} replicas")
    autoscaling = None
    if args.autoscale:
        autoscaling = _autoscaling(args, replicas)
    kept = args.min_replicas if args.autoscale else replicas  # what a budget must hold
    _check_gpu_budget(args, [(f"{kept} x tp={tp}", kept * tp)])
    config = SimulationConfig(shape=shape, num_replicas=replicas, serve=serve, autoscaling=autoscaling,
                              replica_start_s=args.replica_start_s, concurrency=args.concurrency,
                              trace_block_tokens=_trace_block_tokens(args),
                              request_latency_s=args.request_latency_s,
                              progress=None if args.quiet else sys.stderr, gpu_budget=args.gpu_budget)
    facts: dict[str, Any] = {
        "model": spec.describe_shape(), "gpu": gpu.name, "gpus": gpus, "layout": f"tp={tp} dcp={dcp}",
        "replicas": replicas, "kv_tokens_per_replica": shape.num_blocks * shape.tokens_per_block,
        "step_model": step_model.describe()}
    if shape.host_tier is not None:
        facts["host_kv_tokens_per_replica"] = shape.host_tier.num_blocks * shape.tokens_per_block
        facts["host_link_gbps"] = shape.host_tier.load_bytes_per_s / 1e9
    if args.gpu_budget is not None:
        facts["gpu_budget"] = args.gpu_budget
    return Simulation(config, step_model), facts


def _replica_shape(args: argparse.Namespace, spec: GqaSpec | MlaSpec | GenericSpec, gpu: GpuSpec, tp: int,
                   dcp: int) -> tuple[ReplicaShape, RooflineModel]:
    """One replica of the layout: its shape (the KV pool the roofline sizes, the scheduler's limits) and the roofline
    model of its steps."""
    if tp > args.gpus_per_node:
        raise ValueError(f"tp={tp} spans more than one node of {args.gpus_per_node} GPUs; a replica never spans "
                         f"nodes: lower tp or raise --gpus-per-node")
    roofline = RooflineModel(spec, gpu, tp, dcp, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype)
    num_blocks = roofline.kv_blocks_per_replica(args.block_size, args.gpu_memory_utilization)
    max_model_len = args.max_model_len or spec.max_position_embeddings
    scheduler = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens, admission=args.admission)
    tier = None
    host_kv: HostKvOption | None = getattr(args, "host_kv_per_node", None)
    if host_kv is not None:
        if args.no_prefix_caching:
            raise ValueError("--host-kv-per-node holds cached prefix blocks: drop --no-prefix-caching")
        link_gbps = getattr(args, "host_link_gbps", None)
        tier = host_tier_shape(host_kv, num_blocks, args.block_size * roofline.kv_bytes_per_token_per_rank,
                               args.gpus_per_node, gpu.host_link_bytes_per_s if link_gbps is None else link_gbps * 1e9)
        if tier.num_blocks < 1:
            raise ValueError(f"--host-kv-per-node {host_kv} holds no block of tp={tp} dcp={dcp} (a page of "
                             f"{tier.bytes_per_block_per_rank:,} bytes per GPU); give more host memory")
    shape = ReplicaShape(tp=tp, dcp=dcp, num_blocks=num_blocks, block_size=args.block_size, scheduler=scheduler,
                         enable_prefix_caching=not args.no_prefix_caching, host_tier=tier)
    return shape, roofline


def _trace_block_tokens(args: argparse.Namespace) -> int:
    """--trace-block-size: tokens per hash id of the trace (Mooncake's 512 when not given)."""
    value = getattr(args, "trace_block_size", None)
    return MOONCAKE_BLOCK_TOKENS if value is None else int(value)


def _fitted_step_model(args: argparse.Namespace) -> LinearStepModel | None:
    """--step-model's fitted model; None for the roofline (each layout its own)."""
    if args.step_model == "roofline":
        return None
    path = Path(args.step_model)
    if not path.is_file():
        raise ValueError(f"--step-model {args.step_model!r} is neither 'roofline' nor a fitted model's JSON file")
    return LinearStepModel.from_json(path.read_text())


# AutoscalingArgs' service-level fields, each a simulate option of its name (--ttft-target-s, ...), left to
# AutoscalingArgs' default when not given.
SLO_OPTIONS = ("ttft_target_s", "itl_target_s", "slo_percentile", "slo_window_s", "scale_down_fraction", "cooldown_s")


def _autoscaling(args: argparse.Namespace, max_replicas: int) -> AutoscalingArgs:
    slo = {name: getattr(args, name) for name in SLO_OPTIONS if getattr(args, name, None) is not None}
    try:
        return AutoscalingArgs(
            min_replicas=args.min_replicas, max_replicas=max_replicas,
            target_sequences_per_replica=args.target_sequences_per_replica,
            upscale_delay_s=args.upscale_delay_s, downscale_delay_s=args.downscale_delay_s, **slo)
    except ValidationError as err:  # each problem as the option it came from
        problems = []
        for error in err.errors():
            where = "--" + "-".join(str(part) for part in error["loc"]).replace("_", "-")
            message = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
            problems.append(f"{where}: {message}" if error["loc"] else message)
        raise ValueError("; ".join(problems)) from None


def _check_gpu_budget(args: argparse.Namespace, minimums: list[tuple[str, int]]) -> None:
    """--gpu-budget, if given, exists on the nodes and holds the replicas the app keeps (minimums: each pool's as
    (text, GPUs); with --autoscale its --min-replicas, else all of its replicas), as AppArgs checks it at deploy."""
    budget = args.gpu_budget
    if budget is None:
        return
    gpus = args.nodes * args.gpus_per_node
    if budget > gpus:
        raise ValueError(f"--gpu-budget {budget} is more than the {gpus} GPUs of --nodes {args.nodes} x "
                         f"--gpus-per-node {args.gpus_per_node}: lower it or add nodes")
    needed = sum(count for _, count in minimums)
    if needed > budget:
        kept, fewer = (("--min-replicas", "lower --min-replicas") if args.autoscale
                       else ("replicas (all of them: no --autoscale)", "run fewer replicas"))
        raise ValueError(f"--gpu-budget {budget} cannot hold the {kept}: {' + '.join(text for text, _ in minimums)} "
                         f"= {needed} GPUs; raise --gpu-budget to {needed} or {fewer}")


def place_replicas(sizes: list[int], nodes: int, gpus_per_node: int) -> bool:
    """Whether replicas of these sizes (GPUs each) fit the nodes with none spanning two: first fit, largest first,
    which is exact when each size divides the larger ones (TP sizes are powers of two)."""
    free = [gpus_per_node] * nodes
    for size in sorted(sizes, reverse=True):
        node = next((i for i, gpus in enumerate(free) if gpus >= size), None)
        if node is None:
            return False
        free[node] -= size
    return True


def _build_pools(args: argparse.Namespace, spec: GqaSpec | MlaSpec | GenericSpec, gpu: GpuSpec,
                 serve: ServeSettings) -> tuple[Simulation, dict[str, Any]]:
    """build() for --pool: one SimPool per pool, each with its layout's KV pool and roofline steps (or the fitted
    step model for all), its replicas, and with --autoscale its own autoscaling."""
    options: list[PoolOption] = args.pool
    if args.layout is not None or args.replicas is not None:
        given = " and ".join(flag for flag, value in (("--layout", args.layout), ("--replicas", args.replicas))
                             if value is not None)
        raise ValueError(f"{given} with --pool: each --pool gives its own layout and replicas, as {POOL_FORM}; "
                         f"drop {given}")
    names = [option.name for option in options]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--pool {', '.join(twice)} given more than once: name each pool once")
    fitted = _fitted_step_model(args)
    pools: list[SimPool] = []
    facts_pools: list[dict[str, Any]] = []
    step_models: list[StepTimeModel] = []
    for option in options:
        try:
            shape, roofline = _replica_shape(args, spec, gpu, option.tp, option.dcp)
        except ValueError as err:
            raise ValueError(f"pool {option.name}: {err}") from None
        autoscaling = None
        if args.autoscale:
            if args.min_replicas > option.replicas:
                raise ValueError(f"pool {option.name}: --min-replicas {args.min_replicas} is more than its "
                                 f"replicas={option.replicas}, the most it may reach with --autoscale; raise "
                                 f"replicas= in --pool {option} or lower --min-replicas")
            autoscaling = _autoscaling(args, option.replicas)
        step_model: StepTimeModel = fitted or roofline
        step_models.append(step_model)
        pools.append(SimPool(option.name, shape, option.replicas, step_model, autoscaling))
        facts_pools.append({"name": option.name, "layout": option.layout, "replicas": option.replicas,
                            "kv_tokens_per_replica": shape.num_blocks * shape.tokens_per_block,
                            "step_model": step_model.describe()})
        if shape.host_tier is not None:
            facts_pools[-1]["host_kv_tokens_per_replica"] = shape.host_tier.num_blocks * shape.tokens_per_block
        if autoscaling is not None:
            facts_pools[-1]["min_replicas"] = autoscaling.min_replicas
    _check_placement(args, options)
    kept = {option.name: args.min_replicas if args.autoscale else option.replicas for option in options}
    _check_gpu_budget(args, [(f"{option.name} {kept[option.name]} x tp={option.tp}", kept[option.name] * option.tp)
                             for option in options])
    config = SimulationConfig(shape=pools[0].shape, num_replicas=pools[0].num_replicas, serve=serve,
                              replica_start_s=args.replica_start_s, concurrency=args.concurrency,
                              trace_block_tokens=_trace_block_tokens(args),
                              request_latency_s=args.request_latency_s,
                              progress=None if args.quiet else sys.stderr, pools=tuple(pools),
                              gpu_budget=args.gpu_budget)
    facts: dict[str, Any] = {
        "model": spec.describe_shape(), "gpu": gpu.name, "gpus": args.nodes * args.gpus_per_node,
        "layout": " + ".join(f"{option.name} {option.layout}" for option in options),
        "replicas": sum(option.replicas for option in options),
        "step_model": fitted.describe() if fitted else "roofline, each pool its own layout's", "pools": facts_pools}
    if args.gpu_budget is not None:
        facts["gpu_budget"] = args.gpu_budget
    return Simulation(config, step_models[0]), facts  # every pool has its own: the simulation's is unused


def _check_placement(args: argparse.Namespace, options: list[PoolOption]) -> None:
    """The pools' replicas fit the nodes, none spanning two: all of them at once, or with --gpu-budget (which bounds
    what they hold together) each pool's on its own."""
    groups = [options] if args.gpu_budget is None else [[option] for option in options]
    for group in groups:
        sizes = [option.tp for option in group for _ in range(option.replicas)]
        if not place_replicas(sizes, args.nodes, args.gpus_per_node):
            parts = " + ".join(f"{option.name} {option.replicas} x tp={option.tp}" for option in group)
            raise ValueError(f"the pools' replicas do not fit {args.nodes} node(s) of {args.gpus_per_node} GPUs (a "
                             f"replica never spans nodes): {parts} = {sum(sizes)} GPUs; lower replicas= or add "
                             f"--nodes")
