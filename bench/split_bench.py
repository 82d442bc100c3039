"""Services vs in-process, side by side in one run: tokens/s, Step round trip, row bytes over gRPC.

    python bench/split_bench.py --device cuda --drafter dflash --json-out result.json

The drafter runs as its own process (`specsplit drafter serve`); the target engine runs here, once
with the drafter object in-process, once with the client (`RemoteProposer`: the Step stream over the
drafter's step socket) and once with the Step stream over gRPC, on the same prompts, so the ratios
are measured under the same conditions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace

import torch

from specsplit.kernels import _triton, rope
from specsplit.shared import fused
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.tokenizer import Tokenizer
from specsplit.lifeline import Lifeline
from specsplit.local import LocalSetup, make_drafter, target_dir
from specsplit.mps import MpsServer
from specsplit.shared.serving import wait_healthy
from specsplit.target_service.drafter_client import RemoteProposer
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.model import load_target
from specsplit.target_service.sequence import Request
from specsplit.cli import drafts_by_batch
from step_overhead import free_port, labelled, phase_seconds, served_seconds

PROMPTS = [
    "Explain how a hash map works.", "Write a Python function to reverse a linked list.",
    "List five facts about the Moon.", "What is the difference between TCP and UDP?",
    "Describe the water cycle for a child.", "Write a haiku about autumn.",
    "How do I sort a dictionary by value in Python?", "Summarise the plot of Hamlet in three sentences.",
]


def stream_prompts(streams: int, waves: int = 1) -> list[str]:
    """The prompts a run at `streams` concurrent streams serves. One stream runs every prompt, one after
    another (one prompt's tau is its text's, see draft_length). B streams run `waves` · B requests through
    the engine's B slots, each admitted as another ends: with one wave a closed batch of B that drains,
    its last steps running fewer sequences (more so with speculation, whose sequences end at different
    steps, than target-only, whose all end together); with several, the batch stays full until the last."""
    if streams < 1 or waves < 1:
        raise ValueError("streams >= 1 and waves >= 1 are required")
    if streams == 1:
        return list(PROMPTS)
    count = streams * waves
    return (PROMPTS * -(-count // len(PROMPTS)))[:count]


class StepTimes:
    """Host wall time per decode step, split by phase, from timers around the engine's own methods:
    verify = the target's forward and acceptance (which reads the device back), draft = propose,
    commit = telling the drafter what was accepted (stash/commit/trim or catch-up, and the batched
    context forward in-process). In the split, draft is the Step round trip carrying the commits.
    In-process with device drafts, draft is only the host's launch of the propose (its GPU time is
    waited for in verify's read-back, `_read_drafts`), and a propose prefetched at the end of a step
    counts as draft too."""

    PHASES = {"_verify_forward": "verify", "_sample": "verify", "_read_drafts": "verify", "_propose": "draft",
              "_prefetch_drafts": "draft", "_after_verify": "commit", "_commit_many": "commit",
              "_batched_appends": "commit", "_chain_launch": "draft"}

    def __init__(self, engine: Engine) -> None:
        self.total = {"step": 0.0, "verify": 0.0, "draft": 0.0, "commit": 0.0}
        self.steps = 0
        self.rows = 0  # sequences over those steps
        self.inside = False  # prefill samples too: only time phases inside a decode step
        for name, phase in self.PHASES.items():
            setattr(engine, name, self._timed(getattr(engine, name), phase))
        step = engine._decode_step

        def decode_step(seqs):
            started, self.inside = time.perf_counter(), True
            try:
                return step(seqs)
            finally:
                self.inside = False
                self.total["step"] += time.perf_counter() - started
                self.steps += 1
                self.rows += len(seqs)

        engine._decode_step = decode_step

    def _timed(self, fn, phase: str):
        if phase == "commit" and fn.__name__ == "_batched_appends":  # a context manager: time its exit
            def block():
                cm = fn()

                class Timed:
                    def __enter__(_):
                        return cm.__enter__()

                    def __exit__(_, *exc):
                        started = time.perf_counter()
                        try:
                            return cm.__exit__(*exc)
                        finally:
                            self.total["commit"] += (time.perf_counter() - started) * self.inside
                return Timed()
            return block

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[phase] += (time.perf_counter() - started) * self.inside
        return timed

    def per_step_ms(self) -> dict[str, float]:
        out = {k: 1e3 * v / max(self.steps, 1) for k, v in self.total.items()}
        out["other_host"] = out["step"] - out["verify"] - out["draft"] - out["commit"]
        return out


def run(engine: Engine, tokenizer: Tokenizer, prompts: list[str], max_tokens: int, tag: str):
    reqs = [Request(f"{tag}{i}", tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i, p in enumerate(prompts)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timer = StepTimes(engine)
    counters = engine.counters
    chained, replays, captures = counters.chained, counters.chain_replays, counters.chain_captures  # (a warm-up counted its own)
    capturing = counters.chain_capture_seconds
    started = time.perf_counter()
    events, full = served(engine, reqs)
    elapsed = time.perf_counter() - started
    tokens = [[t for e in events[r.request_id] for t in e.token_ids] for r in reqs]
    stats = [events[r.request_id][-1].stats for r in reqs]
    generated = sum(len(t) for t in tokens)
    return tokens, {"tokens_per_s": generated / elapsed, "seconds": elapsed, "generated": generated,
                    # admission and prefill (packed forwards, drafter attach): the run's time outside decode steps
                    "outside_steps_s": elapsed - timer.total["step"],
                    "tau": sum(s.generated for s in stats) / sum(s.steps for s in stats),
                    # how full the batch was: a closed batch drains (stream_prompts)
                    "mean_batch": timer.rows / max(timer.steps, 1),
                    "steps_by_request": [s.steps for s in stats],
                    "chained_steps": engine.counters.chained - chained,
                    "chained_steps_replayed_whole": engine.counters.chain_replays - replays,
                    "chained_step_captures": engine.counters.chain_captures - captures,
                    # a short run pays for captures a server pays for once: the rate without them beside it
                    "chain_capture_s": counters.chain_capture_seconds - capturing,
                    "tokens_per_s_excluding_captures": generated / (elapsed - (counters.chain_capture_seconds - capturing)),
                    "per_step_ms": timer.per_step_ms(),
                    # with more requests than slots: the rate until the last was admitted, every slot busy
                    # until then (a server's steady state), without the drain after it
                    "tokens_per_s_while_full": None if full is None else full[0] / (full[1] - started)}


def served(engine: Engine, reqs: list[Request]) -> tuple[dict, tuple[int, float] | None]:
    """`engine.generate(reqs)`, and when some requests had to wait for a slot, the tokens emitted by the time
    the last of them was admitted and that time (None when none waited)."""
    for request in reqs:
        engine.add(request)
    out = {r.request_id: [] for r in reqs}
    emitted, full = 0, None
    queued = len(reqs) > engine.config.max_batch  # (added, every request waits for the first step's admission)
    while engine.has_work:
        for event in engine.step():
            out[event.request_id].append(event)
            emitted += len(event.token_ids)
        if queued and full is None and not engine.waiting:
            full = (emitted, time.perf_counter())
    return out, full


# Engines like target_only's and in_process's with one kernel setting changed, side by side (--also-unfolded,
# --also-no-pdl, --also-tables-apart), named by a suffix: the setting's module,
# attribute and value for the variant, and the ratio's name (the default's rate over the variant's)
KERNEL_VARIANTS = {"unfolded": (fused, "FOLD", False, "folded_over_unfolded"),
                   "nopdl": (_triton, "PDL", False, "pdl_over_nopdl"),
                   "tablesapart": (rope, "TABLES_IN_ONE_LAUNCH", False, "one_tables_launch_over_seven")}


@contextmanager
def kernel_setting(engine: str):
    """The setting an engine named *_unfolded, *_nopdl or *_tablesapart captures its graphs and
    launches its kernels with (read at capture and at each eager launch: a graph keeps what it was captured with)."""
    suffix = engine.rsplit("_", 1)[-1]
    if suffix not in KERNEL_VARIANTS:
        yield
        return
    module, attr, value = KERNEL_VARIANTS[suffix][:3]
    old = getattr(module, attr)
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, old)


# The variants' ratios within each round: (name, numerator, denominator), where both ran
VARIANT_RATIOS = (
    ("in_process_trees_over_in_process", "in_process_trees", "in_process"),
    ("in_process_trees_over_target_only", "in_process_trees", "target_only"),
    ("services_trees_over_services", "services_trees", "services"),
    ("services_trees_over_target_only", "services_trees", "target_only"),
    ("services_trees_over_in_process_trees", "services_trees", "in_process_trees"),
    ("services_trees_ahead_over_services_trees", "services_trees_ahead", "services_trees"),
    ("services_trees_both_waits_over_services_trees", "services_trees_both_waits", "services_trees"),
    ("services_trees_both_waits_over_in_process_trees", "services_trees_both_waits", "in_process_trees"),
    ("services_ahead_over_not_ahead", "services", "services_not_ahead"),
    ("services_over_unprepared", "services", "services_unprepared"),
    ("services_over_tail_uncaptured", "services", "services_tail_uncaptured"),
    ("services_over_no_regroup", "services", "services_no_regroup"),
    ("services_device_waits_over_host_polls", "services_device_waits", "services"),
    ("services_device_waits_over_in_process", "services_device_waits", "in_process"),
    ("services_both_waits_over_host_polls", "services_both_waits", "services"),
    ("services_both_waits_over_in_process", "services_both_waits", "in_process"),
    ("services_both_waits_over_target_waits", "services_both_waits", "services_device_waits"),
)


def round_ratios(rates: dict[str, list[float]]) -> dict:
    """Each round's tokens/s of target_only, in_process and services, the ratios within each round, and
    the median of each (a ratio's median over rounds, not a ratio of medians: each round's are side by
    side)."""
    base, local, split = rates["target_only"], rates["in_process"], rates["services"]
    ratios = {"in_process_over_target_only": [b / a for a, b in zip(base, local)],
              "services_over_in_process": [c / b for b, c in zip(local, split)],
              "services_over_target_only": [c / a for a, c in zip(base, split)]}
    for name in ("target_only", "in_process"):
        for suffix, (*_, label) in KERNEL_VARIANTS.items():
            if f"{name}_{suffix}" in rates:
                ratios[f"{name}_{label}"] = [a / b for a, b in zip(rates[name], rates[f"{name}_{suffix}"])]
    # (and each further tree size's, in-process, over the first's: --also-trees N M ...)
    extra = [(f"{name}_over_in_process_trees", name, "in_process_trees") for name in rates
             if name.startswith("in_process_trees_")]
    ratios.update({name: [a / b for a, b in zip(rates[top], rates[bottom])]
                   for name, top, bottom in (*VARIANT_RATIOS, *extra) if top in rates and bottom in rates})
    return {"tokens_per_s": rates, "ratios": ratios,
            "median": {name: statistics.median(values) for name, values in {**rates, **ratios}.items()}}


def summary(batch: int, prompts: list[str], result: dict) -> str:
    """One line of a batch size's result: rates, the ratios (medians over rounds where there were
    several), tau and the speedup as a share of it, and how full the batch was."""
    base, local, split = result["target_only"], result["in_process"], result["services"]
    median = result.get("rounds", {}).get("median", {})
    over_base = median.get("in_process_over_target_only", result["in_process_over_target_only"])
    over_local = median.get("services_over_in_process", result["services_over_in_process"])
    line = (f"batch {batch}, {len(prompts)} requests: target only {base['tokens_per_s']:.0f} tok/s; in-process "
            f"{over_base:.2f}x target only (tau {local['tau']:.2f}, {over_base / local['tau']:.2f} tau); services "
            f"{over_local:.2f}x in-process; mean batch {base['mean_batch']:.2f} / {local['mean_batch']:.2f} / "
            f"{split['mean_batch']:.2f}; {result['requests_differing_from_target_only']} requests differing"
            + (" (ratios: medians of the rounds)" if median else ""))
    if batch > 1 and base["tokens_per_s_while_full"] is not None:
        full = [r["tokens_per_s_while_full"] for r in (base, local, split)]
        over = result.get("rounds_while_full", {}).get("median", {})
        over_base = over.get("in_process_over_target_only", full[1] / full[0])
        over_local = over.get("services_over_in_process", full[2] / full[1])
        line += (f"; while every slot was busy: target only {full[0]:.0f} tok/s, in-process {over_base:.2f}x "
                 f"({over_base / local['tau']:.2f} tau), services {over_local:.2f}x in-process")
    if "in_process_trees_over_target_only" in result:
        over = median.get("in_process_trees_over_target_only", result["in_process_trees_over_target_only"])
        line += (f"; draft trees of {result['draft_tree_nodes']} nodes in-process {over:.2f}x target only (tau "
                 f"{result['in_process_trees']['tau']:.2f}, {over / result['in_process_trees']['tau']:.2f} tau), "
                 f"{median.get('in_process_trees_over_in_process', result['in_process_trees_over_in_process']):.2f}x "
                 f"chains, {result['requests_differing_trees_vs_target_only']} requests differing")
    for name in (key for key in result if key.startswith("in_process_trees_") and key[17:].isdigit()):
        over = median.get(f"{name}_over_in_process_trees", result[f"{name}_over_in_process_trees"])
        line += f"; trees of {name[17:]} nodes in-process {over:.2f}x those of {result['draft_tree_nodes']}"
    if "services_trees_over_target_only" in result:
        trees = result["services_trees"]
        over = median.get("services_trees_over_target_only", result["services_trees_over_target_only"])
        line += (f"; draft trees through the services {over:.2f}x target only (tau {trees['tau']:.2f}), "
                 f"{median.get('services_trees_over_services', result['services_trees_over_services']):.2f}x the "
                 f"services' chains, "
                 f"{median.get('services_trees_over_in_process_trees', result['services_trees_over_in_process_trees']):.2f}x "
                 f"in-process trees, "
                 f"{result['requests_differing_services_trees_vs_target_only']} requests differing")
    if "services_trees_ahead_over_services_trees" in result:
        name = "services_trees_ahead_over_services_trees"
        over = median.get(name, result[name])
        line += (f"; trees sent ahead {over:.2f}x not ahead, "
                 f"{result['requests_differing_services_trees_ahead_vs_target_only']} requests differing")
    if "services_over_no_regroup" in result:
        line += f"; services {median.get('services_over_no_regroup', result['services_over_no_regroup']):.2f}x without regroup"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--drafter", default="dflash")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="concurrent requests per engine step")
    ap.add_argument("--waves", type=int, default=1,
                    help="at B > 1 streams, B x WAVES requests through the engine's B slots, each admitted as "
                         "another ends, so the batch stays full until the last wave (default 1: a closed batch "
                         "of B, which drains)")
    ap.add_argument("--drafts-by-batch", type=drafts_by_batch, default=(), metavar="N:K,...",
                    help="the engine's draft length by batch size, in every mode (default: the drafter's most)")
    ap.add_argument("--auto", action="store_true", help="the engines learn their draft length (--num-drafts auto)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--also-step-by-step", action="store_true",
                    help="also run target-only and in-process with EngineConfig(decode_ahead=False), side by side")
    ap.add_argument("--also-trees", type=int, nargs="+", default=[0], metavar="N",
                    help="an in-process engine verifying draft trees of N nodes (EngineConfig.draft_tree), and one "
                         "through the services (the drafter answering its rows' candidates), in the rounds; further "
                         "counts (--also-trees 31 15 63): in-process engines of those too, beside the first")
    ap.add_argument("--also-trees-ahead", action="store_true",
                    help="(with --also-trees) also through the services with each tree step's next candidates asked "
                         "for as it launches (RemoteProposer(trees_ahead=True)), in the rounds")
    ap.add_argument("--no-chain", action="store_true", help="every engine with EngineConfig(chain_steps=False)")
    ap.add_argument("--also-unchained", action="store_true",
                    help="also run in-process and through the services with EngineConfig(chain_steps=False), "
                         "side by side")
    ap.add_argument("--also-not-ahead", action="store_true",
                    help="also run the services with each chained propose sent only when its step launches "
                         "(RemoteProposer(chain_ahead=False)), side by side, in every round")
    ap.add_argument("--also-device-waits", action="store_true",
                    help="also run the services with the target's stream waiting on the device for each chained "
                         "step's drafts (RemoteProposer(device_waits=True)), side by side, in every round")
    ap.add_argument("--also-tail-uncaptured", action="store_true",
                    help="also the services with what follows each chained step's drafts run uncaptured "
                         "(EngineConfig(chain_capture_remote=False); the services replay it as one graph of the "
                         "target's), side by side, in every round")
    ap.add_argument("--also-no-regroup", action="store_true",
                    help="also the services with EngineConfig(chain_regroup=False): a batch that changed (a request "
                         "ended or arrived) waits for a chained propose of its own")
    ap.add_argument("--also-unprepared", action="store_true",
                    help="also the services through a second drafter service with --no-prepare-chains (each chained "
                         "step's host work after the target's writes are seen done), side by side, in every round")
    ap.add_argument("--also-both-waits", action="store_true",
                    help="also the services with both streams waiting on the device: a third drafter service with "
                         "--device-waits --max-targets 1 (its stream waits for the target's writes) and the target's "
                         "stream waiting for the drafts (RemoteProposer(device_waits=True)), side by side, in every round")
    ap.add_argument("--host-flags", action=argparse.BooleanOptionalAction, default=True,
                    help="with --also-device-waits / --also-both-waits, the DONE buffer in a host page passed over the "
                         "step socket (a wait released by a store of the host's CPU), else in the target's device "
                         "memory (default: on, as the services)")
    ap.add_argument("--also-unfolded", action="store_true",
                    help="also target-only and in-process with their engines' graphs captured without the few-rows "
                         "kernel's folds (shared.fused.FOLD, read at capture), side by side; the in-process engine "
                         "shares the drafter, whose own graphs the first run captured with them")
    ap.add_argument("--also-no-pdl", action="store_true",
                    help="also target-only and in-process with their engines' Triton kernels launched without "
                         "programmatic dependent launch (kernels._triton.PDL, read at capture and at each eager "
                         "launch), side by side; the in-process engine shares the drafter, whose own graphs the "
                         "first run captured with it")
    ap.add_argument("--also-tables-apart", action="store_true",
                    help="also target-only and in-process with their engines' rotary cos/sin tables computed by "
                         "torch's seven launches (kernels.rope.TABLES_IN_ONE_LAUNCH off, read at capture), side by "
                         "side; the in-process engine shares the drafter, whose own graphs the first run captured "
                         "with the one launch")
    ap.add_argument("--also-uncaptured", action="store_true",
                    help="also run in-process with EngineConfig(chain_capture=0) (chained steps, each "
                         "piece its own graph), side by side")
    ap.add_argument("--chain-capture", type=int, default=None,
                    help="EngineConfig.chain_capture for every engine: the most sequences of a chained step "
                         "captured whole (default: the engine's)")
    ap.add_argument("--drafter-profile", nargs=2, default=None, metavar=("FIRST:LAST", "PATH"),
                    help="the drafter service records those Step messages with the torch profiler into PATH "
                         "(its --profile-steps / --profile-out)")
    ap.add_argument("--drafter-chain-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="the drafter service replays chained steps as one CUDA graph each (its --chain-graphs, "
                         "on by default)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run target-only, in-process and services this many times in turn (after the first "
                         "round, which everything else reports): each round's tokens/s and ratios, and their "
                         "medians (runs of one call differ by up to ~10%%)")
    ap.add_argument("--mps", action="store_true",
                    help="this process and the drafters as clients of a private NVIDIA MPS server (specsplit.mps, "
                         "as `specsplit up --mps`): every engine, in-process ones too, runs under it")
    ap.add_argument("--drafter-profile-host", action="store_true",
                    help="with --drafter-profile: the host only, with Python stacks (its --profile-host)")
    args = ap.parse_args()
    args.also_trees, args.more_trees = args.also_trees[0], args.also_trees[1:]
    if args.rounds < 1:
        ap.error("--rounds takes 1 or more")
    if args.waves < 1:
        ap.error("--waves takes 1 or more")
    mps = None
    if args.mps:  # before this process's CUDA context is made: it is a client of the server, or of none
        if torch.cuda.is_initialized():
            ap.error("--mps: CUDA was initialized before the server started")
        lifeline = Lifeline()
        mps = MpsServer(lifeline)
        os.environ.update(mps.env)  # (the drafters started below inherit it)
    setup = LocalSetup(drafter=args.drafter, device=args.device, dtype=args.dtype, seed=0)
    folder = target_dir(setup.target)
    model = load_target(folder, dtype=setup.torch_dtype, device=setup.device)
    tokenizer = Tokenizer.from_dir(folder)
    sock = f"unix:{tempfile.mkdtemp(prefix='specsplit-bench-')}/drafter.sock"
    port = free_port()
    metrics = f"http://127.0.0.1:{port}/metrics"
    cmd = [sys.executable, "-m", "specsplit", "drafter", "serve", "--listen", sock, "--drafter", args.drafter,
           "--device", args.device, "--seed", "0", "--metrics-port", str(port)] + \
        (["--dtype", args.dtype] if args.dtype else []) + ([] if args.drafter_chain_graphs else ["--no-chain-graphs"]) + \
        (["--profile-steps", args.drafter_profile[0], "--profile-out", args.drafter_profile[1]]
         + (["--profile-host"] if args.drafter_profile_host else []) if args.drafter_profile else [])
    drafter_procs = [subprocess.Popen(cmd)]
    # (--also-unprepared) a second drafter service, each chained step's host work after the target's writes
    second = f"unix:{tempfile.mkdtemp(prefix='specsplit-bench-')}/drafter.sock" if args.also_unprepared else ""
    if args.also_unprepared:
        drafter_procs.append(subprocess.Popen(cmd[:cmd.index("--listen") + 1] + [second] + cmd[cmd.index("--listen") + 2:]
                                              + ["--no-prepare-chains", "--metrics-port", str(free_port())]))
    # (--also-both-waits) a third, whose stream waits for the target's writes on the device
    third = f"unix:{tempfile.mkdtemp(prefix='specsplit-bench-')}/drafter.sock" if args.also_both_waits else ""
    third_metrics = ""
    if args.also_both_waits:
        third_port = free_port()
        third_metrics = f"http://127.0.0.1:{third_port}/metrics"
        drafter_procs.append(subprocess.Popen(cmd[:cmd.index("--listen") + 1] + [third] + cmd[cmd.index("--listen") + 2:]
                                              + ["--device-waits", "--max-targets", "1", "--metrics-port", str(third_port)]))
    # (--also-trees with --also-both-waits) a fourth like the third, for the services' trees sent ahead with both
    # streams waiting on the device (one target a drafter: two would take each other's stream)
    fourth = f"unix:{tempfile.mkdtemp(prefix='specsplit-bench-')}/drafter.sock" \
        if args.also_both_waits and args.also_trees else ""
    fourth_metrics = ""
    if fourth:
        fourth_port = free_port()
        fourth_metrics = f"http://127.0.0.1:{fourth_port}/metrics"
        drafter_procs.append(subprocess.Popen(cmd[:cmd.index("--listen") + 1] + [fourth] + cmd[cmd.index("--listen") + 2:]
                                              + ["--device-waits", "--max-targets", "1", "--metrics-port",
                                                 str(fourth_port)]))
    try:
        wait_healthy(sock, 300)
        remote = RemoteProposer(sock, device=setup.device, dtype=setup.torch_dtype,
                                head=(model.embed_weight, model.lm_head_weight))
        # The same drafter with the Step stream over gRPC, beside the step socket's (services)
        over_grpc = RemoteProposer(sock, device=setup.device, dtype=setup.torch_dtype,
                                   head=(model.embed_weight, model.lm_head_weight), step_socket=False)
        # ... and one that sends each chained propose only when its step launches (--also-not-ahead)
        not_ahead = RemoteProposer(sock, device=setup.device, dtype=setup.torch_dtype,
                                   head=(model.embed_weight, model.lm_head_weight),
                                   chain_ahead=False) if args.also_not_ahead else None
        # ... and one whose stream waits on the device for the chained drafts (--also-device-waits)
        device_waits = RemoteProposer(sock, device=setup.device, dtype=setup.torch_dtype,
                                      head=(model.embed_weight, model.lm_head_weight),
                                      device_waits=True, host_flags=args.host_flags) if args.also_device_waits else None
        # ... and one whose engine runs what follows each chained step's drafts uncaptured (--also-tail-uncaptured)
        tail_uncaptured = RemoteProposer(sock, device=setup.device, dtype=setup.torch_dtype,
                                         head=(model.embed_weight, model.lm_head_weight)) if args.also_tail_uncaptured else None
        # ... and one whose engine takes the propose sent ahead only for the same batch (--also-no-regroup)
        no_regroup = RemoteProposer(sock, device=setup.device, dtype=setup.torch_dtype,
                                    head=(model.embed_weight, model.lm_head_weight)) if args.also_no_regroup else None
        # ... and one asking for draft trees' candidates (--also-trees: the services' trees)
        remote_trees = RemoteProposer(sock, device=setup.device, dtype=setup.torch_dtype,
                                      head=(model.embed_weight, model.lm_head_weight),
                                      tree_keep=EngineConfig.draft_tree_keep) if args.also_trees else None
        trees_ahead = RemoteProposer(sock, device=setup.device, dtype=setup.torch_dtype,
                                     head=(model.embed_weight, model.lm_head_weight), trees_ahead=True,
                                     tree_keep=EngineConfig.draft_tree_keep) \
            if args.also_trees and args.also_trees_ahead else None
        # ... and one to the second drafter service (--also-unprepared)
        if args.also_unprepared:
            wait_healthy(second, 300)
        unprepared = RemoteProposer(second, device=setup.device, dtype=setup.torch_dtype,
                                    head=(model.embed_weight, model.lm_head_weight)) if args.also_unprepared else None
        # ... and one to the third, both streams waiting on the device (--also-both-waits)
        if args.also_both_waits:
            wait_healthy(third, 300)
        both_waits = RemoteProposer(third, device=setup.device, dtype=setup.torch_dtype,
                                    head=(model.embed_weight, model.lm_head_weight),
                                    device_waits=True, host_flags=args.host_flags) if args.also_both_waits else None
        # ... and trees with candidates sent ahead to the fourth (--also-trees with --also-both-waits): neither
        # host waits for the other's GPU work before it launches its own
        if fourth:
            wait_healthy(fourth, 300)
        trees_both_waits = RemoteProposer(fourth, device=setup.device, dtype=setup.torch_dtype,
                                          head=(model.embed_weight, model.lm_head_weight), device_waits=True,
                                          host_flags=args.host_flags, trees_ahead=True,
                                          tree_keep=EngineConfig.draft_tree_keep) \
            if fourth else None
        results = {"device": args.device, "drafter": args.drafter, "transport": remote.mode,
                   "step_transport": remote.step_transport, "waves": args.waves, "mps": args.mps,
                   "done_in_host_page": [r._conn is not None and r._conn.page is not None
                                         and r._conn.done is r._conn.page
                                         for r in (device_waits, both_waits, trees_both_waits) if r is not None]}
        if results["done_in_host_page"]:
            print(f"device waits' DONE buffers in the host page: {results['done_in_host_page']}", flush=True)
        local_drafter = make_drafter(args.drafter, model, setup)
        for batch in args.batch:
            prompts = stream_prompts(batch, args.waves)
            conf = EngineConfig(max_batch=batch, drafts_by_batch=args.drafts_by_batch, auto_drafts=args.auto,
                                chain_steps=not args.no_chain)
            if args.chain_capture is not None:
                conf = replace(conf, chain_capture=args.chain_capture)
            local_engine, split_engine = Engine(model, local_drafter, conf), Engine(model, remote, conf)
            # Warm-up on the same shapes: the drafter captures its graphs per size bucket on first use.
            # (With --auto, the same engines go on: what the warm-up taught their tuners is kept.)
            run(local_engine, tokenizer, prompts, args.max_tokens, "warm")
            run(split_engine, tokenizer, prompts, args.max_tokens, "warm")
            grpc_engine = Engine(model, over_grpc, conf)
            run(grpc_engine, tokenizer, prompts, args.max_tokens, "warm")
            base_engine = Engine(model, None, conf)
            base_tokens, base = run(base_engine, tokenizer, prompts, args.max_tokens, "t")
            local_tokens, local = run(local_engine, tokenizer, prompts, args.max_tokens, "l")
            remote.link.step_seconds.clear()
            bytes_before = remote.link.inline_row_bytes
            served_before, ahead_before = served_seconds(metrics), remote.link.sent_ahead
            phases_before = phase_seconds(metrics)
            graphs_before = labelled(metrics, "chain_graph_steps_total", "outcome")
            drafts_ahead_before, on_device_before = remote.link.drafts_ahead, remote.link.drafts_on_device
            chain_sent_before, chain_taken_before = remote.link.chain_sent_ahead, remote.link.chain_taken_ahead
            regrouped_before = remote.link.chain_taken_regrouped
            split_tokens, split = run(split_engine, tokenizer, prompts, args.max_tokens, "s")
            served_after = served_seconds(metrics)
            phases_after = phase_seconds(metrics)
            graphs_after = labelled(metrics, "chain_graph_steps_total", "outcome")
            steps = sorted(remote.link.step_seconds)
            over_grpc.link.step_seconds.clear()
            grpc_tokens, grpc_split = run(grpc_engine, tokenizer, prompts, args.max_tokens, "g")
            grpc_steps = over_grpc.link.step_seconds
            plain = {}
            if args.also_step_by_step:  # steps launched ahead (the default) against none, same run
                step_conf = replace(conf, decode_ahead=False)
                plain_local = Engine(model, local_drafter, step_conf)
                run(plain_local, tokenizer, prompts, args.max_tokens, "warm")
                plain_base_tokens, plain_base = run(Engine(model, None, step_conf), tokenizer, prompts, args.max_tokens, "t")
                plain_local_tokens, plain_in = run(plain_local, tokenizer, prompts, args.max_tokens, "l")
                plain = {"target_only_step_by_step": plain_base, "in_process_step_by_step": plain_in,
                         "target_only_ahead_over_step_by_step": base["tokens_per_s"] / plain_base["tokens_per_s"],
                         "in_process_ahead_over_step_by_step": local["tokens_per_s"] / plain_in["tokens_per_s"],
                         "step_by_step_same_tokens": plain_base_tokens == base_tokens and plain_local_tokens == local_tokens}
            # The in-process engine beside itself with one setting changed, same run: chained steps (the
            # default) against none, and chained steps captured whole (the default) against piece by piece.
            variants = ([("chained", "unchained", replace(conf, chain_steps=False))] if args.also_unchained else []) \
                + ([("captured", "uncaptured", replace(conf, chain_capture=0))] if args.also_uncaptured else [])
            for default, other, changed in variants:
                engine = Engine(model, local_drafter, changed)
                run(engine, tokenizer, prompts, args.max_tokens, "warm")
                other_tokens, result = run(engine, tokenizer, prompts, args.max_tokens, "l")
                plain.update({f"in_process_{other}": result,
                              f"in_process_{default}_over_{other}": local["tokens_per_s"] / result["tokens_per_s"],
                              f"in_process_{default}_over_{other}_excluding_captures":
                                  local["tokens_per_s_excluding_captures"] / result["tokens_per_s_excluding_captures"],
                              f"requests_differing_{default}_vs_{other}": sum(
                                  a != b for a, b in zip(local_tokens, other_tokens))})
            kernel_engines = {}  # the engines' graphs with one kernel setting changed (KERNEL_VARIANTS), same run
            chosen = (("unfolded", args.also_unfolded), ("nopdl", args.also_no_pdl),
                      ("tablesapart", args.also_tables_apart))
            for suffix in [s for s, on in chosen if on]:
                label = KERNEL_VARIANTS[suffix][3]
                for name, drafter, default, default_tokens in (("target_only", None, base, base_tokens),
                                                               ("in_process", local_drafter, local, local_tokens)):
                    variant = f"{name}_{suffix}"
                    with kernel_setting(variant):  # (the drafter is the in-process run's: its graphs are its own)
                        engine = kernel_engines[variant] = Engine(model, drafter, conf)
                        run(engine, tokenizer, prompts, args.max_tokens, "warm")
                        other_tokens, result = run(engine, tokenizer, prompts, args.max_tokens, name[0])
                    ratio = default["tokens_per_s"] / result["tokens_per_s"]
                    plain.update({variant: result, f"{name}_{label}": ratio,
                                  f"requests_differing_{name}_{label.replace('_over_', '_vs_')}": sum(
                                      a != b for a, b in zip(default_tokens, other_tokens))})
                    print(f"batch {batch} {name}: {default['tokens_per_s']:.0f} tok/s as default, "
                          f"{result['tokens_per_s']:.0f} {suffix} ({label} {ratio:.3f}x)", flush=True)
            if args.also_unchained:  # the services too: their steps chained (StepRequest.chain) or step by step
                engine = Engine(model, remote, replace(conf, chain_steps=False))
                run(engine, tokenizer, prompts, args.max_tokens, "warm")
                other_tokens, result = run(engine, tokenizer, prompts, args.max_tokens, "s")
                plain.update({"services_unchained": result,
                              "services_chained_over_unchained": split["tokens_per_s"] / result["tokens_per_s"],
                              "requests_differing_services_chained_vs_unchained": sum(
                                  a != b for a, b in zip(split_tokens, other_tokens))})
            engines = {"target_only": base_engine, "in_process": local_engine, "services": split_engine}
            rates = {name: [r["tokens_per_s"]] for name, r in (("target_only", base), ("in_process", local),
                                                              ("services", split))}
            if args.also_trees:  # draft trees, in-process, against its chains and target only (in the rounds)
                engine = engines["in_process_trees"] = Engine(model, local_drafter,
                                                              replace(conf, draft_tree=args.also_trees))
                run(engine, tokenizer, prompts, args.max_tokens, "warm")
                tree_tokens, result = run(engine, tokenizer, prompts, args.max_tokens, "l")
                rates["in_process_trees"] = [result["tokens_per_s"]]
                plain.update({"in_process_trees": result, "draft_tree_nodes": args.also_trees,
                              "in_process_trees_over_in_process": result["tokens_per_s"] / local["tokens_per_s"],
                              "in_process_trees_over_target_only": result["tokens_per_s"] / base["tokens_per_s"],
                              "requests_differing_trees_vs_target_only": sum(
                                  a != b for a, b in zip(base_tokens, tree_tokens))})
                print(f"batch {batch}: draft trees of {args.also_trees} nodes in-process {result['tokens_per_s']:.0f} "
                      f"tok/s (tau {result['tau']:.2f}, {result['chained_steps']} chained, "
                      f"{result['chained_steps_replayed_whole']} replayed whole), "
                      f"{plain['in_process_trees_over_target_only']:.2f}x target only, "
                      f"{plain['in_process_trees_over_in_process']:.2f}x chains (tau {local['tau']:.2f})", flush=True)
                for nodes in args.more_trees:  # (--also-trees N M ...: in-process trees of M beside N's)
                    name = f"in_process_trees_{nodes}"
                    engine = engines[name] = Engine(model, local_drafter, replace(conf, draft_tree=nodes))
                    run(engine, tokenizer, prompts, args.max_tokens, "warm")
                    more_tokens, more = run(engine, tokenizer, prompts, args.max_tokens, "l")
                    rates[name] = [more["tokens_per_s"]]
                    plain.update({name: more,
                                  f"{name}_over_in_process_trees": more["tokens_per_s"] / result["tokens_per_s"],
                                  f"{name}_over_target_only": more["tokens_per_s"] / base["tokens_per_s"],
                                  f"requests_differing_trees_{nodes}_vs_target_only": sum(
                                      a != b for a, b in zip(base_tokens, more_tokens))})
                    print(f"batch {batch}: draft trees of {nodes} nodes in-process {more['tokens_per_s']:.0f} tok/s "
                          f"(tau {more['tau']:.2f}), {plain[f'{name}_over_target_only']:.2f}x target only, "
                          f"{plain[f'{name}_over_in_process_trees']:.2f}x trees of {args.also_trees}", flush=True)
                engine = engines["services_trees"] = Engine(model, remote_trees,
                                                            replace(conf, draft_tree=args.also_trees))
                run(engine, tokenizer, prompts, args.max_tokens, "warm")
                services_tree_tokens, result = run(engine, tokenizer, prompts, args.max_tokens, "s")
                rates["services_trees"] = [result["tokens_per_s"]]
                plain.update({"services_trees": result,
                              "services_trees_over_services": result["tokens_per_s"] / split["tokens_per_s"],
                              "services_trees_over_target_only": result["tokens_per_s"] / base["tokens_per_s"],
                              "services_trees_over_in_process_trees":
                                  result["tokens_per_s"] / plain["in_process_trees"]["tokens_per_s"],
                              "requests_differing_services_trees_vs_target_only": sum(
                                  a != b for a, b in zip(base_tokens, services_tree_tokens))})
                print(f"batch {batch}: draft trees of {args.also_trees} nodes through the services "
                      f"{result['tokens_per_s']:.0f} tok/s (tau {result['tau']:.2f}), "
                      f"{plain['services_trees_over_target_only']:.2f}x target only, "
                      f"{plain['services_trees_over_services']:.2f}x the services' chains", flush=True)
                def trees_variant(name: str, proposer: RemoteProposer, tag: str) -> dict:
                    """The services' trees through another proposer, warmed and run once beside the rest (its
                    engine goes on with the rounds): its result, with its ratio over the services' trees"""
                    engine = engines[name] = Engine(model, proposer, replace(conf, draft_tree=args.also_trees))
                    run(engine, tokenizer, prompts, args.max_tokens, "warm")
                    tokens, result = run(engine, tokenizer, prompts, args.max_tokens, tag)
                    rates[name] = [result["tokens_per_s"]]
                    plain.update({name: result, f"{name}_over_services_trees":
                                  result["tokens_per_s"] / plain["services_trees"]["tokens_per_s"],
                                  f"requests_differing_{name}_vs_target_only": sum(
                                      a != b for a, b in zip(base_tokens, tokens))})
                    return result

                if trees_ahead is not None:
                    result = trees_variant("services_trees_ahead", trees_ahead, "a")
                    plain["trees_taken_ahead"] = trees_ahead.link.chain_taken_ahead
                    print(f"batch {batch}: draft trees of {args.also_trees} nodes through the services, sent ahead "
                          f"{result['tokens_per_s']:.0f} tok/s (tau {result['tau']:.2f}, "
                          f"{trees_ahead.link.chain_taken_ahead} taken ahead so far), "
                          f"{plain['services_trees_ahead_over_services_trees']:.2f}x not ahead", flush=True)
                if trees_both_waits is not None:
                    result = trees_variant("services_trees_both_waits", trees_both_waits, "t")
                    plain.update({"services_trees_both_waits_over_in_process_trees":
                                  result["tokens_per_s"] / plain["in_process_trees"]["tokens_per_s"],
                                  "trees_both_waits_taken_ahead": trees_both_waits.link.chain_taken_ahead,
                                  # the fourth drafter's chained steps so far by how they ran ("waited": its stream
                                  # waited on the device), warm-up runs included
                                  "trees_both_waits_drafter_chain_graph_steps": labelled(
                                      fourth_metrics, "chain_graph_steps_total", "outcome")})
                    print(f"batch {batch}: draft trees of {args.also_trees} nodes through the services, sent ahead, "
                          f"both streams waiting on the device {result['tokens_per_s']:.0f} tok/s (tau "
                          f"{result['tau']:.2f}, {trees_both_waits.link.chain_taken_ahead} taken ahead so far), "
                          f"{plain['services_trees_both_waits_over_services_trees']:.2f}x the services' trees, "
                          f"{plain['services_trees_both_waits_over_in_process_trees']:.2f}x in-process trees",
                          flush=True)
            for name, engine in kernel_engines.items():  # (their graphs were all captured above, each its way)
                engines[name] = engine
                rates[name] = [plain[name]["tokens_per_s"]]

            def services_variant(name: str, proposer: RemoteProposer, config: EngineConfig, before=None):
                """The services with one thing changed, warmed and run once beside the rest (its engine goes
                on with the rounds; `before(engine)` is read just before the measured run): the engine, its
                result, what `before` returned, and how many requests' tokens differ from the services'."""
                engine = engines[name] = Engine(model, proposer, config)
                run(engine, tokenizer, prompts, args.max_tokens, "warm")
                seen = before(engine) if before is not None else None
                other_tokens, result = run(engine, tokenizer, prompts, args.max_tokens, "s")
                rates[name] = [result["tokens_per_s"]]
                plain[name] = result
                return engine, result, seen, sum(a != b for a, b in zip(split_tokens, other_tokens))

            if not_ahead is not None:  # chained proposes sent as their steps launch, against ahead (the default)
                _, result, _, differing = services_variant("services_not_ahead", not_ahead, conf)
                plain.update({"services_ahead_over_not_ahead": split["tokens_per_s"] / result["tokens_per_s"],
                              "requests_differing_services_ahead_vs_not_ahead": differing})
            if device_waits is not None:  # the target's stream waits for the drafts, against its host polling
                _, result, (waited, released), differing = services_variant(
                    "services_device_waits", device_waits, conf,
                    lambda _: (device_waits.link.device_waits, device_waits.waits_released))
                plain.update({"services_device_waits_over_host_polls": result["tokens_per_s"] / split["tokens_per_s"],
                              "services_device_waits_over_in_process": result["tokens_per_s"] / local["tokens_per_s"],
                              # chained drafts our stream waited for, and waits we released ourselves (a
                              # drafter late past a step's deadline: it is dropped)
                              "device_waits": device_waits.link.device_waits - waited,
                              "device_waits_released": device_waits.waits_released - released,
                              "requests_differing_services_device_waits_vs_host_polls": differing})
            if tail_uncaptured is not None:  # the target's side of a chained step uncaptured, against captured
                _, result, _, differing = services_variant(
                    "services_tail_uncaptured", tail_uncaptured, replace(conf, chain_capture_remote=False))
                plain.update({"services_over_tail_uncaptured": split["tokens_per_s"] / result["tokens_per_s"],
                              "requests_differing_services_vs_tail_uncaptured": differing})
            if no_regroup is not None:  # a batch that changed waits for a propose of its own, against taking rows
                _, result, _, differing = services_variant(
                    "services_no_regroup", no_regroup, replace(conf, chain_regroup=False))
                plain.update({"services_over_no_regroup": split["tokens_per_s"] / result["tokens_per_s"],
                              "requests_differing_services_vs_no_regroup": differing})
            if unprepared is not None:  # chained steps' host work after the target's writes, against before
                _, result, _, differing = services_variant("services_unprepared", unprepared, conf)
                plain.update({"services_over_unprepared": split["tokens_per_s"] / result["tokens_per_s"],
                              "requests_differing_services_vs_unprepared": differing})
            if both_waits is not None:  # both streams wait on the device, against both hosts polling
                _, result, (waited, released, launches, unanswered), differing = services_variant(
                    "services_both_waits", both_waits, conf,
                    lambda _: (both_waits.link.device_waits, both_waits.waits_released,
                               labelled(third_metrics, "chain_graph_steps_total", "outcome"),
                               both_waits.link.taken_unanswered))
                after = labelled(third_metrics, "chain_graph_steps_total", "outcome")
                plain.update({"services_both_waits_over_host_polls": result["tokens_per_s"] / split["tokens_per_s"],
                              "services_both_waits_over_in_process": result["tokens_per_s"] / local["tokens_per_s"],
                              "both_waits_target_device_waits": both_waits.link.device_waits - waited,
                              "both_waits_target_waits_released": both_waits.waits_released - released,
                              # drafts the verify took before the propose's answer was read (its host not waiting)
                              "both_waits_taken_unanswered": both_waits.link.taken_unanswered - unanswered,
                              # the drafter's chained steps by how they ran ("waited": its stream waited on the device)
                              "both_waits_drafter_chain_graph_steps": {o: int(n - launches.get(o, 0.0))
                                                                      for o, n in after.items()},
                              "requests_differing_services_both_waits_vs_host_polls": differing})
                if device_waits is not None:
                    plain["services_both_waits_over_target_waits"] = \
                        result["tokens_per_s"] / plain["services_device_waits"]["tokens_per_s"]
            if args.rounds > 1:  # the same again, in turn: how far one round's ratios are from their median
                # (with --waves, the rates while every slot was busy too, for the three engines)
                full = {name: [r["tokens_per_s_while_full"]] for name, r in (("target_only", base), ("in_process", local),
                                                                           ("services", split))}
                for _ in range(args.rounds - 1):
                    for name, engine in engines.items():
                        with kernel_setting(name):  # (a graph captured late keeps its engine's setting)
                            result = run(engine, tokenizer, prompts, args.max_tokens, name[0])[1]
                        rates[name].append(result["tokens_per_s"])
                        if name in full:
                            full[name].append(result["tokens_per_s_while_full"])
                plain["rounds"] = round_ratios(rates)
                if None not in full["target_only"]:
                    plain["rounds_while_full"] = round_ratios(full)
            results[f"batch_{batch}"] = {**plain,
                "target_only": base, "in_process": local, "services": split,
                "services_over_in_process": split["tokens_per_s"] / local["tokens_per_s"],
                "in_process_over_target_only": local["tokens_per_s"] / base["tokens_per_s"],
                "services_over_target_only": split["tokens_per_s"] / base["tokens_per_s"],
                # bf16: the batched verify and the single-token decode round differently, so greedy
                # outputs may part at near-ties; count the requests where they do.
                "requests_differing_from_target_only": sum(a != b for a, b in zip(base_tokens, local_tokens)),
                "services_equal_in_process": split_tokens == local_tokens == grpc_tokens,
                # how many requests part, where they do (bf16: near-ties, and with --auto the two engines'
                # learned draft lengths give their verifies other shapes, which round differently)
                "requests_differing_services_vs_in_process": sum(a != b for a, b in zip(split_tokens, local_tokens)),
                "requests_differing_services_over_grpc_vs_in_process": sum(
                    a != b for a, b in zip(grpc_tokens, local_tokens)),
                # the Step stream over gRPC instead of the step socket, same drafter, same run
                "services_step_over_grpc": grpc_split,
                "step_socket_over_grpc": split["tokens_per_s"] / grpc_split["tokens_per_s"],
                "step_round_trip_mean_ms_over_grpc": 1e3 * statistics.fmean(grpc_steps) if grpc_steps else None,
                "step_round_trip_p50_ms": 1e3 * statistics.median(steps) if steps else None,
                "step_round_trip_mean_ms": 1e3 * statistics.fmean(steps) if steps else None,
                # The drafter's own clock per Step message (parse, the drafter's work, its GPU waits), so
                # the mean round trip less this is the transport, both ends' gRPC and the thread handoffs.
                "drafter_served_mean_ms": 1e3 * (served_after[0] - served_before[0])
                / max(served_after[1] - served_before[1], 1),
                # ... and its parts (host clock; "propose" holds the GPU work the drafts' read-back waits for)
                "drafter_phase_mean_ms": {
                    phase: 1e3 * (spent - phases_before.get(phase, 0.0)) / max(served_after[1] - served_before[1], 1)
                    for phase, spent in phases_after.items()},
                # (unless --no-drafter-chain-graphs) the chained steps whose commit and propose the drafter ran
                # fused, by how (uncaptured, captured, replayed, failed: see its chain_graph_steps metric)
                "drafter_chain_graph_steps": {outcome: int(n - graphs_before.get(outcome, 0.0))
                                              for outcome, n in graphs_after.items()},
                # Steps of commits sent ahead (steps without drafts): served, but no round trip waited for
                "steps_sent_ahead": remote.link.sent_ahead - ahead_before,
                # proposals taken from a Step sent ahead with the last step's commits (RemoteProposer.prefetch)
                "drafts_taken_ahead": remote.link.drafts_ahead - drafts_ahead_before,
                # chained proposes sent as the step before them launched, and those the next step took
                "chain_proposes_sent_ahead": remote.link.chain_sent_ahead - chain_sent_before,
                "chain_proposes_taken_ahead": remote.link.chain_taken_ahead - chain_taken_before,
                # ... of them for a batch that lost sequences that ended or gained those attached as it was sent
                "chain_proposes_taken_regrouped": remote.link.chain_taken_regrouped - regrouped_before,
                # proposals the verify read from the target's drafts buffer (written there by the drafter)
                "drafts_on_device": remote.link.drafts_on_device - on_device_before,
                # What the split adds to each step's drafter phases (round trip, serialisation, the
                # second process's GPU context) over the same drafter work in-process.
                "control_plane_exposed_ms": (split["per_step_ms"]["draft"] + split["per_step_ms"]["commit"])
                - (local["per_step_ms"]["draft"] + local["per_step_ms"]["commit"]),
                "hidden_row_bytes_over_grpc": remote.link.inline_row_bytes - bytes_before,
                "learned_draft_length": {"in_process": local_engine.tuner.learned() if local_engine.tuner else None,
                                         "services": split_engine.tuner.learned() if split_engine.tuner else None},
                # with --auto: what each tuner's choice rests on (E(k), step ms per k and batch bucket)
                "draft_tuner": {"in_process": local_engine.tuner.snapshot() if local_engine.tuner else None,
                                "services": split_engine.tuner.snapshot() if split_engine.tuner else None},
            }
            print(json.dumps({f"batch_{batch}": results[f"batch_{batch}"]}), flush=True)
            print(summary(batch, prompts, results[f"batch_{batch}"]), flush=True)
        pings = sorted(remote.ping() for _ in range(200))
        results["empty_step_round_trip_p50_ms"] = 1e3 * statistics.median(pings)
        results["empty_step_round_trip_p50_ms_over_grpc"] = 1e3 * statistics.median([over_grpc.ping() for _ in range(200)])
        remote.close()
        over_grpc.close()
        if remote_trees is not None:
            remote_trees.close()
        if trees_ahead is not None:
            trees_ahead.close()
        if not_ahead is not None:
            not_ahead.close()
        if device_waits is not None:
            device_waits.close()
        if tail_uncaptured is not None:
            tail_uncaptured.close()
        if no_regroup is not None:
            no_regroup.close()
        if unprepared is not None:
            unprepared.close()
        if both_waits is not None:
            both_waits.close()
        text = json.dumps(results, indent=2)
        print(text, flush=True)
        if args.json_out:
            with open(args.json_out, "w") as f:
                f.write(text)
    finally:
        for proc in drafter_procs:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                print("drafter did not stop on SIGTERM within 10 s; killing it", file=sys.stderr)
                proc.kill()
        if mps is not None:
            mps.stop()
            lifeline.close()


if __name__ == "__main__":
    main()
