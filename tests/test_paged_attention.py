"""Paged attention: the torch reference against a naive loop; the Triton kernel against the reference,
under Triton's CPU interpreter here (a subprocess) and on CUDA in the gpu tests, inside a CUDA graph too."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specsplit.kernels.paged_attention import paged_attention_reference, paged_attention_triton

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def ragged_case(seed, batch, q_len, q_heads, kv_heads, head_dim, max_context, block_size=16,
                dtype=torch.float32, device="cpu"):
    """Sequences of random lengths whose blocks lie shuffled in one pool; the last q_len positions are
    the queries', except that some sequences pad with queries at position 0. The slots no query may
    read (free blocks, the tail of a sequence's last block) hold NaN, table padding is -1."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max_context // block_size)
    num_blocks = batch * max_blocks + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    positions = torch.zeros(batch, q_len, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    for b in range(batch):
        length = int(torch.randint(q_len, max_context + 1, (1,), generator=gen))
        used = -(-length // block_size)
        tables[b, :used] = torch.tensor([free.pop() for _ in range(used)], dtype=torch.int32)
        slots = tables[b, torch.arange(length) // block_size].long() * block_size + torch.arange(length) % block_size
        for cache in (k_cache, v_cache):
            cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(length, kv_heads, head_dim, generator=gen)
        real = int(torch.randint(1, q_len + 1, (1,), generator=gen)) if b % 2 else q_len
        positions[b, :real] = torch.arange(length - real, length)
    q = 2 * torch.randn(batch, q_len, q_heads, head_dim, generator=gen)  # peaky enough that errors show
    args = (q, k_cache, v_cache)
    return (*(t.to(device=device, dtype=dtype) for t in args), tables.to(device), positions.to(device))


def naive_attention(q, k_cache, v_cache, tables, positions, scale, window, tree=None):
    """One (sequence, query) at a time, its keys listed position by position, in float64."""
    batch, q_len, q_heads, _ = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        root = int(positions[b, 0])
        for j in range(q_len):
            pos = int(positions[b, j])
            lo = 0 if window is None else max(0, pos - window + 1)
            seen = [p for p in range(lo, pos + 1)
                    if tree is None or not root <= p < root + q_len or int(tree[b, j]) >> (p - root) & 1]
            slots = [(int(tables[b, p // block_size]), p % block_size) for p in seen]
            k = torch.stack([k_cache[s] for s in slots]).double().repeat_interleave(q_heads // kv_heads, 1)
            v = torch.stack([v_cache[s] for s in slots]).double().repeat_interleave(q_heads // kv_heads, 1)
            weights = (torch.einsum("hd,nhd->hn", q[b, j].double(), k) * scale).softmax(-1)
            out[b, j] = torch.einsum("hn,nhd->hd", weights, v)
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("q_len", [1, 3, 8, 16])
def test_reference_matches_naive_loop(q_len, q_heads, kv_heads, window):
    q, k, v, tables, positions = ragged_case(q_len, 4, q_len, q_heads, kv_heads, 32, max_context=70)
    out = paged_attention_reference(q, k, v, tables, positions, 32 ** -0.5, window)
    # float32 against float64: each score sums 32 products and each output <= 70 weighted values,
    # all O(1-10); rounding grows ~ sqrt(n) * 6e-8 * magnitude, ~1e-6. 1e-5 leaves 10x margin while
    # one wrong key, block or mask moves an output by O(0.1).
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, tables, positions, 32 ** -0.5, window),
                               atol=1e-5, rtol=1e-5)


def tree_words(seed: int, batch: int, q_len: int) -> torch.Tensor:
    """[B, Q] int64: each row a random tree's root then its nodes; a row's word has the bits of the block rows
    it sees (itself, its ancestors, the root)."""
    gen = torch.Generator().manual_seed(seed)
    words = [[1] for _ in range(batch)]
    for row in words:
        for i in range(1, q_len):
            row.append(row[int(torch.randint(0, i, (1,), generator=gen))] | (1 << i))  # a parent: a row before it
    return torch.tensor([[as_int64(w) for w in row] for row in words])


def as_int64(word: int) -> int:
    """A 64-bit word as the signed value an int64 holds (bit 63 set: negative)."""
    return word - (1 << 64) if word >= 1 << 63 else word


@pytest.mark.parametrize("q_len", [2, 7, 16, 64])
def test_reference_sees_a_trees_ancestors_only(q_len):
    q, k, v, tables, positions = ragged_case(q_len + 40, 3, q_len, 9, 3, 16, max_context=q_len + 40)
    tree = tree_words(q_len, 3, q_len)
    out = paged_attention_reference(q, k, v, tables, positions, 0.25, tree=tree)
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, tables, positions, 0.25, None, tree),
                               atol=1e-5, rtol=1e-5)
    chain = torch.tensor([as_int64((1 << (i + 1)) - 1) for i in range(q_len)]).expand(3, -1)  # the rows before
    torch.testing.assert_close(paged_attention_reference(q, k, v, tables, positions, 0.25, tree=chain),
                               paged_attention_reference(q, k, v, tables, positions, 0.25))
    for bad in ({"window": 4, "tree": tree}, {"tree": tree[:, :1]}, {"tree": tree.int()}):
        with pytest.raises(ValueError):
            paged_attention_reference(q, k, v, tables, positions, 0.25, **bad)


def test_reference_block_size_not_a_power_of_two():
    q, k, v, tables, positions = ragged_case(7, 3, 4, 6, 2, 16, max_context=40, block_size=5)
    out = paged_attention_reference(q, k, v, tables, positions, 0.25, window=9)
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, tables, positions, 0.25, 9),
                               atol=1e-5, rtol=1e-5)


def test_imports_and_falls_back_without_triton():
    code = ("import sys; sys.modules['triton'] = None; import torch\n"
            "from specsplit.kernels.paged_attention import paged_attention\n"
            "q, k = torch.randn(1, 1, 2, 16), torch.randn(1, 4, 2, 16)\n"
            "t, p = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([[3]], dtype=torch.int32)\n"
            "print(paged_attention(q, k, k, t, p, 0.25).shape)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "torch.Size([1, 1, 2, 16])" in result.stdout, result.stderr


# (seed, batch, q_len, q_heads, kv_heads, head_dim, max_context, block_size, window, num_splits)
INTERPRETED = [
    (0, 2, 1, 9, 3, 64, 80, 16, None, 1),
    (1, 3, 16, 9, 3, 64, 90, 16, 7, 1),
    (2, 2, 3, 8, 2, 128, 100, 16, None, 4),
    (3, 2, 8, 4, 4, 32, 120, 8, 20, 2),
    (5, 1, 16, 8, 2, 64, 100, 16, None, 2),  # 64 rows a group (4 heads x 16 queries): two row tiles
    (8, 2, 16, 9, 3, 64, 90, 16, "tree", 2),  # a draft tree's verify: each node its ancestors
]
# (2.5-4.7 s each under the interpreter: under `slow`, so the default run stays under five minutes)
INTERPRETED_LONG = [
    (4, 1, 8, 9, 3, 64, 640, 16, None, 32),  # one stream's verify on the H200: 32 key splits, many of them empty
    (6, 2, 13, 9, 3, 32, 70, 16, 5, 4),  # 39 rows: a full tile and a partial one
    (7, 1, 150, 3, 1, 16, 220, 16, None, 2),  # a captured prefill's long chunk: 450 rows a group, 15 tiles
]


def check_triton_interpreted(cases: list[tuple]) -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (test_triton_interpreted does)."""
    from triton.runtime import interpreter

    # triton 3.6's interpreter int()s 1-element arrays (loop bounds), an error since numpy 2.4
    # (triton-lang/triton#9171, fixed upstream by squeezing first, as here).
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
    for seed, batch, q_len, q_heads, kv_heads, head_dim, context, block_size, window, splits in cases:
        q, k, v, tables, positions = ragged_case(seed, batch, q_len, q_heads, kv_heads, head_dim, context, block_size)
        scale = head_dim ** -0.5
        tree = tree_words(seed, batch, q_len) if window == "tree" else None
        window = None if window == "tree" else window
        out = paged_attention_triton(q, k, v, tables, positions, scale, window, num_splits=splits, tree=tree)
        # both float32; the kernel's exp2 and online rescaling add a few ulps: same bound as above
        torch.testing.assert_close(out, paged_attention_reference(q, k, v, tables, positions, scale, window, tree),
                                   atol=1e-5, rtol=1e-5)
    print("interpreted cases ok:", len(cases))


@pytest.mark.slow  # (the default run stays under five minutes; CI runs the slow ones after it)
@pytest.mark.parametrize("cases", ["short", "long"])
def test_triton_interpreted(cases):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, __file__, cases], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "interpreted cases ok:" in result.stdout, result.stdout[-3000:]


def test_row_tiles_stay_within_the_decode_path():
    pytest.importorskip("triton")
    from specsplit.kernels.paged_attention import MAX_TILE_ROWS, row_tiles

    assert row_tiles(3) == (16, 1) and row_tiles(24) == (32, 1) and row_tiles(48) == (32, 2)
    assert row_tiles(39) == (32, 2) and row_tiles(64) == (32, 2) and row_tiles(16 * 16) == (32, 8)
    assert all(16 <= row_tiles(n)[0] <= MAX_TILE_ROWS and row_tiles(n)[0] * row_tiles(n)[1] >= n for n in range(1, 300))


def test_key_splits_fill_the_sms_from_shapes_alone(monkeypatch):
    from specsplit.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "_sm_count", lambda index: 132)  # an H200's
    cuda = torch.device("cuda", 0)  # (only its type is read: no GPU needed)
    # one stream of SmolLM2 (3 KV heads) over the engine's 8,192-token table; eight streams; a table too short
    assert pa.default_splits(3, 8192, 64, cuda) == 32 and pa.default_splits(24, 8192, 64, cuda) == 4
    assert pa.default_splits(3, 512, 64, cuda) == 2 and pa.default_splits(3, 8192, 64, torch.device("cpu")) == 1


GEOMETRIES = {"smollm2": (9, 3, 64), "qwen3_8b": (32, 8, 128)}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_splits", [1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [4, 8, 16])
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("batch", [1, 6])
def test_a_verify_attends_each_row_as_its_decode_would_bit_for_bit(geometry, q_len, dtype, batch, num_splits):
    """Each query row of a verify (q_len tokens at once) equals, bit for bit, that query attended alone
    (a decode of that token over the same cache): in bf16 too, so speculative greedy output does not
    part from target-only's at near-ties because of the attention. (The sixteenth session's H200 runs:
    4- and 8-token verifies kept eight texts target-only's over 512 tokens, the 16-token one kept one.)
    Where that holds: no window, and contexts within num_splits x 64 keys, so that every split is one
    64-key tile whatever the other rows of the tile (one stream's 32 splits: 2,048 keys). In float32 the
    rows may differ by a few ulps (the H200, seventeenth session: every bf16 case equal bit for bit, float32
    within 5e-7): the tile's dot products need not add in the same order for another tile shape, and
    float32 keeps the difference where bf16's rounding of the output absorbs it."""
    q_heads, kv_heads, head_dim = GEOMETRIES[geometry]
    q, k, v, tables, positions = ragged_case(q_len + 10, batch, q_len, q_heads, kv_heads, head_dim,
                                             max_context=500, dtype=dtype, device="cuda")
    scale = head_dim ** -0.5
    together = paged_attention_triton(q, k, v, tables, positions, scale, num_splits=num_splits)
    for j in range(q_len):
        alone = paged_attention_triton(q[:, j:j + 1].contiguous(), k, v, tables, positions[:, j:j + 1].contiguous(),
                                       scale, num_splits=num_splits)
        if dtype == torch.bfloat16:
            assert torch.equal(together[:, j:j + 1], alone), (j, (together[:, j:j + 1].float() - alone.float()).abs().max())
        else:
            torch.testing.assert_close(together[:, j:j + 1], alone, atol=2e-6, rtol=0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_splits", [1, None])
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("q_len", [1, 5, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("batch", [6, 1])  # one sequence: the most key splits (32 for SmolLM2 on an H200)
def test_triton_matches_reference_cuda(geometry, dtype, q_len, window, num_splits, batch):
    q_heads, kv_heads, head_dim = GEOMETRIES[geometry]
    q, k, v, tables, positions = ragged_case(q_len, batch, q_len, q_heads, kv_heads, head_dim, max_context=4096,
                                             dtype=dtype, device="cuda")
    scale = head_dim ** -0.5
    out = paged_attention_triton(q, k, v, tables, positions, scale, window, num_splits=num_splits)
    ref = paged_attention_reference(q, k, v, tables, positions, scale, window)
    # float32: exact (ieee) dots, only the summation order differs. bfloat16: both round the output
    # to bf16 (2^-9 relative) and the kernel rounds the softmax weights to bf16 before P @ V.
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_splits", [1, None])
@pytest.mark.parametrize("q_len", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_triton_tree_verify_matches_reference_cuda(geometry, dtype, q_len, num_splits):
    """A draft tree's verify (each node its ancestors): the kernel against the reference, one to six streams."""
    q_heads, kv_heads, head_dim = GEOMETRIES[geometry]
    for batch in (1, 6):
        q, k, v, tables, positions = ragged_case(q_len + batch, batch, q_len, q_heads, kv_heads, head_dim,
                                                 max_context=4096, dtype=dtype, device="cuda")
        tree = tree_words(q_len, batch, q_len).cuda()
        scale = head_dim ** -0.5
        out = paged_attention_triton(q, k, v, tables, positions, scale, num_splits=num_splits, tree=tree)
        ref = paged_attention_reference(q, k, v, tables, positions, scale, tree=tree)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_triton_in_cuda_graph(geometry):
    """Captured once; new positions, tables, queries and cache contents copied into the static inputs
    are what the replay reads (the split count is fixed by shapes, the key range read on the device)."""
    q_heads, kv_heads, head_dim = GEOMETRIES[geometry]
    case = lambda seed: ragged_case(seed, 4, 16, q_heads, kv_heads, head_dim, 4096, dtype=torch.bfloat16,
                                    device="cuda")
    static = case(0)
    run = lambda: (paged_attention_triton(*static, 0.1, None), paged_attention_reference(*static, 0.1, None))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, ref_out = run()
    for seed in (1, 2):
        fresh = case(seed)
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        graph.replay()
        expected = paged_attention_reference(*fresh, 0.1, None)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(ref_out.float(), expected.float(), atol=2e-2, rtol=2e-2)


if __name__ == "__main__":
    check_triton_interpreted(INTERPRETED_LONG if sys.argv[1:] == ["long"] else INTERPRETED)
