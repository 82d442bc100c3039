#!/usr/bin/env python3
"""Both services in one container (the gpu-legacy overlay): the drafter first, the target once it serves.

Usage: run_pair.py DRAFTER_COMMAND... -- TARGET_COMMAND...

This keeps the order the two-container pod gets from running the drafter as a native sidecar. The
target attaches to the drafter when it starts (and gives up after --drafter-timeout), so it starts
only once the drafter answers SERVING on its unix socket. On SIGTERM the target drains first, then the
drafter, which otherwise would wait for the still-connected target. If either exits by itself, the
other is stopped and this exits non-zero, so the kubelet restarts the container.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

from health_probe import check

POLL_SECONDS = 0.5


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        raise SystemExit(__doc__.split("\n\n")[1])
    cut = argv.index("--")
    drafter, target = argv[:cut], argv[cut + 1:]
    if not drafter or not target:
        raise SystemExit(__doc__.split("\n\n")[1])
    return drafter, target


def unix_listen(command: list[str]) -> str:
    """The drafter's `--listen unix:PATH` address: where the target reaches it, so where we probe it."""
    for flag, value in zip(command, command[1:]):
        if flag == "--listen" and value.startswith("unix:"):
            return value
    raise SystemExit("the drafter command needs --listen unix:PATH")


def wait_serving(address: str, proc: subprocess.Popen, stop: threading.Event) -> bool:
    """Until the drafter serves (True), or it exited or we were told to stop (False). No deadline of
    our own: the target's startupProbe bounds the start-up and restarts the container."""
    while not stop.is_set():
        if proc.poll() is not None:
            return False
        if check(address, timeout=1.0)[0]:
            return True
        stop.wait(POLL_SECONDS)
    return False


def stop_process(proc: subprocess.Popen | None) -> int | None:
    """SIGTERM and wait: the service drains by itself (--drain-seconds), the kubelet bounds the rest."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait()


def main(argv: list[str]) -> int:
    drafter_command, target_command = split(argv)
    address = unix_listen(drafter_command)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    drafter = subprocess.Popen(drafter_command)
    target = subprocess.Popen(target_command) if wait_serving(address, drafter, stop) else None
    while target is not None and not stop.wait(POLL_SECONDS):
        if drafter.poll() is not None or target.poll() is not None:
            break
    target_code, drafter_code = stop_process(target), stop_process(drafter)
    if not stop.is_set():
        print(f"run_pair: a service exited by itself (drafter {drafter_code}, target {target_code})",
              file=sys.stderr, flush=True)
        return 1
    return target_code or drafter_code or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
