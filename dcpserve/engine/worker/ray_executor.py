"""A replica's worker group on Ray: one actor per rank (tp * pcp of them: pcp groups of tp), torch.distributed
between them.

Layout: with GPUs in the cluster, one bundle of {GPU: 1} per rank in a STRICT_PACK placement group (DCP adds no
GPUs: it reuses the ranks); the group may be given (a Serve replica's own placement group, whose first
bundles belong to the replica) or created here. On a cluster without GPU resources the ranks run as CPU
actors. Each group picks its own rendezvous address and port (rank 0's node address as Ray reports it, a port rank 0
listens on from the moment it is chosen), so several groups share a host, and nothing listens beyond that address.

Steps do not go through Ray tasks. Once the ranks hold their KV cache, each runs one long call, `serve_steps`, on a
thread of its own (the actor's "steps" concurrency group), connected to the driver by an authenticated TCP step
channel (dcpserve.engine.worker.rank_channel). Every step the driver pickles the step (an opaque SchedulerOutput) once,
sends it to every rank, and waits on all channels at once; rank 0 replies with its ModelRunnerOutput, the others with
None, each with its DCP exchange seconds. Ping and shutdown run on the actor's default thread, during a step too.

Failures: a rank whose step raises replies with the traceback, and a rank whose process dies closes its channel;
the driver sees either as soon as it happens, whichever rank it is. The first failure marks the group dead and kills
every rank (a rank left blocked in a collective with the failed one would hold its GPU until the collective timed
out); execute() raises WorkerGroupError, and so does every later execute() and check_health().
"""

from __future__ import annotations

import logging
import os
import pickle
import selectors
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, NamedTuple

import ray
import torch
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dcpserve.engine.config import EngineConfig
from dcpserve.engine.core.outputs import ModelRunnerOutput
from dcpserve.engine.core.step import SchedulerOutput
from dcpserve.engine.worker.rank_channel import ChannelListener, FrameSocket, connect_rank

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 10.0  # check_health: a rank that does not answer a ping within this is reported (Serve: 30 s)
LIVENESS_PERIOD_S = 1.0  # a step without replies for this long checks that every rank's step loop still runs
SHUTDOWN_TIMEOUT_S = 10.0  # shutdown: for the step loops to end, then for each rank's process-group teardown


class WorkerGroupError(RuntimeError):
    """A TP rank raised or died in a step: the worker group is dead (its ranks are stopped); restart the engine."""


@dataclass
class RankReply:
    """One rank's answer to a step: rank 0's ModelRunnerOutput (None on the others) and the rank's DCP exchange
    seconds in the step, or the traceback of the exception the step raised there."""

    output: ModelRunnerOutput | None
    exchange_seconds: float
    error: str | None = None
    copy_seconds: tuple[float, float] = (0.0, 0.0)  # the host KV tier's (swap-out, swap-in) seconds on the rank


class _RankFailure(NamedTuple):
    """How a rank failed a step: it raised (and replied with the traceback) or it is gone (its channel closed)."""

    rank: int
    raised: bool
    reason: str


@ray.remote(concurrency_groups={"steps": 1})  # type: ignore[call-overload]  # Ray's overloads of remote() omit concurrency_groups
class RankWorker:
    """One TP rank: its process group membership, model runner and KV cache shard."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.runner: Any = None
        self.parallel: Any = None
        self.rendezvous: Any = None  # parallel.Rendezvous, on rank 0 between rendezvous_address and init

    def rendezvous_address(self) -> str:
        """tcp://this-node:port for the group's rendezvous, which this rank (0) hosts: the port listens on this
        node's address (as Ray reports it: 127.0.0.1 on a local cluster) from now until init() hands it to the
        group's store."""
        from dcpserve.engine.worker.parallel import Rendezvous

        self.rendezvous = Rendezvous(ray.util.get_node_ip_address())
        return self.rendezvous.init_method

    def init(self, init_method: str, cpu_threads: int) -> int:
        """Joins the process group, loads this rank's weights; returns the KV pages this rank could hold."""
        from dcpserve.engine.worker.model_runner import ModelRunner
        from dcpserve.engine.worker.parallel import init_parallel_state

        use_cuda = self.config.device.startswith("cuda") and torch.cuda.is_available()
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        else:
            torch.set_num_threads(cpu_threads)  # process-wide: the steps thread gets it too
        parallel = self.config.parallel
        self.parallel = init_parallel_state(
            tp_size=parallel.tp,
            tp_rank=self.rank,
            dcp_size=parallel.dcp,
            pcp_size=parallel.pcp,
            num_kv_heads=self.config.model_config.num_key_value_heads,
            init_method=init_method,
            backend="nccl" if use_cuda else "gloo",
            rendezvous=self.rendezvous,
            local_address=ray.util.get_node_ip_address(),
            transport=parallel.rank_transport,
        )
        self.rendezvous = None
        if self.rank == 0:
            logger.info("the ranks' collectives: %s", ", ".join(f"{group} over {transport}" for group, transport
                                                                in self.parallel.transports.items()))
        self.runner = ModelRunner(self.config, self.parallel, device)
        return self.runner.available_blocks()

    def allocate(self, num_blocks: int) -> None:
        """Allocates this rank's KV cache, then captures the decode CUDA graphs over it (CUDA only: every rank of
        the group captures the same batch sizes, their collectives included, in the same order)."""
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.allocate_host_tier(self.config.cache.host_tier_blocks)
        self.runner.capture_decode_graphs()

    @ray.method(concurrency_group="steps")
    def serve_steps(self, address: tuple[str, int], authkey: bytes, connect_timeout_s: float,
                    local_address: str | None = None) -> None:
        """The rank's step loop for the group's whole life: connect the step channel, then for each step received
        run it and reply (a RankReply). Returns when the driver closes the channel."""
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)  # the current device is per thread
        channel = connect_rank(address, authkey, self.rank, connect_timeout_s, local_address)
        try:
            while True:
                try:
                    step = channel.recv()
                except EOFError:
                    return  # the driver closed the channel: the group is shutting down
                channel.send(pickle.dumps(self._run(step), protocol=pickle.HIGHEST_PROTOCOL))
        finally:
            channel.close()

    def _run(self, step: bytearray) -> RankReply:
        try:
            output = self.runner.execute(pickle.loads(step))
            return RankReply(output, self.runner.last_exchange_seconds, copy_seconds=self.runner.last_copy_seconds)
        except Exception:  # noqa: BLE001 - the driver reports it and stops the group
            return RankReply(None, 0.0, error=traceback.format_exc())

    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        from dcpserve.engine.worker.parallel import destroy_parallel_state

        if self.parallel is not None:
            destroy_parallel_state(self.parallel)


class RayWorkerGroup:
    """Starts, drives and stops the rank actors of one replica."""

    def __init__(
        self,
        config: EngineConfig,
        placement_group: PlacementGroup | None = None,
        first_bundle: int = 0,
        startup_timeout_s: float = 600.0,
    ) -> None:
        # Everything shutdown() reads is set before anything can fail: a failed constructor shuts down what it made.
        self.workers: list[Any] = []
        self._owned_group: PlacementGroup | None = None
        self._channels: list[FrameSocket] = []
        self._selector = selectors.DefaultSelector()
        self._loops: list[ray.ObjectRef] = []  # each rank's serve_steps call: it ends only when the rank stops
        self._failure: WorkerGroupError | None = None
        self._failure_lock = threading.Lock()
        self._closing = False
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        tp = config.parallel.world_size  # every rank: tp of each of the pcp groups
        self.config = config
        self.last_exchange_seconds = 0.0
        self.last_copy_seconds = (0.0, 0.0)
        use_gpus = ray.cluster_resources().get("GPU", 0) > 0
        try:
            if placement_group is None and use_gpus:
                placement_group = self._create_group(config.parallel.tp, config.parallel.pcp, startup_timeout_s)
                self._owned_group = placement_group
            options: list[dict[str, Any]] = []
            for rank in range(tp):
                option: dict[str, Any] = {"num_cpus": 0, "num_gpus": 1 if use_gpus else 0}
                if placement_group is not None:
                    option["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                        placement_group, placement_group_bundle_index=first_bundle + rank
                    )
                options.append(option)
            # mypy applies no class decorator: RankWorker is Ray's ActorClass at run time.
            self.workers = [RankWorker.options(**options[r]).remote(config, r) for r in range(tp)]  # type: ignore[attr-defined]  # see above
            init_method = ray.get(self.workers[0].rendezvous_address.remote(), timeout=startup_timeout_s)
            # CPU ranks share this host's cores (Ray's logical CPUs may exceed them): oversubscribing torch threads
            # makes every gloo collective wait on a descheduled peer.
            cpu_threads = max(1, (os.cpu_count() or 1) // tp)
            available = ray.get(
                [w.init.remote(init_method, cpu_threads) for w in self.workers], timeout=startup_timeout_s
            )
            self.num_blocks = min(available)
            if self.num_blocks < 1:
                raise RuntimeError(
                    f"no room for KV cache on some rank (pages per rank: {available}); raise kv_cache_memory_bytes "
                    f"(or gpu_memory_utilization on GPUs)"
                )
            ray.get([w.allocate.remote(self.num_blocks) for w in self.workers], timeout=startup_timeout_s)
            self._connect(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def in_current_placement(cls, config: EngineConfig) -> RayWorkerGroup:
        """Inside a Serve replica whose placement group is [replica bundle] + one bundle per rank, the ranks take
        those bundles; anywhere else the group reserves its own GPUs (or runs CPU actors on a GPU-less cluster)."""
        if ray.is_initialized():
            group = get_current_placement_group()
            if group is not None and len(group.bundle_specs) == config.parallel.world_size + 1:
                return cls(config, placement_group=group, first_bundle=1)
        return cls(config)

    @staticmethod
    def _create_group(tp: int, pcp: int, timeout_s: float) -> PlacementGroup:
        world = tp * pcp
        group = placement_group([{"GPU": 1}] * world, strategy="STRICT_PACK")
        if not group.wait(timeout_seconds=timeout_s):
            remove_placement_group(group)
            gpus = ray.cluster_resources().get("GPU", 0)
            layout = f"tp={tp}" if pcp == 1 else f"tp={tp} x pcp={pcp}"
            raise RuntimeError(
                f"{layout} needs {world} GPUs on one node (STRICT_PACK bundles of {{GPU: 1}}) but none were free "
                f"within {timeout_s:.0f}s; the cluster has {gpus:g} GPUs in all. On a CPU machine start Ray with "
                f"--num-gpus {world} (logical GPUs)"
            )
        return group

    def _connect(self, timeout_s: float) -> None:
        """Starts every rank's step loop and accepts its channel, checking every LIVENESS_PERIOD_S that no loop has
        failed. The listening port (on this node's address: the ranks may be on another node when the driver is not
        in their placement group) closes once all have connected."""
        tp = len(self.workers)
        listener = ChannelListener(ray.util.get_node_ip_address())
        connected: dict[int, FrameSocket] = {}
        try:
            self._loops = [w.serve_steps.remote(listener.address, listener.authkey, timeout_s, listener.local_address)
                           for w in self.workers]
            deadline = time.monotonic() + timeout_s
            while len(connected) < tp:
                ended, _ = ray.wait(self._loops, num_returns=tp, timeout=0)
                ray.get(ended)  # a rank whose loop could not connect raises its own error here
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"TP ranks {sorted(set(range(tp)) - set(connected))} did not connect their step channel to "
                        f"{listener.address} within {timeout_s:.0f}s"
                    )
                accepted = listener.accept(tp, LIVENESS_PERIOD_S)
                if accepted is not None:
                    rank, channel = accepted
                    if rank in connected:
                        channel.close()
                        raise ConnectionError(f"TP rank {rank} connected its step channel twice")
                    connected[rank] = channel
        except BaseException:
            for channel in connected.values():
                channel.close()
            raise
        finally:
            listener.close()
        self._channels = [connected[rank] for rank in range(tp)]
        for rank, channel in enumerate(self._channels):
            self._selector.register(channel, selectors.EVENT_READ, rank)

    # ---- steps -----------------------------------------------------------------------------------------------

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step on every rank and returns rank 0's output. Raises WorkerGroupError as soon as any rank
        raises or dies (the group is dead from then on)."""
        self._raise_if_dead()
        if not self._channels:
            raise WorkerGroupError("the worker group is shut down: create a new engine")
        step = pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL)
        channels = self._channels
        try:
            for rank, channel in enumerate(channels):
                try:
                    channel.send(step)
                except OSError as err:
                    raise self._fail(self._rank_gone(rank, err)) from err
            replies = self._gather(channels)
        except (OSError, ValueError) as err:  # a channel closed under us (shutdown from another thread)
            raise self._fail(f"the step channel failed: {err!r}") from err
        # Every rank waits in the same collectives, so the slowest rank's exchange time is the step's.
        self.last_exchange_seconds = max(reply.exchange_seconds for reply in replies)
        self.last_copy_seconds = (max(reply.copy_seconds[0] for reply in replies),
                                  max(reply.copy_seconds[1] for reply in replies))
        output_of_rank0 = replies[0].output
        return ModelRunnerOutput() if output_of_rank0 is None else output_of_rank0

    def _gather(self, channels: list[FrameSocket]) -> list[RankReply]:
        """Every rank's reply to the step just sent, read in whatever order they come: the first failure of any rank
        raises at once, even while the others are still blocked (in a collective with the failed rank)."""
        replies: dict[int, RankReply] = {}
        while len(replies) < len(channels):
            events = self._selector.select(timeout=LIVENESS_PERIOD_S)
            if self._closing:
                raise WorkerGroupError("the worker group was shut down during the step")
            if not events:
                self._check_loops()  # a rank on a lost node closes no socket; Ray marks its actor dead
                continue
            failures = self._read_replies([key.data for key, _ in events], channels, replies)
            if failures:
                # One rank's failure makes its peers fail in their collectives: take in what else has already
                # arrived, so that the cause (a rank that died) comes before the errors it caused.
                failed = {failure.rank for failure in failures}
                ready = [key.data for key, _ in self._selector.select(timeout=0)]
                failures += self._read_replies([r for r in ready if r not in replies and r not in failed],
                                               channels, replies)
                failures.sort(key=lambda failure: failure.raised)
                raise self._fail("; ".join(failure.reason for failure in failures))
        return [replies[rank] for rank in range(len(channels))]

    def _read_replies(self, ranks: list[int], channels: list[FrameSocket],
                      replies: dict[int, RankReply]) -> list[_RankFailure]:
        """Reads one frame from each of `ranks` into `replies`; returns the failures among them."""
        tp = len(channels)
        failures: list[_RankFailure] = []
        for rank in ranks:
            try:
                reply: RankReply = pickle.loads(channels[rank].recv())
            except (EOFError, ConnectionError) as err:  # a killed rank's socket may reset rather than close
                failures.append(_RankFailure(rank, False, self._rank_gone(rank, err)))
                continue
            if reply.error is not None:
                failures.append(_RankFailure(rank, True, f"TP rank {rank} of {tp} raised in the step:\n{reply.error}"))
            elif rank in replies:
                failures.append(_RankFailure(rank, True, f"TP rank {rank} of {tp} replied twice to one step"))
            else:
                replies[rank] = reply
        return failures

    # ---- failures and health ---------------------------------------------------------------------------------

    def _fail(self, reason: str) -> WorkerGroupError:
        """Marks the group dead (the first reason wins) and kills every rank: a rank blocked in a collective with a
        failed one would otherwise hold the collective, and its GPU, until the collective times out."""
        with self._failure_lock:
            if self._closing and self._failure is None:  # shutdown() stops the ranks: not a failure
                return WorkerGroupError("the worker group was shut down during the step")
            if self._failure is None:
                self._failure = WorkerGroupError(
                    f"the TP worker group is dead and its ranks are stopped: {reason}\nRestart the engine (a Serve "
                    f"replica is replaced once its health check fails)."
                )
                for worker in self.workers:
                    ray.kill(worker)
            return self._failure

    def _raise_if_dead(self) -> None:
        if self._failure is not None:
            raise WorkerGroupError(str(self._failure)) from self._failure

    def _rank_gone(self, rank: int, err: BaseException) -> str:
        """Why rank's channel closed: its step loop's error, or its actor's death (Ray learns of it within moments)."""
        tp = self.config.parallel.tp
        try:
            ray.get(self._loops[rank], timeout=LIVENESS_PERIOD_S)
        except ray.exceptions.GetTimeoutError:
            return f"TP rank {rank} of {tp} closed its step channel ({err})"
        except Exception as cause:  # noqa: BLE001 - RayActorError (the process died) or the loop's own error
            return f"TP rank {rank} of {tp} is gone: {cause}"
        return f"TP rank {rank} of {tp} ended its step loop ({err})"

    def _check_loops(self) -> None:
        if self._closing or not self._loops:
            return
        ended, _ = ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
        if ended:
            rank = self._loops.index(ended[0])
            raise self._fail(self._rank_gone(rank, RuntimeError("its step loop ended")))

    def check_health(self) -> None:
        """Raises if the group is dead, a rank's step loop has ended, or a rank does not answer a ping within
        PING_TIMEOUT_S. Pings are answered during a step too: steps run on each rank's "steps" thread."""
        self._raise_if_dead()
        if not self.workers:
            raise WorkerGroupError("the worker group is shut down: create a new engine")
        self._check_loops()
        try:
            ray.get([worker.ping.remote() for worker in self.workers], timeout=PING_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as err:
            raise WorkerGroupError(
                f"a TP rank did not answer a ping within {PING_TIMEOUT_S:.0f}s (a hung process or an overloaded "
                f"host); Serve replaces the replica if this persists"
            ) from err
        except ray.exceptions.RayActorError as err:
            raise self._fail(f"a TP rank died: {err}") from err

    def shutdown(self) -> None:
        """Closes the step channels (the ranks' loops end), leaves the process groups and kills the ranks, bounded in
        time also for a dead or hung group; removes the placement group it created. Safe to call twice."""
        self._closing = True
        channels, self._channels = self._channels, []
        for channel in channels:
            channel.close()  # wakes a step waiting on it in another thread
            self._selector.unregister(channel)
        self._selector.close()
        workers, self.workers = self.workers, []
        if self._failure is None and self._loops:
            ray.wait(self._loops, num_returns=len(self._loops), timeout=SHUTDOWN_TIMEOUT_S)
        for worker in workers:
            if self._failure is None:
                try:
                    ray.get(worker.shutdown.remote(), timeout=SHUTDOWN_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - a dead worker is being removed anyway
                    pass
            ray.kill(worker)
        if self._owned_group is not None:
            remove_placement_group(self._owned_group)
            self._owned_group = None
