"""The seeded pure-torch sampler both verify paths use (SamplingParams, torch-free, is in sampling_params)."""

from __future__ import annotations

import math

import torch

from specsplit.shared.errors import InvalidRequest
from specsplit.shared.sampling_params import SamplingParams  # also imported from here by the services


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
