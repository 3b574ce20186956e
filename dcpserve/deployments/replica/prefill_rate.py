"""What prefill costs on a replica, measured: seconds per token on its engine steps that carry prompt tokens.

The admission queue prices a replica's queued prefill (the TTFT bound, dcpserve/deployments/admission/ttft_bound.py)
and a host-tier block's recompute (the prefix credit) in seconds per block. Derived from the replica's mean step
time over its step budget, that price is the decode steps' (most steps are decodes: a few milliseconds for a whole
budget of tokens), tens to hundreds of times below what a chunk of a long prompt takes: the simulator's agentic
trace on Kimi K2 priced a 72,896-token later turn at 0.03 s, and it took 4.47 s on an idle replica. So every request
looked startable within the bound and the bound never acted.

The replica measures the price instead, on the steps that compute prompt tokens: an exponentially decayed sum of
their seconds over a decayed sum of their tokens (a step's decodes ride in it, as they do when the prompt is
prefilled). Weighted by tokens, the long chunks that make up a long prompt's prefill dominate; the decay follows the
contexts the replica serves now (a chunk at 100k tokens of context costs about three times one at 0).
"""

from __future__ import annotations

# Each step with prompt tokens keeps this share of the sums before it (about the last ten such steps count).
DECAY = 0.9


class PrefillRate:
    """Seconds per token of one replica's steps that carry prompt tokens (module docstring)."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._tokens = 0.0

    def observe(self, seconds: float, prompt_tokens: int, tokens: int) -> None:
        """One engine step: its wall time, its prompt tokens and all its tokens. A step without prompt tokens (all
        decodes) or with no time measured changes nothing."""
        if prompt_tokens <= 0 or tokens <= 0 or seconds <= 0:
            return
        self._seconds = DECAY * self._seconds + seconds
        self._tokens = DECAY * self._tokens + tokens

    @property
    def seconds_per_token(self) -> float:
        """The measured price; 0 until a step with prompt tokens was seen."""
        return self._seconds / self._tokens if self._tokens > 0 else 0.0
