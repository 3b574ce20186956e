"""What admitting one request costs as the cluster and the burst grow: the admission queue's grant with many replicas
holding many grants, and the engine core's KV check of a burst of adds. Plain Python on this machine's CPU, no Ray.

1. The queue (dcpserve/deployments/admission/queue.py), the real AdmissionQueue: R replicas report, each holding G
   granted sequences; then requests are acquired and released one after another, each choosing among all R replicas.
   Per grant it prints the time of one acquire + release, and what summing each replica's grants (the granted
   blocks, the prefill ahead, the sequences: what ReplicaKv computed at every read before it kept running totals)
   costs over the same state once per replica, the least a choice paid then.
2. The core's check (dcpserve/engine/core/core.py): a burst of B requests added to a scheduler holding H, each checked
   against the KV ledger. "rebuilt": kv_ledger() built for each add (before); "extended": built once and extended by
   each add (Scheduler.ledger_with). Both run on the same state, alternated; medians over rounds.

    python -m bench admission_scale
    python -m bench admission_scale --write-docs
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time

from bench.harness.docs_section import DocsSection, bench_command
from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.admission.replica_choice import ReplicaKv
from dcpserve.deployments.messages import KvReport, PrefixAsk
from dcpserve.engine.config import SchedulerConfig
from dcpserve.engine.core.block_manager import BlockManager
from dcpserve.engine.core.prefix_cache import CACHED, PrefixReporter, chain_hashes
from dcpserve.engine.core.request import Request
from dcpserve.engine.core.scheduler import Scheduler
from dcpserve.engine.sampling_params import SamplingParams

SECTION = "admission_scale"
TOKENS_PER_BLOCK = 64
SEED = b"admission_scale"


def summed(replica: ReplicaKv) -> int:
    """The three sums a replica's reads computed before the running totals (their sum, so nothing is optimised out)."""
    granted = sum(max(blocks, replica.held.get(ticket, 0)) for ticket, (blocks, _) in replica.grants.items())
    ahead = sum(blocks for ticket, blocks in replica.grant_prefill.items() if ticket not in replica.held)
    sequences = len(replica.grants) + sum(1 for ticket in replica.held
                                          if ticket not in replica.grants and ticket not in replica.released)
    return granted + ahead + sequences


def preamble_ask(preamble: list[int], i: int) -> PrefixAsk | None:
    """Request i's prompt: the preamble's blocks, then 8 of its own."""
    if not preamble:
        return None
    own = 1_000_000 + i * 8 * TOKENS_PER_BLOCK  # its own tokens, past the preamble's
    tokens = [*range(len(preamble) * TOKENS_PER_BLOCK), *range(own, own + 8 * TOKENS_PER_BLOCK)]
    hashes = chain_hashes(tokens, TOKENS_PER_BLOCK, SEED, preamble)
    return PrefixAsk(tuple(hashes), TOKENS_PER_BLOCK, SEED, len(tokens) + 1)


def queue_case(replicas: int, grants: int, requests: int, preamble_blocks: int = 0) -> tuple[float, float]:
    """(us per acquire + release, us per grant of the old sums over every replica) at that size. preamble_blocks > 0:
    every replica reports caching a preamble of that many blocks, and every prompt starts with it."""
    preamble = chain_hashes(list(range(preamble_blocks * TOKENS_PER_BLOCK)), TOKENS_PER_BLOCK, SEED)
    prefix = None
    if preamble:
        reporter = PrefixReporter(TOKENS_PER_BLOCK, SEED)
        for block in preamble:
            reporter.set(block, CACHED)
        prefix = reporter.report(None, 0)

    async def run() -> tuple[float, float]:
        queue = AdmissionQueue(max_queued=10, leak_grace_s=1e9)
        for r in range(replicas):
            queue.report(KvReport(replica_id=f"r{r}", capacity=100 * grants, tokens_per_block=TOKENS_PER_BLOCK,
                                  held={}, prefill_tokens=0, prefix=prefix))
        for i in range(replicas * grants):  # the held sequences: granted round the replicas by the queue itself
            await queue.acquire(f"held{i}", 8, 1.0)
        asks = [preamble_ask(preamble, i) for i in range(requests)]
        start = time.perf_counter()
        for i in range(requests):
            await queue.acquire(f"t{i}", 8, 1.0, ask=asks[i])
            queue.release(f"t{i}")
        per_grant = (time.perf_counter() - start) / requests
        start = time.perf_counter()
        rounds = max(requests // 10, 1)
        for _ in range(rounds):
            for replica in queue.replicas.values():
                summed(replica)
        return per_grant * 1e6, (time.perf_counter() - start) / rounds * 1e6

    return asyncio.run(run())


def burst_case(held: int, burst: int, incremental: bool) -> float:
    """Seconds to check and add `burst` requests to a scheduler holding `held` (half running, half waiting)."""
    config = SchedulerConfig(max_model_len=8192, max_num_seqs=max(held // 2, 1), max_num_batched_tokens=1 << 20,
                             admission="usage")
    scheduler = Scheduler(config, BlockManager(1 << 18, 16, 1, enable_prefix_caching=True), frozenset({0}))
    prompt = list(range(1, 2000))
    for i in range(held):
        scheduler.add_request(Request(f"h{i}", [i % 500 + 1, *prompt], SamplingParams(max_tokens=100)))
    scheduler.schedule()
    requests = [Request(f"b{i}", [i % 500 + 1, *prompt], SamplingParams(max_tokens=100)) for i in range(burst)]
    start = time.perf_counter()
    ledger = None
    for request in requests:
        need = scheduler.committed_blocks(request)
        if incremental:
            ledger = ledger or scheduler.kv_ledger()
            ledger.require(need)
            scheduler.add_request(request)
            ledger = scheduler.ledger_with(ledger, request, need)
        else:
            scheduler.kv_ledger().require(need)
            scheduler.add_request(request)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench admission_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--grants", type=int, nargs="+", default=[64, 512], help="sequences held per replica")
    parser.add_argument("--requests", type=int, default=400, help="acquire + release pairs timed per case")
    parser.add_argument("--preamble-blocks", type=int, default=192,
                        help="the cached preamble every prompt starts with, in the prefix rows (default 192: the "
                             "agentic preset's 12k-token tool preamble in TP8's 64-token blocks); 0: no prefix rows")
    parser.add_argument("--held", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--burst", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    section = DocsSection(SECTION)
    if args.write_docs:
        section.check()

    queue_rows = []
    for replicas in args.replicas:
        for grants in args.grants:
            grant_us, sums_us = queue_case(replicas, grants, args.requests)
            queue_rows.append(f"| {replicas} | {grants} | {replicas * grants:,} | {grant_us:,.0f} | {sums_us:,.0f} |")
            print(queue_rows[-1], flush=True)
    prefix_rows = []
    for replicas in args.replicas if args.preamble_blocks > 0 else ():
        grant_us, _ = queue_case(replicas, min(args.grants), args.requests, args.preamble_blocks)
        prefix_rows.append(f"| {replicas} | {min(args.grants)} | {grant_us:,.0f} |")
        print(prefix_rows[-1], flush=True)
    burst_rows = []
    for held in args.held:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for incremental in (False, True):
                times[incremental].append(burst_case(held, args.burst, incremental))
        rebuilt, extended = statistics.median(times[False]), statistics.median(times[True])
        burst_rows.append(f"| {held} | {args.burst} | {rebuilt * 1e3:,.0f} | {extended * 1e3:,.0f} | "
                          f"{rebuilt / extended:.1f}x |")
        print(burst_rows[-1], flush=True)

    text = "\n".join([
        "## Admission's cost per request at scale (`bench/admission_scale.py`)", "",
        f"`{bench_command('admission_scale', argv)}`; python {platform.python_version()}, one process on this "
        f"machine's CPU.", "",
        "**The admission queue's grant.** Each row: R replicas, each holding G granted sequences; the time of one "
        "acquire + release choosing among them (running totals), and what the sums each replica's reads computed "
        "before the totals cost over the same state, once per replica (the least one grant paid then).", "",
        "| replicas | sequences per replica | sequences | us per acquire + release | the old sums, us per grant |",
        "|---|---|---|---|---|", *queue_rows, "",
        *([f"The same grant with prefix routing over a shared preamble: every replica reports caching "
           f"{args.preamble_blocks} blocks, and every prompt is those and 8 blocks of its own, so the choice walks the "
           f"preamble on every replica (`PrefixIndex.match`).", "",
           "| replicas | sequences per replica | us per acquire + release |", "|---|---|---|", *prefix_rows, ""]
          if prefix_rows else []),
        f"**The engine core's check of a burst.** {args.burst} requests of 2,000 tokens added to a scheduler holding "
        f"H (half running), each checked against the KV ledger; medians of {args.rounds} rounds, alternated.", "",
        "| held | burst | the burst checked, ledger rebuilt per add: ms | extended per add: ms | ratio |",
        "|---|---|---|---|---|",
        *burst_rows])
    print(text)
    if args.write_docs:
        section.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
