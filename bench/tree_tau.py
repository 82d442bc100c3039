"""How far would a DFlash drafter's drafts go verified as a tree instead of one chain? No training.

    python bench/tree_tau.py [dflash | CHECKPOINT] --prompts 80 --tokens 128 --budgets 15 31 63 \
        [--calibrate 800] [--decode 16] [--fit-scores 400 --save-scores FOLDER]

A DFlash block drafts its γ-1 rows in one parallel pass, each row's distribution given only the anchor's context,
so the rows' runners-up cost nothing more to draft: a target could verify a tree of them (`shared.tree`) where
it verifies one chain today. Chat is where the shipped drafter falls short of the goal (held-out τ 3.14 against
3.5).

Over the target's greedy continuations of the held-out prompts (float32), per arm, the walk's τ: the tokens a
verify step emits when greedy speculative decoding walks the continuation with that arm's trees
(`tree_eval.walk`; the chain's equals `evaluate.teacher_forced`'s walk). Arms: the chain of 15 drafts
(today's), best-first trees of each budget (the best rank paths of each block), and with `--calibrate P` static
trees (the rank paths the true tokens took most often over P training-side continuations: a shape a captured
verify can keep; `--save-paths FILE` writes them as JSON). `--decode N` also decodes the first N prompts for
real with each arm (`tree_eval.decode`, paged) and checks the output against the target's and the steps against
the walk's. A tree
of N nodes is verified in N+1 rows a sequence where the chain takes 16, which this does not price.

`--fit-scores P` fits draft-tree scores (`drafter_service.tree_scores`) over P training-side continuations'
candidates (`--fit-keep` a row, the engine's 8 by default) and adds best-first trees over them as arms;
`--save-scores FOLDER` writes them where a checkpoint ships them. A checkpoint that ships scores also gets arms
over its own ("tree N shipped").
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from specsplit.drafter_service.tree_scores import fit as fit_scores
from specsplit.local import LocalSetup, load_parts
from specsplit.shared.tree import TREE_KEEP
from specsplit.shared.tokenizer import Tokenizer
from specsplit.target_service.dense import capture_features, generate
from specsplit.target_service.model import CaptureSpec
from specsplit.train_data import HELDOUT_PATH, Prompt, read_prompts, training_prompts
from specsplit.tree_eval import TreePolicy, candidates, chain_policy, decode, frequent_paths, true_ranks, walk


def continuations(model, tokenizer: Tokenizer, prompts: list[Prompt], tokens: int,
                  batch: int) -> list[tuple[Prompt, list[int], list[int]]]:
    """(prompt, its ids, the target's greedy continuation) for each prompt."""
    out = []
    for start in range(0, len(prompts), batch):
        part = prompts[start:start + batch]
        ids = [p.encode(tokenizer) for p in part]
        for prompt, row, full in zip(part, ids, generate(model, ids, tokens, eos_ids=tokenizer.eos_token_ids).rows()):
            out.append((prompt, row, full[len(row):]))
    return out


@torch.no_grad()
def calibration_candidates(model, drafter, data, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every anchor of the continuations: its block rows' `keep` best log-probabilities [N, γ-1, keep] and the
    true tokens' ranks among them [N, γ-1] (-1: not there)."""
    dm, head = drafter.model, drafter.head
    logps, ranks = [], []
    for _, prompt, continuation in data:
        seq = prompt + continuation
        tokens = torch.tensor(seq, device=model.embed_weight.device)
        rows = capture_features(model, tokens[None], torch.tensor([len(seq)], device=tokens.device),
                                CaptureSpec(layer_ids=dm.cfg.target_layer_ids))[0]
        anchors = list(range(len(prompt), len(seq) - 1))
        for start in range(0, len(anchors), 64):
            part = anchors[start:start + 64]
            logp, ids = candidates(dm, head, rows, tokens, part, keep)
            logps.append(logp.float().cpu())
            ranks += [true_ranks(ids[n].cpu(), seq[a + 1:]) for n, a in enumerate(part)]
    return torch.cat(logps), torch.tensor(ranks, dtype=torch.long)


def training_side(tokenizer: Tokenizer, count: int) -> list[Prompt]:
    """The first `count` training-side prompts of up to 192 tokens, in the held-out set's mix of kinds."""
    pool = [p for p in training_prompts(0) if len(p.encode(tokenizer)) <= 192]
    shares = {"chat": count // 2, "code": count * 3 // 10}
    shares["math"] = count - sum(shares.values())
    return [p for kind, n in shares.items() for p in [q for q in pool if q.kind == kind][:n]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter", nargs="?", default="dflash", help="dflash (the shipped one) or a checkpoint")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=80, help="held-out prompts, in the file's order")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens generated per prompt")
    parser.add_argument("--gen-batch", type=int, default=16)
    parser.add_argument("--budgets", type=int, nargs="+", default=[15, 31, 63])
    parser.add_argument("--keep", type=int, default=32, help="candidates a row (a tree reaches no further)")
    parser.add_argument("--calibrate", type=int, default=0, metavar="P",
                        help="also: static trees of the paths taken most often over P training-side prompts")
    parser.add_argument("--save-paths", default=None, metavar="FILE", help="the static trees' rank paths, as JSON")
    parser.add_argument("--decode", type=int, default=0, metavar="N", help="also decode the first N prompts")
    parser.add_argument("--fit-scores", type=int, default=0, metavar="P",
                        help="also: best-first trees over scores fitted on P training-side prompts (`tree_scores`)")
    parser.add_argument("--save-scores", default=None, metavar="FOLDER",
                        help="write the fitted scores as FOLDER/tree_scores.json (a drafter checkpoint's)")
    parser.add_argument("--fit-keep", type=int, default=TREE_KEEP,
                        help="candidates a row the scores are fitted over (the engine's, by default)")
    args = parser.parse_args()
    if min(args.budgets) < 1 or args.keep < 1 or args.fit_keep < 1:
        parser.error("--budgets, --keep and --fit-keep: each at least 1")
    if args.save_scores and not args.fit_scores:
        parser.error("--save-scores writes what --fit-scores fits")
    started = time.perf_counter()
    model, tokenizer, drafter = load_parts(LocalSetup(drafter=args.drafter, device=args.device, dtype="float32"))
    dm, head = drafter.model, drafter.head
    held = continuations(model, tokenizer, read_prompts(HELDOUT_PATH)[:args.prompts], args.tokens, args.gen_batch)
    arms = [chain_policy(dm.cfg.block_size - 1)] + [TreePolicy(budget=n, keep=args.keep) for n in args.budgets]
    if drafter.tree_scores is not None:  # (the checkpoint's own)
        arms += [TreePolicy(budget=n, keep=args.fit_keep, scores=drafter.tree_scores, name=f"tree {n} shipped")
                 for n in args.budgets]
    if args.calibrate:
        side = training_side(tokenizer, args.calibrate)
        _, ranks = calibration_candidates(
            model, drafter, continuations(model, tokenizer, side, args.tokens, args.gen_batch), args.keep)
        print(f"{len(side)} training-side continuations ({len(ranks)} anchors) calibrate the static trees; "
              f"{time.perf_counter() - started:.0f}s")
        arms += [TreePolicy(budget=n, paths=frequent_paths(ranks.tolist(), n)) for n in args.budgets]
        if args.save_paths:
            with open(args.save_paths, "w") as f:
                json.dump({"calibration": {"prompts": len(side), "anchors": len(ranks), "tokens": args.tokens},
                           "paths": {str(a.budget): [list(p) for p in a.paths] for a in arms if a.paths
                                     and str(a).startswith("static")}}, f)
    if args.fit_scores:
        side = training_side(tokenizer, args.fit_scores)
        logp, ranks = calibration_candidates(
            model, drafter, continuations(model, tokenizer, side, args.tokens, args.gen_batch), args.fit_keep)
        scores = fit_scores(logp, ranks)
        scores = replace(scores, fit={**scores.fit, "prompts": len(side), "tokens": args.tokens,
                                      "drafter": args.drafter})
        print(f"{len(side)} training-side continuations ({len(ranks)} anchors) fit the tree scores; "
              f"{time.perf_counter() - started:.0f}s")
        print("b by row: " + " ".join(f"{b:.2f}" for b in scores.b))
        arms += [TreePolicy(budget=n, keep=args.fit_keep, scores=scores) for n in args.budgets]
        if args.save_scores:
            print(f"wrote {scores.save(args.save_scores)}")
    print(f"{len(held)} held-out continuations; {time.perf_counter() - started:.0f}s")
    kinds = sorted({p.kind for p, _, _ in held})
    tally = [{kind: [0, 0] for kind in kinds} for _ in arms]  # per arm and kind: steps, tokens past the prefill's
    for prompt, ids, continuation in held:
        for counts, steps in zip(tally, walk(model, dm, head, ids, continuation, arms)):
            counts[prompt.kind][0] += steps
            counts[prompt.kind][1] += len(continuation) - 1
    print(f"\n{'drafts a step':<16} {'walk tau':>9}  " + "  ".join(f"{k:>6}" for k in kinds))
    for arm, counts in zip(arms, tally):
        rows = [counts[kind] for kind in kinds]
        total = [sum(r[i] for r in rows) for i in (0, 1)]
        print(f"{str(arm):<16} {total[1] / total[0]:>9.3f}  " + "  ".join(f"{r[1] / r[0]:>6.3f}" for r in rows),
              flush=True)
    if args.decode:
        print(f"\ndecoded, the first {args.decode} prompts (tau without the prefill; outputs against the target's)")
        for arm in arms:
            steps = tokens = differing = off_walk = 0
            for _, ids, continuation in held[:args.decode]:
                got = decode(model, dm, head, ids, len(continuation), arm, tokenizer.eos_token_ids, paged=True)
                walked = walk(model, dm, head, ids, continuation, [arm])[0]
                steps, tokens = steps + got.steps, tokens + len(got.tokens) - 1
                differing += got.tokens != continuation
                off_walk += got.steps != walked
            print(f"{str(arm):<16} tau {tokens / steps:.3f}, {differing} outputs differing, "
                  f"{off_walk} step counts off the walk's", flush=True)
    print(f"total {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
