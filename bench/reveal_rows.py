"""Per block row, a DFlash drafter's CE and greedy accuracy when its first r rows are given (a refining pass).

    python bench/reveal_rows.py dflash /path/to/checkpoint --prompts 8 --tokens 64 --reveal 0 1 2 4

Teacher-forced over the target's greedy continuations of the first held-out prompts (float32): blocks
anchored at every 4th generated token, each given r true tokens (`dflash_block_hidden(reveal=)`); rows
1..6 printed, unconditional (row k right or not, whatever rows before it did). Row r+1 given r against
row r+1 of the plain pass shows what the given tokens are worth to the next draft.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from specsplit.drafter_service.base import DraftVocab
from specsplit.drafter_service.training import dflash_block_hidden
from specsplit.local import LocalSetup, make_drafter, target_dir
from specsplit.shared.tokenizer import Tokenizer
from specsplit.target_service.dense import capture_features, generate
from specsplit.target_service.model import CaptureSpec, load_target
from specsplit.train_data import HELDOUT_PATH, read_prompts

ROWS = 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", nargs="+", help="dflash or DFlash checkpoint folders")
    parser.add_argument("--prompts", type=int, default=8, help="the first N held-out prompts")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens generated per prompt")
    parser.add_argument("--reveal", type=int, nargs="+", default=[0, 1, 2, 4], help="rows given")
    args = parser.parse_args()
    folder = target_dir("default")
    model = load_target(folder, dtype=torch.float32, device="cpu")
    tokenizer = Tokenizer.from_dir(folder)
    gen = generate(model, [p.encode(tokenizer) for p in read_prompts(HELDOUT_PATH, args.prompts)], args.tokens)
    batch, width = gen.tokens.shape
    positions = torch.arange(width).expand(batch, width)
    valid = positions < gen.lengths[:, None]
    # The same count of anchors in every sequence, each block's printed rows within its continuation
    span = int((gen.lengths - gen.prompt_lengths).min()) - ROWS - 1
    if span < 0:
        raise SystemExit(f"a continuation ended within {ROWS + 1} tokens: ask more --tokens or other prompts")
    anchors = gen.prompt_lengths[:, None] + 4 * torch.arange(span // 4 + 1)
    for name in args.drafters:
        drafter = make_drafter(name, model, LocalSetup(drafter=name))
        rows = capture_features(model, gen.tokens, gen.lengths,
                                CaptureSpec(layer_ids=drafter.model.cfg.target_layer_ids))
        if drafter.model.cfg.block_size <= ROWS or max(args.reveal) > drafter.model.cfg.block_size - 2:
            raise SystemExit(f"{name}: blocks of {drafter.model.cfg.block_size} hold fewer than {ROWS} drafts, or "
                             f"no row past {max(args.reveal)} given")
        vocab = DraftVocab(drafter.model.d2t, drafter.head.vocab_size)
        if vocab.table is not None:
            raise SystemExit(f"{name}: a drafter over a reduced vocabulary (d2t) has no CE against every label")
        index = anchors[:, :, None] + torch.arange(1, ROWS + 1)
        labels = gen.tokens.gather(1, index.flatten(1)).view_as(index)
        print(f"{name}: {anchors.numel()} blocks")
        for r in args.reveal:
            with torch.no_grad():
                hidden = dflash_block_hidden(drafter.model, drafter.head, rows, gen.tokens, positions, valid,
                                             anchors, reveal=torch.full_like(anchors, r))
                logits = drafter.model.logits(hidden[:, :, 1:ROWS + 1], drafter.head)
            ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
            right = vocab.to_target(logits.argmax(-1)) == labels
            cells = [f"row {k + 1}: given" if k < r else
                     f"row {k + 1}: ce {ce.view_as(labels)[..., k].mean():.2f} acc {right[..., k].float().mean():.2f}"
                     for k in range(ROWS)]
            print(f"  {r} given  " + "  ".join(cells))


if __name__ == "__main__":
    main()
