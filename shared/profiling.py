"""A torch profiler over a window of a service's steps: where a step's host and GPU time go.

`drafter serve --profile-steps 300:400 --profile-out trace.json` records Step messages 300 to 400
(counted from the first, whatever the client) and writes a Chrome trace (open it in Perfetto) and,
beside it, `trace.json.txt` with the ops' totals. CUDA kernels and runtime calls are recorded when the
service runs on a GPU. Profiling slows the steps it records (each CUDA call a little, a graph launch
by its nodes): read the order of things and their GPU times, not the recorded steps' wall time. With
`--profile-host` only the host is recorded (no CUDA activity, so no CUPTI callback inflating each
launch), with Python stacks: where a step's host time goes, op by op and by calling line. With
`--profile-on-signal` the steps count from the latest SIGUSR1 instead of from the start (`kill -USR1
PID`: the next Step messages FIRST to LAST, on a service already warm), and each signal after a window
is written records another over the same path.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def parse_window(text: str) -> tuple[int, int]:
    """'FIRST:LAST' → (first, last), 1 <= first <= last; ValueError with the reason otherwise."""
    first, sep, last = text.partition(":")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise ValueError(f"--profile-steps takes FIRST:LAST (two step numbers), got {text!r}")
    window = int(first), int(last)
    if not 1 <= window[0] <= window[1]:
        raise ValueError(f"--profile-steps {text}: steps count from 1 and FIRST must not pass LAST")
    return window


class StepWindow:
    """Counts steps (`enter` before one, `exit` after it) and profiles steps first..last, once."""

    def __init__(self, first: int, last: int, out: str | Path, *, host_only: bool = False,
                 on_signal: bool = False) -> None:
        if not 1 <= first <= last:
            raise ValueError(f"profile window {first}..{last}: steps count from 1 and first must not pass last")
        self.first, self.last, self.out = first, last, Path(out)
        self.host_only = host_only
        self._lock = threading.Lock()
        self._count = 0
        self._profile: torch.profiler.profile | None = None
        self._counting = not on_signal  # on_signal: nothing counts before the first arm()
        self._armed = False
        self.on_signal = on_signal
        self.written = False

    def arm(self) -> None:
        """Count steps from the next one (a signal handler may call this: it only sets a flag). A window
        being recorded ends as it would; a later one then starts over, its trace replacing the last."""
        self._armed = True

    def enter(self) -> int:
        """Before a step: returns its number (from 1; 0 while not counting); the first of the window
        starts the profiler."""
        with self._lock:
            if self._armed and self._profile is None:
                self._armed, self._counting, self._count = False, True, 0
            if not self._counting:
                return 0
            self._count += 1
            if self._count == self.first:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available() and not self.host_only:
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self._profile = torch.profiler.profile(activities=activities, with_stack=self.host_only)
                self._profile.__enter__()
                log.info("profiling steps %d to %d into %s", self.first, self.last, self.out)
            return self._count

    def exit(self, step: int) -> None:
        """After step `step` (what `enter` returned): the last of the window stops it and writes."""
        if step != self.last:
            return
        with self._lock:
            profile, self._profile = self._profile, None
            self._counting = self._counting and not self.on_signal  # on a signal: until the next one
        if profile is None:
            return
        profile.__exit__(None, None, None)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.out))
        averages = profile.key_averages()
        if self.host_only:  # the ops, then the ops by the Python lines that called them
            text = averages.table(sort_by="self_cpu_time_total", row_limit=60) + "\n" + profile.key_averages(
                group_by_stack_n=6).table(sort_by="cpu_time_total", row_limit=60)
        else:
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            text = averages.table(sort_by="self_cpu_time_total", row_limit=60) + "\n" + averages.table(
                sort_by=sort, row_limit=30)
        Path(f"{self.out}.txt").write_text(text)
        self.written = True
        log.info("profile of steps %d to %d written to %s", self.first, self.last, self.out)
