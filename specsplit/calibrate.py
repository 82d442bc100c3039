"""The draft length for this device, by measurement: one short generation per draft length; the fastest wins.

A verify of k drafts costs a GPU about one decode step but a CPU more as k grows, so the number of
drafts per step that pays depends on the device as much as on the drafter's acceptance. Terms as in
`specsplit.evaluate`: τ = generated tokens per target step; acceptance = accepted / drafted tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from specsplit.local import LocalSetup, load_parts
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.proposer import Proposer
from specsplit.shared.sampling import SamplingParams
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.model import TargetModel
from specsplit.target_service.sequence import Request, RequestStats

DRAFT_LENGTHS = (0, 2, 4, 8, 15)  # 0: the target alone
PROMPT = "Explain how a bicycle stays upright while it moves."


@dataclass(frozen=True)
class Trial:
    num_drafts: int  # drafts per step; 0 = the target alone, no drafter involved
    generated: int
    seconds: float
    tau: float
    acceptance: float  # accepted / drafted; 0 when nothing was drafted
    stopped: bool = False  # cut short: it could no longer be the fastest

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Calibration:
    trials: tuple[Trial, ...]
    max_tokens: int

    def __post_init__(self) -> None:
        if not self.trials:
            raise InvalidRequest("a calibration needs at least one trial")

    @property
    def fastest(self) -> Trial:
        return max(self.trials, key=lambda t: t.tokens_per_s)

    @property
    def fastest_drafting(self) -> Trial | None:
        """The fastest trial that used the drafter (None if none did)."""
        drafting = [t for t in self.trials if t.num_drafts > 0]
        return max(drafting, key=lambda t: t.tokens_per_s) if drafting else None

    def table(self) -> list[str]:
        alone = next((t for t in self.trials if t.num_drafts == 0), None)
        lines = [f"  {'drafts/step':>11}  {'tokens/s':>8}  {'τ':>5}  {'acceptance':>10}  {'vs target alone':>15}"]
        for t in self.trials:
            ratio = f"{t.tokens_per_s / alone.tokens_per_s:.2f}x" if alone and alone.tokens_per_s else "-"
            accepted = f"{t.acceptance:.0%}" if t.num_drafts else "-"
            note = f"  (stopped after {t.generated} tokens)" if t.stopped else ""
            lines.append(f"  {t.num_drafts:>11}  {t.tokens_per_s:>8.1f}  {t.tau:>5.2f}  {accepted:>10}  "
                         f"{ratio:>15}{note}")
        return lines


def calibrate(model: TargetModel, proposer: Proposer, prompt_ids: Sequence[int], *,
              draft_lengths: Sequence[int] = DRAFT_LENGTHS, max_tokens: int = 32, eos_ids: Sequence[int] = (),
              rounds: int = 2, patience: float = 2.0) -> Calibration:
    """Time a greedy generation of `prompt_ids` per draft length, `rounds` times in turn; keep each one's best.

    Lengths past the drafter's most are clipped to it; 0 runs the target alone. Taking the best of
    interleaved rounds keeps a burst of other work on the machine from deciding the choice. A trial
    still running `patience` times as long as the fastest so far cannot win: it stops there and
    reports the tokens/s it reached, which bounds the calibration's time on a slow or busy machine.
    """
    lengths = sorted({min(k, proposer.spec.max_drafts) for k in draft_lengths if k >= 0})
    for k in {0, lengths[-1]}:  # the first forwards of each mode pay one-off costs
        _trial(model, proposer, prompt_ids, k, 4, eos_ids, deadline=float("inf"))
    best: dict[int, Trial] = {}
    for _ in range(rounds):
        for k in lengths:
            per_token = [t.seconds / t.generated for t in best.values() if t.generated]
            deadline = patience * min(per_token) * max_tokens if per_token else float("inf")
            trial = _trial(model, proposer, prompt_ids, k, max_tokens, eos_ids, deadline=deadline)
            if k not in best or trial.tokens_per_s > best[k].tokens_per_s:
                best[k] = trial
    return Calibration(tuple(best[k] for k in lengths), max_tokens)


def _trial(model: TargetModel, proposer: Proposer, prompt_ids: Sequence[int], num_drafts: int, max_tokens: int,
           eos_ids: Sequence[int], deadline: float) -> Trial:
    engine = Engine(model, proposer if num_drafts else None, EngineConfig(max_batch=1, num_drafts=num_drafts),
                    eos_ids=eos_ids)
    request = Request("calibration", list(prompt_ids), SamplingParams(max_tokens=max_tokens),
                      speculative=num_drafts > 0)
    engine.add(request)
    stats, stopped = RequestStats(), False
    started = time.perf_counter()
    while engine.has_work:  # each step reads its tokens on the host, so the clock sees finished work
        for event in engine.step():
            stats = event.stats
        if engine.has_work and time.perf_counter() - started > deadline:
            stopped = engine.abort(request.request_id)
    seconds = time.perf_counter() - started
    return Trial(num_drafts, stats.generated, seconds, stats.tau,
                 stats.accepted / stats.drafted if stats.drafted else 0.0, stopped)


def calibrate_local(setup: LocalSetup, *, draft_lengths: Sequence[int] = DRAFT_LENGTHS,
                    max_tokens: int = 32) -> Calibration:
    """Load the target and drafter `setup` names into this process and calibrate them on a short chat prompt."""
    model, tokenizer, proposer = load_parts(setup)
    if proposer is None:
        raise InvalidRequest("calibrating the draft length needs a drafter, not --drafter none")
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    return calibrate(model, proposer, prompt, draft_lengths=draft_lengths, max_tokens=max_tokens,
                     eos_ids=tokenizer.eos_token_ids)
