"""The kinds of drafter: a torch-free enum that the proposer interface, the wire and the Python client share."""

from __future__ import annotations

import enum


class DrafterKind(str, enum.Enum):
    DFLASH = "dflash"
    MTP = "mtp"
