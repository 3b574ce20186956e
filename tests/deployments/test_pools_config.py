"""Layout pools in the app args: one pool of the app's own layout when none is given, several validated together."""

from __future__ import annotations

import pytest

from dcpserve.deployments.config import parse_args

TWO_POOLS = [{"name": "short", "tensor_parallel_size": 2},
             {"name": "long", "tensor_parallel_size": 2, "decode_context_parallel_size": 2,
              "kv_cache_memory_bytes": 1 << 20, "autoscaling": {"min_replicas": 1, "max_replicas": 3}}]


def test_without_pools_the_app_is_one_pool_of_its_own_layout() -> None:
    args = parse_args({"model": "/m", "tensor_parallel_size": 2, "decode_context_parallel_size": 2,
                       "autoscaling": {"max_replicas": 4}})
    [pool] = args.pool_list()
    assert (pool.name, pool.tensor_parallel_size, pool.decode_context_parallel_size) == ("default", 2, 2)
    assert pool.autoscaling == args.autoscaling
    assert args.pool_engine_args(pool) == args.engine_args()


def test_each_pool_has_the_apps_engine_args_with_its_own_layout() -> None:
    args = parse_args({"model": "/m", "max_model_len": 4096, "kv_cache_memory_bytes": 4 << 20, "pools": TWO_POOLS,
                       "gpu_budget": 8})
    short, long = args.pool_list()
    assert args.pool_engine_args(short).kv_cache_memory_bytes == 4 << 20
    engine = args.pool_engine_args(long)
    assert (engine.tensor_parallel_size, engine.decode_context_parallel_size) == (2, 2)
    assert engine.kv_cache_memory_bytes == 1 << 20 and engine.max_model_len == 4096
    assert long.autoscaling.max_replicas == 3 and long.min_gpus == 2


@pytest.mark.parametrize(("extra", "message"), [
    ({"pools": [TWO_POOLS[0], {**TWO_POOLS[1], "name": "short"}]}, "the names short are used more than once"),
    ({"pools": [{**TWO_POOLS[0], "model": "/other"}]},
     r"pools\[0\] \(short\): model '/other' is not the app's model '/m'"),
    ({"pools": TWO_POOLS, "gpu_budget": 3},
     r"gpu_budget=3 cannot hold the pools' minimum replicas: short 1 x tp=2 \+ long 1 x tp=2 = 4 GPUs"),
    ({"gpu_budget": 1, "tensor_parallel_size": 2}, r"default 1 x tp=2 = 2 GPUs; raise gpu_budget to at least 2"),
    ({"pools": [{**TWO_POOLS[0], "name": "Short pool"}]}, "pools.0.name: String should match pattern"),
    ({"pools": [{**TWO_POOLS[0], "decode_context_parallel_size": 0}]}, "pools.0.decode_context_parallel_size"),
])
def test_bad_pools_are_refused_naming_the_pool_and_the_numbers(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_args({"model": "/m", **extra})
