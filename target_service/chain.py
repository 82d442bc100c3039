"""Chained speculative steps: in-process, the device one step ahead of the host.

A speculative step ends with a decision only the verify's outcome settles: how many drafts each
sequence accepted, hence where its next anchor lies and which token it is. Read back on the host,
that decision costs the device a gap per step (the wait, the host's accepts and commits, the next
propose's and verify's launches). A chained step makes it on the device instead: the accept
(`accept_greedy`, or speculative sampling), the next anchors and positions, the drafter's commit of the verified rows, and
the next step's propose and verify all read device tensors, so the engine queues step N+1 before it
reads step N's picks, and the device goes from one step to the next without waiting for the host.

What makes that exact: greedy picks do not depend on the drafts (a pick is the target's argmax after
the tokens before it, and the tokens a step accepts equal its picks); a sampled sequence's step is
speculative sampling on the device (`shared.verify.sample_accept`) from the uniforms a step-by-step
verify would draw, over the same drafts (the drafter's proposes read only committed positions); a
sequence without the drafter rides along, offering none; K/V rows past a sequence's accepted ones lie
at positions the next verify and the next propose overwrite before anything reads them; and the host's
own record of each sequence (its tokens, the KV blocks it holds, the drafter's next position) follows
one step behind, from what it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.shared.errors import StateConflict
from specsplit.shared.tree import TreeBatch, accept_trees
from specsplit.target_service.sequence import Sequence


def accept_greedy(drafts: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """Drafts [B, k] against the verify's greedy picks [B, k + 1] → accepted drafts per sequence [B]:
    the length of the longest prefix of drafts equal to the picks at the same places."""
    k = drafts.shape[1]
    return (drafts == picks[:, :k]).to(torch.int64).cumprod(dim=1).sum(dim=1)


def accept_tree_paths(trees: TreeBatch, picks: torch.Tensor,
                      words: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft trees [B, N] against the verify's greedy picks [B, N + 1] (after the root, then after each node) →
    each sequence's accepted count [B], its accepted nodes [B, N] by depth (-1 past the count) and what it
    emits [B, N + 1]: the path's tokens, then the pick after its last node, then padding. No host reads."""
    count, nodes = accept_trees(trees, picks, words)
    last = nodes.gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1)
    final = picks.gather(1, torch.where(count > 0, last + 1, 0)[:, None])  # [B, 1]: the bonus pick
    path = trees.tokens.gather(1, nodes.clamp(min=0))
    emitted = torch.cat([path, final], dim=1).scatter(1, count[:, None], final)
    return count, nodes, emitted


@dataclass(frozen=True)
class ChainedStep:
    """A chained step, launched; its outcome on its way to the host."""

    seqs: list[Sequence]
    num_drafts: int  # k: the drafts proposed and verified for every sequence, this step ...
    counts: list[int]  # ... and those each sequence offered (a sampled one near its end: fewer)
    anchors: torch.Tensor  # [B] on the device: each sequence's next anchor (its bonus pick) ...
    positions: torch.Tensor  # [B] ... and that anchor's position
    host: torch.Tensor  # pinned, flat: per sequence its k + 1 emitted tokens, then its accepted count ([B, k + 2] first)
    ready: torch.cuda.Event | None  # recorded after the copy to `host` (None: a CPU step, done)
    started: float  # perf_counter when the engine step that launched it began
    number: int  # this launch's number ...
    owners: list[int]  # ... and each host buffer's latest launch (shared with ChainBuffers)
    turn: int
    program: "ChainProgram | None" = None  # whose feed `anchors` and `positions` are

    def outcome(self) -> list[tuple[int, list[int]]]:
        """(accepted drafts, the tokens the sequence gains: its accepted drafts and the pick after them)
        per sequence, in order. Waits for this step alone; read it before the launch after next, which
        reuses its host buffer (refused after it)."""
        if self.owners[self.turn] != self.number:
            raise StateConflict(f"chained step {self.number}'s picks were overwritten by step "
                                f"{self.owners[self.turn]}: read each step before the one after next")
        if self.ready is not None:
            self.ready.synchronize()
        k = self.num_drafts
        rows = self.host[:len(self.seqs) * (k + 2)].view(-1, k + 2).tolist()
        return [(row[k + 1], row[:row[k + 1] + 1]) for row in rows]


class ChainBuffers:
    """Two pinned host buffers taken in turn: a chained step may be queued while the one before it is
    still unread, never more."""

    def __init__(self, max_batch: int, max_drafts: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        # Flat: the [B, k + 2] a step fills is their first B * (k + 2) elements, contiguous for every k (a
        # strided destination would make the copy go through an unpinned temporary, and wait for the device)
        self.host = [torch.zeros(max_batch * (max_drafts + 2), dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.ready = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self.turn, self.launches, self.owners = 0, 0, [0, 0]

    def launch(self, seqs: list[Sequence], num_drafts: int, counts: list[int], program: "ChainProgram",
               started: float) -> ChainedStep:
        """Queue the copy of a launched step's outcome (`program.outcome`) to the host."""
        turn = self.turn
        self.turn ^= 1
        host, ready = self.host[turn], self.ready[turn]
        host[:program.outcome.numel()].copy_(program.outcome, non_blocking=True)
        if ready is not None:
            ready.record()
        self.launches += 1
        self.owners[turn] = self.launches
        return ChainedStep(list(seqs), num_drafts, list(counts), program.feed[0], program.feed[1], host, ready,
                           started, self.launches, self.owners, turn, program)


class ChainProgram:
    """A chained step's device work for n sequences and k drafts, over buffers of its own: `feed` [2, n]
    (each sequence's anchor and that anchor's position), read at the step's start and rewritten at its
    end with the next step's, and `outcome` [n * (k + 2)] (per sequence its accepted drafts, the token
    after them, padding to k + 1, then its accepted count: what `ChainedStep.outcome` reads).

    Run uncaptured, a step costs the host some forty launches around the drafter's and the target's
    graphs, more than the device needs for the step at small batches. So once a shape has run (its
    kernels' first runs), a step whose sequences are all greedy and all drafting is captured whole
    (`graph`: the drafter's propose, the verify, the accept, the drafter's commit, the next feed) and
    every later one is a single replay. What the host must do per step stays outside: the cache's
    reservations, the block tables into the verify's and the drafter's buffers, the feed when the batch
    changed, the copy of `outcome` to the host."""

    def __init__(self, n: int, k: int, device: torch.device, tree: int = 0) -> None:
        self.n, self.k = n, k
        # A draft tree's step (`EngineConfig.draft_tree`): k nodes a sequence where a chain has k drafts, grown from
        # the drafter's first `tree` rows (0: a chain step); the same verify width, the same outcome (its accepted
        # path read as drafts accepted)
        self.tree = tree
        self.feed = torch.zeros((2, n), dtype=torch.int64, device=device)
        self.outcome = torch.zeros(n * (k + 2), dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.runs = 0  # uncaptured runs
        self.broken = False  # its capture failed once: not tried again
        # Through a drafter service (EngineConfig.chain_capture_remote) the graph holds what follows the
        # propose, a round trip: the drafts are its input, and the rows to commit and their positions (before
        # the feed moves on) are kept for the commit queued after it
        self.drafts = torch.zeros((n, k), dtype=torch.int64, device=device)
        self.committed_at = torch.zeros(n, dtype=torch.int64, device=device)
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None
        # ... and a tree step's input instead of drafts: the candidates' log-probabilities and ids [n, rows, keep]
        self.candidates: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def commit_width(self) -> int:
        """The rows a sequence's commit to the drafter holds: a chain's k + 1 verified; a tree's root and the
        deepest path its rows allow (a tree may have more nodes than the drafter has rows, never a longer path)."""
        return (min(self.k, self.tree) if self.tree else self.k) + 1

    def keep(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """A step's verified rows [n * commit_width, F] and their positions [n], for the commit after it (the
        positions copied: the feed moves on after this). Captured, the rows live in the pool every chained
        graph shares: valid until the next replay of any shape, so the commit must copy them at once, in
        stream order (`RemoteProposer.chain_commit` does)."""
        self.kept = rows, self.committed_at.copy_(positions)
