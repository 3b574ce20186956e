"""build_app(args): the Serve application `serve deploy serve_config.yaml` runs (import_path
dcpserve.deployments.app:build_app).

Three deployments: OpenAIIngress (HTTP, route_prefix /), EngineReplica (one engine per replica, autoscaled by
SequenceAutoscalingPolicy, or SloAutoscalingPolicy with a latency target; routed by KvAwareRouter) and KvAdmission
(one replica: the app's admission queue).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from dcpserve.cluster.node_types import check_replica_fits, cluster_config_from_env, node_types
from dcpserve.deployments.admission.kv_admission import KvAdmission
from dcpserve.deployments.admission.tenant_limits import Limits
from dcpserve.deployments.api.ingress import OpenAIIngress
from dcpserve.deployments.autoscaling import policy_function, policy_kwargs
from dcpserve.deployments.config import AppArgs, PoolArgs, parse_args
from dcpserve.deployments.replica.engine_replica import EngineReplica, replica_bundles
from dcpserve.engine.backends import validate_engine_args

# How often a stopping replica checks whether its requests have all ended (Serve's graceful_shutdown_wait_loop_s,
# 2 s by default, which it waits before the first check too): a replica with nothing left to finish (scale-down,
# redeploy, delete) goes, and frees its GPUs, within this instead of 2 s, and every deployment the next one waits on
# (the ingress' streams to the engine replicas) the same.
DRAIN_POLL_S = 0.25


def engine_deployment(args: AppArgs, pool: PoolArgs | None = None) -> Any:
    """EngineReplica of one pool (default: the app's one pool) with its placement group, router, autoscaling policy
    and health checks. The app without pools keeps the name EngineReplica; a pool's is EngineReplica-<pool>."""
    pool = pool or args.default_pool()
    ranks = pool.ranks  # GPUs of one replica: tp of each of its pcp groups
    scaling = pool.autoscaling
    actor_options: dict[str, Any] = {"num_cpus": 1}
    if ranks == 1:
        actor_options["num_gpus"] = 1
    return serve.deployment(
        EngineReplica,
        name="EngineReplica" if not args.pools else f"EngineReplica-{pool.name}",
        ray_actor_options=actor_options,
        placement_group_bundles=replica_bundles(ranks),
        placement_group_strategy="STRICT_PACK",
        # Admission bounds what a replica holds by KV; this only has to exceed what KV could ever admit.
        max_ongoing_requests=max(args.max_num_seqs * 4, 1024),
        health_check_period_s=args.health_check_period_s,
        health_check_timeout_s=max(30.0, args.health_check_period_s * 3),
        # A stopped replica (scale-down mid-burst, redeploy) keeps streaming its running requests instead of
        # cutting them off; the admission queue stops granting it as soon as Serve stops probing it.
        graceful_shutdown_timeout_s=args.drain_timeout_s,
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
        request_router_config=RequestRouterConfig(
            # Ray annotates RequestRouterConfig's **kwargs as dict[str, Any] values (each keyword its own error).
            request_router_class="dcpserve.deployments.dispatch.router:KvAwareRouter",  # type: ignore[arg-type]  # see above
            request_routing_stats_period_s=args.routing_stats_period_s,  # type: ignore[arg-type]  # see above
            request_routing_stats_timeout_s=max(5.0, args.routing_stats_period_s * 5),  # type: ignore[arg-type]  # see above
        ),
        autoscaling_config=AutoscalingConfig(
            min_replicas=scaling.min_replicas,
            max_replicas=scaling.max_replicas,
            initial_replicas=scaling.initial_replicas,
            upscale_delay_s=scaling.upscale_delay_s,
            downscale_delay_s=scaling.downscale_delay_s,
            look_back_period_s=scaling.look_back_period_s,
            metrics_interval_s=scaling.metrics_interval_s,
            policy=AutoscalingPolicy(
                policy_function=policy_function(scaling),
                policy_kwargs=policy_kwargs(scaling, args.gpu_budget, ranks),
            ),
        ),
    )


def _cluster_device() -> str:
    """cuda when some node of the cluster has real GPUs (Ray labels them with an accelerator type), else cpu."""
    import ray

    if not ray.is_initialized():
        return "cpu"
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    has_gpus = any(key.startswith("accelerator_type:") for node in nodes for key in node.get("Resources", {}))
    return "cuda" if has_gpus else "cpu"


def check_cluster_fits(args: AppArgs) -> None:
    """Refuses a replica layout that no node type of the cluster can hold on one node, naming the node types, their
    GPUs and the layout, instead of a placement group that waits forever. The node types are the cluster config's
    that CLUSTER_CONFIG_ENV names (`make cluster` and ray_cluster.yaml set it on every node); without it the check is
    skipped: Ray does not publish its autoscaler's node types, and the nodes alive now are not all the cluster can
    have."""
    found = cluster_config_from_env()
    if found is None:
        return
    config, path = found
    for pool in args.pool_list():
        check_replica_fits(node_types(config), pool.tensor_parallel_size, pool.decode_context_parallel_size,
                           f"the cluster config {path}", pool.prefill_context_parallel_size)


def pool_kv_tokens(args: AppArgs, pool: PoolArgs, device: str) -> int | None:
    """Tokens of KV one replica of the pool holds, where the deploy can know it: the native engine with
    kv_cache_memory_bytes, or on CPU (its default budget); None where the replica sizes its KV when it starts
    (gpu_memory_utilization on a GPU, or the vLLM backend)."""
    engine = args.pool_engine_args(pool)
    if engine.backend != "native":
        return None
    config = engine.create_engine_config()
    budget = config.cache.kv_cache_memory_bytes
    if budget is None and device == "cpu":
        budget = config.cache.cpu_default_kv_bytes
    if budget is None:
        return None
    page_bytes = (config.model_config.kv_bytes_per_token_per_rank(pool.tensor_parallel_size, config.torch_dtype)
                  * config.cache.block_size)
    return budget // page_bytes * config.cache.block_size * pool.decode_context_parallel_size


def check_pools_hold_a_whole_request(args: AppArgs, device: str) -> None:
    """Refuses pools of which none can hold one request of max_model_len tokens (prompt and output), naming each
    pool and the tokens it holds. A pool that holds less is kept while another holds it: it serves the shorter
    requests (dcpserve/deployments/admission/pools.py sends each request only to pools that can hold all of it)."""
    if not args.pools:
        return
    limit = args.engine_config().scheduler.max_model_len
    held = {}
    for pool in args.pools:
        tokens = pool_kv_tokens(args, pool, device)
        if tokens is None or tokens >= limit:
            return
        held[pool.name] = tokens
    parts = "; ".join(f"{name} holds {tokens} tokens" for name, tokens in held.items())
    raise ValueError(
        f"no pool can hold one request of max_model_len={limit} tokens ({parts}): give a pool more KV "
        f"(kv_cache_memory_bytes, or a larger decode_context_parallel_size), or lower max_model_len"
    )


def build_app(raw_args: dict[str, Any] | AppArgs) -> serve.Application:
    """Validates the args (every problem named) and the engine layout, then binds the three deployments."""
    args = parse_args(raw_args)
    # Fails the deploy now, with the engine's message (bad model dir, TP x DCP layout, a vLLM that is missing or cannot
    # run this layout here), instead of a replica that fails to start again and again.
    device = args.device or _cluster_device()
    for pool in args.pool_list():
        validate_engine_args(args.pool_engine_args(pool), device)
    check_pools_hold_a_whole_request(args, device)
    check_cluster_fits(args)
    admission = KvAdmission.options(name="KvAdmission", graceful_shutdown_wait_loop_s=DRAIN_POLL_S).bind(  # type: ignore[attr-defined]  # mypy ignores class decorators: @serve.deployment made it a Deployment
        args.max_queued_requests, prefix_routing=args.prefix_routing, leak_grace_s=args.grant_leak_grace_s,
        sheddable_priority=args.sheddable_priority, fair_share_half_life_s=args.fair_share_half_life_s,
        fair_share_quantum_s=args.fair_share_quantum_s, fair_share_reserve=args.fair_share_reserve,
        order=args.admission_order, retry_after_s=args.retry_after_s, ttft_bound_s=args.admission_ttft_bound_s,
        session_ttl_s=args.session_ttl_s, prefix_hold=args.admission_prefix_hold,
        limits={name: Limits(t.max_concurrent_requests, t.tokens_per_minute) for name, t in args.tenants.items()})
    if args.pools:  # one engine deployment per pool; the ingress finds a granted replica's by its pool
        engine: Any = {pool.name: engine_deployment(args, pool).bind(args, admission, pool.name)
                       for pool in args.pools}
    else:
        engine = engine_deployment(args).bind(args, admission)
    ingress = serve.deployment(
        name="OpenAIIngress",
        num_replicas=args.num_ingress_replicas,
        ray_actor_options={"num_cpus": 0.5},
        max_ongoing_requests=max(args.max_queued_requests * 2, 256),
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
    )(OpenAIIngress)
    return ingress.bind(args, engine, admission)
