"""The draft length that pays, learned while serving: per batch size, the k that gives the most tokens
per second of decode step.

A step of B sequences with k drafts each yields B · E(k) tokens, E(k) = 1 + Σ_{j<k} P(the first j+1
drafts are accepted), and costs T(B, k) seconds, which grows with k once the batch fills the device
(and with the drafter's own work). Both move with the hardware, the model pair, the batch and the
traffic, so they are measured, not configured: acceptance by draft position from every verified
proposal, T as a moving average of the decode step's wall time per (batch bucket, k). Each bucket
first tries every candidate k (largest first, which measures acceptance at every position), then
takes the best estimate (a one-off slow step, such as a graph captured mid-run, is clipped), and
now and then retries the choice it measured longest ago, so a change in traffic or acceptance is
noticed. Greedy or sampled, the output does not depend on k: only speed does.

`choose` has no side effects: the engine asks it when it prefetches the next step's drafts and again
when that step proposes, and both must get the same k until `observe` records the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

CANDIDATES = (0, 1, 3, 7, 15)
# A step more than OUTLIER times the average of its k counts as OUTLIER times it: a one-off (a graph
# captured for a new shape mid-run, as the MTP chain does for each new cache length; a collection)
# must not keep a k out for the many steps until its next retry. While a k is still being measured
# (its warm-up steps), one that fast after an average of such a one-off replaces it; later, a short
# step (fewer drafts near a request's end) only moves the average. A lasting change still moves it
# within a few steps.
OUTLIER = 2.0
# A retry runs its k this many steps in a row: the engine times a chained step only between two of the same
# k (a switch un-overlaps the launches next to it, see Engine._chain_read), so a retry of one step was timed
# with its switch in it, and then looked slower than it is. Three give the middle one.
RETRY_STEPS = 3


@dataclass
class _Bucket:
    seconds: dict[int, float] = field(default_factory=dict)  # k -> moving average of a step's wall time
    samples: dict[int, int] = field(default_factory=dict)
    last_step: dict[int, int] = field(default_factory=dict)  # k -> the bucket's step count when last measured
    steps: int = 0
    retrying: int | None = None  # the k a retry runs (chosen as it starts, kept for its RETRY_STEPS steps)


class DraftTuner:
    def __init__(self, most: int, *, candidates: Iterable[int] = CANDIDATES, warmup: int = 2,
                 retry_every: int = 64, smoothing: float = 0.25, forget: float = 0.02) -> None:
        """most: the drafter's (or the configuration's) largest draft length; candidates above it are
        replaced by it. warmup: steps each k is measured before estimates are trusted (the first step of
        a new shape can carry one-time costs, so it is not counted). retry_every: a bucket's steps
        between retries of its longest-unmeasured k. smoothing: weight of a new step time in its moving
        average. forget: share of a position's acceptance counts forgotten at each step that offers drafts
        there (so they follow the traffic)."""
        if most < 0 or warmup < 1 or retry_every <= RETRY_STEPS or not 0 < smoothing <= 1 or not 0 <= forget < 1:
            raise ValueError(f"most >= 0, warmup >= 1, retry_every > {RETRY_STEPS}, smoothing in (0, 1] and forget "
                             "in [0, 1) are required")
        self.choices = tuple(sorted({min(k, most) for k in candidates if k >= 0} | {most}, reverse=True))
        self.most = most
        self.warmup = warmup
        self.retry_every = retry_every
        self.smoothing = smoothing
        self.keep = 1.0 - forget
        self.offered = [0.0] * most  # proposals that offered at least j+1 drafts (recent ones weigh more)
        self.accepted = [0.0] * most  # ... whose first j+1 drafts were all accepted
        self._expected = [float(k + 1) for k in range(most + 1)]  # E(0..most), all accepted until seen
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(num_seqs: int) -> int:
        """Steps are timed per power-of-two bucket of sequences: the target's step graph pads a batch to
        its bucket, so the step time hardly depends on where in the bucket the batch lies."""
        return 1 << max(num_seqs - 1, 0).bit_length()

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a sequence gains in a step with k drafts, from the acceptance seen so far."""
        return self._expected[min(k, self.most)]

    def _update_expected(self) -> None:
        """E(0..most); a position never offered yet is assumed as likely as the deepest one seen
        (optimistic, so it gets tried)."""
        expected, total, p = [1.0], 1.0, 1.0
        for j in range(self.most):
            if self.offered[j]:
                p = self.accepted[j] / self.offered[j]
            total += p
            expected.append(total)
        self._expected = expected

    def _choices(self, cap: int | None) -> tuple[int, ...]:
        """The candidates a step may run under `cap` (a configured limit at this batch size)."""
        if cap is None or cap >= self.most:
            return self.choices
        return tuple(k for k in self.choices if k <= cap) or (0,)

    def choose(self, num_seqs: int, cap: int | None = None) -> int:
        """The draft length for a step of `num_seqs` sequences, at most `cap`."""
        choices = self._choices(cap)
        bucket = self._buckets.get(self.bucket_of(num_seqs))
        if bucket is None:
            return choices[0]
        for k in choices:  # first, measure every k (largest first)
            if bucket.samples.get(k, 0) < self.warmup + 1:
                return k
        if bucket.steps % self.retry_every >= self.retry_every - RETRY_STEPS:
            return bucket.retrying if bucket.retrying in choices else min(choices, key=lambda k: bucket.last_step[k])
        return self.best(num_seqs, cap)

    def best(self, num_seqs: int, cap: int | None = None) -> int:
        """The measured best k for `num_seqs` sequences (the largest k until the bucket was measured)."""
        choices = self._choices(cap)
        bucket = self._buckets.get(self.bucket_of(num_seqs))
        seconds = dict(bucket.seconds) if bucket is not None else {}  # one read (metrics scrape from a thread)
        measured = [k for k in choices if k in seconds]
        if not measured:
            return choices[0]
        expected = self._expected
        return max(measured, key=lambda k: (expected[k] / seconds[k], -k))

    def learned(self) -> dict[int, int]:
        """{batch bucket: the k it runs when not measuring}, for every bucket seen (metrics read it from
        another thread: a snapshot of the keys, each bucket's figures read once)."""
        return {bucket: self.best(bucket) for bucket in sorted(list(self._buckets))}

    def snapshot(self) -> dict:
        """What the choice rests on, for benchmarks and debugging: E(k) for every candidate, and per batch
        bucket each measured k's average step time (ms), samples and tokens per second of step for each
        sequence in it (what `best` maximises)."""
        expected = self._expected
        buckets = {}
        for bucket in sorted(list(self._buckets)):
            b = self._buckets[bucket]
            seconds, samples = dict(b.seconds), dict(b.samples)
            buckets[bucket] = {k: {"ms": 1e3 * seconds[k], "samples": samples.get(k, 0),
                                   "tokens_per_s_per_sequence": expected[k] / seconds[k]}
                               for k in sorted(seconds) if seconds[k] > 0}
        return {"expected_tokens": {k: expected[k] for k in self.choices}, "buckets": buckets,
                "learned": self.learned()}

    def observe(self, num_seqs: int, k: int, seconds: float | None, verified: Sequence[tuple[int, int]]) -> None:
        """Record a decode step: its sequences, the draft length it ran (the k `choose` gave), its wall
        time, and each sequence's (drafts offered, drafts accepted). seconds None: the step's acceptance
        only, its time not comparable with other steps' (see Engine._chain_read)."""
        if verified:
            most = self.most
            offered_hist, accepted_hist = [0] * (most + 1), [0] * (most + 1)
            for offered, accepted in verified:
                offered_hist[min(offered, most)] += 1
                accepted_hist[min(accepted, most)] += 1
            keep, offered_at_least, accepted_at_least = self.keep, 0, 0
            for j in range(most - 1, -1, -1):  # position j: proposals with more than j drafts (accepted)
                offered_at_least += offered_hist[j + 1]
                accepted_at_least += accepted_hist[j + 1]
                # A position this step offered nothing at keeps what was seen of it: forgotten while the
                # tuner runs a shorter k, a far position's few retry samples (mostly rejections) made E(15)
                # equal E(7) at eight streams (2.54 each), where 15 drafts gave tau 2.84 against 7's 2.74.
                if offered_at_least:
                    self.offered[j] = self.offered[j] * keep + offered_at_least
                    self.accepted[j] = self.accepted[j] * keep + accepted_at_least
            self._update_expected()
        bucket = self._buckets.setdefault(self.bucket_of(num_seqs), _Bucket())
        bucket.steps += 1
        if bucket.steps % self.retry_every == self.retry_every - RETRY_STEPS and bucket.last_step:
            bucket.retrying = min(bucket.last_step, key=bucket.last_step.__getitem__)  # measured longest ago
        if k not in self.choices or seconds is None:
            return
        seen = bucket.samples.get(k, 0)
        bucket.samples[k] = seen + 1
        bucket.last_step[k] = bucket.steps
        if seen == 0:
            return  # a shape's first step can carry one-time costs (captures, allocations): not counted
        old = bucket.seconds.get(k)
        if old is None:
            bucket.seconds[k] = seconds
        elif seconds < old / OUTLIER and seen <= self.warmup:  # a first counted step that was a one-off
            bucket.seconds[k] = seconds  # (a capture on a shape's second step): the new time takes over
        else:  # a one-off slow step moves the average as a step OUTLIER times as slow would
            bucket.seconds[k] = old + self.smoothing * (min(seconds, OUTLIER * old) - old)
