"""How many device kernels (CUDA) or top-level aten ops (CPU) a call issues: a small model's step
on a GPU is bound by this count, so the benches report it beside their timings."""

from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def count_launches(call: Callable[[], object], device: str) -> int | None:
    cuda = device.startswith("cuda")
    try:
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            call()
            if cuda:
                torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a profiler that does not work here leaves the timings
        print(f"(no launch count: {exc})")
        return None
    if cuda:
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
