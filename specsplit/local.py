"""In-process wiring: a target model, an optional drafter object and the engine, in one process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specsplit import drafter_service
from specsplit.drafter_service.checkpoint import load_drafter, random_drafter
from specsplit.drafter_service.context_pool import BLOCK_SIZE
from specsplit.drafter_service.heads import TargetHead, TargetInfo
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.gguf_import import default_target_dir
from specsplit.shared.proposer import Proposer
from specsplit.shared.tokenizer import Tokenizer
from specsplit.cli import DRAFTER_HELP
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.model import TargetModel, load_target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# `--drafter dflash|mtp`: the drafters trained for the default target and shipped in the package;
# `random-dflash|random-mtp`: seeded random drafters of that kind (lossless, but they accelerate nothing).
SHIPPED_DIR = Path(drafter_service.__file__).parent / "checkpoints"
SHIPPED = {"dflash": "smollm2-135m-dflash", "mtp": "smollm2-135m-mtp"}
RANDOM_PREFIX = "random-"


@dataclass(frozen=True)
class DrafterChoice:
    """What `--drafter` names: a seeded random drafter of a kind, or a checkpoint folder."""

    random_kind: str | None = None
    folder: Path | None = None


def resolve_drafter(spec: str) -> DrafterChoice | None:
    if spec == "none":
        return None
    if spec.startswith(RANDOM_PREFIX) and spec[len(RANDOM_PREFIX):] in SHIPPED:
        return DrafterChoice(random_kind=spec[len(RANDOM_PREFIX):])
    folder = SHIPPED_DIR / SHIPPED[spec] if spec in SHIPPED else Path(spec)
    if not folder.is_dir():
        raise InvalidRequest(f"--drafter {spec!r}: expected {DRAFTER_HELP}")
    return DrafterChoice(folder=folder)


@dataclass(frozen=True)
class LocalSetup:
    target: str = "default"  # "default" or a checkpoint folder
    drafter: str = "none"  # see DRAFTER_HELP
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on the CPU, bfloat16 on CUDA
    seed: int = 0  # seeds a random drafter

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidRequest(f"--dtype must be one of {', '.join(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return DTYPES[self.dtype]
        return torch.float32 if self.device == "cpu" else torch.bfloat16


def target_dir(spec: str) -> Path:
    if spec == "default":
        return default_target_dir()
    folder = Path(spec)
    if not folder.is_dir():
        raise InvalidRequest(f"--target {spec!r}: no such checkpoint folder")
    return folder


def target_info(model: TargetModel) -> TargetInfo:
    return TargetInfo.from_config(model.config)


def target_head(model: TargetModel) -> TargetHead:
    return TargetHead(embed=model.embed_weight, lm_head=model.lm_head_weight)


def build_drafter(spec: str, info: TargetInfo, head: TargetHead | None, setup: LocalSetup, *,
                  pool_rows: int | None = None) -> Proposer | None:
    """The drafter `--drafter` names; head None gives a seeded stand-in until the target shares its own.
    `pool_rows` sizes a DFlash drafter's context pool (None: its default)."""
    choice = resolve_drafter(spec)
    if choice is None:
        return None
    kw = dict(dtype=setup.torch_dtype, device=setup.device)
    if pool_rows is not None:
        if pool_rows < 1:
            raise InvalidRequest(f"--context-pool-rows must be positive, got {pool_rows}")
        kw["pool_blocks"] = -(-pool_rows // BLOCK_SIZE)
    if choice.random_kind is not None:
        return random_drafter(choice.random_kind, info, head, seed=setup.seed, **kw)
    head = head if head is not None else TargetHead.random(info, seed=0, dtype=kw["dtype"], device=kw["device"])
    return load_drafter(choice.folder, head, target_info=info, **kw)


def make_drafter(spec: str, model: TargetModel, setup: LocalSetup) -> Proposer | None:
    return build_drafter(spec, target_info(model), target_head(model), setup)


def load_parts(setup: LocalSetup) -> tuple[TargetModel, Tokenizer, Proposer | None]:
    """The target, its tokenizer and the drafter `setup` names, loaded into this process."""
    folder = target_dir(setup.target)
    model = load_target(folder, dtype=setup.torch_dtype, device=setup.device)
    return model, Tokenizer.from_dir(folder), make_drafter(setup.drafter, model, setup)


def load_local(setup: LocalSetup, config: EngineConfig = EngineConfig()) -> tuple[Engine, Tokenizer]:
    model, tokenizer, drafter = load_parts(setup)
    engine = Engine(model, drafter, config, eos_ids=tokenizer.eos_token_ids, text_stream=tokenizer.output_stream)
    return engine, tokenizer
