"""Where a speculative step's time goes: wall time vs GPU busy time per engine step, and the top GPU
kernels and host ops, for the in-process engine (target graphs + drafter graphs).

    python bench/profile_step.py --drafter dflash --batch 1 --steps 30 --out DIR

GPU busy < wall means the step waits on the host (launches, Python, synchronisations).
"""

from __future__ import annotations

import argparse
import os
import time
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.profiler import ProfilerActivity, profile

from specsplit.kernels import chain_accept, chain_meta, fed_inputs, kv_move, top_k, tree_accept
from specsplit.local import LocalSetup, make_drafter, target_dir
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.tokenizer import Tokenizer
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.model import load_target
from specsplit.target_service.sequence import Request

# The kernels that stand for a run of small torch ops in a step's graph, each with a module switch to its reference
ONE_LAUNCH = {"tree_accept": tree_accept, "fed_inputs": fed_inputs, "chain_meta": chain_meta, "kv_move": kv_move,
              "top_k": top_k, "chain_accept": chain_accept}
PROMPT = "Explain how a hash map works, with an example in Python."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="dflash", help="dflash, mtp or none")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--num-drafts", type=int, default=None, metavar="K",
                    help="drafts per step (default: the drafter's most)")
    ap.add_argument("--draft-tree", type=int, default=0, metavar="N",
                    help="verify draft trees of N nodes (EngineConfig.draft_tree; chained in-process)")
    ap.add_argument("--torch-kernels", nargs="+", default=[], choices=sorted(ONE_LAUNCH), metavar="NAME",
                    help="run these one-launch kernels' torch references instead, to measure the kernels against "
                         f"them: {', '.join(sorted(ONE_LAUNCH))}")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--stacks", action="store_true",
                    help="also list host->device and device->host copies and syncs by the Python line that made them")
    ap.add_argument("--op-sites", action="store_true",
                    help="run the chained step uncaptured (chain_capture 0) and list its eager device ops by the "
                         "Python line that made them: what a captured step's small kernels are")
    args = ap.parse_args()
    if args.num_drafts is not None and args.num_drafts < 1:
        ap.error("--num-drafts: at least 1")
    torch.set_grad_enabled(False)
    for name in args.torch_kernels:
        ONE_LAUNCH[name].KERNEL = False
    setup = LocalSetup(drafter=args.drafter, device="cuda", dtype="bfloat16", seed=0)
    folder = target_dir("default")
    model = load_target(folder, dtype=torch.bfloat16, device="cuda")
    tokenizer = Tokenizer.from_dir(folder)
    drafter = None if args.drafter == "none" else make_drafter(args.drafter, model, setup)
    engine = Engine(model, drafter, EngineConfig(max_batch=args.batch, num_drafts=args.num_drafts,
                                                 draft_tree=args.draft_tree,
                                                 **({"chain_capture": 0} if args.op_sites else {})))
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    params = SamplingParams(max_tokens=48 * args.steps + 64, ignore_eos=True)  # three stretches of steps
    for i in range(args.batch):
        engine.add(Request(f"r{i}", prompt, params))
    for _ in range(20):  # prefill, captures of the buckets in use (a chained step shape: after 8 runs)
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    unprofiled = (time.perf_counter() - start) / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / args.steps  # ms
    k = ("" if args.num_drafts is None else f", k = {args.num_drafts}") \
        + (f", trees of {args.draft_tree} nodes" if args.draft_tree else "") \
        + (", chained step uncaptured" if args.op_sites else "") \
        + "".join(f", {name} in torch" for name in args.torch_kernels)
    lines = [f"drafter {args.drafter}, batch {args.batch}{k}: wall {unprofiled * 1e3:.3f} ms/step unprofiled, "
             f"{wall * 1e3:.3f} profiled, GPU busy {busy:.3f} ms/step, "
             f"{len(kernels) / args.steps:.0f} kernels/step",
             prof.key_averages().table(sort_by="device_time_total", row_limit=15),
             prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)]
    if args.stacks:
        lines.append(copy_sites(engine, args.steps))
    if args.op_sites:
        lines.append(op_sites(engine, args.steps))
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        suffix = ("" if args.num_drafts is None else f"-k{args.num_drafts}") \
            + (f"-tree{args.draft_tree}" if args.draft_tree else "") + ("-sites" if args.op_sites else "") \
            + "".join(f"-torch-{name}" for name in args.torch_kernels)
        with open(os.path.join(args.out, f"profile-{args.drafter}-b{args.batch}{suffix}.txt"), "w") as f:
            f.write(text)


class HostDeviceSites(TorchFunctionMode):
    """Counts the Python calls that move data between host and device or read the device, by the
    innermost line of our code that made them (the profiler's own stacks come back empty here)."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy"}

    def __init__(self) -> None:
        super().__init__()
        self.sites: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        kind = None
        if name in self.READS and args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
            kind = "device->host"
        elif name in ("tensor", "as_tensor") and "cuda" in str(kwargs.get("device", "")):
            kind = "host->device (pageable)"
        elif name in ("to", "cuda", "copy_") and args and isinstance(args[0], torch.Tensor):
            other = args[1] if len(args) > 1 else kwargs.get("device")
            src_cuda = args[0].is_cuda if name != "copy_" else (isinstance(other, torch.Tensor) and other.is_cuda)
            dst_cuda = (name == "cuda" or "cuda" in str(other)) if name != "copy_" else args[0].is_cuda
            if src_cuda != dst_cuda:
                pinned = (args[0] if name != "copy_" else other).is_pinned() if not src_cuda else False
                kind = f"host->device ({'pinned' if pinned else 'pageable'})" if dst_cuda else "device->host"
        if kind is not None:
            key = f"{kind:26} {name:10} {our_line(('_service/', '/shared/', 'specsplit/'))}"
            self.sites[key] = self.sites.get(key, 0) + 1
        return func(*args, **kwargs)


def counted_steps(engine, steps: int, mode) -> list[tuple[str, int]]:
    """`steps` engine steps under `mode` (one of the counters here): its sites, most counted first."""
    with mode:
        for _ in range(steps):
            engine.step()
    torch.cuda.synchronize()
    return sorted(mode.sites.items(), key=lambda kv: -kv[1])


def our_line(parts: tuple[str, ...]) -> str:
    """The innermost line of the caller's stack in a file whose path holds one of `parts`, as folder/file:line name."""
    frame = next((f for f in reversed(traceback.extract_stack()[:-2]) if any(part in f.filename for part in parts)),
                 None)
    if frame is None:
        return "?"
    return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"


def copy_sites(engine, steps: int) -> str:
    rows = counted_steps(engine, steps, HostDeviceSites())
    out = ["host<->device transfers and device reads per step, by call site:"]
    out += [f"{n / steps:6.2f}  {site}" for site, n in rows[:40]]
    return "\n".join(out)


class DeviceOpSites(TorchDispatchMode):
    """Counts the aten ops on CUDA tensors that launch work (views and metadata left out), by the innermost
    line of our code that made them. Graph replays and Triton launches are not aten ops: not counted."""

    VIEWS = {"view", "_unsafe_view", "slice", "select", "expand", "as_strided", "unsqueeze", "squeeze", "permute",
             "t", "transpose", "alias", "detach", "lift_fresh", "split", "unbind", "split_with_sizes", "chunk",
             "narrow", "diagonal", "unfold", "_reshape_alias", "reshape", "view_as", "sym_size", "sym_stride",
             "sym_numel", "sym_storage_offset", "is_same_size", "empty", "empty_like", "empty_strided",
             "resolve_conj", "resolve_neg", "record_stream"}

    def __init__(self) -> None:
        super().__init__()
        self.sites: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if name not in self.VIEWS and any(t.is_cuda for t in tensors):
            key = f"{name:22} {our_line(('_service/', '/shared/', '/kernels/'))}"
            self.sites[key] = self.sites.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


def op_sites(engine, steps: int) -> str:
    rows = counted_steps(engine, steps, DeviceOpSites())
    total = sum(n for _, n in rows) / steps
    out = [f"eager device ops per step outside captured graphs ({total:.1f}), by call site:"]
    out += [f"{n / steps:6.2f}  {site}" for site, n in rows[:120]]
    return "\n".join(out)


if __name__ == "__main__":
    main()
