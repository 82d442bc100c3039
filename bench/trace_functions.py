"""Where a host's time goes in a torch profiler trace recorded with Python stacks (`with_stack=True`, e.g.
`specsplit drafter serve --profile-host`): own and cumulative time by Python function and by op, per
thread, in µs per step.

    python bench/trace_functions.py TRACE.json[.gz] --steps 300 [--top 40]

Own time is an event's duration less its children's on the same thread (the events nest: a function's
calls and the ops it runs lie inside it). A trace holds what the profiler saw between its window's
first and last step, so `--steps` is that window's length.
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op", "cuda_runtime",
                                                                          "user_annotation")]


def own_times(events: list[dict]) -> tuple[dict, dict, dict]:
    """(own µs, cumulative µs, calls) by (thread, name); cumulative counts an event once even when it
    nests in itself (recursion)."""
    own, cum, calls = defaultdict(float), defaultdict(float), defaultdict(int)
    by_thread = defaultdict(list)
    for e in events:
        by_thread[e.get("tid")].append(e)
    for tid, evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[tuple[float, tuple]] = []  # (end, key) of the open events
        open_names: dict[tuple, int] = defaultdict(int)
        for e in evs:
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and stack[-1][0] <= start:
                open_names[stack.pop()[1]] -= 1
            key = (tid, e["name"])
            own[key] += e["dur"]
            if stack:
                own[stack[-1][1]] -= min(e["dur"], stack[-1][0] - start)
            if not open_names[key]:
                cum[key] += e["dur"]
            calls[key] += 1
            stack.append((end, key))
            open_names[key] += 1
    return own, cum, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, required=True, help="steps the trace's window holds")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps counts from 1")
    own, cum, calls = own_times(load(args.trace))
    threads = defaultdict(float)
    for (tid, _), t in own.items():
        threads[tid] += t
    for tid, total in sorted(threads.items(), key=lambda kv: -kv[1]):
        print(f"thread {tid}: {total / args.steps:.1f} µs a step recorded")
        print(" own µs/step  cum µs/step calls/step  name")
        rows = sorted(((k, t) for k, t in own.items() if k[0] == tid), key=lambda kv: -kv[1])[:args.top]
        for key, t in rows:
            print(f"{t / args.steps:12.1f} {cum[key] / args.steps:12.1f} {calls[key] / args.steps:10.1f}  {key[1][:110]}")


if __name__ == "__main__":
    main()
