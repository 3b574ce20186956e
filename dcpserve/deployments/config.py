"""The app's arguments (`args:` in serve_config.yaml), validated with pydantic before anything is deployed.

The engine's arguments are not spelled here: `EngineArgsModel` is generated from the fields of EngineArgs
(dcpserve/engine/args.py: types, defaults, help as descriptions) and checked by EngineArgs' own validation, so a field
added there is an app arg too. Every knob has a default; unknown keys are refused by name. `AppArgs.engine_config()`
runs the engine's validation that needs the model (directory, TP x DCP layout rules, max_model_len), so a bad layout
fails `serve deploy` with the engine's message instead of failing inside a replica later.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, create_model, model_validator

from dcpserve.deployments.messages import ANONYMOUS, PRIORITY_MAX, PRIORITY_MIN
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.config import EngineConfig


class AutoscalingArgs(BaseModel):
    """Replica autoscaling by concurrent sequences and KV usage, and with a latency target by the pool's service
    levels too (dcpserve/deployments/autoscaling.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(
        default=1, ge=1, description="replicas kept running (the admission queue needs one to drain)")
    max_replicas: int = Field(default=1, ge=1, description="upper bound; each replica takes tp GPUs")
    initial_replicas: int | None = Field(
        default=None, ge=1, description="replicas at deploy time (default: min_replicas)")
    target_sequences_per_replica: float = Field(
        default=8.0, gt=0, description="desired replicas = ceil(running + waiting + queued sequences / this)"
    )
    kv_usage_scale_up: float = Field(
        default=0.85, gt=0, le=1, description="add a replica when the mean KV usage (reserved / capacity) passes this"
    )
    upscale_delay_s: float = Field(
        default=5.0, ge=0, description="a scale-up decision must hold this long (Serve's delay)")
    downscale_delay_s: float = Field(default=30.0, ge=0, description="a scale-down decision must hold this long")
    look_back_period_s: float = Field(default=5.0, gt=0, description="window Serve averages the replica stats over")
    # Deprecated in Ray 2.60 but still what sets the replicas' push period (the documented env var is ignored).
    metrics_interval_s: float = Field(default=1.0, gt=0, description="how often replicas report autoscaling stats")
    # ---- service levels (dcpserve/deployments/autoscaling.py SloAutoscalingPolicy): on when either target is set ----
    ttft_target_s: float | None = Field(
        default=None, gt=0, description="add a replica while the pool's TTFT (from arrival, queue wait included) at "
        "slo_percentile over slo_window_s is above this; none: TTFT is no signal")
    itl_target_s: float | None = Field(
        default=None, gt=0, description="add a replica while the pool's mean inter-token latency at slo_percentile "
        "over slo_window_s is above this; none: ITL is no signal")
    slo_percentile: float = Field(
        default=0.9, gt=0, le=1, description="the percentile (0 < p <= 1) of the requests served in the window that "
        "is held to the targets")
    slo_window_s: float = Field(
        default=30.0, gt=0, description="the latencies are those of the requests of the pool that ended in the last "
        "this many seconds")
    scale_down_fraction: float = Field(
        default=0.7, gt=0, lt=1, description="remove a replica only while every latency is below this fraction of "
        "its target (and the sequences and KV of the remaining replicas hold the load): the band between keeps the "
        "count, so a latency near its target does not flap")
    cooldown_s: float = Field(
        default=60.0, ge=0, description="with a latency target, no scale event within this long of the previous one; "
        "at least the replica start time plus slo_window_s, so the new replica's effect is seen before the next")

    @property
    def slo_targets(self) -> bool:
        """Whether the service-level policy runs (a latency target is set)."""
        return self.ttft_target_s is not None or self.itl_target_s is not None

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingArgs:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"autoscaling.max_replicas ({self.max_replicas}) is smaller than min_replicas ({self.min_replicas})"
            )
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(
                f"autoscaling.initial_replicas ({self.initial_replicas}) must lie in "
                f"[min_replicas={self.min_replicas}, max_replicas={self.max_replicas}]"
            )
        if not self.slo_targets:
            unused = sorted(self.model_fields_set & {"slo_percentile", "slo_window_s", "scale_down_fraction",
                                                     "cooldown_s"})
            if unused:
                raise ValueError(
                    f"autoscaling.{unused[0]} applies only with a latency target: set ttft_target_s or itl_target_s, "
                    f"or leave out {', '.join(unused)}"
                )
        return self


POOL_NAME = r"^[a-z][a-z0-9-]{0,31}$"  # part of the pool's deployment name (EngineReplica-<name>) and metric tags


class PoolArgs(BaseModel):
    """One pool of an app with several layouts of the same model: its engine deployment's layout, KV budget and
    autoscaling. Every other engine argument is the app's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=POOL_NAME, description="the pool's name: lower-case letters, digits and dashes")
    model: str | None = Field(
        default=None, description="may repeat the app's model; a pool of another model is refused (one model per app)")
    tensor_parallel_size: int = Field(ge=1, description="TP ranks = GPUs per replica of this pool")
    decode_context_parallel_size: int = Field(default=1, ge=1, description="DCP size of this pool's replicas")
    prefill_context_parallel_size: int = Field(
        default=1, ge=1, description="PCP groups of tp ranks per replica of this pool (tp * pcp GPUs a replica)")
    kv_cache_memory_bytes: int | None = Field(
        default=None, ge=1, description="per-rank KV budget of this pool (default: the app's)")
    autoscaling: AutoscalingArgs = Field(default_factory=AutoscalingArgs)

    @property
    def ranks(self) -> int:
        """GPUs of one replica: tp ranks in each of its pcp groups."""
        return self.tensor_parallel_size * self.prefill_context_parallel_size

    @property
    def min_gpus(self) -> int:
        return self.autoscaling.min_replicas * self.ranks


TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # an API key's name: a metric label of its requests
UNNAMED_TENANT = "default"  # the tenant of keys given without a name (api_keys, api_keys_env, one-field lines)


class TenantArgs(BaseModel):
    """One tenant's service level and limits (dcpserve/deployments/admission/fair_share.py; limits in
    dcpserve/deployments/admission/tenant_limits.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    priority: int = Field(
        default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX,
        description="priority of its requests that do not send one (lower first, as vLLM)")
    min_priority: int | None = Field(
        default=None, ge=PRIORITY_MIN, le=PRIORITY_MAX,
        description="the most urgent (lowest) priority its requests may ask for; lower -> 400 (default: any)")
    weight: float = Field(
        default=1.0, gt=0, description="its share of the KV-seconds against other tenants of the same priority")
    max_concurrent_requests: int | None = Field(
        default=None, ge=1, description="sequences it may have waiting or running at once (each choice of n counts); "
        "more -> 429 naming the limit (default: no limit)")
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="prompt + max_tokens of the sequences it may start in any 60 s; more -> 429 "
        "with Retry-After when that much has left the window (default: no limit)")
    request_timeout_s: float | None = Field(
        default=None, gt=0, description="longest one of its requests may take from arrival, as the app's "
        "request_timeout_s (a 504 past it, its KV freed); the shorter of the two applies (default: the app's)")

    @model_validator(mode="after")
    def _min_priority(self) -> TenantArgs:
        if self.min_priority is not None and self.priority < self.min_priority:
            raise ValueError(f"priority ({self.priority}) is more urgent than min_priority ({self.min_priority}); "
                             f"raise priority to at least {self.min_priority}")
        return self


def parse_keys_file(text: str, where: str) -> list[tuple[str, str]]:
    """(name, key) for each line of an API keys file: `<name> <key>`, or `<key>` alone (the tenant "default");
    blank lines and # comments are skipped. A name used twice, a key given twice or a malformed line is refused
    naming the line (never the key)."""
    import re

    keys: list[tuple[str, str]] = []
    lines_of: dict[str, int] = {}
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise ValueError(f"{where} line {number}: expected `<name> <key>` or `<key>`, got {len(fields)} fields")
        name, key = (UNNAMED_TENANT, fields[0]) if len(fields) == 1 else (fields[0], fields[1])
        if len(fields) == 2:
            if not re.match(TENANT_NAME, name):
                raise ValueError(f"{where} line {number}: the name {name!r} must be letters, digits, '_', '.' or '-' "
                                 f"(at most 64)")
            if name in lines_of:
                raise ValueError(f"{where} line {number}: the name {name!r} is used on line {lines_of[name]} too; "
                                 f"give each key its own name")
            lines_of[name] = number
        if key in seen:
            raise ValueError(f"{where} line {number}: this key is given on an earlier line too; give each key once")
        seen.add(key)
        keys.append((name, key))
    return keys


def _engine_fields() -> dict[str, Any]:
    """EngineArgs' fields as pydantic field definitions: (type, Field(default, description=help))."""
    hints = typing.get_type_hints(EngineArgs)
    definitions: dict[str, Any] = {}
    for f in dataclasses.fields(EngineArgs):
        default = ... if f.default is dataclasses.MISSING else f.default
        definitions[f.name] = (hints[f.name], Field(default, description=f.metadata["help"]))
    return definitions


def _check_engine_args(model: BaseModel) -> BaseModel:
    """EngineArgs' own validation of the engine fields; its ValueError becomes the validation message."""
    EngineArgs(**{f.name: getattr(model, f.name) for f in dataclasses.fields(EngineArgs)})
    return model


# The engine's arguments of one replica (both admission and the engine count KV by `admission`). Pydantic checks the
# types; the ranges are EngineArgs.__post_init__'s, so they are stated once.
EngineArgsModel = create_model(
    "EngineArgsModel",
    __config__=ConfigDict(extra="forbid", frozen=True),
    __doc__="EngineArgs (dcpserve/engine/args.py) as app args: the engine of every replica.",
    __module__=__name__,
    # pydantic annotates __validators__ as plain callables; it takes (and documents) decorated validators.
    __validators__={"_check_engine_args": model_validator(mode="after")(_check_engine_args)},  # type: ignore[dict-item]  # see above
    **_engine_fields(),
)


class AppArgs(EngineArgsModel):  # type: ignore[valid-type, misc]  # a base built at run time (create_model above)
    """Arguments of build_app: the engine of every replica (EngineArgsModel), admission, autoscaling, the ingress."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str | None = Field(
        None, description="the `model` name clients send (default: the directory name)")
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None, description="vLLM's --reasoning-parser: chat answers carry the model's <think>...</think> reasoning as "
        "message.reasoning_content (streamed: delta.reasoning_content) and only the rest as content; deepseek_r1 "
        "(DeepSeek-R1, Kimi-K2-Thinking) or qwen3 (Qwen3: also honours chat_template_kwargs enable_thinking); "
        "unset: the text is all content")
    # ---- admission ----
    max_queued_requests: int = Field(
        64, ge=0, description="bounded FIFO of requests that fit no replica yet; full -> 429")
    queue_timeout_s: float = Field(30.0, gt=0, description="longest wait in that queue; past it -> 429")
    retry_after_s: int = Field(5, ge=1, description="the Retry-After header of a 429")
    dispatch_timeout_s: float = Field(
        10.0, gt=0, description="longest wait for a granted replica to take a request; past it the grant goes back "
        "and the request waits at the head of the queue again"
    )
    grant_leak_grace_s: float = Field(
        30.0, gt=0, description="a grant that its replica has not reported holding this long after it was given, "
        "and that nobody released, is dropped (its caller, an ingress replica, died): its KV counts free again"
    )
    # ---- serving ----
    api_keys: list[SecretStr] = Field(
        default_factory=list, description="keys clients must send as `Authorization: Bearer <key>` on /v1 routes; "
        "empty (and no api_keys_env / api_keys_file): the API is open. Prefer the two below: they keep secrets out "
        "of the config"
    )
    api_keys_env: str | None = Field(
        None, description="name of an environment variable of the ingress replicas that holds API keys "
        "(comma-separated), e.g. set with the app's runtime_env env_vars or on `ray start`"
    )
    api_keys_file: str | None = Field(
        None, description="path, on every node, of a file with one API key per line, `<name> <key>` (the name is the "
        "key's tenant: its service level in `tenants`, its metrics) or `<key>` alone (tenant `default`); blank lines "
        "and # comments ignored"
    )
    # ---- service levels (dcpserve/deployments/admission/fair_share.py) ----
    admission_order: Literal["service_levels", "fifo"] = Field(
        "service_levels", description="the order waiting requests are granted in: `service_levels` (priority "
        "bands, then tenants' fair shares of KV-seconds, then deadline and arrival) or `fifo` (arrival alone: "
        "priorities, tenants and shedding ignored)")
    tenants: dict[str, TenantArgs] = Field(
        default_factory=dict, description="service level and limits by tenant: an API key's name, `default` for "
        "unnamed keys, `anonymous` when the app has no keys; a tenant not listed gets TenantArgs' defaults")
    sheddable_priority: int | None = Field(
        None, ge=PRIORITY_MIN, le=PRIORITY_MAX, description="requests with a priority at or above this are "
        "sheddable: refused first (429, newest first) while a request that is not sheddable waits for KV "
        "(default: none is sheddable)")
    fair_share_half_life_s: float = Field(
        60.0, gt=0, description="tenants' shares of KV-seconds count recent use: what they held this long ago "
        "counts half")
    fair_share_reserve: bool = Field(
        True, description="a tenant over its fair share of the KV leaves room for the next request of each tenant "
        "that sent one in the last half-life and holds less than its share, so a light tenant is not queued behind "
        "a flood's running requests; false: every free block goes to the head of the order (work-conserving)")
    fair_share_quantum_s: float = Field(
        1.0, ge=0, description="a grant charges its tenant need x this at once, so grants made together alternate "
        "between tenants")
    # ---- sessions and compute (dcpserve/deployments/admission/session_affinity.py, ttft_bound.py) ----
    admission_ttft_bound_s: float = Field(
        2.0, ge=0, description="a replica whose queued prefill would put a request's first token past this many "
        "seconds does not get it while another replica would start it within the bound, or while a short wait in "
        "the queue (at most this long, never past the request's deadline) lets a backlog drain under it; when none "
        "can, it goes where it starts soonest. 0: off (KV and prefix alone decide)")
    admission_prefix_hold: bool = Field(
        True, description="a request whose prompt another replica caches more of, but that has no room now, waits "
        "for it instead of prefilling its history elsewhere, for as long as that replica would still start it sooner "
        "(the queue's estimates), and goes as soon as it has room; false: the first replica with room takes it "
        "(needs prefix_routing)")
    session_ttl_s: float = Field(
        600.0, gt=0, description="a session (prompt_cache_key or X-Session-Id) silent this long loses its replica "
        "(its next turn is routed as a new one) and its share of its tenant")
    max_request_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="largest request body accepted; larger -> 413"
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="longest a request may take from arrival (admission wait included); past it the "
        "request ends with a 504 (or an error event in its stream) and its KV is freed"
    )
    num_ingress_replicas: int = Field(1, ge=1, description="OpenAI ingress replicas (tokenize, admit, stream)")
    prefix_routing: bool = Field(
        True, description="with prefix caching, the admission queue grants the replica (with room, in balance) that "
        "served the request's session last, else the one that caches the longest run of the request's prompt, and "
        "among equal runs the one with the most free KV; false: the most free KV alone"
    )
    stream_interval_s: float = Field(
        0.05, ge=0, description="a replica sends an ingress the deltas of all of its requests there as one Ray stream "
        "item per engine step, and at most one per this interval when steps are faster (a request's first and last "
        "token at once); 0: one item per engine step"
    )
    routing_stats_period_s: float = Field(1.0, gt=0, description="how often replicas report KV to the routers")
    kv_report_period_s: float = Field(0.5, gt=0, description="how often replicas reconcile KV with the admission queue")
    health_check_period_s: float = Field(10.0, gt=0, description="Serve health checks (they ping every TP rank)")
    drain_timeout_s: float = Field(
        120.0, ge=0, description="a replica Serve stops (scale-down, redeploy) finishes its running requests for up to "
        "this long before it is killed (Serve's graceful_shutdown_timeout_s); it gets no new grants meanwhile"
    )
    autoscaling: AutoscalingArgs = Field(default_factory=AutoscalingArgs)
    # ---- layout pools ----
    pools: list[PoolArgs] = Field(
        default_factory=list, description="several layouts of the model in one app, each an engine deployment of its "
        "own behind the one ingress and admission queue; empty: one pool of the app's own layout and autoscaling"
    )
    gpu_budget: int | None = Field(
        None, ge=1, description="GPUs the app's engine replicas may hold together; the pools' autoscaling shares it")

    @model_validator(mode="after")
    def _check_tenants(self) -> AppArgs:
        import re

        bad = sorted(name for name in self.tenants if not re.match(TENANT_NAME, name))
        if bad:
            raise ValueError(f"tenants: the names {', '.join(map(repr, bad))} must be letters, digits, '_', '.' or '-' "
                             f"(at most 64), as the keys file names them")
        return self

    @model_validator(mode="after")
    def _check_pools(self) -> AppArgs:
        names = [pool.name for pool in self.pools]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"pools: the names {', '.join(repeated)} are used more than once; name each pool once")
        for index, pool in enumerate(self.pools):
            if pool.model is not None and Path(pool.model).resolve() != Path(self.model).resolve():
                raise ValueError(
                    f"pools[{index}] ({pool.name}): model {pool.model!r} is not the app's model {self.model!r}; an "
                    f"app serves one model (deploy another app for another model)"
                )
            self.pool_engine_args(pool)  # EngineArgs' checks of the pool's layout (those without the model)
        if self.gpu_budget is not None:
            pools = self.pools or [self.default_pool()]
            needed = sum(pool.min_gpus for pool in pools)
            if needed > self.gpu_budget:
                parts = " + ".join(
                    f"{pool.name} {pool.autoscaling.min_replicas} x tp={pool.tensor_parallel_size}"
                    + (f" x pcp={pool.prefill_context_parallel_size}" if pool.prefill_context_parallel_size > 1 else "")
                    for pool in pools)
                raise ValueError(
                    f"gpu_budget={self.gpu_budget} cannot hold the pools' minimum replicas: {parts} = {needed} GPUs; "
                    f"raise gpu_budget to at least {needed} or lower min_replicas"
                )
        return self

    def default_pool(self) -> PoolArgs:
        """The one pool of an app without `pools`: its own layout and autoscaling."""
        return PoolArgs(name="default", tensor_parallel_size=self.tensor_parallel_size,
                        decode_context_parallel_size=self.decode_context_parallel_size,
                        prefill_context_parallel_size=self.prefill_context_parallel_size,
                        kv_cache_memory_bytes=self.kv_cache_memory_bytes, autoscaling=self.autoscaling)

    def pool_list(self) -> list[PoolArgs]:
        return list(self.pools) or [self.default_pool()]

    def pool_layouts(self) -> dict[str, int]:
        """Each pool's tokens_per_block (block_size * dcp): the size of the blocks its KV need is counted in."""
        return {pool.name: self.block_size * pool.decode_context_parallel_size for pool in self.pool_list()}

    def pool_engine_args(self, pool: PoolArgs) -> EngineArgs:
        """The engine arguments of the pool's replicas: the app's, with the pool's layout and KV budget."""
        engine = self.engine_args()
        kv = pool.kv_cache_memory_bytes if pool.kv_cache_memory_bytes is not None else engine.kv_cache_memory_bytes
        return dataclasses.replace(engine, tensor_parallel_size=pool.tensor_parallel_size,
                                   decode_context_parallel_size=pool.decode_context_parallel_size,
                                   prefill_context_parallel_size=pool.prefill_context_parallel_size,
                                   kv_cache_memory_bytes=kv)

    def resolved_api_keys(self) -> list[str]:
        """Every configured API key: the list, the environment variable and the file together."""
        return [key for _, key in self.resolved_tenant_keys()]

    def resolved_tenant_keys(self) -> list[tuple[str, str]]:
        """(tenant name, key) of every configured API key: the list, the environment variable and the file together
        (the first two and one-field file lines are the tenant `default`). Raises ValueError naming the variable or
        file when one is configured but missing or empty, a line of the file that is malformed or repeats a name or
        a key, and a tenant in `tenants` that no key has (never the keys themselves)."""
        import os

        keys = [(UNNAMED_TENANT, key.get_secret_value()) for key in self.api_keys]
        if self.api_keys_env is not None:
            value = os.environ.get(self.api_keys_env, "")
            found = [k.strip() for k in value.split(",") if k.strip()]
            if not found:
                raise ValueError(
                    f"api_keys_env={self.api_keys_env!r}: that environment variable is unset or empty in the ingress "
                    f"replica; set it where Ray starts (or in the app's runtime_env env_vars), or drop api_keys_env"
                )
            keys += [(UNNAMED_TENANT, key) for key in found]
        if self.api_keys_file is not None:
            path = Path(self.api_keys_file)
            if not path.is_file():
                raise ValueError(f"api_keys_file={self.api_keys_file!r} does not exist on this node")
            named = parse_keys_file(path.read_text(), f"api_keys_file={self.api_keys_file!r}")
            if not named:
                raise ValueError(f"api_keys_file={self.api_keys_file!r} holds no key (one per line)")
            keys += named
        names = {name for name, _ in keys} if keys else {ANONYMOUS}
        unknown = sorted(set(self.tenants) - names)
        if unknown:
            raise ValueError(f"tenants: {', '.join(unknown)} name no API key (the keys' tenants are "
                             f"{', '.join(sorted(names))}); name a key so in api_keys_file, or drop the entry")
        return keys

    def tenant(self, name: str) -> TenantArgs:
        """The tenant's service level and limits (TenantArgs' defaults when `tenants` does not list it)."""
        return self.tenants.get(name) or TenantArgs()

    def request_timeout_for(self, tenant: str) -> float:
        """The longest a request of `tenant` may take from arrival: the app's request_timeout_s, or the tenant's
        own when that is shorter."""
        own = self.tenant(tenant).request_timeout_s
        return self.request_timeout_s if own is None else min(own, self.request_timeout_s)

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    def engine_args(self) -> EngineArgs:
        """The engine arguments of every replica."""
        return EngineArgs(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineArgs)})

    def engine_config(self) -> EngineConfig:
        """The native engine's validation of these arguments (raises ValueError / FileNotFoundError naming the fix)."""
        return self.engine_args().create_engine_config()


def parse_args(raw: dict[str, object] | AppArgs) -> AppArgs:
    """AppArgs from serve_config.yaml's `args`, with every problem named in one ValueError."""
    if isinstance(raw, AppArgs):
        return raw
    try:
        args: AppArgs = AppArgs.model_validate(raw)  # AppArgs' base is a run-time class: mypy sees Any
        return args
    except ValidationError as err:
        problems = "; ".join(_problem(e) for e in err.errors())
        raise ValueError(f"invalid dcpserve app args: {problems}") from None


def _problem(error: Any) -> str:
    """One pydantic error as `where: what`; a validator's own ValueError (EngineArgs', the autoscaling bounds)
    names its keys, so it is shown as written unless it does not start with where it was raised."""
    where = ".".join(str(p) for p in error["loc"])
    if error["type"] == "value_error":
        message = str(error["ctx"]["error"])
        return message if message.startswith(where) else f"{where}: {message}"
    return f"{where or 'args'}: {error['msg']}"
