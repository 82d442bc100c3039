"""An oracle drafter for tests: proposes the target's own greedy continuation, with injected mistakes.

It wraps a real drafter and delegates every state verb to it, so stash/commit/trim and the DFlash
context-window slide run for real while the drafts come from the oracle: long accepted runs,
partial accepts and full rejections are all hit, deterministically.
"""

from __future__ import annotations

import random
from typing import Sequence

from specsplit.shared.proposer import Proposal, ProposeRequest, Proposer


class OracleDrafter:
    def __init__(self, inner: Proposer, continuations: dict[tuple[int, ...], list[int]],
                 mistake_rate: float = 0.2, seed: int = 0) -> None:
        self.inner = inner
        self.spec = inner.spec
        self.continuations = continuations  # prompt ids -> the target's full greedy token list
        self.mistake_rate = mistake_rate
        self.seed = seed
        self.truth: dict[int, list[int]] = {}
        self.proposed = 0

    def alloc(self, seq_id: int, budget_tokens: int) -> None:
        self.inner.alloc(seq_id, budget_tokens)

    def prefill(self, seq_id, token_ids, rows, start_pos=0):
        self.truth[seq_id] = self.continuations.get(tuple(token_ids), [])
        return self.inner.prefill(seq_id, token_ids, rows, start_pos)

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        real = self.inner.propose(requests)  # keeps the inner drafter's code path exercised
        return [self._oracle(r, p) for r, p in zip(requests, real)]

    def _oracle(self, request: ProposeRequest, real: Proposal) -> Proposal:
        truth = self.truth.get(request.seq_id, [])
        rng = random.Random(hash((self.seed, request.seq_id, request.position)))
        tokens = []
        for i in range(request.num_drafts):
            pos = request.position + 1 + i
            token = truth[pos] if pos < len(truth) else real.tokens[i]
            if rng.random() < self.mistake_rate:
                token = (token + 1 + rng.randrange(50)) % self.spec.vocab_size
            tokens.append(token)
        self.proposed += len(tokens)
        return Proposal(tokens=tokens)

    def __getattr__(self, name):  # stash, commit, trim, catchup, free, take/install/free_kv
        return getattr(self.inner, name)


class DeviceOracle(OracleDrafter):
    """The oracle's drafts handed over as an in-process drafter hands them over on a GPU: a device
    tensor [B, max_drafts] whose rows run past each request's num_drafts with junk the engine must not
    read (here: vocab - 1). `device_steps` counts the proposes that went this way."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.device_steps = 0

    def propose_on_device(self, requests: Sequence[ProposeRequest]):
        import torch

        rows = [p.tokens + [self.spec.vocab_size - 1] * (self.spec.max_drafts - len(p.tokens))
                for p in self.propose(requests)]
        self.device_steps += 1
        return torch.tensor(rows, dtype=torch.int64)
