"""A chained step's greedy acceptance of its drafts, and the outcome row the host reads, in one launch.

After the verify of B chains of k drafts, `Engine._chain_verify` takes each sequence's longest prefix of drafts
equal to the target's picks, the pick after it, and writes what the sequence gains (its accepted drafts, then
that pick) and the accepted count into the step's outcome. As torch ops (`target_service.chain.accept_greedy`,
then a gather, a scatter and two concatenations) that is about ten tiny kernels in a chain step's graph; here one
program a sequence.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, _switch, dependent_launch, gdc_enter, tl, triton

# On since the forty-ninth session, which ran it on an H100 (`gpu_round.sh scored-top-k`: a chain step 0.982 ms
# against 1.008 with the torch acceptance); SPECSPLIT_CHAIN_ACCEPT_KERNEL=0, or `bench/profile_step.py
# --torch-kernels chain_accept`: the torch reference on CUDA too.
KERNEL = _switch("SPECSPLIT_CHAIN_ACCEPT_KERNEL", True)


def accept_chain_step_reference(drafts: torch.Tensor, picks: torch.Tensor,
                                outcome: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts [B, k] against the verify's greedy picks [B, >= k + 1] (after the anchor, then after each draft):
    the accepted count [B] and the pick after the accepted drafts [B]. Writes each sequence's emitted tokens to
    outcome[:, :k + 1] (its drafts with that pick at the accepted count; the drafts past it are not read) and its
    accepted count to outcome[:, k + 1] (outcome [B, k + 2])."""
    from specsplit.target_service.chain import accept_greedy

    k = drafts.shape[1]
    accepted = accept_greedy(drafts, picks[:, :k + 1])
    final = picks.gather(1, accepted[:, None]).squeeze(1)  # the bonus pick, or the one that differed
    write_outcome(drafts, accepted, final, outcome)
    return accepted, final


def write_outcome(drafts: torch.Tensor, accepted: torch.Tensor, final: torch.Tensor, outcome: torch.Tensor) -> None:
    """What each sequence gains into outcome [B, k + 2]: its drafts [B, k] with the token after its accepted ones
    (`final` [B]) at its accepted count, then that count (`accepted` [B]). Torch ops, however they were accepted."""
    emitted = torch.cat([drafts, final[:, None]], dim=1).scatter(1, accepted[:, None], final[:, None])
    outcome.copy_(torch.cat([emitted, accepted[:, None]], dim=1))


def accept_chain_step(drafts: torch.Tensor, picks: torch.Tensor,
                      outcome: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on CUDA (int64 tensors whose columns are unit-strided), the torch reference elsewhere (the
    same arguments)."""
    if KERNEL and HAVE_TRITON and drafts.is_cuda and drafts.dtype == picks.dtype == outcome.dtype == torch.int64 \
            and drafts.stride(1) == picks.stride(1) == outcome.stride(1) == 1:
        return accept_chain_step_triton(drafts, picks, outcome)
    return accept_chain_step_reference(drafts, picks, outcome)


@triton.jit
def _accept_chain_kernel(drafts_ptr, stride_drafts, picks_ptr, stride_picks, outcome_ptr, stride_outcome,
                         accepted_ptr, final_ptr, K: tl.constexpr, KP: tl.constexpr, USE_GDC: tl.constexpr):
    """Program b: sequence b's K drafts against its K + 1 picks (KP a power of two above K)."""
    gdc_enter(USE_GDC)
    b = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, KP)
    draft = tl.load(drafts_ptr + b * stride_drafts + d, mask=d < K, other=0)
    pick = tl.load(picks_ptr + b * stride_picks + d, mask=d < K, other=0)
    accepted = tl.min(tl.where((draft != pick) & (d < K), d, K), 0).to(tl.int64)  # the first that differs
    final = tl.load(picks_ptr + b * stride_picks + accepted)
    emitted = tl.where(d == accepted, final, tl.where(d < K, draft, final))
    out = outcome_ptr + b * stride_outcome
    tl.store(out + d, emitted, mask=d <= K)
    tl.store(out + K + 1, accepted)
    tl.store(accepted_ptr + b, accepted)
    tl.store(final_ptr + b, final)


def accept_chain_step_triton(drafts: torch.Tensor, picks: torch.Tensor,
                             outcome: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_chain_step` in one launch: int64 drafts [B, k], picks [B, >= k + 1] and outcome [B, k + 2], each with
    unit column stride."""
    batch, k = drafts.shape
    assert k >= 1 and picks.shape[0] == batch and picks.shape[1] >= k + 1 and outcome.shape == (batch, k + 2)
    assert drafts.dtype == picks.dtype == outcome.dtype == torch.int64
    assert drafts.stride(1) == picks.stride(1) == outcome.stride(1) == 1
    accepted, final = (torch.empty(batch, dtype=torch.int64, device=drafts.device) for _ in range(2))
    _accept_chain_kernel[(batch,)](drafts, drafts.stride(0), picks, picks.stride(0), outcome, outcome.stride(0),
                                   accepted, final, K=k, KP=triton.next_power_of_2(k + 1), num_warps=1,
                                   **dependent_launch(drafts.device, "chain_accept"))
    return accepted, final
