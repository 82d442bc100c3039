"""The one owner of per-sequence drafter state: live sequences by id, carried KV entries by handle."""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

from specsplit.shared.errors import AlreadyExists, InvalidRequest, UnknownSequence

StateT = TypeVar("StateT")


def check_id(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"{what} must be a non-negative integer, got {value!r}")
    return value


class SequenceStore(Generic[StateT]):
    """Sequences keyed by seq_id and carried entries (state moved out by take_kv) keyed by handle."""

    def __init__(self) -> None:
        self._live: dict[int, StateT] = {}
        self._carried: dict[int, StateT] = {}
        self._next_handle = 1

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._live))

    def add(self, seq_id: int, state: StateT) -> None:
        if check_id(seq_id, "seq_id") in self._live:
            raise AlreadyExists(f"sequence {seq_id} already has drafter state")
        self._live[seq_id] = state

    def get(self, seq_id: int) -> StateT:
        try:
            return self._live[check_id(seq_id, "seq_id")]
        except KeyError:
            raise UnknownSequence(f"no drafter state for sequence {seq_id}") from None

    def replace(self, seq_id: int, state: StateT) -> None:
        self.get(seq_id)
        self._live[seq_id] = state

    def pop(self, seq_id: int) -> StateT:
        state = self.get(seq_id)
        del self._live[seq_id]
        return state

    def park(self, state: StateT) -> int:
        """Hold `state` under a new handle (no sequence owns it)."""
        handle = self._next_handle
        self._next_handle += 1
        self._carried[handle] = state
        return handle

    def carried(self, handle: int) -> StateT:
        try:
            return self._carried[check_id(handle, "handle")]
        except KeyError:
            raise UnknownSequence(f"no carried drafter KV under handle {handle}") from None

    def unpark(self, handle: int) -> StateT:
        state = self.carried(handle)
        del self._carried[handle]
        return state

    @property
    def num_carried(self) -> int:
        return len(self._carried)
