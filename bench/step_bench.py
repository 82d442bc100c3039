"""The decode/verify step against its floor: eager forward vs captured CUDA graph, side by side in one run.

    python bench/step_bench.py --target default --batch 1 8 32 --query 1 8 16 --out step.json
    python bench/step_bench.py --target qwen3-8b ...   (random bf16 weights of Qwen3-8B's geometry)

B sequences with --context cached tokens each run one step of Q tokens (decode: Q = 1; verify:
Q = k + 1). The floor is the bytes a step must read (every weight once, plus the cached K/V its
queries attend to) divided by the device copy bandwidth measured in the same run.

    python bench/step_bench.py --target qwen3-8b --batch 1 8 --served 256

--served also runs the engine itself (target only, greedy, --context random prompt tokens per stream, EOS
ignored) for that many tokens at each batch size: ms a decode step as a server's loop makes them (a step
launched ahead of the host's reading, so the host's part of a step hides behind the device's) against the
floor at the context halfway through.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from specsplit.shared.checkpoint import load_config
from specsplit.shared.config import ModelConfig, RopeConfig
from specsplit.local import target_dir
from specsplit.shared.sampling_params import SamplingParams
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.graphs import StepBatch, StepGraphs
from specsplit.target_service.model import CaptureSpec, ForwardBatch, TargetModel, load_target
from specsplit.target_service.sequence import Request

QWEN3_8B = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       rope=RopeConfig(theta=1e6), max_position_embeddings=40960)


def random_model(config: ModelConfig, dtype: torch.dtype) -> TargetModel:
    with torch.device("meta"):
        model = TargetModel(config).to(dtype)
    model = model.to_empty(device="cuda")
    for name, p in model.named_parameters():
        p.data.fill_(1.0) if name.endswith("norm.weight") else p.data.normal_(0, 0.02)
    from specsplit.shared.layers import RotaryEmbedding
    model.model.rotary_emb = RotaryEmbedding(config.head_dim, config.rope).cuda()
    return model.eval().requires_grad_(False)


def copy_bandwidth() -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of 1 GiB."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    stop.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(stop) / 1e3)


def step_bytes(model: TargetModel, batch: int, context: int) -> int:
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    kv = batch * context * cfg.num_hidden_layers * 2 * cfg.kv_size * model.embed_weight.element_size()
    return weights + kv


def ms_per_call(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def bench(model: TargetModel, batch: int, query: int, context: int, repeats: int, bandwidth: float) -> dict:
    cache = model.new_cache(num_blocks=batch * (-(-(context + query) // 16)) + 2, block_size=16)
    # The block table as wide as the engine captures it (the model's whole context), not the context at hand:
    # its width sets the attention's key splits (twenty-seventh session: an 8B step 4.94 -> 4.76 ms)
    max_len = model.config.max_position_embeddings + query
    graphs = StepGraphs(model, cache, CaptureSpec(), max_batch=batch, query_lens=(query,), max_len=max_len)
    unfused = StepGraphs(model, cache, CaptureSpec(), max_batch=batch, query_lens=(query,), max_len=max_len,
                         fused=False)
    gen = torch.Generator().manual_seed(0)
    for s in range(batch):
        cache.allocate(s)
        prompt = torch.randint(10, 10000, (context,), generator=gen)
        model(ForwardBatch(prompt.cuda(), torch.arange(context, device="cuda"), torch.tensor([0, context]), [s]), cache)
    step = StepBatch(list(range(batch)), [torch.randint(10, 10000, (query,), generator=gen).tolist()] * batch,
                     [context] * batch)
    ids = torch.tensor([t for ids in step.tokens for t in ids], device="cuda")
    eager_batch = ForwardBatch(ids, torch.arange(context, context + query, device="cuda").repeat(batch),
                               torch.arange(0, batch * query + 1, query), step.seq_ids)
    eager_ms = ms_per_call(lambda: model(eager_batch, cache), max(3, repeats // 10))
    graph_ms = ms_per_call(lambda: graphs.forward(step), repeats)
    unfused_ms = ms_per_call(lambda: unfused.forward(step), repeats)
    graph = graphs.graphs[(batch, query)]
    replay_ms = ms_per_call(graph.replay, repeats)
    floor_ms = step_bytes(model, batch, context) / bandwidth * 1e3
    return {"batch": batch, "query": query, "context": context, "eager_ms": eager_ms, "graph_step_ms": graph_ms, "unfused_graph_step_ms": unfused_ms,
            "graph_replay_ms": replay_ms, "floor_ms": floor_ms, "graph_over_floor": graph_ms / floor_ms,
            "eager_over_graph": eager_ms / graph_ms}


def served(model: TargetModel, batch: int, context: int, tokens: int, bandwidth: float, trace: bool = False) -> dict:
    """The engine's decode steps, target only: `batch` requests of `context` random prompt tokens, `tokens`
    each, admitted together after a short warm-up run; ms a step between the second and the last step that
    emitted (the first carries the prefill), their median, and the floor at the context halfway through."""
    if tokens < 3:
        raise SystemExit("--served needs at least 3 tokens (the first step carries the prefill)")
    blocks = batch * -(-(context + max(tokens, 48) + 16) // 16) + 16
    engine = Engine(model, None, EngineConfig(max_batch=batch, graphed_prefill=0, kv_blocks=blocks))
    gen = torch.Generator().manual_seed(1)

    def requests(tag: str, count: int) -> list[Request]:
        return [Request(f"{tag}{i}", torch.randint(10, 10000, (context,), generator=gen).tolist(),
                        SamplingParams(max_tokens=count, ignore_eos=True)) for i in range(batch)]

    engine.generate(requests("warm-up ", 16))
    for request in requests("timed ", tokens):
        engine.add(request)
    stamps = []
    while engine.has_work:
        emitted = sum(len(event.token_ids) for event in engine.step())
        if emitted:
            stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    step_ms = (stamps[-1] - stamps[1]) / len(gaps) * 1e3
    floor_ms = step_bytes(model, batch, context + tokens // 2) / bandwidth * 1e3
    idle = device_idle(engine, requests("traced ", 48)) if trace else None
    del engine
    torch.cuda.empty_cache()
    return {"batch": batch, "context": context, "tokens": tokens, "steps": len(gaps), "served_step_ms": step_ms,
            "served_median_ms": statistics.median(gaps) * 1e3, "floor_ms": floor_ms,
            "served_over_floor": step_ms / floor_ms, "device_idle": idle}


def device_idle(engine: Engine, batch: list[Request]) -> dict:
    """The engine's steps over `batch` under the torch profiler (CUDA activity): how long the device stood idle
    between its kernels and copies, and where (the pairs of work on either side of the longest total idle). A
    device idle before each step's graph is the host's part of a step showing; none means the served step's
    time over a replay is device work outside the graph (copies, the fed token's kernels)."""
    from torch.profiler import ProfilerActivity, profile

    for request in batch:
        engine.add(request)
    for _ in range(4):  # the prefill and the first launches
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps = 0
        while engine.has_work:
            engine.step()
            steps += 1
        torch.cuda.synchronize()
    work = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)
    if not work or not steps:
        return {"steps": steps, "note": "the profiler saw no device work"}
    sites: dict[tuple[str, str], float] = {}
    idle, end, before = 0.0, work[0][1], work[0][2]
    for start, stop, name in work[1:]:
        if start > end:
            idle += start - end
            site = (short_name(before), short_name(name))
            sites[site] = sites.get(site, 0.0) + start - end
        if stop >= end:
            end, before = stop, name
    span = end - work[0][0]
    top = sorted(sites.items(), key=lambda kv: -kv[1])[:6]
    return {"steps": steps, "span_us_per_step": span / steps, "idle_us_per_step": idle / steps,
            "work_items_per_step": len(work) / steps,
            "idle_sites_us_per_step": [{"after": a, "before": b, "us": us / steps} for (a, b), us in top]}


def short_name(name: str, width: int = 48) -> str:
    """A kernel's name cut to `width` characters."""
    return name if len(name) <= width else name[:width - 3] + "..."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="default", help="default, qwen3-8b (random weights) or an HF folder")
    ap.add_argument("--random-weights", action="store_true", help="random weights of the target's geometry")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--query", type=int, nargs="+", default=[1, 8, 16], help="tokens per sequence per step")
    ap.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--served", type=int, default=0, metavar="TOKENS",
                    help="also time the engine's own decode steps over this many tokens a stream (see above)")
    ap.add_argument("--trace-served", action="store_true",
                    help="with --served: 48 more tokens under the profiler, where the device stood idle")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for step_bench-<target>.json")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    if args.target == "qwen3-8b":
        model = random_model(QWEN3_8B, dtype)
    elif args.random_weights:
        model = random_model(load_config(target_dir(args.target)), dtype)
    else:
        model = load_target(target_dir(args.target), dtype=dtype, device="cuda")
    bandwidth = copy_bandwidth()
    print(f"{args.target} {args.dtype}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'B':>3} {'Q':>3} {'eager ms':>9} {'unfused':>9} {'graph ms':>9} {'replay ms':>9} {'floor ms':>9} {'graph/floor':>11} {'eager/graph':>11}")
    rows = []
    for b in args.batch:
        for q in args.query:
            r = bench(model, b, q, args.context, args.repeats, bandwidth)
            rows.append(r)
            print(f"{b:>3} {q:>3} {r['eager_ms']:>9.3f} {r['unfused_graph_step_ms']:>9.3f} {r['graph_step_ms']:>9.3f} {r['graph_replay_ms']:>9.3f} "
                  f"{r['floor_ms']:>9.3f} {r['graph_over_floor']:>11.2f} {r['eager_over_graph']:>11.1f}", flush=True)
            torch.cuda.empty_cache()
    served_rows = []
    if args.served:
        print(f"\nthe engine's own steps, target only, {args.served} tokens a stream from {args.context}:")
        print(f"{'B':>3} {'ms a step':>9} {'median':>9} {'floor ms':>9} {'over floor':>10}")
        for b in args.batch:
            r = served(model, b, args.context, args.served, bandwidth, trace=args.trace_served)
            served_rows.append(r)
            print(f"{b:>3} {r['served_step_ms']:>9.3f} {r['served_median_ms']:>9.3f} {r['floor_ms']:>9.3f} "
                  f"{r['served_over_floor']:>10.2f}", flush=True)
            if r["device_idle"] and "note" in r["device_idle"]:
                print(f"    traced: {r['device_idle']['note']}")
            elif r["device_idle"]:
                idle = r["device_idle"]
                print(f"    traced ({idle['steps']} steps): device busy from first to last "
                      f"{idle['span_us_per_step']:.1f} µs a step, idle {idle['idle_us_per_step']:.1f} µs of it, "
                      f"{idle['work_items_per_step']:.1f} kernels and copies a step; idle by site (µs a step):")
                for site in idle["idle_sites_us_per_step"]:
                    print(f"      {site['us']:7.1f}  after {site['after']}  before {site['before']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"step_bench-{os.path.basename(args.target)}.json"), "w") as f:
            json.dump({"target": args.target, "dtype": args.dtype, "bandwidth": bandwidth, "rows": rows,
                       "served": served_rows}, f, indent=1)


if __name__ == "__main__":
    main()
