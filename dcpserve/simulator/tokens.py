"""Simulated requests' tokens: lengths instead of token ids, and block hashes from the trace's prefix ids.

The engine's Request keeps its prompt and outputs as a list of token ids. A simulated prompt of 67k tokens times
thousands of concurrent requests would be gigabytes of ids nobody reads: the scheduler only takes lengths and slices
of them (a step's chunk), and the prefix cache names blocks by hashes, which a simulated request carries from the
start (as a served request carries the ingress' `prompt_hashes`). `PromptTokens` is a prompt of n tokens whose ids
are all 0; adding the outputs list to it (Request.__post_init__) gives `SequenceTokens`, which grows by append like
the list it stands for.

Block names: a trace names its prompt's prefix by one id per trace block (Mooncake: 512 tokens). A logical block of
the replica (block_size * dcp tokens) is named by a hash chained over its parent's name and the trace ids it covers
with its offset in them, so two prompts with the same leading trace ids get the same leading block names at any
block unit, and different ones never share a name (Python's hash of a tuple of ints: deterministic across runs and
processes, unlike that of strings). The blocks a request computes past its prompt are named by the engine itself
(BlockManager.block_hashes over the ids: zeros, then the outputs), chained from the prompt's last block, so they
are unique to the prompt too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

_MASK = (1 << 64) - 1


class SequenceTokens(Sequence[int]):
    """A prompt of `num_prompt` zeros followed by the outputs: a list of ids in everything the scheduler asks of it."""

    __slots__ = ("num_prompt", "outputs")

    def __init__(self, num_prompt: int, outputs: list[int]) -> None:
        self.num_prompt = num_prompt
        self.outputs = outputs

    def __len__(self) -> int:
        return self.num_prompt + len(self.outputs)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        num_prompt = self.num_prompt
        if type(index) is slice:
            start, stop = index.start, index.stop
            # The scheduler's common slices, a step's tokens of a decode or chunk: plain bounds inside one part.
            if index.step is None and type(start) is int and type(stop) is int and 0 <= start <= stop:
                if start >= num_prompt:
                    return self.outputs[start - num_prompt:stop - num_prompt]
                if stop <= num_prompt:
                    return [0] * (stop - start)
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("simulated tokens are sliced with step 1 only")
            if stop <= start:
                return []
            zeros = max(0, min(stop, num_prompt) - start)
            return [0] * zeros + self.outputs[max(start - num_prompt, 0):max(stop - num_prompt, 0)]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return 0 if index < num_prompt else self.outputs[index - num_prompt]

    def __iter__(self) -> Iterator[int]:
        yield from (0 for _ in range(self.num_prompt))
        yield from self.outputs

    def append(self, token_id: int) -> None:
        self.outputs.append(token_id)

    def extend(self, token_ids: list[int]) -> None:
        self.outputs.extend(token_ids)


class PromptTokens(SequenceTokens):
    """A prompt of n tokens: `prompt + outputs` (how Request builds its whole sequence) gives its SequenceTokens."""

    __slots__ = ()

    def __init__(self, num_prompt: int) -> None:
        super().__init__(num_prompt, [])

    def __add__(self, outputs: list[int]) -> SequenceTokens:
        return SequenceTokens(self.num_prompt, list(outputs))


def trace_block_hashes(hash_ids: Sequence[int], num_tokens: int, trace_block_tokens: int,
                       tokens_per_block: int) -> list[int]:
    """The names of the full logical blocks (tokens_per_block tokens) of a prompt of num_tokens tokens whose trace
    blocks (trace_block_tokens each) have the ids hash_ids: each chained over its parent's and the trace ids it covers
    from its offset in the first of them."""
    names: list[int] = []
    parent = 0
    for index in range(num_tokens // tokens_per_block):
        start = index * tokens_per_block
        first = start // trace_block_tokens
        last = (start + tokens_per_block - 1) // trace_block_tokens
        covered = tuple(hash_ids[first:last + 1])
        if len(covered) != last - first + 1:
            raise ValueError(f"{len(hash_ids)} trace block ids do not cover a prompt of {num_tokens} tokens "
                             f"({trace_block_tokens}-token trace blocks)")
        parent = hash((parent, start - first * trace_block_tokens, covered)) & _MASK
        names.append(parent)
    return names
