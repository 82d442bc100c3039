"""What the serving benches share: the default model in bf16 on the GPU with the shipped DFlash drafter, the
held-out prompts, and writing a result under --out."""

from __future__ import annotations

import json
import os

import torch

from specsplit.local import LocalSetup, make_drafter, target_dir
from specsplit.shared.tokenizer import Tokenizer
from specsplit.target_service.model import TargetModel, load_target
from specsplit.train_data import HELDOUT_PATH, read_prompts


def default_model() -> tuple[LocalSetup, TargetModel, Tokenizer]:
    """The embedded default target, bf16 on CUDA, its tokenizer, and the settings a drafter is made with."""
    torch.set_grad_enabled(False)
    setup = LocalSetup(drafter="dflash", device="cuda", dtype="bfloat16", seed=0)
    folder = target_dir("default")
    return setup, load_target(folder, dtype=torch.bfloat16, device="cuda"), Tokenizer.from_dir(folder)


def dflash(model: TargetModel, setup: LocalSetup):
    return make_drafter("dflash", model, setup)


def heldout(tokenizer: Tokenizer, count: int | None) -> list[list[int]]:
    """The first `count` held-out prompts (chat, code, math), as the engine takes them."""
    return [p.encode(tokenizer) for p in read_prompts(HELDOUT_PATH, count)]


def save(out: str | None, name: str, result) -> None:
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, name), "w") as f:
            json.dump(result, f, indent=1)
