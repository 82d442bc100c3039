"""A chained tree step's bookkeeping in one launch (`kernels.tree_accept`): its torch reference against
`shared.tree.accept_greedy` walked one tree at a time, and the Triton kernel against the reference under the
Triton interpreter here (a child process, see tests/kernel_checks.py), on CUDA and inside a CUDA graph in the
gpu tests."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.tree_accept import accept_tree_step, accept_tree_step_reference, accept_tree_step_triton
from specsplit.kernels.tree_grow import grow_tree_words_reference
from specsplit.shared.tree import accept_greedy
from tests.kernel_checks import captured, run_interpreted

BLOCK = 4
SCRATCH = 7  # (any row: where the nodes off the path move, from and to)
SHAPES = ((3, 15, 8, 15), (2, 4, 3, 9), (1, 2, 1, 2), (5, 15, 8, 31), (4, 15, 8, 63), (2, 3, 1, 1))


def case(batch: int, rows: int, width: int, budget: int, seed: int, device="cpu"):
    """Random trees, picks that follow a tree's nodes most of the way (and leave it at random), positions and
    block tables: (trees, words, picks, positions, tables, outcome), outcome holding a marker to be overwritten."""
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(batch, rows, width, generator=gen) * 3, -1).sort(-1, descending=True).values
    ids = torch.stack([torch.randperm(1000, generator=gen)[:rows * width].view(rows, width) for _ in range(batch)])
    trees, words = grow_tree_words_reference(logp, ids, budget)
    picks = torch.randint(1000, 2000, (batch, budget + 3), generator=gen)  # (wider than the trees: a bucket's)
    for b in range(batch):
        parents = trees.parents[b].tolist()
        for node in range(-1, budget):
            children = [i for i, p in enumerate(parents) if p == node]
            if children and torch.rand((), generator=gen) < 0.85:
                pick = children[int(torch.randint(len(children), (), generator=gen))]
                picks[b, node + 1] = trees.tokens[b, pick]
    width_blocks = (60 + budget + 2) // BLOCK + 2
    tables = torch.stack([torch.randperm(100, generator=gen)[:width_blocks] for _ in range(batch)]).int()
    positions = torch.randint(0, 60, (batch,), generator=gen)
    outcome = torch.full((batch, budget + 2 + seed % 2), -5, dtype=torch.int64)  # (a wider row: its last column)
    return tuple(t.to(device) for t in (trees.tokens, trees.parents, trees.depths)), words.to(device), \
        picks.to(device), positions.to(device), tables.to(device), outcome.to(device)


def run(step, seed: int, device="cpu"):
    from specsplit.shared.tree import TreeBatch

    for shape in SHAPES:
        tree, words, picks, positions, tables, outcome = case(*shape, seed, device)
        yield shape, TreeBatch(*tree), words, picks, positions, tables, outcome, step(
            TreeBatch(*tree), words, picks, positions, tables, BLOCK, SCRATCH, outcome)


@pytest.mark.parametrize("seed", range(3))
def test_the_reference_accepts_as_the_tree_walk_does(seed):
    accepted_some = 0
    for shape, trees, words, picks, positions, tables, outcome, got in run(accept_tree_step_reference, seed):
        n = trees.tokens.shape[1]
        for b in range(shape[0]):
            tree = trees.tree(b)
            nodes, emitted = accept_greedy(tree, picks[b, :n + 1].tolist())
            count = len(nodes)
            accepted_some += count > 1
            assert got.accepted[b].item() == count and got.final[b].item() == emitted[-1], (shape, b)
            assert outcome[b, :count + 1].tolist() == emitted and outcome[b, -1].item() == count
            assert outcome[b, n].item() == emitted[-1]  # (past the path: the bonus pick, as the host ignores)
            # the root's row, the path's rows by depth, then each missing depth's own row (never read)
            assert got.order[b].tolist() == [0] + [i + 1 for i in nodes] + list(range(count + 1, n + 1))

            def slot(position: int) -> int:
                return tables[b, position // BLOCK].item() * BLOCK + position % BLOCK

            root = positions[b].item()
            assert got.move_from[b].tolist() == [slot(root + i + 1) for i in nodes] + [SCRATCH] * (n - count)
            assert got.move_to[b].tolist() == [slot(root + d + 1) for d in range(count)] + [SCRATCH] * (n - count)
    assert accepted_some > 5  # (the picks followed the trees: paths of two and more were walked)


def assert_matches_reference(step, seed: int, device="cpu") -> None:
    for shape, trees, words, picks, positions, tables, outcome, got in run(step, seed, device):
        *_, want_outcome = case(*shape, seed, device)
        want = accept_tree_step_reference(trees, words, picks, positions, tables, BLOCK, SCRATCH, want_outcome)
        assert torch.equal(outcome, want_outcome), (shape, outcome, want_outcome)
        for name in ("accepted", "final", "order", "move_from", "move_to"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (shape, name, getattr(got, name),
                                                                          getattr(want, name))


def test_off_cuda_the_step_is_the_reference():
    assert_matches_reference(accept_tree_step, 0)


def assert_repeated_siblings_emit_only_the_targets_picks(step) -> None:
    """Two siblings of one token (a drafter's repeated candidates) both match the target's pick: the deeper path
    is taken, and every emitted token is the target's."""
    from specsplit.shared.tree import TreeBatch

    trees = TreeBatch(torch.tensor([[5, 5, 6, 7]]), torch.tensor([[-1, -1, 0, 1]]), torch.tensor([[1, 1, 2, 2]]))
    words = torch.tensor([[1, 0b11, 0b101, 0b1011, 0b10101]])
    picks = torch.tensor([[5, 7, 7, 9, 9]])  # after node 1 the target picks 7: node 3 holds it
    outcome = torch.zeros((1, 6), dtype=torch.int64)
    got = step(trees, words, picks, torch.tensor([0]), torch.tensor([[0, 1]]), BLOCK, SCRATCH, outcome)
    assert got.accepted.item() == 2 and outcome[0, :3].tolist() == [5, 7, 9]  # (the deeper: node 1, then 3)
    assert got.order[0].tolist() == [0, 2, 4, 3, 4]  # (the root, node 1's row, node 3's, then unused depths)


def test_a_hostile_tree_of_repeated_siblings_still_emits_only_the_targets_picks():
    assert_repeated_siblings_emit_only_the_targets_picks(accept_tree_step_reference)


def assert_paths_past_the_table_move_nothing(step, device="cpu") -> None:
    """A root too near its table's end for its path (which the engine never verifies: the reference fails there)
    moves scratch to scratch, never a row of another sequence's block; the paths within their tables move."""
    from specsplit.shared.tree import TreeBatch

    tree, words, picks, positions, tables, outcome = case(2, 15, 8, 15, 0, device)
    picks[:, :16] = 5000  # (first: nothing accepted, for a path of the chain below)
    trees = TreeBatch(*(t.clone() for t in tree))
    trees.parents.copy_(torch.arange(-1, 14, device=device).expand(2, -1))  # (a chain of 15 nodes)
    trees.depths.copy_(torch.arange(1, 16, device=device).expand(2, -1))
    words.copy_(torch.cumsum(1 << torch.arange(16, device=device), 0).expand(2, -1))
    picks[:, :15] = trees.tokens  # (each node the target's pick after its parent: all 15 accepted)
    positions.copy_(torch.tensor([tables.shape[1] * BLOCK - 6, 0], device=device))
    got = step(trees, words, picks, positions, tables, BLOCK, SCRATCH, outcome)
    assert got.accepted.tolist() == [15, 15]
    assert got.move_from[0].tolist()[:4] != [SCRATCH] * 4  # (rows 1..5 past the root lie within the table)
    assert got.move_from[0].tolist()[5:] == [SCRATCH] * 10 and got.move_to[0].tolist()[5:] == [SCRATCH] * 10
    assert SCRATCH not in got.move_to[1].tolist()


def check_triton_interpreted() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (test_triton_interpreted does)."""
    for seed in range(2):
        assert_matches_reference(accept_tree_step_triton, seed)
    assert_paths_past_the_table_move_nothing(accept_tree_step_triton)
    assert_repeated_siblings_emit_only_the_targets_picks(accept_tree_step_triton)
    print("interpreted tree accept ok")


@pytest.mark.slow  # (the default run stays under five minutes; CI runs the slow ones after it)
def test_triton_interpreted():
    run_interpreted(__file__, "tree accept ok")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_accepts_as_the_reference_on_cuda_and_in_a_graph():
    from specsplit.shared.tree import TreeBatch

    for seed in range(3):
        assert_matches_reference(accept_tree_step_triton, seed, "cuda")
    assert_paths_past_the_table_move_nothing(accept_tree_step_triton, "cuda")
    tree, words, picks, positions, tables, outcome = case(8, 15, 8, 15, 4, "cuda")
    trees = TreeBatch(*tree)
    graph, got = captured(lambda: accept_tree_step_triton(trees, words, picks, positions, tables, BLOCK, SCRATCH,
                                                          outcome))
    other = case(8, 15, 8, 15, 6, "cuda")
    for into, values in zip((*tree, words, picks, positions, tables), (*other[0], *other[1:5])):
        into.copy_(values)
    graph.replay()
    want_outcome = other[5].clone()
    want = accept_tree_step_reference(trees, words, picks, positions, tables, BLOCK, SCRATCH, want_outcome)
    assert torch.equal(outcome, want_outcome) and torch.equal(got.accepted, want.accepted)
    assert torch.equal(got.move_from, want.move_from) and torch.equal(got.order, want.order)


if __name__ == "__main__":
    check_triton_interpreted()
