"""Both services' GPU work on one clock: where a services step's time goes, beside in-process.

    python bench/timeline.py --device cuda --dtype bfloat16 --batch 1 --steps 150 --out DIR
    python bench/timeline.py --analyze DIR/services_target.json.gz DIR/services_drafter.json.gz

The first form starts the drafter service (`drafter serve --profile-on-signal`), warms an in-process and
a services engine on the same prompts, then records the same window of decode steps with the torch
profiler in each: the in-process engine's, then the services engine's beside the drafter's own Step
messages (the drafter is signalled as the window starts). Traces go to DIR, gzipped. The second form,
which the first runs too, puts traces on one clock (each trace's `baseTimeNanoseconds` plus its event
times: the host's wall clock, the same in both processes) and splits the window's time into:

- GPU busy with one side's work only, with both sides' at once (two contexts time-slice one GPU);
- GPU idle because the next work's launch had not been issued yet ("host late", by side: that side's
  host is on the critical path), or with its launch already issued (the GPU was waiting: a stream wait on
  a flag, an event, a context switch between the processes).

Profiling slows each launch (a CUPTI callback); graph replays, one launch each, suffer least. Read the
shares and the order of things, not the recorded steps' wall time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
STEP_MARK = "timeline_step"  # the target's decode steps, as a user annotation


def load_trace(path: str | Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def spans(trace: dict) -> tuple[list[tuple[float, float, float]], list[tuple[float, float]], tuple[float, float]]:
    """GPU activity as (start, end, its launch's end) in µs on the host's wall clock (launch end: when
    the host call that queued it returned; the start when none is found), the step marks (start, end),
    and what the trace recorded: its first event's start to its last one's end."""
    base = trace.get("baseTimeNanoseconds", 0) / 1e3
    launched: dict[int, float] = {}
    gpu, steps = [], []
    first, last = float("inf"), float("-inf")
    for e in trace.get("traceEvents", ()):
        if e.get("ph") != "X":
            continue
        cat, start = e.get("cat", ""), base + float(e["ts"])
        end = start + float(e.get("dur", 0.0))
        first, last = min(first, start), max(last, end)
        if cat in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            launched[e["args"]["correlation"]] = end
        elif cat in GPU_CATEGORIES:
            gpu.append((start, end, e.get("args", {}).get("correlation")))
        elif cat == "user_annotation" and e.get("name") == STEP_MARK:
            steps.append((start, end))
    out = sorted((s, e, launched.get(c, s) if c is not None else s) for s, e, c in gpu)
    return out, sorted(steps), (first, last)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _clip(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def summarize(sides: dict[str, dict], step_side: str) -> dict:
    """The whole steps of `step_side` (its STEP_MARK annotations) in the time every side recorded, split
    as the module says, in ms a step. `sides` maps a name to its loaded trace."""
    activity = {name: spans(trace) for name, trace in sides.items()}
    if any(not gpu for gpu, _, _ in activity.values()):
        raise ValueError("a trace has no GPU activity: was it recorded on a GPU, with CUDA activities?")
    lo = max(recorded[0] for _, _, recorded in activity.values())
    hi = min(recorded[1] for _, _, recorded in activity.values())
    steps = [s for s in activity[step_side][1] if lo <= s[0] <= hi]
    if len(steps) < 2:
        raise ValueError(f"fewer than two of {step_side}'s steps lie in the window where every trace has GPU work")
    lo, hi = steps[0][0], steps[-1][0]  # whole steps: from the first step's start to the last one's
    n = len(steps) - 1
    busy = {name: _union(_clip([(s, e) for s, e, _ in gpu], lo, hi)) for name, (gpu, _, _) in activity.items()}
    names = list(busy)
    out: dict = {"steps": n, "window_ms": (hi - lo) / 1e3, "step_ms": (hi - lo) / 1e3 / n}
    both = _intersect(busy[names[0]], busy[names[1]]) if len(names) == 2 else []
    for name in names:
        out[f"{name}_gpu_only_ms"] = (_length(busy[name]) - _length(both)) / 1e3 / n
    if len(names) == 2:
        out["both_gpu_ms"] = _length(both) / 1e3 / n
    # Idle gaps: between the merged busy time of every side; each charged to the side whose work came next
    every = sorted((s, e, last, name) for name, (gpu, _, _) in activity.items() for s, e, last in gpu)
    idle = {f"{name}_{why}_ms": 0.0 for name in names for why in ("host_late", "gpu_waiting")}
    reach = lo
    for s, e, launched, name in every:
        if e <= lo:
            continue
        if s >= hi:
            break
        if s > reach:  # an idle gap [reach, s): was the next work's launch issued before it opened?
            late = min(max(launched - reach, 0.0), s - reach)
            idle[f"{name}_host_late_ms"] += late
            idle[f"{name}_gpu_waiting_ms"] += (s - reach) - late
        reach = max(reach, e)
    out.update({k: v / 1e3 / n for k, v in idle.items()})
    out["idle_ms"] = sum(v for k, v in out.items() if k.endswith(("_host_late_ms", "_gpu_waiting_ms")))
    return out


def print_summary(label: str, summary: dict) -> None:
    parts = ", ".join(f"{k.removesuffix('_ms')} {v:.3f}" for k, v in summary.items()
                      if k.endswith("_ms") and k not in ("step_ms", "window_ms"))
    print(f"{label}: {summary['steps']} steps, {summary['step_ms']:.3f} ms a step (profiled); per step: {parts}",
          flush=True)


def gzip_to(src: Path, dst: Path) -> Path:
    with open(src, "rb") as f, gzip.open(dst, "wb") as g:
        shutil.copyfileobj(f, g)
    src.unlink()
    return dst


def record(args) -> None:
    import torch

    from specsplit.local import LocalSetup, make_drafter, target_dir
    from specsplit.shared.profiling import StepWindow
    from specsplit.shared.serving import wait_healthy
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service import drafter_client
    from specsplit.target_service.drafter_client import RemoteProposer
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.model import load_target
    from split_bench import run, stream_prompts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mps = None
    if args.mps:  # before this process's CUDA context is made (the drafter started below inherits the server's env)
        import os

        from specsplit.lifeline import Lifeline
        from specsplit.mps import MpsServer
        mps = MpsServer(Lifeline())
        os.environ.update(mps.env)
    setup = LocalSetup(drafter=args.drafter, device=args.device, dtype=args.dtype, seed=0)
    folder = target_dir(setup.target)
    model = load_target(folder, dtype=setup.torch_dtype, device=setup.device)
    tokenizer = Tokenizer.from_dir(folder)
    sock = f"unix:{tempfile.mkdtemp(prefix='specsplit-timeline-')}/drafter.sock"
    # the drafter is signalled as the target's window starts and records as many Step messages as it has
    # steps: at least one goes a step (more while sequences attach), so the drafter's window ends within the
    # target's (twice as many outlasted a run of trees, one a step) and the summary keeps the time both recorded
    drafter_raw = out / "services_drafter.json"
    cmd = [sys.executable, "-m", "specsplit", "drafter", "serve", "--listen", sock, "--drafter", args.drafter,
           "--device", args.device, "--seed", "0", "--profile-on-signal",
           "--profile-steps", f"1:{args.steps}", "--profile-out", str(drafter_raw)] + \
        (["--dtype", args.dtype] if args.dtype else []) + \
        (["--device-waits", "--max-targets", "1"] if args.drafter_device_waits else [])
    drafter_proc = subprocess.Popen(cmd)
    # The Step during which the drafter's profiler starts takes over a second (CUPTI's start): a deadline
    # drawn from the usual round trips would drop the drafter there (it did, once, in the first run)
    drafter_client.STEP_DEADLINE_FLOOR = 30.0
    prompts = stream_prompts(args.batch)
    conf = EngineConfig(max_batch=args.batch, draft_tree=args.draft_tree)
    try:
        wait_healthy(sock, 300)
        # with trees, linked as `specsplit up` pairs them: the next tree step's ask sent as the target launches
        remote = RemoteProposer(sock, device=setup.device, dtype=setup.torch_dtype,
                                head=(model.embed_weight, model.lm_head_weight), device_waits=args.device_waits,
                                trees_ahead=args.draft_tree > 0,
                                tree_keep=EngineConfig.draft_tree_keep if args.draft_tree else 0)
        engines = {"in_process": Engine(model, make_drafter(args.drafter, model, setup), conf),
                   "services": Engine(model, remote, replace(conf, chain_capture_remote=args.remote_tail))}
        traces = {}
        for name, engine in engines.items():
            run(engine, tokenizer, prompts, args.max_tokens, "warm")  # captures, first launches
            raw = out / f"{name}_target.json"
            window = StepWindow(args.skip + 1, args.skip + args.steps, raw)
            step = engine._decode_step

            def decode_step(seqs, step=step, window=window, signal_drafter=name == "services"):
                number = window.enter()
                if signal_drafter and number == window.first:  # its window: the Step messages from now on
                    drafter_proc.send_signal(signal.SIGUSR1)
                try:
                    with torch.profiler.record_function(STEP_MARK):
                        return step(seqs)
                finally:
                    window.exit(number)

            engine._decode_step = decode_step
            run(engine, tokenizer, prompts, args.max_tokens, name[0])
            engine._decode_step = step
            if not window.written:
                raise SystemExit(f"{name}: the run ended before step {args.skip + args.steps}; "
                                 "give more --max-tokens or fewer --skip/--steps")
            traces[name] = {"target": gzip_to(raw, out / f"{raw.name}.gz")}
        link = remote.link  # how the services' steps went: proposes sent ahead and taken, drafts waited for
        print(f"services link: sent ahead {link.sent_ahead}, chained taken ahead {link.chain_taken_ahead}, device "
              f"waits {link.device_waits}, host waits {link.host_waits}, taken unanswered {link.taken_unanswered}",
              flush=True)
        remote.close()
    finally:
        drafter_proc.terminate()
        drafter_proc.wait(timeout=30)  # the drafter's trace was written when its window ended
        if mps is not None:
            mps.stop()
    if not drafter_raw.exists():
        raise SystemExit("the drafter wrote no trace: the run ended before its window of Step messages did "
                         "(give more --max-tokens)")
    traces["services"]["drafter"] = gzip_to(drafter_raw, out / f"{drafter_raw.name}.gz")
    results = {}
    for name, paths in traces.items():
        results[name] = summarize({side: load_trace(p) for side, p in paths.items()}, "target")
        print_summary(name, results[name])
    (out / "timeline.json").write_text(json.dumps(results, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--analyze", nargs="+", metavar="TRACE",
                    help="summarize traces already recorded: the target's, then the drafter's if any")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--drafter", default="dflash")
    ap.add_argument("--batch", type=int, default=1, help="concurrent requests")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--skip", type=int, default=50, help="decode steps of the measured run before the window")
    ap.add_argument("--steps", type=int, default=150, help="decode steps recorded")
    ap.add_argument("--device-waits", action=argparse.BooleanOptionalAction, default=True,
                    help="the services engine's stream waits for chained drafts on the device (RemoteProposer)")
    ap.add_argument("--drafter-device-waits", action="store_true",
                    help="the drafter's stream waits for the target's writes on the device too (`drafter serve "
                         "--device-waits --max-targets 1`; split_bench's --also-both-waits)")
    ap.add_argument("--remote-tail", action=argparse.BooleanOptionalAction, default=True,
                    help="the services engine replays what follows each chained step's drafts as one graph "
                         "(EngineConfig.chain_capture_remote, the default; --no-remote-tail: uncaptured)")
    ap.add_argument("--draft-tree", type=int, default=0, metavar="N",
                    help="both engines verify draft trees of N nodes (EngineConfig.draft_tree), the services' with "
                         "the next tree step's ask sent as the target launches (as `specsplit up` pairs them)")
    ap.add_argument("--mps", action="store_true",
                    help="this process and the drafter as clients of a private NVIDIA MPS server (`up --mps`)")
    ap.add_argument("--out", default="timeline")
    args = ap.parse_args()
    if args.analyze:
        if len(args.analyze) > 2:
            ap.error("--analyze takes the target's trace and at most the drafter's")
        sides = dict(zip(("target", "drafter"), (load_trace(p) for p in args.analyze)))
        print_summary("timeline", summarize(sides, "target"))
        return
    if args.steps < 2 or args.skip < 0 or args.draft_tree < 0:
        ap.error("--steps takes 2 or more, --skip and --draft-tree 0 or more")
    record(args)


if __name__ == "__main__":
    main()
