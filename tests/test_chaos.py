"""Issue 9's chaos suite: drafters SIGKILLed and SIGSTOPped at random moments under load, clients that
cancel at random points (prefill included), a target SIGKILLed mid-generation. Every request that
completes equals target-only token for token, and at the end nothing is left: no sequence, session,
registration, mapping or /dev/shm segment.

Drafters are real processes killed with real signals. Starting one from scratch (interpreter, torch,
weights) costs seconds on 2 cores, so they are forked from a warm parent (`Zygote`) that has imported
everything and built the seeded drafter: a fresh drafter listens ~0.1 s after it is asked for, and a
hundred kills fit in a couple of minutes. Each forked drafter serves exactly as `drafter serve` does
(DrafterServer over the same drafter) and answers `stats` (what it holds) to the test over a pipe.
The target (tiny chat model, tests/conftest.py) runs in this process, where its engine can be inspected,
except in the target-SIGKILL test. The frozen-drafter detection time is test_outages' test, not repeated here.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from specsplit.local import LocalSetup
from specsplit.services import TargetSettings, start_target
from specsplit.shared import wire
from specsplit.shared.errors import SpecsplitError
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.transport import SHM_DIR, SHM_PREFIX
from specsplit.target_service.engine import EngineConfig
from tests.raw_client import RawClient
from tests.test_cancellation import wait_until

PROMPTS = ["Count from one to a thousand:", "Hi", "Write a poem about the sea. " * 3, "The capital of France is",
           "List the planets, one per line, with their moons and their distances from the sun. " * 8,
           "Summarize: " + "the quick brown fox jumps over the lazy dog, " * 250]  # ~2,500 tokens: a long prefill
MAX_TOKENS = 28
START_TIMEOUT = 120  # the warm parent imports torch and builds the drafter once


# --- drafters forked from a warm parent -----------------------------------------------------------


def _zygote_main(conn, target: str, address: str) -> None:
    from specsplit.drafter_service.heads import TargetInfo
    from specsplit.local import build_drafter, target_dir
    from specsplit.services import checkpoint_head
    from specsplit.shared.checkpoint import load_config

    setup = LocalSetup(target=target, drafter="random-dflash")
    folder = target_dir(target)
    head = checkpoint_head(folder, setup.torch_dtype, setup.device)
    drafter = build_drafter(setup.drafter, TargetInfo.from_config(load_config(folder)), head, setup)
    children: dict[int, object] = {}
    deaths: dict[str, int] = {}  # how the drafters it forked ended: only our SIGKILLs are expected
    conn.send("ready")
    while True:
        try:
            command, *args = conn.recv()
        except EOFError:
            return
        _reap(children, deaths)
        if command == "deaths":
            conn.send(dict(deaths))
        if command == "fork":
            mine, theirs = mp.Pipe()
            pid = os.fork()
            if pid == 0:
                for other in (conn, mine, *children.values()):
                    other.close()
                _drafter_child(theirs, drafter, head, address)
                os._exit(0)
            theirs.close()
            children[pid] = mine
            conn.send(pid if mine.poll(30) and mine.recv() == "ready" else None)
        elif command == "stats":
            child = children.get(args[0])
            try:
                child.send("stats")
                conn.send(child.recv() if child.poll(30) else None)
            except (OSError, EOFError, AttributeError):
                conn.send(None)


def _reap(children: dict, deaths: dict) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.pop(pid).close()
            signaled = os.WIFSIGNALED(status)
            cause = signal.Signals(os.WTERMSIG(status)).name if signaled else f"exit {os.WEXITSTATUS(status)}"
            deaths[cause] = deaths.get(cause, 0) + 1


def _drafter_child(conn, drafter, head, address: str) -> None:
    """A drafter service over the parent's drafter (copy-on-write), until its pipe closes or a signal."""
    from specsplit.drafter_service.server import DrafterServer, serve

    server_obj = DrafterServer(drafter, head=head, device="cpu")
    served = serve(server_obj, [address])
    conn.send("ready")
    while True:
        try:
            conn.recv()
        except (EOFError, OSError):
            served.stop(None)
            return
        conn.send(_holdings(server_obj))


def _holdings(server_obj) -> dict:
    """What a drafter holds now: its sessions and streams, sequences, carried KVs, registered buffers,
    and the shared-memory segments it holds open (the kernel's view, not its own bookkeeping)."""
    with server_obj._lock:
        buffers = sum(len(s._buffer_bytes) for s in server_obj._sessions.values())
        store = server_obj.proposer.store
        return {"sessions": len(server_obj._sessions), "streams": server_obj.num_streams, "sequences": len(store),
                "carried": store.num_carried, "buffers": buffers, "shm_fds": len(_shm_fds())}


def _shm_fds(pid: str = "self") -> list[str]:
    """The shared-memory segments a process holds open (the drafter reads rows through their fds)."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith(f"{SHM_DIR}/{SHM_PREFIX}"):
            found.append(link)
    return found


# glibc settings under which a process's RSS follows what it holds (see Zygote and the soak test).
MALLOC_SETTINGS = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "131072"}


class Zygote:
    """The warm parent and the one drafter it is serving now at `address`."""

    def __init__(self, target: str, address: str) -> None:
        ctx = mp.get_context("spawn")
        self.address = address
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_zygote_main, args=(child_conn, target, address), daemon=True)
        # glibc gives threads that allocate arenas of their own (up to eight per core), so with 64 streams
        # the drafter's RSS steps up whenever a gRPC worker first allocates (+18 MiB at 112 s of a CI soak,
        # flat after): not a leak, but as large as the soak's bound. Two arenas keep RSS to what is held.
        # And glibc's mmap threshold rises with each large block freed, after which blocks that size come
        # from the heap and stay: a CI soak's drafter stepped 357 -> 386 MiB at
        # 119 s and stayed flat there. A fixed threshold returns large blocks when they are freed.
        saved = {key: os.environ.get(key) for key in MALLOC_SETTINGS}
        os.environ.update(MALLOC_SETTINGS)
        try:
            self.process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    del os.environ[key]
                else:
                    os.environ[key] = value
        assert self.conn.poll(START_TIMEOUT) and self.conn.recv() == "ready"
        self.pid: int | None = None
        self.faults = {"SIGKILL": 0, "SIGSTOP": 0}

    def fork(self) -> int:
        self.conn.send(("fork",))
        self.pid = self.conn.recv()
        assert self.pid, "the forked drafter did not start"
        return self.pid

    def stats(self) -> dict:
        self.conn.send(("stats", self.pid))
        return self.conn.recv()

    def deaths(self) -> dict:
        """How the drafters that ended did (reaped by the parent): {"SIGKILL": n, ...}."""
        self.conn.send(("deaths",))
        return self.conn.recv()

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.faults["SIGKILL"] += 1
        self.pid = None

    def freeze(self, seconds: float) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.faults["SIGSTOP"] += 1
        time.sleep(seconds)
        os.kill(self.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)
        self.conn.close()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


@pytest.fixture(scope="module")
def folder():
    path = Path(tempfile.mkdtemp(prefix="chaos-"))  # short: unix socket paths are at most 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def zygote(tiny_chat_dir, folder):
    z = Zygote(str(tiny_chat_dir), f"unix:{folder}/d.sock")
    yield z
    z.close()


@pytest.fixture(scope="module")
def target(tiny_chat_dir, folder, zygote):
    """The target in this process, its drafter forked; the target-only outputs of every prompt."""
    zygote.fork()
    address = f"unix:{folder}/t.sock"
    loop, served = start_target(TargetSettings((address,), LocalSetup(target=str(tiny_chat_dir)), zygote.address,
                                               EngineConfig(), drafter_timeout=30))
    client = RawClient(address)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = {p: client.generate(p, params, speculative=False).token_ids for p in PROMPTS}
    yield loop, client, reference
    served.stop(None).wait()
    loop.stop()


def _our_segments() -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{SHM_PREFIX}{os.getpid()}-")]


# --- load: requests that must equal target-only, some cancelled at random points -------------------


@dataclasses.dataclass
class Load:
    """Client threads looping requests until stopped; every completed one is checked against target-only."""

    client: RawClient
    reference: dict
    seed: int
    cancel_rate: float = 0.25
    completed: int = 0
    cancelled: int = 0
    speculated: int = 0
    wrong: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, clients: int) -> "Load":
        for i in range(clients):
            thread = threading.Thread(target=self._run, args=(random.Random(self.seed * 100 + i),), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self, rng: random.Random) -> None:
        while not self._stop.is_set():
            prompt = rng.choice(PROMPTS)
            cancel_after = rng.choice([0, 0, 1, 2, 5]) if rng.random() < self.cancel_rate else None
            try:
                self._one(prompt, cancel_after, rng.uniform(0, 0.05))
            except grpc.RpcError as err:
                with self._lock:
                    self.errors.append(f"{err.code().name}: {err.details()}")

    def _one(self, prompt: str, cancel_after: int | None, delay: float) -> None:
        """cancel_after chunks: 0 cancels `delay` seconds after the call, before its first chunk (while
        the request is queued or its prompt in prefill)."""
        request = wire.generate_to_proto(wire.GenerateCall(prompt, SamplingParams(max_tokens=MAX_TOKENS,
                                                                                  ignore_eos=True)))
        call = self.client.stub.Generate(request, timeout=120)
        if cancel_after == 0:
            time.sleep(delay)
            call.cancel()
        tokens, drafted = [], 0
        try:
            for i, chunk in enumerate(call):
                tokens += chunk.token_ids
                if chunk.HasField("stats"):
                    drafted = chunk.stats.drafted
                if cancel_after is not None and i + 1 >= cancel_after:
                    call.cancel()
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.CANCELLED and cancel_after is not None:
                with self._lock:
                    self.cancelled += 1
                return
            raise
        with self._lock:
            self.completed += 1
            self.speculated += drafted > 0
            if tokens != self.reference[prompt]:
                self.wrong.append((prompt, tokens))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(180)


def settle(loop, client, zygote, reference) -> dict:
    """Once the load is over: the engine idle, the target re-attached and speculating, and what the
    drafter holds then (only the target's own connection: its stream and its two row buffers)."""
    assert wait_until(lambda: not loop.busy and not loop.engine.running, timeout=60)
    cache = loop.engine.cache
    assert cache.num_free_blocks == cache.num_blocks  # every KV block of every request came back
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(100):
        result = client.generate(PROMPTS[0], params)
        assert result.token_ids == reference[PROMPTS[0]]
        if result.stats.drafted > 0:
            break
        time.sleep(0.2)
    assert result.stats.drafted > 0, (f"the target never re-attached: {loop.engine.proposer.last_error!r}; "
                                            f"drafter {zygote.pid} holds {zygote.stats()}; ended: {zygote.deaths()}")
    wait_until(lambda: zygote.stats()["sequences"] == 0, timeout=10)
    return zygote.stats()


def run_chaos(target, zygote, *, faults: int, seed: int, clients: int = 4) -> dict:
    loop, client, reference = target
    rng = random.Random(seed)
    load = Load(client, reference, seed).start(clients)
    started = time.monotonic()
    try:
        for _ in range(faults):
            time.sleep(rng.uniform(0.05, 0.8))  # a random moment: prefill, mid-step, between requests
            if rng.random() < 0.15:
                zygote.freeze(rng.uniform(0.2, 2.5))  # stopped, then thawed: it must not corrupt anything
                continue
            zygote.kill()
            time.sleep(rng.choice([0, 0, 0.1, 0.5, 1.5]))  # sometimes down a while: serial fallback
            zygote.fork()
    finally:
        load.stop()
    seconds = time.monotonic() - started
    held = settle(loop, client, zygote, reference)
    deaths = zygote.deaths()  # settling took seconds: every drafter killed has been reaped by now
    table = {**zygote.faults, "drafters ended": deaths, "seconds": round(seconds), "completed": load.completed,
             "speculated": load.speculated, "cancelled": load.cancelled, "wrong": len(load.wrong),
             "errors": len(load.errors), **held}
    print(f"\nchaos: {table}")
    assert set(deaths) <= {"SIGKILL"}, deaths  # no drafter died of anything but our kills
    assert not load.wrong, load.wrong[:3]
    assert not load.errors, load.errors[:5]
    assert load.completed > faults // 2 and load.speculated > 0
    # What is left on the drafter is the target's live connection, nothing else: no sequence, no carried
    # KV, one session with its stream, its two row buffers, and only those two segments open.
    assert held == {"sessions": 1, "streams": 1, "sequences": 0, "carried": 0, "buffers": 2, "shm_fds": 2}, held
    # Registration unlinks a segment's name, and the target unlinks those it made for drafters that died
    # before registering them: no name of ours is left in /dev/shm.
    assert not _our_segments()
    return table


def test_drafters_killed_at_random_moments_under_load(target, zygote):
    run_chaos(target, zygote, faults=4, seed=0, clients=3)


@pytest.mark.slow
def test_a_hundred_drafter_kills_and_freezes_at_random_moments(target, zygote):
    run_chaos(target, zygote, faults=120, seed=1)


# --- a target process: SIGKILLed mid-generation, and a 64-stream soak ------------------------------


@pytest.fixture
def spawned_target(tiny_chat_dir, zygote):
    """start(*args) → a target service process attached to the zygote's drafter (forked if none is)."""
    from specsplit.pair import ServiceSpec, Services

    if zygote.pid is None:
        zygote.fork()
    made: list[Services] = []

    def start(*target_args: str) -> Services:
        services = Services(ServiceSpec(target=str(tiny_chat_dir), drafter="random-dflash", startup_timeout=120,
                                        target_args=target_args), Path(tempfile.mkdtemp(prefix="chaos-t-")))
        services.drafter_address = zygote.address  # the forked drafter, not one of its own
        made.append(services)
        services.start_target()
        return services

    yield start
    for services in made:
        services.stop()
        shutil.rmtree(services.workdir, ignore_errors=True)


def _segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{SHM_PREFIX}{pid}-")]


@pytest.mark.slow
def test_a_target_killed_mid_generation_leaves_nothing_on_the_drafter(spawned_target, zygote):
    before = zygote.stats()  # another target (this module's) may be attached and idle
    services = spawned_target()
    pid = services.procs["target"].pid
    client = services.client()
    params = SamplingParams(max_tokens=2000, ignore_eos=True)
    for _ in range(50):  # until it speculates: it has attached
        if client.generate(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True)).stats.drafted:
            break
    stream = client.stream(PROMPTS[4], params)
    for _ in range(3):
        next(stream)
    during = zygote.stats()
    assert during["sessions"] == before["sessions"] + 1 and during["sequences"] == before["sequences"] + 1
    assert during["buffers"] > before["buffers"] and during["shm_fds"] > before["shm_fds"]
    os.kill(pid, signal.SIGKILL)
    services.procs.pop("target").wait(30)
    with pytest.raises(SpecsplitError):  # the client's domain error for the UNAVAILABLE stream
        list(stream)
    assert wait_until(lambda: zygote.stats() == before, timeout=15), (zygote.stats(), before)
    leftovers = _segments_of(pid)
    for name in leftovers:  # never leave them behind on this machine, pass or fail
        os.unlink(os.path.join(SHM_DIR, name))
    assert not leftovers
    print(f"\ntarget SIGKILL: drafter held {during}, then {zygote.stats()} (before: {before}); /dev/shm left: 0")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.slow
def test_sixty_four_streams_soak_with_flat_memory(spawned_target, zygote, tiny_chat_dir, monkeypatch):
    """64 concurrent streams for 150 s; RSS of both services, segments and live sequences sampled."""
    # As for the drafter (see Zygote): glibc keeps what a freed large block held (its mmap threshold rises
    # with each large free, so later ones come from the heap and stay), and a CPU target's step frees
    # tensors of many sizes, so its RSS swung by 100+ MiB between samples in CI (520-690 MiB, before and
    # after prefill packing), and one unlucky third of six samples moved the median by 34 MiB. A fixed
    # threshold returns large blocks to the system when freed, so RSS follows what is held (what remains
    # are live peaks, such as a wave of 32 prompts in prefill, which the medians of many samples skip).
    for key, value in MALLOC_SETTINGS.items():
        monkeypatch.setenv(key, value)
    services = spawned_target("--max-batch", "32")
    client = RawClient(services.target_address)  # the load drives the raw stub
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = {p: client.generate(p, params, speculative=False).token_ids for p in PROMPTS}
    target_pid = services.procs["target"].pid
    # No cancellations here (the chaos test has them): a stream cancelled holds its --max-streams slot until
    # its handler sees it, so a 65th stream opened at once is refused, as it should be, with RESOURCE_EXHAUSTED.
    load = Load(client, reference, seed=7, cancel_rate=0).start(64)
    samples = []
    started = time.monotonic()
    try:
        while time.monotonic() - started < 150:
            time.sleep(2)  # ~15 samples a third after warm-up: a median a few sampled peaks cannot move
            held = zygote.stats()
            samples.append((round(time.monotonic() - started), _rss_mib(target_pid), _rss_mib(zygote.pid),
                            len(_segments_of(target_pid)) + len(_shm_fds(str(target_pid))), held["sequences"],
                            load.completed))
    finally:
        load.stop()
    print("\n   s  target MiB  drafter MiB  target shm  drafter seqs  completed")
    for s, t, d, shm, seqs, done in samples:
        print(f"{s:4d}  {t:10.1f}  {d:11.1f}  {shm:10d}  {seqs:12d}  {done:9d}")
    print(f"completed {load.completed} (speculated {load.speculated}), cancelled {load.cancelled}, "
          f"wrong {len(load.wrong)}, errors {len(load.errors)}")
    assert not load.wrong and not load.errors, (load.wrong[:2], load.errors[:3])
    assert load.speculated > 0
    # Warm-up (the first 60 s): allocator arenas, the KV cache's pages and the drafter's per-batch
    # buffers grow to their high-water mark, in steps (the drafter once rose 20 MiB at 30 s, the first
    # time its batch was that wide, and stayed flat after). After it, the lowest sample of the last
    # third against the first third's. A leak raises every sample, the lowest too; what else moves a
    # sample is a live peak, a step or a wave of prompts in prefill at the moment it was taken, and peaks
    # raise only some samples (with prompts prefilled together a CI run's target sat at 484-488 MiB
    # throughout with peaks to 586 in a third of the samples: the medians moved 23 MiB; in a later run
    # peaks filled 13 of the last third's 15 samples: the lower quartiles moved 26 MiB, the lowest 0.3). 16 MiB: the thirds' middles lie 2/3 of the steady window apart,
    # in which 170-230 of the requests complete on a busy 2-core machine, so it catches a leak of about
    # 100 KiB or more per request (of any kind: buffers, caches, Python objects). Leaks of whole sequences, segments or
    # registrations are counted exactly (the shm and sequence columns here, and the chaos test's end state).
    steady = [s for s in samples if s[0] > 60]
    third = len(steady) // 3
    for column, name in ((1, "target"), (2, "drafter")):
        values = [s[column] for s in steady]
        drift = min(values[-third:]) - min(values[:third])
        assert drift < 16, f"{name} RSS drifted {drift:.1f} MiB: {values}"
    assert len({s[3] for s in steady}) == 1, "the target's shared-memory segments changed in number"
    after = zygote.stats()
    assert wait_until(lambda: zygote.stats()["sequences"] == 0, timeout=30), after


# --- found by the chaos run: a target that lost its drafter between probing and attaching -----------


def test_a_drafter_lost_after_the_probe_connected_is_still_reattached(tmp_path):
    """The target's probe channel connected to a drafter that died before the target attached through
    it; a third drafter then came up. A gRPC channel whose connection drops goes IDLE and does not
    reconnect by itself: the probe must ask again, or the target decodes alone forever (the chaos
    run above once ended so: 'the target never re-attached')."""
    from specsplit.drafter_service.server import DrafterServer, serve
    from specsplit.target_service.drafter_client import RemoteProposer
    from tests.test_drafter_server import make_drafter

    address = f"unix:{tmp_path}/d.sock"

    def drafter():
        obj = make_drafter()
        server_obj = DrafterServer(obj, head=obj.head, device="cpu")
        return server_obj, serve(server_obj, [address])

    first = drafter()
    proposer = RemoteProposer(address, max_batch=2)
    try:
        assert proposer.available()
        first[1].stop(None).wait()
        proposer.reset()
        assert wait_until(lambda: proposer.available() is False and proposer._probe is not None)  # probing
        second = drafter()
        assert wait_until(lambda: proposer._probe.up, timeout=20)  # connected, not yet taken by an attach
        second[1].stop(None).wait()
        assert wait_until(lambda: not proposer._probe.up, timeout=10)
        third = drafter()
        try:
            assert wait_until(proposer.available, timeout=20)
        finally:
            third[1].stop(None).wait()
    finally:
        proposer.close()
