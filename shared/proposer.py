"""The proposer interface: the verbs the target speaks to a drafter, in-process or over gRPC.

Terms, defined once for the project:
- position: a token's index in its sequence (RoPE uses it). A *row* is one target hidden feature
  vector for one position; the drafter's context window holds rows stamped with their positions.
  After the window slides, a row's index in the window is no longer its position.
- feature row: what the drafter needs from the target for one token. For DFlash it is the
  concatenation of the outputs of the target layers `target_layer_ids` ([len(ids) * hidden]); for
  MTP it is the last layer's output before the final norm ([hidden]).
- block size γ: DFlash drafts γ-1 tokens per propose from a block [anchor, mask × (γ-1)].
- anchor / last token: the newest committed token, whose feature row is not known yet (the target
  computes it in the next verify); proposals continue from it.
- stash: a copy of one verify's feature rows ([k+1, feature_dim]) held per sequence until the
  target knows how many were accepted; `commit` then moves the first rows of the stash into the
  context. Splitting the two lets the drafter copy rows before acceptance is known.
- trim: drop speculative drafter state past the accepted drafts (the seeds' `after_verify`).
- catch-up: rows the target decoded without speculation (serial decode), appended directly, so the
  context window has no holes.

Per step, for a sequence whose verify fed [x_L, d_1..d_k] at positions L..L+k and accepted a drafts:
`stash(rows[0:k+1])`, `commit(a+1, base_pos=L, token_ids=[x_L, d_1..d_a])`, `trim(a)`, then
`propose(last_token=bonus, position=L+a+1)`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from specsplit.shared.drafter_kind import DrafterKind  # also imported from here by both services
from specsplit.shared.errors import InvalidRequest


class FeatureKind(str, enum.Enum):
    """Which target rows a drafter consumes."""

    LAYER_CONCAT = "layer_concat"  # outputs of target_layer_ids, concatenated (DFlash)
    LAST_HIDDEN = "last_hidden"  # last layer output before the final norm (MTP)


@dataclass(frozen=True)
class DrafterSpec:
    """What a drafter is and what it needs from the target (served by `Describe`)."""

    kind: DrafterKind
    feature: FeatureKind
    feature_dim: int  # width of one feature row
    hidden_size: int  # the target's hidden size
    vocab_size: int  # the target's vocabulary (draft ids are mapped into it)
    max_drafts: int  # most drafts one propose returns (γ-1 for DFlash)
    block_size: int = 0  # γ for DFlash, 0 otherwise
    target_layer_ids: tuple[int, ...] = ()
    max_batch: int = 64  # widest batched propose
    window: int = 4096  # context rows kept per sequence (DFlash slide window); 0 = all rows (MTP)

    def __post_init__(self) -> None:
        if self.feature_dim <= 0 or self.max_drafts <= 0 or self.max_batch <= 0:
            raise InvalidRequest("feature_dim, max_drafts and max_batch must be positive")


def bitmask_words(vocab_size: int) -> int:
    """int32 words in an allowed-token bitmask: bit t of word t // 32 is set when token t is allowed."""
    return (vocab_size + 31) // 32


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[words] int32 → [vocab_size] bool of allowed tokens."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 1 or bitmask.numel() != bitmask_words(vocab_size):
        raise InvalidRequest(
            f"bitmask must be {bitmask_words(vocab_size)} int32 words for a {vocab_size}-token vocabulary"
        )
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = (bitmask[:, None] >> bits[None, :]) & 1
    return allowed.reshape(-1)[:vocab_size].bool()


def bool_to_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[vocab_size] bool → [words] int32 (the inverse of `bitmask_to_bool`)."""
    vocab = allowed.numel()
    padded = torch.zeros(bitmask_words(vocab) * 32, dtype=torch.int64)
    padded[:vocab] = allowed.to(torch.int64).cpu()
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    words = (padded.view(-1, 32) * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@dataclass
class ProposeRequest:
    """One sequence's part of a batched propose."""

    seq_id: int
    last_token: int  # the anchor: newest committed token, its row not yet in the context
    position: int  # position of last_token
    num_drafts: int  # ≤ spec.max_drafts
    bitmask: torch.Tensor | None = None  # [ceil(vocab/32)] int32 allowed-token mask, or None
    want_confidence: bool = False  # return each draft's top-1 log-probability


@dataclass
class Proposal:
    tokens: list[int]  # draft token ids in the target vocabulary, len == num_drafts
    confidence: list[float] | None = None  # top-1 log-probability of each draft
    # [num_drafts, vocab] draft distribution when drafts were sampled (None: one-hot drafts).
    probs: torch.Tensor | None = None


@dataclass
class CarriedKV:
    """A sequence's drafter state moved out for reuse on the next turn (see take_kv)."""

    handle: int  # drafter-side id
    rows: int  # context rows held
    last_position: int  # position of the newest row, -1 when empty


@runtime_checkable
class Proposer(Protocol):
    """A drafter, seen from the target. Every method may raise `shared.errors` exceptions."""

    spec: DrafterSpec

    def alloc(self, seq_id: int, budget_tokens: int) -> None:
        """Create state for `seq_id`, sized for `budget_tokens` (prompt + max new tokens)."""

    def prefill(self, seq_id: int, token_ids: Sequence[int], rows: torch.Tensor, start_pos: int = 0) -> int:
        """Append prompt rows [P, feature_dim] at positions start_pos..; token_ids are the tokens at
        those positions. start_pos > 0 continues an installed carried KV. Returns rows appended."""

    def stash(self, seq_id: int, rows: torch.Tensor) -> None:
        """Hold one verify's feature rows [k+1, feature_dim] until `commit`."""

    def commit(self, seq_id: int, num_rows: int, base_pos: int, token_ids: Sequence[int]) -> None:
        """Append stash[:num_rows] to the context stamped base_pos.., sliding the window if full."""

    def trim(self, seq_id: int, num_accepted: int) -> None:
        """After a verify that accepted `num_accepted` drafts, drop speculative drafter state."""

    def catchup(self, seq_id: int, token_ids: Sequence[int], rows: torch.Tensor, base_pos: int) -> int:
        """Append rows decoded without speculation directly (no stash). Returns rows appended."""

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        """Draft for several sequences at once (one forward when the batch fits `spec.max_batch`)."""

    def free(self, seq_id: int) -> None:
        """Release all state of `seq_id`. Freeing an unknown id raises UnknownSequence."""

    def take_kv(self, seq_id: int) -> CarriedKV:
        """Move the sequence's context/drafter KV out; the sequence then behaves as freshly allocated."""

    def install_kv(self, seq_id: int, handle: int) -> CarriedKV:
        """Install carried state into a freshly allocated sequence; the handle is consumed."""

    def free_kv(self, handle: int) -> None:
        """Release carried state no sequence owns."""

