"""What the split adds to a decode step on the host: the Step stream's control plane vs the drafter's compute.

    python bench/step_overhead.py [--batch 1 16 64] [--steps 200]

CPU-only. A tiny target config (small vocabulary and hidden size, so the drafter's own compute is small)
and a seeded random DFlash drafter; the drafter runs once as its own process (`specsplit drafter serve`,
reached by the real `RemoteProposer` with rows in shared memory and the Step stream over the drafter's
step socket, or over gRPC with --step-over-grpc; the empty Step's round trip is timed both ways) and once in this
process, fed the same verbs on the same rows (stash, commit, trim per sequence, then one batched
propose: the engine's step). Per step it prints the in-process drafter time (its compute), the split's
time, the drafter's compute inside the service (its own step clock, from its metrics, less its parse),
and the split's control plane (the split's step less that compute) broken into the parts this process
can time: queueing the verbs, sending the StepRequest (staging rows, building it), parsing the answer, the
drafter's parse and reply (the same code, timed here on the same messages), and the rest (the
transport, the thread handoffs, the drafter's lock). Both drafters must draft the same tokens.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from safetensors.torch import save_file

from specsplit.drafter_service.heads import TargetInfo
from specsplit.local import LocalSetup, build_drafter
from specsplit.protos.v1 import drafter_pb2
from specsplit.shared import wire
from specsplit.shared.checkpoint import load_config
from specsplit.shared.proposer import ProposeRequest
from specsplit.services import checkpoint_head
from specsplit.shared.serving import wait_healthy
from specsplit.target_service.drafter_client import RemoteProposer

TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1 << 16,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
PROMPT_ROWS = 16
PREFIX = "specsplit_drafter"  # the drafter service's metric names


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_target(folder: Path) -> Path:
    """A config and an embedding: all a drafter service needs of its target on the CPU."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY))
    embed = torch.randn(TINY["vocab_size"], TINY["hidden_size"], generator=torch.Generator().manual_seed(0))
    save_file({"model.embed_tokens.weight": embed}, str(folder / "model.safetensors"))
    return folder


class Timer:
    """Accumulated seconds by name; `wrap` times every call of a function."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.on = False

    @contextmanager
    def phase(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.on:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def wrap(self, fn, name: str):
        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)
        return timed


class Workload:
    """The same steps for every drafter: a seeded stream of rows, acceptances and anchors."""

    def __init__(self, batch: int, spec, steps: int, one_call: bool = True) -> None:
        self.batch, self.k, self.dim, self.steps = batch, spec.max_drafts, spec.feature_dim, steps
        self.one_call = one_call  # a step's commits in one call (the engine's way), or three verbs per sequence
        self.vocab = spec.vocab_size

    def start(self, drafter, first_id: int) -> list[int]:
        gen = torch.Generator().manual_seed(first_id)
        ids = list(range(first_id, first_id + self.batch))
        for seq_id in ids:
            drafter.alloc(seq_id, PROMPT_ROWS + (self.steps + 1) * (self.k + 1))
            tokens = torch.randint(0, self.vocab, (PROMPT_ROWS,), generator=gen).tolist()
            drafter.prefill(seq_id, tokens, torch.randn(PROMPT_ROWS, self.dim, generator=gen))
        return ids

    def run(self, drafter, ids: list[int], timer: Timer) -> tuple[list[float], list]:
        """Per-step wall seconds and every proposal's tokens."""
        gen = torch.Generator().manual_seed(1)
        pos = [PROMPT_ROWS] * self.batch  # position of each sequence's anchor
        last = [3] * self.batch
        seconds, drafted = [], []
        batched = getattr(drafter, "batched_appends", nullcontext)
        for _ in range(self.steps):
            rows = torch.randn(self.batch * (self.k + 1), self.dim, generator=gen)  # one verify's output
            accepted = torch.randint(0, self.k + 1, (self.batch,), generator=gen).tolist()
            tokens = torch.randint(4, self.vocab, (self.batch, self.k + 1), generator=gen).tolist()
            started = time.perf_counter()
            with timer.phase("queue verbs"), batched():
                if self.one_call and hasattr(type(drafter), "commit_verified_many"):  # as the engine does
                    width = self.k + 1
                    drafter.commit_verified_many(ids, rows, [i * width for i in range(self.batch)],
                                                 [width] * self.batch, accepted, list(pos),
                                                 [[last[i]] + tokens[i][:accepted[i]] for i in range(self.batch)])
                else:
                    for i, seq_id in enumerate(ids):
                        a = accepted[i]
                        drafter.stash(seq_id, rows[i * (self.k + 1):(i + 1) * (self.k + 1)])
                        drafter.commit(seq_id, a + 1, pos[i], [last[i]] + tokens[i][:a])
                        drafter.trim(seq_id, a)
                for i, a in enumerate(accepted):
                    pos[i] += a + 1
                    last[i] = tokens[i][a]
            requests = [ProposeRequest(seq_id, last[i], pos[i], self.k) for i, seq_id in enumerate(ids)]
            with timer.phase("propose"):
                proposals = drafter.propose(requests)
            seconds.append(time.perf_counter() - started)
            drafted.append([p.tokens for p in proposals])
        for seq_id in ids:
            drafter.free(seq_id)
        flush = getattr(drafter, "flush", None)
        if flush is not None:  # a remote drafter's frees ride on the next step: with none coming, send them
            flush()
        return seconds, drafted


def instrument(timer: Timer, remote: RemoteProposer) -> list:
    """Time the client's send (sealing the rows, building the message) and its parse of the answer;
    keep the last messages each way for `conversions`."""
    seen = {}
    originals = (wire.step_to_proto, wire.step_result_from_proto)

    def to_proto(batch, **kwargs):
        seen["request"] = originals[0](batch, **kwargs)
        with timer.phase("serialize request"):  # grpc's, in its own thread: timed here on a copy, then
            seen["request"].SerializeToString()  # taken off the send below
        return seen["request"]

    def from_proto(pb):
        seen["response"] = pb
        with timer.phase("parse response"):
            return originals[1](pb)

    def send(*args, **kwargs):
        with timer.phase("send"):
            return send_original(*args, **kwargs)

    def answer(*args, **kwargs):
        with timer.phase("receive"):
            return answer_original(*args, **kwargs)

    send_original, answer_original = remote._send, remote._answer
    remote._send, remote._answer = send, answer
    wire.step_to_proto, wire.step_result_from_proto = to_proto, from_proto
    return [seen, originals]


def conversions(seen: dict, repeats: int = 200) -> dict[str, float]:
    """µs the drafter spends converting one step's messages (the same code, timed here)."""
    request, response = seen["request"], seen["response"]
    data, answer = request.SerializeToString(), response.SerializeToString()
    result = wire.step_result_from_proto(response)

    def us(fn) -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        return 1e6 * (time.perf_counter() - started) / repeats

    return {"drafter parse request": us(lambda: wire.step_from_proto(drafter_pb2.StepRequest.FromString(data))),
            "drafter build reply": us(lambda: wire.step_result_to_proto(result, request.draft_columns)
                                      .SerializeToString()),
            "request bytes": len(data), "response bytes": len(answer)}


def phase_seconds(metrics_url: str) -> dict[str, float]:
    """Seconds the drafter service spent so far in each part of its Step messages (its own clock)."""
    return labelled(metrics_url, "step_phase_seconds_total", "phase")


def labelled(metrics_url: str, counter: str, label: str) -> dict[str, float]:
    """The drafter service's counter `counter` (its name less the prefix) so far, by its one `label`."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    prefix = f'{PREFIX}_{counter}{{{label}="'
    return {line[len(prefix):].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def served_seconds(metrics_url: str) -> tuple[float, int]:
    """(seconds, count) of the Step messages the drafter service answered so far: its own clock."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(f"{PREFIX}_step_seconds_"))
    return float(values[f"{PREFIX}_step_seconds_sum"]), int(float(values[f"{PREFIX}_step_seconds_count"]))


def bench_batch(batch: int, args, local, remote: RemoteProposer, seen: dict, timer: Timer, first_id: int,
                metrics_url: str) -> dict:
    work = Workload(batch, remote.spec, args.steps, one_call=not args.per_sequence_verbs)
    out = {}
    for name, drafter in (("in_process", local), ("split", remote)):
        ids = work.start(drafter, first_id)
        work.run(drafter, ids, timer)  # warm-up
        ids = work.start(drafter, first_id + batch)
        served = served_seconds(metrics_url)
        timer.seconds, timer.on = {}, True
        seconds, drafted = work.run(drafter, ids, timer)
        timer.on = False
        after = served_seconds(metrics_url)
        served_us = 1e6 * (after[0] - served[0]) / max(after[1] - served[1], 1)
        out[name] = (statistics.mean(seconds), drafted, {k: v / args.steps for k, v in timer.seconds.items()},
                     served_us)
    (local_s, local_drafts, _, _), (split_s, split_drafts, parts, served_us) = out["in_process"], out["split"]
    assert local_drafts == split_drafts, "the split drafted other tokens than the in-process drafter"
    conv = conversions(seen)
    us = {k: 1e6 * v for k, v in parts.items()}
    parse, reply = conv["drafter parse request"], conv["drafter build reply"]
    compute = served_us - parse  # the service's clock runs from its parse to its answer
    control = 1e6 * split_s - compute
    us.pop("receive")  # the wait for the answer: the drafter's compute, the transport and the handoffs
    us["send request"] = us.pop("send") - us["serialize request"]
    client = us["queue verbs"] + us["send request"] + us["parse response"]
    row = {"in_process_step_us": 1e6 * local_s, "split_step_us": 1e6 * split_s,
           "drafter_compute_in_service_us": compute, "control_plane_us": control,
           **{f"{k}_us": v for k, v in us.items() if k not in ("propose", "serialize request")},
           "drafter parse request_us": parse, "drafter build reply_us": reply,
           "transport and handoffs_us": control - client - parse - reply,
           "request_bytes": conv["request bytes"], "response_bytes": conv["response bytes"]}
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--step-over-grpc", action="store_true",
                    help="the Step stream over gRPC instead of the drafter's step socket")
    ap.add_argument("--per-sequence-verbs", action="store_true",
                    help="stash, commit and trim per sequence instead of the engine's one call per step")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    tmp = Path(tempfile.mkdtemp(prefix="specsplit-overhead-"))
    folder = write_target(tmp / "target")
    sock = f"unix:{tmp}/drafter.sock"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specsplit", "drafter", "serve", "--listen", sock, "--target",
                             str(folder), "--drafter", "random-dflash", "--device", "cpu", "--seed", "0",
                             "--log-level", "WARNING", "--max-rows", str(1 << 24),
                             "--drain-seconds", "0", "--metrics-port", str(port)])
    try:
        wait_healthy(sock, 120, alive=lambda: proc.poll() is None)
        info = TargetInfo.from_config(load_config(folder))
        local = build_drafter("random-dflash", info, checkpoint_head(folder, torch.float32, "cpu"), LocalSetup(seed=0))
        remote = RemoteProposer(sock, max_batch=max(args.batch), step_socket=not args.step_over_grpc)
        timer = Timer()
        seen, originals = instrument(timer, remote)
        results = {"transport": remote.mode, "step_transport": remote.step_transport}
        for n, batch in enumerate(args.batch):
            results[f"batch_{batch}"] = bench_batch(batch, args, local, remote, seen, timer, 1000 * (n + 1),
                                                  f"http://127.0.0.1:{port}/metrics")
            print(json.dumps({f"batch_{batch}": results[f"batch_{batch}"]}), flush=True)
        wire.step_to_proto, wire.step_result_from_proto = originals
        # The Step stream's floor both ways, in alternating blocks of one run: the step socket and gRPC.
        other = RemoteProposer(sock, max_batch=max(args.batch), step_socket=args.step_over_grpc)
        pings: dict[str, list[float]] = {remote.step_transport: [], other.step_transport: []}
        for _ in range(10):
            for proposer in (remote, other):
                pings[proposer.step_transport] += [proposer.ping() for _ in range(100)]
        floor = {name: round(1e6 * statistics.median(values), 1) for name, values in pings.items()}
        results["empty_step_round_trip_p50_us"] = floor
        print(json.dumps({"empty_step_round_trip_p50_us": floor,
                          "grpc_over_socket": round(floor["grpc"] / floor["socket"], 2)}), flush=True)
        other.close()
        remote.close()
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=2))
    finally:
        proc.terminate()
        proc.wait(timeout=20)


if __name__ == "__main__":
    main()
