"""Conversion between the specsplit.v1 protobuf messages and domain objects; nothing else here.

Besides the servers and clients, this module and shared.generation (TargetService's messages,
torch-free for the Python client; re-exported here) are the only ones that import the generated stubs.
Every `*_from_proto` validates what arrived and raises InvalidRequest for malformed input.

The per-step message pieces live here as protobuf-free dataclasses (`SeqStep`, `StepBatch`,
`StepResult`, `SeqError`) because they are the wire's shape of a step: the drafter applies a
`StepBatch` through the Proposer verbs, in the fixed order catchup, stash, commit, trim, free for
each sequence, then the batch's proposes. The unary Stash/Commit/Trim/Catchup/FreeState requests
convert to a one-sequence `SeqStep`, so both paths share one applier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import torch

from specsplit.protos.v1 import common_pb2, drafter_pb2
from specsplit.shared.errors import (
    AlreadyExists,
    CapacityExceeded,
    DrafterUnavailable,
    InvalidRequest,
    SpecsplitError,
    StateConflict,
    Unauthenticated,
    UnknownSequence,
)
from specsplit.shared.generation import (  # noqa: F401 (re-exported: wire converts every message)
    DRAFTER_KINDS as _DRAFTER_KIND,
    FINISH_REASONS,
    GenerateCall,
    GenerateChunk,
    GenerationStats,
    TargetDescription,
    chunk_from_proto,
    chunk_to_proto,
    generate_from_proto,
    generate_to_proto,
    sampling_from_proto,
    sampling_to_proto,
    target_description_from_proto,
    target_description_to_proto,
)
from specsplit.shared.generation import check_token_ids as _tokens
from specsplit.shared.generation import enum_from_proto as _from_proto
from specsplit.shared.proposer import CarriedKV, DrafterKind, DrafterSpec, FeatureKind, Proposal, ProposeRequest
from specsplit.shared.tree import MAX_TREE_KEEP
from specsplit.shared.transport import (
    BufferDescriptor,
    BufferKind,
    BufferRole,
    InlineRows,
    RowRef,
    RowSource,
    decode_inline,
    encode_inline,
)

_DTYPE = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
    torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.int32: common_pb2.DTYPE_INT32,  # a drafts buffer's ids (rows refuse it: shared.transport)
}
_FEATURE = {
    FeatureKind.LAYER_CONCAT: common_pb2.FEATURE_KIND_LAYER_CONCAT,
    FeatureKind.LAST_HIDDEN: common_pb2.FEATURE_KIND_LAST_HIDDEN,
}
_BUFFER_KIND = {BufferKind.SHM: common_pb2.BUFFER_KIND_SHM, BufferKind.CUDA_IPC: common_pb2.BUFFER_KIND_CUDA_IPC,
                BufferKind.HOST_PAGE: common_pb2.BUFFER_KIND_HOST_PAGE}
_ROLE = {
    BufferRole.ROWS: common_pb2.BUFFER_ROLE_ROWS,
    BufferRole.TARGET_EMBEDDING: common_pb2.BUFFER_ROLE_TARGET_EMBEDDING,
    BufferRole.TARGET_LM_HEAD: common_pb2.BUFFER_ROLE_TARGET_LM_HEAD,
    BufferRole.DRAFTS: common_pb2.BUFFER_ROLE_DRAFTS,
    BufferRole.FEED: common_pb2.BUFFER_ROLE_FEED,
    BufferRole.DONE: common_pb2.BUFFER_ROLE_DONE,
}
_STATUS_BY_NUMBER = {code.value[0]: code.name for code in grpc.StatusCode}
# The inverse of shared.errors' grpc_code, for clients; FAILED_PRECONDITION from a running drafter is
# a state conflict (a checkpoint error would have stopped it from starting).
_ERROR_BY_STATUS: dict[str, type[SpecsplitError]] = {
    "INVALID_ARGUMENT": InvalidRequest,
    "NOT_FOUND": UnknownSequence,
    "FAILED_PRECONDITION": StateConflict,
    "ALREADY_EXISTS": AlreadyExists,
    "RESOURCE_EXHAUSTED": CapacityExceeded,
    "UNAUTHENTICATED": Unauthenticated,
}


def error_from_status(code: str, message: str) -> SpecsplitError:
    """The domain error a client raises for a status code; codes without one mean the peer failed."""
    return _ERROR_BY_STATUS.get(code, DrafterUnavailable)(message)


def _nonneg(what: str, value: int) -> int:
    if value < 0:
        raise InvalidRequest(f"{what} must be >= 0, got {value}")
    return value


# --- rows and buffers --------------------------------------------------------------------------


def inline_to_proto(inline: InlineRows) -> common_pb2.InlineRows:
    return common_pb2.InlineRows(data=inline.data, dtype=_DTYPE[inline.dtype], rows=inline.rows, cols=inline.cols)


def inline_from_proto(pb: common_pb2.InlineRows) -> InlineRows:
    return InlineRows(pb.data, _from_proto(_DTYPE, pb.dtype, "dtype"), pb.rows, pb.cols)


def rows_to_proto(source: RowSource) -> common_pb2.RowRef:
    if isinstance(source, InlineRows):
        return common_pb2.RowRef(inline=inline_to_proto(source))
    return common_pb2.RowRef(
        buffer_id=source.buffer_id, row_offset=source.row_offset, rows=source.rows, generation=source.generation
    )


def rows_from_proto(pb: common_pb2.RowRef) -> RowSource:
    if pb.HasField("inline"):
        return inline_from_proto(pb.inline)
    return RowRef(pb.buffer_id, pb.row_offset, pb.rows, pb.generation)


def _required_rows(pb, name: str = "rows") -> RowSource:
    if not pb.HasField(name):
        raise InvalidRequest(f"{type(pb).__name__}.{name} is missing")
    return rows_from_proto(getattr(pb, name))


def descriptor_to_proto(d: BufferDescriptor) -> common_pb2.BufferDescriptor:
    return common_pb2.BufferDescriptor(
        buffer_id=d.buffer_id,
        kind=_BUFFER_KIND[d.kind],
        name=d.name,
        mem_handle=d.mem_handle,
        dtype=_DTYPE[d.dtype],
        rows=d.rows,
        cols=d.cols,
        device_uuid=d.device_uuid,
        host_id=d.host_id,
        event_handle=d.event_handle,
        role=_ROLE[d.role],
        token=d.token,
    )


def descriptor_from_proto(pb: common_pb2.BufferDescriptor) -> BufferDescriptor:
    return BufferDescriptor(
        buffer_id=pb.buffer_id,
        kind=_from_proto(_BUFFER_KIND, pb.kind, "buffer kind"),
        name=pb.name,
        dtype=_from_proto(_DTYPE, pb.dtype, "dtype"),
        rows=pb.rows,
        cols=pb.cols,
        host_id=pb.host_id,
        device_uuid=pb.device_uuid,
        mem_handle=pb.mem_handle,
        event_handle=pb.event_handle,
        role=_from_proto(_ROLE, pb.role, "buffer role"),
        token=pb.token,
    )


def bitmask_to_proto(bitmask: torch.Tensor) -> common_pb2.Bitmask:
    """[words] int32 → Bitmask (little-endian bytes)."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 1 or bitmask.numel() == 0:
        raise InvalidRequest(f"a bitmask is a non-empty 1-D int32 tensor, got {bitmask.dtype} {tuple(bitmask.shape)}")
    return common_pb2.Bitmask(words=bitmask.detach().contiguous().cpu().numpy().astype("<i4").tobytes())


def bitmask_from_proto(pb: common_pb2.Bitmask) -> torch.Tensor:
    """Bitmask → [words] int32 on the host (the proposer checks its length against the vocabulary)."""
    if not pb.words or len(pb.words) % 4:
        raise InvalidRequest(f"a bitmask is a non-empty whole number of 4-byte words, got {len(pb.words)} bytes")
    return torch.frombuffer(bytearray(pb.words), dtype=torch.int32)


# --- sampling ----------------------------------------------------------------------------------


# --- drafter description and carried KV --------------------------------------------------------


@dataclass(frozen=True)
class DrafterDescription:
    """DrafterService.Describe: the drafter's spec plus where it runs (to choose the row transport)."""

    spec: DrafterSpec
    host_id: str = ""  # shared.transport.host_id() of the drafter process
    device_uuid: str = ""  # the drafter's GPU, empty on the CPU
    needs_target_head: bool = False  # wants the target's embedding and LM head as buffers
    step_columns: bool = False  # reads a StepRequest's columns (an older drafter would skip them)
    step_socket: str = ""  # a unix socket carrying the Step stream without gRPC (shared.frames)
    drafts_buffer: bool = False  # takes a DRAFTS buffer (StepRequest.drafts_buffer)
    instance: str = ""  # this drafter process (a target sends it back with its calls)
    chains: bool = False  # serves chained steps (StepRequest.chain)
    done_flags: bool = False  # writes a chained step's done value into a DONE buffer (ChainStep.done_value)
    written_flags: bool = False  # its stream may wait on the device for ChainStep.written_value
    prefill_allocs: bool = False  # PrefillDrafter allocates the sequence when asked (alloc_budget_tokens)
    host_flags: bool = False  # takes its DONE buffer in a host page passed with the Step socket hello
    tree_keep: int = 0  # the candidates a row a chained propose may ask for (ChainStep.tree_keep; 0: none)
    step_attach: bool = False  # a SeqStep may allocate its sequence (SeqStep.alloc: an attach on the stream)


def description_to_proto(d: DrafterDescription) -> drafter_pb2.DrafterDescription:
    s = d.spec
    return drafter_pb2.DrafterDescription(
        kind=_DRAFTER_KIND[DrafterKind(s.kind)],
        block_size=s.block_size,
        max_drafts=s.max_drafts,
        target_layer_ids=s.target_layer_ids,
        feature=_FEATURE[FeatureKind(s.feature)],
        feature_dim=s.feature_dim,
        hidden_size=s.hidden_size,
        vocab_size=s.vocab_size,
        max_batch=s.max_batch,
        window=s.window,
        needs_target_head=d.needs_target_head,
        host_id=d.host_id,
        device_uuid=d.device_uuid,
        step_columns=d.step_columns,
        step_socket=d.step_socket,
        drafts_buffer=d.drafts_buffer,
        instance=d.instance,
        chains=d.chains,
        done_flags=d.done_flags,
        written_flags=d.written_flags,
        prefill_allocs=d.prefill_allocs,
        host_flags=d.host_flags,
        tree_keep=d.tree_keep,
        step_attach=d.step_attach,
    )


def description_from_proto(pb: drafter_pb2.DrafterDescription) -> DrafterDescription:
    if pb.hidden_size <= 0 or pb.vocab_size <= 0 or pb.window < 0:
        raise InvalidRequest("drafter description needs positive hidden_size and vocab_size, window >= 0")
    if not 0 <= pb.tree_keep <= min(MAX_TREE_KEEP, pb.vocab_size):
        raise InvalidRequest(f"drafter description's tree_keep is 0..{MAX_TREE_KEEP}, at most its vocabulary")
    spec = DrafterSpec(
        kind=_from_proto(_DRAFTER_KIND, pb.kind, "drafter kind"),
        feature=_from_proto(_FEATURE, pb.feature, "feature kind"),
        feature_dim=pb.feature_dim,
        hidden_size=pb.hidden_size,
        vocab_size=pb.vocab_size,
        max_drafts=pb.max_drafts,
        block_size=_nonneg("block_size", pb.block_size),
        target_layer_ids=tuple(_nonneg("target layer id", i) for i in pb.target_layer_ids),
        max_batch=pb.max_batch,
        window=pb.window,
    )
    return DrafterDescription(spec, pb.host_id, pb.device_uuid, pb.needs_target_head, pb.step_columns,
                              pb.step_socket, pb.drafts_buffer, pb.instance, pb.chains, pb.done_flags,
                              pb.written_flags, pb.prefill_allocs, pb.host_flags, pb.tree_keep, pb.step_attach)


def carried_kv_to_proto(kv: CarriedKV) -> drafter_pb2.CarriedKV:
    return drafter_pb2.CarriedKV(handle=kv.handle, rows=kv.rows, last_position=kv.last_position)


def carried_kv_from_proto(pb: drafter_pb2.CarriedKV) -> CarriedKV:
    if pb.rows < 0 or pb.last_position < -1:
        raise InvalidRequest(f"carried KV needs rows >= 0 and last_position >= -1, got {pb.rows}, {pb.last_position}")
    return CarriedKV(handle=pb.handle, rows=pb.rows, last_position=pb.last_position)


# --- propose -----------------------------------------------------------------------------------


def propose_item_to_proto(r: ProposeRequest) -> drafter_pb2.ProposeItem:
    pb = drafter_pb2.ProposeItem(
        seq_id=r.seq_id,
        last_token=r.last_token,
        position=r.position,
        num_drafts=r.num_drafts,
        want_confidence=r.want_confidence,
    )
    if r.bitmask is not None:
        pb.bitmask.CopyFrom(bitmask_to_proto(r.bitmask))
    return pb


def propose_item_from_proto(pb: drafter_pb2.ProposeItem) -> ProposeRequest:
    if pb.num_drafts <= 0:
        raise InvalidRequest(f"sequence {pb.seq_id}: num_drafts must be >= 1, got {pb.num_drafts}")
    return ProposeRequest(
        seq_id=_nonneg("seq_id", pb.seq_id),
        last_token=_nonneg("last_token", pb.last_token),
        position=_nonneg("position", pb.position),
        num_drafts=pb.num_drafts,
        bitmask=bitmask_from_proto(pb.bitmask) if pb.HasField("bitmask") else None,
        want_confidence=pb.want_confidence,
    )


def proposal_to_proto(seq_id: int, p: Proposal) -> drafter_pb2.Proposal:
    probs = inline_to_proto(encode_inline(p.probs)) if p.probs is not None else None
    return drafter_pb2.Proposal(seq_id=seq_id, tokens=p.tokens, confidence=p.confidence or (), probs=probs)


def proposal_from_proto(pb: drafter_pb2.Proposal) -> tuple[int, Proposal]:
    """→ (seq_id, Proposal); probs are decoded onto the host."""
    tokens = list(_tokens("proposal", pb.tokens))
    if pb.confidence and len(pb.confidence) != len(tokens):
        raise InvalidRequest(f"proposal for {pb.seq_id}: {len(pb.confidence)} confidences for {len(tokens)} drafts")
    probs = decode_inline(inline_from_proto(pb.probs)) if pb.HasField("probs") else None
    if probs is not None and probs.shape[0] != len(tokens):
        raise InvalidRequest(f"proposal for {pb.seq_id}: probs have {probs.shape[0]} rows for {len(tokens)} drafts")
    return pb.seq_id, Proposal(tokens=tokens, confidence=list(pb.confidence) or None, probs=probs)


def propose_to_proto(requests: Sequence[ProposeRequest]) -> drafter_pb2.ProposeRequest:
    return drafter_pb2.ProposeRequest(items=[propose_item_to_proto(r) for r in requests])


def propose_from_proto(pb: drafter_pb2.ProposeRequest) -> list[ProposeRequest]:
    return [propose_item_from_proto(item) for item in pb.items]


def proposals_to_proto(
    requests: Sequence[ProposeRequest], proposals: Sequence[Proposal]
) -> drafter_pb2.ProposeResponse:
    return drafter_pb2.ProposeResponse(
        proposals=[proposal_to_proto(r.seq_id, p) for r, p in zip(requests, proposals, strict=True)]
    )


def proposals_from_proto(pb: drafter_pb2.ProposeResponse) -> list[Proposal]:
    return [proposal_from_proto(p)[1] for p in pb.proposals]


# --- per-sequence operations (the Step stream and their unary twins) ---------------------------


@dataclass(frozen=True)
class CommitOp:
    """Move stash[:num_rows] into the context at base_pos.. (Proposer.commit)."""

    num_rows: int
    base_pos: int
    token_ids: tuple[int, ...]  # [num_rows]

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", _tokens("commit", self.token_ids))
        if self.num_rows <= 0 or self.base_pos < 0 or len(self.token_ids) != self.num_rows:
            raise InvalidRequest(
                f"commit needs num_rows >= 1 token ids and base_pos >= 0, got {self.num_rows} rows, "
                f"{len(self.token_ids)} ids, base_pos {self.base_pos}"
            )


@dataclass(frozen=True)
class RowsOp:
    """Rows with their tokens at base_pos.. (Proposer.catchup; also the prefill of a prompt)."""

    token_ids: tuple[int, ...]  # [rows]
    rows: RowSource  # [len(token_ids), feature_dim]
    base_pos: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", _tokens("rows", self.token_ids))
        if not self.token_ids or self.rows.rows != len(self.token_ids) or self.base_pos < 0:
            raise InvalidRequest(
                f"{len(self.token_ids)} token ids need as many rows (got {self.rows.rows}) and base_pos >= 0 "
                f"(got {self.base_pos})"
            )


@dataclass(frozen=True)
class SeqStep:
    """One sequence's operations in a step, applied as alloc, catchup, stash, commit, trim, free."""

    seq_id: int
    catchup: RowsOp | None = None
    stash: RowSource | None = None  # [k+1, feature_dim] verify rows
    commit: CommitOp | None = None
    trim: int | None = None  # drafts the verify accepted
    free: bool = False
    alloc: int | None = None  # allocate the sequence first with this budget (DrafterDescription.step_attach)

    def __post_init__(self) -> None:
        _nonneg("seq_id", self.seq_id)
        if self.trim is not None:
            _nonneg("trim", self.trim)
        if self.alloc is not None:
            _budget(self.seq_id, self.alloc)


@dataclass(frozen=True)
class VerifiedColumns:
    """A step's verified sequences as they came in StepRequest.verified, every entry already checked
    (step_from_proto): each one verify's stash of `stash_rows[i]` rows at `row_offsets[i]` of one buffer
    generation, its commit of `num_accepted[i]` + 1 rows at `base_pos[i]` with `token_ids[i]`, its trim.
    No SeqStep object per sequence: the drafter takes them in one call."""

    buffer_id: int
    generation: int
    seq_ids: list[int]
    row_offsets: list[int]
    stash_rows: list[int]
    base_pos: list[int]
    num_accepted: list[int]
    token_ids: list[list[int]]

    def seq_steps(self) -> list[SeqStep]:
        """The same operations as SeqSteps (to apply one by one)."""
        return [SeqStep(seq_id, stash=RowRef(self.buffer_id, offset, rows, self.generation),
                        commit=CommitOp(accepted + 1, base, tuple(tokens)), trim=accepted)
                for seq_id, offset, rows, base, accepted, tokens in zip(
                    self.seq_ids, self.row_offsets, self.stash_rows, self.base_pos, self.num_accepted, self.token_ids)]


@dataclass(frozen=True)
class ChainStep:
    """A chained step's part of a Step message (see drafter.proto's ChainStep): settles, then the commit of
    the last chained step's rows, then (after the message's other operations) a propose, whose anchors
    and positions the drafter reads from the target's feed buffer."""

    settle_seq_ids: tuple[int, ...] = ()
    settle_counts: tuple[int, ...] = ()
    commit_seq_ids: tuple[int, ...] = ()
    commit_rows: int = 0
    rows: RowRef | None = None
    feed: RowRef | None = None
    seq_ids: tuple[int, ...] = ()
    ahead: tuple[int, ...] = ()
    num_drafts: int = 0
    done_buffer: int = 0  # a DONE buffer the drafter writes `done_value` into after the propose (0: none)
    done_value: int = 0
    written_value: int = 0  # written by the target's stream into the DONE buffer's element 1 after its writes (0: none)
    written_buffer: int = 0  # ... or into this DONE buffer's element 0 (device memory; 0: done_buffer's element 1)
    tree_keep: int = 0  # the propose answers each row's tree_keep best tokens instead of drafts (0: drafts)

    def __post_init__(self) -> None:
        # (parsed from every chained Step on the drafter's critical path: few Python operations a field)
        settles, counts, commits, ids, ahead = (tuple(map(int, v)) for v in (
            self.settle_seq_ids, self.settle_counts, self.commit_seq_ids, self.seq_ids, self.ahead))
        set_field = object.__setattr__
        set_field(self, "settle_seq_ids", settles)
        set_field(self, "settle_counts", counts)
        set_field(self, "commit_seq_ids", commits)
        set_field(self, "seq_ids", ids)
        set_field(self, "ahead", ahead)
        if len(settles) != len(counts) or len(ids) != len(ahead):
            raise InvalidRequest("a chained step's settles and proposes take one count per sequence")
        for what, named in (("settles", settles), ("commit", commits), ("propose", ids)):
            if named and (len(set(named)) != len(named) or min(named) < 0):
                raise InvalidRequest(f"a chained step's {what} names a sequence twice, or a negative one")
        if (ahead and min(ahead) < 0) or self.commit_rows < 0 or self.num_drafts < 0:
            raise InvalidRequest("a chained step's counts are >= 0")
        if bool(self.commit_seq_ids) != (self.commit_rows > 0) or bool(self.commit_seq_ids) != (self.rows is not None):
            raise InvalidRequest("a chained step's commit names its sequences, its rows per sequence and its rows")
        if bool(self.seq_ids) != (self.num_drafts > 0):
            raise InvalidRequest("a chained step's propose names its sequences and a number of drafts")
        if (self.commit_seq_ids or self.seq_ids) and not isinstance(self.feed, RowRef):
            raise InvalidRequest("a chained step's commit or propose reads a feed buffer")
        if self.rows is not None and not isinstance(self.rows, RowRef):
            raise InvalidRequest("a chained step's rows lie in a registered buffer")
        if bool(self.done_buffer) != bool(self.done_value) or (self.done_buffer and not self.seq_ids) \
                or self.done_buffer < 0 or not 0 <= self.done_value < 2 ** 32:
            raise InvalidRequest("a chained step's done flag names a buffer and a value (1..2^32-1), with a propose")
        if not 0 <= self.written_value < 2 ** 32 or (self.written_value and not self.done_buffer):
            raise InvalidRequest("a chained step's written value (1..2^32-1) goes with its done buffer")
        if self.written_buffer < 0 or (self.written_buffer and not self.written_value):
            raise InvalidRequest("a chained step's written buffer goes with its written value")
        if not 0 <= self.tree_keep <= MAX_TREE_KEEP or (self.tree_keep and not self.seq_ids):
            raise InvalidRequest(f"a chained step's tree_keep (0..{MAX_TREE_KEEP}) goes with a propose")

    @property
    def empty(self) -> bool:
        return not (self.settle_seq_ids or self.commit_seq_ids or self.seq_ids)


def chain_to_proto(c: ChainStep) -> drafter_pb2.ChainStep:
    return drafter_pb2.ChainStep(
        settle_seq_ids=c.settle_seq_ids, settle_counts=c.settle_counts, commit_seq_ids=c.commit_seq_ids,
        commit_rows=c.commit_rows, rows=rows_to_proto(c.rows) if c.rows is not None else None,
        feed=rows_to_proto(c.feed) if c.feed is not None else None, seq_ids=c.seq_ids, ahead=c.ahead,
        num_drafts=c.num_drafts, done_buffer=c.done_buffer, done_value=c.done_value,
        written_value=c.written_value, written_buffer=c.written_buffer, tree_keep=c.tree_keep)


def chain_from_proto(pb: drafter_pb2.ChainStep) -> ChainStep:
    return ChainStep(tuple(pb.settle_seq_ids), tuple(pb.settle_counts), tuple(pb.commit_seq_ids), pb.commit_rows,
                     rows_from_proto(pb.rows) if pb.HasField("rows") else None,
                     rows_from_proto(pb.feed) if pb.HasField("feed") else None,
                     tuple(pb.seq_ids), tuple(pb.ahead), pb.num_drafts, pb.done_buffer, pb.done_value,
                     pb.written_value, pb.written_buffer, pb.tree_keep)


@dataclass(frozen=True)
class StepBatch:
    """One engine step, target → drafter: per-sequence operations, then the batch's proposes."""

    step_id: int
    seqs: tuple[SeqStep, ...] = ()
    proposes: tuple[ProposeRequest, ...] = ()
    register: tuple[BufferDescriptor, ...] = ()  # mapped before any rows are read
    release: tuple[int, ...] = ()  # unmapped after the step
    draft_columns: bool = False  # answer plain drafts in columns (StepResponse.drafts)
    verified: VerifiedColumns | None = None  # parsed verified columns, none of them in seqs (drafter side)
    drafts_buffer: int = 0  # a registered DRAFTS buffer the drafts may be written into (0: none)
    chain: ChainStep | None = None  # a chained step's settles, commit and propose

    def __post_init__(self) -> None:
        for name in ("seqs", "proposes", "register", "release"):
            if type(getattr(self, name)) is not tuple:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        _nonneg("step_id", self.step_id)
        _nonneg("drafts_buffer", self.drafts_buffer)
        for what, items in (("seqs", self.seqs), ("proposes", self.proposes)):
            if len(items) > 1 and len({s.seq_id for s in items}) != len(items):
                raise InvalidRequest(f"a step names a sequence twice in {what}")
        if self.chain is not None and self.chain.seq_ids and self.proposes:
            raise InvalidRequest("a step proposes either chained or as usual, not both")


@dataclass(frozen=True)
class SeqError:
    """A sequence that failed inside a step: its gRPC status code name and message."""

    seq_id: int
    code: str  # grpc.StatusCode name, e.g. "NOT_FOUND"
    message: str

    def __post_init__(self) -> None:
        if self.code not in grpc.StatusCode.__members__ or self.code == "OK":
            raise InvalidRequest(f"not an error status code: {self.code!r}")

    @staticmethod
    def from_exception(seq_id: int, error: Exception) -> SeqError:
        """The status a server maps the exception to (shared.errors' grpc_code; INTERNAL otherwise)."""
        return SeqError(seq_id, getattr(error, "grpc_code", "INTERNAL"), str(error))

    def exception(self) -> SpecsplitError:
        """The domain error for a client to raise; codes without one mean the drafter failed."""
        return error_from_status(self.code, f"sequence {self.seq_id}: {self.message}")


@dataclass(frozen=True)
class StepResult:
    """One engine step's answer: proposals of the sequences that succeeded, errors of the others."""

    step_id: int
    proposals: dict[int, Proposal] = field(default_factory=dict)  # seq_id → drafts, in propose order
    errors: tuple[SeqError, ...] = ()
    # (seq_id, count) of the drafts written into the step's drafts buffer instead, row i for entry i;
    # those sequences have no entry in `proposals`
    in_buffer: tuple[tuple[int, int], ...] = ()


def _commit_to_proto(op: CommitOp) -> drafter_pb2.CommitOp:
    return drafter_pb2.CommitOp(num_rows=op.num_rows, base_pos=op.base_pos, token_ids=op.token_ids)


def _rows_op_to_proto(op: RowsOp) -> drafter_pb2.CatchupOp:
    return drafter_pb2.CatchupOp(token_ids=op.token_ids, rows=rows_to_proto(op.rows), base_pos=op.base_pos)


def _rows_op_from_proto(pb: drafter_pb2.CatchupOp) -> RowsOp:
    return RowsOp(tuple(pb.token_ids), _required_rows(pb), pb.base_pos)


def seq_step_to_proto(s: SeqStep) -> drafter_pb2.SeqStep:
    # Sub-messages passed to the constructor (None: unset), not copied in: this runs per sequence per step.
    return drafter_pb2.SeqStep(
        seq_id=s.seq_id,
        catchup=_rows_op_to_proto(s.catchup) if s.catchup is not None else None,
        stash=rows_to_proto(s.stash) if s.stash is not None else None,
        commit=_commit_to_proto(s.commit) if s.commit is not None else None,
        trim=s.trim,
        free=s.free,
        alloc_budget_tokens=s.alloc,
    )


def seq_step_from_proto(pb: drafter_pb2.SeqStep) -> SeqStep:
    c = pb.commit
    return SeqStep(
        seq_id=pb.seq_id,
        catchup=_rows_op_from_proto(pb.catchup) if pb.HasField("catchup") else None,
        stash=rows_from_proto(pb.stash) if pb.HasField("stash") else None,
        commit=CommitOp(c.num_rows, c.base_pos, tuple(c.token_ids)) if pb.HasField("commit") else None,
        trim=pb.trim if pb.HasField("trim") else None,
        free=pb.free,
        alloc=pb.alloc_budget_tokens if pb.HasField("alloc_budget_tokens") else None,
    )


def step_to_proto(batch: StepBatch, columns: bool = False) -> drafter_pb2.StepRequest:
    """columns: the peer reads StepRequest's columns (DrafterDescription.step_columns); each sequence
    whose operations fit them travels there, the others as a SeqStep or ProposeItem."""
    seqs, proposes = batch.seqs, batch.proposes
    verified = propose_columns = None
    if columns and seqs:
        verified, seqs = _verified_columns(seqs)
    if columns and proposes:  # (none: no columns, as a chained step's Step goes every step)
        propose_columns, proposes = _propose_columns(proposes)
    return drafter_pb2.StepRequest(
        step_id=batch.step_id,
        seqs=[seq_step_to_proto(s) for s in seqs],
        proposes=[propose_item_to_proto(p) for p in proposes],
        register_buffers=[descriptor_to_proto(d) for d in batch.register],
        release_buffers=batch.release,
        verified=verified,
        propose_columns=propose_columns,
        draft_columns=batch.draft_columns,
        drafts_buffer=batch.drafts_buffer,
        chain=chain_to_proto(batch.chain) if batch.chain is not None else None,
    )


def _fits_columns(s: SeqStep, first: RowRef) -> bool:
    """Exactly a stash of rows in `first`'s buffer and generation, a commit and a trim."""
    return (s.commit is not None and s.trim is not None and s.catchup is None and not s.free and s.alloc is None
            and isinstance(s.stash, RowRef) and s.stash.buffer_id == first.buffer_id
            and s.stash.generation == first.generation)


def _verified_columns(seqs: Sequence[SeqStep]) -> tuple[drafter_pb2.VerifiedColumns | None, list[SeqStep]]:
    """→ (the sequences that fit VerifiedColumns, in columns; the others)."""
    first = next((s.stash for s in seqs if isinstance(s.stash, RowRef)), None)
    if first is None:
        return None, list(seqs)
    ids, offsets, stash_rows, commit_rows, base_pos, tokens, accepted, rest = [], [], [], [], [], [], [], []
    for s in seqs:
        if not _fits_columns(s, first):
            rest.append(s)
            continue
        ids.append(s.seq_id)
        offsets.append(s.stash.row_offset)
        stash_rows.append(s.stash.rows)
        commit_rows.append(s.commit.num_rows)
        base_pos.append(s.commit.base_pos)
        tokens += s.commit.token_ids
        accepted.append(s.trim)
    columns = drafter_pb2.VerifiedColumns(
        seq_ids=ids, buffer_id=first.buffer_id, generation=first.generation, row_offsets=offsets,
        stash_rows=stash_rows, commit_rows=commit_rows, base_pos=base_pos, token_ids=tokens, num_accepted=accepted)
    return columns, rest


def _propose_columns(proposes: Sequence[ProposeRequest]) -> tuple[drafter_pb2.ProposeColumns, list[ProposeRequest]]:
    """→ (the proposes without a bitmask or confidence, in columns; the others)."""
    plain = [p for p in proposes if p.bitmask is None and not p.want_confidence]
    columns = drafter_pb2.ProposeColumns(
        seq_ids=[p.seq_id for p in plain], last_tokens=[p.last_token for p in plain],
        positions=[p.position for p in plain], num_drafts=[p.num_drafts for p in plain])
    return columns, [p for p in proposes if p.bitmask is not None or p.want_confidence]


def step_from_proto(pb: drafter_pb2.StepRequest) -> tuple[StepBatch, list[SeqError]]:
    """→ (the well-formed part of the step, errors of the sequences left out).

    A malformed SeqStep or ProposeItem (or column entry) drops that sequence from the whole step (its
    propose too), so one bad sequence does not fail the stream. Malformed connection-level fields, and
    columns of unequal lengths, raise.
    """
    if not (pb.seqs or pb.proposes or pb.register_buffers or pb.release_buffers or pb.HasField("verified")
            or pb.propose_columns.ByteSize()):
        # A chained step's usual message, its chain alone (parsed on the drafter's critical path every step):
        # what the general path below makes of it, with the same checks, in fewer Python operations
        # (bench/wire_bench.py; tests/test_wire.py holds the two equal, refusals included)
        return StepBatch(step_id=pb.step_id, draft_columns=pb.draft_columns, drafts_buffer=pb.drafts_buffer,
                         chain=chain_from_proto(pb.chain) if pb.HasField("chain") else None), []
    return _step_from_proto(pb)


def _step_from_proto(pb: drafter_pb2.StepRequest) -> tuple[StepBatch, list[SeqError]]:
    errors: dict[int, SeqError] = {}
    seen: set[int] = set()
    seqs = _convert_each(pb.seqs, seq_step_from_proto, errors, seen)
    verified = _checked_verified_columns(pb.verified, seen) if pb.HasField("verified") else None
    if pb.HasField("verified") and verified is None:  # an entry is bad: each is converted (and refused) alone
        seqs += _convert_each(_verified_entries(pb.verified), _verified_from_entry, errors, seen)
    seen = set()
    proposes = _convert_each(pb.proposes, propose_item_from_proto, errors, seen)
    if pb.HasField("propose_columns"):
        c = pb.propose_columns
        _same_lengths("propose_columns", c.seq_ids, c.last_tokens, c.positions, c.num_drafts)
        columns = list(c.seq_ids), list(c.last_tokens), list(c.positions), list(c.num_drafts)
        ids, last_tokens, positions, num_drafts = columns
        if ids and min(ids) >= 0 and min(last_tokens) >= 0 and min(positions) >= 0 and min(num_drafts) >= 1 \
                and len(set(ids)) == len(ids) and seen.isdisjoint(ids):  # every entry good: no checks one by one
            proposes += [ProposeRequest(*entry) for entry in zip(*columns)]
        else:
            proposes += _convert_each([_Entry(e) for e in zip(*columns)], _propose_from_entry, errors, seen)
    if verified is not None and any(seq_id in errors for seq_id in verified.seq_ids):
        seqs += verified.seq_steps()  # a bad propose drops its sequence's operations too
        verified = None
    batch = StepBatch(
        step_id=pb.step_id,
        verified=verified,
        seqs=[s for s in seqs if s.seq_id not in errors],
        proposes=[p for p in proposes if p.seq_id not in errors],
        register=[descriptor_from_proto(d) for d in pb.register_buffers],
        release=[_nonneg("buffer id", i) for i in pb.release_buffers],
        draft_columns=pb.draft_columns,
        drafts_buffer=pb.drafts_buffer,
        chain=chain_from_proto(pb.chain) if pb.HasField("chain") else None,
    )
    return batch, list(errors.values())


class _Entry(tuple):
    """One sequence's entry of a message's columns: its fields in column order, seq_id first."""

    @property
    def seq_id(self) -> int:
        return self[0]


def _same_lengths(what: str, *columns) -> None:
    if len({len(c) for c in columns}) > 1:
        raise InvalidRequest(f"{what}: columns of unequal lengths {[len(c) for c in columns]}")


def _verified_entries(c: drafter_pb2.VerifiedColumns) -> list[_Entry]:
    """(seq_id, buffer_id, generation, row_offset, stash_rows, commit_rows, base_pos, token_ids, num_accepted)
    per sequence; each sequence's tokens are the next commit_rows of token_ids."""
    _same_lengths("verified", c.seq_ids, c.row_offsets, c.stash_rows, c.commit_rows, c.base_pos, c.num_accepted)
    counts = list(c.commit_rows)
    tokens = list(c.token_ids)
    if min(counts, default=0) < 0 or sum(counts) != len(tokens):
        raise InvalidRequest(f"verified: {len(tokens)} token ids for commits of {counts} rows")
    entries, at = [], 0
    for seq_id, offset, rows, n, base, accepted in zip(c.seq_ids, c.row_offsets, c.stash_rows, counts, c.base_pos,
                                                       c.num_accepted):
        entries.append(_Entry((seq_id, c.buffer_id, c.generation, offset, rows, n, base, tokens[at:at + n],
                               accepted)))
        at += n
    return entries


def _checked_verified_columns(c: drafter_pb2.VerifiedColumns, named: set[int]) -> VerifiedColumns | None:
    """The columns checked as a whole (unequal lengths raise, as in `_verified_entries`); None when any
    entry is malformed, repeats a sequence or names one of `named` (the step's SeqSteps), which the
    entry-by-entry conversion then reports for that sequence alone."""
    _same_lengths("verified", c.seq_ids, c.row_offsets, c.stash_rows, c.commit_rows, c.base_pos, c.num_accepted)
    counts, tokens = list(c.commit_rows), list(c.token_ids)
    if min(counts, default=0) < 0 or sum(counts) != len(tokens):
        raise InvalidRequest(f"verified: {len(tokens)} token ids for commits of {counts} rows")
    seq_ids, offsets, stash_rows = list(c.seq_ids), list(c.row_offsets), list(c.stash_rows)
    base_pos, accepted = list(c.base_pos), list(c.num_accepted)
    if not seq_ids or c.buffer_id <= 0 or c.generation < 0 or min(seq_ids) < 0 or min(offsets) < 0 \
            or min(stash_rows) <= 0 or min(counts) <= 0 or min(base_pos) < 0 or min(accepted) < 0 \
            or min(tokens) < 0 or any(n != a + 1 for n, a in zip(counts, accepted)) \
            or len(set(seq_ids)) != len(seq_ids) or not named.isdisjoint(seq_ids):
        return None
    named.update(seq_ids)
    split, at = [], 0
    for n in counts:
        split.append(tokens[at:at + n])
        at += n
    return VerifiedColumns(c.buffer_id, c.generation, seq_ids, offsets, stash_rows, base_pos, accepted, split)


def _verified_from_entry(e: _Entry) -> SeqStep:
    seq_id, buffer_id, generation, offset, rows, n, base, tokens, accepted = e
    return SeqStep(seq_id, stash=RowRef(buffer_id, offset, rows, generation), commit=CommitOp(n, base, tuple(tokens)),
                   trim=accepted)


def _propose_from_entry(e: _Entry) -> ProposeRequest:
    seq_id, last_token, position, num_drafts = e
    if num_drafts <= 0:
        raise InvalidRequest(f"sequence {seq_id}: num_drafts must be >= 1, got {num_drafts}")
    return ProposeRequest(_nonneg("seq_id", seq_id), _nonneg("last_token", last_token),
                          _nonneg("position", position), num_drafts)


def _convert_each(items, convert, errors: dict[int, SeqError], seen: set[int]) -> list:
    """Convert each item; a failure or a repeated seq_id (in `seen`) records an INVALID_ARGUMENT for its sequence."""
    out = []
    for item in items:
        try:
            if item.seq_id in seen:
                raise InvalidRequest(f"sequence {item.seq_id} appears twice in one step")
            seen.add(item.seq_id)
            out.append(convert(item))
        except InvalidRequest as err:
            errors.setdefault(item.seq_id, SeqError(item.seq_id, "INVALID_ARGUMENT", str(err)))
    return out


def step_result_to_proto(r: StepResult, columns: bool = False) -> drafter_pb2.StepResponse:
    """columns: plain drafts (no confidence, no distribution) go in StepResponse.drafts."""
    plain = {seq_id: p for seq_id, p in r.proposals.items() if p.confidence is None and p.probs is None} \
        if columns else {}
    counts = [len(p.tokens) for p in plain.values()]
    if r.in_buffer:  # the step's drafts are all in its drafts buffer (the drafter writes it for a whole step)
        if plain:
            raise ValueError("a step answers its drafts in the buffer or in the message, not both")
        drafts = drafter_pb2.DraftColumns(seq_ids=[s for s, _ in r.in_buffer], counts=[n for _, n in r.in_buffer],
                                          in_buffer=True)
    else:
        drafts = drafter_pb2.DraftColumns(seq_ids=list(plain), counts=counts,
                                          tokens=[t for p in plain.values() for t in p.tokens]) if plain else None
    return drafter_pb2.StepResponse(
        step_id=r.step_id,
        proposals=[proposal_to_proto(seq_id, p) for seq_id, p in r.proposals.items() if seq_id not in plain],
        errors=[
            drafter_pb2.SeqError(seq_id=e.seq_id, code=grpc.StatusCode[e.code].value[0], message=e.message)
            for e in r.errors
        ],
        drafts=drafts,
    )


def step_result_from_proto(pb: drafter_pb2.StepResponse) -> StepResult:
    proposals = dict(proposal_from_proto(p) for p in pb.proposals)
    count = len(pb.proposals)
    in_buffer: tuple[tuple[int, int], ...] = ()
    if pb.HasField("drafts") and pb.drafts.in_buffer:
        c = pb.drafts
        _same_lengths("drafts", c.seq_ids, c.counts)
        if c.tokens or min(c.counts, default=0) < 0 or len(set(c.seq_ids)) != len(c.seq_ids) \
                or not set(c.seq_ids).isdisjoint(proposals):
            raise InvalidRequest(f"step {pb.step_id}: drafts in the buffer come with counts >= 0 of distinct "
                                 "sequences and no tokens")
        in_buffer = tuple(zip(c.seq_ids, c.counts))
    elif pb.HasField("drafts"):
        c = pb.drafts
        _same_lengths("drafts", c.seq_ids, c.counts)
        counts, tokens = list(c.counts), _tokens("drafts", c.tokens)
        if min(counts, default=0) < 0 or sum(counts) != len(tokens):
            raise InvalidRequest(f"step {pb.step_id}: {len(tokens)} draft tokens for counts {counts}")
        at = 0
        for seq_id, n in zip(c.seq_ids, counts):
            proposals[seq_id] = Proposal(tokens=list(tokens[at:at + n]))
            at += n
        count += len(counts)
    if len(proposals) != count:
        raise InvalidRequest(f"step {pb.step_id} answers a sequence twice")
    errors = tuple(SeqError(e.seq_id, _STATUS_BY_NUMBER.get(e.code, "UNKNOWN"), e.message) for e in pb.errors)
    return StepResult(pb.step_id, proposals, errors, in_buffer)


# Unary requests ↔ a one-sequence SeqStep (the same applier serves both paths).


def stash_to_proto(seq_id: int, rows: RowSource) -> drafter_pb2.StashRequest:
    return drafter_pb2.StashRequest(seq_id=seq_id, rows=rows_to_proto(rows))


def commit_to_proto(seq_id: int, op: CommitOp) -> drafter_pb2.CommitRequest:
    return drafter_pb2.CommitRequest(seq_id=seq_id, num_rows=op.num_rows, base_pos=op.base_pos, token_ids=op.token_ids)


def trim_to_proto(seq_id: int, num_accepted: int) -> drafter_pb2.TrimRequest:
    return drafter_pb2.TrimRequest(seq_id=seq_id, num_accepted=num_accepted)


def catchup_to_proto(seq_id: int, op: RowsOp) -> drafter_pb2.CatchupRequest:
    return drafter_pb2.CatchupRequest(
        seq_id=seq_id, token_ids=op.token_ids, rows=rows_to_proto(op.rows), base_pos=op.base_pos
    )


def unary_to_seq_step(pb) -> SeqStep:
    """A StashRequest, CommitRequest, TrimRequest, CatchupRequest or FreeStateRequest → SeqStep."""
    if isinstance(pb, drafter_pb2.StashRequest):
        return SeqStep(pb.seq_id, stash=_required_rows(pb))
    if isinstance(pb, drafter_pb2.CommitRequest):
        return SeqStep(pb.seq_id, commit=CommitOp(pb.num_rows, pb.base_pos, tuple(pb.token_ids)))
    if isinstance(pb, drafter_pb2.TrimRequest):
        return SeqStep(pb.seq_id, trim=pb.num_accepted)
    if isinstance(pb, drafter_pb2.CatchupRequest):
        return SeqStep(pb.seq_id, catchup=RowsOp(tuple(pb.token_ids), _required_rows(pb), pb.base_pos))
    if isinstance(pb, drafter_pb2.FreeStateRequest):
        return SeqStep(pb.seq_id, free=True)
    raise InvalidRequest(f"{type(pb).__name__} is not a per-sequence request")


def alloc_to_proto(seq_id: int, budget_tokens: int) -> drafter_pb2.AllocStateRequest:
    return drafter_pb2.AllocStateRequest(seq_id=seq_id, budget_tokens=budget_tokens)


def alloc_from_proto(pb: drafter_pb2.AllocStateRequest) -> tuple[int, int]:
    """→ (seq_id, budget_tokens)."""
    return _nonneg("seq_id", pb.seq_id), _budget(pb.seq_id, pb.budget_tokens)


def _budget(seq_id: int, budget_tokens: int) -> int:
    if budget_tokens <= 0:
        raise InvalidRequest(f"sequence {seq_id}: budget_tokens must be >= 1, got {budget_tokens}")
    return budget_tokens


def prefill_to_proto(seq_id: int, op: RowsOp, alloc_budget: int | None = None) -> drafter_pb2.PrefillDrafterRequest:
    """alloc_budget: the sequence is allocated with it first (a drafter with prefill_allocs)."""
    return drafter_pb2.PrefillDrafterRequest(
        seq_id=seq_id, token_ids=op.token_ids, rows=rows_to_proto(op.rows), start_pos=op.base_pos,
        alloc_budget_tokens=alloc_budget,
    )


def prefill_from_proto(pb: drafter_pb2.PrefillDrafterRequest) -> tuple[int, RowsOp, int | None]:
    """→ (seq_id, prompt rows at start_pos.., the budget to allocate the sequence with first or None)."""
    seq_id = _nonneg("seq_id", pb.seq_id)
    budget = _budget(seq_id, pb.alloc_budget_tokens) if pb.HasField("alloc_budget_tokens") else None
    return seq_id, RowsOp(tuple(pb.token_ids), _required_rows(pb), pb.start_pos), budget


# --- target service ----------------------------------------------------------------------------


