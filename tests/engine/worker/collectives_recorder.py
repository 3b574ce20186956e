"""Records every collective a rank issues and checks the logs of a replica's ranks against NCCL's rules.

Every collective of a replica goes through one interface, `Collectives` (dcpserve/kernels/collectives.py), held by
the rank's `ParallelState` as tp_comm, dcp_comm and pcp_comm. `RecordingCollectives` wraps one of them: each call
is logged (`CollectiveCall`: the group's role and world ranks, the op, the input's shape, dtype, device and
contiguity) before it is forwarded, so a call that hangs or raises is in the log too. `record_parallel` wraps the
three of a ParallelState; `Recorder` is the observer bench/harness/model_harness.py's run_rank / run_job take
(`observer`): it wraps each job's collectives, marks the start of each step (`StepStart`: its decode rows and
prefill tokens) and saves the rank's log as json (`log_file`).

`check_logs` reads the logs of every rank of one run and returns what breaks the rules the transports rely on:
- for each group instance (role + world ranks), every member issued the same sequence of (op, shape, dtype): the
  first divergence is reported with the group, the two ranks, the index and both calls (or the missing one);
- no CPU tensor in a group whose transport is nccl (NCCL carries device memory only);
- every input contiguous: all_reduce works in place, so a non-contiguous input is an error under NCCL's rules even
  where the shared-memory transport copes; the other ops' inputs are checked the same way (every transport copies
  a strided input on every call), except the (group, op) pairs a caller names in `copies_allowed`;
- all_to_all's leading dim equals the group size.
`step_counts` tallies the calls of each step by kind (prefill, decode, mixed) for one rank.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dcpserve.engine.worker.parallel import ParallelState
from dcpserve.kernels.collectives import Collectives


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as the issuing rank saw it, before it ran."""

    group: str  # "tp", "dcp" or "pcp"
    members: tuple[int, ...]  # the group's world ranks, by group rank: with `group`, the group instance
    group_rank: int
    transport: str  # "shm", "gloo" or "nccl"
    op: str  # "all_reduce", "all_gather", "all_to_all" or "gather"
    shape: tuple[int, ...]
    dtype: str
    device: str  # the device type: "cpu" or "cuda"
    contiguous: bool
    lead: int | None = None  # all_to_all's leading dim (must be the group size); None for the other ops

    @property
    def signature(self) -> tuple[str, tuple[int, ...], str]:
        """What every member of the group must issue alike, call by call."""
        return self.op, self.shape, self.dtype

    def describe(self) -> str:
        return f"{self.op} {list(self.shape)} {self.dtype} on {self.device}"


@dataclass(frozen=True)
class StepStart:
    """The start of a step in a rank's log: what the step schedules (the same on every rank)."""

    index: int
    num_decodes: int
    num_prefill_tokens: int

    @property
    def kind(self) -> str:
        if self.num_decodes and self.num_prefill_tokens:
            return "mixed"
        return "decode" if self.num_decodes else "prefill"


LogEntry = CollectiveCall | StepStart


class RecordingCollectives:
    """A Collectives that logs each call into `log` and then forwards it to `inner`. `members`: the group's world
    ranks by group rank; None learns them from the group (group_members: collective, every member constructs its
    recorder at the same point)."""

    def __init__(self, inner: Collectives, log: list[LogEntry], members: Sequence[int] | None = None) -> None:
        if members is None:
            if not torch.distributed.is_initialized():
                raise ValueError(f"the {inner.name} group's world ranks cannot be learned without torch.distributed: "
                                 f"pass members=")
            members = group_members(inner, torch.distributed.get_rank())
        if len(members) != inner.size:
            raise ValueError(f"the {inner.name} group has {inner.size} ranks, but {len(members)} world ranks "
                             f"{list(members)} were given for it")
        self.inner = inner
        self.log = log
        self.members = tuple(members)
        self.name = inner.name
        self.transport = inner.transport
        self.size = inner.size
        self.rank = inner.rank

    def _record(self, op: str, x: torch.Tensor) -> None:
        self.log.append(CollectiveCall(
            group=self.name, members=self.members, group_rank=self.rank, transport=self.transport, op=op,
            shape=tuple(x.shape), dtype=str(x.dtype).removeprefix("torch."), device=x.device.type,
            contiguous=x.is_contiguous(), lead=int(x.shape[0]) if op == "all_to_all" and x.dim() else None))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._record("all_reduce", x)
        return self.inner.all_reduce(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._record("all_gather", x)
        return self.inner.all_gather(x)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        self._record("all_to_all", x)
        return self.inner.all_to_all(x)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        self._record("gather", x)
        return self.inner.gather(x)

    def close(self) -> None:
        self.inner.close()


def group_members(comm: Collectives, world_rank: int) -> tuple[int, ...]:
    """The group's world ranks by group rank, learned from the group itself (one all_gather, not recorded): every
    member must call it at the same point."""
    ranks = comm.all_gather(torch.tensor([world_rank], dtype=torch.int64))
    return tuple(int(r) for r in ranks.flatten().tolist())


def record_parallel(parallel: ParallelState, log: list[LogEntry]) -> ParallelState:
    """The ParallelState with each of its comms wrapped in a RecordingCollectives writing into `log`. Collective:
    every rank of the replica calls it at the same point (each group's members are all-gathered, tp then dcp then
    pcp)."""

    def wrap(comm: Collectives | None) -> Collectives | None:
        return None if comm is None else RecordingCollectives(comm, log, group_members(comm, parallel.world_rank))

    tp_comm = wrap(parallel.tp_comm)  # in this order on every rank: each group's members wait for the same call
    dcp_comm = wrap(parallel.dcp_comm)
    pcp_comm = wrap(parallel.pcp_comm)
    return dataclasses.replace(parallel, tp_comm=tp_comm, dcp_comm=dcp_comm, pcp_comm=pcp_comm)


# ---- the logs as files -----------------------------------------------------------------------------------------


def log_file(out_dir: Path, job_name: str, world_rank: int) -> Path:
    return out_dir / f"{job_name}_collectives_rank{world_rank}.json"


def save_log(log: Sequence[LogEntry], path: Path) -> None:
    entries = [{"step": dataclasses.asdict(e)} if isinstance(e, StepStart) else {"call": dataclasses.asdict(e)}
               for e in log]
    path.write_text(json.dumps(entries))


def load_log(path: Path) -> list[LogEntry]:
    entries: list[LogEntry] = []
    for raw in json.loads(path.read_text()):
        if "step" in raw:
            entries.append(StepStart(**raw["step"]))
        else:
            call: dict[str, Any] = raw["call"]
            entries.append(CollectiveCall(**{**call, "members": tuple(call["members"]), "shape": tuple(call["shape"])}))
    return entries


@dataclass
class Recorder:
    """The harness' observer of one rank (bench/harness/model_harness.py RankObserver): records each job's
    collectives and steps, and saves them to log_file(out_dir, job, rank) when the job ends. Picklable: the test
    hands one to every spawned rank."""

    out_dir: str
    log: list[LogEntry] = dataclasses.field(default_factory=list)
    steps: int = 0  # steps of the current job so far

    def attach(self, parallel: ParallelState) -> ParallelState:
        self.log, self.steps = [], 0
        return record_parallel(parallel, self.log)

    def step(self, num_decodes: int, num_prefill_tokens: int) -> None:
        self.log.append(StepStart(self.steps, num_decodes, num_prefill_tokens))
        self.steps += 1

    def job_done(self, job_name: str, world_rank: int) -> None:
        save_log(self.log, log_file(Path(self.out_dir), job_name, world_rank))


# ---- the checks ------------------------------------------------------------------------------------------------


def _calls(log: Sequence[LogEntry]) -> list[CollectiveCall]:
    return [e for e in log if isinstance(e, CollectiveCall)]


def rule_violations(call: CollectiveCall, rank: int, index: int,
                    copies_allowed: Collection[tuple[str, str]] = ()) -> list[str]:
    """NCCL's rules for one call (index: its place in the rank's calls on that group); a non-contiguous input of a
    (group, op) in copies_allowed passes (never an all_reduce's)."""
    where = f"rank {rank}'s {call.group} group {list(call.members)} call {index} ({call.describe()})"
    found = []
    if call.transport == "nccl" and call.device == "cpu":
        found.append(f"{where}: a CPU tensor in an nccl group (NCCL carries device memory only)")
    if not call.contiguous and (call.op == "all_reduce" or (call.group, call.op) not in copies_allowed):
        why = "it sums in place" if call.op == "all_reduce" else "NCCL takes contiguous buffers"
        found.append(f"{where}: a non-contiguous input ({why})")
    if call.op == "all_to_all" and call.lead != len(call.members):
        found.append(f"{where}: all_to_all's leading dim {call.lead} is not the group size {len(call.members)}")
    return found


def check_logs(logs: Mapping[int, Sequence[LogEntry]], copies_allowed: Collection[tuple[str, str]] = ()) -> list[str]:
    """What the logs of one run's ranks (by world rank) break: per group instance, the first place two members'
    sequences of (op, shape, dtype) differ; every call's NCCL rules (`copies_allowed`: rule_violations); ranks that
    disagree on the steps. Empty: all agree."""
    if any(op == "all_reduce" for _, op in copies_allowed):
        raise ValueError(f"copies_allowed={sorted(copies_allowed)} names all_reduce, which works in place: a "
                         f"non-contiguous input is never copied back; leave it out")
    problems: list[str] = []
    per_group: dict[tuple[str, tuple[int, ...]], dict[int, list[CollectiveCall]]] = {}
    for rank, log in sorted(logs.items()):
        mine: dict[tuple[str, tuple[int, ...]], list[CollectiveCall]] = {}
        for call in _calls(log):
            if call.members[call.group_rank] != rank:
                problems.append(f"rank {rank} logged group rank {call.group_rank} of the {call.group} group "
                                f"{list(call.members)}, which is world rank {call.members[call.group_rank]}")
            mine.setdefault((call.group, call.members), []).append(call)
        for key, calls in mine.items():
            per_group.setdefault(key, {})[rank] = calls
            for index, call in enumerate(calls):
                problems.extend(rule_violations(call, rank, index, copies_allowed))
    for (name, members), by_rank in sorted(per_group.items()):
        missing = [r for r in members if r not in logs]
        if missing:
            problems.append(f"the {name} group {list(members)}: no log from ranks {missing}")
        present = [r for r in members if r in logs]
        first = present[0]
        expected = by_rank.get(first, [])
        for other in present[1:]:
            divergence = _first_divergence(expected, by_rank.get(other, []))
            if divergence is not None:
                index, a, b = divergence
                problems.append(f"the {name} group {list(members)} diverges at call {index}: rank {first} issued "
                                f"{a}, rank {other} issued {b}")
    steps = {rank: [e for e in log if isinstance(e, StepStart)] for rank, log in logs.items()}
    for rank, marks in sorted(steps.items()):
        first_rank = min(steps)
        if marks != steps[first_rank]:
            problems.append(f"rank {rank}'s steps {marks} are not rank {first_rank}'s {steps[first_rank]}")
    return problems


def _first_divergence(a: list[CollectiveCall], b: list[CollectiveCall]) -> tuple[int, str, str] | None:
    for index in range(max(len(a), len(b))):
        left = a[index].describe() if index < len(a) else "nothing (its calls end here)"
        right = b[index].describe() if index < len(b) else "nothing (its calls end here)"
        if index >= len(a) or index >= len(b) or a[index].signature != b[index].signature:
            return index, left, right
    return None


def assert_logs_agree(logs: Mapping[int, Sequence[LogEntry]], copies_allowed: Collection[tuple[str, str]] = ()) -> None:
    problems = check_logs(logs, copies_allowed)
    if problems:
        raise AssertionError(f"{len(problems)} collective rule violation(s):\n" + "\n".join(problems[:20]))


def step_counts(log: Sequence[LogEntry]) -> list[tuple[str, dict[str, int]]]:
    """(step kind, calls per group role) for each step of one rank's log; calls before the first step are left out."""
    counts: list[tuple[str, dict[str, int]]] = []
    for entry in log:
        if isinstance(entry, StepStart):
            counts.append((entry.kind, {}))
        elif counts:
            per_group = counts[-1][1]
            per_group[entry.group] = per_group.get(entry.group, 0) + 1
    return counts
