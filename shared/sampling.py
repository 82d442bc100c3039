"""Per-request sampling parameters and the seeded pure-torch sampler both verify paths use."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

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


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits → [N, V] float32 probabilities after temperature, top-k, then top-p.

    Greedy params give the one-hot of the argmax (the temperature → 0 limit). Top-p keeps the
    smallest prefix of the sorted distribution whose mass reaches top_p, so the top token always
    survives. Each row needs at least one finite logit.
    """
    _check_logits(logits)
    logits = logits.float()
    vocab = logits.shape[-1]
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), vocab).float()
    logits = logits / params.temperature
    top_k_on = 0 < params.top_k < vocab
    if not top_k_on and params.top_p >= 1.0:
        return torch.softmax(logits, dim=-1)
    # Stable sort so ties at a cut-off resolve the same way on every run and device.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [N, V] each
    if top_k_on:
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks >= params.top_k, -math.inf)
    if params.top_p < 1.0:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # 0 for the top token
        sorted_logits = sorted_logits.masked_fill(mass_before >= params.top_p, -math.inf)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    return torch.empty_like(sorted_probs).scatter_(-1, order, sorted_probs)


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or not logits.is_floating_point() or logits.shape[-1] == 0:
        raise InvalidRequest(
            f"logits must be a floating [N, V] tensor with V > 0, got {tuple(logits.shape)} {logits.dtype}"
        )


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Pick one token per row of [N, V] non-negative weights with [N] uniforms in [0, 1) → [N] int64.

    Rows need not sum to 1 but must have positive mass. A token of weight 0 is never picked.
    """
    if probs.dim() != 2 or uniforms.shape != probs.shape[:1]:
        raise InvalidRequest(f"need probs [N, V] and uniforms [N], got {tuple(probs.shape)}, {tuple(uniforms.shape)}")
    probs = probs.float()
    cdf = probs.cumsum(dim=-1)  # [N, V]
    targets = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]  # [N, 1]
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(-1)  # [N]
    # u * total can reach total (u of 1, uneven parallel cumsum rounding): land on the last positive token.
    last_positive = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)  # [N]
    return torch.minimum(picked, last_positive)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[N, V] probabilities → [N] int64 tokens, drawing exactly N uniforms from `generator`."""
    if probs.dim() != 2:
        raise InvalidRequest(f"probs must be [N, V], got {tuple(probs.shape)}")
    check_generator_device(generator, probs.device)
    uniforms = torch.rand(probs.shape[0], generator=generator, device=probs.device)  # [N]
    return inverse_cdf(probs, uniforms)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on `device`, seeded for reproducibility or from OS entropy when seed is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def check_generator_device(generator: torch.Generator, device: torch.device) -> None:
    """torch.rand refuses a generator on another device; say so in the domain's terms."""
    device = torch.device(device)
    same_index = generator.device.index is None or device.index is None or generator.device.index == device.index
    if generator.device.type != device.type or not same_index:
        raise InvalidRequest(f"generator is on {generator.device}, tensors on {device}")
