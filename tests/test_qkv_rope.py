"""The q/k/v projection with its rotation and cache write in one launch (`kernels.qkv_rope`) against the torch
reference (the projection, then `rope_and_cache_write_reference`): under Triton's CPU interpreter here (a child
process, see tests/kernel_checks.py), on CUDA in the gpu tests."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.qkv_rope import qkv_rope_reference, qkv_rope_triton
from specsplit.kernels.rope import rotary_tables_reference
from tests.kernel_checks import run_interpreted

# (rows, Hq, Hkv, head dim, K, bias, per-head norms, input norm handed over): SmolLM2's heads at one stream's
# decode and verify, Qwen3-style norms, a wide tile's rows
CASES = ((1, 9, 3, 64, 96, False, False, False), (16, 9, 3, 64, 96, True, False, True),
         (5, 4, 2, 32, 64, False, True, False), (20, 4, 1, 32, 48, True, True, True))


def case(rows, hq, hkv, dim, k, bias, norms, norm_in, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    x, weight = rand(rows, k), rand((hq + 2 * hkv) * dim, k) / k ** 0.5
    positions = torch.randint(0, 4000, (rows,), generator=gen)
    cos, sin = (t.to(device) for t in rotary_tables_reference(positions, 1.0 / 10000 ** (torch.arange(
        0, dim, 2).float() / dim), dtype))
    blocks = rows + 3
    slots = torch.randperm(blocks * 4, generator=gen)[:rows].to(device)
    return dict(x=x, weight=weight, bias=rand((hq + 2 * hkv) * dim) if bias else None, heads=(hq, hkv), cos=cos,
                sin=sin, slots=slots, norms=(rand(dim), rand(dim)) if norms else None, eps=1e-6,
                norm_in=rand(k) if norm_in else None, caches=(blocks, 4, hkv, dim))


def check(device: str, dtype=torch.float32, atol=1e-5) -> None:
    for rows, hq, hkv, dim, k, bias, norms, norm_in in CASES:
        c = case(rows, hq, hkv, dim, k, bias, norms, norm_in, dtype, device)
        caches = [torch.full(c["caches"], float("nan"), dtype=dtype, device=device) for _ in range(4)]
        common = dict(weight=c["weight"], bias=c["bias"], heads=c["heads"], cos=c["cos"], sin=c["sin"],
                      slots=c["slots"], norms=c["norms"], eps=c["eps"])
        want = qkv_rope_reference(c["x"], k_cache=caches[0], v_cache=caches[1], norm_in=c["norm_in"], norm_eps=1e-5,
                                  **common)
        x, squares = c["x"], None
        if norm_in:  # handed over as a PendingNorm: the input times the norm's weight and its sum of squares
            x = (c["x"].float() * c["norm_in"].float()).to(dtype)
            squares = (c["x"].float() ** 2).sum(-1, keepdim=True)
        got = qkv_rope_triton(x, k_cache=caches[2], v_cache=caches[3], squares=squares, norm_eps=1e-5, **common)
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)
        written = c["slots"]
        for ours, theirs in ((caches[2], caches[0]), (caches[3], caches[1])):
            flat_ours, flat_theirs = ours.view(-1, *ours.shape[2:]), theirs.view(-1, *theirs.shape[2:])
            torch.testing.assert_close(flat_ours[written], flat_theirs[written], atol=atol, rtol=atol)
            untouched = torch.ones(flat_ours.shape[0], dtype=torch.bool, device=device)
            untouched[written] = False
            assert flat_ours[untouched].isnan().all()  # no other cache row was written


def test_the_reference_is_the_projection_then_the_rotary_write():
    c = case(3, 4, 2, 32, 48, True, True, False, torch.float32, "cpu")
    caches = [torch.zeros(c["caches"]) for _ in range(2)]
    q = qkv_rope_reference(c["x"], c["weight"], c["bias"], c["heads"], c["cos"], c["sin"], *caches, c["slots"],
                           c["norms"], c["eps"])
    assert q.shape == (3, 4, 32) and caches[0].view(-1, 2, 32)[c["slots"]].abs().sum() > 0


def check_triton_interpreted() -> None:
    check("cpu")
    print("interpreted qkv rope ok")


@pytest.mark.slow  # (the default run stays under five minutes; CI runs the slow ones after it)
def test_triton_interpreted():
    run_interpreted(__file__, "qkv rope ok")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_the_reference_on_cuda(dtype):
    check("cuda", dtype, atol=1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_steps_with_the_rotation_in_the_projection_equal_those_without(smollm2_dir, monkeypatch, dtype):
    """ROPE_IN_QKV: SmolLM2's captured decode and verify steps (its heads of 64 take the kernel in bfloat16; in
    float32 the layers keep their two launches, a check of the switch's bounds) against the same steps captured
    without it: the logits, the captured layers' rows and the cache rows written agree."""
    from specsplit.kernels import qkv_rope
    from specsplit.target_service.graphs import StepBatch, StepGraphs
    from specsplit.target_service.model import CaptureSpec, load_target
    from tests.test_step_graphs import prefilled_pair

    model = load_target(smollm2_dir, dtype=dtype, device="cuda")
    capture = CaptureSpec(layer_ids=(4, 8), last_hidden=True)
    outputs, caches = {}, {}
    for on in (False, True):
        monkeypatch.setattr(qkv_rope, "ROPE_IN_QKV", on)  # (read as the steps are captured)
        (_, cache), _ = prefilled_pair(model, [9, 14, 6], block_size=16)
        graphs = StepGraphs(model, cache, capture, max_batch=4, query_lens=(1, 16), max_len=256)
        gen = torch.Generator().manual_seed(3)
        ends, got = [9, 14, 6], []
        for lens in ([1, 1, 1], [16, 16, 16], [1], [16, 4]):
            tokens = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
            out = graphs.forward(StepBatch(list(range(len(tokens))), tokens, ends[:len(tokens)]))
            ends[:len(tokens)] = [e + n for e, n in zip(ends, lens)]
            got.append((out.logits.float().clone(), out.layer_features.float().clone()))
        outputs[on], caches[on] = got, cache
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for (logits, rows), (logits_on, rows_on) in zip(outputs[False], outputs[True]):
        torch.testing.assert_close(logits_on, logits, atol=tol * float(logits.abs().max()), rtol=0)
        torch.testing.assert_close(rows_on, rows, atol=tol * float(rows.abs().max()), rtol=0)
    torch.testing.assert_close(caches[True].k_pool.float(), caches[False].k_pool.float(), atol=tol * 10, rtol=tol)


if __name__ == "__main__":
    check_triton_interpreted()
