"""Where the host's time goes in a decode step: cProfile of the engine's steps, per step.

    python bench/host_profile.py --device cuda --batch 1 16 [--split] [--out DIR]

GPU kernels in a step are short (a graph-captured verify of the default model is ~1 ms), so the host's
Python between two launches is what a step waits on. This lists the functions with the most own time
per step (µs) and the cumulative time of the engine's phases. With `--split` the engine speaks to a
drafter service over the Step stream (the service itself is profiled separately, e.g. with py-spy:
its pid is printed).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import inspect
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable

import torch

from specsplit.cli import trees_by_batch
from specsplit.lifeline import Lifeline
from specsplit.local import LocalSetup, make_drafter, target_dir
from specsplit.mps import MpsServer
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.serving import wait_healthy
from specsplit.shared.tokenizer import Tokenizer
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.model import load_target
from specsplit.target_service.sequence import Request
from step_overhead import PREFIX, free_port, labelled, served_seconds

PROMPT = "Explain how a hash map works, with an example in Python."


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class ReplayClock:
    """(--time-replays) host seconds inside CUDAGraph.replay (cudaGraphLaunch and the GIL's return), counted
    while `on`: unprofiled, and on this thread alone (Python 3.12's cProfile sees every thread's calls, so
    its figures for a call that lets the GIL go hold other threads' work)."""

    def __init__(self) -> None:
        self.on, self.seconds, self.calls = False, 0.0, 0
        self._replay = torch.cuda.CUDAGraph.replay
        clock = self

        def replay(graph) -> None:
            if not clock.on:
                return clock._replay(graph)
            started = time.perf_counter()
            try:
                return clock._replay(graph)
            finally:
                clock.seconds += time.perf_counter() - started
                clock.calls += 1

        torch.cuda.CUDAGraph.replay = replay

    def line(self, steps: int) -> str:
        return f"; graph replays {self.calls / steps:.1f} a step, {self.seconds / steps * 1e6:.1f} µs a step"


REPLAYS: ReplayClock | None = None


# (--clock) what a step's host time is spent in, unprofiled: the engine's phases and a drafter service's verbs
CLOCKED = {
    "specsplit.target_service.engine:Engine": (
        "step", "_admit", "_finish_prefill", "_decode_step", "_chain_plan", "_chain_step", "_chain_launch",
        "_chain_tail", "_chain_run", "_chain_feed", "_chain_send_ahead", "_chain_read", "_quiesce", "_emit",
        "_text_delta", "_release", "_settle_attaches", "_drafter_call"),
    "specsplit.target_service.graphs:StepGraphs": ("chain_tables",),
    "specsplit.target_service.graphs:StaticForward": ("load_fed_tables",),
    "specsplit.target_service.kv_cache:PagedKVCache": ("reserve_batch",),
    "specsplit.target_service.chain:ChainedStep": ("outcome",),
    "specsplit.target_service.chain:ChainBuffers": ("launch",),
    "specsplit.target_service.drafter_client:RemoteProposer": (
        "chain_batch", "chain_candidates", "chain_propose", "chain_commit", "chain_prefetch", "chain_settle",
        "_take_unanswered", "_candidates_in_buffer", "_live", "_send", "_answer", "_write_feed"),
    "specsplit.shared.device_waits:DeviceWaits": ("wait",),
}


class MethodClock:
    """(--clock) inclusive host seconds in the CLOCKED methods, called on this thread while `on`: each method
    wrapped with two clock reads (about a microsecond a call), no profiler (cProfile's per-call cost swells
    Python-heavy code, and in Python 3.12 it sees every thread's calls). Methods nest: read a phase's figure as
    including the verbs it calls."""

    def __init__(self, targets: dict[str, tuple[str, ...]] = CLOCKED) -> None:
        self.on = False
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()
        self._targets = targets
        self._restore = []
        self._install()  # (a name that is no method stops the bench now, not after its first runs)
        self.close()

    def _install(self) -> None:
        """Wrap the methods (only while clocking: the unprofiled and the profiled steps run the plain ones)."""
        thread = threading.current_thread()
        for where, names in self._targets.items():
            module, _, cls = where.partition(":")
            owner = getattr(importlib.import_module(module), cls)
            for name in names:
                original = inspect.getattr_static(owner, name, None)
                if isinstance(original, staticmethod):
                    setattr(owner, name, staticmethod(self._wrap(original.__func__, f"{cls}.{name}", thread)))
                elif inspect.isfunction(original):
                    setattr(owner, name, self._wrap(original, f"{cls}.{name}", thread))
                else:
                    raise SystemExit(f"--clock: {cls}.{name} is no method here")
                self._restore.append((owner, name, original))

    def _wrap(self, original, label: str, thread: threading.Thread):
        clock = self

        @functools.wraps(original)
        def clocked(*args, **kwargs):
            if not clock.on or threading.current_thread() is not thread:
                return original(*args, **kwargs)
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                clock.seconds[label] += time.perf_counter() - started
                clock.calls[label] += 1
        return clocked

    def start(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self._install()
        self.on = True

    def lines(self, steps: int) -> str:
        self.on = False
        self.close()
        rows = [f"{'µs/step':>10} {'calls/step':>10}  method (inclusive, unprofiled)"]
        for label, seconds in self.seconds.most_common():
            rows.append(f"{seconds / steps * 1e6:10.1f} {self.calls[label] / steps:10.1f}  {label}")
        return "\n".join(rows)

    def close(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()


CLOCK: MethodClock | None = None


def profile_engine(engine: Engine, tokenizer: Tokenizer, batch: int, steps: int, device: str) -> str:
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    # enough tokens for every step measured (16 a step at most), within the model's context
    room = engine.model.config.max_position_embeddings - len(prompt)
    params = SamplingParams(max_tokens=min(16 * (2 * steps + 40), room), ignore_eos=True)
    for i in range(batch):
        engine.add(Request(f"r{i}", prompt, params))
    for _ in range(20):  # prefill, graph captures of the buckets in use
        engine.step()
    sync(device)
    if REPLAYS is not None:
        REPLAYS.on, REPLAYS.seconds, REPLAYS.calls = True, 0.0, 0
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    wall = (time.perf_counter() - started) / steps
    replays = ""
    if REPLAYS is not None:
        REPLAYS.on, replays = False, REPLAYS.line(steps)
    clocked = ""
    if CLOCK is not None:  # the same number of steps again, the methods clocked
        CLOCK.start()
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        clocked_wall = (time.perf_counter() - started) / steps
        clocked = f"\nclocked: {clocked_wall * 1e3:.3f} ms/step\n{CLOCK.lines(steps)}"
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    sync(device)
    prof.disable()
    for request_id in list(engine.running):
        engine.abort(request_id)
    return profile_lines(prof, steps, f"batch {batch}: {wall * 1e3:.3f} ms/step unprofiled{replays}") + clocked


def timed_line(runs: list[tuple[float, int, int]]) -> str:
    """The timed runs' (seconds, engine steps, tokens emitted) as the serving line says them: engine steps, ms
    a step, tok/s and tokens a step of the median run by ms a step, and with several runs each run's ms a step."""
    if not runs or any(steps < 1 or seconds <= 0 for seconds, steps, _ in runs):
        raise ValueError(f"timed runs need steps and time: {runs}")
    ranked = sorted(runs, key=lambda r: r[0] / r[1])
    seconds, steps, tokens = ranked[(len(ranked) - 1) // 2]  # (an even count: the lower middle, a run measured)
    line = f"{steps} engine steps, {seconds / steps * 1e3:.3f} ms/step unprofiled ({tokens / seconds:,.0f} tok/s, " \
           f"{tokens / steps:.2f} tokens a step"
    if len(runs) > 1:
        walls = [f"{s / n * 1e3:.3f}" for s, n, _ in runs]
        line += f"; median of {len(runs)} timed runs, in order {' '.join(walls)} ms/step"
    return line + ")"


def profile_serving(engine: Engine, prompts: list[list[int]], max_tokens: int, batch: int, device: str,
                    temperature: float = 0.0, mark: Callable[[str], None] | None = None, timed_runs: int = 1) -> str:
    """Requests admitted as others end (what a server sees): every prompt through `batch` slots, run once to
    warm up, then timed (`timed_runs` times: the median run), then profiled; per engine step. `mark(run)` is
    called as each run ends ("warm-up", "timed", "profiled"), e.g. to read a drafter service's counters between
    them (the timed runs' together)."""
    shapes: list[str] = []

    emitted = [0]  # tokens the last run emitted

    def run(tag: str) -> int:
        emitted[0] = 0
        for i, ids in enumerate(prompts):
            engine.add(Request(f"{tag}{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                                seed=i if temperature else None)))
        before = chain_tally(engine.counters)
        steps = 0
        while engine.has_work:
            emitted[0] += sum(len(event.token_ids) for event in engine.step())
            steps += 1
        sync(device)
        shapes.append(f"{tag}: {said_chain_tally(chain_tally(engine.counters), before, len(engine._chain_programs))}")
        return steps

    run("w")
    if mark is not None:
        mark("warm-up")
    link = getattr(engine.proposer, "link", None)  # (a drafter service's: the Steps its host waited for)
    waited = len(link.step_seconds) if link is not None else 0
    unary = sum(link.unary_calls.values()) if link is not None else 0
    regrouped = link.chain_taken_regrouped if link is not None else 0
    if REPLAYS is not None:
        REPLAYS.on, REPLAYS.seconds, REPLAYS.calls = True, 0.0, 0
    timed = []
    for r in range(timed_runs):
        started = time.perf_counter()
        steps = run("t" if r == 0 else f"t{r}-")  # (request ids unique across the runs)
        timed.append((time.perf_counter() - started, steps, emitted[0]))
    steps = sum(n for _, n, _ in timed)  # (the counts below: a step of all the timed runs)
    if mark is not None:
        mark("timed")
    extra = ""
    if REPLAYS is not None:
        REPLAYS.on, extra = False, REPLAYS.line(steps)
    if link is not None:
        answers = list(link.step_seconds)[waited:]
        extra += (f"; Step answers waited for {len(answers) / steps:.2f} a step, "
                  f"{sum(answers) / steps * 1e3:.3f} ms a step; unary calls {sum(link.unary_calls.values()) - unary} "
                  f"({', '.join(f'{m} {n}' for m, n in sorted(link.unary_calls.items()))} in all); chained proposes "
                  f"sent ahead taken for a batch that changed {link.chain_taken_regrouped - regrouped}"
                  + (f" (the calls and proposes of the {len(timed)} timed runs together)" if len(timed) > 1 else ""))
    clocked = ""
    if CLOCK is not None:  # the same requests again, the methods clocked (unprofiled)
        CLOCK.start()
        started = time.perf_counter()
        clocked_steps = run("c")
        clocked_wall = (time.perf_counter() - started) / clocked_steps
        clocked = f"\nclocked: {clocked_steps} engine steps, {clocked_wall * 1e3:.3f} ms/step\n{CLOCK.lines(clocked_steps)}"
        if mark is not None:
            mark("clocked")
    prof = cProfile.Profile()
    prof.enable()
    steps = run("p")
    prof.disable()
    if mark is not None:
        mark("profiled")
    head, _, rest = profile_lines(prof, steps, f"serving {len(prompts)} prompts through {batch} slots, {max_tokens} "
                                               f"tokens: {timed_line(timed)}"
                                               f"{extra}").partition("\n")
    return (f"{head}\nchained steps by run (w warm-up, t timed, c clocked, p profiled): {'; '.join(shapes)}\n{rest}"
            f"{clocked}")


_CHAIN_TALLY = ("chained", "chain_replays", "chain_captures", "chain_capture_seconds", "chain_programs_made",
                "chain_programs_dropped")


def chain_tally(counters) -> dict[str, float]:
    """The engine's counters of chained steps and their programs, as they stand."""
    return {name: getattr(counters, name) for name in _CHAIN_TALLY}


def said_chain_tally(after: dict[str, float], before: dict[str, float], held: int) -> str:
    """One run's chained steps: how many, how many replayed a captured graph, the captures and their host
    seconds, the programs made and dropped (a dropped shape that comes back runs uncaptured again), and the
    programs held at its end."""
    d = {name: after[name] - before[name] for name in _CHAIN_TALLY}
    return (f"{d['chained']:.0f} chained, {d['chain_replays']:.0f} replayed, {d['chain_captures']:.0f} captured "
            f"({1e3 * d['chain_capture_seconds']:.0f} ms), programs {d['chain_programs_made']:.0f} made, "
            f"{d['chain_programs_dropped']:.0f} dropped, {held} held")


def prefill_phases(metrics_url: str) -> tuple[float, dict[str, float]]:
    """The drafter service's PrefillDrafter calls answered so far and their host seconds by phase."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    count = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith(f"{PREFIX}_prefills_total "))
    return count, labelled(metrics_url, "prefill_phase_seconds_total", "phase")


def prefill_line(before: tuple[float, dict[str, float]], after: tuple[float, dict[str, float]],
                 run: str = "") -> str:
    """The drafter's ms a PrefillDrafter, by phase, between two `prefill_phases` (of `run`, if named)."""
    calls = after[0] - before[0]
    where = f" ({run})" if run else ""
    if not calls:
        return f"drafter{where}: no PrefillDrafter answered"
    parts = {p: (after[1][p] - before[1].get(p, 0.0)) / calls * 1e3 for p in after[1]}
    return (f"drafter{where}: {calls:.0f} PrefillDrafter answered, {sum(parts.values()):.3f} ms each on its host: "
            + ", ".join(f"{p} {ms:.3f}" for p, ms in parts.items()))


def graph_line(before: dict[str, float], after: dict[str, float], run: str) -> str:
    """The drafter's chained steps between two reads of its `chain_graph_steps` counter, by outcome (captures
    in a warm server's run stall the target's steps that wait for those drafts)."""
    counts = {o: after[o] - before.get(o, 0.0) for o in after if after[o] - before.get(o, 0.0)}
    return (f"drafter ({run}): chained steps " + (", ".join(f"{o} {n:.0f}" for o, n in counts.items()) or "none"))


def prefill_marks(metrics_url: str, lines: list[str]) -> Callable[[str], None]:
    """A `profile_serving` mark that appends to `lines` the drafter's PrefillDrafter line of each run, and its
    chained steps by how they ran (uncaptured, captured, replayed, ...)."""
    last = prefill_phases(metrics_url)
    graphs = labelled(metrics_url, "chain_graph_steps_total", "outcome")
    steps = step_phases(metrics_url)

    def mark(run: str) -> None:
        nonlocal last, graphs, steps
        now, graphed = prefill_phases(metrics_url), labelled(metrics_url, "chain_graph_steps_total", "outcome")
        stepped = step_phases(metrics_url)
        lines.extend([prefill_line(last, now, run), graph_line(graphs, graphed, run), step_line(steps, stepped, run)])
        last, graphs, steps = now, graphed, stepped
    return mark


def step_phases(metrics_url: str) -> tuple[float, float, dict[str, float]]:
    """The drafter service's Step messages answered so far, their seconds (its own clock, from a message's
    arrival to its answer) and their host seconds by phase."""
    seconds, count = served_seconds(metrics_url)
    return count, seconds, labelled(metrics_url, "step_phase_seconds_total", "phase")


def step_line(before: tuple[float, float, dict[str, float]], after: tuple[float, float, dict[str, float]],
              run: str) -> str:
    """The drafter's ms a Step message between two `step_phases`, and by phase: is its host what the target's
    waits for?"""
    count = after[0] - before[0]
    if not count:
        return f"drafter ({run}): no Step answered"
    parts = {p: (after[2][p] - before[2].get(p, 0.0)) / count * 1e3 for p in after[2]}
    return (f"drafter ({run}): {count:.0f} Steps answered, {(after[1] - before[1]) / count * 1e3:.3f} ms each from "
            f"arrival to answer; by phase: " + ", ".join(f"{p} {ms:.3f}" for p, ms in parts.items() if ms >= 0.0005))


def profile_lines(prof: cProfile.Profile, steps: int, head: str) -> str:
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # own time, all functions
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])
    out = [f"{head}; profiled own time {total / steps * 1e6:.0f} µs/step",
           f"{'own µs/step':>12} {'cum µs/step':>12} {'calls/step':>10}  function"]
    for (path, line, name), (_, ncalls, own, cum, _) in rows[:45]:
        where = "/".join(path.rsplit("/", 2)[-2:]) if path != "~" else "builtin"
        out.append(f"{own / steps * 1e6:12.1f} {cum / steps * 1e6:12.1f} {ncalls / steps:10.1f}  {where}:{line} {name}")
    phases = {"_decode_step", "_propose", "_verify_forward", "_sample", "_after_verify", "_emit", "_admit",
              "_maybe_reattach", "forward", "load", "step_call", "_drafter_call", "propose", "__exit__", "_prefill",
              "_attach", "_chain_step", "_chain_launch", "_chain_read", "_chain_run", "_finish_verify", "_finish_prefill",
              "_decode_step_ahead", "_release"}
    out.append("engine phases (cumulative µs/step):")
    for (path, line, name), (_, ncalls, own, cum, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][3]):
        if name in phases and ("specsplit" in path or "_service" in path or "/shared/" in path):
            where = "/".join(path.rsplit("/", 2)[-2:])
            out.append(f"{cum / steps * 1e6:12.1f}  {where}:{line} {name} ({ncalls / steps:.1f} calls/step)")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--drafter", default="dflash")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--split", action="store_true", help="profile the target side of the split too")
    ap.add_argument("--both-waits", action="store_true",
                    help="(--split) both streams wait on the device: the drafter's for the target's writes "
                         "(drafter --device-waits), the target's for the drafts (RemoteProposer(device_waits=True))")
    ap.add_argument("--target-waits", action="store_true",
                    help="(--split) the target's stream waits on the device for the drafts (RemoteProposer("
                         "device_waits=True)), the drafter's host polls: the DONE buffer is the host page")
    ap.add_argument("--prefill-copies", action="store_true",
                    help="(--split) the drafter service's --prefill-copies: a prefill waits only for its rows' copy")
    ap.add_argument("--overlap-attach", action="store_true",
                    help="(--split --serving) EngineConfig.overlap_attach for the services: requests arriving while a "
                         "chained step is out are attached to the drafter after the next step launched")
    ap.add_argument("--stream-attach", action="store_true",
                    help="(--split --serving) EngineConfig(stream_attach=True) for the services: each request's "
                         "attach rides the next Step instead of a PrefillDrafter call after the answer to the Step "
                         "sent ahead")
    ap.add_argument("--drafter-capture-after", type=int, default=None, metavar="N",
                    help="(--split) the drafter service's --chain-capture-after (default: its own, 8)")
    ap.add_argument("--no-tree-regroup", dest="tree_regroup", action="store_false",
                    help="(--split) EngineConfig(tree_regroup=False) for the services: a tree step whose batch lost or "
                         "gained sequences waits for candidates of its own instead of taking their rows of those sent "
                         "ahead (as before the sixty-second session)")
    ap.add_argument("--no-regroup", action="store_true",
                    help="(--split) EngineConfig(chain_regroup=False) for the services: a batch that changed waits for "
                         "a propose of its own, as before the thirty-seventh session")
    ap.add_argument("--unquiesced", action="store_true",
                    help="(--split --target-waits) EngineConfig.unquiesced_host_flags for the services: waits on the host "
                         "page left pending across a kernel's first launch (no drain, no host wait at a batch change)")
    ap.add_argument("--chain-programs", type=int, default=EngineConfig.chain_programs, metavar="N",
                    help="EngineConfig.chain_programs: chained-step programs (and graphs) kept")
    ap.add_argument("--capture-after", type=int, default=EngineConfig.chain_capture_after, metavar="N",
                    help="EngineConfig.chain_capture_after: uncaptured runs of a chained-step shape before its capture")
    ap.add_argument("--split-only", action="store_true", help="(--split) only the services, not in-process too")
    ap.add_argument("--drafter-trace", default=None, metavar="PATH",
                    help="(--split) the drafter's host during Step messages 300 to 600 (the first batch's steady "
                         "steps) with Python stacks, a Chrome trace at PATH (drafter serve --profile-host)")
    ap.add_argument("--serving", type=int, default=0, metavar="N",
                    help="instead: N held-out prompts through --batch slots, admitted as others end (in-process; "
                         "with --split, through the drafter service too)")
    ap.add_argument("--max-tokens", type=int, default=128, help="(--serving) tokens per request")
    ap.add_argument("--timed-runs", type=int, default=1, metavar="N",
                    help="(--serving) time the requests N times after the warm-up and report the median run (one "
                         "run of 24 prompts through 8 slots is about 0.3 s)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="(--serving) sampled requests at this temperature, each seeded by its index (0: greedy)")
    ap.add_argument("--target-only", action="store_true",
                    help="the steady-state profiles of the engine with no drafter too (its decode steps launched "
                         "ahead: where the host's part of a step outlasts the device's, the device waits)")
    ap.add_argument("--time-replays", action="store_true",
                    help="also the host's time inside CUDA graph replays in the unprofiled steps")
    ap.add_argument("--clock", action="store_true",
                    help="also the host's µs a step in the engine's phases and the drafter verbs, unprofiled "
                         "(each method wrapped with two clock reads; MethodClock)")
    ap.add_argument("--draft-tree", type=int, default=0, metavar="N",
                    help="the engines verify draft trees of N nodes (EngineConfig.draft_tree); a drafter service "
                         "is asked for them as `specsplit up` links a pair (the next tree step's sent ahead)")
    ap.add_argument("--trees-by-batch", type=trees_by_batch, default=(), metavar="N:NODES,...",
                    help="(--draft-tree) trees of at most NODES nodes in steps of N or more sequences "
                         "(EngineConfig.trees_by_batch, as `target serve --trees-by-batch`)")
    ap.add_argument("--mps", action="store_true",
                    help="this process and the drafter service as clients of a private NVIDIA MPS server "
                         "(specsplit.mps, as `specsplit up --mps`)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    if args.draft_tree < 0:
        ap.error("--draft-tree takes 0 (chains) or more nodes")
    if args.timed_runs < 1:
        ap.error("--timed-runs takes 1 or more")
    torch.set_grad_enabled(False)
    mps = None
    if args.mps:  # before this process's CUDA context is made
        mps = MpsServer(Lifeline())
        os.environ.update(mps.env)  # (the drafter service started below inherits it)
    try:
        run(args)
    finally:
        if mps is not None:
            mps.stop()


def run(args: argparse.Namespace) -> None:
    global REPLAYS, CLOCK
    if args.time_replays:
        REPLAYS = ReplayClock()
    if args.clock:
        CLOCK = MethodClock()
    setup = LocalSetup(drafter=args.drafter, device=args.device, seed=0)
    folder = target_dir("default")
    model = load_target(folder, dtype=setup.torch_dtype, device=args.device)
    tokenizer = Tokenizer.from_dir(folder)
    local = make_drafter(args.drafter, model, setup)
    texts = []

    def report(text: str) -> None:
        print(text, flush=True)
        texts.append(text)

    proc = remote = None
    services = "services, " + "both waits, " * args.both_waits + "target waits, " * args.target_waits \
        + "unquiesced, " * args.unquiesced + "no regroup, " * args.no_regroup \
        + "trees not regrouped, " * (not args.tree_regroup) \
        + "overlapped attach, " * args.overlap_attach + "attached on the stream, " * args.stream_attach \
        + (f"drafter captures after {args.drafter_capture_after}, " if args.drafter_capture_after is not None else "")
    services = services if services != "services, " else "services "
    try:
        if args.split:
            from specsplit.target_service.drafter_client import RemoteProposer

            sock = f"unix:{tempfile.mkdtemp(prefix='specsplit-prof-')}/drafter.sock"
            metrics_port = free_port()
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            proc = subprocess.Popen([sys.executable, "-m", "specsplit", "drafter", "serve", "--listen", sock,
                                     "--drafter", args.drafter, "--device", args.device, "--seed", "0",
                                     "--metrics-port", str(metrics_port)]
                                    + (["--device-waits", "--max-targets", "1"] if args.both_waits else [])
                                    + (["--prefill-copies"] if args.prefill_copies else [])
                                    + (["--chain-capture-after", str(args.drafter_capture_after)]
                                       if args.drafter_capture_after is not None else [])
                                    + (["--profile-steps", "300:600", "--profile-out", args.drafter_trace,
                                        "--profile-host"] if args.drafter_trace else []))
            print(f"drafter service pid {proc.pid}", flush=True)
            wait_healthy(sock, 300)
            remote = RemoteProposer(sock, device=args.device, dtype=setup.torch_dtype,
                                    head=(model.embed_weight, model.lm_head_weight),
                                    device_waits=args.both_waits or args.target_waits,
                                    trees_ahead=args.draft_tree > 0,  # (as `specsplit up` links a pair's trees)
                                    tree_keep=EngineConfig.draft_tree_keep if args.draft_tree else 0)
            if remote._conn is not None and remote._conn.done is not None:
                print(f"the DONE buffer: {'the host page' if remote.waits_outlive_loads else 'device memory'}",
                      flush=True)
        engines = [] if args.split and args.split_only else [("in-process ", local)]
        engines += [(services, remote)] if remote is not None else []
        if args.serving:
            from specsplit.train_data import HELDOUT_PATH, read_prompts

            prompts = [p.encode(tokenizer) for p in read_prompts(HELDOUT_PATH, args.serving)]
            for batch in args.batch:
                for name, drafter in [("target-only ", None)] * (not (args.split and args.split_only)) + engines:
                    config = EngineConfig(max_batch=batch, draft_tree=args.draft_tree,
                                          trees_by_batch=args.trees_by_batch if args.draft_tree else (),
                                          chain_programs=args.chain_programs,
                                          chain_capture_after=args.capture_after,
                                          overlap_attach=args.overlap_attach and drafter is remote,
                                          stream_attach=args.stream_attach and drafter is remote,
                                          chain_regroup=not (args.no_regroup and drafter is remote),
                                          tree_regroup=args.tree_regroup and drafter is remote,
                                          unquiesced_host_flags=args.unquiesced and drafter is remote)
                    engine = Engine(model, drafter, config, eos_ids=tokenizer.eos_token_ids)
                    # The drafter's prefills run by run: the warm-up's carry its graphs' first uses and
                    # captures (a context bucket runs eagerly once, then is captured), the timed run's are
                    # what a warm server pays.
                    lines: list[str] = []
                    mark = prefill_marks(metrics_url, lines) if remote is not None and drafter is remote else None
                    text = name + profile_serving(engine, prompts, args.max_tokens, batch, args.device,
                                                  args.temperature, mark, args.timed_runs)
                    report("\n".join([text, *lines]))
        else:
            for batch in args.batch:
                for name, drafter in [("target-only ", None)] * args.target_only + engines:
                    config = EngineConfig(max_batch=batch, draft_tree=args.draft_tree,
                                          chain_programs=args.chain_programs,
                                          chain_capture_after=args.capture_after)
                    report(name + profile_engine(Engine(model, drafter, config), tokenizer, batch, args.steps,
                                                 args.device))
    finally:
        if remote is not None:
            remote.close()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=20)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_profile.txt"), "w") as f:
            f.write("\n\n".join(texts))


if __name__ == "__main__":
    main()
