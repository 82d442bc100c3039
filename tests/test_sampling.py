"""SamplingParams validation, target_probs filtering, and the seeded inverse-CDF sampler."""

from __future__ import annotations

import math

import pytest
import torch

from specsplit.shared.errors import InvalidRequest
from specsplit.shared.sampling import SamplingParams, inverse_cdf, make_generator, sample, target_probs

# Upper 0.001 quantile of the chi-square distribution, by degrees of freedom (index = df).
CHI2_CRITICAL_P001 = (
    None, 10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588,
    31.264, 32.909, 34.528, 36.123, 37.697, 39.252, 40.790, 42.312, 43.820, 45.315,
    46.797, 48.268, 49.728, 51.179, 52.620, 54.052, 55.476, 56.892, 58.301, 59.703,
    61.098, 62.487, 63.870, 65.247, 66.619, 67.985, 69.346, 70.703, 72.055, 73.402,
)  # fmt: skip


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom of [V] counts against [V] probs.

    Tokens of probability 0 must never occur; they are left out of the statistic.
    """
    support = probs > 0
    assert counts[~support].sum() == 0, f"tokens outside the support were emitted: {counts.tolist()}"
    expected = counts.sum() * probs[support].double()
    observed = counts[support].double()
    return float(((observed - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def test_chi_square_table_matches_the_incomplete_gamma_function():
    dfs = torch.arange(1, len(CHI2_CRITICAL_P001), dtype=torch.float64)
    critical = torch.tensor(CHI2_CRITICAL_P001[1:], dtype=torch.float64)
    tail = torch.special.gammaincc(dfs / 2, critical / 2)
    torch.testing.assert_close(tail, torch.full_like(tail, 0.001), atol=2e-6, rtol=0)


# --- SamplingParams ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": math.inf},
        {"temperature": math.nan},
        {"temperature": "hot"},
        {"top_k": -1},
        {"top_k": 2.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": math.nan},
        {"max_tokens": 0},
        {"max_tokens": True},
        {"seed": -1},
        {"seed": 2**64},
        {"stop_token_ids": (3, -2)},
        {"stop_strings": ("",)},
    ],
)
def test_sampling_params_rejects_bad_values(kwargs):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_are_greedy_and_lists_become_tuples():
    assert SamplingParams().greedy
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, stop_token_ids=[2, 7], stop_strings=["\n"])
    assert not params.greedy
    assert params.stop_token_ids == (2, 7) and params.stop_strings == ("\n",)
    hash(params)  # frozen and hashable, so it can key caches


# --- target_probs --------------------------------------------------------------------------------


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def test_greedy_params_give_the_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 3.0], [2.0, 0.0, 0.0, 0.0]])
    probs = target_probs(logits, SamplingParams())
    # A tie goes to the first maximum, as torch.argmax promises on every device.
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("temperature", [0.25, 1.0, 3.0])
def test_temperature_scales_logits_before_the_softmax(temperature):
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    probs = target_probs(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))


@pytest.mark.parametrize(
    "probs, params, expected",
    [
        # top-k keeps exactly the k most likely tokens, renormalised
        ([0.1, 0.4, 0.2, 0.3], SamplingParams(temperature=1.0, top_k=2), [0.0, 4 / 7, 0.0, 3 / 7]),
        ([0.1, 0.4, 0.2, 0.3], SamplingParams(temperature=1.0, top_k=4), [0.1, 0.4, 0.2, 0.3]),
        ([0.1, 0.4, 0.2, 0.3], SamplingParams(temperature=1.0, top_k=9), [0.1, 0.4, 0.2, 0.3]),
        # top-p keeps the smallest set whose mass reaches top_p
        ([0.15, 0.5, 0.05, 0.3], SamplingParams(temperature=1.0, top_p=0.79), [0.0, 0.625, 0.0, 0.375]),
        (
            [0.15, 0.5, 0.05, 0.3],
            SamplingParams(temperature=1.0, top_p=0.81),
            [0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95],
        ),
        # the top token always survives, however small top_p is
        ([0.15, 0.5, 0.05, 0.3], SamplingParams(temperature=1.0, top_p=1e-6), [0.0, 1.0, 0.0, 0.0]),
        # top-k first, then top-p on the renormalised survivors: 4/7 >= 0.5 keeps only the top token
        # (top-p first would have kept two)
        ([0.4, 0.3, 0.2, 0.1], SamplingParams(temperature=1.0, top_k=2, top_p=0.5), [1.0, 0.0, 0.0, 0.0]),
    ],
)
def test_top_k_then_top_p(probs, params, expected):
    got = target_probs(_logits_of(probs), params)
    torch.testing.assert_close(got, torch.tensor([expected]), atol=1e-6, rtol=0)


def test_target_probs_are_float32_rows_summing_to_one():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    probs = target_probs(logits, SamplingParams(temperature=0.9, top_k=20, top_p=0.7))
    assert probs.dtype == torch.float32 and probs.shape == (5, 50)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    assert ((probs > 0).sum(-1) <= 20).all()


def test_target_probs_keeps_masked_tokens_at_zero():
    logits = torch.tensor([[0.0, -math.inf, 1.0, -math.inf]])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.99))
    assert probs[0, 1] == 0 and probs[0, 3] == 0
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("logits", [torch.zeros(4), torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long)])
def test_target_probs_rejects_bad_logits(logits):
    with pytest.raises(InvalidRequest):
        target_probs(logits, SamplingParams(temperature=1.0))


# --- inverse_cdf and sample ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "probs, u, expected",
    [
        ([0.25, 0.25, 0.5], 0.0, 0),
        ([0.25, 0.25, 0.5], 0.2499, 0),
        ([0.25, 0.25, 0.5], 0.25, 1),
        ([0.25, 0.25, 0.5], 0.74, 2),
        ([0.0, 0.0, 1.0, 0.0], 0.0, 2),  # zero-weight tokens are skipped at both ends
        ([0.0, 0.3, 0.7, 0.0], 1.0 - 2**-24, 2),
        ([2.0, 6.0], 0.3, 1),  # unnormalised weights are scaled by the row's mass
    ],
)
def test_inverse_cdf_table(probs, u, expected):
    assert inverse_cdf(torch.tensor([probs]), torch.tensor([u])).item() == expected


def test_inverse_cdf_never_picks_a_zero_weight_token_when_the_target_reaches_the_mass():
    # u * mass == mass (u of exactly 1, or a parallel cumsum that rounds unevenly) finds no cdf
    # entry above it; the guard lands on the last token of positive weight, not the last token.
    probs = torch.tensor([[0.6, 0.4, 0.0, 0.0]])
    assert torch.searchsorted(probs.cumsum(-1), probs.sum(-1, keepdim=True), right=True).item() == 4
    assert inverse_cdf(probs, torch.tensor([1.0])).item() == 1


def test_inverse_cdf_rejects_mismatched_shapes():
    with pytest.raises(InvalidRequest):
        inverse_cdf(torch.ones(2, 3), torch.rand(3))


def test_sample_matches_the_distribution():
    probs = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1])
    tokens = sample(probs.expand(20_000, -1), make_generator(7, "cpu"))
    assert tokens.dtype == torch.int64 and tokens.shape == (20_000,)
    stat, df = chi_square(torch.bincount(tokens, minlength=6), probs)
    assert stat < CHI2_CRITICAL_P001[df]


def test_sample_is_reproducible_per_seed_and_draws_one_uniform_per_row():
    probs = torch.softmax(torch.randn(64, 100, generator=torch.Generator().manual_seed(2)), dim=-1)
    first, again = make_generator(11, "cpu"), make_generator(11, "cpu")
    assert torch.equal(sample(probs, first), sample(probs, again))
    assert not torch.equal(sample(probs, first), sample(probs, make_generator(12, "cpu")))
    reference = make_generator(11, "cpu")
    torch.rand(64, generator=reference)
    torch.rand(64, generator=reference)
    assert torch.equal(torch.rand(8, generator=first), torch.rand(8, generator=reference))


def test_unseeded_generators_differ():
    a, b = make_generator(None, "cpu"), make_generator(None, "cpu")
    assert not torch.equal(torch.rand(16, generator=a), torch.rand(16, generator=b))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sample_on_cuda_is_seeded_and_refuses_a_cpu_generator():
    probs = torch.softmax(torch.randn(32, 1000, device="cuda"), dim=-1)
    assert torch.equal(sample(probs, make_generator(5, "cuda")), sample(probs, make_generator(5, "cuda")))
    assert sample(probs, make_generator(5, "cuda")).device.type == "cuda"
    with pytest.raises(InvalidRequest):
        sample(probs, make_generator(5, "cpu"))
