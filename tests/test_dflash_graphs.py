"""The DFlash drafter's static (graph-shaped) context and block forwards equal its eager ones."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from specsplit.drafter_service.graphs import length_buckets
from specsplit.kernels import rope
from specsplit.shared.proposer import ProposeRequest
from tests.test_dflash import INFO, make

# Both paths are float32 over the same weights; the static one pads contexts to a bucket (masked keys)
# and rows to a bucket, so only reduction order differs: 1e-5 on log-probabilities of magnitude ~1-10.
ATOL = 1e-5


def drive(drafter, lengths: list[int], steps: int, seed: int = 0):
    """Prefill sequences, then propose / stash / commit (accepting a varying number) for some steps;
    returns every step's proposals and the final contexts."""
    gen = torch.Generator().manual_seed(seed)
    width = drafter.spec.feature_dim
    for seq_id, n in enumerate(lengths):
        drafter.alloc(seq_id, 400)
        drafter.prefill(seq_id, torch.randint(0, 97, (n,), generator=gen).tolist(), torch.randn(n, width, generator=gen))
    pos = list(lengths)
    last = [1] * len(lengths)
    history = []
    for step in range(steps):
        requests = [ProposeRequest(i, last[i], pos[i], 4, want_confidence=True) for i in range(len(lengths))]
        proposals = drafter.propose(requests)
        history.append(proposals)
        with drafter.batched_appends():
            for i, p in enumerate(proposals):
                accepted = (step + i) % 5
                drafter.stash(i, torch.randn(5, width, generator=gen))
                committed = [last[i]] + p.tokens[:accepted]
                drafter.commit(i, accepted + 1, pos[i], committed)
                drafter.trim(i, accepted)
                pos[i] += accepted + 1
                last[i] = int(torch.randint(0, 97, (1,), generator=gen))
    contexts = [dict(zip(("pos", "k", "v"), drafter.held(drafter.store.get(i)))) for i in range(len(lengths))]
    return history, contexts


def drive_changing(drafter, seed: int = 0):
    """Three sequences propose and commit; then one leaves and a newcomer (another ring, so another
    table) takes its place in the batch, which keeps its size: the static forward must read its table."""
    gen = torch.Generator().manual_seed(seed)
    width = drafter.spec.feature_dim
    pos, history = {}, []

    def start(seq_id: int, n: int) -> None:
        drafter.alloc(seq_id, 400)
        drafter.prefill(seq_id, torch.randint(0, 97, (n,), generator=gen).tolist(), torch.randn(n, width, generator=gen))
        pos[seq_id] = n

    def step(ids: list[int]) -> None:
        proposals = drafter.propose([ProposeRequest(i, 1, pos[i], 4, want_confidence=True) for i in ids])
        history.append(proposals)
        with drafter.batched_appends():
            for i, p in zip(ids, proposals):
                drafter.commit_verified(i, torch.randn(5, width, generator=gen), 2, pos[i], [1] + p.tokens[:2])
                pos[i] += 3

    for seq_id, n in enumerate([7, 30, 3]):
        start(seq_id, n)
    for _ in range(3):
        step([0, 1, 2])
    start(3, 11)
    drafter.free(1)
    for _ in range(3):
        step([0, 3, 2])
    return history


def test_static_forwards_equal_eager_with_scaled_embeddings_and_logits():
    """A checkpoint's input_embedding_scale and output_multiplier (1.0 for the shipped drafter, whose
    forwards then skip them) are applied by both forwards alike."""
    eager, static = make(), make()
    for drafter in (eager, static):
        drafter.model.cfg = replace(drafter.model.cfg, input_embedding_scale=1.7, output_multiplier=0.6)
    static.use_static_forwards(use_graphs=False)
    want, _ = drive(eager, [7, 30, 3], steps=4)
    got, _ = drive(static, [7, 30, 3], steps=4)
    unscaled, _ = drive(make(), [7, 30, 3], steps=4)
    assert [[p.confidence for p in a] for a in want] != [[p.confidence for p in a] for a in unscaled]
    for a, b in zip(want, got):
        assert [p.tokens for p in a] == [p.tokens for p in b]
        assert_close(torch.tensor([p.confidence for p in b]), torch.tensor([p.confidence for p in a]), atol=ATOL, rtol=0)


def test_static_forwards_follow_a_batch_whose_sequences_change():
    eager, static = make(), make()
    static.use_static_forwards(use_graphs=False)
    for a, b in zip(drive_changing(eager), drive_changing(static)):
        assert [p.tokens for p in a] == [p.tokens for p in b]
        assert_close(torch.tensor([p.confidence for p in b]), torch.tensor([p.confidence for p in a]), atol=ATOL, rtol=0)


def drive_both(eager, static, steps: int):
    """Both drafters driven alike (`drive`): their drafts equal and their confidences within ATOL; their
    final contexts (eager's, static's)."""
    want, want_ctx = drive(eager, [7, 30, 3], steps=steps)
    got, got_ctx = drive(static, [7, 30, 3], steps=steps)
    for a, b in zip(want, got):
        assert [p.tokens for p in a] == [p.tokens for p in b]
        assert_close(torch.tensor([p.confidence for p in b]), torch.tensor([p.confidence for p in a]), atol=ATOL, rtol=0)
    return want_ctx, got_ctx


@pytest.mark.parametrize("one_launch", [False, True])
@pytest.mark.parametrize("window", [4096, 12])
def test_static_forwards_equal_eager(window, one_launch, monkeypatch):
    """(one_launch: the context forward through `kernels.rope.context_kv_write`, its reference on the CPU)"""
    monkeypatch.setattr(rope, "CONTEXT_IN_ONE_LAUNCH", one_launch)
    eager, static = make(window=window), make(window=window)
    assert all(layer.self_attn.k_norm is not None for layer in static.model.layers)  # (the branch folds them)
    static.use_static_forwards(use_graphs=False)
    want_ctx, got_ctx = drive_both(eager, static, steps=8)
    for a, b in zip(want_ctx, got_ctx):
        for name in a:
            assert_close(b[name], a[name], atol=ATOL, rtol=0)


def test_static_forwards_embed_the_block_by_indexing_as_eager(monkeypatch):
    """With SPECSPLIT_EMBED_BY_INDEXING the static forwards embed the block through weight[ids]: the drafts and
    contexts are the eager forward's."""
    from specsplit.shared import layers

    monkeypatch.setattr(layers, "EMBED_BY_INDEXING", True)
    indexed = []
    plain = layers.embed_rows
    monkeypatch.setattr("specsplit.drafter_service.graphs.embed_rows", lambda w, i: indexed.append(i) or plain(w, i))
    eager, static = make(), make()
    static.use_static_forwards(use_graphs=False)
    want_ctx, got_ctx = drive_both(eager, static, steps=4)
    assert indexed
    for a, b in zip(want_ctx, got_ctx):
        for name in a:
            assert_close(b[name], a[name], atol=ATOL, rtol=0)


@pytest.mark.parametrize("in_rope", [True, False], ids=["in-rope", "apart"])
def test_static_forwards_equal_eager_with_q_and_k_normed_in_the_rotary_launch(monkeypatch, in_rope):
    """kernels.rope.QK_NORM_IN_ROPE (on by default): the fused layers hand their q and k norms to the rotary kernel
    (its reference on the CPU) instead of norming first; the drafts are the eager forward's, and every layer's norms
    went in. Off, none is handed over and the drafts are the same."""
    monkeypatch.setattr(rope, "QK_NORM_IN_ROPE", in_rope)
    given = []
    plain = rope.rope_and_cache_write

    def spy(*args, **kw):
        given.append(args[8] if len(args) > 8 else kw.get("norms"))
        return plain(*args, **kw)

    import specsplit.drafter_service.dflash as dflash
    monkeypatch.setattr(dflash, "rope_and_cache_write", spy)  # (the context rows')
    monkeypatch.setattr(rope, "rope_and_cache_write", spy)  # (the block's, through shared.fused.PagedAttend)
    eager, static = make(), make()
    static.use_static_forwards(use_graphs=False)
    drive_both(eager, static, steps=4)
    layers = static.model.layers
    block_calls = [norms for norms in given if norms is not None]
    if not in_rope:
        assert given and not block_calls
        return
    assert block_calls and len(block_calls) % len(layers) == 0
    for i, (q_norm, k_norm) in enumerate(block_calls[:len(layers)]):
        assert q_norm is layers[i].self_attn.q_norm.weight and k_norm is layers[i].self_attn.k_norm.weight


def test_bitmask_requests_take_the_eager_path():
    from specsplit.shared.proposer import bool_to_bitmask

    drafter = make()
    drafter.use_static_forwards(use_graphs=False)
    drafter.alloc(0, 64)
    drafter.prefill(0, [1, 2, 3], torch.randn(3, drafter.spec.feature_dim))
    allowed = torch.zeros(97, dtype=torch.bool)
    allowed[[5, 9]] = True
    proposal = drafter.propose([ProposeRequest(0, 3, 3, 4, bitmask=bool_to_bitmask(allowed))])[0]
    assert set(proposal.tokens) <= {5, 9}


def test_each_target_head_keeps_its_own_graphs_until_it_leaves():
    """A drafter serving two targets binds each one's head before its propose: alternating heads must
    not throw away (and on a GPU re-capture) the other's graphs, and a head that leaves is forgotten."""
    drafter = make()
    drafter.use_static_forwards(use_graphs=False)
    first = drafter.head
    second = replace(first, embed=first.embed.clone(), lm_head=first.lm_head.clone())
    drafter.alloc(0, 64)
    drafter.prefill(0, [1, 2, 3], torch.randn(3, drafter.spec.feature_dim))
    graphs = drafter.propose_graphs
    proposals = []
    for head in (first, second, first, second):
        drafter.head = head
        proposals.append(drafter.propose([ProposeRequest(0, 3, 3, 4)])[0].tokens)
        built = {key: dict(runs) for key, runs in graphs._runs.items()}
    assert len(built) == 2 and all(len(runs) == 1 for runs in built.values())
    assert proposals[0] == proposals[1] == proposals[2] == proposals[3]  # equal weights, equal drafts
    drafter.propose([ProposeRequest(0, 3, 3, 4)])
    assert {k: dict(r) for k, r in graphs._runs.items()} == built  # nothing was rebuilt
    drafter.forget_head(first)
    assert len(graphs._runs) == 1


def test_a_replayable_runs_first_then_captures_while_serving_then_replays(monkeypatch):
    """On a GPU a bucket's function runs directly on its first call (its kernels' first run: a capture
    while serving runs nothing), is captured on its second with `capture_serving` (no device-wide sync,
    collection or emptied cache stalling other targets) and replayed from then on; inlined in another
    capture it always runs directly."""
    from specsplit.drafter_service import graphs as graphs_module
    from specsplit.drafter_service.graphs import _Replayable
    from specsplit.shared.cuda_graphs import inlined

    calls, captured = [], []

    class FakeGraph:
        def replay(self):
            calls.append("replay")

    def fake_capture(fn, pool):
        captured.append(pool)
        calls.append("capture")
        fn()  # (a real capture records the kernels instead of running them)
        return FakeGraph()

    monkeypatch.setattr(graphs_module, "capture_serving", fake_capture)
    out = torch.zeros(1)

    def fn():
        calls.append("run")
        return out

    run = _Replayable(fn, "pool", use_graphs=True)
    assert run() is out and calls == ["run"] and run.graph is None
    assert run() is out and calls == ["run", "capture", "run", "replay"] and captured == ["pool"]
    assert run() is out and calls[-1] == "replay" and len(captured) == 1
    with inlined():
        calls.clear()
        assert run() is out and calls == ["run"]
    plain = _Replayable(fn, None, use_graphs=False)
    calls.clear()
    plain(), plain()
    assert calls == ["run", "run"] and plain.graph is None


def test_length_buckets():
    assert length_buckets(4096) == [64, 128, 256, 512, 1024, 2048, 4096]
    assert length_buckets(12) == [12] and length_buckets(100, smallest=16) == [16, 32, 64, 100]


# The Triton paged-attention kernel needs a power-of-two head_dim of at least 16.
INFO16 = replace(INFO, head_dim=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("one_launch", [False, True])
@pytest.mark.parametrize("use_graphs", [True, False])
@pytest.mark.parametrize("window", [4096, 12])
def test_triton_paged_forwards_equal_eager(window, use_graphs, one_launch, monkeypatch):
    """On a GPU the paged block forward runs the Triton kernel, replayed from a graph or not (which
    isolates the kernel from the capture); the eager drafter attends with SDPA over gathered rows. With
    one_launch the context forward writes every layer's k and v in one launch (kernels.rope.context_kv_write)."""
    monkeypatch.setattr(rope, "CONTEXT_IN_ONE_LAUNCH", one_launch)
    eager, paged = make(window=window, device="cuda", info=INFO16), make(window=window, device="cuda", info=INFO16)
    assert paged.propose_graphs is not None  # on by default on a GPU
    if not use_graphs:
        paged.use_static_forwards(use_graphs=False)
    eager.propose_graphs = eager.context_graphs = None
    want, want_ctx = drive(eager, [7, 30, 3], steps=8)
    got, got_ctx = drive(paged, [7, 30, 3], steps=8)
    runs = [run for per_head in paged.propose_graphs._runs.values() for _, run in per_head.values()]
    # (a bucket is captured on its second use: its first runs directly)
    assert runs and any(run.graph is not None for run in runs) == use_graphs
    for a, b in zip(want, got):
        assert [p.tokens for p in a] == [p.tokens for p in b]
        assert_close(torch.tensor([p.confidence for p in b]), torch.tensor([p.confidence for p in a]),
                     atol=1e-4, rtol=0)
    for a, b in zip(want_ctx, got_ctx):
        for name in a:
            assert_close(b[name], a[name], atol=1e-4, rtol=0)


def test_a_prompt_longer_than_the_largest_context_bucket_goes_through_it_in_pieces(monkeypatch):
    """A prompt's rows past the static context forward's largest bucket (a long prompt's) go through it in
    pieces of that bucket (the context forward treats each row alone), where they went eagerly: the same
    contexts and proposals as the eager drafter's."""
    from specsplit.drafter_service.graphs import ContextGraphs

    eager, static = make(), make()
    static.use_static_forwards(use_graphs=False)
    most = static.context_graphs.buckets[-1]
    calls = []
    run = ContextGraphs.__call__
    monkeypatch.setattr(ContextGraphs, "__call__", lambda self, rows, *a: (calls.append(rows.shape[0]), run(self, rows, *a))[1])
    lengths = [most + 5, 7]
    want, want_ctx = drive(eager, lengths, steps=3)
    assert calls == []
    got, got_ctx = drive(static, lengths, steps=3)
    assert calls[:3] == [most, 5, 7]  # the prefills (one each), the long one in two pieces
    for a, b in zip(want, got):
        assert [p.tokens for p in a] == [p.tokens for p in b]
    for a, b in zip(want_ctx, got_ctx):
        for name in a:
            assert_close(b[name], a[name], atol=ATOL, rtol=0)
