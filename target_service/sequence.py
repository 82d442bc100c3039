"""One request's life in the engine: its tokens, sampling state, stop rules and stats."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from specsplit.shared.sampling import SamplingParams
from specsplit.shared.tokenizer import TextStream


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens reached
    EOS = "eos"  # the model's end-of-sequence token
    STOP = "stop"  # a stop token id or stop string
    CANCELLED = "cancelled"  # the client went away or the request was aborted


@dataclass
class RequestStats:
    """τ is generated tokens per target forward that produced tokens (prefill counts as one)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    prompt_tokens: int = 0

    @property
    def tau(self) -> float:
        return self.generated / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "tau": round(self.tau, 4)}


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculative: bool = True


@dataclass
class StepEvent:
    """What one engine step produced for one request."""

    request_id: str
    token_ids: list[int]  # newly emitted ids (may be empty on the final event)
    text_delta: str
    finish_reason: FinishReason | None
    stats: RequestStats


@dataclass
class Sequence:
    seq_id: int
    request: Request
    generator: torch.Generator
    eos_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)  # prompt followed by generated ids
    stats: RequestStats = field(default_factory=RequestStats)
    drafter_attached: bool = False  # the drafter holds state for this sequence
    drafter_refused: bool = False  # the drafter refused this sequence (e.g. its budget): decode it serially
    drafter_resting: bool = False  # detached while the batch size drafts nothing (EngineConfig.resume_after)
    # Positions its KV may take, held for it at admission: its budget and what its steps may write past it
    # (Engine._overhang then; fixed, so the room a chained step takes never outgrows what was held)
    reserved_tokens: int = 0
    finish_reason: FinishReason | None = None
    text: str = ""  # decoded generated text emitted so far (stop strings excluded)
    detok: TextStream | None = None  # incremental detokenizer (None: the engine emits no text)
    decoded: str = ""  # (with stop strings) all text decoded so far, including what is held back for them

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def last_position(self) -> int:
        """Position of the newest token, whose KV is not yet in the cache."""
        return len(self.tokens) - 1

    @property
    def remaining(self) -> int:
        return self.request.params.max_tokens - self.num_generated

    @property
    def budget_tokens(self) -> int:
        return self.prompt_len + self.request.params.max_tokens

    def accept(self, new_tokens: list[int]) -> list[int]:
        """Append verified tokens, cut at max_tokens / EOS / stop ids; returns what was kept."""
        params = self.request.params
        kept: list[int] = []
        for token in new_tokens[: max(self.remaining, 0)]:
            kept.append(token)
            if token in self.eos_ids and not params.ignore_eos:
                self.finish_reason = FinishReason.EOS
                break
            if token in params.stop_token_ids:
                self.finish_reason = FinishReason.STOP
                break
        self.tokens.extend(kept)
        self.stats.generated += len(kept)
        if self.finish_reason is None and self.remaining <= 0:
            self.finish_reason = FinishReason.LENGTH
        return kept
