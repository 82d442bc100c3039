"""A request's sampling parameters, validated once; torch-free, so the Python client can use them."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from specsplit.shared.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns target logits into tokens; validated once when the request arrives."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None = a fresh nondeterministic seed per request
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Lists from JSON/protobuf become tuples so params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("top_k", self.top_k, low=0)
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=2**64 - 1)
        for token in self.stop_token_ids:
            _check_int("stop_token_ids entry", token, low=0)
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise InvalidRequest("stop_strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidRequest(f"{name} must be an integer {bound}, got {value!r}")
