"""A DFlash drafter's blocks verified as draft trees (`shared.tree`): teacher-forced walks and real decoding.

The reference for tree verification, before any cached or graphed path: `decode` runs greedy speculative decoding
one sequence at a time, the target recomputing the whole sequence and the tree each step (`dense.tree_forward`; or
through its paged cache, `paged=True`), the drafter's block over the target's rows of every emitted token before the
anchor (`training.dflash_block_hidden`, the training forward that `evaluate`'s alignment tests hold equal to the
served drafter's). `walk` scores the same trees teacher-forced over the target's greedy continuations: the steps
decoding would take, each next anchor one past the last accepted node. The two agree step for step when drafting and
verification agree on what each sees; its output equals the target's greedy output whatever the tree holds.

A `TreePolicy` turns a block's rows into a tree: the `budget` best rank paths (`best_first`), or a fixed set
of them (`paths`: a static tree, the shape a captured verify can keep), e.g. the paths the true tokens took
most often over training-side continuations (`frequent_paths`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specsplit.drafter_service.base import DraftVocab
from specsplit.drafter_service.dflash import DFlashModel
from specsplit.drafter_service.heads import TargetHead
from specsplit.drafter_service.tree_scores import PAST_END, TreeScores
from specsplit.drafter_service.training import dflash_block_hidden
from specsplit.evaluate import walk_steps
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.tree import DraftTree, accept_greedy, best_first, from_paths, matched
from specsplit.target_service.dense import capture_features, tree_forward
from specsplit.target_service.model import CaptureSpec, ForwardBatch, TargetModel


@dataclass(frozen=True)
class TreePolicy:
    budget: int  # nodes a step (draft tokens verified); best first when `paths` is None
    paths: tuple[tuple[int, ...], ...] | None = None  # a static tree's rank paths
    keep: int = 32  # candidates a row that best-first trees choose among
    name: str = ""  # how reports call it; by default "tree N" or "static N"
    scores: TreeScores | None = None  # best-first trees: the candidates scored so (a drafter's `tree_scores`)

    def __post_init__(self) -> None:
        if self.budget < 1 or self.keep < 1:
            raise InvalidRequest(f"a tree policy needs a budget and candidates, got {self.budget} and {self.keep}")
        if self.paths is not None and len(set(self.paths)) > self.budget:
            raise InvalidRequest(f"{len(set(self.paths))} rank paths exceed the budget of {self.budget}")

    @property
    def width(self) -> int:
        """Candidates a row must offer."""
        return self.keep if self.paths is None else 1 + max((max(p) for p in self.paths if p), default=0)

    def tree(self, logp: torch.Tensor, ids: torch.Tensor) -> DraftTree:
        """logp, ids [γ-1, K]: each block row's candidates best first."""
        if self.paths is not None:
            return from_paths(self.paths, ids.tolist())
        if self.scores is not None:
            logp = self.scores.apply(logp)
        return best_first(logp.tolist(), ids.tolist(), self.budget)

    def __str__(self) -> str:
        return self.name or f"{'static' if self.paths is not None else 'tree'} {self.budget}" \
            + (" scored" if self.scores is not None and self.paths is None else "")


def chain_policy(drafts: int) -> TreePolicy:
    """Today's verify as a tree: the best token of each of the first `drafts` rows."""
    return TreePolicy(budget=drafts, paths=tuple((0,) * d for d in range(1, drafts + 1)), name=f"chain {drafts}")


@torch.no_grad()
def candidates(drafter: DFlashModel, head: TargetHead, rows: torch.Tensor, tokens: torch.Tensor,
               anchors: Sequence[int], keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per anchor of one sequence (tokens [S], the target's rows [S, feature_dim], those at and after an anchor
    unread): its block rows' `keep` best log-probabilities and their target token ids, [N, γ-1, keep] each."""
    vocab = DraftVocab(drafter.d2t, head.vocab_size)
    positions = torch.arange(tokens.shape[0], device=tokens.device)[None]
    valid = torch.ones_like(positions, dtype=torch.bool)
    index = torch.tensor(list(anchors), dtype=torch.long, device=tokens.device)[None]
    hidden = dflash_block_hidden(drafter, head, rows[None], tokens[None], positions, valid, index)[0]
    logp = torch.log_softmax(drafter.logits(hidden[:, 1:], head).float(), -1)
    top, ids = logp.topk(min(keep, logp.shape[-1]), -1)
    return top, vocab.to_target(ids)


@dataclass
class Decoded:
    tokens: list[int]  # generated, the prefill's first
    steps: int  # verify steps (the prefill not counted)


@torch.no_grad()
def decode(target: TargetModel, drafter: DFlashModel, head: TargetHead, prompt: Sequence[int], max_new: int,
           policy: TreePolicy, eos_ids: Sequence[int] = (), *, paged: bool = False) -> Decoded:
    """Greedy speculative decoding of one prompt with draft trees. The reference recomputes the context and
    the tree each step (`dense.tree_forward`, no cache); `paged` verifies each tree in one forward through the
    target's paged KV cache (`ForwardBatch.trees`), then moves the accepted path's k/v to the positions its
    tokens take (`PagedKVCache.move`) and drops the rest. The two agree token for token and step for step."""
    if not prompt or max_new < 1:
        raise InvalidRequest("decode takes a prompt and at least one new token")
    capture = CaptureSpec(layer_ids=drafter.cfg.target_layer_ids)
    device = target.embed_weight.device
    step, settle = _paged_steps(target, capture, len(prompt) + max_new + policy.budget + 1) if paged else \
        (lambda seq, tree: _dense_step(target, capture, seq, tree), None)
    logits, rows = step(list(prompt), None)  # the prefill: the first token, the prompt's rows
    seq, steps, eos = list(prompt) + [int(logits[-1].argmax())], 0, set(eos_ids)
    while len(seq) - len(prompt) < max_new and not eos.intersection(seq[len(prompt):]):
        root = len(seq) - 1  # the last emitted token: no row yet
        padded = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        logp, ids = candidates(drafter, head, padded, torch.tensor(seq, device=device), [root], policy.width)
        tree = policy.tree(logp[0], ids[0])
        logits, block = step(seq, tree)  # [N + 1] rows each: the root's, then the nodes'
        accepted, emitted = accept_greedy(tree, logits.argmax(-1).tolist())
        if settle is not None:
            settle(root, accepted)
        rows = torch.cat([rows, block[torch.tensor([0] + [1 + i for i in accepted], device=device)]])
        seq += emitted
        steps += 1
    return Decoded(_cut(seq[len(prompt):], max_new, eos), steps)


def _dense_step(target: TargetModel, capture: CaptureSpec, seq: list[int],
                tree: DraftTree | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill's (tree None: the last row's logits, every row) or a verify's logits and rows, recomputed."""
    out = tree_forward(target, seq, tree or DraftTree((), ()), capture)
    return out.logits, out.features if tree is None else out.features[len(seq) - 1:]


def _paged_steps(target: TargetModel, capture: CaptureSpec, most: int):
    """`decode`'s step and settle through a paged KV cache of room for `most` positions."""
    device = target.embed_weight.device
    cache = target.new_cache(num_blocks=most // 16 + 2)
    cache.allocate(0)

    def step(seq: list[int], tree: DraftTree | None) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, first = (seq, 0) if tree is None else ([seq[-1], *tree.tokens], len(seq) - 1)
        batch = ForwardBatch(torch.tensor(tokens, device=device), torch.arange(first, first + len(tokens)),
                             torch.tensor([0, len(tokens)]), [0], trees=None if tree is None else [tree.parents],
                             logits_index=torch.tensor([len(tokens) - 1]) if tree is None else None)
        out = target(batch, cache, capture)
        return out.logits, out.layer_features

    def settle(root: int, accepted: list[int]) -> None:
        cache.move(0, [root + 1 + i for i in accepted], [root + 1 + d for d in range(len(accepted))])
        cache.truncate(0, root + 1 + len(accepted))

    return step, settle


def _cut(new: list[int], max_new: int, eos: set[int]) -> list[int]:
    """The generated tokens up to `max_new` and the first end-of-sequence token."""
    new = new[:max_new]
    for i, token in enumerate(new):
        if token in eos:
            return new[:i + 1]
    return new


@torch.no_grad()
def walk(target: TargetModel, drafter: DFlashModel, head: TargetHead, prompt: Sequence[int],
         continuation: Sequence[int], policies: Sequence[TreePolicy]) -> list[int]:
    """Teacher forcing: per policy, the verify steps greedy decoding with its trees takes over `continuation`
    (the target's greedy output for `prompt`, its first token the prefill's)."""
    seq = list(prompt) + list(continuation)
    device = target.embed_weight.device
    tokens = torch.tensor(seq, device=device)
    rows = capture_features(target, tokens[None], torch.tensor([len(seq)], device=device),
                            CaptureSpec(layer_ids=drafter.cfg.target_layer_ids))[0]
    anchors = list(range(len(prompt), len(seq) - 1))
    matches: list[list[int]] = [[] for _ in policies]
    keep = max(p.width for p in policies)
    for start in range(0, len(anchors), 64):
        part = anchors[start:start + 64]
        logp, ids = candidates(drafter, head, rows, tokens, part, keep)
        for n, anchor in enumerate(part):
            ahead = seq[anchor + 1:]
            for m, policy in zip(matches, policies):
                m.append(matched(policy.tree(logp[n, :, :policy.width], ids[n, :, :policy.width]), ahead))
    return [walk_steps(m, drafter.cfg.block_size - 1) for m in matches]


def frequent_paths(ranks: Sequence[Sequence[int]], budget: int) -> tuple[tuple[int, ...], ...]:
    """The `budget` rank paths the true tokens took most often: `ranks[n][j]` the true token's rank in row j of
    anchor n's block (-1: not among the candidates). A step accepts as many tokens as the tree holds prefixes
    of the true path, so a static tree's mean accepted is the sum of its paths' frequencies; a path is never
    more frequent than its prefix, so the most frequent form a tree."""
    counts: Counter[tuple[int, ...]] = Counter()
    for row in ranks:
        path: tuple[int, ...] = ()
        for rank in row:
            if rank < 0:
                break
            path += (int(rank),)
            counts[path] += 1
    return tuple(sorted(counts, key=lambda p: (-counts[p], len(p), p))[:budget])


def true_ranks(ids: torch.Tensor, continuation: Sequence[int]) -> list[int]:
    """Row j's rank of continuation[j] among ids [γ-1, K]: -1 where it is not there, -2 past the continuation's end
    (no token to miss: a fit leaves it out)."""
    out = []
    for j in range(ids.shape[0]):
        if j >= len(continuation):
            out.append(PAST_END)
            continue
        hit = (ids[j] == continuation[j]).nonzero()
        out.append(int(hit[0]) if len(hit) else -1)
    return out
