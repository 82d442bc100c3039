"""Where a captured decode step's time goes against its floor, kernel by kernel, one layer's worth at a time.

    python bench/floor_profile.py --target qwen3-8b --batch 1 --query 1 [--context 512] [--out DIR]

The step is the engine's captured target forward (`StepGraphs`, fused layers) with --context cached tokens
per sequence, in variants side by side: the block table sized for the context (as bench/step_bench.py
captured it until the twenty-seventh session); sized like the engine's (the model's whole context: more key
splits for the attention); that with the few-rows kernel (kernels/skinny_linear.py) for the projections
and the LM head where cuBLAS ran before; that with the layers' residual adds and SiLU·mul folded into the
kernel's launches; with the norms handed between them too (shared/fused.py); with SiLU·mul's programs
twice as wide; and with --unbounded, the kernel and its folds for every projection whatever its size (more
variants of the kernel measured here were dropped: see its docstring). One replay is traced
(torch.profiler, CUPTI): its kernels in launch order, the gaps between them (the device idle inside the
graph), and, since every decoder layer launches the same kernels, each position of a layer averaged over
the layers, with the bytes of weights it reads where it is a projection (matched by order: the layer's
GEMMs are qkv, o, gate/up, down) and the bandwidth that makes. The floor is the bytes the step must read
over the device copy bandwidth measured in the same run (bench/step_bench.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_bench import QWEN3_8B, copy_bandwidth, random_model, short_name, step_bytes  # noqa: E402  (bench/ is not a package)

from specsplit.kernels import _triton, rope, skinny_linear  # noqa: E402
from specsplit.local import target_dir  # noqa: E402
from specsplit.shared import fused  # noqa: E402
from specsplit.target_service.graphs import StepBatch, StepGraphs  # noqa: E402
from specsplit.target_service.model import CaptureSpec, ForwardBatch, load_target  # noqa: E402


def kernels_of_one_replay(run) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of each kernel one call of `run` launches, in start order."""
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy")]
    return sorted(kernels, key=lambda k: k[1])


def layer_period(names: list[str], layers: int) -> tuple[int, int] | None:
    """(offset, period): the kernels of `layers` consecutive layers repeat with period kernels from offset;
    None where they do not (the variant's table is left out, its replay time still counts)."""
    for period in range(2, len(names) // layers + 1):
        for offset in range(0, len(names) - layers * period + 1):
            span = names[offset:offset + layers * period]
            if all(span[i] == span[i + period] for i in range(len(span) - period)):
                return offset, period
    print(f"no period of {layers} repeating layers in {len(names)} kernels; the first 24:")
    for name in names[:24]:
        print(f"     {short_name(name, 70)}")
    return None


def replay_us(graph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def layer_table(model, kernels: list[tuple[str, float, float]], bandwidth: float) -> tuple[list[dict], list]:
    """Each position of a layer's kernels averaged over the layers (printed), and the kernels outside them."""
    cfg = model.config
    names = [k[0] for k in kernels]
    gaps = [max(0.0, nxt[1] - (cur[1] + cur[2])) for cur, nxt in zip(kernels, kernels[1:])]
    layers = cfg.num_hidden_layers
    found = layer_period(names, layers)
    if found is None:
        return [], []
    offset, period = found
    h, kv, ffn = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    q_size = cfg.num_attention_heads * cfg.head_dim
    width = model.embed_weight.element_size()
    projection_bytes = [h * (q_size + 2 * kv) * width, q_size * h * width, h * 2 * ffn * width, ffn * h * width]
    print(f"layers: {period} kernels each from kernel {offset}; per position, mean over {layers} layers:")
    rows = []
    gemm_index = 0
    for i in range(period):
        durations = [kernels[offset + layer * period + i][2] for layer in range(layers)]
        gap_after = [gaps[offset + layer * period + i] for layer in range(layers)
                     if offset + layer * period + i < len(gaps)]
        mean = statistics.mean(durations)
        name = names[offset + i]
        lowered = name.lower()
        is_gemm = "reduce" not in lowered and any(tag in lowered for tag in ("gemm", "gemv", "nvjet", "cutlass",
                                                                              "xmma", "skinny"))
        weight = projection_bytes[gemm_index] if is_gemm and gemm_index < len(projection_bytes) else None
        gemm_index += bool(is_gemm)
        rate = f"{weight / mean / 1e6:6.2f} TB/s of {weight / 2**20:6.1f} MiB" if weight else ""
        print(f"  {i:>2} {mean:8.2f} µs  gap after {statistics.mean(gap_after):5.2f}  {rate:28} {short_name(name, 70)}")
        rows.append({"position": i, "name": name, "mean_us": mean, "gap_after_us": statistics.mean(gap_after),
                     "weight_bytes": weight})
    outside = kernels[:offset] + kernels[offset + layers * period:]
    print(f"outside the layers: {len(outside)} kernels, {sum(k[2] for k in outside):.1f} µs")
    for name, _, dur in outside:
        print(f"     {dur:8.2f} µs  {short_name(name, 70)}")
    layer_total = sum(r["mean_us"] + r["gap_after_us"] for r in rows)
    layer_floor = sum(projection_bytes) / bandwidth * 1e6
    print(f"a layer: {layer_total:.1f} µs with gaps against its weights' floor {layer_floor:.1f} µs "
          f"({layer_total / layer_floor:.2f}x)")
    return rows, outside


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen3-8b", help="qwen3-8b (random bf16 weights) or default")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--query", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--replays", type=int, default=50, help="replays timed for the wall figure")
    variant_flags = {  # each asks for more variants beside the defaults
        "--unbounded": "two: the kernel (alone, then with every fold) for every projection and the head, whatever "
                       "their size (the default model's fall below its bounds)",
        "--row-tiles": "two, for steps of more than 16 rows: the folds kept to one tile of rows (as before the "
                       "twenty-ninth session: cuBLAS and the norms' launches beyond it), and the few-rows kernel's "
                       "narrow tiles instead of kernels.skinny_linear.WIDE_TILE",
        "--pdl": "three, of the engine's programmatic dependent launch (kernels/_triton.py: on, heavy projections "
                 "plain): without it, every kernel dependent, and each kernel letting the next launch at its exit",
        "--rotary-tables": "one: the step's rotary cos/sin tables by torch's seven launches (kernels.rope."
                           "TABLES_IN_ONE_LAUNCH off) instead of the engine's one",
    }
    for flag, text in variant_flags.items():
        ap.add_argument(flag, action="store_true", help=f"more variants: {text}")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.target == "qwen3-8b":
        model = random_model(QWEN3_8B, torch.bfloat16)
    else:
        model = load_target(target_dir(args.target), dtype=torch.bfloat16, device="cuda")
    cfg = model.config
    bandwidth = copy_bandwidth()
    b, q, ctx = args.batch, args.query, args.context
    # The block table's capacity sets the attention's key splits (kernels.paged_attention.default_splits):
    # the engine captures its steps for the model's whole context; bench/step_bench.py for the context at hand
    engine_len = cfg.max_position_embeddings + q
    # (name, table length, settings of kernels.skinny_linear and shared.fused for the variant)
    cublas = {"MIN_WEIGHT_BYTES": math.inf, "FOLD": False}
    skinny = {"FOLD": False}
    folds_apart = {"FOLD_NORMS": False}
    variants = [("table for the context, cuBLAS", ctx + q, cublas),
                ("table like the engine's, cuBLAS", engine_len, cublas),
                ("table like the engine's, skinny projections and head", engine_len, skinny),
                ("... residual adds and SiLU·mul folded into them, norms apart", engine_len, folds_apart),
                ("... and the norms handed between them", engine_len, {}),
                ("... with SiLU·mul's programs 32 columns wide", engine_len, {"SWIGLU_BLOCK_N": 32})]
    if args.unbounded:  # a small model's projections fall below the bounds: through the kernel all the same
        variants += [("every projection and the head through the kernel, no folds", engine_len,
                      {"MIN_WEIGHT_BYTES": 0, "MIN_K": 0, "FOLD": False}),
                     ("... and every fold", engine_len, {"MIN_WEIGHT_BYTES": 0, "MIN_K": 0})]
    if args.row_tiles:
        variants += [("... folds within one tile of rows", engine_len, {"MAX_FOLD_ROWS": skinny_linear.MAX_ROWS}),
                     ("... row tiles of 32 x 16 columns", engine_len, {"WIDE_TILE": (32, 16, 256, 4, 4)})]
    if args.rotary_tables:
        variants.append(("... the rotary tables by torch's seven launches", engine_len, {"TABLES_IN_ONE_LAUNCH": False}))
    if args.pdl:  # the engine's PDL (on, heavy projections plain) against none, every kernel, the other trigger
        variants += [("... without PDL", engine_len, {"PDL": False}),
                     ("... PDL for every kernel, heavy projections too", engine_len, {"PDL_SKIP": frozenset()}),
                     ("... PDL, the next kernel launched at each one's exit", engine_len, {"PDL_TRIGGER": "exit"})]
    cache = model.new_cache(num_blocks=b * (-(-(ctx + q) // 16)) + 2, block_size=16)
    gen = torch.Generator().manual_seed(0)
    for s in range(b):
        cache.allocate(s)
        prompt = torch.randint(10, 10000, (ctx,), generator=gen)
        model(ForwardBatch(prompt.cuda(), torch.arange(ctx, device="cuda"), torch.tensor([0, ctx]), [s]), cache)
    step = StepBatch(list(range(b)), [torch.randint(10, 10000, (q,), generator=gen).tolist()] * b, [ctx] * b)
    floor_us = step_bytes(model, b, ctx) / bandwidth * 1e6
    print(f"{args.target} B={b} Q={q} context {ctx}: floor {floor_us:.1f} µs at copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s")
    results = []
    modules = {"MIN_WEIGHT_BYTES": skinny_linear, "MIN_K": skinny_linear, "SWIGLU_BLOCK_N": skinny_linear,
               "MAX_FOLD_ROWS": skinny_linear, "WIDE_TILE": skinny_linear, "FOLD": fused, "FOLD_NORMS": fused,
               "PDL": _triton, "PDL_TRIGGER": _triton, "PDL_SKIP": _triton,
               "TABLES_IN_ONE_LAUNCH": rope}
    defaults = {name: getattr(module, name) for name, module in modules.items()}
    try:
        for name, max_len, settings in variants:
            for setting, value in {**defaults, **settings}.items():
                setattr(modules[setting], setting, value)
            graphs = StepGraphs(model, cache, CaptureSpec(), max_batch=b, query_lens=(q,), max_len=max_len)
            graphs.forward(step)
            graph = graphs.graphs[(b, q)]
            wall = replay_us(graph, args.replays)
            kernels = kernels_of_one_replay(graph.replay)
            busy = sum(k[2] for k in kernels)
            gaps = [max(0.0, nxt[1] - (cur[1] + cur[2])) for cur, nxt in zip(kernels, kernels[1:])]
            attention = sum(k[2] for k in kernels if "attention" in k[0] or "combine_splits" in k[0])
            print(f"\n{name}: replay {wall:.1f} µs ({wall / floor_us:.2f}x the floor); {len(kernels)} kernels, busy "
                  f"{busy:.1f} µs, gaps {sum(gaps):.1f} µs; attention {attention:.1f} µs")
            rows, outside = layer_table(model, kernels, bandwidth)
            results.append({"variant": name, "table_len": max_len, "replay_us": wall,
                            "settings": {k: sorted(v) if isinstance(v, frozenset) else v for k, v in settings.items()},
                            "over_floor": wall / floor_us, "kernels": len(kernels), "busy_us": busy,
                            "gaps_us": sum(gaps), "attention_us": attention, "layer": rows,
                            "outside": [{"name": n, "us": d} for n, _, d in outside]})
            del graphs, graph
            torch.cuda.empty_cache()
    finally:
        for setting, value in defaults.items():
            setattr(modules[setting], setting, value)
    base = results[0]["replay_us"]
    print("\nside by side (replay µs, over the floor, speedup over the first):")
    for r in results:
        print(f"  {r['replay_us']:8.1f}  {r['over_floor']:5.2f}x  {base / r['replay_us']:5.3f}x  {r['variant']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"floor_profile-{args.target}-b{b}q{q}.json"), "w") as f:
            json.dump({"target": args.target, "batch": b, "query": q, "context": ctx, "floor_us": floor_us,
                       "bandwidth": bandwidth, "variants": results}, f, indent=1)


if __name__ == "__main__":
    main()
