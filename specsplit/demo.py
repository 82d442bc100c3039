"""`specsplit demo`: pick the draft length by measurement, start both services, stream a few prompts
through gRPC with speculation and with the target alone, and show both side by side.

Both passes go through the same target service (a request can turn speculation off), with the same
greedy settings, so their tokens must match; tokens/s is measured at the client, end to end.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace

import torch

from specsplit.calibrate import Calibration, calibrate_local
from specsplit.client import Client
from specsplit.local import LocalSetup
from specsplit.options import MPS_CHOICES
from specsplit.pair import ServiceSpec, spawn
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.sampling import SamplingParams

PROMPTS = [
    "What is speculative decoding, in two sentences?",
    "Write a Python function that checks whether a number is prime.",
    "Give three tips for writing clear documentation.",
]
MAX_TOKENS = 64
CALIBRATION_TOKENS = 32


@dataclass(frozen=True)
class Pass:
    """One prompt generated once, timed at the client."""

    token_ids: tuple[int, ...]
    seconds: float
    steps: int
    drafted: int
    accepted: int

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        return len(self.token_ids) / self.steps if self.steps else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def run_demo(args) -> None:
    if args.drafter == "none":
        raise InvalidRequest("the demo compares speculation with the target alone: give it a drafter")
    started = time.perf_counter()
    spec = ServiceSpec(target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype,
                       seed=args.seed, mps=MPS_CHOICES[args.mps], device_waits=args.device_waits,
                       speculate_below=args.speculate_below)  # (checked before the runs)
    setup = LocalSetup(target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype, seed=args.seed)
    if setup.device == "cpu":
        print(f"cpu: {one_thread_per_process()} intra-op thread(s) in each process (set OMP_NUM_THREADS to change it)",
              flush=True)
    target_args, drafting = split_drafts(calibrate_draft_length(setup), setup.device)
    spec = replace(spec, target_args=target_args)
    print(f"starting the drafter ({spec.drafter}) and target ({spec.target}) services on {spec.device}, "
          f"{drafting} ...", flush=True)
    with spawn(spec) as services:
        print(f"drafter: {services.drafter_address}\ntarget:  {services.target_address}\n", flush=True)
        client = services.client()
        try:
            warm_up(client)
            results = [run_prompt(client, prompt) for prompt in PROMPTS]
        finally:
            client.close()
    print_summary(results, drafting)
    print(f"services stopped; the demo took {time.perf_counter() - started:.0f} s")


def one_thread_per_process() -> int:
    """Unless OMP_NUM_THREADS says otherwise, one intra-op thread here and in the services (they inherit it).

    On a CPU the drafter and target processes take turns on the same cores, and OpenMP workers that
    spin-wait for a core another process holds made generation 6 to 16 times slower at random on a busy
    2-core machine (two threads: target alone 2.8 tok/s, two drafts 0.7; one thread: 17.9 and 11.4),
    measurements that decide nothing. Two threads at their best were no faster than one (18.6 tok/s).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return torch.get_num_threads()


def calibrate_draft_length(setup: LocalSetup) -> Calibration:
    """Calibrate in this process: which draft length is fastest (`split_drafts` says what the split uses)."""
    print(f"measuring which draft length is fastest on {setup.device}: {CALIBRATION_TOKENS} greedy tokens of one "
          "short prompt per setting, best of two rounds, target and drafter in this process ...", flush=True)
    calibration = calibrate_local(setup, max_tokens=CALIBRATION_TOKENS)
    print("\n".join(calibration.table()))
    print(choice_line(calibration) + "\n", flush=True)
    return calibration


def split_drafts(calibration: Calibration, device: str) -> tuple[tuple[str, ...], str]:
    """The target's flags for the split and how the summary names them. The fastest drafting length, at least
    1 so that the split drafts; on a GPU, where that is the longest tried (the drafter's own), no --num-drafts:
    the target then verifies draft trees of that length, as `specsplit up` pairs them (the calibration's steps
    are chains, which trees beat at one stream)."""
    drafting = calibration.fastest_drafting.num_drafts
    if device.startswith("cuda") and drafting == max(t.num_drafts for t in calibration.trials):
        return (), f"{drafting} drafts per step, verified as draft trees"
    return ("--num-drafts", str(drafting)), f"{drafting} drafts per step"


def choice_line(calibration: Calibration) -> str:
    fastest, drafting = calibration.fastest, calibration.fastest_drafting
    if fastest.num_drafts > 0:
        return f"chosen: {fastest.num_drafts} drafts per step, the fastest here."
    return (f"chosen: 0 drafts: on this device the target alone is fastest, so speculation does not pay here "
            f"(serve with `--drafter none`). The demo still runs the split at {drafting.num_drafts} drafts per "
            "step, the fastest draft length, to show it side by side with the target alone.")


def warm_up(client: Client) -> None:
    """The first request of each mode pays one-off costs (the drafter's attach, first forwards): keep them out."""
    for speculative in (True, False):
        client.generate("Hi", SamplingParams(max_tokens=4), chat=True, speculative=speculative)


def run_prompt(client: Client, prompt: str) -> tuple[Pass, Pass]:
    print(f"> {prompt}", flush=True)
    fast = timed(client, prompt, speculative=True, echo=True)
    alone = timed(client, prompt, speculative=False, echo=False)
    print(f"\n  [{row_text(fast, alone)}]\n", flush=True)
    return fast, alone


def timed(client: Client, prompt: str, *, speculative: bool, echo: bool) -> Pass:
    started = time.perf_counter()
    token_ids: list[int] = []
    for chunk in client.stream(prompt, SamplingParams(max_tokens=MAX_TOKENS), chat=True, speculative=speculative):
        token_ids += chunk.token_ids
        if echo:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    s = chunk.stats
    return Pass(tuple(token_ids), time.perf_counter() - started, s.steps, s.drafted, s.accepted)


def row_text(fast: Pass, alone: Pass) -> str:
    return (f"{len(fast.token_ids)} tokens; speculative {fast.tokens_per_s:.1f} tok/s (τ {fast.tau:.2f}, "
            f"acceptance {fast.acceptance:.0%}) vs target alone {alone.tokens_per_s:.1f} tok/s: "
            f"{speedup(fast, alone)}; {'same tokens' if fast.token_ids == alone.token_ids else 'TOKENS DIFFER'}")


def speedup(fast: Pass, alone: Pass) -> str:
    return f"{fast.tokens_per_s / alone.tokens_per_s:.2f}x" if alone.tokens_per_s else "-"


def print_summary(results: list[tuple[Pass, Pass]], drafting: str) -> None:
    print(f"through the services, {drafting}, tokens/s measured at the client:")
    print(f"  {'prompt':>6}  {'tokens':>6}  {'speculative tok/s':>17}  {'target alone tok/s':>18}  {'speedup':>7}  "
          f"{'τ':>5}  {'acceptance':>10}  same tokens")
    rows = [(str(i + 1), fast, alone, "yes" if fast.token_ids == alone.token_ids else "NO")
            for i, (fast, alone) in enumerate(results)]
    same = sum(fast.token_ids == alone.token_ids for fast, alone in results)
    rows.append(("total", combined([f for f, _ in results]), combined([a for _, a in results]),
                 f"{same} of {len(results)}"))
    for name, fast, alone, matched in rows:
        print(f"  {name:>6}  {len(fast.token_ids):>6}  {fast.tokens_per_s:>17.1f}  {alone.tokens_per_s:>18.1f}  "
              f"{speedup(fast, alone):>7}  {fast.tau:>5.2f}  {fast.acceptance:>10.0%}  {matched}")


def combined(passes: list[Pass]) -> Pass:
    return Pass(tuple(t for p in passes for t in p.token_ids), sum(p.seconds for p in passes),
                sum(p.steps for p in passes), sum(p.drafted for p in passes), sum(p.accepted for p in passes))
