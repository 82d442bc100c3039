"""Float32 rounding bounds for tests that compare two computations of the same sums in different orders.

Batch shape, padding, GEMM blocking and the CPU's SIMD width (8 float32 lanes with AVX2, 16 with
AVX-512) all change the order in which a float32 sum is accumulated, so results that are equal in
exact arithmetic differ in their last bits, and differently on each machine. Tests comparing such
results take their tolerance from here, never a constant that happens to pass on one CPU; results of
the very same computation (copies, gathers, a call repeated on the same shapes) stay exactly equal.
"""

from __future__ import annotations

import torch

EPS = torch.finfo(torch.float32).eps  # 2^-23, twice the unit roundoff u


def gamma(n: int) -> float:
    """γ_n = n·u / (1 − n·u): a float32 sum of n terms, in any order, lies within γ_(n−1)·Σ|terms| of
    the exact sum (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §4.2)."""
    u = EPS / 2
    return n * u / (1 - n * u)


def matmul_reorder_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, N] elementwise bound on how far two float32 evaluations of a @ b ([M, K] @ [K, N]) may differ
    when their K-sums run in different orders: each lies within γ_K·(|a| @ |b|) of the exact product."""
    return (2 * gamma(a.shape[-1]) * (a.double().abs() @ b.double().abs())).float()


def network_atol(scale: float, sum_length: int, depth: int) -> float:
    """Absolute tolerance between two float32 evaluations of a network, differing in sum order, on
    values at most `scale` in magnitude.

    A model, not a theorem: each of `depth` chained stages (a decoder layer adding to the residual
    stream, a projection, a head) sums at most `sum_length` terms, which the bound above puts within
    n·u·Σ|terms| of exact in each evaluation, so 2·n·u apart; with normalised activations and weights
    scaled by 1/√fan-in, Σ|terms| is of the size of the values (√n larger in the worst case, while
    roundings of random sign grow only like √n·u), and the errors of chained stages add.
    """
    return depth * 2 * gamma(sum_length) * scale


def conf_atol(logit_scale: float, sum_length: int, depth: int) -> float:
    """Tolerance for confidences (log-probabilities: max logit − logsumexp). Moving every logit by at
    most δ moves a log-probability by at most 2δ, whatever its own size: the scale is the logits'."""
    return 2 * network_atol(logit_scale, sum_length, depth)
