"""The one-launch best-first trees (`kernels.tree_grow`) against `shared.tree.best_first` and the torch reference:
under Triton's CPU interpreter here (a child process, see tests/kernel_checks.py), on CUDA and inside a CUDA graph
in the gpu tests."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.tree_grow import (_grow_triton, grow_tree_words, grow_tree_words_reference, grow_tree_words_triton,
                                         grow_verify_inputs, grow_verify_inputs_reference)
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.tree import best_first, tree_words
from tests.kernel_checks import captured, run_interpreted

SHAPES = ((3, 15, 8, 15), (2, 4, 3, 9), (1, 2, 1, 2), (2, 15, 8, 31), (4, 15, 8, 63))


def candidates(batch: int, rows: int, width: int, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random log-probabilities, each row's best first (one -inf among them), and distinct tokens a row."""
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(batch, rows, width, generator=gen) * 3, -1).sort(-1, descending=True).values
    logp[0, -1, -1] = float("-inf")
    ids = torch.stack([torch.randperm(1000, generator=gen)[:rows * width].view(rows, width) for _ in range(batch)])
    return logp.to(device), ids.to(device)


def assert_best_first(grow, seed: int, device="cpu") -> None:
    """`grow`'s trees hold `best_first`'s token paths, their depths and words agree with their parents."""
    for batch, rows, width, budget in SHAPES:
        logp, ids = candidates(batch, rows, width, seed, device)
        trees, words = grow(logp, ids, budget)
        assert torch.equal(words, tree_words(trees.parents)), (batch, rows, width, budget)
        for b in range(batch):
            got, want = trees.tree(b), best_first(logp[b].tolist(), ids[b].tolist(), budget)

            def paths(tree):
                return sorted(tuple(tree.tokens[n] for n in tree.path_to(i)) for i in range(len(tree)))

            assert paths(got) == paths(want), (b, got, want)
            assert trees.depths[b].tolist() == [len(got.path_to(i)) for i in range(len(got))]
            assert all(p < i for i, p in enumerate(got.parents))  # parents before children


@pytest.mark.parametrize("seed", range(3))
def test_the_torch_reference_grows_best_first_trees(seed):
    assert_best_first(grow_tree_words_reference, seed)
    logp, ids = candidates(2, 15, 8, seed)
    trees, _ = grow_tree_words(logp, ids, 15)  # (off CUDA: the reference)
    assert torch.equal(trees.tokens, grow_tree_words_reference(logp, ids, 15)[0].tokens)


def test_the_kernel_refuses_what_it_cannot_hold():
    logp, ids = candidates(1, 4, 3, 0)
    for budget in (0, 64, 40):  # (4 rows of 3 candidates: 3 + 9 + 27 + 81 paths; 2 rows of 1: 2)
        with pytest.raises(InvalidRequest):
            grow_tree_words_triton(logp, ids, budget if budget != 40 else 121)
    with pytest.raises(InvalidRequest):
        grow_tree_words(logp[:, :2, :1], ids[:, :2, :1], 3)
    with pytest.raises(InvalidRequest):
        grow_tree_words_triton(logp, ids[:, :2], 3)


def assert_well_formed_with_nan(grow) -> None:
    """A NaN score (a drafter's non-finite logits) ranks last: the trees stay well formed, NaN row 0 included."""
    logp, ids = candidates(2, 6, 3, 9)
    logp[0, 0, 0], logp[1, 2] = float("nan"), float("nan")
    trees, words = grow(logp, ids, 9)
    assert torch.equal(words, tree_words(trees.parents))
    for b in range(2):
        tree = trees.tree(b)
        assert all(p < i for i, p in enumerate(tree.parents))
        assert trees.depths[b].tolist() == [len(tree.path_to(i)) for i in range(len(tree))]
        assert len(set(tree.parents)) > 1 or len(tree) == 1  # (not every node hung from one parent)


def test_nan_scores_make_well_formed_trees():
    assert_well_formed_with_nan(grow_tree_words)


@pytest.mark.parametrize("hostile", [5.0, float("inf")])
def test_scores_above_zero_cannot_emit_a_token_the_target_did_not_pick(hostile):
    """A drafter's score above 0 (a log-probability cannot be) would let a child outscore its parent: kept
    without it, the child hung from the root at depth 2, and its accepted path read a token nobody verified.
    Clamped to 0, the trees stay well formed and every emitted token is the target's pick after its parent."""
    from specsplit.target_service.chain import accept_tree_paths

    logp = torch.tensor([[[-1.0, -2.0], [hostile, -3.0], [-0.5, -9.0]]])
    ids = torch.tensor([[[1, 2], [3, 4], [5, 6]]])
    trees, words = grow_tree_words(logp, ids, 5)
    tree = trees.tree(0)
    assert all(p < i for i, p in enumerate(tree.parents))
    assert trees.depths[0].tolist() == [len(tree.path_to(i)) for i in range(len(tree))]
    picks = torch.tensor([[3, 9, 9, 9, 9, 9]])  # the target picks 3 after the root: no node holds it
    accepted, _, emitted = accept_tree_paths(trees, picks, words)
    assert accepted.tolist() == [0] and emitted[0, 0].item() == 3


def assert_verify_inputs(grow, device="cpu") -> None:
    """`grow_verify_inputs`: the trees of the ids clamped into the vocabulary (best-first's token paths, a NaN and
    a +inf score among them), their words, the verify's tokens (the anchor, then the nodes') and rotary positions
    (the root's, then its plus each node's depth)."""
    vocab = 700
    for seed, (batch, rows, width, budget) in enumerate(SHAPES):
        logp, ids = candidates(batch, rows, width, seed, device)
        ids = ids - 150  # (some below 0, some at or past the vocabulary: a hostile drafter's)
        logp[-1, 0, -1], logp[0, -1, 0] = float("nan"), float("inf")
        anchors = torch.arange(batch, device=device) + 5
        positions = torch.arange(batch, device=device) * 17 + 3
        trees, words, tokens, rotary = grow(logp, ids, budget, vocab, anchors, positions)
        assert torch.equal(words, tree_words(trees.parents)), (batch, rows, width, budget)
        assert torch.equal(tokens[:, 0], anchors) and torch.equal(tokens[:, 1:], trees.tokens)
        assert torch.equal(rotary, positions[:, None] + torch.cat([torch.zeros_like(trees.depths[:, :1]),
                                                                    trees.depths], 1))
        assert int(trees.tokens.min()) >= 0 and int(trees.tokens.max()) < vocab
        for b in range(batch):  # (clamped ids may repeat a token among siblings: no DraftTree of them)
            parents, depths = trees.parents[b].tolist(), trees.depths[b].tolist()
            assert all(-1 <= p < i for i, p in enumerate(parents))
            assert depths == [1 if p < 0 else depths[p] + 1 for p in parents]


def test_the_verify_inputs_reference():
    assert_verify_inputs(grow_verify_inputs_reference)
    logp, ids = candidates(2, 15, 8, 0)
    with pytest.raises(InvalidRequest):
        grow_verify_inputs(logp, ids, 15, 0, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(InvalidRequest):
        grow_verify_inputs(logp, ids, 15, 9, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))


def assert_kernel_verify_inputs_equal_the_reference(device="cpu") -> None:
    """Tie-free candidates (no NaN; a positive score and +inf, each its row's only 0 once clamped): the kernel's
    trees hold the reference's token paths, and its verify inputs are its own trees' (assert_verify_inputs checks
    the rest)."""
    for seed, (batch, rows, width, budget) in enumerate(SHAPES):
        logp, ids = candidates(batch, rows, width, seed + 10, device)
        logp[0, -1, -1] = -30.0  # (candidates() puts one -inf in: ties among -inf paths may differ)
        if rows > 2:  # a hostile drafter's scores above 0, in rows the trees reach: read as 0 (a child never
            logp[-1, 1, 0], logp[0, 2, 0] = 2.5, float("inf")  # outscores its parent), as the reference does
        anchors, positions = torch.arange(batch, device=device), torch.arange(batch, device=device) * 3
        got = _grow_triton(logp, ids, budget, 1000, anchors, positions)  # (ids within: no clamp repeats a token)
        want = grow_verify_inputs_reference(logp, ids, budget, 1000, anchors, positions)
        for b in range(batch):
            def paths(trees):
                tree = trees.tree(b)
                return sorted(tuple(tree.tokens[n] for n in tree.path_to(i)) for i in range(len(tree)))

            assert paths(got[0]) == paths(want[0]), (seed, b)


def check_triton_interpreted() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (test_triton_interpreted does)."""
    for seed in range(2):
        assert_best_first(grow_tree_words_triton, seed)
    assert_well_formed_with_nan(grow_tree_words_triton)  # (the kernel reads a NaN as -inf itself)
    assert_verify_inputs(_grow_triton)
    assert_kernel_verify_inputs_equal_the_reference()
    print("interpreted tree grow ok")


@pytest.mark.slow  # (the default run stays under five minutes; CI runs the slow ones after it)
def test_triton_interpreted():
    run_interpreted(__file__, "tree grow ok")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_grows_best_first_trees_on_cuda_and_in_a_graph():
    for seed in range(3):
        assert_best_first(grow_tree_words_triton, seed, "cuda")
    assert_well_formed_with_nan(lambda logp, ids, budget: grow_tree_words(logp.cuda(), ids.cuda(), budget))
    assert_verify_inputs(grow_verify_inputs, "cuda")
    assert_kernel_verify_inputs_equal_the_reference("cuda")
    logp, ids = candidates(8, 15, 8, 5, "cuda")
    graph, (trees, words) = captured(lambda: grow_tree_words_triton(logp, ids, 15))
    want, want_words = grow_tree_words_triton(logp, ids, 15)
    logp.copy_(candidates(8, 15, 8, 6, "cuda")[0])
    graph.replay()
    again, again_words = grow_tree_words_triton(logp, ids, 15)
    assert torch.equal(trees.tokens, again.tokens) and torch.equal(words, again_words)
    assert not torch.equal(want.tokens, again.tokens)


if __name__ == "__main__":
    check_triton_interpreted()
