"""Do two engines' steps overlap on one GPU? Requests served through one engine of N slots against L engines
("lanes") of N/L slots each, in one process, each lane's work on a CUDA stream of its own.

    python bench/lanes_probe.py --device cuda --slots 8 --lanes 1 2 --serving 24 --draft-tree 15

At eight slots an in-process tree step is the device's (sixtieth session, H100: 1.48 ms against target only's
0.73, the host waiting 0.73 ms a step for it), and a step's kernels are latency-bound: each runs ~3 µs on a few
of the GPU's SMs, one after another. Two lanes' steps, each a chain of such kernels on its own stream, could run
side by side, the device's time a step shared between them. Each lane is a whole engine (its KV cache, graphs,
drafter and workspaces; the target's weights shared); the host steps them in turn, one thread: a lane launches
its next chained step, then reads the one before (`Engine._chain_step`), so while it reads, the other lanes'
steps run. Requests are dealt to the lanes in turn, all at the start; each lane admits its own as slots free.

Measured (sixty-second session, H100, 24 held-out prompts through 8 slots, 128 tokens, three rounds): lanes lose.
Target only 9,527 tok/s in one lane, 0.58x in two lanes of 4, 0.33x in four of 2; trees of 15 14,198 tok/s in one
lane, 0.85x in two, 0.69x in four; chains 0.88x in two. The lanes' steps did not overlap enough to pay for the
host stepping each one (two lanes of target only: a step's time each, nearly in series).

Printed per variant (target only and drafted, each with one lane and with L): tokens/s of the timed run, its
ratio to the same drafter's one lane, and how many requests' tokens equal the one lane's (bf16 near-ties may
part them at other batch compositions; float32 on the CPU must keep every one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import dataclass, field

import torch

from specsplit.local import LocalSetup, make_drafter, target_dir
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.tokenizer import Tokenizer
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.model import TargetModel, load_target
from specsplit.target_service.sequence import Request


@dataclass
class Served:
    """One run of every prompt through some lanes."""

    tokens: dict[str, list[int]] = field(default_factory=dict)  # each request's emitted ids, by request index
    seconds: float = 0.0
    rounds: int = 0  # turns of the host through every lane with work
    steps: int = 0  # engine steps, all lanes

    @property
    def emitted(self) -> int:
        return sum(len(ids) for ids in self.tokens.values())

    @property
    def rate(self) -> float:
        return self.emitted / self.seconds if self.seconds else 0.0


def deal(count: int, lanes: int) -> list[list[int]]:
    """Request indices 0..count-1 dealt to `lanes` lanes in turn."""
    if lanes < 1:
        raise ValueError(f"at least one lane, not {lanes}")
    return [list(range(lane, count, lanes)) for lane in range(lanes)]


def lane_slots(slots: int, lanes: int) -> int:
    """Each lane's slots: `slots` shared evenly (the probe compares equal totals)."""
    if lanes < 1 or slots % lanes:
        raise ValueError(f"{slots} slots do not share evenly among {lanes} lanes")
    return slots // lanes


def serve(engines: list[Engine], streams: list["torch.cuda.Stream | None"], prompts: list[list[int]],
          max_tokens: int, tag: str, device: str) -> Served:
    """Every prompt through `engines`, dealt in turn, the host stepping each lane with work in turn, each lane's
    work on its stream (None: the current one, off CUDA)."""
    served = Served()
    for lane, indices in enumerate(deal(len(prompts), len(engines))):
        for i in indices:
            engines[lane].add(Request(f"{tag}{i}", prompts[i], SamplingParams(max_tokens=max_tokens)))
            served.tokens[str(i)] = []
    started = time.perf_counter()
    while any(engine.has_work for engine in engines):
        for engine, stream in zip(engines, streams):
            if not engine.has_work:
                continue
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for event in engine.step():
                    served.tokens[event.request_id[len(tag):]].extend(event.token_ids)
            served.steps += 1
        served.rounds += 1
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    served.seconds = time.perf_counter() - started
    return served


def build_lanes(model: TargetModel, setup: LocalSetup, tokenizer: Tokenizer, lanes: int, slots: int,
                drafted: bool, draft_tree: int) -> tuple[list[Engine], list["torch.cuda.Stream | None"]]:
    """`lanes` engines of `slots` / `lanes` slots sharing `model`, each with a drafter of its own (if `drafted`)
    and, on CUDA, a stream of its own."""
    config = EngineConfig(max_batch=lane_slots(slots, lanes), draft_tree=draft_tree if drafted else 0)
    engines, streams = [], []
    for _ in range(lanes):
        drafter = make_drafter(setup.drafter, model, setup) if drafted else None
        engines.append(Engine(model, drafter, config, eos_ids=tokenizer.eos_token_ids))
        streams.append(torch.cuda.Stream(torch.device(setup.device)) if setup.device.startswith("cuda") else None)
    return engines, streams


def matching(served: Served, reference: Served) -> int:
    """Requests whose tokens equal the reference run's."""
    return sum(served.tokens[key] == ids for key, ids in reference.tokens.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--drafter", default="dflash")
    ap.add_argument("--slots", type=int, default=8, help="slots in all, shared evenly by each variant's lanes")
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 2], help="lane counts to compare (1 first)")
    ap.add_argument("--serving", type=int, default=24, metavar="N", help="held-out prompts served")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-tree", type=int, default=15, help="nodes of the drafted lanes' trees (0: chains)")
    ap.add_argument("--rounds", type=int, default=2, help="timed runs of each variant, alternating (after a warm-up)")
    ap.add_argument("--no-target-only", action="store_true", help="only the drafted lanes")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if 1 not in args.lanes:
        ap.error("--lanes must include 1 (what the others are compared with)")

    setup = LocalSetup(drafter=args.drafter, device=args.device, seed=0)
    folder = target_dir("default")
    model = load_target(folder, dtype=setup.torch_dtype, device=args.device)
    tokenizer = Tokenizer.from_dir(folder)
    from specsplit.train_data import HELDOUT_PATH, read_prompts

    prompts = [p.encode(tokenizer) for p in read_prompts(HELDOUT_PATH, args.serving)]
    kinds = [("drafted", True)] if args.no_target_only else [("target only", False), ("drafted", True)]
    variants = {(kind, lanes): build_lanes(model, setup, tokenizer, lanes, args.slots, drafted, args.draft_tree)
                for kind, drafted in kinds for lanes in args.lanes}
    for (kind, lanes), (engines, streams) in variants.items():  # warm-up: first uses, captures
        serve(engines, streams, prompts, args.max_tokens, "w", args.device)
    runs: dict[tuple[str, int], list[Served]] = {key: [] for key in variants}
    for _ in range(args.rounds):
        for key, (engines, streams) in variants.items():
            runs[key].append(serve(engines, streams, prompts, args.max_tokens, "t", args.device))

    print(f"{args.serving} held-out prompts, {args.max_tokens} tokens, {args.slots} slots in all, "
          f"{'trees of %d' % args.draft_tree if args.draft_tree else 'chains'}, {args.device}, "
          f"{args.rounds} timed rounds (median tok/s)")
    print(f"{'variant':<13}{'lanes':>6}{'slots each':>11}{'tok/s':>10}{'x 1 lane':>10}{'steps/round':>13}"
          f"{'same tokens':>13}")
    record = []
    for (kind, lanes), served in runs.items():
        rates = sorted(s.rate for s in served)
        rate = rates[len(rates) // 2]
        one = sorted(s.rate for s in runs[(kind, 1)])[len(rates) // 2]
        same = matching(served[0], runs[(kind, 1)][0])
        per_round = served[0].steps / served[0].rounds
        print(f"{kind:<13}{lanes:>6}{lane_slots(args.slots, lanes):>11}{rate:>10,.0f}{rate / one:>9.2f}x"
              f"{per_round:>13.2f}{same:>8}/{len(served[0].tokens)}")
        record.append({"kind": kind, "lanes": lanes, "slots_each": lane_slots(args.slots, lanes),
                       "tok_s": [s.rate for s in served], "seconds": [s.seconds for s in served],
                       "rounds": [s.rounds for s in served], "steps": [s.steps for s in served],
                       "same_tokens_as_one_lane": same})
    if "drafted" in dict(kinds) and ("target only", 1) in runs:
        base = sorted(s.rate for s in runs[("target only", 1)])[args.rounds // 2]
        for lanes in args.lanes:
            rate = sorted(s.rate for s in runs[("drafted", lanes)])[args.rounds // 2]
            print(f"drafted, {lanes} lane(s), against target only in one lane: {rate / base:.2f}x")
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "runs": record}, f, indent=1)


if __name__ == "__main__":
    main()
