"""A private NVIDIA MPS server for a service pair that shares one GPU (`specsplit up --mps`).

Without MPS, the target's and the drafter's processes each hold a CUDA context and the GPU time-slices
between them. On the H200 (thirty-fourth session, `tools/cross_gpu_probe.py`) the two-process skeleton
of a step took 0.90 ms against 0.66 ms for the same graphs in one process; under an MPS server, whose
one context runs both processes' kernels, 0.64 ms. The services with both streams waiting on the device
went from 0.70x to 0.80x in-process at one stream (`bench/split_bench.py --mps`).

`MpsServer` starts a guard process (`python -m specsplit.mps FOLDER`) that runs
`nvidia-cuda-mps-control -f` with its pipe and log directories in FOLDER, a temporary folder of its own,
so only processes given `MpsServer.env` become its clients: the GPU's settings (compute mode and the
rest) are not touched, and any MPS server the machine already runs is not either. The guard is on the
same lifeline as the services (`specsplit.lifeline`): when `stop()` is called, or the process that
started it dies however it dies, the guard sends the control daemon `quit` and waits for it; FOLDER
goes with `stop()`, or with the guard when its parent is gone. Start it before the services (their CUDA contexts are made as MPS clients or not at all) and stop
it after them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from specsplit.lifeline import Lifeline, watch_from_env
from specsplit.shared.errors import SpecsplitError

CONTROL = "nvidia-cuda-mps-control"
CONTROL_ENV = "SPECSPLIT_MPS_CONTROL"  # the control program's path, from the parent to the guard
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
READY = "ready"  # a file the guard writes into FOLDER once the daemon answers
QUIT_SECONDS = 15.0


class MpsUnavailable(SpecsplitError, RuntimeError):
    """No private MPS server could be started here (the command line prints it as an error, no traceback)."""

    grpc_code = "FAILED_PRECONDITION"


def client_env(folder: str | os.PathLike) -> dict[str, str]:
    """What a process needs in its environment to be a client of the server in `folder`."""
    return {PIPE_ENV: os.path.join(folder, "pipe"), LOG_ENV: os.path.join(folder, "log")}


class MpsServer:
    """The parent's side: start the guard, hand `env` to each service, `stop()` after the services."""

    def __init__(self, lifeline: Lifeline, *, control: str = CONTROL, timeout: float = 30.0) -> None:
        if os.environ.get(PIPE_ENV):
            raise MpsUnavailable(f"{PIPE_ENV} is set ({os.environ[PIPE_ENV]}): this process, and the services it "
                                 f"starts, are clients of that MPS server already, not of a private one (--mps off "
                                 f"does not try one)")
        path = shutil.which(control)
        if path is None:
            raise MpsUnavailable(f"a private MPS server needs NVIDIA's {control} on PATH (it comes with the "
                                 f"driver; in a container, with the NVIDIA container toolkit's compute capability)")
        self.folder = Path(tempfile.mkdtemp(prefix="specsplit-mps-"))
        self.env = client_env(self.folder)
        env = {**os.environ, **lifeline.child_env(grace=3 * QUIT_SECONDS), **self.env, CONTROL_ENV: path}
        with open(self.folder / "guard.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "specsplit.mps", str(self.folder)], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         pass_fds=lifeline.pass_fds)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not (self.folder / READY).exists():
            if self.proc.poll() is not None:
                raise MpsUnavailable(f"the MPS control daemon did not start:\n{self.log()[-2000:]}")
            if time.monotonic() > deadline:
                raise MpsUnavailable(f"the MPS control daemon did not answer within {timeout:.0f} s:\n"
                                   f"{self.log()[-2000:]}")
            time.sleep(0.05)

    def log(self) -> str:
        """The guard's and the daemon's logs, until `stop()` removes them."""
        parts = [self.folder / "guard.log", self.folder / "log" / "control.log"]
        return "".join(p.read_text(errors="replace") for p in parts if p.exists())

    def stop(self) -> None:
        """SIGTERM the guard (it quits the daemon); SIGKILL it if it hangs; remove the folder."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=2 * QUIT_SECONDS + 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _ask(control: str, env: dict[str, str], command: str) -> subprocess.CompletedProcess:
    return subprocess.run([control], input=f"{command}\n", env=env, capture_output=True, text=True,
                          timeout=QUIT_SECONDS)


def guard(folder: Path) -> int:
    """The guard process: run the daemon until told to stop (SIGTERM, or the parent's lifeline cut), then quit it."""
    control = os.environ[CONTROL_ENV]
    env = {**os.environ, **client_env(folder)}
    parent = os.getppid()
    for sub in ("pipe", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    watch_from_env()  # the parent gone: this process is SIGTERMed
    daemon = subprocess.Popen([control, "-f"], env=env, stdin=subprocess.DEVNULL)
    try:
        while not stop.is_set():  # ready once the daemon answers a query
            if daemon.poll() is not None:
                print(f"{control} -f exited with status {daemon.returncode}", flush=True)
                return 1
            try:
                if _ask(control, env, "get_server_list").returncode == 0:
                    break
            except subprocess.TimeoutExpired:
                pass
            stop.wait(0.1)
        (folder / READY).touch()
        while not stop.is_set() and daemon.poll() is None:
            stop.wait(0.5)
        if daemon.poll() is not None:
            print(f"{control} -f exited with status {daemon.returncode} while serving", flush=True)
            return 1
        return 0
    finally:
        if daemon.poll() is None:
            try:
                _ask(control, env, "quit")
                daemon.wait(timeout=QUIT_SECONDS)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        if os.getppid() != parent:  # orphaned: nobody else will remove the folder (else MpsServer.stop does,
            shutil.rmtree(folder, ignore_errors=True)  # after reading the logs in it)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m specsplit.mps FOLDER (started by specsplit.mps.MpsServer)")
    sys.exit(guard(Path(sys.argv[1])))
