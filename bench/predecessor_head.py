"""Would a DFlash drafter's drafts gain from seeing the draft before them? A pilot with the drafter frozen.

    python bench/predecessor_head.py [dflash | CHECKPOINT] --train-prompts 192 --eval-prompts 48 --steps 600

A DFlash block drafts its rows in parallel, so row k cannot see which token row k-1 drafted, though it only
counts when that one was right; a refining second pass that sees the leading drafts gained +5.8 % walk tau
(session 41, H100), for a whole second block forward. This asks whether a shallow correction gets some of
that for a few launches: on the frozen drafter's final rows h_k, h'_k = h_k + down(silu(up([h_k; norm(e)])))
with e the target's embedding of the token before row k (the anchor's own for row 1), trained on the true
tokens (the only case that matters for acceptance: row k counts only when the drafts before it were right),
and at inference given the plain pass's drafts (one round), or the corrected ones again (two rounds).

Teacher-forced over the target's greedy continuations (float32, CPU or GPU): training-side prompts train the
correction, held-out ones (chat, code and math) score it by decoding's walk (the steps greedy speculative
decoding would take with these drafts, `evaluate.walk_steps`) and over every anchor. "true" feeds the
correction the true previous token at every row: its ceiling, not a decoder's figure. Prints a table; the
numbers are this script's, not a shipped drafter's.
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.drafter_service.base import DraftVocab
from specsplit.drafter_service.training import dflash_block_hidden
from specsplit.evaluate import walk_steps
from specsplit.local import LocalSetup, load_parts
from specsplit.shared.tokenizer import Tokenizer
from specsplit.target_service.dense import capture_features, generate
from specsplit.target_service.model import CaptureSpec
from specsplit.train import block_targets
from specsplit.train_data import HELDOUT_PATH, Prompt, read_prompts, training_prompts


class Predecessor(nn.Module):
    """h + down(silu(up([h; norm(embed(prev))]))), `down` zero at the start (the drafter's own rows)."""

    def __init__(self, embed: torch.Tensor, hidden: int, inner: int) -> None:
        super().__init__()
        self.embed = embed  # the target's embedding, frozen (not a parameter)
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.up = nn.Linear(2 * hidden, inner)
        self.down = nn.Linear(inner, hidden)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        e = self.norm(F.embedding(prev, self.embed).to(h.dtype))
        return h + self.down(F.silu(self.up(torch.cat([h, e], -1))))


def pick_prompts(prompts: list[Prompt], count: int, seed: int) -> list[Prompt]:
    """`count` prompts, half chat and a quarter each code and math (as many as there are), in a fixed draw."""
    rng = random.Random(seed)
    shares = {"chat": count // 2, "code": count // 4, "math": count - count // 2 - count // 4}
    out = []
    for kind, n in shares.items():
        pool = [p for p in prompts if p.kind == kind]
        out += rng.sample(pool, min(n, len(pool)))
    return out


@torch.no_grad()
def blocks(model, drafter, tokenizer: Tokenizer, prompts: list[Prompt], tokens: int, batch: int,
           max_prompt: int) -> list[dict]:
    """Per prompt: its block rows h [A, γ-1, H] (anchors at every generated token with one after it),
    labels and whether each is real [A, γ-1], the tokens before each row [A, γ-1], and its kind."""
    dm, head = drafter.model, drafter.head
    gamma = dm.cfg.block_size
    out = []
    encoded = [(p, p.encode(tokenizer)) for p in prompts]
    encoded = [(p, ids) for p, ids in encoded if len(ids) <= max_prompt]
    for start in range(0, len(encoded), batch):
        part = encoded[start:start + batch]
        gen = generate(model, [ids for _, ids in part], tokens, eos_ids=tokenizer.eos_token_ids)
        rows = capture_features(model, gen.tokens, gen.lengths, CaptureSpec(layer_ids=dm.cfg.target_layer_ids))
        width = gen.tokens.shape[1]
        positions = torch.arange(width, device=gen.tokens.device).expand(len(part), width)
        valid = positions < gen.lengths[:, None]
        for b, (prompt, _) in enumerate(part):
            first, last = int(gen.prompt_lengths[b]), int(gen.lengths[b]) - 1  # anchors first..last-1
            if last <= first:
                continue
            hs, labels, oks, prevs = [], [], [], []
            for a0 in range(first, last, 64):
                anchors = torch.arange(a0, min(a0 + 64, last), device=gen.tokens.device)[None]
                h = dflash_block_hidden(dm, head, rows[b:b + 1], gen.tokens[b:b + 1], positions[b:b + 1],
                                        valid[b:b + 1], anchors)[0]  # [N, γ, H]
                targets, ok = block_targets(gen.tokens[b:b + 1], gen.lengths[b:b + 1], anchors,
                                            torch.ones_like(anchors, dtype=torch.bool), gamma)
                hs.append(h[:, 1:].float())
                labels.append(targets[0, :, 1:])
                oks.append(ok[0, :, 1:])
                prevs.append(targets[0, :, :-1])  # x_{a+k-1}: the anchor's own token for row 1
            out.append({"kind": prompt.kind, "h": torch.cat(hs), "labels": torch.cat(labels),
                        "ok": torch.cat(oks), "prev": torch.cat(prevs)})
    return out


def drafts_of(dm, head, vocab: DraftVocab, h: torch.Tensor) -> torch.Tensor:
    return vocab.to_target(dm.logits(h, head).argmax(-1))


@torch.no_grad()
def score(dm, head, vocab: DraftVocab, corr: Predecessor | None, data: list[dict], mode: str, rows: int) -> dict:
    """Walk and every-anchor tau (without prefill) by kind, drafting as `mode` says: plain, 1 round, 2 rounds,
    true (the correction given the true previous tokens). The correction drafts the first `rows` rows (those
    it was trained on), the plain pass the rest."""
    tally: dict[str, list[int]] = {}
    for seq in data:
        h, labels, ok, prev = seq["h"], seq["labels"], seq["ok"], seq["prev"]
        matches = []
        for i in range(0, h.shape[0], 128):
            hh, pp = h[i:i + 128], prev[i:i + 128]
            plain = drafts = drafts_of(dm, head, vocab, hh)
            if mode == "true":
                drafts = drafts_of(dm, head, vocab, corr(hh, pp))
            elif mode != "plain":
                for _ in range(1 if mode == "1 round" else 2):
                    given = torch.cat([pp[:, :1], drafts[:, :-1]], 1)  # row 1: the anchor's token; row k: draft k-1
                    drafts = torch.cat([drafts_of(dm, head, vocab, corr(hh, given))[:, :rows], plain[:, rows:]], 1)
            drafts = torch.cat([drafts[:, :rows], plain[:, rows:]], 1)
            hit = (drafts == labels[i:i + 128]) & ok[i:i + 128]
            matches += hit.long().cumprod(1).sum(1).tolist()
        t = tally.setdefault(seq["kind"], [0, 0, 0])
        t[0] += walk_steps(matches, h.shape[1])
        t[1] += len(matches)
        t[2] += sum(matches)
    kinds = {k: {"walk": v[1] / v[0], "every": 1 + v[2] / v[1]} for k, v in sorted(tally.items())}
    steps, toks, hits = (sum(v[i] for v in tally.values()) for i in range(3))
    return {"walk": toks / steps, "every": 1 + hits / toks, "kinds": kinds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter", nargs="?", default="dflash", help="dflash (the shipped one) or a checkpoint")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--train-prompts", type=int, default=192)
    parser.add_argument("--eval-prompts", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens generated per prompt")
    parser.add_argument("--max-prompt", type=int, default=192, help="longest prompt kept, in tokens")
    parser.add_argument("--gen-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=32, help="anchors a training step")
    parser.add_argument("--rows", type=int, default=8, help="block rows trained (the decay weighs later ones little)")
    parser.add_argument("--inner", type=int, default=1536)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--decay", type=float, default=4.0, help="row k weighs exp(-(k-1)/decay)")
    parser.add_argument("--seed", type=int, default=41)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    model, tokenizer, drafter = load_parts(LocalSetup(drafter=args.drafter, device=args.device, dtype="float32"))
    dm, head = drafter.model, drafter.head
    vocab = DraftVocab(dm.d2t, head.vocab_size)
    if vocab.table is not None:
        raise SystemExit("a drafter over a reduced vocabulary (d2t): its labels are not the target's ids")
    for p in dm.parameters():
        p.requires_grad_(False)
    train = blocks(model, drafter, tokenizer, pick_prompts(training_prompts(args.seed), args.train_prompts, args.seed),
                   args.tokens, args.gen_batch, args.max_prompt)
    held = blocks(model, drafter, tokenizer, pick_prompts(read_prompts(HELDOUT_PATH), args.eval_prompts, 0),
                  args.tokens, args.gen_batch, args.max_prompt)
    h = torch.cat([s["h"] for s in train])[:, :args.rows]
    labels = torch.cat([s["labels"] for s in train])[:, :args.rows]
    ok = torch.cat([s["ok"] for s in train])[:, :args.rows]
    prev = torch.cat([s["prev"] for s in train])[:, :args.rows]
    print(f"{len(train)} training sequences ({h.shape[0]} anchors), {len(held)} held-out "
          f"({sum(s['h'].shape[0] for s in held)} anchors); {time.perf_counter() - started:.0f}s")
    corr = Predecessor(head.embed.float(), dm.cfg.decoder.hidden_size, args.inner).to(args.device)
    opt = torch.optim.AdamW(corr.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    weights = torch.exp(-torch.arange(args.rows, dtype=torch.float32, device=h.device) / args.decay)
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(1, args.steps + 1):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, h.shape[0], (args.batch,), generator=gen).to(h.device)
        logits = dm.logits(corr(h[idx], prev[idx]), head)
        w = weights * ok[idx]
        loss = (F.cross_entropy(logits.flatten(0, 1), labels[idx].flatten(), reduction="none") * w.flatten()).sum() \
            / w.sum().clamp(min=1e-6)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == 1:
            print(f"step {step}: loss {loss.item():.3f}, lr {lr:.2e}, {time.perf_counter() - started:.0f}s", flush=True)
    print(f"\n{'drafting':<10} {'walk tau':>9} {'every':>7}  walk by kind (held out)")
    for mode in ("plain", "1 round", "2 rounds", "true"):
        got = score(dm, head, vocab, corr, held, mode, args.rows)
        kinds = "  ".join(f"{k} {v['walk']:.3f}" for k, v in got["kinds"].items())
        print(f"{mode:<10} {got['walk']:>9.3f} {got['every']:>7.3f}  {kinds}", flush=True)
    fit = [score(dm, head, vocab, corr, train[:len(held)], mode, args.rows)["walk"] for mode in ("plain", "true")]
    print(f"(on {min(len(held), len(train))} of its training sequences: walk tau plain {fit[0]:.3f}, "
          f"true {fit[1]:.3f})")
    print(f"total {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
