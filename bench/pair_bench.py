"""Tokens/s as gRPC clients see them: service pairs started as `specsplit up` starts them, held-out prompts
streamed by N concurrent clients, side by side in one run.

    python bench/pair_bench.py --device cuda --streams 1 2 4 8 16 [--speculate-below 0 4] [--requests 3]
        [--max-tokens 128] [--rounds 2] [--mps] [--also-chains] [--client-processes] [--json-out PATH]

One pair per --speculate-below value (`ServiceSpec.speculate_below`: the target drafts only in steps of fewer
sequences; 0: at every batch size), all up at once (an idle pair costs the GPU nothing; with --mps one at a time,
each under its own server, beside its own target-only runs). At each stream count every pair serves the same
prompts (N clients, each sending --requests held-out prompts one after another, greedy, EOS ends a request), and
so does the first pair with speculation off for every request (the target-only baseline, the same process); each
is warmed up once with the whole run, then timed in alternating rounds.
Prints tokens/s (the median over rounds), each pair over target only, its tau, how many requests' tokens
differ from target only's (bf16 parts at near-ties), the longest any client waited for a chunk (a stall
shows there), the median wait for a request's first chunk (what a request costs beyond its steps), and the
shape of the target's steps: sequences a step (below the stream count: the batch not full) and wall ms a step
(above the step's own time: the target waited between steps). The clients are threads of the bench, or with
--client-processes processes of their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import shlex
import statistics
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from specsplit.client import Client, Generation
from specsplit.local import target_dir
from specsplit.pair import ServiceSpec, spawn
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.tokenizer import Tokenizer
from specsplit.train_data import HELDOUT_PATH, read_prompts
from step_overhead import free_port


def _one_client(address: str, prompts: list[list[int]], max_tokens: int, speculative: bool
                ) -> tuple[list[Generation], float, list[float]]:
    """One client's prompts one after another: their generations, the longest wait for a chunk (seconds,
    the first chunk's included: a stall anywhere in a request shows here) and each request's wait for its
    first chunk (what a request costs beyond its steps: admission, prefill, the drafter's attach)."""
    params = SamplingParams(max_tokens=max_tokens)
    results, longest, firsts = [], 0.0, []
    with Client(address) as client:
        for ids in prompts:
            chunks, last = [], time.perf_counter()
            with client.stream(ids, params, speculative=speculative) as stream:
                for chunk in stream:
                    now = time.perf_counter()
                    if not chunks:
                        firsts.append(now - last)
                    longest, last = max(longest, now - last), now
                    chunks.append(chunk)
            results.append(Generation.from_chunks(chunks))
    return results, longest, firsts


_POOL: ProcessPoolExecutor | None = None  # --client-processes: one process a client, kept across runs


def _pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def start_clients(workers: int, tries: int = 20) -> ProcessPoolExecutor:
    """A pool of `workers` client processes, every one started and its imports done before anything is timed.
    (A pool starts its processes as tasks find none idle, and a spawned one takes seconds to import this
    module: started on demand, the runs at a new stream count went to the processes already up, one request
    after another, the first pair's clients at two streams one at a time, 1.0 sequences a step.)"""
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    for _ in range(tries):  # all busy at once: each process answers one task
        if len(set(pool.map(_pid_after, [0.5] * workers))) == workers:
            return pool
    pool.shutdown()
    raise SystemExit(f"--client-processes: {workers} client processes did not all start")


def serve(address: str, prompts: list[list[list[int]]], max_tokens: int, speculative: bool
          ) -> tuple[float, list[Generation], float, list[float]]:
    """Each client's prompts one after another, the clients at once: tokens/s over the wall time, the results,
    the longest wait any client had for a chunk and every request's wait for its first chunk (seconds). The
    clients are threads of this process, or with --client-processes processes of a pool (then the clients' own
    Python cannot be what bounds the tokens/s)."""
    start = time.perf_counter()
    if _POOL is not None:
        per_client = [f.result() for f in [_POOL.submit(_one_client, address, p, max_tokens, speculative)
                                           for p in prompts]]
    else:
        with ThreadPoolExecutor(len(prompts)) as threads:
            per_client = list(threads.map(lambda p: _one_client(address, p, max_tokens, speculative), prompts))
    seconds = time.perf_counter() - start
    flat = [g for generations, _, _ in per_client for g in generations]
    return (sum(len(g.token_ids) for g in flat) / seconds, flat, max(gap for _, gap, _ in per_client),
            [first for _, _, firsts in per_client for first in firsts])


# The target's counters over the timed rounds, as the bench prints them (target_service.metrics): how its steps
# went (chained on the device, drafts waited for there, Steps sent ahead), what tells a stall's cause, and (below)
# the host's time a step by phase
EVENTS = {"steps_total": "steps", "chained_steps_total": "chained", "drafter_device_waits_total": "device waits",
          "drafter_steps_sent_ahead_total": "sent ahead",
          "drafter_drafts_taken_unanswered_total": "taken unanswered", "drafter_fallbacks_total": "fallbacks",
          "drafter_reattaches_total": "reattaches", "drafter_device_waits_released_total": "waits released",
          "chain_captures_total": "captures", "drafter_rests_total": "rests", "drafter_resumes_total": "resumes"}


PHASE_SUM = 'step_seconds_sum{phase="'  # the host's seconds by step phase: propose, verify, control
HOST_SECONDS = " host seconds"


def counters(port: int) -> dict[str, float]:
    """The target's EVENTS counters from its metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        short = name.removeprefix("specsplit_target_")
        if short in EVENTS:
            found[EVENTS[short]] = float(value)
        elif short.startswith(PHASE_SUM):  # step_seconds_sum{phase="propose"}: host seconds in that phase
            found[short[len(PHASE_SUM):].split('"')[0] + HOST_SECONDS] = float(value)
    return found


def said(events: dict[str, float]) -> str:
    """The counters as the bench prints them; a phase's host seconds as ms a step."""
    steps = events.get("steps", 0.0)
    return "".join(f", {k.removesuffix(HOST_SECONDS)} {1e3 * v / steps:.2f} ms/step" if k.endswith(HOST_SECONDS)
                   else f", {k} {v:.0f}" for k, v in events.items() if steps or not k.endswith(HOST_SECONDS))


def tau(results: list[Generation]) -> float:
    steps = sum(g.stats.steps for g in results)
    return sum(len(g.token_ids) for g in results) / steps if steps else 0.0


def step_shape(sequence_steps: int, requests: int, seconds: float, steps: float) -> dict[str, float]:
    """What the target's steps were over timed rounds: how many sequences each carried on average (the
    requests' steps, less the prefill each counts as one, over the target's decode and verify steps), and
    the wall time a step took from the clients' side (the rounds' seconds over those steps). Below the stream
    count, the batch was not full (requests arriving, prefilling, ending); above the step's own time, the
    target spent time between steps (prefills among it). Empty without steps."""
    if steps <= 0:
        return {}
    return {"sequences_per_step": (sequence_steps - requests) / steps, "wall_ms_per_step": 1e3 * seconds / steps}


def said_shape(shape: dict[str, float]) -> str:
    return (f", {shape['sequences_per_step']:.2f} sequences a step, {shape['wall_ms_per_step']:.3f} ms a step (wall)"
            if shape else "")


def measure(runs: list[tuple[str, str, bool]], prompts: list[list[list[int]]], args, row: dict, label: str,
            ports: dict[str, int]) -> None:
    """Warm every run up once, then time them in alternating rounds; into `row` each speculative run's median
    tokens/s over the first (target-only) run's, its tau, its requests differing from target only's, the
    longest wait for a chunk in any of its rounds and what its target counted in them (EVENTS; `ports`: each
    run's target's metrics port)."""
    for _, address, speculative in runs:  # warm-up: graphs captured, chained steps too
        serve(address, prompts, args.max_tokens, speculative)
    rates: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    gaps: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    firsts: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    outputs: dict[str, list[Generation]] = {}
    events: dict[str, dict[str, float]] = {name: {} for name, _, _ in runs}
    sequence_steps: dict[str, int] = {name: 0 for name, _, _ in runs}
    requests: dict[str, int] = {name: 0 for name, _, _ in runs}
    seconds: dict[str, float] = {name: 0.0 for name, _, _ in runs}
    for _ in range(args.rounds):
        for name, address, speculative in runs:
            before = counters(ports[name])
            rate, outputs[name], gap, first = serve(address, prompts, args.max_tokens, speculative)
            sequence_steps[name] += sum(g.stats.steps for g in outputs[name])
            requests[name] += len(outputs[name])
            seconds[name] += sum(len(g.token_ids) for g in outputs[name]) / rate
            rates[name].append(rate)
            gaps[name].append(gap)
            firsts[name] += first
            for key, value in counters(ports[name]).items():
                if value != before.get(key, 0.0):
                    events[name][key] = events[name].get(key, 0.0) + value - before.get(key, 0.0)
    base = statistics.median(rates["target_only"])
    want = [g.token_ids for g in outputs["target_only"]]
    shapes = {name: step_shape(sequence_steps[name], requests[name], seconds[name], events[name].get("steps", 0.0))
              for name, _, _ in runs}
    parts = [f"{label}: target only {base:.0f} tok/s (longest wait {1e3 * max(gaps['target_only']):.0f} ms, "
             f"first chunk {1e3 * statistics.median(firsts['target_only']):.1f} ms{said_shape(shapes['target_only'])}"
             f"{said(events['target_only'])})"]
    for name, _, _ in runs[1:]:
        rate = statistics.median(rates[name])
        differing = sum(g.token_ids != w for g, w in zip(outputs[name], want))
        row[name] = {"tokens_per_s": rate, "target_only_tokens_per_s": base, "over_target_only": rate / base,
                     "tau": tau(outputs[name]), "requests_differing": differing, "rounds": rates[name],
                     "target_only_rounds": rates["target_only"], "longest_wait_s": gaps[name],
                     "target_only_longest_wait_s": gaps["target_only"], "events": events[name],
                     "first_chunk_median_s": statistics.median(firsts[name]),
                     "target_only_first_chunk_median_s": statistics.median(firsts["target_only"]),
                     "step_shape": shapes[name], "target_only_step_shape": shapes["target_only"]}
        parts.append(f"{name.replace('_', ' ')} {rate / base:.2f}x (tau {tau(outputs[name]):.2f}, "
                     f"{differing} differing, longest wait {1e3 * max(gaps[name]):.0f} ms, first chunk "
                     f"{1e3 * statistics.median(firsts[name]):.1f} ms{said_shape(shapes[name])}{said(events[name])})")
    print("; ".join(parts), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: the services' own (bf16 on a GPU)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--speculate-below", type=int, nargs="+", default=[0, 4])
    ap.add_argument("--requests", type=int, default=3, help="prompts each client sends one after another")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mps", action="store_true",
                    help="every pair under a private MPS server of its own (as `up` starts them on a GPU, where "
                         "MPS can start); without it, as `up --mps off`")
    ap.add_argument("--also-chains", action="store_true",
                    help="beside each pair, one verifying chains (its target given --draft-tree 0), as `up` "
                         "started them on a GPU before the fifty-second session")
    ap.add_argument("--client-processes", action="store_true",
                    help="each client in a process of its own (default: threads of this process)")
    ap.add_argument("--engine-process", choices=["off", "on", "both"], default="off",
                    help="the targets' engines in a process of their own (target serve --engine-process); both: "
                         "each pair once each way, each beside its own target only")
    ap.add_argument("--target-args", default="", metavar="'ARGS'",
                    help="more `target serve` options for every pair's target, one string, e.g. '--tree-regroup'")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if min(args.streams) < 1 or args.requests < 1 or args.rounds < 1 or min(args.speculate_below) < 0:
        ap.error("--streams, --requests and --rounds must be positive, --speculate-below >= 0")
    tokenizer = Tokenizer.from_dir(target_dir("default"))
    heldout = [p.encode(tokenizer) for p in read_prompts(HELDOUT_PATH)]
    max_batch = ("--max-batch", str(max(16, max(args.streams))), *shlex.split(args.target_args))
    specs = {}  # run name -> its pair
    engines = {"off": [""], "on": ["_engine_process"], "both": ["", "_engine_process"]}[args.engine_process]
    for engine in engines:
        given = (*max_batch, "--engine-process") if engine else max_batch
        for below in args.speculate_below:
            specs[f"below_{below}{engine}"] = ServiceSpec(device=args.device, dtype=args.dtype, speculate_below=below,
                                                          target_args=given, mps=args.mps)
            if args.also_chains:
                specs[f"below_{below}_chains{engine}"] = ServiceSpec(
                    device=args.device, dtype=args.dtype, speculate_below=below,
                    target_args=(*given, "--draft-tree", "0"), mps=args.mps)
    # Under MPS one pair at a time (each its own private server), each beside its own target-only runs; so too
    # where the engines run both ways (target only's too)
    groups = [list(specs)] if not args.mps and args.engine_process != "both" else [[name] for name in specs]
    table: dict[str, dict] = {f"streams_{n}": {"requests": n * args.requests} for n in args.streams}
    if args.client_processes:
        global _POOL
        _POOL = start_clients(max(args.streams))
    for group in groups:
        pairs, ports = {}, {}
        try:
            for name in group:
                ports[name] = free_port()
                spec = specs[name]
                pairs[name] = spawn(dataclasses.replace(
                    spec, target_args=(*spec.target_args, "--metrics-port", str(ports[name]))))
                print(f"pair {name}: target {pairs[name].spec.service_args('target')}", flush=True)
            runs = [("target_only", pairs[group[0]].target_address, False)] + \
                [(name, pairs[name].target_address, True) for name in group]
            for n in args.streams:
                row = table[f"streams_{n}"]
                chosen = [heldout[i % len(heldout)] for i in range(n * args.requests)]
                measure(runs, [chosen[i * args.requests:(i + 1) * args.requests] for i in range(n)], args, row,
                        f"streams {n}" + (f", pair {group[0]}" if len(groups) > 1 else ""),
                        {"target_only": ports[group[0]], **ports})
        finally:
            for services in pairs.values():
                services.stop()
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        setting = {"device": args.device, "mps": args.mps, "client_processes": args.client_processes,
                   "engine_process": args.engine_process,
                   "max_tokens": args.max_tokens,
                   "speculate_below": args.speculate_below, "also_chains": args.also_chains,
                   "target_args": args.target_args}
        Path(args.json_out).write_text(json.dumps({**setting, **table}, indent=1))


if __name__ == "__main__":
    main()
