"""The host's wire work of a steady chained step through the services, per message, on this machine's CPU.

    python bench/wire_bench.py [--batch 1 8] [--repeats 20000]

Every chained step sends one Step that only chains (settles, the commit, the next propose) and gets one
answer naming the drafts in the target's buffer. Both hosts are on the step's critical path, so their
Python per message counts: on the H200's host the drafter's parse alone measured ~0.1 ms a Step
(thirty-fourth session, split_bench's drafter_phase_mean_ms). Times, in µs a message, side by side in one
run: the target's build and encoding of the Step, the drafter's decoding and parse (its short path for
a message that only chains, and the general parse of the same message), the drafter's answer, and the
target's parse of it. Writes JSON with --json-out.
"""

from __future__ import annotations

import argparse
import json
import time

from specsplit.protos.v1 import drafter_pb2
from specsplit.shared import wire
from specsplit.shared.transport import RowRef


def per_call_us(fn, repeats: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e6


def steady_step(batch: int) -> wire.StepBatch:
    ids = tuple(range(batch))
    chain = wire.ChainStep(settle_seq_ids=ids, settle_counts=(3,) * batch, commit_seq_ids=ids, commit_rows=16,
                           rows=RowRef(3, 0, 16 * batch, 7), feed=RowRef(5, 0, 3, 9), seq_ids=ids, ahead=(4,) * batch,
                           num_drafts=15, done_buffer=6, done_value=123, written_value=124)
    return wire.StepBatch(step_id=1000, draft_columns=True, drafts_buffer=4, chain=chain)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=20000)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    results = {}
    for batch in args.batch:
        step = steady_step(batch)
        data = wire.step_to_proto(step, columns=True).SerializeToString()
        pb = drafter_pb2.StepRequest.FromString(data)
        short, general = wire.step_from_proto(pb), wire._step_from_proto(pb)
        if short != general:
            raise SystemExit("the short parse and the general one differ")
        answer = wire.StepResult(step.step_id, in_buffer=tuple((i, 15) for i in range(batch)))
        reply = wire.step_result_to_proto(answer, columns=True).SerializeToString()
        r = {
            "target_build_and_encode_us": per_call_us(
                lambda: wire.step_to_proto(steady_step(batch), columns=True).SerializeToString(), args.repeats),
            "drafter_decode_us": per_call_us(lambda: drafter_pb2.StepRequest.FromString(data), args.repeats),
            "drafter_parse_us": per_call_us(lambda: wire.step_from_proto(pb), args.repeats),
            "drafter_parse_general_us": per_call_us(lambda: wire._step_from_proto(pb), args.repeats),
            "drafter_answer_us": per_call_us(
                lambda: wire.step_result_to_proto(answer, columns=True).SerializeToString(), args.repeats),
            "target_answer_parse_us": per_call_us(
                lambda: wire.step_result_from_proto(drafter_pb2.StepResponse.FromString(reply)), args.repeats),
            "step_bytes": len(data), "answer_bytes": len(reply)}
        r["general_over_short_parse"] = r["drafter_parse_general_us"] / r["drafter_parse_us"]
        results[f"batch_{batch}"] = r
        print(f"batch {batch}: the target builds and encodes the Step in {r['target_build_and_encode_us']:.1f} us "
              f"({len(data)} bytes); the drafter decodes it in {r['drafter_decode_us']:.1f} us and parses it in "
              f"{r['drafter_parse_us']:.1f} us ({r['drafter_parse_general_us']:.1f} by the general parse, "
              f"{r['general_over_short_parse']:.2f}x), answers in {r['drafter_answer_us']:.1f} us; the target "
              f"reads the answer in {r['target_answer_parse_us']:.1f} us", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
