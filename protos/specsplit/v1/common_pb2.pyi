from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]

class DrafterKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTER_KIND_UNSPECIFIED: _ClassVar[DrafterKind]
    DRAFTER_KIND_DFLASH: _ClassVar[DrafterKind]
    DRAFTER_KIND_MTP: _ClassVar[DrafterKind]

class FeatureKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FEATURE_KIND_UNSPECIFIED: _ClassVar[FeatureKind]
    FEATURE_KIND_LAYER_CONCAT: _ClassVar[FeatureKind]
    FEATURE_KIND_LAST_HIDDEN: _ClassVar[FeatureKind]

class BufferKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUFFER_KIND_UNSPECIFIED: _ClassVar[BufferKind]
    BUFFER_KIND_SHM: _ClassVar[BufferKind]
    BUFFER_KIND_CUDA_IPC: _ClassVar[BufferKind]
    BUFFER_KIND_HOST_PAGE: _ClassVar[BufferKind]

class BufferRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUFFER_ROLE_ROWS: _ClassVar[BufferRole]
    BUFFER_ROLE_TARGET_EMBEDDING: _ClassVar[BufferRole]
    BUFFER_ROLE_TARGET_LM_HEAD: _ClassVar[BufferRole]
    BUFFER_ROLE_DRAFTS: _ClassVar[BufferRole]
    BUFFER_ROLE_FEED: _ClassVar[BufferRole]
    BUFFER_ROLE_DONE: _ClassVar[BufferRole]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_INT32: DType
DRAFTER_KIND_UNSPECIFIED: DrafterKind
DRAFTER_KIND_DFLASH: DrafterKind
DRAFTER_KIND_MTP: DrafterKind
FEATURE_KIND_UNSPECIFIED: FeatureKind
FEATURE_KIND_LAYER_CONCAT: FeatureKind
FEATURE_KIND_LAST_HIDDEN: FeatureKind
BUFFER_KIND_UNSPECIFIED: BufferKind
BUFFER_KIND_SHM: BufferKind
BUFFER_KIND_CUDA_IPC: BufferKind
BUFFER_KIND_HOST_PAGE: BufferKind
BUFFER_ROLE_ROWS: BufferRole
BUFFER_ROLE_TARGET_EMBEDDING: BufferRole
BUFFER_ROLE_TARGET_LM_HEAD: BufferRole
BUFFER_ROLE_DRAFTS: BufferRole
BUFFER_ROLE_FEED: BufferRole
BUFFER_ROLE_DONE: BufferRole

class InlineRows(_message.Message):
    __slots__ = ("data", "dtype", "rows", "cols")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: DType
    rows: int
    cols: int
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[_Union[DType, str]] = ..., rows: _Optional[int] = ..., cols: _Optional[int] = ...) -> None: ...

class RowRef(_message.Message):
    __slots__ = ("buffer_id", "row_offset", "rows", "generation", "inline")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    buffer_id: int
    row_offset: int
    rows: int
    generation: int
    inline: InlineRows
    def __init__(self, buffer_id: _Optional[int] = ..., row_offset: _Optional[int] = ..., rows: _Optional[int] = ..., generation: _Optional[int] = ..., inline: _Optional[_Union[InlineRows, _Mapping]] = ...) -> None: ...

class BufferDescriptor(_message.Message):
    __slots__ = ("buffer_id", "kind", "name", "mem_handle", "dtype", "rows", "cols", "device_uuid", "host_id", "event_handle", "role", "token")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    buffer_id: int
    kind: BufferKind
    name: str
    mem_handle: bytes
    dtype: DType
    rows: int
    cols: int
    device_uuid: str
    host_id: str
    event_handle: bytes
    role: BufferRole
    token: bytes
    def __init__(self, buffer_id: _Optional[int] = ..., kind: _Optional[_Union[BufferKind, str]] = ..., name: _Optional[str] = ..., mem_handle: _Optional[bytes] = ..., dtype: _Optional[_Union[DType, str]] = ..., rows: _Optional[int] = ..., cols: _Optional[int] = ..., device_uuid: _Optional[str] = ..., host_id: _Optional[str] = ..., event_handle: _Optional[bytes] = ..., role: _Optional[_Union[BufferRole, str]] = ..., token: _Optional[bytes] = ...) -> None: ...

class Bitmask(_message.Message):
    __slots__ = ("words",)
    WORDS_FIELD_NUMBER: _ClassVar[int]
    words: bytes
    def __init__(self, words: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "stop_strings", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...
