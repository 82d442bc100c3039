"""Two random DFlash drafters for the default target, 4 and 6 layers over its target layers 1, 8, 14, 20
and 27 (the shipped drafter's shapes before and after the tenth session), written to DIR/dflash4 and
DIR/dflash6. `bench/draft_length.py --drafter DIR/dflashN` at fixed draft lengths then prices two more
drafter layers per step (random weights' drafts are rejected, but a step costs the same).

    python tools/random_dflash_pair.py DIR
"""

from __future__ import annotations

import sys

import torch

from specsplit.drafter_service.checkpoint import write_random_drafter
from specsplit.local import target_dir, target_info
from specsplit.target_service.model import load_target

SHIPPED_TARGET_LAYERS = (1, 4, 8, 11, 14, 17, 20, 24, 27)  # the shipped drafter's (fourteenth session)


def main(out: str) -> None:
    info = target_info(load_target(target_dir("default"), dtype=torch.float32, device="cpu"))
    for layers in (4, 6):
        folder = write_random_drafter(f"{out}/dflash{layers}", "dflash", info, seed=0, num_layers=layers,
                                      target_layer_ids=SHIPPED_TARGET_LAYERS)
        print(f"{folder}: random DFlash drafter, {layers} layers")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
