"""Drives a dcpserve model on one rank the way the model runner does, without the scheduler.

Paged KV caches per layer (poisoned with NaN so any over-read shows), block tables in logical blocks of
block_size * dcp tokens taken from a shuffled free list (the same on every rank: same seed, same steps),
slot mappings from dcpserve.kernels.dcp_slot_mapping and local lengths from dcpserve.kernels.dcp_local_seq_lens, greedy
decoding with chunked prefill. Rows of a step: decodes first, then prefill chunks, as AttentionMetadata requires.

Imports no transformers, so spawned ranks start fast; `run_rank` is the body of one spawned rank. The model tests
(tests/engine/models) and the long-context benchmark (bench/long_context.py) drive their checkpoints with it.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from dcpserve.engine.config import ModelConfig
from dcpserve.engine.layers.attention import Attention, KernelBackend
from dcpserve.engine.models import CausalLM
from dcpserve.engine.worker.attention_metadata import AttentionMetadata
from dcpserve.engine.worker.loader import load_model
from dcpserve.engine.worker.parallel import ParallelState, destroy_parallel_state, init_parallel_state
from dcpserve.engine.worker.pcp import unsplit_rows
from dcpserve.kernels import dcp_local_seq_lens, dcp_slot_mapping


@dataclass
class Sequence:
    """One request: its tokens so far, how many have K/V cached, its logical blocks, and its step logits."""

    tokens: list[int]
    prompt_len: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # logits that chose each generated token

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass(frozen=True)
class Scenario:
    """Prompts generated together in one batch, with the per-sequence prefill chunk size."""

    prompts: tuple[tuple[int, ...], ...]
    prefill_chunk: int
    max_new_tokens: int


@dataclass(frozen=True)
class Job:
    """One checkpoint and the scenarios a rank runs on it; each rank saves its results to out_dir/result_file(rank)."""

    name: str
    model_dir: str
    scenarios: tuple[Scenario, ...]
    # None: the layer's own choice (Triton on CUDA, the fused CPU kernels elsewhere); "triton" off CUDA runs under
    # TRITON_INTERPRET=1; "ref": the exact references.
    kernels: KernelBackend | None = None
    device: str = "cpu"
    dtype: str = "float32"  # the weights' and the KV cache's torch dtype, by name

    def result_file(self, rank: int) -> str:
        dtype = "" if self.dtype == "float32" else f"_{self.dtype}"
        return f"{self.name}{'_' + self.kernels if self.kernels else ''}{dtype}_rank{rank}.pt"


class RankObserver(Protocol):
    """What a test attaches to a rank's run (tests/engine/worker/collectives_recorder.py records every collective):
    it may replace each job's ParallelState (before the model loads), hears of every step before its forward, and of
    each job's end."""

    def attach(self, parallel: ParallelState) -> ParallelState: ...

    def step(self, num_decodes: int, num_prefill_tokens: int) -> None: ...

    def job_done(self, job_name: str, world_rank: int) -> None: ...


class PagedRunner:
    """Per-rank paged KV caches and the metadata construction of one step."""

    def __init__(
        self,
        model: CausalLM,
        parallel: ParallelState,
        block_size: int,
        num_blocks: int,
        interleave: int = 1,
        seed: int = 0,
        observer: RankObserver | None = None,
    ) -> None:
        dtype = model.model.norm.weight.dtype
        device = model.model.norm.weight.device
        self.kv_caches = model.kv_cache_spec.allocate(num_blocks, block_size, dtype, device, fill=float("nan"))
        self.model = model
        self.parallel = parallel
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.interleave = interleave
        self.device = device
        self.observer = observer
        # Shuffled pages, identical on every rank: block tables are shared by the whole DCP group.
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()

    def _allocate(self, seq: Sequence, num_tokens: int) -> None:
        tokens_per_block = self.block_size * self.parallel.dcp_size
        while len(seq.blocks) * tokens_per_block < num_tokens:
            if not self.free_blocks:
                raise RuntimeError("the test KV cache is full: raise num_blocks")
            seq.blocks.append(self.free_blocks.pop())

    def build_metadata(self, work: list[tuple[Sequence, int]], num_decodes: int) -> AttentionMetadata:
        """work: (sequence, new tokens) with the decodes first. Positions are [num_computed, num_computed + n)."""
        dcp, rank, interleave = self.parallel.dcp_size, self.parallel.dcp_rank, self.interleave
        width = max(len(seq.blocks) for seq, _ in work)
        # Unused columns hold an out-of-range page id: a kernel that reads past a sequence's blocks fails.
        table = torch.full((len(work), width), self.num_blocks + 7, dtype=torch.int32)
        for row, (seq, _) in enumerate(work):
            table[row, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        seq_idx = torch.cat([torch.full((n,), row, dtype=torch.int64) for row, (_, n) in enumerate(work)])
        positions = torch.cat([torch.arange(s.num_computed, s.num_computed + n) for s, n in work])
        slots = dcp_slot_mapping(table, seq_idx, positions, self.block_size, dcp, rank, interleave)
        decode_lens = torch.tensor([s.num_computed + 1 for s, _ in work[:num_decodes]], dtype=torch.int32)
        prefill_context = torch.tensor([s.num_computed for s, _ in work[num_decodes:]], dtype=torch.int32)
        chunk_lens = [n for _, n in work[num_decodes:]]
        query_start_loc = torch.tensor([0, *chunk_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        to = self.device
        return AttentionMetadata(
            slot_mapping=slots.to(to),
            num_decode_tokens=num_decodes,
            decode_block_table=table[:num_decodes].to(to),
            decode_local_seq_lens=dcp_local_seq_lens(decode_lens, dcp, rank, interleave).to(to),
            prefill_block_table=table[num_decodes:].to(to),
            prefill_query_start_loc=query_start_loc.to(to),
            prefill_local_context_lens=dcp_local_seq_lens(prefill_context, dcp, rank, interleave).to(to),
            prefill_max_query_len=max(chunk_lens, default=0),
        )

    def step(self, work: list[tuple[Sequence, int]]) -> None:
        """Runs one forward over the scheduled tokens; sequences whose tokens are all computed get a greedy token."""
        decodes = [(s, n) for s, n in work if s.num_computed >= s.prompt_len]
        prefills = [(s, n) for s, n in work if s.num_computed < s.prompt_len]
        if any(n != 1 for _, n in decodes):
            raise AssertionError("a decode row schedules exactly one token")
        ordered = decodes + prefills
        if self.observer is not None:
            self.observer.step(len(decodes), sum(n for _, n in prefills))
        for seq, n in ordered:
            self._allocate(seq, seq.num_computed + n)
        metadata = self.build_metadata(ordered, len(decodes))
        input_ids = torch.tensor([t for s, n in ordered for t in s.tokens[s.num_computed : s.num_computed + n]])
        positions = torch.cat([torch.arange(s.num_computed, s.num_computed + n) for s, n in ordered])
        own_rows = None
        parallel = self.parallel
        if parallel.pcp_size > 1:  # this rank's rows of the step: every decode and its segments of each chunk
            metadata, split = metadata.for_pcp_rank(
                [n for _, n in prefills], [s.num_computed for s, _ in prefills], parallel.pcp_size,
                parallel.pcp_rank, parallel.dcp_size, parallel.dcp_rank, self.interleave)
            own_rows = split.own_rows()
            input_ids, positions = input_ids[own_rows], positions[own_rows]
        hidden = self.model(input_ids.to(self.device), positions.to(self.device), self.kv_caches, metadata)
        if own_rows is not None:  # every PCP group ends up with every row's hidden state, as without PCP
            hidden = unsplit_rows(hidden, split, parallel.pcp_comm)
        sample_rows, sampled = [], []
        row = 0
        for seq, n in ordered:
            row += n
            seq.num_computed += n
            if seq.num_computed == len(seq.tokens):
                sample_rows.append(row - 1)
                sampled.append(seq)
        if sampled:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)]).float().cpu()
            for seq, row_logits in zip(sampled, logits, strict=True):
                seq.logits.append(row_logits)
                seq.tokens.append(int(row_logits.argmax()))

    def generate(self, scenario: Scenario) -> list[Sequence]:
        """Greedy decoding of a batch: prompts prefill in chunks, then every sequence decodes one token a step."""
        seqs = [Sequence(list(p), len(p)) for p in scenario.prompts]
        while True:
            work = []
            for seq in seqs:
                if len(seq.generated) >= scenario.max_new_tokens:
                    continue
                if seq.num_computed < seq.prompt_len:
                    work.append((seq, min(scenario.prefill_chunk, seq.prompt_len - seq.num_computed)))
                else:
                    work.append((seq, len(seq.tokens) - seq.num_computed))
            if not work:
                return seqs
            self.step(work)


MIN_PAGES = 64  # pages per rank at least: a short scenario's pages still come from a roomy, shuffled free list
SPARE_PAGES = 16  # pages no sequence needs, so the shuffled free list scatters even a long scenario's pages


def pages_needed(scenario: Scenario, block_size: int, dcp: int) -> int:
    """Pages per rank for the scenario: its sequences' logical blocks of block_size * dcp tokens (one page each on
    every rank of the DCP group) and SPARE_PAGES, at least MIN_PAGES."""
    tokens_per_block = block_size * dcp
    blocks = sum(-(-(len(p) + scenario.max_new_tokens) // tokens_per_block) for p in scenario.prompts)
    return max(blocks + SPARE_PAGES, MIN_PAGES)


def free_port() -> int:
    """A free TCP port on loopback for a gloo group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(
    rank: int, tp: int, dcp: int, interleave: int, port: int, jobs: list[Job], out_dir: str, block_size: int,
    pcp: int = 1, observer: RankObserver | None = None,
) -> None:
    """Body of one spawned rank (of tp * pcp): joins the gloo group, runs every job, saves tokens and logits per
    job; `observer` (a copy per rank) watches every job."""
    torch.set_num_threads(1)
    first = ModelConfig.from_pretrained(jobs[0].model_dir)
    # 300 s: a rank of a 32k-token scenario waits that long for its peers' prefill chunks (long_context.py)
    base = init_parallel_state(tp, rank, dcp, first.num_key_value_heads, f"tcp://127.0.0.1:{port}", "gloo", 300.0,
                               pcp_size=pcp)
    try:
        for job in jobs:
            config = ModelConfig.from_pretrained(job.model_dir)
            # The process groups do not depend on the model; only which KV head this rank holds does.
            parallel = dataclasses.replace(base, num_kv_heads=config.num_key_value_heads)
            run_job(job, config, parallel, interleave, Path(out_dir), block_size, observer)
        # Nobody tears down its gloo pairs while a peer may still be reading from them (that aborts the peer).
        torch.distributed.barrier()
    finally:
        destroy_parallel_state(base)


def run_job(
    job: Job, config: ModelConfig, parallel: ParallelState, interleave: int, out_dir: Path, block_size: int,
    observer: RankObserver | None = None,
) -> dict[str, list]:
    """Loads the checkpoint for this rank, generates every scenario, saves and returns tokens, logits and the
    attention kernels that ran. `observer` (RankObserver) sees the job's collectives and steps."""
    if observer is not None:
        parallel = observer.attach(parallel)
    model = load_model(job.model_dir, config, parallel, getattr(torch, job.dtype), torch.device(job.device))
    attention = [module for module in model.modules() if isinstance(module, Attention)]
    if job.kernels is not None:
        for module in attention:
            module.select_kernels(job.kernels)
    # The kernels that ran, so a test can check it covered the path it names.
    results: dict[str, list] = {"tokens": [], "logits": [], "kernels": sorted({m.kernels for m in attention})}
    for scenario in job.scenarios:
        pages = pages_needed(scenario, block_size, parallel.dcp_size)
        runner = PagedRunner(model, parallel, block_size, num_blocks=pages, interleave=interleave, observer=observer)
        for seq in runner.generate(scenario):
            results["tokens"].append(seq.generated)
            results["logits"].append(torch.stack(seq.logits))
    torch.save(results, out_dir / job.result_file(parallel.world_rank))
    if observer is not None:
        observer.job_done(job.name, parallel.world_rank)
    return results
