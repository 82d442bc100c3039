"""TargetModel equals transformers on random tiny checkpoints, however a sequence is split over forwards."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from specsplit.shared.errors import AlreadyExists, CapacityExceeded, InvalidRequest, StateConflict, UnknownSequence
from specsplit.target_service.kv_cache import PagedKVCache
from specsplit.target_service.model import CaptureSpec, ForwardBatch, load_target
from tests.conftest import TINY
from tests.rounding import matmul_reorder_bound, network_atol


def tolerance(expected: torch.Tensor) -> float:
    """Every comparison below is of one function summed in two orders (ours against transformers',
    chunked against one shot, batched against per sequence): the tiny checkpoints' longest sum is the
    MLP's 128-wide down projection, chained through 3 decoder layers and the head (tests/rounding.py)."""
    return network_atol(expected.abs().max().item(), TINY["intermediate_size"], TINY["num_hidden_layers"] + 1)


def assert_reordered_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert_close(got, expected, atol=tolerance(expected), rtol=0)


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def token_ids(n: int, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def batch(*seqs: tuple[int, torch.Tensor, int], logits_index=None) -> ForwardBatch:
    """seqs: (seq_id, ids, first position) each."""
    lengths = torch.tensor([0] + [len(ids) for _, ids, _ in seqs])
    return ForwardBatch(
        token_ids=torch.cat([ids for _, ids, _ in seqs]),
        positions=torch.cat([torch.arange(start, start + len(ids)) for _, ids, start in seqs]),
        cu_seqlens=torch.cumsum(lengths, 0),
        seq_ids=[seq_id for seq_id, _, _ in seqs],
        logits_index=logits_index,
    )


def one_shot(model, ids: torch.Tensor, capture: CaptureSpec | None = None):
    cache = model.new_cache(num_blocks=64, block_size=4)
    cache.allocate(0)
    return model(batch((0, ids, 0)), cache, capture or CaptureSpec())


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_target(tiny_llama_dir)


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_dir):
    return load_target(tiny_qwen3_dir)


# ---- equality with transformers ----------------------------------------------------------------

def test_logits_match_transformers(tiny_dir):
    ids = token_ids(24)  # longer than the sliding windows of the qwen3 (5) and mistral (6) checkpoints
    with torch.no_grad():
        expected = hf_model(tiny_dir)(ids[None]).logits[0]
    got = one_shot(load_target(tiny_dir), ids).logits
    assert got.dtype == torch.float32 and got.shape == (24, 128)
    assert_reordered_close(got, expected)


def test_wrong_rope_would_be_caught(tiny_llama_dir, llama):
    """The tolerance is meaningful: dropping llama3 rope scaling moves logits far past it."""
    from dataclasses import replace

    from specsplit.shared.config import RopeConfig
    from specsplit.shared.layers import RotaryEmbedding

    ids = token_ids(24)
    plain = load_target(tiny_llama_dir)
    plain.model.rotary_emb = RotaryEmbedding(16, replace(llama.config.rope, scaling_type="default"))
    right = one_shot(llama, ids).logits
    assert (one_shot(plain, ids).logits - right).abs().max() > 100 * tolerance(right)
    assert isinstance(llama.config.rope, RopeConfig) and llama.config.rope.scaling_type == "llama3"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_captures_match_transformers_hidden_states(family, request):
    folder = request.getfixturevalue(f"tiny_{family}_dir")
    reference, ours = hf_model(folder), load_target(folder)
    last_layer_out = []
    reference.model.layers[-1].register_forward_hook(lambda m, i, out: last_layer_out.append(out))
    ids = token_ids(20, seed=1)
    with torch.no_grad():
        hidden = reference(ids[None], output_hidden_states=True).hidden_states
    out = one_shot(ours, ids, CaptureSpec(layer_ids=(1, 0, 2), last_hidden=True))
    last = last_layer_out[0][0] if isinstance(last_layer_out[0], tuple) else last_layer_out[0]
    # hidden_states[i + 1] is layer i's output, except the last entry, which HF takes after the final norm:
    # captured layer features follow HF's numbering (the last layer's normed), last_hidden is before the norm
    expected = torch.cat([hidden[2][0], hidden[1][0], hidden[3][0]], dim=-1)
    assert out.layer_features.shape == (20, 3 * 64)
    assert_reordered_close(out.layer_features, expected)
    assert_reordered_close(out.last_hidden, last[0])
    assert (out.last_hidden - hidden[-1][0]).abs().max() > 1e-2  # before the norm, not after


def test_capture_ids_are_validated(llama):
    for bad in (CaptureSpec(layer_ids=(3,)), CaptureSpec(layer_ids=(-1,)), CaptureSpec(layer_ids=(0, 0))):
        with pytest.raises(InvalidRequest):
            one_shot(llama, token_ids(4), bad)


def test_weights_are_tied_only_when_configured(llama, qwen3):
    assert llama.lm_head_weight is llama.embed_weight
    assert qwen3.lm_head_weight is not qwen3.embed_weight
    assert not torch.equal(qwen3.lm_head_weight, qwen3.embed_weight)


# ---- one sequence, many splits -----------------------------------------------------------------

def test_chunked_prefill_then_decode_equals_one_shot(tiny_dir):
    model = load_target(tiny_dir)
    ids = token_ids(26, seed=2)
    expected = one_shot(model, ids).logits
    cache = model.new_cache(num_blocks=16, block_size=4)
    cache.allocate(7)
    rows = [model(batch((7, ids[a:a + 7], a)), cache).logits for a in range(0, 21, 7)]  # 0..20, across blocks
    rows += [model(batch((7, ids[p:p + 1], p)), cache).logits for p in range(21, 26)]  # decode
    assert_reordered_close(torch.cat(rows), expected)
    assert cache.length(7) == 26


def test_ragged_verify_equals_one_shot_per_sequence(tiny_dir):
    """Three sequences of different lengths verify k+1 = 2, 4, 5 tokens in one forward."""
    model = load_target(tiny_dir)
    prompts = {3: token_ids(9, seed=3), 5: token_ids(14, seed=4), 11: token_ids(4, seed=5)}
    tails = {3: token_ids(2, seed=6), 5: token_ids(4, seed=7), 11: token_ids(5, seed=8)}
    cache = model.new_cache(num_blocks=32, block_size=4)
    for seq_id, prompt in prompts.items():
        cache.allocate(seq_id)
        model(batch((seq_id, prompt, 0)), cache)
    out = model(batch(*[(s, tails[s], len(prompts[s])) for s in prompts]), cache, CaptureSpec(last_hidden=True))
    expected = [one_shot(model, torch.cat([prompts[s], tails[s]]), CaptureSpec(last_hidden=True)) for s in prompts]
    assert_reordered_close(out.logits, torch.cat([e.logits[len(prompts[s]):] for s, e in zip(prompts, expected)]))
    assert_reordered_close(out.last_hidden,
                           torch.cat([e.last_hidden[len(prompts[s]):] for s, e in zip(prompts, expected)]))


def test_batched_attention_equals_the_per_sequence_reference(tiny_dir):
    """Serving's padded attention (one call per layer) against the per-sequence loop, on a mixed batch:
    a long prefill chunk, decodes and verifies of other lengths, blocks interleaved across sequences."""
    model = load_target(tiny_dir)
    histories = {4: token_ids(23, seed=20), 9: token_ids(5, seed=21), 2: token_ids(1, seed=22), 6: token_ids(0)}
    tails = {4: token_ids(6, seed=23), 9: token_ids(1, seed=24), 2: token_ids(3, seed=25), 6: token_ids(17, seed=26)}
    capture = CaptureSpec(layer_ids=(0, 2), last_hidden=True)
    outputs = {}
    for path in ("per_sequence", "batched"):
        model.attention_path = path
        cache = model.new_cache(num_blocks=40, block_size=4)
        for seq_id in histories:
            cache.allocate(seq_id)
        for start in range(0, 24, 3):  # grow the histories in turns, so each one's blocks are scattered
            part = [(s, h[start:start + 3], start) for s, h in histories.items() if len(h) > start]
            model(batch(*part), cache)
        outputs[path] = model(batch(*[(s, tails[s], len(histories[s])) for s in histories]), cache, capture)
    model.attention_path = "batched"
    ref, got = outputs["per_sequence"], outputs["batched"]
    for name in ("logits", "layer_features", "last_hidden"):
        assert_reordered_close(getattr(got, name), getattr(ref, name))


@pytest.mark.parametrize("truncate", [True, False])
def test_rejected_verify_rows_are_overwritten(tiny_dir, truncate):
    """A verify whose drafts were all rejected leaves stale K/V; the next forward must not see them."""
    model = load_target(tiny_dir)
    prompt, accepted, wrong = token_ids(10, seed=9), token_ids(6, seed=10), token_ids(7, seed=11)
    cache = model.new_cache(num_blocks=8, block_size=4)
    cache.allocate(0)
    model(batch((0, prompt, 0)), cache)
    free_before = cache.num_free_blocks
    model(batch((0, wrong, 10)), cache)  # positions 10..16: two more blocks
    if truncate:
        cache.truncate(0, 10)
        assert cache.num_free_blocks == free_before
    got = model(batch((0, accepted, 10)), cache).logits
    expected = one_shot(model, torch.cat([prompt, accepted])).logits[10:]
    assert_reordered_close(got, expected)


def test_logits_index_selects_rows(llama):
    ids, rows = token_ids(12, seed=12), [11, 0, 5]
    full = one_shot(llama, ids, CaptureSpec(last_hidden=True))
    cache = llama.new_cache(num_blocks=8, block_size=4)
    cache.allocate(0)
    picked = llama(batch((0, ids, 0), logits_index=torch.tensor(rows)), cache).logits
    # Both forwards are the same up to the final norm; then 3 rows enter the head's GEMM instead of
    # 12, which may block its 64-term sums differently. Twice that GEMM's order-free bound also
    # covers the norm's 64-term mean, should it be summed in another order too (tests/rounding.py).
    normed = llama.model.norm(full.last_hidden[rows])
    bound = 2 * matmul_reorder_bound(normed, llama.lm_head_weight.T)
    assert ((picked - full.logits[rows]).abs() <= bound).all()


def test_bfloat16_weights_give_float32_logits_near_float32(tiny_llama_dir, llama):
    ids = token_ids(16, seed=13)
    half = load_target(tiny_llama_dir, dtype=torch.bfloat16)
    cache = half.new_cache(num_blocks=8, block_size=4)
    assert cache.dtype == torch.bfloat16 and half.embed_weight.dtype == torch.bfloat16
    assert half.model.rotary_emb.inv_freq.dtype == torch.float32
    cache.allocate(0)
    out = half(batch((0, ids, 0)), cache, CaptureSpec(layer_ids=(0,)))
    reference = one_shot(llama, ids).logits
    assert out.logits.dtype == torch.float32 and out.layer_features.dtype == torch.bfloat16
    assert (out.logits - reference).abs().max() < 0.05 * reference.abs().max()


# ---- bad batches ------------------------------------------------------------------------------

def test_bad_batches_raise_domain_errors(llama):
    cache = llama.new_cache(num_blocks=4, block_size=4)
    cache.allocate(0)
    llama(batch((0, token_ids(3), 0)), cache)
    with pytest.raises(UnknownSequence):
        llama(batch((1, token_ids(3), 0)), cache)
    with pytest.raises(StateConflict, match="cannot start at 5"):
        llama(batch((0, token_ids(2), 5)), cache)
    gappy = batch((0, token_ids(3), 3))
    gappy.positions = torch.tensor([3, 4, 6])
    with pytest.raises(InvalidRequest, match="contiguous"):
        llama(gappy, cache)
    with pytest.raises(InvalidRequest, match="token ids"):
        llama(batch((0, torch.tensor([5, 128]), 3)), cache)
    with pytest.raises(InvalidRequest, match="cu_seqlens"):
        llama(ForwardBatch(token_ids(3), torch.arange(3, 6), torch.tensor([0, 2]), [0]), cache)
    with pytest.raises(InvalidRequest, match="twice"):
        llama(batch((0, token_ids(1), 3), (0, token_ids(1), 4)), cache)
    with pytest.raises(InvalidRequest, match="logits_index"):
        llama(batch((0, token_ids(2), 3), logits_index=torch.tensor([2])), cache)
    assert cache.length(0) == 3


def test_capacity_is_all_or_nothing(llama):
    cache = llama.new_cache(num_blocks=3, block_size=4)
    cache.allocate(0)
    cache.allocate(1)
    with pytest.raises(CapacityExceeded):
        llama(batch((0, token_ids(4), 0), (1, token_ids(9), 0)), cache)  # needs 1 + 3 blocks
    assert cache.num_free_blocks == 3 and cache.length(0) == cache.length(1) == 0


# ---- the paged KV cache on its own -------------------------------------------------------------

def test_kv_cache_block_bookkeeping():
    cache = PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=3, num_blocks=5, block_size=4)
    assert cache.k_pool.shape == (2, 5, 4, 2, 3)
    cache.allocate(1)
    cache.allocate(2)
    with pytest.raises(AlreadyExists):
        cache.allocate(1)
    cache.reserve(1, 6)
    cache.reserve(2, 4)
    cache.reserve(1, 3)  # never shrinks
    assert cache.length(1) == 6 and cache.block_table(1).tolist() == [0, 1] and cache.block_table(2).tolist() == [2]
    assert cache.block_table(1).dtype == torch.int32
    with pytest.raises(CapacityExceeded):
        cache.reserve(2, 4 * 4)  # needs 3 more, 2 free
    assert cache.num_free_blocks == 2 and cache.length(2) == 4
    cache.truncate(1, 4)
    assert cache.block_table(1).tolist() == [0] and cache.num_free_blocks == 3
    with pytest.raises(InvalidRequest):
        cache.truncate(1, 5)
    cache.free(1)
    with pytest.raises(UnknownSequence):
        cache.length(1)
    with pytest.raises(UnknownSequence):
        cache.reserve(9, 1)
    assert cache.num_free_blocks == 4


def test_kv_cache_write_then_gather_across_blocks():
    cache = PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=3, num_blocks=6, block_size=4)
    cache.allocate(0)
    cache.allocate(1)
    cache.reserve(1, 4)  # seq 0's blocks are not contiguous in the pool
    cache.reserve(0, 10)
    k, v = torch.randn(10, 2, 3), torch.randn(10, 2, 3)
    cache.write(1, 0, torch.arange(10), k, v)
    got_k, got_v = cache.gather(1, 0, 10)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert torch.count_nonzero(cache.k_pool[0]) == 0  # other layer untouched
    cache.write(1, 0, torch.tensor([7, 2]), k[:2] * 0, v[:2] * 0)
    assert torch.count_nonzero(cache.gather(1, 0, 10)[0][[2, 7]]) == 0
    with pytest.raises(CapacityExceeded):
        cache.write(1, 0, torch.tensor([10]), k[:1], v[:1])
    with pytest.raises(CapacityExceeded):
        cache.gather(1, 0, 11)
