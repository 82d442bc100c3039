"""A drafter + target service pair as subprocesses on unix sockets: spawn, wait for health, hand out clients.

Used by `specsplit up` / `specsplit demo` and by the pytest fixtures in `specsplit.harness`; it imports
nothing test-only, so the command line works without pytest installed. The services never outlive the
process that spawned them (`specsplit.lifeline`), and a folder `spawn` made is removed when they stop.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from specsplit.client import Client, Retry
from specsplit.lifeline import Lifeline
from specsplit.mps import MpsServer, MpsUnavailable
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.gguf_import import default_target_dir
from specsplit.shared.security import TOKEN_ENV
from specsplit.shared.serving import wait_healthy

log = logging.getLogger(__name__)

# The two services on one GPU, linked (`device_waits`), under MPS, the target's engine in its own process, as `up`
# starts them: what gRPC clients saw (H100, fifty-fifth session, `pair_bench --streams 1 4 8 --speculate-below 0 4`)
# was 1.74x, 1.37x and 1.10x target only at 1, 4 and 8 streams drafting at every batch size, against 1.04x and 0.99x
# resting from the drafter from four sequences on. (Below four was chosen in the fiftieth session, the engine then
# sharing the front end's GIL: trees 0.88x target only at 4 streams, 0.63x at 8.) Past eight nothing was measured
# that way; in process, where the split costs nothing, trees ran 0.92x target only at 12 streams and 0.66x at 16.
# So the pair drafts in steps of up to eight sequences (trees, `target serve --draft-tree-batch`'s bound too).
SHARED_GPU_SPECULATE_BELOW = 9
# Once the process that spawned the pair is gone, a service has its drain plus this long to stop in order before
# its lifeline ends it at once (specsplit.lifeline): a thread stuck at exit must not keep it running for good.
STOP_MARGIN_SECONDS = 10.0


@dataclass(frozen=True)  # used as a default argument: must not be mutable
class ServiceSpec:
    target: str = "default"
    drafter: str = "dflash"  # as --drafter takes it (specsplit.local.DRAFTER_HELP)
    device: str = "cpu"
    dtype: str | None = None
    seed: int = 0
    target_args: tuple[str, ...] = ()
    drafter_args: tuple[str, ...] = ()
    startup_timeout: float = 180.0
    drain_seconds: float = 5.0  # how long a SIGTERMed service lets calls in flight finish
    auth_token: str | None = None  # both services require it (and the target sends it to its drafter)
    # Both services clients of a private MPS server (specsplit.mps): one GPU context runs both processes' kernels
    # instead of two contexts time-slicing the GPU. True: required (an error where it cannot start); False: off;
    # None ("auto"): on with a CUDA device and a drafter where it can be, else (no nvidia-cuda-mps-control, an MPS
    # client already, the server or the services under it not starting) without it, with a warning saying why.
    # Auto by default since the fifty-second session's H100 run (gpu_round.sh mps-default, mps-default-tests): under
    # it test_mps and test_chaos_gpu passed, and the 21 of test_split_gpu's 32 cases that ran in the time left (none
    # failed); pair_bench's pairs drafting below 4 streams (chains then) ran 1.45x target only at one stream under
    # MPS against 1.14x without, 1.25x against 1.05x at two.
    mps: bool | None = None
    # The pair's streams wait for each other on the device: the drafter serves this one target (--device-waits
    # --max-targets 1) and the target asks for a tree step's candidates as the step before launches (--trees-ahead),
    # so neither host waits for the other's GPU work before launching its own. None: on with a CUDA device
    device_waits: bool | None = None
    # The target drafts only in steps of fewer than this many sequences; from there on its sequences rest from
    # the drafter and decode as target only (target serve --drafts-by-batch N:0, EngineConfig.resume_after).
    # None: SHARED_GPU_SPECULATE_BELOW on a CUDA device (the two services share its GPU), no limit elsewhere;
    # 0: no limit. Left alone when target_args give --drafts-by-batch.
    speculate_below: int | None = None

    def __post_init__(self) -> None:
        if self.speculate_below is not None and (isinstance(self.speculate_below, bool)
                                                 or not isinstance(self.speculate_below, int)
                                                 or self.speculate_below < 0):
            raise InvalidRequest(f"--speculate-below is a number of sequences >= 0 (0: no limit), got "
                                 f"{self.speculate_below!r}")
        if self.mps and not self.device.startswith("cuda"):
            raise InvalidRequest(f"--mps shares one GPU between the two services: it needs a CUDA device, "
                                 f"not {self.device!r}")
        if self.device_waits and not self.device.startswith("cuda"):
            raise InvalidRequest(f"--device-waits orders the two services' CUDA streams: it needs a CUDA device, "
                                 f"not {self.device!r}")
        if self.device_waits and self.drafter == "none":
            raise InvalidRequest("--device-waits orders the target's stream and its drafter's: give a drafter")
        for name in ("drafter", "target"):
            self.drain_for(name)  # (refused here, not as the service starts)
        clash = self._unlinking_drafter_args()
        if self.device_waits and clash:
            raise InvalidRequest(f"--device-waits serves one target with prepared chained graphs: the drafter's "
                                 f"{clash} says otherwise (leave it out, or pass device_waits=False)")

    def drain_for(self, name: str) -> float:
        """How long `name` ("target" or "drafter") drains once SIGTERMed: the last --drain-seconds of its own
        arguments (argparse takes the last), else `drain_seconds`."""
        given, args = self.drain_seconds, self.target_args if name == "target" else self.drafter_args
        for i, arg in enumerate(args):
            if arg == "--drain-seconds":
                given = args[i + 1] if i + 1 < len(args) else None
            elif arg.startswith("--drain-seconds="):
                given = arg.partition("=")[2]
        try:
            seconds = float(given)
        except (TypeError, ValueError):
            seconds = float("nan")
        if isinstance(given, bool) or not 0 <= seconds < float("inf"):
            raise InvalidRequest(f"the {name}'s --drain-seconds is a number of seconds >= 0, not {given!r}")
        return seconds

    def _unlinking_drafter_args(self) -> str | None:
        """The first of `drafter_args` a drafter serving with device waits refuses (DrafterSettings), if any."""
        for arg in self.drafter_args:
            if arg.split("=", 1)[0] in ("--max-targets", "--no-chain-graphs", "--no-prepare-chains"):
                return arg
        return None

    @property
    def tries_mps(self) -> bool:
        """Whether the pair starts a private MPS server (see `mps`): as asked, else (None) with a CUDA device and
        a drafter (two processes on one GPU)."""
        if self.mps is not None:
            return self.mps
        return self.device.startswith("cuda") and self.drafter != "none"

    @property
    def waits_on_device(self) -> bool:
        """Whether the pair links its streams: as asked, else (None) on a CUDA device unless the drafter's own
        arguments set what a linked drafter cannot take (its --max-targets, --no-chain-graphs, ...)."""
        if self.device_waits is not None:
            return self.device_waits
        return self.device.startswith("cuda") and self.drafter != "none" and self._unlinking_drafter_args() is None

    @property
    def speculates_below(self) -> int:
        """The batch size from which the target drafts nothing (0: none): as asked, else (None) on a CUDA device
        SHARED_GPU_SPECULATE_BELOW; 0 where the target's own arguments give --drafts-by-batch or there is no drafter."""
        if self.drafter == "none" or any(a.split("=", 1)[0] == "--drafts-by-batch" for a in self.target_args):
            return 0
        if self.speculate_below is not None:
            return self.speculate_below
        return SHARED_GPU_SPECULATE_BELOW if self.device.startswith("cuda") else 0

    def service_args(self, name: str) -> tuple[str, ...]:
        """What `name` ("target" or "drafter") is started with beyond the common flags: the pair's device waits
        (`device_waits`), the target's batch size to stop drafting at (`speculate_below`), then `target_args` /
        `drafter_args`."""
        given = self.target_args if name == "target" else self.drafter_args
        if name == "target" and self.speculates_below:
            given = ("--drafts-by-batch", f"{self.speculates_below}:0") + given
        if not self.waits_on_device:
            return given
        linked = ("--trees-ahead",) if name == "target" else ("--device-waits", "--max-targets", "1")
        return linked + given


def _common(spec: ServiceSpec) -> list[str]:
    args = ["--target", spec.target, "--device", spec.device, "--seed", str(spec.seed),
            "--drain-seconds", str(spec.drain_seconds)]
    return args + (["--dtype", spec.dtype] if spec.dtype else [])


@dataclass
class Services:
    """A running drafter + target pair on unix sockets in a private directory."""

    spec: ServiceSpec
    workdir: Path
    drafter_address: str | None = None
    target_address: str = ""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    owns_workdir: bool = False  # spawn() made it: removed on stop, or by the services if this process dies
    lifeline: Lifeline | None = None  # made with the first service, cut on stop
    mps: MpsServer | None = None  # started before the services, stopped after them

    def __post_init__(self) -> None:
        if self.spec.drafter != "none":
            self.drafter_address = f"unix:{self.workdir}/drafter.sock"
        self.target_address = f"unix:{self.workdir}/target.sock"

    def start(self) -> "Services":
        if self.spec.tries_mps:
            try:
                self.mps = MpsServer(self._lifeline())
            except MpsUnavailable as exc:
                if self.spec.mps:
                    raise
                log.warning("the services share the GPU without MPS (their two contexts time-slice it): %s", exc)
        if self.drafter_address:
            self.start_drafter()
        self.start_target()
        return self

    def start_target(self) -> None:
        """The target alone; it serves without speculation until its drafter (if any) answers."""
        drafter = ["--drafter", self.drafter_address] if self.drafter_address else []
        self._spawn("target", ["target", "serve", "--listen", self.target_address, *drafter,
                               *_common(self.spec), *self.spec.service_args("target")])
        self._wait("target", self.target_address)

    def start_drafter(self) -> None:
        self._spawn("drafter", ["drafter", "serve", "--listen", self.drafter_address,
                                "--drafter", self.spec.drafter, *_common(self.spec), *self.spec.service_args("drafter")])
        self._wait("drafter", self.drafter_address)

    def _wait(self, name: str, address: str) -> None:
        proc = self.procs[name]
        try:
            wait_healthy(address, self.spec.startup_timeout, alive=lambda: proc.poll() is None)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}\n--- {name}.log ---\n{self.log(name)[-4000:]}") from None

    def _lifeline(self) -> Lifeline:
        if self.lifeline is None:
            self.lifeline = Lifeline(self.workdir if self.owns_workdir else None)
        return self.lifeline

    def _spawn(self, name: str, args: list[str]) -> None:
        lifeline = self._lifeline()
        log = open(self.workdir / f"{name}.log", "ab")
        # The token travels in the environment, not argv (which `ps` shows anyone); none inherited.
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        env.update(lifeline.child_env(grace=self.spec.drain_for(name) + STOP_MARGIN_SECONDS),
                   **(self.mps.env if self.mps else {}),
                   **({TOKEN_ENV: self.spec.auth_token} if self.spec.auth_token else {}))
        with log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "specsplit", *args], stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, pass_fds=lifeline.pass_fds, env=env)

    def client(self, *, timeout: float | None = 600.0, retry: Retry = Retry()) -> Client:
        """A `specsplit.client.Client` of the target that sends the pair's token; close it when done."""
        return Client(self.target_address, token=self.spec.auth_token, timeout=timeout, retry=retry)

    def kill_drafter(self, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop("drafter")
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM each service (target first), then SIGKILL whatever is left after 20 s; then the MPS server."""
        for name in ("target", "drafter"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.mps is not None:
            self.mps.stop()
            self.mps = None
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None
        if self.owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Services":
        return self  # spawn() has started it

    def __exit__(self, *exc) -> None:
        self.stop()


def spawn(spec: ServiceSpec = ServiceSpec(), workdir: str | os.PathLike | None = None) -> Services:
    """Start a service pair; use as a context manager (or call stop())."""
    if spec.target == "default":
        default_target_dir()  # converted here, once, so its progress shows on this terminal, not in a service log
    folder = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="specsplit-"))
    folder.mkdir(parents=True, exist_ok=True)
    services = Services(spec, folder, owns_workdir=workdir is None)
    try:
        return services.start()
    except Exception as exc:
        under_mps = services.mps is not None
        services.stop()
        if spec.mps is None and under_mps:  # (MPS was not required: try once more without it)
            log.warning("the services did not start under MPS; starting them without it: %s",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return spawn(replace(spec, mps=False), workdir)
        raise
    except BaseException:
        services.stop()
        raise
