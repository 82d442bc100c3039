"""Which draft length pays at which batch size: in-process speculative tokens/s for each draft length k,
beside target-only decoding, measured in one run.

    python bench/draft_length.py --device cuda --dtype bfloat16 --batch 1 8 32 64 --drafts 3 5 7 15

A verify costs about the same for 1 or 16 tokens per sequence while the batch leaves the GPU idle, and
grows with its tokens once the batch fills it; the drafts far down a block are rarely accepted. So the
best k shrinks as the batch grows; the table says where, for this GPU and drafter, and the last line
prints the `--drafts-by-batch` schedule it suggests.
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager

from specsplit.kernels import rope
from specsplit.local import LocalSetup, load_parts, make_drafter
from specsplit.target_service.engine import Engine, EngineConfig
from split_bench import run, stream_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--drafter", default="dflash")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--waves", type=int, default=1,
                    help="at B > 1 streams, B x WAVES requests through B slots, the batch kept full until the last "
                         "wave (default 1: a closed batch of B, which drains)")
    ap.add_argument("--drafts", type=int, nargs="+", default=[3, 7, 15], help="draft lengths k >= 1 to compare")
    ap.add_argument("--auto", action="store_true", help="also the engine that learns k per batch size (auto_drafts)")
    ap.add_argument("--also-context-apart", action="store_true",
                    help="also the longest k through a second drafter whose graphed context forward writes each "
                         "layer's k and v in launches of their own (kernels.rope.CONTEXT_IN_ONE_LAUNCH off), beside "
                         "the default's one launch for every layer (row 'K apart')")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.waves < 1:
        ap.error("--waves takes 1 or more")
    if min(args.drafts) < 1:
        ap.error("--drafts: each k must be >= 1 (the target alone is always measured, as k = 0)")
    setup = LocalSetup(drafter=args.drafter, device=args.device, dtype=args.dtype, seed=0)
    model, tokenizer, drafter = load_parts(setup)
    apart = make_drafter(args.drafter, model, setup) if args.also_context_apart else None
    longest = max(args.drafts)
    results, best = {}, {}
    print(f"{'batch':>5} {'k':>4} {'tok/s':>9} {'x target':>8} {'tau':>5} {'ms/step':>7} {'full':>5} {'same':>5}"
          + (f" {'x target while full':>20}" if args.waves > 1 else ""), flush=True)
    for batch in args.batch:
        # one stream: every prompt, served one after another (in bfloat16 a text can part from
        # target-only's at a near-tie, and a draft length's tau is then over another text: one prompt
        # would measure that text as much as the draft length)
        prompts = stream_prompts(batch, args.waves)
        engines = {0: Engine(model, None, EngineConfig(max_batch=batch))}
        engines.update({k: Engine(model, drafter, EngineConfig(max_batch=batch, num_drafts=k)) for k in args.drafts})
        if args.auto:
            engines["auto"] = Engine(model, drafter, EngineConfig(max_batch=batch, auto_drafts=True))
        if apart is not None:
            engines[f"{longest} apart"] = Engine(model, apart, EngineConfig(max_batch=batch, num_drafts=longest))
        for k, engine in engines.items():  # warm-up: every captured shape in use, before any timing
            with context_in_one_launch(k != f"{longest} apart"):
                run(engine, tokenizer, prompts, args.max_tokens, f"w{k}-")
        row, want = {}, None
        for k, engine in engines.items():
            with context_in_one_launch(k != f"{longest} apart"):
                tokens, r = run(engine, tokenizer, prompts, args.max_tokens, f"k{k}-")
            want = tokens if want is None else want  # k = 0 runs first: target-only's texts
            # requests whose text is target-only's (all of them in float32; in bfloat16 near-ties part some)
            r["requests_equal_target_only"] = sum(a == b for a, b in zip(tokens, want))
            row[k] = r
            ratio = r["tokens_per_s"] / row[0]["tokens_per_s"]
            print(f"{batch:>5} {k!s:>4} {r['tokens_per_s']:>9.0f} {ratio:>8.2f} {r['tau']:>5.2f} "
                  f"{r['per_step_ms']['step']:>7.2f} {r['mean_batch'] / batch:>5.2f} "
                  f"{r['requests_equal_target_only']:>2}/{len(prompts)}"
                  + (f" {r['tokens_per_s_while_full'] / row[0]['tokens_per_s_while_full']:>20.2f}"
                     if batch > 1 and r["tokens_per_s_while_full"] is not None else ""), flush=True)
        auto = engines.get("auto")
        if auto is not None:  # what it learned on this batch size
            row["auto"]["learned_k"] = auto.tuner.best(batch) if auto.tuner else None
            row["auto"]["draft_tuner"] = auto.tuner.snapshot() if auto.tuner else None
            print(f"{'':>5} auto learned k = {row['auto']['learned_k']}", flush=True)
            if auto.tuner:
                snap = row["auto"]["draft_tuner"]
                for bucket, measured in snap["buckets"].items():
                    print(f"{'':>5} tuner bucket {bucket}: " + ", ".join(
                        f"k={k} {m['ms']:.2f} ms E={snap['expected_tokens'][k]:.2f} ({m['samples']} steps)"
                        for k, m in measured.items()), flush=True)
        results[f"batch_{batch}"] = {str(k): r for k, r in row.items()}
        best[batch] = max((k for k in row if isinstance(k, int)), key=lambda k: row[k]["tokens_per_s"])
    # --drafts-by-batch caps k from N sequences on, so it can only lower k as batches grow: a best k
    # that rises again is capped at the smaller one before it.
    schedule, last = [], None
    for batch in sorted(best):
        k = best[batch] if last is None else min(best[batch], last)
        if k != last:
            schedule.append(f"{batch}:{k}")
            last = k
    results["fastest_k_by_batch"] = best
    print(json.dumps({"fastest_k_by_batch": best}))
    print("suggested: --drafts-by-batch " + ",".join(schedule))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)


@contextmanager
def context_in_one_launch(on: bool):
    """kernels.rope.CONTEXT_IN_ONE_LAUNCH for one engine's runs (its drafter's graphs keep what they were
    captured with; the row "K apart" is the longest k through the drafter captured with it off)."""
    old = rope.CONTEXT_IN_ONE_LAUNCH
    rope.CONTEXT_IN_ONE_LAUNCH = on
    try:
        yield
    finally:
        rope.CONTEXT_IN_ONE_LAUNCH = old


if __name__ == "__main__":
    main()
