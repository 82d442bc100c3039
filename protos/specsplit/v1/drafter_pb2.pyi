from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeDrafterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterDescription(_message.Message):
    __slots__ = ("kind", "block_size", "max_drafts", "target_layer_ids", "feature", "feature_dim", "hidden_size", "vocab_size", "max_batch", "window", "needs_target_head", "host_id", "device_uuid", "step_columns", "step_socket", "drafts_buffer", "instance", "chains", "done_flags", "written_flags", "prefill_allocs", "host_flags", "tree_keep", "step_attach")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DIM_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    NEEDS_TARGET_HEAD_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    STEP_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_BUFFER_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    DONE_FLAGS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FLAGS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ALLOCS_FIELD_NUMBER: _ClassVar[int]
    HOST_FLAGS_FIELD_NUMBER: _ClassVar[int]
    TREE_KEEP_FIELD_NUMBER: _ClassVar[int]
    STEP_ATTACH_FIELD_NUMBER: _ClassVar[int]
    kind: _common_pb2.DrafterKind
    block_size: int
    max_drafts: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    feature: _common_pb2.FeatureKind
    feature_dim: int
    hidden_size: int
    vocab_size: int
    max_batch: int
    window: int
    needs_target_head: bool
    host_id: str
    device_uuid: str
    step_columns: bool
    step_socket: str
    drafts_buffer: bool
    instance: str
    chains: bool
    done_flags: bool
    written_flags: bool
    prefill_allocs: bool
    host_flags: bool
    tree_keep: int
    step_attach: bool
    def __init__(self, kind: _Optional[_Union[_common_pb2.DrafterKind, str]] = ..., block_size: _Optional[int] = ..., max_drafts: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., feature: _Optional[_Union[_common_pb2.FeatureKind, str]] = ..., feature_dim: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_batch: _Optional[int] = ..., window: _Optional[int] = ..., needs_target_head: _Optional[bool] = ..., host_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., step_columns: _Optional[bool] = ..., step_socket: _Optional[str] = ..., drafts_buffer: _Optional[bool] = ..., instance: _Optional[str] = ..., chains: _Optional[bool] = ..., done_flags: _Optional[bool] = ..., written_flags: _Optional[bool] = ..., prefill_allocs: _Optional[bool] = ..., host_flags: _Optional[bool] = ..., tree_keep: _Optional[int] = ..., step_attach: _Optional[bool] = ...) -> None: ...

class RegisterBuffersRequest(_message.Message):
    __slots__ = ("buffers",)
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    buffers: _containers.RepeatedCompositeFieldContainer[_common_pb2.BufferDescriptor]
    def __init__(self, buffers: _Optional[_Iterable[_Union[_common_pb2.BufferDescriptor, _Mapping]]] = ...) -> None: ...

class RegisterBuffersResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseBuffersRequest(_message.Message):
    __slots__ = ("buffer_ids",)
    BUFFER_IDS_FIELD_NUMBER: _ClassVar[int]
    buffer_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, buffer_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseBuffersResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AllocStateRequest(_message.Message):
    __slots__ = ("seq_id", "budget_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    budget_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., budget_tokens: _Optional[int] = ...) -> None: ...

class AllocStateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillDrafterRequest(_message.Message):
    __slots__ = ("seq_id", "token_ids", "rows", "start_pos", "alloc_budget_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    ALLOC_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rows: _common_pb2.RowRef
    start_pos: int
    alloc_budget_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., rows: _Optional[_Union[_common_pb2.RowRef, _Mapping]] = ..., start_pos: _Optional[int] = ..., alloc_budget_tokens: _Optional[int] = ...) -> None: ...

class PrefillDrafterResponse(_message.Message):
    __slots__ = ("rows_appended",)
    ROWS_APPENDED_FIELD_NUMBER: _ClassVar[int]
    rows_appended: int
    def __init__(self, rows_appended: _Optional[int] = ...) -> None: ...

class FreeStateRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    def __init__(self, seq_id: _Optional[int] = ...) -> None: ...

class FreeStateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProposeItem(_message.Message):
    __slots__ = ("seq_id", "last_token", "position", "num_drafts", "bitmask", "want_confidence")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    WANT_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    last_token: int
    position: int
    num_drafts: int
    bitmask: _common_pb2.Bitmask
    want_confidence: bool
    def __init__(self, seq_id: _Optional[int] = ..., last_token: _Optional[int] = ..., position: _Optional[int] = ..., num_drafts: _Optional[int] = ..., bitmask: _Optional[_Union[_common_pb2.Bitmask, _Mapping]] = ..., want_confidence: _Optional[bool] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("seq_id", "tokens", "confidence", "probs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    confidence: _containers.RepeatedScalarFieldContainer[float]
    probs: _common_pb2.InlineRows
    def __init__(self, seq_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., confidence: _Optional[_Iterable[float]] = ..., probs: _Optional[_Union[_common_pb2.InlineRows, _Mapping]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("proposals",)
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    def __init__(self, proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ...) -> None: ...

class StashRequest(_message.Message):
    __slots__ = ("seq_id", "rows")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    rows: _common_pb2.RowRef
    def __init__(self, seq_id: _Optional[int] = ..., rows: _Optional[_Union[_common_pb2.RowRef, _Mapping]] = ...) -> None: ...

class StashResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("seq_id", "num_rows", "base_pos", "token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    BASE_POS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_rows: int
    base_pos: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., num_rows: _Optional[int] = ..., base_pos: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrimRequest(_message.Message):
    __slots__ = ("seq_id", "num_accepted")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_accepted: int
    def __init__(self, seq_id: _Optional[int] = ..., num_accepted: _Optional[int] = ...) -> None: ...

class TrimResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CatchupRequest(_message.Message):
    __slots__ = ("seq_id", "token_ids", "rows", "base_pos")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BASE_POS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rows: _common_pb2.RowRef
    base_pos: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., rows: _Optional[_Union[_common_pb2.RowRef, _Mapping]] = ..., base_pos: _Optional[int] = ...) -> None: ...

class CatchupResponse(_message.Message):
    __slots__ = ("rows_appended",)
    ROWS_APPENDED_FIELD_NUMBER: _ClassVar[int]
    rows_appended: int
    def __init__(self, rows_appended: _Optional[int] = ...) -> None: ...

class TakeDrafterKVRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    def __init__(self, seq_id: _Optional[int] = ...) -> None: ...

class CarriedKV(_message.Message):
    __slots__ = ("handle", "rows", "last_position")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    LAST_POSITION_FIELD_NUMBER: _ClassVar[int]
    handle: int
    rows: int
    last_position: int
    def __init__(self, handle: _Optional[int] = ..., rows: _Optional[int] = ..., last_position: _Optional[int] = ...) -> None: ...

class InstallDrafterKVRequest(_message.Message):
    __slots__ = ("seq_id", "handle")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    handle: int
    def __init__(self, seq_id: _Optional[int] = ..., handle: _Optional[int] = ...) -> None: ...

class FreeDrafterKVRequest(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: int
    def __init__(self, handle: _Optional[int] = ...) -> None: ...

class FreeDrafterKVResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommitOp(_message.Message):
    __slots__ = ("num_rows", "base_pos", "token_ids")
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    BASE_POS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    num_rows: int
    base_pos: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_rows: _Optional[int] = ..., base_pos: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CatchupOp(_message.Message):
    __slots__ = ("token_ids", "rows", "base_pos")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BASE_POS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rows: _common_pb2.RowRef
    base_pos: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., rows: _Optional[_Union[_common_pb2.RowRef, _Mapping]] = ..., base_pos: _Optional[int] = ...) -> None: ...

class SeqStep(_message.Message):
    __slots__ = ("seq_id", "catchup", "stash", "commit", "trim", "free", "alloc_budget_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CATCHUP_FIELD_NUMBER: _ClassVar[int]
    STASH_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    TRIM_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    ALLOC_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    catchup: CatchupOp
    stash: _common_pb2.RowRef
    commit: CommitOp
    trim: int
    free: bool
    alloc_budget_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., catchup: _Optional[_Union[CatchupOp, _Mapping]] = ..., stash: _Optional[_Union[_common_pb2.RowRef, _Mapping]] = ..., commit: _Optional[_Union[CommitOp, _Mapping]] = ..., trim: _Optional[int] = ..., free: _Optional[bool] = ..., alloc_budget_tokens: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "seqs", "proposes", "register_buffers", "release_buffers", "verified", "propose_columns", "draft_columns", "drafts_buffer", "chain")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    PROPOSES_FIELD_NUMBER: _ClassVar[int]
    REGISTER_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_BUFFER_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seqs: _containers.RepeatedCompositeFieldContainer[SeqStep]
    proposes: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    register_buffers: _containers.RepeatedCompositeFieldContainer[_common_pb2.BufferDescriptor]
    release_buffers: _containers.RepeatedScalarFieldContainer[int]
    verified: VerifiedColumns
    propose_columns: ProposeColumns
    draft_columns: bool
    drafts_buffer: int
    chain: ChainStep
    def __init__(self, step_id: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[SeqStep, _Mapping]]] = ..., proposes: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ..., register_buffers: _Optional[_Iterable[_Union[_common_pb2.BufferDescriptor, _Mapping]]] = ..., release_buffers: _Optional[_Iterable[int]] = ..., verified: _Optional[_Union[VerifiedColumns, _Mapping]] = ..., propose_columns: _Optional[_Union[ProposeColumns, _Mapping]] = ..., draft_columns: _Optional[bool] = ..., drafts_buffer: _Optional[int] = ..., chain: _Optional[_Union[ChainStep, _Mapping]] = ...) -> None: ...

class ChainStep(_message.Message):
    __slots__ = ("settle_seq_ids", "settle_counts", "commit_seq_ids", "commit_rows", "rows", "feed", "seq_ids", "ahead", "num_drafts", "done_buffer", "done_value", "written_value", "written_buffer", "tree_keep")
    SETTLE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SETTLE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FEED_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DONE_BUFFER_FIELD_NUMBER: _ClassVar[int]
    DONE_VALUE_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_VALUE_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BUFFER_FIELD_NUMBER: _ClassVar[int]
    TREE_KEEP_FIELD_NUMBER: _ClassVar[int]
    settle_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    settle_counts: _containers.RepeatedScalarFieldContainer[int]
    commit_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    commit_rows: int
    rows: _common_pb2.RowRef
    feed: _common_pb2.RowRef
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    ahead: _containers.RepeatedScalarFieldContainer[int]
    num_drafts: int
    done_buffer: int
    done_value: int
    written_value: int
    written_buffer: int
    tree_keep: int
    def __init__(self, settle_seq_ids: _Optional[_Iterable[int]] = ..., settle_counts: _Optional[_Iterable[int]] = ..., commit_seq_ids: _Optional[_Iterable[int]] = ..., commit_rows: _Optional[int] = ..., rows: _Optional[_Union[_common_pb2.RowRef, _Mapping]] = ..., feed: _Optional[_Union[_common_pb2.RowRef, _Mapping]] = ..., seq_ids: _Optional[_Iterable[int]] = ..., ahead: _Optional[_Iterable[int]] = ..., num_drafts: _Optional[int] = ..., done_buffer: _Optional[int] = ..., done_value: _Optional[int] = ..., written_value: _Optional[int] = ..., written_buffer: _Optional[int] = ..., tree_keep: _Optional[int] = ...) -> None: ...

class VerifiedColumns(_message.Message):
    __slots__ = ("seq_ids", "buffer_id", "generation", "row_offsets", "stash_rows", "commit_rows", "base_pos", "token_ids", "num_accepted")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    STASH_ROWS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ROWS_FIELD_NUMBER: _ClassVar[int]
    BASE_POS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    buffer_id: int
    generation: int
    row_offsets: _containers.RepeatedScalarFieldContainer[int]
    stash_rows: _containers.RepeatedScalarFieldContainer[int]
    commit_rows: _containers.RepeatedScalarFieldContainer[int]
    base_pos: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., buffer_id: _Optional[int] = ..., generation: _Optional[int] = ..., row_offsets: _Optional[_Iterable[int]] = ..., stash_rows: _Optional[_Iterable[int]] = ..., commit_rows: _Optional[_Iterable[int]] = ..., base_pos: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeColumns(_message.Message):
    __slots__ = ("seq_ids", "last_tokens", "positions", "num_drafts")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    last_tokens: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    num_drafts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., last_tokens: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., num_drafts: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftColumns(_message.Message):
    __slots__ = ("seq_ids", "counts", "tokens", "in_buffer")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    IN_BUFFER_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    in_buffer: bool
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., in_buffer: _Optional[bool] = ...) -> None: ...

class SeqError(_message.Message):
    __slots__ = ("seq_id", "code", "message")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    code: int
    message: str
    def __init__(self, seq_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "proposals", "errors", "drafts")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    errors: _containers.RepeatedCompositeFieldContainer[SeqError]
    drafts: DraftColumns
    def __init__(self, step_id: _Optional[int] = ..., proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[SeqError, _Mapping]]] = ..., drafts: _Optional[_Union[DraftColumns, _Mapping]] = ...) -> None: ...
