"""TargetService's own vocabulary and its protobuf conversion: the Generate request, its chunks and
stats, the target's description, sampling parameters.

Torch-free on purpose (grpcio and protobuf are all it needs), so the Python client in
specsplit.client runs in apps that do not install torch. shared.wire re-exports all of it: with
wire, this is the conversion layer, and every `*_from_proto` validates what arrived.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from specsplit.protos.v1 import common_pb2, target_pb2
from specsplit.shared.drafter_kind import DrafterKind
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.sampling_params import SamplingParams

DRAFTER_KINDS = {DrafterKind.DFLASH: common_pb2.DRAFTER_KIND_DFLASH, DrafterKind.MTP: common_pb2.DRAFTER_KIND_MTP}
FINISH_REASONS = {
    "length": target_pb2.FINISH_REASON_LENGTH,
    "stop": target_pb2.FINISH_REASON_STOP,
    "eos": target_pb2.FINISH_REASON_EOS,
    "cancelled": target_pb2.FINISH_REASON_CANCELLED,
}


def enum_from_proto(table: dict, number: int, what: str):
    """The domain value `table` maps to the proto enum `number`; InvalidRequest when there is none."""
    for domain, number_on_wire in table.items():
        if number_on_wire == number:
            return domain
    raise InvalidRequest(f"unknown or unset {what} ({number})")


def check_token_ids(what: str, values: Iterable[int]) -> tuple[int, ...]:
    """`values` as a tuple; InvalidRequest (naming `what`) when one is a negative token id."""
    tokens = tuple(values)
    if tokens and min(tokens) < 0:
        raise InvalidRequest(f"{what} holds a negative token id")
    return tokens


# --- sampling ----------------------------------------------------------------------------------


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        stop_token_ids=p.stop_token_ids,
        stop_strings=p.stop_strings,
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        pb.seed = p.seed
    return pb


def sampling_from_proto(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Proto3 zeros mean "unset": max_tokens 0 takes the default, top_p 0 means 1 (off)."""
    defaults = SamplingParams()
    return SamplingParams(
        max_tokens=pb.max_tokens or defaults.max_tokens,
        temperature=pb.temperature,
        top_k=pb.top_k,
        top_p=pb.top_p or 1.0,
        seed=pb.seed if pb.HasField("seed") else None,
        stop_token_ids=tuple(pb.stop_token_ids),
        stop_strings=tuple(pb.stop_strings),
        ignore_eos=pb.ignore_eos,
    )


# --- Generate and Describe ---------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateCall:
    """TargetService.Generate's request: a text or token-id prompt and how to sample it."""

    prompt: str | tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    chat: bool = False  # wrap a text prompt in the chat template
    speculative: bool = True  # use the drafter when one is attached
    request_id: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", check_token_ids("prompt", self.prompt))
        if not self.prompt:
            raise InvalidRequest("the prompt is empty")
        if self.chat and not isinstance(self.prompt, str):
            raise InvalidRequest("chat needs a text prompt")


@dataclass(frozen=True)
class GenerationStats:
    """Counters of a finished generation; τ = generated tokens per step."""

    steps: int
    drafted: int
    accepted: int
    tau: float
    prompt_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class GenerateChunk:
    """A request's output since the last chunk (one engine step's, or several steps' where the stream fell
    behind the engine); the last one carries finish_reason and stats."""

    token_ids: tuple[int, ...]
    text: str = ""
    finish_reason: str | None = None  # length | stop | eos | cancelled
    stats: GenerationStats | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", check_token_ids("generated", self.token_ids))
        reason = self.finish_reason
        if isinstance(reason, enum.Enum):  # target_service's FinishReason is a str enum
            object.__setattr__(self, "finish_reason", reason.value)
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise InvalidRequest(f"unknown finish reason {self.finish_reason!r}")


@dataclass(frozen=True)
class TargetDescription:
    """TargetService.Describe: the served model and its drafter."""

    model_name: str
    vocab_size: int
    max_context: int
    drafter_kind: DrafterKind | None = None  # None: no drafter attached

    @property
    def drafter_attached(self) -> bool:
        return self.drafter_kind is not None


def generate_to_proto(call: GenerateCall) -> target_pb2.GenerateRequest:
    pb = target_pb2.GenerateRequest(
        chat=call.chat,
        sampling=sampling_to_proto(call.sampling),
        speculative=call.speculative,
        request_id=call.request_id,
    )
    if isinstance(call.prompt, str):
        pb.text = call.prompt
    else:
        pb.token_ids.ids.extend(call.prompt)
    return pb


def generate_from_proto(pb: target_pb2.GenerateRequest) -> GenerateCall:
    which = pb.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("GenerateRequest has no prompt")
    return GenerateCall(
        prompt=pb.text if which == "text" else tuple(pb.token_ids.ids),
        sampling=sampling_from_proto(pb.sampling),
        chat=pb.chat,
        speculative=pb.speculative if pb.HasField("speculative") else True,
        request_id=pb.request_id,
    )


def chunk_to_proto(chunk: GenerateChunk) -> target_pb2.GenerateResponse:
    pb = target_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text)
    if chunk.finish_reason is not None:
        pb.finish_reason = FINISH_REASONS[chunk.finish_reason]
    if chunk.stats is not None:
        s = chunk.stats
        pb.stats.CopyFrom(
            target_pb2.GenerationStats(
                steps=s.steps,
                drafted=s.drafted,
                accepted=s.accepted,
                tau=s.tau,
                prompt_tokens=s.prompt_tokens,
                generated_tokens=s.generated_tokens,
            )
        )
    return pb


def chunk_from_proto(pb: target_pb2.GenerateResponse) -> GenerateChunk:
    reason = enum_from_proto(FINISH_REASONS, pb.finish_reason, "finish reason") if pb.HasField("finish_reason") else None
    stats = None
    if pb.HasField("stats"):
        s = pb.stats
        stats = GenerationStats(s.steps, s.drafted, s.accepted, s.tau, s.prompt_tokens, s.generated_tokens)
    return GenerateChunk(tuple(pb.token_ids), pb.text, reason, stats)


def target_description_to_proto(d: TargetDescription) -> target_pb2.TargetDescription:
    kind = common_pb2.DRAFTER_KIND_UNSPECIFIED if d.drafter_kind is None else DRAFTER_KINDS[DrafterKind(d.drafter_kind)]
    return target_pb2.TargetDescription(
        model_name=d.model_name,
        vocab_size=d.vocab_size,
        max_context=d.max_context,
        drafter_attached=d.drafter_attached,
        drafter_kind=kind,
    )


def target_description_from_proto(pb: target_pb2.TargetDescription) -> TargetDescription:
    kind = enum_from_proto(DRAFTER_KINDS, pb.drafter_kind, "drafter kind") if pb.drafter_attached else None
    return TargetDescription(pb.model_name, pb.vocab_size, pb.max_context, kind)
