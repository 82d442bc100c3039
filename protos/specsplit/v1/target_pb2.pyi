from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "sampling", "speculative", "request_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: bool
    sampling: _common_pb2.SamplingParams
    speculative: bool
    request_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[bool] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculative: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("steps", "drafted", "accepted", "tau", "prompt_tokens", "generated_tokens")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    drafted: int
    accepted: int
    tau: float
    prompt_tokens: int
    generated_tokens: int
    def __init__(self, steps: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., tau: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    stats: GenerationStats
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...

class DescribeTargetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetDescription(_message.Message):
    __slots__ = ("model_name", "vocab_size", "max_context", "drafter_attached", "drafter_kind")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_KIND_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    max_context: int
    drafter_attached: bool
    drafter_kind: _common_pb2.DrafterKind
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., drafter_attached: _Optional[bool] = ..., drafter_kind: _Optional[_Union[_common_pb2.DrafterKind, str]] = ...) -> None: ...
