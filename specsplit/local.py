"""In-process wiring: a target model, an optional drafter object and the engine, in one process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from drafter_service.checkpoint import load_drafter, random_drafter
from drafter_service.heads import TargetHead, TargetInfo
from shared.errors import InvalidRequest
from shared.gguf_import import default_target_dir
from shared.proposer import Proposer
from shared.tokenizer import Tokenizer
from target_service.engine import Engine, EngineConfig
from target_service.model import TargetModel, load_target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RANDOM_DRAFTERS = ("dflash", "mtp")


@dataclass(frozen=True)
class LocalSetup:
    target: str = "default"  # "default" or a checkpoint folder
    drafter: str = "none"  # none | dflash | mtp (random, seeded) | a checkpoint folder
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


def make_drafter(spec: str, model: TargetModel, setup: LocalSetup) -> Proposer | None:
    if spec == "none":
        return None
    info, head = target_info(model), target_head(model)
    dtype, device = setup.torch_dtype, setup.device
    if spec in RANDOM_DRAFTERS:
        return random_drafter(spec, info, head, seed=setup.seed, dtype=dtype, device=device)
    folder = Path(spec)
    if not folder.is_dir():
        raise InvalidRequest(f"--drafter {spec!r}: expected none, dflash, mtp or a checkpoint folder")
    return load_drafter(folder, head, target_info=info, dtype=dtype, device=device)


def load_local(setup: LocalSetup, config: EngineConfig = EngineConfig()) -> tuple[Engine, Tokenizer]:
    folder = target_dir(setup.target)
    model = load_target(folder, dtype=setup.torch_dtype, device=setup.device)
    tokenizer = Tokenizer.from_dir(folder)
    drafter = make_drafter(setup.drafter, model, setup)
    engine = Engine(model, drafter, config, eos_ids=tokenizer.eos_token_ids, decode=tokenizer.decode)
    return engine, tokenizer
