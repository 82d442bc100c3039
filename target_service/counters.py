"""What the engine counts for its metrics: plain integers and host-side seconds, no lock, no device read.

The engine thread is the only writer; a scrape (`target_service.metrics`) reads from another thread
and may see a step half counted, never a torn number. Terms as in the README: per sequence, a verify
step checks k drafts and accepts a of them (0 <= a <= k), emitting a + 1 tokens; τ = 1 + mean a.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Seconds: a graphed GPU step is about a millisecond, an eager CPU step up to seconds.
STEP_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Tally:
    """A histogram in plain ints: counts[i] values <= bounds[i], the last past every bound."""

    def __init__(self, bounds: tuple[float, ...] = STEP_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


def _bump(counts: list[int], index: int) -> None:
    if index >= len(counts):
        counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += 1


@dataclass
class EngineCounters:
    """Totals since the engine started."""

    steps: int = 0  # batched decode/verify forwards
    prefills: int = 0  # prompts prefilled (each is a target forward that produced a token)
    graphed_prefills: int = 0  # prefill forwards run as captured graphs (EngineConfig.graphed_prefill; re-attaches too)
    tokens: int = 0  # tokens emitted to clients
    # Per sequence and verify step, indexed by count: drafts[k] steps that verified k drafts, accepted[a]
    # steps that accepted a. Acceptance at draft position p follows: steps with a >= p over those with k >= p.
    drafts: list[int] = field(default_factory=lambda: [0])
    accepted: list[int] = field(default_factory=lambda: [0])
    fallbacks: int = 0  # the drafter failed: every sequence went on without it (serial decoding)
    refusals: int = 0  # the drafter refused one sequence (its limits): that one decodes serially
    reattaches: int = 0  # a drafter attached after a fallback, or first answered after a start without it
    rests: int = 0  # sequences set to rest from the drafter (freed, or not attached) at a batch size drafting nothing
    resumes: int = 0  # ... and re-attached once the batch drafted again
    chained: int = 0  # speculative steps chained on the device (target_service/chain.py), counted when read
    chain_captures: int = 0  # chained steps' shapes captured as one CUDA graph (chain.ChainProgram; whole, or after a service's drafts) ...
    chain_replays: int = 0  # ... and chained steps launched as a replay of one
    chain_capture_seconds: float = 0.0  # host seconds spent capturing them (a step that captures waits)
    chain_programs_made: int = 0  # chained-step programs made (a shape's first use, or its return once dropped) ...
    chain_programs_dropped: int = 0  # ... and dropped, least recently used, past EngineConfig.chain_programs
    # Host seconds of one batched step's phases, each ending at a point that already waits for the device:
    # propose (drafts back), verify (target forward and acceptance read back), control (telling the
    # drafter what was accepted: stash, commit, trim, catch-up).
    propose: Tally = field(default_factory=Tally)
    verify: Tally = field(default_factory=Tally)
    control: Tally = field(default_factory=Tally)

    def verified(self, num_drafts: int, num_accepted: int) -> None:
        _bump(self.drafts, num_drafts)
        _bump(self.accepted, num_accepted)
