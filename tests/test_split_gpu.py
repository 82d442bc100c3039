"""The split on one GPU: rows cross by CUDA IPC handle; output equals the in-process engine."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from specsplit.shared.sampling import SamplingParams
from specsplit.harness import ServiceSpec
from specsplit.local import LocalSetup, load_local
from specsplit.target_service.sequence import Request

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPTS = ["The capital of France is", "def add(a, b):\n    ", "A short poem about the sea:\n"]
GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)


def local_tokens(drafter: str, params: SamplingParams = GREEDY) -> list[list[int]]:
    engine, tokenizer = load_local(LocalSetup(drafter=drafter, device="cuda", dtype="float32", seed=0))
    reqs = [Request(str(i), tokenizer.encode(p), params) for i, p in enumerate(PROMPTS)]
    events = engine.generate(reqs)
    return [[t for e in events[str(i)] for t in e.token_ids] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("kind", ["dflash", "random-mtp"])
def test_cuda_ipc_split_equals_in_process(kind, specsplit_factory):
    services = specsplit_factory(ServiceSpec(drafter=kind, device="cuda", dtype="float32"))
    client = services.client()
    remote = [client.generate(p, GREEDY) for p in PROMPTS]
    target_only, local = local_tokens("none"), local_tokens(kind)
    for i in range(len(PROMPTS)):
        assert remote[i].token_ids == local[i] == target_only[i]
        assert remote[i].stats.drafted > 0
    log = services.log("target")
    assert "cuda_ipc" in log
    if kind == "dflash":  # (chained steps: by default the target's stream waits for their drafts on the host page)
        assert "chained drafts: our stream waits on the host page" in log


@pytest.mark.parametrize("device_waits", [True, False], ids=["device-waits", "host-waits"])
def test_target_serve_with_draft_trees_streams_the_in_process_trees_tokens(device_waits, specsplit_factory):
    """`specsplit target serve --draft-tree 15` through the harness: each request's tokens are target-only's and
    the in-process trees', in the in-process trees' steps (fewer than the services' chains would take). With the
    pair's device waits (the default on a GPU) the drafter's chained steps were launched behind a wait on its
    stream and the target took tree candidates asked for ahead."""
    from specsplit.target_service.engine import EngineConfig
    from tests.test_metrics import free_port, scrape, value

    port = free_port()
    services = specsplit_factory(ServiceSpec(drafter="dflash", device="cuda", dtype="float32",
                                             target_args=("--draft-tree", "15"), device_waits=device_waits,
                                             drafter_args=("--metrics-port", str(port))))
    client = services.client()
    remote = [client.generate(p, GREEDY) for p in PROMPTS]
    waited = value(scrape(port), "specsplit_drafter_chain_graph_steps_total", outcome="waited")
    assert (waited > 0) == device_waits, waited
    engine, tokenizer = load_local(LocalSetup(drafter="dflash", device="cuda", dtype="float32", seed=0),
                                   EngineConfig(draft_tree=15))
    for i, p in enumerate(PROMPTS):  # (one at a time, as the client sent them)
        events = engine.generate([Request(str(i), tokenizer.encode(p), GREEDY)])[str(i)]
        assert remote[i].token_ids == [t for e in events for t in e.token_ids] == local_tokens("none")[i]
        assert remote[i].stats.steps == events[-1].stats.steps and remote[i].stats.accepted > 0


STALL_CYCLES = 120_000_000_000  # a GPU sleep of about a minute on an H200


def _drafter_main(address: str, mode: str, conn, writes_wait: float = 10.0) -> None:
    """A DFlash drafter service. mode "out-of-vocabulary": its drafts in the target's buffer are replaced by
    ids outside the vocabulary (negative and huge), written after the real ones and recorded again;
    "stalling": the first time, it records the drafts buffer's event behind a GPU sleep of a minute."""
    from specsplit.drafter_service.session import Session
    from specsplit.services import DrafterSettings, start_drafter

    # Both ways drafts reach the buffer, step by step (propose_into) and chained (_chain_propose), get the
    # same treatment: `after(session, buffer_id)` once they are written and recorded
    def tampered(after):
        step_by_step, chained = Session.propose_into, Session._chain_propose

        def propose_into(self, requests, buffer_id):
            written = step_by_step(self, requests, buffer_id)
            if written:
                after(self, buffer_id)
            return written

        def chain_propose(self, chain, buffer_id):
            in_buffer, proposals = chained(self, chain, buffer_id)
            if in_buffer:
                after(self, buffer_id)
            return in_buffer, proposals

        Session.propose_into, Session._chain_propose = propose_into, chain_propose

    if mode == "stalling":
        stalled = []

        def stall(self, buffer_id):
            if not stalled:
                stalled.append(buffer_id)
                torch.cuda._sleep(STALL_CYCLES)
                self.importer.drafts_target(buffer_id)[1].record()

        tampered(stall)
    if mode.startswith("busy-prefill"):
        # Each prefill but the first finds our stream busy: GPU work of about a minute (-long) or two seconds
        # (-short) queued before it. "-waits": without --prefill-copies (the call waits for our whole stream).
        # The first one warms the drafter: a kernel's first launch loads its module (CUDA's lazy loading), which
        # waits for the whole device, and so does a graph's capture; a serving drafter has done both long before
        prefill, cycles = Session.prefill, STALL_CYCLES if "-long" in mode else STALL_CYCLES // 30
        warm = []

        def busy_prefill(self, seq_id, op):
            if warm:
                torch.cuda._sleep(cycles)
            warm.append(seq_id)
            return prefill(self, seq_id, op)

        Session.prefill = busy_prefill
    if mode == "silent":  # it never writes a chained step's done value (DrafterDescription.done_flags)
        Session._write_done = staticmethod(lambda view, value: None)
    if mode == "out-of-vocabulary":
        # A chained step's done value (device waits) is written only after the garbage: a target whose stream
        # waits for it reads the garbage, never the drafts before it
        write_done, held = Session._write_done, []
        Session._write_done = staticmethod(lambda view, value: held.append((view, value)))

        def garble(self, buffer_id):
            view, event = self.importer.drafts_target(buffer_id)
            garbage = torch.tensor([-7, 2**31 - 1, -2**31, 49152, 10**6], dtype=torch.int32, device=view.device)
            view.copy_(garbage.repeat(view.numel() // 5 + 1)[:view.numel()].view_as(view))
            for done in held:
                write_done(*done)
            held.clear()
            event.record()

        tampered(garble)
    replays, errors, launched = [], [], []
    waits = mode == "graphs-waits"  # as "graphs", with --device-waits (one target): its launches counted if device-waited
    if mode in ("graphs", "graphs-waits"):  # counts the chained steps its graphs replayed, keeps why a capture failed (sent back)
        device = Session._chain_device

        def chain_device(self, key, batch, work):
            device(self, key, batch, work)
            replays.append(self._chain_graphs.get(key) is not None)
            if self.chain_graph_error and self.chain_graph_error not in errors:
                errors.append(self.chain_graph_error)

        Session._chain_device = chain_device
        launch = Session._launch_prepared

        def launch_prepared(self, prepared):  # a chained step sent ahead, prepared before the target's writes
            result = launch(self, prepared)
            replays.append(True)
            if prepared.written is not None or not waits:
                launched.append(True)
            return result

        Session._launch_prepared = launch_prepared
    from specsplit.drafter_service import server as server_module
    from specsplit.drafter_service.limits import DrafterLimits

    copies = mode == "copies" or (mode.startswith("busy-prefill") and "-waits" not in mode)  # --prefill-copies
    made = []  # every session's device waits (--device-waits), for the waits its watchdog released
    real_waits = server_module.DeviceWaits
    server_module.DeviceWaits = lambda *args, **kwargs: made.append(real_waits(*args, **kwargs)) or made[-1]
    server_obj, server = start_drafter(DrafterSettings((address,), LocalSetup(drafter="dflash", device="cuda",
                                                                               dtype="float32", seed=0),
                                                       limits=DrafterLimits(writes_wait_seconds=writes_wait,
                                                                            max_targets=1 if waits else 8),
                                                       chain_graphs=mode in ("graphs", "graphs-waits"),
                                                       device_waits=waits,
                                                       prefill_copies=copies))
    conn.send("ready")
    try:
        conn.recv()
    except EOFError:
        pass
    server.stop(None)
    server_obj.close()
    conn.send((len(replays), sum(replays), errors, len(launched), sum(w.released for w in made)))


@contextlib.contextmanager
def spawned_drafter(tmp_path, mode: str = "honest", writes_wait: float = 10.0, report: list | None = None):
    """A drafter service in a process of its own (`_drafter_main`), answering health checks: yields its
    address; stopped at the end, killed if it does not stop (a stalled one's GPU work may not end).
    `report` gets what it sends back as it stops (mode "graphs": its chained steps, those replayed, why
    captures failed, and those replayed as prepared before the target's writes were done; "graphs-waits":
    the same, with --device-waits, the last counting those launched behind a device wait)."""
    import multiprocessing as mp

    from specsplit.shared.serving import wait_healthy

    address = f"unix:{tmp_path}/drafter.sock"
    parent, child = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(target=_drafter_main, args=(address, mode, child, writes_wait),
                                              daemon=True)
    process.start()
    try:
        assert parent.poll(300) and parent.recv() == "ready"
        wait_healthy(address, 60)
        yield address
    finally:
        if mode != "stalling" and "-long" not in mode:
            parent.send("stop")
            if report is not None and parent.poll(60):
                report.append(parent.recv())
            process.join(30)
        if process.is_alive():
            process.kill()
            process.join(30)


def default_target():
    """The default model in float32 on the GPU, and its tokenizer."""
    from specsplit.local import target_dir
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.model import load_target

    folder = target_dir("default")
    return load_target(folder, dtype=torch.float32, device="cuda"), Tokenizer.from_dir(folder)


def remote_engine(address: str, model, chain: bool = True, config: dict | None = None, **remote_kw):
    """An engine of `model` drafting through the drafter service at `address`, its steps chained or step
    by step (and any other EngineConfig fields in `config`): (engine, its RemoteProposer)."""
    from specsplit.target_service.drafter_client import RemoteProposer
    from specsplit.target_service.engine import Engine, EngineConfig

    remote = RemoteProposer(address, device="cuda", dtype=torch.float32,
                            head=(model.embed_weight, model.lm_head_weight), max_batch=4, **remote_kw)
    return Engine(model, remote, EngineConfig(max_batch=4, chain_steps=chain, **(config or {}))), remote


def generate(engine, tokenizer, params: SamplingParams = GREEDY) -> tuple[list[list[int]], list]:
    """PROMPTS, greedy: each request's tokens and its final stats."""
    events = engine.generate([Request(str(i), tokenizer.encode(p), params) for i, p in enumerate(PROMPTS)])
    return ([[t for e in events[str(i)] for t in e.token_ids] for i in range(len(PROMPTS))],
            [events[str(i)][-1].stats for i in range(len(PROMPTS))])


@pytest.mark.parametrize("chain", [True, False], ids=["chained", "step-by-step"])
@pytest.mark.parametrize("mode", ["honest", "out-of-vocabulary"])
def test_drafts_left_in_the_targets_buffer_are_verified_there_and_bounded(tmp_path, mode, chain):
    """On one GPU the drafter writes its drafts into the target's drafts buffer and the verify reads them
    there (no host read-back on either side), its steps chained (the feed and rows written by the
    target's GPU, StepRequest.chain) or step by step: output equals target-only, and the drafts did come
    that way. A drafter writing ids outside the vocabulary changes no token and crashes nothing: the
    target bounds them on the device and verifies what it bounded."""
    with spawned_drafter(tmp_path, mode) as address:
        model, tokenizer = default_target()
        engine, remote = remote_engine(address, model, chain)
        tokens, stats = generate(engine, tokenizer)
        assert tokens == local_tokens("none")
        assert remote.link.drafts_on_device > 0 and engine.drafter_ok
        assert (engine.counters.chained > 0) == chain
        assert remote.link.drafts_on_device >= engine.counters.chained  # (each chained propose's drafts too)
        if mode == "honest":
            assert sum(s.accepted for s in stats) > 0
        remote.close()


def _done_placed(remote, flags: str) -> None:
    """The connection's DONE buffer is where `flags` says: the host page passed with the step socket's hello
    (the drafter offers host_flags on a GPU), or device memory (RemoteProposer(host_flags=False))."""
    conn = remote._conn
    assert conn is not None and conn.done is not None and remote.step_transport == "socket"
    assert (conn.done is conn.page and conn.page is not None) == (flags == "host-page")
    assert all(flag.host is not None for flag in conn.done_flags) == (flags == "host-page")


@pytest.mark.parametrize("flags", ["host-page", "device-memory"])
@pytest.mark.parametrize("mode", ["honest", "out-of-vocabulary"])
def test_chained_drafts_waited_for_by_the_targets_stream_are_verified_as_polled_ones(tmp_path, mode, flags):
    """RemoteProposer(device_waits=True): the target's stream waits on the device for the done value the
    drafter's stream writes after each chained propose's drafts, instead of its host polling the
    drafter's event. Output equals target-only, every chained propose was waited for that way but those
    the engine had our host wait for (a chained step other than the one before, whose work after the drafts
    may load a kernel: Engine._quiesce), and no wait had to be released by the target. The proposes sent
    ahead are taken before their answers are read (`_take_unanswered`), and each request accepts as many
    drafts as with our host polling: drafts read before the drafter wrote them would accept fewer. The
    same with the DONE buffer in the host page both sides map, and in the target's device memory."""
    with spawned_drafter(tmp_path, mode) as address:
        model, tokenizer = default_target()
        engine, remote = remote_engine(address, model, device_waits=True, host_flags=flags == "host-page")
        tokens, stats = generate(engine, tokenizer)
        _done_placed(remote, flags)
        assert tokens == local_tokens("none")
        assert engine.drafter_ok and engine.counters.chained > 0
        assert remote.link.device_waits > 0 and remote._waits.released == 0
        assert remote.link.device_waits + remote.link.host_waits >= engine.counters.chained
        assert 0 < remote.link.taken_unanswered <= remote.link.device_waits
        remote.close()
        polled_engine, polled = remote_engine(address, model)
        polled_tokens, polled_stats = generate(polled_engine, tokenizer)
        polled.close()
        assert polled_tokens == tokens
        if mode == "honest":
            assert sum(s.accepted for s in stats) > 0
            assert [s.accepted for s in stats] == [s.accepted for s in polled_stats]


@pytest.mark.parametrize("flags", ["host-page", "device-memory", "host-page-unquiesced"])
def test_a_drafter_that_never_writes_its_done_value_costs_a_deadline_not_a_hang(tmp_path, flags):
    """A drafter that says it writes done values and never does: the target's stream waits for one, its
    watchdog releases the wait at the step's deadline (writing the value itself: a store of its CPU into
    the host page, or a stream write into device memory) and the drafter is dropped; the verify read
    whatever the drafts buffer held, so the output still equals target-only. "host-page-unquiesced"
    (EngineConfig.unquiesced_host_flags): the engine leaves the waits pending across work that may launch a
    kernel for the first time (prefills, other shapes), the hang device waits were kept off for: the
    watchdog's store must get through each module's load."""
    want = local_tokens("none")
    with spawned_drafter(tmp_path, "silent") as address:
        model, tokenizer = default_target()
        paged = flags.startswith("host-page")
        engine, remote = remote_engine(address, model, timeout=3.0, device_waits=True, host_flags=paged,
                                       config={"unquiesced_host_flags": flags == "host-page-unquiesced"})
        _done_placed(remote, "host-page" if paged else flags)
        placed = []  # (those of the connections after the drafter is dropped)
        connect = remote._setup_done
        remote._setup_done = lambda conn, desc, wait: (connect(conn, desc, wait), placed.append(conn.page))
        started = time.monotonic()
        assert generate(engine, tokenizer)[0] == want
        assert remote._waits.released >= 1
        assert all((page is not None) == paged for page in placed)
        deadline = time.monotonic() + 10
        while remote._waits.pending:  # (the watchdog forgets released waits once the stream is past them)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert time.monotonic() - started < 120
        remote.close()


def _runs_against(tmp_path, modes, params: SamplingParams, **remote_kw) -> list[tuple]:
    """The default target through a drafter service of each mode in turn (`spawned_drafter`): per mode its
    tokens, accepted drafts per request, chained steps, the target's released waits, and the drafter's report."""
    model, tokenizer = default_target()
    runs = []
    for mode in modes:
        report: list = []
        (tmp_path / mode).mkdir()
        with spawned_drafter(tmp_path / mode, mode, report=report) as address:
            engine, remote = remote_engine(address, model, **remote_kw)
            tokens, stats = generate(engine, tokenizer, params)
            released = remote._waits.released if remote._waits is not None else 0
            remote.close()
        runs.append((tokens, [s.accepted for s in stats], engine.counters.chained, released, report))
    return runs


def test_chained_steps_replayed_as_the_drafters_graphs_draft_as_uncaptured(tmp_path):
    """A drafter service with --chain-graphs: each chained step's commit, propose and drafts copy replay as
    one CUDA graph once the shape has run a few times, most of them prepared before the target's writes
    were done (Session.prepare_chain: chained proposes sent ahead). Every verify accepts as many drafts as through the
    same drafter without graphs (float32: the same drafts), the tokens are target-only's, and chained
    steps were replayed. (Long enough that one shape, three sequences, runs past its capture: the
    eighteenth session's 48 tokens spread 16 fused steps over three shapes, none captured.)"""
    params = SamplingParams(max_tokens=160, ignore_eos=True)
    (tokens, accepted, chained, _, _), (graphed, graphed_accepted, graphed_chained, _, report) = \
        _runs_against(tmp_path, ("honest", "graphs"), params)
    assert graphed == tokens == local_tokens("none", params)
    assert graphed_accepted == accepted and sum(accepted) > 0 and graphed_chained == chained >= 30
    (steps, replayed, errors, prepared, _), = report
    assert not errors and steps >= 20 and replayed >= 10 and prepared >= 5, report


def test_chained_steps_launched_behind_the_drafters_device_waits_draft_as_host_polled_ones(tmp_path):
    """Drafter --device-waits with a target's --device-waits: each prepared chained step's graph is launched
    as its Step arrives, the drafter's stream waiting on the device for the value the target's stream
    writes after its rows and feed (ChainStep.written_value), and the target's stream waiting for the
    drafter's done value: neither host waits for the other's GPU. Every verify accepts as many drafts as
    with the drafter's host polling (float32: the same drafts), the tokens are target-only's, most
    chained steps were launched that way, and no wait was released on either side."""
    params = SamplingParams(max_tokens=160, ignore_eos=True)
    (tokens, accepted, chained, _, _), (waited, waited_accepted, waited_chained, released, report) = \
        _runs_against(tmp_path, ("graphs", "graphs-waits"), params, device_waits=True)
    assert waited == tokens == local_tokens("none", params)
    assert waited_accepted == accepted and sum(accepted) > 0 and waited_chained == chained >= 30
    (steps, replayed, errors, launched, drafter_released), = report
    assert not errors and released == drafter_released == 0 and replayed >= 10 and launched >= 5, report


def test_a_target_that_never_writes_its_written_value_costs_the_drafter_a_deadline_not_its_stream(tmp_path, monkeypatch):
    """A target whose stream never writes the written values its chained steps name: the drafter's stream
    waits for one until --writes-wait-seconds, its watchdog releases it (writing the value itself) and that
    target's Step stream ends; the target goes on target-only (its output equals target-only's), and the
    drafter, serving one target, then serves the next connection with drafts."""
    from specsplit.target_service import drafter_client

    want = local_tokens("none")
    report: list = []
    with spawned_drafter(tmp_path, "graphs-waits", writes_wait=3.0, report=report) as address:
        model, tokenizer = default_target()
        write = drafter_client._write_on_stream
        monkeypatch.setattr(drafter_client, "_write_on_stream", lambda view, value: None)
        engine, remote = remote_engine(address, model, timeout=30.0, device_waits=True)
        started = time.monotonic()
        params = SamplingParams(max_tokens=160, ignore_eos=True)
        assert generate(engine, tokenizer, params)[0] == local_tokens("none", params)
        assert time.monotonic() - started < 120
        print("the silent target's drafter:", remote.last_error)
        remote.close()
        monkeypatch.setattr(drafter_client, "_write_on_stream", write)
        engine, remote = remote_engine(address, model, device_waits=True)
        tokens, stats = generate(engine, tokenizer)
        assert tokens == want and sum(s.accepted for s in stats) > 0 and engine.drafter_ok
        remote.close()
    (_, _, errors, launched, drafter_released), = report
    assert not errors and launched >= 1 and drafter_released >= 1, report  # (the silent target's waits released)


@pytest.mark.parametrize("device_waits", [False, True], ids=["host-polls", "device-waits"])
def test_the_targets_side_of_a_services_chained_step_replayed_as_a_graph_accepts_as_uncaptured(tmp_path, device_waits):
    """EngineConfig(chain_capture_remote=True): through the drafter service, what follows each chained
    step's drafts (the verify, the accept, the outcome, the next feed) replays as one CUDA graph of the
    target's once the shape has run a few times. Requests of three lengths, so three, then two, then one
    sequence run long enough to be captured (three graphs sharing one pool, replayed out of capture
    order, each fed anew as the batch shrinks); host polls and device waits. The tokens are target-only's,
    every request accepts as many drafts as uncaptured (float32: the same drafts), and steps were
    replayed. (The data flow through a stand-in graph on the CPU: tests/test_remote_chain.py.)"""
    model, tokenizer = default_target()
    # Each shape's steps outnumber the uncaptured runs it takes (the code prompt accepts about 3.9 tokens a step, the
    # others 2.2-2.4: on the CPU with the shipped drafter, float32, 46 / 34 / 51 steps of three / two / one)
    lengths = (300, 260, 100)
    requests = lambda: [Request(str(i), tokenizer.encode(p), SamplingParams(max_tokens=n, ignore_eos=True))  # noqa: E731
                        for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    runs = {}
    with spawned_drafter(tmp_path) as address:
        for captured in (False, True):
            engine, remote = remote_engine(address, model, config={"chain_capture_remote": captured},
                                           device_waits=device_waits)
            events = engine.generate(requests())
            remote.close()
            runs[captured] = ([[t for e in events[str(i)] for t in e.token_ids] for i in range(len(lengths))],
                              [events[str(i)][-1].stats.accepted for i in range(len(lengths))], engine.counters,
                              {key: (p.runs, p.graph is not None) for key, p in engine._chain_programs.items()})
    (tokens, accepted, plain, _), (graphed, graphed_accepted, counters, programs) = runs[False], runs[True]
    want = [local_tokens("none", SamplingParams(max_tokens=n, ignore_eos=True))[i] for i, n in enumerate(lengths)]
    assert graphed == tokens == want
    assert graphed_accepted == accepted and sum(accepted) > 0 and counters.chained == plain.chained
    assert plain.chain_replays == 0 and counters.chain_captures >= 3 and counters.chain_replays >= 20, \
        (counters.chain_captures, counters.chain_replays, counters.chained, programs)


@pytest.mark.parametrize("device_waits, ahead", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["host-polls", "device-waits", "host-polls-sent-ahead", "device-waits-sent-ahead"])
def test_draft_trees_through_the_drafter_service_accept_as_the_in_process_trees(tmp_path, device_waits, ahead):
    """Draft trees through the services (ChainStep.tree_keep): the drafter writes each block row's best tokens into
    the target's drafts buffer (ids, then their log-probabilities' bits), the target grows, verifies and accepts
    the trees, its side replayed as a graph. Requests of three lengths (the batch shrinks): the tokens are
    target-only's, each request accepts as many drafts as with the in-process trees (float32: the same
    candidates), in fewer steps than the services' chains. With `trees_ahead` most steps take candidates asked
    for as the step before launched (with device waits, before their answer is read; as the batch shrinks, with
    `tree_regroup`, its sequences' rows of them)."""
    from specsplit.target_service.engine import EngineConfig

    model, tokenizer = default_target()
    lengths = (160, 100, 60)

    def outcome(engine):
        events = engine.generate([Request(str(i), tokenizer.encode(p), SamplingParams(max_tokens=n, ignore_eos=True))
                                  for i, (p, n) in enumerate(zip(PROMPTS, lengths))])
        return ([[t for e in events[str(i)] for t in e.token_ids] for i in range(len(lengths))],
                [events[str(i)][-1].stats for i in range(len(lengths))])

    local, _ = load_local(LocalSetup(drafter="dflash", device="cuda", dtype="float32", seed=0),
                          EngineConfig(max_batch=4, draft_tree=15))
    want, want_stats = outcome(local)
    with spawned_drafter(tmp_path) as address:
        engine, remote = remote_engine(address, model, config={"draft_tree": 15, "tree_regroup": ahead},
                                       device_waits=device_waits, tree_keep=8, trees_ahead=ahead)
        assert remote.tree_candidates and remote._conn.drafts.tensor.shape[1] == 2 * 15 * 8
        tokens, stats = outcome(engine)
        trees, taken, regrouped = engine.counters, remote.link.chain_taken_ahead, remote.link.chain_taken_regrouped
        remote.close()
        engine, remote = remote_engine(address, model, device_waits=device_waits)
        _, chain_stats = outcome(engine)
        remote.close()
    alone = [local_tokens("none", SamplingParams(max_tokens=n, ignore_eos=True))[i] for i, n in enumerate(lengths)]
    assert tokens == want == alone
    assert [s.accepted for s in stats] == [s.accepted for s in want_stats] and sum(s.accepted for s in stats) > 0
    assert sum(s.steps for s in stats) < sum(s.steps for s in chain_stats)
    assert trees.fallbacks == 0 and trees.chain_replays >= 20, (trees.chain_captures, trees.chain_replays)
    assert (taken > trees.chained // 2) if ahead else taken == 0, (taken, trees.chained)
    # (as the batch shrank, the next step took its sequences' rows of the candidates sent ahead)
    assert (regrouped > 0) if ahead else regrouped == 0, regrouped


@pytest.mark.parametrize("device_waits", [False, True], ids=["host-polls", "device-waits"])
def test_requests_ending_and_arriving_take_the_drafts_sent_ahead_as_fresh_proposes_would_draft(tmp_path, device_waits):
    """Seven requests of different lengths through four slots, as a server sees them, three of them sampled
    (seeded; near its end one sits a chained step out and is back in the next): the chained propose sent
    ahead as a step launches also asks for the sequences attached since and those sitting it out (their
    anchors gathered on the device), and the next step takes its drafts (rows of the drafts buffer, on
    the device) for whichever of them it holds. The greedy requests' tokens are target-only's, the
    requests accept as many drafts as with each chained propose sent as its own step launches (within 3 %:
    a propose sent ahead drafts in a batch of another size, whose float32 sums may break a near-tie the
    other way; a row taken for the wrong sequence would accept next to nothing), and few Step answers are
    waited for; host polls and device waits. (The rules, exactly, on the CPU: tests/test_remote_chain.py.)"""
    model, tokenizer = default_target()
    lengths = (40, 90, 60, 120, 30, 70, 50)
    sampled = {1, 4, 5}
    requests = lambda: [Request(str(i), tokenizer.encode(PROMPTS[i % len(PROMPTS)]), SamplingParams(  # noqa: E731
        max_tokens=n, ignore_eos=True, temperature=0.8 if i in sampled else 0.0, seed=i if i in sampled else None))
        for i, n in enumerate(lengths)]
    runs = {}
    with spawned_drafter(tmp_path) as address:
        for ahead in (False, True):
            engine, remote = remote_engine(address, model, device_waits=device_waits, chain_ahead=ahead)
            try:
                events = engine.generate(requests())
                assert engine.drafter_ok and engine.counters.fallbacks == 0
                runs[ahead] = ([[t for e in events[str(i)] for t in e.token_ids] for i in range(len(lengths))],
                               [events[str(i)][-1].stats.accepted for i in range(len(lengths))],
                               len(remote.link.step_seconds), remote.link.chain_taken_regrouped, engine.counters.chained)
            finally:
                remote.close()
    (tokens, accepted, each_waited, _, _), (ahead_tokens, ahead_accepted, waited, regrouped, chained) = runs[False], runs[True]
    target_only, _ = load_local(LocalSetup(drafter="none", device="cuda", dtype="float32", seed=0))
    alone = target_only.generate(requests())
    for i in range(len(lengths)):
        if i not in sampled:
            assert tokens[i] == ahead_tokens[i] == [t for e in alone[str(i)] for t in e.token_ids], i
        assert len(ahead_tokens[i]) == len(tokens[i]) == lengths[i], i
    assert sum(accepted) > 0 and abs(sum(ahead_accepted) - sum(accepted)) <= 0.03 * sum(accepted), (ahead_accepted, accepted)
    assert regrouped >= len(lengths) - 4 and chained >= 40 and waited <= 6 < each_waited, (regrouped, chained, waited)


@pytest.mark.parametrize("device_waits", [False, True], ids=["host-polls", "device-waits"])
def test_requests_attached_on_the_stream_decode_as_target_only(tmp_path, device_waits):
    """EngineConfig.stream_attach: seven greedy requests through four slots, arriving as others end, each attached
    by a SeqStep riding the next Step (its prompt's rows through the bulk buffer by CUDA IPC, the generation's
    writes recorded before the Step names them) instead of a PrefillDrafter call. Tokens are target-only's,
    nothing falls back, no unary call goes, the chained steps take the drafts sent ahead for the sequences
    joining, and the requests accept as many drafts as when attached by PrefillDrafter (within 3 %: a join a
    step later drafts some steps in batches of other sizes)."""
    model, tokenizer = default_target()
    lengths = (40, 90, 60, 120, 30, 70, 50)
    requests = lambda: [Request(str(i), tokenizer.encode(PROMPTS[i % len(PROMPTS)]),  # noqa: E731
                                SamplingParams(max_tokens=n, ignore_eos=True)) for i, n in enumerate(lengths)]
    runs = {}
    with spawned_drafter(tmp_path) as address:
        for on_stream in (False, True):
            engine, remote = remote_engine(address, model, device_waits=device_waits,
                                           config={"stream_attach": on_stream})
            try:
                events = engine.generate(requests())
                assert engine.drafter_ok and engine.counters.fallbacks == 0 and engine.counters.refusals == 0
                runs[on_stream] = ([[t for e in events[str(i)] for t in e.token_ids] for i in range(len(lengths))],
                                   sum(events[str(i)][-1].stats.accepted for i in range(len(lengths))),
                                   dict(remote.link.unary_calls), remote.link.chain_taken_regrouped,
                                   engine.counters.chained)
                assert not engine._attaching and not remote._attaches
            finally:
                remote.close()
    target_only, _ = load_local(LocalSetup(drafter="none", device="cuda", dtype="float32", seed=0))
    alone = target_only.generate(requests())
    want = [[t for e in alone[str(i)] for t in e.token_ids] for i in range(len(lengths))]
    (tokens, accepted, unary, _, _), (stream_tokens, stream_accepted, stream_unary, regrouped, chained) = \
        runs[False], runs[True]
    assert tokens == stream_tokens == want
    assert unary == {"PrefillDrafter": len(lengths)} and not stream_unary, (unary, stream_unary)
    assert accepted > 0 and abs(stream_accepted - accepted) <= 0.03 * accepted, (stream_accepted, accepted)
    assert regrouped >= len(lengths) - 4 and chained >= 40, (regrouped, chained)


def test_a_drafter_whose_drafts_never_land_is_given_up_without_stalling_the_target(tmp_path, monkeypatch):
    """A drafter that records the drafts buffer's event behind GPU work of a minute: the target's host
    polls that event and gives the drafter up at the step's deadline (its stream never waits on the
    event), then goes on target-only. Output equals target-only, and the generation ends while the
    drafter's queued work is still running."""
    from specsplit.shared.transport import RowBuffer

    want = local_tokens("none")  # before the drafter's minute of GPU sleep starts
    polled = []
    await_importer = RowBuffer.await_importer
    monkeypatch.setattr(RowBuffer, "await_importer",
                        lambda self, timeout: polled.append(self) or await_importer(self, timeout))
    with spawned_drafter(tmp_path, "stalling") as address:
        model, tokenizer = default_target()
        engine, remote = remote_engine(address, model, timeout=3.0)
        assert generate(engine, tokenizer)[0] == want
        # the stalled drafts buffer's event is still pending: nothing of ours waited for it
        assert polled and not polled[0]._cuda.done()
        remote.close()


def _prefill_remote(address: str, timeout: float = 30.0):
    """A RemoteProposer of the default target's head at `address`, and random prompt rows for it."""
    from specsplit.target_service.drafter_client import RemoteProposer

    model, _ = default_target()
    remote = RemoteProposer(address, device="cuda", dtype=torch.float32, timeout=timeout,
                            head=(model.embed_weight, model.lm_head_weight), max_batch=4)
    gen = torch.Generator(device="cuda").manual_seed(3)
    prompt = torch.randn(40, remote.spec.feature_dim, device="cuda", generator=gen)
    tokens = torch.randint(0, model.config.vocab_size, (40,), device="cuda", generator=gen).tolist()
    return remote, prompt, tokens


@pytest.mark.parametrize("copies", [True, pytest.param(False, marks=pytest.mark.xfail(
    strict=True, reason="without copies the call waits for our whole stream, a minute of GPU work"))],
                         ids=["copies", "no-copies"])
def test_a_prefill_answers_without_waiting_for_the_drafters_stream(tmp_path, copies):
    """A PrefillDrafter whose CUDA IPC rows are copied out waits for that copy alone, not for the GPU work
    queued before it on the drafter's stream (a minute of it here: the call's 20-s timeout would fail it).
    The first prefill, on an idle stream, warms the drafter (its kernels loaded, its graphs captured)."""
    mode = "busy-prefill-long" + ("" if copies else "-waits")
    with spawned_drafter(tmp_path, mode) as address:
        remote, prompt, tokens = _prefill_remote(address, timeout=20.0)
        try:
            for seq_id in range(2):
                remote.alloc(seq_id, 256)
                assert remote.prefill(seq_id, tokens, prompt) == len(tokens)
        finally:
            remote.reset()  # (the drafter is killed, its GPU work with it)


def test_prefill_rows_copied_out_are_the_targets_as_it_sent_them(tmp_path):
    """The drafter answers a prefill before its context forward has run (its stream busy for two seconds
    each time but the first, which warms it); the target then writes other rows into the same buffer at
    once. Each sequence's drafts are still those of the rows it sent: the same for three sequences whose
    buffer was overwritten with different garbage, or not at all."""
    from specsplit.shared.proposer import ProposeRequest

    with spawned_drafter(tmp_path, "busy-prefill-short") as address:
        remote, prompt, tokens = _prefill_remote(address)
        try:
            for seq_id in range(3):
                remote.alloc(seq_id, 256)
                remote.prefill(seq_id, tokens, prompt)
                if seq_id < 2:  # the buffer the rows went through, overwritten while the drafter's stream sleeps
                    garbage = torch.Generator(device="cuda").manual_seed(seq_id)
                    remote._conn.bulk.buffer.tensor.normal_(generator=garbage)
                    torch.cuda.synchronize()
            asked = [ProposeRequest(s, tokens[-1], len(tokens), 7) for s in range(3)]
            drafts = [p.tokens for p in remote.propose(asked)]
            assert drafts[0] == drafts[1] == drafts[2] and len(drafts[0]) == 7
        finally:
            remote.close()


def _staggered(engine, tokenizer, prompts: list[str], late_at: int = 4) -> tuple[list[list[int]], list[int]]:
    """`prompts`, greedy, the first alone and the others added at engine step `late_at` (a chained step out):
    each request's tokens and accepted drafts."""
    reqs = [Request(str(i), tokenizer.encode(p), GREEDY) for i, p in enumerate(prompts)]
    engine.add(reqs[0])
    tokens: dict[str, list[int]] = {}
    stats: dict[str, object] = {}
    step = 0
    while engine.has_work or step <= late_at:
        if step == late_at:
            for r in reqs[1:]:
                engine.add(r)
        for e in engine.step():
            tokens.setdefault(e.request_id, []).extend(e.token_ids)
            stats[e.request_id] = e.stats
        step += 1
    return [tokens[r.request_id] for r in reqs], [stats[r.request_id].accepted for r in reqs]


def test_requests_attached_behind_the_next_step_draft_as_those_attached_before_it(tmp_path):
    """EngineConfig.overlap_attach, the drafter with --prefill-copies: requests arriving while a chained step
    is out are attached after the next step launched, their rows copied for the drafter on a stream of their
    own behind their prefill alone. Their tokens are target-only's, and each request accepts as many drafts
    as with its attach before the launch (rows copied wrong or too early would change the drafts). The last
    prompt is longer than the target's prefill buffer for the drafter: the buffer grows as it attaches."""
    prompts = [*PROMPTS, "Say it again: " + "the sea, " * 600]
    target_only, tokenizer = load_local(LocalSetup(drafter="none", device="cuda", dtype="float32", seed=0))
    want = _staggered(target_only, tokenizer, prompts)[0]
    results = {}
    with spawned_drafter(tmp_path, "copies") as address:
        model, tokenizer = default_target()
        for overlap in (False, True):
            # (attached by PrefillDrafter, as overlap_attach was built for: not on the Step stream)
            engine, remote = remote_engine(address, model, config={"overlap_attach": overlap, "stream_attach": False})
            try:
                results[overlap] = _staggered(engine, tokenizer, prompts)
                assert engine.drafter_ok and engine.counters.fallbacks == 0
            finally:
                remote.close()
    assert results[True][0] == results[False][0] == want
    assert results[True][1] == results[False][1] and sum(results[True][1]) > 0


def test_a_target_whose_rows_never_land_stalls_only_itself(tmp_path):
    """Two targets share one drafter. One records its step buffer's event behind GPU work of ~20 s (a
    sleep on a side stream): the drafter polls that event outside its lock, so the other target's Steps
    are served meanwhile and its generation ends, with drafts, while the stalled work still runs; the
    stalled target's Step ends after --writes-wait-seconds (it goes on target-only and re-attaches).
    Both outputs equal target-only."""
    import threading

    want = local_tokens("none")
    with spawned_drafter(tmp_path, "honest", writes_wait=8.0) as address:
        try:
            model, tokenizer = default_target()
            (good, good_remote), (bad, bad_remote) = remote_engine(address, model), remote_engine(address, model)
            # warm: graphs captured, drafters attached
            assert generate(good, tokenizer)[0] == want and generate(bad, tokenizer)[0] == want
            side, stalled = torch.cuda.Stream(), threading.Event()
            after_sleep = torch.cuda.Event()
            buffer = bad_remote._conn.step.buffer
            record = buffer.record

            def stalling_record(stream=None):  # this connection's writes "land" only after ~20 s
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch.cuda._sleep(40_000_000_000)
                    after_sleep.record(side)
                record(side)
                stalled.set()

            buffer.record = stalling_record
            outcome: dict = {}
            thread = threading.Thread(target=lambda: outcome.update(bad=generate(bad, tokenizer)[0]), daemon=True)
            thread.start()
            assert stalled.wait(60)
            tokens, stats = generate(good, tokenizer)  # while the drafter polls the stalled target's event
            assert tokens == want and sum(s.drafted for s in stats) > 0 and good.drafter_ok
            assert not after_sleep.query()  # served before the stalled work ended: no one waited on it
            thread.join(120)
            assert outcome.get("bad") == want
            good_remote.close()
            bad_remote.close()
        finally:
            torch.cuda.synchronize()
