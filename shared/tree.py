"""Draft trees: a block's runners-up verified together, where a chain verifies one guess a position.

A DFlash block drafts its γ-1 rows in one parallel pass, each row a distribution given only the anchor's
context, so the second- and third-best tokens of every row come with the best at no extra drafting cost.
A draft tree holds several continuations of the last emitted token (the root) that share their prefixes;
the target scores every node in one forward, each node seeing the context and its own ancestors only
(`DraftTree.visibility`), and greedy verification walks down from the root while a child holds the token
the target picks after its parent (`accept_greedy`). Every emitted token is the target's own argmax after
the tokens before it, so the output is the target's greedy output whatever the tree holds (lossless), and a
chain is the tree whose nodes each have one child.

Terms: node i (0-based) has a draft `tokens[i]` and a `parents[i]` (-1: the root), parents listed before
their children; its depth is 1 + its parent's (the root's is 0), so node i stands at position
root_position + depth(i). A rank path (r_1, .., r_d) names the node whose row-j token is row j's r_j-th
best (0: the best): `from_paths` turns a fixed set of them into a tree, `best_first` picks the `budget`
paths of highest summed log-probability (a path never scores above its prefix, so the best form a tree).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specsplit.shared.errors import InvalidRequest

MAX_TREE_NODES = 63  # a tree verify's rows (its root and nodes) fit the attention kernel's one int64 word a row
MAX_TREE_KEEP = 1024  # tokens a block row offers a tree (EngineConfig.draft_tree_keep, ChainStep.tree_keep)
TREE_KEEP = 8  # ... by default, and the one count a drafter service serves (DrafterDescription.tree_keep)


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # node i's draft token
    parents: tuple[int, ...]  # node i's parent node, -1 for a child of the root; always < i

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise InvalidRequest(f"a draft tree needs one parent a token: {len(self.tokens)} tokens, "
                                 f"{len(self.parents)} parents")
        children: set[tuple[int, int]] = set()
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if not -1 <= parent < i:
                raise InvalidRequest(f"node {i}'s parent {parent} is not an earlier node or the root (-1)")
            if token < 0:
                raise InvalidRequest(f"node {i}'s token {token} is not a token id")
            if (parent, token) in children:
                raise InvalidRequest(f"node {i} repeats token {token} beside a sibling under node {parent}")
            children.add((parent, token))

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def chain(tokens: Sequence[int]) -> DraftTree:
        return DraftTree(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))

    @property
    def depths(self) -> tuple[int, ...]:
        return tuple(block_rows(self.parents)[0][1:])

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`, in order."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def visibility(self) -> torch.Tensor:
        """[N, N] bool: node i sees node j iff j is i or one of its ancestors."""
        words = block_rows(self.parents)[1][1:]
        return torch.tensor([[word >> (j + 1) & 1 for j in range(len(self))] for word in words],
                            dtype=torch.bool).view(len(self), len(self))


def block_rows(parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """A tree verify's rows, the root's and then node i's at row i + 1: each row's depth (the root's 0) and its
    visibility word, bit c set where it sees row c (itself and its ancestors, the root among them). Refuses a
    parent that is not an earlier node or the root (-1)."""
    depths, words = [0], [1]
    for i, parent in enumerate(parents):
        parent = int(parent)
        if not -1 <= parent < i:
            raise InvalidRequest(f"tree node {i}'s parent {parent} is not an earlier node or the root (-1)")
        depths.append(depths[parent + 1] + 1)
        words.append(words[parent + 1] | 1 << (i + 1))
    return depths, words


def accept_greedy(tree: DraftTree, picks: Sequence[int]) -> tuple[list[int], list[int]]:
    """Greedy verification of a tree: `picks[0]` is the target's argmax after the root, `picks[1 + i]` after
    node i. Returns the accepted nodes (root's child first) and the emitted tokens: theirs, then the target's
    pick after the last of them (the recovered or bonus token)."""
    if len(picks) != len(tree) + 1:
        raise InvalidRequest(f"greedy verification of {len(tree)} nodes takes {len(tree) + 1} picks, got {len(picks)}")
    children: dict[tuple[int, int], int] = {(p, t): i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents))}
    accepted, node = [], -1
    while (node, int(picks[node + 1])) in children:
        node = children[(node, int(picks[node + 1]))]
        accepted.append(node)
    return accepted, [tree.tokens[i] for i in accepted] + [int(picks[node + 1])]


def matched(tree: DraftTree, continuation: Sequence[int]) -> int:
    """How many leading tokens of `continuation` (the target's own next tokens) the tree holds as one path:
    what greedy verification accepts when they are what the target picks (teacher forcing)."""
    picks = list(continuation[:max(tree.depths, default=0) + 1])
    children = {(p, t): i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents))}
    node, count = -1, 0
    for token in picks:
        node = children.get((node, int(token)), None)
        if node is None:
            break
        count += 1
    return count


def from_paths(paths: Sequence[tuple[int, ...]], ids: Sequence[Sequence[int]]) -> DraftTree:
    """The tree of rank paths `paths` (each one's prefixes among them) over rows whose candidates are `ids`
    (row j's tokens best first): the path (r_1, .., r_d)'s token is ids[d-1][r_d]."""
    order = sorted(set(paths), key=lambda p: (len(p), p))
    index: dict[tuple[int, ...], int] = {}
    tokens, parents = [], []
    for path in order:
        if not path or (len(path) > 1 and path[:-1] not in index):
            raise InvalidRequest(f"rank path {path} is empty or its prefix is not in the tree")
        if len(path) > len(ids) or not 0 <= path[-1] < len(ids[len(path) - 1]):
            raise InvalidRequest(f"rank path {path} reaches past the rows' candidates")
        index[path] = len(tokens)
        tokens.append(int(ids[len(path) - 1][path[-1]]))
        parents.append(index[path[:-1]] if len(path) > 1 else -1)
    return DraftTree(tuple(tokens), tuple(parents))


def best_first(logp: Sequence[Sequence[float]], ids: Sequence[Sequence[int]], budget: int) -> DraftTree:
    """The `budget` rank paths of highest summed log-probability as a tree: `logp[j]` row j's candidates'
    log-probabilities best first, `ids[j]` their tokens. Found best first: popping a path offers its next
    sibling (its last row's next candidate) and its first child (the next row's best)."""
    if budget < 0:
        raise InvalidRequest(f"a tree's budget must be at least 0, got {budget}")
    if len(logp) != len(ids) or any(len(a) != len(b) for a, b in zip(logp, ids)):
        raise InvalidRequest("best_first takes one token a log-probability, row by row")
    if not logp or not logp[0]:
        return DraftTree((), ())
    heap: list[tuple[float, tuple[int, ...]]] = [(-logp[0][0], (0,))]
    kept: list[tuple[int, ...]] = []
    while heap and len(kept) < budget:
        neg, path = heapq.heappop(heap)
        kept.append(path)
        row, rank = len(path) - 1, path[-1]
        if rank + 1 < len(logp[row]):
            heapq.heappush(heap, (neg + logp[row][rank] - logp[row][rank + 1], path[:-1] + (rank + 1,)))
        if row + 1 < len(logp) and logp[row + 1]:
            heapq.heappush(heap, (neg - logp[row + 1][0], path + (0,)))
    return from_paths(kept, ids)


# ---- batched on the device: fixed shapes, no host reads (what a captured step can replay) -------------


@dataclass(frozen=True)
class TreeBatch:
    """B trees of N nodes each, as tensors on the device: node order puts parents before children."""

    tokens: torch.Tensor  # [B, N] int64
    parents: torch.Tensor  # [B, N] int64, -1 for a child of the root
    depths: torch.Tensor  # [B, N] int64, 1 for a child of the root

    def tree(self, b: int) -> DraftTree:
        return DraftTree(tuple(self.tokens[b].tolist()), tuple(self.parents[b].tolist()))


def grow_trees(logp: torch.Tensor, ids: torch.Tensor, budget: int) -> TreeBatch:
    """`best_first`'s trees for B blocks at once, level by level: logp, ids [B, R, K], each row's candidates
    best first. Depth d keeps the `budget` best children of the nodes kept at depth d-1 (every node of the
    best `budget` overall is among them: a node outranks its children, so the best at a depth are the best
    children of the best a depth above), then the best `budget` of all kept are the tree. Fixed shapes
    throughout; ties may pick other nodes of equal score than `best_first` does."""
    batch, rows, width = logp.shape
    if budget < 1 or rows < 1:
        raise InvalidRequest(f"grow_trees needs a budget and rows, got {budget} and {rows}")
    device = logp.device
    level_score = logp[:, 0, :budget]  # [B, M]: depth 1, the best of row 0
    level_rank = torch.arange(level_score.shape[1], device=device).expand(batch, -1)
    level_parent = torch.full_like(level_rank, -1)
    scores, ranks, parents, depths = [level_score], [level_rank], [level_parent], [torch.ones_like(level_rank)]
    offset = 0  # where the level above starts among all kept nodes
    for row in range(1, rows):
        m = level_score.shape[1]
        child = level_score[:, :, None] + logp[:, row, None, :]  # [B, M, K]
        level_score, flat = child.reshape(batch, -1).topk(min(budget, m * width), -1)
        level_parent = offset + flat // width
        level_rank = flat % width
        offset += m
        scores.append(level_score)
        ranks.append(level_rank)
        parents.append(level_parent)
        depths.append(torch.full_like(level_rank, row + 1))
    score, rank, parent, depth = (torch.cat(t, 1) for t in (scores, ranks, parents, depths))
    # A node never outscores its parent, and the nodes stand level by level: a stable sort keeps a parent
    # before a child that ties it (a row sure of its token adds 0), so no node is kept without its parent
    order = score.sort(dim=-1, descending=True, stable=True).indices
    keep = order[:, :min(budget, score.shape[1])].sort(-1).values  # [B, N]: the best, in level order
    # renumber the kept nodes' parents: position of the parent among the kept (the root stays -1)
    where = torch.full_like(score, -1, dtype=torch.long)
    where.scatter_(1, keep, torch.arange(keep.shape[1], device=device).expand(batch, -1))
    parent = parent.gather(1, keep)
    parent = torch.where(parent < 0, parent, where.gather(1, parent.clamp(min=0)))
    depth = depth.gather(1, keep)
    token = ids.gather(2, rank.gather(1, keep)[:, None, :].expand(-1, rows, -1))  # [B, R, N]
    token = token.gather(1, (depth - 1)[:, None, :]).squeeze(1)
    return TreeBatch(token, parent, depth)


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, N + 1, N + 1] bool from parents [B, N]: row r (0 the root, i + 1 node i) sees column c iff c is r
    or one of its ancestors, the root included. Pointer doubling: log2(N) + 1 rounds of gathers."""
    batch, n = parents.shape
    device = parents.device
    up = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device), parents + 1], 1)  # root's parent: itself
    eye = torch.eye(n + 1, dtype=torch.bool, device=device).expand(batch, -1, -1)
    # (a comparison, not one_hot: one_hot reads its input's range back to the host, which a capture refuses)
    seen = eye | (up[:, :, None] == torch.arange(n + 1, device=device))
    hops = 1
    while hops < n + 1:
        seen = seen | torch.einsum("brc,bcd->brd", seen.float(), seen.float()).bool()  # two steps of reach
        hops *= 2
    return seen


def holds_nodes(rows: int, width: int, budget: int) -> bool:
    """Whether `rows` rows of `width` candidates hold at least `budget` rank paths (width + width² + ... ): a
    tree of that many nodes can be grown from them."""
    paths, level = 0, 1
    for _ in range(rows):
        level *= width
        paths += level
        if paths >= budget:
            return True
    return False


def tree_words(parents: torch.Tensor) -> torch.Tensor:
    """The block rows each row of B trees' verifies sees, [B, N + 1] int64 from parents [B, N] (N < 64): bit c
    of row r set iff r sees row c (row 0 the root), as `block_rows` gives them one tree at a time and the
    paged attention's `tree` words read them. Bit 63 is the sign bit: the sum wraps as the bits' OR."""
    seen = tree_ancestors(parents)
    if seen.shape[-1] > 64:
        raise InvalidRequest(f"a tree's words hold 64 rows, got {seen.shape[-1]}")
    bits = torch.ones((), dtype=torch.int64, device=parents.device) << torch.arange(
        seen.shape[-1], dtype=torch.int64, device=parents.device)
    return (seen.long() * bits).sum(-1)


def accept_trees(trees: TreeBatch, picks: torch.Tensor,
                 words: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of B trees at once: picks [B, N + 1] the target's argmax after the root, then after
    each node. Returns the accepted count [B] and the accepted nodes [B, N] by depth (-1 past the count); the
    emitted tokens are theirs, then picks at the last of them (or at the root). No host reads. `words`, the
    trees' `tree_words` where they are at hand, spare finding the ancestors again."""
    batch, n = trees.tokens.shape
    device = trees.tokens.device
    after_parent = picks.gather(1, trees.parents + 1)  # [B, N]
    match = trees.tokens == after_parent
    if words is None:
        seen = tree_ancestors(trees.parents)[:, 1:, 1:]  # node sees node
    else:
        seen = (words[:, 1:, None] >> torch.arange(1, n + 1, device=device)) & 1 == 1
    ok = ~(seen & ~match[:, None, :]).any(-1)  # every node on its path matched
    depth = torch.where(ok, trees.depths, 0)
    count, last = depth.max(-1)  # the deepest accepted (siblings differ, so one path)
    on_path = seen.gather(1, last[:, None, None].expand(-1, 1, n)).squeeze(1) & (count > 0)[:, None]
    slot = torch.where(on_path, trees.depths - 1, n)  # [B, N]: each path node's depth slot (n: none)
    nodes = torch.full((batch, n + 1), -1, dtype=torch.long, device=device)
    nodes.scatter_(1, slot, torch.arange(n, device=device).expand(batch, -1))
    return count, nodes[:, :n]
