"""Chained steps through the drafter service (StepRequest.chain): the same drafts, tokens and drafter state
as the in-process chain, and a feed a target fills with anything cannot crash, stall or read through the
drafter."""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
import torch

from specsplit.drafter_service.server import DrafterServer, serve
from specsplit.shared import wire
from specsplit.shared import frames
from specsplit.shared.errors import (DrafterUnavailable, InvalidRequest, SpecsplitError, StateConflict, UnknownSequence,
                                     WritesPending)
from specsplit.shared.proposer import ProposeRequest
from specsplit.shared.host_flags import Flag
from specsplit.target_service import drafter_client
from specsplit.target_service.drafter_client import RemoteProposer
from specsplit.target_service.graphs import StepGraphs
from tests.test_chain import _drafter_pair

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Water boils at", "Hello"]


class Recorded:
    """Wraps a drafter's chain_propose, keeping every draft it returned (row by row, per step)."""

    def __init__(self, drafter) -> None:
        self.drafts: list[list[list[int]]] = []
        propose = drafter.chain_propose

        def chain_propose(batch, anchors, positions, k, *ahead_rows):
            out = propose(batch, anchors, positions, k, *ahead_rows)
            self.drafts.append(out.tolist())
            return out

        drafter.chain_propose = chain_propose


@pytest.fixture
def pair(tiny_chat_dir, tmp_path):
    """(target, in-process drafter, served drafter's address, the served drafter): two drafters of the same
    seed, static forwards on the CPU (where the chain runs uncaptured)."""
    target, (local, remote) = _drafter_pair(tiny_chat_dir)
    server_obj = DrafterServer(remote, head=remote.head, device="cpu")
    address = f"unix:{tmp_path}/d.sock"
    server = serve(server_obj, [address])
    yield target, local, address, remote
    server.stop(None).wait()
    server_obj.close()


def _engine(target, proposer, chain: bool = True, max_batch: int = 4, drafts_by_batch=(), graphs_batch: int | None = None,
            **config):
    from specsplit.target_service.engine import Engine, EngineConfig

    engine = Engine(target, proposer, EngineConfig(max_batch=max_batch, chain_steps=chain, drafts_by_batch=drafts_by_batch,
                                                   **config))
    drafts = engine._max_drafts()  # (the engine's own graphs' geometry, uncaptured)
    engine.graphs = StepGraphs(target, engine.cache, engine.capture, max_batch=graphs_batch or max_batch,
                               query_lens=(1, drafts + 1), max_len=target.config.max_position_embeddings + drafts + 1,
                               use_graphs=False)
    return engine


def _run(engine, tokenizer, late_at: int = 5, lengths=(30, 35, 40), late_length: int = 12):
    """Requests of `lengths` tokens, and one of `late_length` added at engine step `late_at`: each one's tokens."""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.target_service.sequence import Request

    for i, (p, n) in enumerate(zip(PROMPTS, lengths)):
        engine.add(Request(f"r{i}", tokenizer.encode(p), SamplingParams(max_tokens=n, ignore_eos=True)))
    events: dict[str, list[int]] = {}
    for n in itertools.count():
        if n == late_at:  # joins mid-chain: the batch changes, its feed comes from the host
            engine.add(Request("late", tokenizer.encode(PROMPTS[3]), SamplingParams(max_tokens=late_length,
                                                                                      ignore_eos=True)))
        for e in engine.step():
            events.setdefault(e.request_id, []).extend(e.token_ids)
        if not engine.has_work:
            return events


def test_a_chained_steps_anchors_and_positions_go_into_the_feed_in_one_copy_where_they_are_rows_of_one_tensor():
    """`RemoteProposer._write_anchors`: rows 1 and 2 of the feed buffer get the anchors and positions, as two writes
    would give them, whether they are two rows of one tensor (one copy: the engine's [2, B] feed, a wider one's
    first columns, rows of a taller one) or not (two)."""
    from types import SimpleNamespace

    from specsplit.target_service.drafter_client import _rows_of_one

    feed = torch.arange(12, dtype=torch.int64).view(2, 6)
    tall = torch.arange(100, 124, dtype=torch.int64).view(4, 6)
    apart = (torch.tensor([7, 8, 9]), torch.tensor([1, 2, 3]))
    cases = [(feed[0], feed[1], True), (feed[0, :4], feed[1, :4], True), (tall[0], tall[1], True),
             (tall[1], tall[3], True), (apart[0], apart[1], False), (feed[1], feed[0], False),
             (feed[0, 1:], feed[0, :5], False), (feed[:, 0], feed[:, 1], False)]
    for anchors, positions, one in cases:
        assert (_rows_of_one(anchors, positions) is not None) == one, (anchors, positions)
        buffer = torch.full((3, 8), -1, dtype=torch.int32)
        conn = SimpleNamespace(feed=SimpleNamespace(tensor=buffer, bump=lambda: None), feed_fresh=False)
        RemoteProposer._write_anchors(conn, anchors, positions)
        n = anchors.shape[0]
        assert buffer[1, :n].tolist() == anchors.tolist() and buffer[2, :n].tolist() == positions.tolist()
        assert (buffer[0] == -1).all() and (buffer[1:, n:] == -1).all()


def test_chained_steps_through_the_services_equal_the_in_process_chain(pair, tiny_chat_dir):
    """The engine chains its steps through the drafter service: every propose drafts what the in-process
    chained drafter drafts (its context K/V committed from the target's rows at the positions the feed
    carried, its positions settled a step behind), so every token and every accepted count is the
    in-process chain's and target-only decoding's; nothing stays allocated on either side."""
    from specsplit.shared.tokenizer import Tokenizer

    target, local, address, remote = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    alone = _run(_engine(target, None, chain=False), tokenizer)
    here, there = Recorded(local), Recorded(remote)
    in_process = _engine(target, local)
    want = _run(in_process, tokenizer)
    proposer = RemoteProposer(address, max_batch=4)
    try:
        assert proposer._conn.feed is not None  # the drafter said it chains
        through = _engine(target, proposer)
        got = _run(through, tokenizer)
        assert got == want == alone
        assert through.counters.chained == in_process.counters.chained > 10 and through.counters.fallbacks == 0
        proposer.flush()
        # Each chained propose after the first was sent ahead, as the step before it launched; those the next
        # step did not take (its batch changed: a request joined or ended) drafted for nothing, in order
        sent, taken = proposer.link.chain_sent_ahead, proposer.link.chain_taken_ahead
        assert taken > 0 and len(there.drafts) == len(here.drafts) + sent - taken
        rest = iter(there.drafts)
        assert all(any(d == e for e in rest) for d in here.drafts) and len(here.drafts) > 10
        assert proposer.link.drafts_on_device == 0  # (on the CPU the drafts come in the answer)
        assert len(remote.store) == 0 and remote.pool.num_free_blocks == remote.pool.num_blocks
        assert through.cache.num_free_blocks == through.cache.num_blocks - 1  # all but the scratch block
    finally:
        proposer.close()


@pytest.mark.slow  # (4-5 s on the CPU: the default run stays under five minutes)
def test_requests_attached_after_the_next_step_launched_decode_as_those_attached_before(pair, tiny_chat_dir):
    """EngineConfig.overlap_attach: a request arriving while a chained step is out is read and attached to
    the drafter after the next chained step of the others launched. Every token and every accepted count is
    that of the engine attaching first, and the late request is read after a launch (its attach does not
    wait for one)."""
    from specsplit.shared.tokenizer import Tokenizer

    target, _, address, _ = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    alone = _run(_engine(target, None, chain=False), tokenizer)
    runs = {}
    for overlap in (False, True):
        proposer = RemoteProposer(address, max_batch=4)
        try:
            engine = _engine(target, proposer, overlap_attach=overlap)
            read_after = []
            finish = engine._finish_prefill
            engine._finish_prefill = lambda prefill, overlapped=False: (
                read_after.append(overlapped) if prefill is not None and prefill.done else None,
                finish(prefill, overlapped))[1]
            runs[overlap] = (_run(engine, tokenizer), engine.counters.accepted, engine.counters.fallbacks)
            assert any(read_after) == overlap, read_after
        finally:
            proposer.close()
    assert runs[True][0] == runs[False][0] == alone
    assert runs[True][1:] == runs[False][1:] and runs[True][2] == 0


class Scripted:
    """The served drafter's chained verbs, recorded: each propose's drafts, replaced by the target's own
    continuation after each anchor (from `texts`, the target-only tokens of every request, looked up by
    anchor token and position) except at every draft position divisible by 3, so how many drafts a step
    accepts (0, 1 or 2) depends on where it stands; and each commit's positions and rows (their sum).
    A step replayed over stale drafts, or committing at positions the feed has moved past, changes both.
    (The tiny random drafter drafts one token everywhere, which the tiny target never picks.)"""

    def __init__(self, drafter, vocab: int, texts: list[list[int]]) -> None:
        self.proposes: list[list[list[int]]] = []
        self.commits: list[tuple[list[int], float]] = []
        truth: dict[tuple[int, int], list[int]] = {}
        for text in texts:
            for at in range(len(text) - 1):
                truth.setdefault((text[at], at), text[at + 1:])
        propose, commit = drafter.chain_propose, drafter.chain_commit

        def chain_propose(batch, anchors, positions, k, *ahead_rows):
            out = propose(batch, anchors, positions, k, *ahead_rows)  # (the drafter's own checks and state, as ever)
            drafts = []
            for anchor, at in zip(anchors.tolist(), positions.tolist()):
                known = (truth.get((anchor, at), []) + [0] * k)[:k]
                drafts.append([(t + 1) % vocab if (at + 1 + i) % 3 == 0 else t for i, t in enumerate(known)])
            self.proposes.append(drafts)
            return torch.tensor(drafts, dtype=out.dtype, device=out.device)

        def chain_commit(batch, rows, positions, count):
            self.commits.append((positions.tolist(), rows.double().sum().item()))
            return commit(batch, rows, positions, count)

        drafter.chain_propose, drafter.chain_commit = chain_propose, chain_commit


@pytest.mark.slow  # (5-6 s on the CPU: the default run stays under five minutes)
def test_the_targets_side_of_a_services_chained_step_replays_what_it_captured(pair, tiny_chat_dir, monkeypatch):
    """EngineConfig(chain_capture_remote=True): through the drafter service a shape's chained steps run
    uncaptured a few times, then what follows the drafts (the verify, the accept, the outcome, the next
    feed, the rows kept for the commit) is captured once, its forwards inlined, and replayed. Here a
    stand-in graph replays the function it was captured from, closure and all, as a CUDA graph replays
    its kernels over the buffers they were captured with: a step reading anything but what it was
    captured over (its drafts input, the feed, the bucket's tables) would go wrong. Every token is
    target-only's, and the drafter was asked the same proposes and told the same commits (positions and
    rows) as without the capture, so every step accepted the same drafts."""
    from specsplit.shared.cuda_graphs import inlining
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service import engine as engine_module

    replaying = {"on": False}

    class Graph:
        def __init__(self, work):
            self.work = work

        def replay(self):
            replaying["on"] = True  # (a graph replays device work: no drafter verb, no host effect inside)
            try:
                self.work()
            finally:
                replaying["on"] = False

    def capture(work, pool):
        assert inlining() and pool == "pool"
        return Graph(work)  # (a capture runs nothing)

    def guarded(call):
        def drafter_call(*args):
            assert not replaying["on"], "a drafter verb inside the captured part of a step"
            return call(*args)
        return drafter_call

    monkeypatch.setattr(engine_module, "capture_serving", capture)
    monkeypatch.setattr(engine_module.torch.cuda, "graph_pool_handle", lambda: "pool")
    target, _, address, remote = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    lengths = (60, 66, 72)
    alone = _run(_engine(target, None, chain=False), tokenizer, lengths=lengths)
    prompts = {f"r{i}": PROMPTS[i] for i in range(len(lengths))} | {"late": PROMPTS[3]}
    scripted = Scripted(remote, target.config.vocab_size,
                        [tokenizer.encode(prompts[rid]) + tokens for rid, tokens in alone.items()])
    runs = {}
    for captured in (False, True):
        scripted.proposes.clear()
        scripted.commits.clear()
        proposer = RemoteProposer(address, max_batch=4)
        try:
            engine = _engine(target, proposer, chain_capture_remote=captured)
            engine._chain_capture_most = 4  # (0 on the CPU, where nothing is captured)
            engine._drafter_call = guarded(engine._drafter_call)
            tokens = _run(engine, tokenizer, lengths=lengths)
            runs[captured] = tokens, list(scripted.proposes), list(scripted.commits), engine.counters
        finally:
            proposer.close()
    (tokens, proposes, commits, plain), (graphed, graphed_proposes, graphed_commits, counters) = runs[False], runs[True]
    assert graphed == tokens == alone
    assert graphed_proposes == proposes and graphed_commits == commits
    accepted = counters.accepted  # steps by drafts accepted (0, 1, 2): most settle at 2 (anchors at 3m)
    assert accepted == plain.accepted and len(accepted) == 3 and accepted[2] >= 10, accepted
    assert plain.chain_replays == plain.chain_captures == 0
    assert counters.chain_captures >= 1 and counters.chain_replays >= 5, (counters.chain_captures, counters.chain_replays)
    assert counters.chained == plain.chained


@pytest.mark.slow  # (10-12 s on the CPU: the default run stays under five minutes)
def test_requests_ending_and_arriving_cost_no_round_trip(pair, tiny_chat_dir):
    """Six requests of different lengths through four slots, as a server sees them. A sequence near its end
    keeps chaining to its last token (its steps may write past its budget, Engine._overhang); the chained
    propose sent ahead as a step launches also asks for the sequences attached since (their prefill ended
    this step), and the next step takes its drafts for whichever of them it holds (one ended: its row is
    left; one joined: its row is there). So the target's host waits for a Step answer only when it
    connects, at the first chained step and for the last free with no step to carry it: not where the
    batch changes (once at each request's arrival and end: 10 answers here, at eight streams 0.22 a step),
    nor where a sequence nears its end (once 85 % of these steps). A request's arrival costs one unary
    call (its prefill allocates it at the drafter); tokens are target-only's, every draft is what a
    chained propose sent as its own step launches drafts, each sequence was first sent ahead with an
    anchor and position such a propose was sent with, and the drafter read the feed as it was sent."""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.sequence import Request

    target, _, address, remote = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    lengths = (20, 30, 40, 50, 25, 35)
    read: list[list[tuple[int, int]]] = []  # each chained propose's (anchor, position) rows, as the drafter read them
    served = remote.chain_propose

    def served_propose(batch, anchors, positions, k):
        read.append(list(zip(anchors.tolist(), positions.tolist())))
        return served(batch, anchors, positions, k)

    remote.chain_propose = served_propose

    def requests():
        return [Request(f"r{i}", tokenizer.encode(PROMPTS[i % len(PROMPTS)]), SamplingParams(max_tokens=n, ignore_eos=True))
                for i, n in enumerate(lengths)]

    alone = _engine(target, None, chain=False).generate(requests())
    unhurried = RemoteProposer(address, max_batch=4, chain_ahead=False)
    each = Recorded(unhurried)
    fed: set[tuple[int, int, int]] = set()  # (sequence, anchor, position) of every chained propose it sent
    propose = unhurried.chain_propose

    def chain_propose(batch, anchors, positions, k):
        fed.update(zip(batch.seq_ids, anchors.tolist(), positions.tolist()))
        return propose(batch, anchors, positions, k)

    unhurried.chain_propose = chain_propose
    try:
        _engine(target, unhurried, stream_attach=False).generate(requests())
    finally:
        unhurried.close()
    proposer = RemoteProposer(address, max_batch=4)
    taken = Recorded(proposer)
    first: dict[int, tuple[int, int, int]] = {}  # each sequence's first (sequence, anchor, position) sent ahead
    sent_rows: list[list[tuple[int, int]]] = []  # the (anchor, position) rows of each propose sent ahead
    prefetch = proposer.chain_prefetch

    def chain_prefetch(seq_ids, ahead, anchors, positions, k):
        rows = list(zip(anchors.tolist(), positions.tolist()))
        sent_rows.append(rows)
        for seq_id, (a, p) in zip(seq_ids, rows):
            first.setdefault(seq_id, (seq_id, a, p))
        return prefetch(seq_ids, ahead, anchors, positions, k)

    proposer.chain_prefetch = chain_prefetch
    read.clear()
    try:
        engine = _engine(target, proposer, stream_attach=False)  # (attaching on the stream: tests/test_stream_attach.py)
        got = engine.generate(requests())
        assert {r: [t for e in got[r] for t in e.token_ids] for r in got} \
            == {r: [t for e in alone[r] for t in e.token_ids] for r in alone}
        assert taken.drafts == each.drafts and len(taken.drafts) > 40
        assert len(first) == len(lengths) and set(first.values()) <= fed, (first, sorted(fed))
        assert all(rows in read for rows in sent_rows)
        waited = len(proposer.link.step_seconds)  # Step answers the target's host waited for
        assert engine.counters.fallbacks == 0 and engine.counters.chained > 40
        assert waited <= 3, f"{waited} Step answers waited for in {engine.counters.steps} steps"
        # every chained step took the drafts sent ahead, some for a batch that lost or gained sequences
        assert proposer.link.chain_taken_ahead >= engine.counters.chained - 1
        assert proposer.link.chain_taken_regrouped >= len(lengths) - 4
        # each request attached in one round trip: its prefill allocates it at the drafter
        assert proposer.link.unary_calls == {"PrefillDrafter": len(lengths)}, proposer.link.unary_calls
    finally:
        proposer.close()
    # EngineConfig.overlap_attach: a request attached behind the launch whose propose went ahead has it sent
    # again (Engine._send_ahead_again): no more answers waited for (5 without), the same drafts
    proposer = RemoteProposer(address, max_batch=4)
    taken = Recorded(proposer)
    try:
        engine = _engine(target, proposer, overlap_attach=True, stream_attach=False)
        overlapped = engine.generate(requests())
        assert {r: [t for e in overlapped[r] for t in e.token_ids] for r in overlapped} \
            == {r: [t for e in alone[r] for t in e.token_ids] for r in alone}
        assert taken.drafts == each.drafts and engine.counters.fallbacks == 0
        assert len(proposer.link.step_seconds) <= 3, len(proposer.link.step_seconds)
    finally:
        proposer.close()
    proposer = RemoteProposer(address, max_batch=4)  # EngineConfig.chain_regroup off (for measurements): as before
    try:
        _engine(target, proposer, chain_regroup=False, stream_attach=False).generate(requests())
        assert len(proposer.link.step_seconds) > 3 + len(lengths) and proposer.link.chain_taken_regrouped == 0
    finally:
        proposer.close()


def test_a_request_validated_before_its_steps_could_chain_is_admitted_and_chains_within_its_room(pair, tiny_chat_dir):
    """The room held for a sequence's steps past its budget grows when its steps can chain (Engine._overhang).
    A request validated before (here: the engine's steps not set up yet; a drafter service that was detached)
    that fits the cache alone is still admitted, with the room the cache has, and its chained steps stay
    within it (they once stopped the queue for good)."""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request

    target, local, _, _ = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    prompt = tokenizer.encode(PROMPTS[0])
    budget = 80  # + a verify's 8 rows fits 6 blocks of 16; + three chained steps' 24 does not

    def request():
        return Request("r", prompt, SamplingParams(max_tokens=budget - len(prompt), ignore_eos=True))

    alone = _engine(target, None, chain=False).generate([request()])
    engine = Engine(target, local, EngineConfig(max_batch=2, kv_blocks=6))
    assert engine._overhang() == local.spec.max_drafts + 1 == 8
    engine.add(request())
    engine.graphs = StepGraphs(target, engine.cache, engine.capture, max_batch=2, query_lens=(1, 8),
                               max_len=target.config.max_position_embeddings + 8, use_graphs=False)
    assert engine._overhang() == 24
    events = []
    for _ in range(200):
        events += engine.step()
        if not engine.has_work:
            break
    assert not engine.has_work, "the request was never admitted"
    assert [t for e in events for t in e.token_ids] == [t for e in alone["r"] for t in e.token_ids]
    assert engine.counters.chained > 10 and engine.counters.fallbacks == 0


def test_one_streams_chained_proposes_go_ahead_of_their_steps_and_are_all_taken(pair, tiny_chat_dir):
    """At one stream the batch never changes: each chained propose goes to the drafter as the step before it
    launches (its feed), while the target still verifies, and the next step takes it, every one, until the
    stream nears its end (two unread steps' rows and k more must fit its budget); tokens as target-only."""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.sequence import Request

    target, _, address, _ = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)

    def requests():
        return [Request("r", tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=80, ignore_eos=True))]

    alone = _engine(target, None, chain=False).generate(requests())
    proposer = RemoteProposer(address, max_batch=4)
    flush, settle, settling, waited = proposer._flush, proposer.chain_settle, [], []

    def counted(*args, **kwargs):  # a Step whose answer the target's host waits for, with nothing to propose
        waited.extend(settling)
        return flush(*args, **kwargs)

    def chain_settle(seq_ids, counts):  # (the queue holding the last step's settles too sent them, and waited)
        settling.append(tuple(seq_ids))
        try:
            settle(seq_ids, counts)
        finally:
            settling.clear()

    proposer._flush, proposer.chain_settle = counted, chain_settle
    try:
        engine = _engine(target, proposer)
        got = engine.generate(requests())
        assert [t for e in got["r"] for t in e.token_ids] == [t for e in alone["r"] for t in e.token_ids]
        sent, taken = proposer.link.chain_sent_ahead, proposer.link.chain_taken_ahead
        # Every step's propose went ahead, to the last token (the steps may write past the budget: Engine._overhang);
        # the last step's went for a step that never came
        assert engine.counters.fallbacks == 0 and sent == taken + 1 and taken >= engine.counters.chained - 1 > 10
        assert proposer.link.drafts_ahead == taken
        assert waited == []
    finally:
        proposer.close()


class _FakeWaits:
    """Stands for shared.device_waits.DeviceWaits on the CPU: counts releases, holds a failure."""

    def __init__(self) -> None:
        self.failure, self.releases, self.closed, self.released = None, 0, False, 0
        self.pending, self.drains = 1, 0  # (as if a wait were always pending: every drain counted)

    def release(self) -> None:
        self.releases += 1

    def drain(self, timeout: float) -> bool:
        self.drains += 1
        return True

    def holds(self, memory) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


def _stand_in_done(conn, memory: torch.Tensor) -> None:
    """A connection's DONE buffer (buffer id 99), standing in CPU memory for the GPU's."""
    conn.done, conn.done_id = memory, 99
    conn.done_flags = [Flag.of(memory[0, i:i + 1]) for i in range(memory.shape[1])]


@pytest.mark.parametrize("columns", [1, pytest.param(2, marks=pytest.mark.slow), "page"],  # (4-5 s each on the CPU)
                         ids=["done-values", "and-written-values", "page-and-written-buffer"])
def test_a_target_with_device_waits_numbers_each_chained_propose_and_drops_a_drafter_its_watchdog_gave_up(
        pair, tiny_chat_dir, monkeypatch, columns):
    """With a DONE buffer (device waits; on a GPU only, stood for here), every chained propose carries the
    next done value, 1, 2, 3 ... (Steps without a propose carry none), and tokens are target-only's. With
    a second column (a drafter with written_flags), every chained propose also carries the next written
    value, which our stream writes into that column before the Step goes out. A failure the watchdog
    reports drops the drafter at our next call to it, with the watchdog's reason, and every wait is
    released; the next connection starts without it. With the done values on the host page, the written
    values go into a written buffer of device memory, which each such Step names (ChainStep.written_buffer)."""
    from types import SimpleNamespace

    from specsplit.shared.host_flags import HostPage

    from specsplit.drafter_service.session import Session
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.sequence import Request

    target, _, address, _ = pair
    seen: list[int] = []
    written: list[tuple[int, int]] = []  # (value, the write's address) as the drafter's Session sees them
    writes: list[tuple[int, int]] = []  # (value, address) our stream was asked to write

    def done_target(self, chain):
        seen.append(chain.done_value)
        if chain.written_value:
            written.append(chain.written_value)
            assert chain.written_buffer == (98 if columns == "page" else 0)

    monkeypatch.setattr(Session, "_done_target", done_target)
    monkeypatch.setattr(drafter_client, "_write_on_stream", lambda flag, value: writes.append((value, flag.address)))
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)

    def requests():
        return [Request(str(i), tokenizer.encode(p), SamplingParams(max_tokens=40, ignore_eos=True))
                for i, p in enumerate(PROMPTS[:3])]

    alone = _engine(target, None, chain=False).generate(requests())
    proposer = RemoteProposer(address, max_batch=4)
    waits = proposer._waits = _FakeWaits()
    page = None
    if columns == "page":
        page, done = HostPage.create(None), torch.zeros(1, 1, dtype=torch.int32)
        conn = proposer._conn
        conn.page = conn.done = page
        conn.written = SimpleNamespace(buffer_id=98, tensor=done)
        conn.done_id, conn.done_flags = 99, [page.flag(0), Flag.of(done[0, 0:1])]
        written_at = done.data_ptr()
    else:
        done = torch.zeros(1, columns, dtype=torch.int32)
        _stand_in_done(proposer._conn, done)
        written_at = done.data_ptr() + 4
    part, sent = proposer._chain_part, []

    def chain_part(conn, propose):  # what each Step's chain carries: (a propose?, its done value)
        queued = len(writes)
        chain = part(conn, propose)
        sent.append((propose is not None, chain.done_value if chain is not None else 0))
        if chain is not None and chain.written_value:  # (queued on our stream as the chain part was made)
            assert writes[queued:] == [(chain.written_value, written_at)]
        else:
            assert len(writes) == queued
        return chain

    proposer._chain_part = chain_part
    try:
        engine = _engine(target, proposer)
        got = engine.generate(requests())
        assert {r: [t for e in ev for t in e.token_ids] for r, ev in got.items()} == \
            {r: [t for e in ev for t in e.token_ids] for r, ev in alone.items()}
        numbered = [value for proposing, value in sent if proposing]
        assert engine.counters.chained > 10 and numbered == seen == list(range(1, len(seen) + 1))
        assert len(seen) >= engine.counters.chained
        assert written == ([] if columns == 1 else seen) and [value for value, _ in writes] == \
            ([] if columns == 1 else list(range(1, len(numbered) + 1)))
        assert [value for proposing, value in sent if not proposing] and all(
            value == 0 for proposing, value in sent if not proposing)  # (Steps of settles and commits alone)
        waits.failure = "the drafter did not write a chained step's done value within its deadline"
        with pytest.raises(DrafterUnavailable, match="done value within its deadline"):
            proposer.ping()
        assert proposer._conn is None and waits.releases >= 1 and waits.failure is None
    finally:
        proposer.close()
    assert waits.closed and proposer._waits is None
    assert page is None or page.closed  # (retired with the connection, closed with the proposer)


@pytest.mark.parametrize("drafts_by_batch, graphs_batch", [
    pytest.param(((3, 0),), None, marks=pytest.mark.slow), pytest.param((), 2, marks=pytest.mark.slow)],  # (5-8 s each)
    ids=["no-drafts-at-three", "graphs-narrower-than-the-batch"])
def test_a_chained_propose_sent_ahead_that_no_step_takes_is_never_taken_for_another(pair, tiny_chat_dir,
                                                                                      drafts_by_batch, graphs_batch):
    """A request joining makes the next step stop chaining (no drafts at three streams; no captured step that
    wide), so the propose sent ahead for two streams is never asked for: the step-by-step Steps after it get
    their own answers (a reviewer found them filed as the chained propose's, and the chain, when it
    resumed with the same sequences and k, took one of them as its drafts: a drafter dropped, or stale
    drafts and a staging overflow). Every draft the target takes is the in-process chain's; nothing falls back."""
    from specsplit.shared.tokenizer import Tokenizer

    target, local, address, _ = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)

    def run(engine):
        return _run(engine, tokenizer, late_at=6, lengths=(60, 60), late_length=3)

    def engine(proposer, chain=True):
        return _engine(target, proposer, chain=chain, drafts_by_batch=drafts_by_batch, graphs_batch=graphs_batch)

    alone = run(engine(None, chain=False))
    here = Recorded(local)
    in_process = engine(local)
    want = run(in_process)
    proposer = RemoteProposer(address, max_batch=4)
    taken = Recorded(proposer)  # what the target's chained proposes returned, sent ahead or not
    try:
        through = engine(proposer)
        assert run(through) == want == alone
        assert through.counters.fallbacks == 0 and through.counters.chained == in_process.counters.chained > 10
        assert taken.drafts == here.drafts
        assert proposer.link.chain_taken_ahead > 10 and proposer.link.chain_sent_ahead > proposer.link.chain_taken_ahead
    finally:
        proposer.close()


def test_sequences_going_on_after_their_chain_stops_find_the_drafter_where_the_target_is(pair, tiny_chat_dir):
    """Sequences whose chain stops short of the context's end (no room for two more chained steps) go on
    step by step through the same drafter: its positions were settled a step behind and the last chained
    step's commit went out with the next Step, so it takes their step-by-step commits and proposes
    without a conflict (a drafter left behind would refuse them, and the engine would fall back)."""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.sequence import Request

    target, _, address, remote = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    context = 72  # a short context: a short test
    target.config = dataclasses.replace(target.config, max_position_embeddings=context)

    def requests():
        return [Request(f"r{i}", ids, SamplingParams(max_tokens=context - len(ids) - 1 - 4 * i, ignore_eos=True))
                for i, ids in enumerate(tokenizer.encode(p) for p in PROMPTS[:2])]

    alone = _engine(target, None, chain=False).generate(requests())
    proposer = RemoteProposer(address, max_batch=4)
    try:
        engine = _engine(target, proposer)
        got = engine.generate(requests())
        assert {r: [t for e in evs for t in e.token_ids] for r, evs in got.items()} == \
            {r: [t for e in evs for t in e.token_ids] for r, evs in alone.items()}
        steps = sum(evs[-1].stats.steps for evs in got.values())
        assert engine.counters.fallbacks == 0 and engine.counters.chained > 10 and steps > engine.counters.chained
    finally:
        proposer.close()


def test_a_drafter_without_static_forwards_is_not_asked_to_chain(tiny_chat_dir, tmp_path):
    """A drafter that cannot chain says so (DrafterDescription.chains false): the target steps as usual
    through it, with the same tokens."""
    from specsplit.shared.tokenizer import Tokenizer

    target, (_, remote) = _drafter_pair(tiny_chat_dir)
    remote.propose_graphs = remote.context_graphs = None
    server_obj = DrafterServer(remote, head=remote.head, device="cpu")
    address = f"unix:{tmp_path}/d.sock"
    server = serve(server_obj, [address])
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    proposer = RemoteProposer(address, max_batch=4)
    try:
        assert proposer._conn.feed is None
        engine = _engine(target, proposer)
        assert _run(engine, tokenizer) == _run(_engine(target, None, chain=False), tokenizer)
        assert engine.counters.chained == 0 and sum(engine.counters.drafts[1:]) > 0  # (verified, step by step)
    finally:
        proposer.close()
        server.stop(None).wait()
        server_obj.close()


def _chained_once(proposer: RemoteProposer, vocab: int):
    """Two sequences prefilled, then one chained propose from whatever the feed holds."""
    gen = torch.Generator().manual_seed(3)
    dim = proposer.spec.feature_dim
    for seq_id in (1, 2):
        proposer.alloc(seq_id, 120)
        proposer.prefill(seq_id, torch.randint(0, vocab, (6,), generator=gen).tolist(), torch.randn(6, dim, generator=gen))
    return proposer.chain_batch([1, 2], [0, 0])


@pytest.mark.parametrize("anchors, positions", [
    ([10 ** 6, -5], [6, 6]),  # anchors outside the vocabulary (an embedding's device assert, unbounded)
    ([3, 4], [-(2 ** 31), 2 ** 31 - 1]),  # positions at int32's ends
    ([3, 4], [6, 6]),
])
def test_a_feed_holding_anything_gets_drafts_and_the_drafter_lives(pair, anchors, positions):
    """The feed is the target's bytes: whatever anchors and positions it holds, a chained propose gets k
    drafts in the vocabulary (verification keeps any of them exact) and the drafter serves on; a commit
    at any positions writes only the sequence's own ring."""
    target, _, address, remote = pair
    vocab = remote.spec.vocab_size
    proposer = RemoteProposer(address, max_batch=4)
    try:
        batch = _chained_once(proposer, vocab)
        assert batch is not None
        rows = torch.randn(2 * 4, proposer.spec.feature_dim)
        rings = {b for seq_id in remote.store for b in remote.store.get(seq_id).ring}
        others = [b for b in range(remote.pool.num_blocks + 1) if b not in rings and b != remote.pool.scratch]
        before = remote.pool.k[:, others].clone(), remote.pool.v[:, others].clone()
        proposer.chain_commit(batch, rows, torch.tensor(positions), 4)
        drafts = proposer.chain_propose(batch, torch.tensor(anchors), torch.tensor(positions), 5)
        # the commit wrote the two rings (and the propose its block there, or scratch), nothing else
        assert others and torch.equal(remote.pool.k[:, others], before[0]) and torch.equal(remote.pool.v[:, others], before[1])
        assert drafts.shape == (2, 5) and 0 <= int(drafts.min()) and int(drafts.max()) < vocab
        proposer.chain_settle([1, 2], [1, 1])
        assert [len(p.tokens) for p in proposer.propose([ProposeRequest(1, 3, 7, 3), ProposeRequest(2, 3, 7, 3)])] == [3, 3]
    finally:
        proposer.close()


def test_a_chain_step_naming_the_wrong_buffers_ends_only_its_connection(pair):
    """A ChainStep whose rows are the feed buffer (or a feed buffer shaped like rows), whose feed is a rows
    buffer, whose commit counts more rows than referenced, or which names a sequence it never allocated:
    INVALID_ARGUMENT / NOT_FOUND for that target (its stream ends), while another target connected all
    along goes on chaining, and the drafter serves the next one."""
    from specsplit.shared.transport import BufferRole

    target, _, address, remote = pair
    vocab = remote.spec.vocab_size
    want = {"rows are the feed": InvalidRequest, "rows in a feed buffer of rows' width": InvalidRequest,
            "feed is rows": InvalidRequest, "rows short": InvalidRequest, "unknown sequence": UnknownSequence,
            "too many drafts": InvalidRequest, "a done flag from a drafter that writes none": StateConflict}
    innocent = RemoteProposer(address, max_batch=4)
    innocent_batch = _chained_once(innocent, vocab)
    for attack in want:
        proposer = RemoteProposer(address, max_batch=4)
        try:
            batch = _chained_once(proposer, vocab)
            conn = proposer._conn
            proposer._write_feed(conn, 1, torch.tensor([3, 4]))
            proposer._write_feed(conn, 2, torch.tensor([6, 6]))
            conn.feed.record()
            conn.feed_fresh = True
            feed = conn.feed.ref(0, 3)
            conn.step.put(torch.randn(8, proposer.spec.feature_dim))
            conn.step.seal()
            rows = conn.step.buffer.ref(0, 8)
            commit = dict(commit_seq_ids=(1, 2), commit_rows=4, rows=rows, feed=feed)
            # int32, [3, feature_dim]: as wide as rows, so only its role tells it apart
            shaped = conn.exporter.create(3, proposer.spec.feature_dim, torch.int32, "cpu", BufferRole.FEED)
            propose = dict(seq_ids=(1, 2), ahead=(0, 0), num_drafts=3, feed=feed)
            chain = {
                "rows are the feed": wire.ChainStep(**{**commit, "rows": feed}),
                "rows in a feed buffer of rows' width": wire.ChainStep(**{**commit, "commit_seq_ids": (1,),
                                                                         "commit_rows": 3, "rows": shaped.ref(0, 3)}),
                "feed is rows": wire.ChainStep(**{**propose, "feed": conn.step.buffer.ref(0, 3)}),
                "rows short": wire.ChainStep(**{**commit, "commit_rows": 5}),
                "unknown sequence": wire.ChainStep(seq_ids=(1, 9), ahead=(0, 0), num_drafts=3, feed=feed),
                "too many drafts": wire.ChainStep(seq_ids=(1, 2), ahead=(0, 0), num_drafts=99, feed=feed),
                # (a CPU drafter: DrafterDescription.done_flags is false, and its GPU could not write one)
                "a done flag from a drafter that writes none": wire.ChainStep(**propose, done_buffer=shaped.buffer_id,
                                                                               done_value=7),
            }[attack]
            proposer._step_id += 1
            pb = wire.step_to_proto(wire.StepBatch(proposer._step_id, chain=chain, register=(shaped.describe(),)),
                                    columns=True)
            frames.send_frame(conn.sock, pb.SerializeToString())
            with pytest.raises(SpecsplitError) as raised:
                proposer._answer(conn, 10.0)
            assert type(raised.value) is want[attack], (attack, raised.value)
            if attack.startswith("rows"):
                assert "holds feed, not rows" in str(raised.value) or attack == "rows short", raised.value
            assert innocent.chain_propose(innocent_batch, torch.tensor([3, 4]), torch.tensor([6, 6]), 3).shape == (2, 3)
        finally:
            proposer.close()
    innocent.close()
    proposer = RemoteProposer(address, max_batch=4)
    try:
        batch = _chained_once(proposer, vocab)
        assert proposer.chain_propose(batch, torch.tensor([3, 4]), torch.tensor([6, 6]), 3).shape == (2, 3)
    finally:
        proposer.close()
    deadline = time.monotonic() + 10
    while len(remote.store) and time.monotonic() < deadline:  # (a session ends with its stream, on its thread)
        time.sleep(0.05)
    assert len(remote.store) == 0


def test_a_chained_batch_made_on_a_dropped_connection_is_refused(pair):
    """The drafter re-attached between a chained batch and its propose: the propose is refused (the new
    session never had the sequences), never sent."""
    target, _, address, remote = pair
    proposer = RemoteProposer(address, max_batch=4)
    try:
        batch = _chained_once(proposer, remote.spec.vocab_size)
        proposer.reset()
        proposer._retry_at = 0.0
        deadline = time.monotonic() + 10
        while not proposer.available():  # (a probe sees the drafter up, then the next call attaches)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(DrafterUnavailable, match="re-attached"):
            proposer.chain_propose(batch, torch.tensor([3, 4]), torch.tensor([6, 6]), 3)
    finally:
        proposer.close()


@pytest.mark.parametrize("fields", [
    dict(settle_seq_ids=[1, 2], settle_counts=[1]),  # columns of unequal lengths
    dict(seq_ids=[1, 1], ahead=[0, 0], num_drafts=3),  # a sequence twice
    dict(seq_ids=[-1], ahead=[0], num_drafts=3),  # a negative id
    dict(seq_ids=[1], ahead=[-2], num_drafts=3),  # a negative count
    dict(seq_ids=[1], ahead=[0], num_drafts=0),  # a propose of no drafts
    dict(seq_ids=[1], ahead=[0], num_drafts=3),  # a propose without its feed
    dict(commit_seq_ids=[1], commit_rows=4),  # a commit without its rows
    dict(settle_seq_ids=[1], settle_counts=[1], done_buffer=3, done_value=1),  # a done flag without a propose
    dict(seq_ids=[1], ahead=[0], num_drafts=3, feed=dict(buffer_id=1, rows=3), done_buffer=3),  # ... without a value
    dict(seq_ids=[1], ahead=[0], num_drafts=3, feed=dict(buffer_id=1, rows=3), done_value=5),  # ... without a buffer
    dict(seq_ids=[1], ahead=[0], num_drafts=3, feed=dict(buffer_id=1, rows=3), done_buffer=-3, done_value=5),
])
def test_a_malformed_chain_step_is_refused_as_it_is_parsed(fields):
    from specsplit.protos.v1 import drafter_pb2

    pb = drafter_pb2.StepRequest(step_id=1, chain=drafter_pb2.ChainStep(**fields))
    with pytest.raises(InvalidRequest):
        wire.step_from_proto(pb)


def test_a_step_proposes_chained_or_as_usual_not_both():
    feed = wire.RowRef(1, 0, 3, 1)
    with pytest.raises(InvalidRequest, match="not both"):
        wire.StepBatch(1, proposes=(ProposeRequest(1, 3, 4, 2),),
                       chain=wire.ChainStep(seq_ids=(1,), ahead=(0,), num_drafts=2, feed=feed))


@pytest.mark.slow  # (7 s on the CPU; tests/test_chaos.py kills drafters mid-stream in the default run)
def test_a_drafter_gone_mid_chain_costs_no_token_and_the_chain_resumes_when_one_returns(tiny_chat_dir, tmp_path):
    """The drafter service stops while the engine chains through it (a chained step's Step goes
    unanswered): the engine goes on without it, then attaches the drafter started again at the same
    address, re-prefills its sequences there and chains again. Every token equals target-only
    decoding's."""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.sequence import Request

    target, (_, first) = _drafter_pair(tiny_chat_dir)
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    address = f"unix:{tmp_path}/d.sock"

    def start(drafter):
        server_obj = DrafterServer(drafter, head=drafter.head, device="cpu")
        return server_obj, serve(server_obj, [address])

    def requests():
        return [Request(f"r{i}", tokenizer.encode(p), SamplingParams(max_tokens=120, ignore_eos=True))
                for i, p in enumerate(PROMPTS[:2])]

    alone = _engine(target, None, chain=False).generate(requests())
    want = {rid: [t for e in evs for t in e.token_ids] for rid, evs in alone.items()}
    served = start(first)
    proposer = RemoteProposer(address, max_batch=4, timeout=5.0)
    engine = _engine(target, proposer)
    for r in requests():
        engine.add(r)
    got: dict[str, list[int]] = {}
    chained_before_stop = chained_after_return = 0
    try:
        for n in itertools.count():
            if n == 8:
                chained_before_stop = engine.counters.chained
                served[1].stop(None).wait()
                served[0].close()
            if n == 12:
                served = start(_drafter_pair(tiny_chat_dir)[1][1])
                chained_after_return = engine.counters.chained
            if n > 12 and not engine.drafter_ok:
                time.sleep(0.05)  # (the re-attach backs off for a moment)
            for e in engine.step():
                got.setdefault(e.request_id, []).extend(e.token_ids)
            if not engine.has_work:
                break
        assert got == want
        assert chained_before_stop > 3 and engine.counters.fallbacks >= 1 and engine.counters.reattaches >= 1
        assert engine.counters.chained > chained_after_return  # chained again through the new drafter
    finally:
        proposer.close()
        served[1].stop(None).wait()
        served[0].close()


@pytest.mark.parametrize("after", [0, 2])
def test_a_drafter_given_chain_capture_after_captures_a_shape_after_that_many_runs(monkeypatch, after):
    """`drafter serve --chain-capture-after N`: a shape runs uncaptured N times and is captured on the next; a
    count that is not one is refused, by the session and by the service's settings."""
    from specsplit.drafter_service import session as session_module
    from specsplit.local import LocalSetup
    from specsplit.services import DrafterSettings

    class Proposer:
        def chain_bind(self, batch):
            pass

    class Graph:
        def replay(self):
            pass

    monkeypatch.setattr(session_module, "capture_serving", lambda work, pool: Graph())
    monkeypatch.setattr(session_module.torch.cuda, "graph_pool_handle", lambda: "pool")
    outcomes = []
    session = session_module.Session(Proposer(), client_id="c", new_seq_id=lambda: 0, head=None, device="cpu",
                                     on_chain_graph=outcomes.append, chain_capture_after=after)
    session.chain_graphs = True
    for _ in range(after + 2):
        session._chain_device((1, 3, "a"), "batch", lambda: None)
    assert outcomes == ["uncaptured"] * after + ["captured", "replayed"]
    for bad in (-1, True, 2.0):
        with pytest.raises(InvalidRequest, match="chain_capture_after"):
            session_module.Session(Proposer(), client_id="c", new_seq_id=lambda: 0, head=None, device="cpu",
                                   chain_capture_after=bad)
        with pytest.raises(InvalidRequest, match="--chain-capture-after"):
            DrafterSettings(("unix:/tmp/x.sock",), LocalSetup(drafter="dflash", device="cpu"), chain_capture_after=bad)


def test_a_chained_steps_graph_is_captured_after_its_runs_replayed_bound_and_given_up_if_it_fails(monkeypatch):
    """`Session._chain_device` (drafter --chain-graphs): a shape runs uncaptured CHAIN_CAPTURE_AFTER times,
    is captured on the next (its tables bound first, its forwards inlined), replayed from then with its
    tables bound before each replay; a shape whose capture fails runs uncaptured for good, asked once;
    registering or releasing buffers drops the graphs and their runs. (The CUDA capture itself: tests/test_split_gpu.py.)"""
    from specsplit.drafter_service import session as session_module
    from specsplit.shared.cuda_graphs import inlining

    log = []

    class Proposer:
        def chain_bind(self, batch):
            log.append(("bind", batch))

    class Graph:
        def __init__(self, work):
            self.work = work

        def replay(self):
            log.append("replay")
            self.work()

    failing = {"shape": None}

    def capture(work, pool):
        assert inlining()
        log.append("capture")
        if failing["shape"] is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        return Graph(work)

    monkeypatch.setattr(session_module, "capture_serving", capture)
    monkeypatch.setattr(session_module.torch.cuda, "graph_pool_handle", lambda: "pool")
    outcomes = []
    session = session_module.Session(Proposer(), client_id="c", new_seq_id=lambda: 0, head=None, device="cpu",
                                     on_chain_graph=outcomes.append)
    session.chain_graphs = True
    after = session_module.CHAIN_CAPTURE_AFTER

    def work():
        log.append("work")

    for _ in range(after + 3):
        session._chain_device((1, 3, "a"), "batch", work)
    assert log[:after] == ["work"] * after
    assert log[after:after + 4] == [("bind", "batch"), "capture", ("bind", "batch"), "replay"]
    assert log[after + 4:] == ["work", ("bind", "batch"), "replay", "work", ("bind", "batch"), "replay", "work"]
    assert outcomes == ["uncaptured"] * after + ["captured", "replayed", "replayed"]
    assert session.chain_graph_error is None
    log.clear()
    outcomes.clear()
    failing["shape"] = "b"
    for _ in range(after + 3):
        session._chain_device((1, 3, "b"), "batch", work)
    assert log.count("capture") == 1 and log.count("replay") == 0 and log.count("work") == after + 3
    assert outcomes == ["uncaptured"] * after + ["failed", "uncaptured", "uncaptured"]
    assert session.chain_graph_error == "RuntimeError: operation not permitted when stream is capturing"
    session._drop_chain_graphs()  # (what register and release do)
    assert session._chain_pool is None  # (a pool no graph holds cannot take a capture: a new one next time)
    log.clear()
    failing["shape"] = None
    session._chain_device((1, 3, "a"), "batch", work)
    assert log == ["work"]  # a shape captured before runs uncaptured again over new buffers first


@pytest.fixture
def captured_graphs(monkeypatch) -> list:
    """The drafter session's CUDA capture replaced on the CPU: a "graph" replays its work by running it
    again. Returns the works captured, in order."""
    from specsplit.drafter_service import session as session_module

    captured = []

    class Graph:
        def __init__(self, work):
            self.work = work

        def replay(self):
            self.work()

    def capture(work, pool):
        captured.append(work)
        return Graph(work)

    monkeypatch.setattr(session_module, "capture_serving", capture)
    monkeypatch.setattr(session_module.torch.cuda, "graph_pool_handle", lambda: "pool")
    return captured


def test_a_target_naming_new_row_offsets_every_chained_step_grows_no_graphs_past_the_bound(captured_graphs):
    """A chained step's graph is keyed by the addresses it reads, and a target picks its rows' offset: one
    naming a new offset every step (a new shape each time), or cycling through many, must not grow the
    shapes counted or the graphs held without end. At most MAX_CHAIN_SHAPES shapes counted (the one run
    longest ago forgotten first, so a shape that keeps coming back is still captured) and
    MAX_CHAIN_GRAPHS graphs; past those, shapes run uncaptured and the ones captured still replay."""
    from specsplit.drafter_service import session as session_module

    captured = captured_graphs

    class Proposer:
        def chain_bind(self, batch):
            pass

    def new_session():
        outcomes = []
        session = session_module.Session(Proposer(), client_id="c", new_seq_id=lambda: 0, head=None, device="cpu",
                                         on_chain_graph=outcomes.append)
        session.chain_graphs = True
        return session, outcomes

    after, most, shapes = (session_module.CHAIN_CAPTURE_AFTER, session_module.MAX_CHAIN_GRAPHS,
                           session_module.MAX_CHAIN_SHAPES)
    session, outcomes = new_session()
    for offset in range(10_000):  # a new offset every step
        session._chain_device((1, 3, offset), "batch", lambda: None)
    assert len(session._chain_runs) == shapes and not session._chain_graphs and set(outcomes) == {"uncaptured"}
    for _ in range(after + 1):  # a shape that keeps coming back is counted anew, and captured
        session._chain_device((1, 3, "steady"), "batch", lambda: None)
    assert outcomes[-1] == "captured" and len(captured) == 1

    session, outcomes = new_session()
    ran = []
    for _ in range(after + 2):  # `shapes` offsets in turn: each reaches its capture in the same round
        for offset in range(shapes):
            session._chain_device((1, 3, offset), "batch", lambda: ran.append(1))
    assert len(session._chain_graphs) == most and outcomes.count("captured") == most
    assert len(captured) == 1 + most and len(ran) == (after + 2) * shapes  # every step's work ran, once
    assert len(session._chain_runs) <= shapes
    session._chain_device((1, 3, 0), "batch", lambda: None)
    assert outcomes[-1] == "replayed"  # (shape 0 was among the first captured)


def test_a_chained_steps_graph_outlives_step_messages_and_buffers_it_does_not_read(pair, monkeypatch,
                                                                                     captured_graphs):
    """Every Step message passes through `Session.register`, most with nothing to register: those keep the
    chained steps' graphs and the runs counted towards them (the eighteenth session's drafter dropped both
    on every message, so with --chain-graphs no shape ever reached its capture: 0 replays on the H200).
    So do a buffer registered or released that no graph reads (a target's bulk buffer grown for a long
    prompt); releasing a buffer a graph reads drops that graph, registering a head drops them all."""
    from specsplit.drafter_service import session as session_module
    from specsplit.shared.transport import BufferExporter, BufferRole

    _, _, _, proposer = pair
    monkeypatch.setattr(proposer, "chain_bind", lambda batch: None, raising=False)
    outcomes = []
    session = session_module.Session(proposer, client_id="c", new_seq_id=lambda: 0, head=proposer.head, device="cpu",
                                     on_chain_graph=outcomes.append)
    session.chain_graphs = True
    after = session_module.CHAIN_CAPTURE_AFTER
    with BufferExporter() as exporter:
        read = exporter.create(4, 8)  # the buffer the graphs' rows lie in
        session.register([read.describe()])

        def run_to_capture(key) -> None:
            for _ in range(after + 1):
                session._chain_device(key, "batch", lambda: None)
            assert outcomes[-1] == "captured"

        reads, other = (1, 3, "rows", frozenset({read.buffer_id, 0})), (1, 3, "other", frozenset({10**6}))
        for step_id in range(after + 3):  # a Step message, then its chained step
            session.step(wire.StepBatch(step_id))
            session._chain_device(reads, "batch", lambda: None)
        assert outcomes == ["uncaptured"] * after + ["captured", "replayed", "replayed"]
        run_to_capture(other)
        bulk = exporter.create(4, 8)
        session.step(wire.StepBatch(99, register=(bulk.describe(),)))  # a buffer no graph reads, in and out
        session.step(wire.StepBatch(100, release=(bulk.buffer_id,)))
        assert set(session._chain_graphs) == {reads, other} and session._chain_pool is not None
        session.release([read.buffer_id])  # the graph that reads it goes, the other stays
        assert set(session._chain_graphs) == {other}
        session._chain_device(other, "batch", lambda: None)
        assert outcomes[-1] == "replayed"
        head = exporter.create(2, 8, role=BufferRole.TARGET_EMBEDDING)
        with pytest.raises(SpecsplitError):  # (a head of the wrong shape: refused, and the graphs dropped first)
            session.register([head.describe()])
        assert not session._chain_graphs and session._chain_pool is None
        session.close()


class _PreparedWorld:
    """A drafter session over stand-ins, for `Session.prepare_chain` on the CPU: a proposer that logs its chain
    verbs, an importer whose rows and feed are "CUDA IPC" views written or not yet, a drafts buffer whose
    event logs its records, and a captured graph for the step's shape that logs its replays."""

    def __init__(self, monkeypatch):
        from specsplit.drafter_service import session as session_module
        from specsplit.shared.transport import BufferKind, RowRef

        log = self.log = []

        class Spec:
            max_batch, max_drafts, feature_dim = 4, 7, 8

        class Proposer:
            spec = Spec()
            propose_graphs = context_graphs = object()
            head = None

            def chain_settle(self, ids, counts):
                log.append(("settle", tuple(ids), tuple(counts)))

            def chain_batch(self, ids, ahead):
                log.append(("batch", tuple(ids)))
                return ("batch", tuple(ids))

            def chain_bind(self, batch):
                log.append(("bind", batch, self.head))

        world = self
        self.written = {1: False, 2: False}  # the target's writes into rows (1) and feed (2), seen done
        self.generation = {1: 5, 2: 5}
        rows, drafts = torch.zeros(6, 8), torch.zeros(4, 7, dtype=torch.int32)
        self.feed = feed = torch.zeros(3, 4, dtype=torch.int32)

        class Event:
            def record(self):
                log.append("record")

        class Importer:
            def descriptor(self, buffer_id):
                return type("D", (), {"kind": BufferKind.CUDA_IPC})

            def resolve(self, ref, *, cols=None, dtype=None, device=None, role=None, before_written=False):
                assert before_written or world.written[ref.buffer_id]
                whole = rows if ref.buffer_id == 1 else world.feed
                return whole[ref.row_offset:ref.row_offset + ref.rows]

            def drafts_target(self, buffer_id):
                assert buffer_id == 3
                return drafts, Event()

            def check_current(self, ref, *, written=True):
                if world.generation[ref.buffer_id] != ref.generation:
                    raise StateConflict("stale")
                if written and not world.written[ref.buffer_id]:
                    raise WritesPending("not written")

        class Graph:
            def replay(self):
                log.append("replay")
                time.sleep(0.002)  # (a launch's host time, told apart from the rest of the launch's)

        self.head = object()  # the server's own head, this connection's
        self.session = session = session_module.Session(Proposer(), client_id="c", new_seq_id=lambda: 0,
                                                        head=self.head, device="cpu")
        session.importer = Importer()
        session.chain_graphs = True
        session._seqs = {0: 100, 1: 101}
        self.chain = wire.ChainStep(settle_seq_ids=(0, 1), settle_counts=(2, 3), commit_seq_ids=(0, 1), commit_rows=3,
                                    rows=RowRef(1, 0, 6, 5), feed=RowRef(2, 0, 3, 5), seq_ids=(0, 1), ahead=(1, 1),
                                    num_drafts=7)
        self.batch = wire.StepBatch(9, chain=self.chain, drafts_buffer=3)
        key = session_module._chain_key(2, 7, 3, rows, feed[:, :2], drafts, self.chain, 3)
        session._chain_graphs[key] = Graph()


def test_a_chained_step_prepared_before_the_targets_writes_launches_after_them_or_not_at_all(monkeypatch):
    """`Session.prepare_chain` (the drafter's host work for a chained propose sent ahead, done while the
    target's GPU still verifies): the settles and the batch's checks run at once, before the target's writes
    are seen done, and nothing reaches the GPU; the launch, after them, binds the tables again, replays the
    step's graph and records the drafts' event. A launch refuses to replay when another call of the
    connection came between, when the rows or feed moved to another generation, or when their writes are
    still not seen done; a step the graphs do not cover is left to `step`, nothing done."""
    world = _PreparedWorld(monkeypatch)
    session, log = world.session, world.log
    launch = session.prepare_chain(world.batch)
    assert launch is not None
    assert log == [("settle", (100, 101), (2, 3)), ("batch", (100, 101))]  # no bind, no replay yet
    with pytest.raises(WritesPending):  # (the server launches only after await_writes)
        launch()
    assert "replay" not in log
    world.written.update({1: True, 2: True})
    session.proposer.head = "another connection's head"  # bound by another connection's step meanwhile
    log.clear()
    result = launch()
    assert log == [("batch", (100, 101)), ("bind", ("batch", (100, 101)), world.head), "replay", "record"]
    assert result.step_id == 9 and result.in_buffer == ((0, 7), (1, 7)) and not result.proposals and not result.errors
    phases = session.last_phases
    assert phases.commit > 0 and phases.replay >= 0.002 and phases.propose > 0

    for spoil, error in ((lambda: setattr(session, "turns", session.turns + 1), StateConflict),  # a call between
                         (lambda: world.generation.update({2: 6}), StateConflict),  # the feed's generation moved
                         (lambda: world.generation.update({1: 6}), StateConflict),  # the rows' generation moved
                         (lambda: world.written.update({2: False}), WritesPending),  # rows written, the feed not
                         (lambda: world.written.update({1: False}), WritesPending),  # the feed written, the rows not
                         (lambda: setattr(session, "closed", True), StateConflict)):  # the connection closed
        world.generation.update({1: 5, 2: 5})
        world.written.update({1: True, 2: True})
        session.closed = False
        launch = session.prepare_chain(world.batch)
        spoil()
        log.clear()
        with pytest.raises(error):
            launch()
        assert "replay" not in log and "record" not in log
    world.generation.update({1: 5, 2: 5})
    session.closed = False

    # A step naming a done value: written after the replay, before the drafts' event
    monkeypatch.setattr(session, "_done_target", lambda chain: "the done buffer's view")
    monkeypatch.setattr(type(session), "_write_done", staticmethod(lambda view, value: log.append(("done", view, value))))
    launch = session.prepare_chain(dataclasses.replace(world.batch, chain=dataclasses.replace(world.chain, done_buffer=4, done_value=42)))
    log.clear()
    launch()
    assert log[-3:] == ["replay", ("done", "the done buffer's view", 42), "record"]

    # Not covered (nothing done, `step` runs it): no graph for the shape, rows in shared memory, a message
    # that does more than chain, a head whose writes were not seen done
    from specsplit.shared.transport import BufferKind

    log.clear()
    assert session.prepare_chain(dataclasses.replace(world.batch, chain=dataclasses.replace(world.chain, num_drafts=6))) is None
    assert session.prepare_chain(dataclasses.replace(world.batch, release=(1,))) is None
    describe = session.importer.descriptor
    session.importer.descriptor = lambda buffer_id: type("D", (), {"kind": BufferKind.SHM})
    assert session.prepare_chain(world.batch) is None
    session.importer.descriptor = describe
    world.feed = torch.zeros(3, 4, dtype=torch.int32, device="meta")  # a feed on another device (a copy would be queued)
    assert session.prepare_chain(world.batch) is None
    session._head, session._head_written = object(), False
    assert session.prepare_chain(world.batch) is None
    assert log == []


class _Waits:
    """Stands for shared.device_waits.DeviceWaits on the drafter's side: logs the waits queued."""

    def __init__(self, log: list) -> None:
        self.log, self.failure, self.closed = log, None, False

    def wait(self, flag, value, deadline):
        self.log.append(("wait", flag.address, value))
        assert deadline > time.perf_counter()

    def close(self):
        self.closed = True

    def join(self):
        self.joined = self.closed  # (after close)


def test_a_device_waited_chained_step_launches_before_the_targets_writes_its_stream_waiting_for_them(monkeypatch):
    """Drafter --device-waits (`Session.waits`): a prepared chained step that carries a written value
    (ChainStep.written_value) is `device_waited`: the server calls its launch at once, and the launch, with
    the target's writes not seen done yet, queues our stream's wait for that value in the DONE buffer's
    element 1 before the graph's replay (then the done value, then the drafts' event). Generations are still
    checked; a done buffer of one column, a failure our watchdog reported, and a session without waits are
    each told apart; closing the session releases its waits."""
    world = _PreparedWorld(monkeypatch)
    session, log = world.session, world.log
    session.waits = waits = _Waits(log)
    memory = torch.zeros(1, 2, dtype=torch.int32)
    done = [Flag.of(memory[0, i:i + 1]) for i in range(2)]
    monkeypatch.setattr(session, "_done_target", lambda chain: done)
    monkeypatch.setattr(type(session), "_write_done", staticmethod(lambda view, value: log.append(("done", value))))
    waited = dataclasses.replace(world.batch, chain=dataclasses.replace(world.chain, done_buffer=4, done_value=42,
                                                                        written_value=7))
    launch = session.prepare_chain(waited)
    assert launch.device_waited
    log.clear()
    result = launch()  # (the rows and feed not seen written: our stream waits for them)
    assert log == [("batch", (100, 101)), ("bind", ("batch", (100, 101)), world.head),
                   ("wait", memory.data_ptr() + 4, 7), "replay", ("done", 42), "record"]
    assert result.in_buffer == ((0, 7), (1, 7))

    launch = session.prepare_chain(waited)  # a generation moved: refused as before, nothing queued
    world.generation[2] = 6
    log.clear()
    with pytest.raises(StateConflict):
        launch()
    assert log == []
    world.generation[2] = 5

    assert not session.prepare_chain(dataclasses.replace(waited, chain=dataclasses.replace(waited.chain, written_value=0))).device_waited
    monkeypatch.setattr(session, "_done_target", lambda chain: done[:1])
    with pytest.raises(InvalidRequest, match="element 1"):
        session.prepare_chain(waited)
    monkeypatch.setattr(session, "_done_target", lambda chain: done)

    launch = session.prepare_chain(waited)
    waits.failure = "the target did not write a chained step's written value within its deadline"
    log.clear()
    with pytest.raises(WritesPending, match="written value"):  # (the launch prepared before the release)
        launch()
    assert "replay" not in log
    with pytest.raises(WritesPending):
        session.prepare_chain(waited)
    waits.failure = None

    session.waits = None  # a session without waits: its launch waits for the host to see the writes done
    launch = session.prepare_chain(waited)
    assert not launch.device_waited
    with pytest.raises(WritesPending):
        launch()
    session.waits = waits
    session._seqs, session.importer.close = {}, lambda: None  # (the stand-ins hold nothing to free)
    session.close()
    assert waits.closed and waits.joined


def test_detaching_a_drafter_service_keeps_the_chained_tails_an_in_process_drafter_drops_its_programs(pair, tiny_chat_dir):
    """`Engine._detach`: an in-process drafter's chained programs go (their graphs, captured whole, read the
    drafter's buffers); through a drafter service they hold only what follows the drafts (reading our own
    buffers), so they stay for the connection that re-attaches: no recapture per shape after an outage."""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.sequence import Request

    target, local, address, _ = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    remote = RemoteProposer(address, max_batch=4)
    try:
        for proposer, kept in ((local, False), (remote, True)):
            engine = _engine(target, proposer)
            engine.generate([Request(str(i), tokenizer.encode(p), SamplingParams(max_tokens=24, ignore_eos=True))
                             for i, p in enumerate(PROMPTS[:2])])
            programs = dict(engine._chain_programs)
            assert programs and engine.counters.chained > 0
            engine._detach()
            assert engine._chain_programs == (programs if kept else {})
    finally:
        remote.close()


@pytest.mark.parametrize("flags", ["device-memory", "host-page", "host-page-unquiesced"])
def test_a_target_lets_its_device_waits_pass_before_work_that_may_load_a_kernel(pair, tiny_chat_dir, monkeypatch,
                                                                                flags):
    """`Engine._quiesce` (device waits): a kernel launched for the first time while our stream waits for a
    drafter's value loads its module, which waits for the whole context, and a drafter that never writes
    would then hang us. So every prefill, and every chained step that is not the same as the one before
    (another shape or batch: kernels perhaps not launched yet, or a capture), first lets the waits pass
    (`RemoteProposer.drain_waits`); the same chained step again does not, which is where device waits
    save the host its wait. (A stand-in stands for the waits; the real ones: tests/test_split_gpu.py.)
    With the DONE buffer on the host page the same, unless EngineConfig.unquiesced_host_flags: then no wait
    is drained and no drafts are waited for on the host (a store of our CPU releases a wait through a load)."""
    from types import SimpleNamespace

    from specsplit.shared.host_flags import HostPage

    from specsplit.drafter_service.session import Session
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.sequence import Request

    target, _, address, _ = pair
    monkeypatch.setattr(Session, "_done_target", lambda self, chain: None)  # (the CPU drafter writes none)
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    proposer = RemoteProposer(address, max_batch=4)
    log: list[str] = []
    waits = proposer._waits = _FakeWaits()
    waits.drain = lambda timeout: log.append("drain") or True
    proposer.wait_on_host_next = lambda: log.append("on-host")
    page = None
    if flags == "device-memory":
        _stand_in_done(proposer._conn, torch.zeros(1, 1, dtype=torch.int32))
    else:
        page = proposer._conn.page = HostPage.create(None)
        proposer._conn.done, proposer._conn.done_id, proposer._conn.done_flags = page, 99, [page.flag(0)]
    assert proposer.waits_outlive_loads == (flags != "device-memory")
    try:
        engine = _engine(target, proposer, unquiesced_host_flags=flags == "host-page-unquiesced")
        prefill, launch = engine._prefill, engine._chain_launch
        engine._prefill = lambda: log.append("prefill") or prefill()
        engine._chain_launch = lambda seqs, k, *rest: log.append(("launch", tuple(s.seq_id for s in seqs), k)) \
            or launch(seqs, k, *rest)
        requests = [Request(str(i), tokenizer.encode(p), SamplingParams(max_tokens=n, ignore_eos=True))
                    for i, (p, n) in enumerate(zip(PROMPTS[:3], (40, 24, 32)))]
        engine.add(requests[0])
        for _ in range(6):  # the first alone for a few steps, then two more arrive
            engine.step()
        for request in requests[1:]:
            engine.add(request)
        while engine.has_work:
            engine.step()
        assert engine.counters.chained > 20 and log.count("prefill") >= 2
        if flags == "host-page-unquiesced":
            assert "drain" not in log and "on-host" not in log, log
            return
        assert all(log[i - 1] == "drain" for i, what in enumerate(log) if what == "prefill")
        # Each launch of another batch or k than the launch before lets the waits pass; the same step again
        # does not (a launch whose batch is the same may still drain: e.g. a capture, a step not chained before)
        launches = [i for i, what in enumerate(log) if what[0] == "launch"]
        drains = [log[i + 1:i + 2] == ["drain"] for i in launches]
        changed = [True] + [log[a][1:] != log[b][1:] for a, b in zip(launches, launches[1:])]
        assert all(d for d, c in zip(drains, changed) if c), log
        # ... and has its own drafts waited for by the host, its eager work after them perhaps a kernel's first
        assert all(log[i + 2:i + 3] == ["on-host"] for i, c in zip(launches, changed) if c), log
        assert log.count("on-host") <= drains.count(True) < len(launches) - 10, log
        assert sum(changed) >= 3 and drains.count(False) >= 10, log
    finally:
        proposer.close()
        if page is not None:
            page.close()


def test_drafts_the_engine_asks_to_wait_for_on_the_host_are_not_waited_for_by_our_stream(pair, monkeypatch):
    """`RemoteProposer.wait_on_host_next` (Engine._quiesce, before a chained step whose eager work may launch a
    kernel for the first time): the next drafts answered in our buffer are awaited by our host (the drafts
    buffer's event polled), not by our stream's device wait; the answer after is our stream's again."""
    from types import SimpleNamespace

    _, _, address, _ = pair
    proposer = RemoteProposer(address, max_batch=4)
    how: list[str] = []
    try:
        conn = proposer._conn
        conn.offered, conn.done_sent, conn.sent_at = True, 5, time.perf_counter()
        _stand_in_done(conn, torch.zeros(1, 2, dtype=torch.int32))
        proposer._waits = SimpleNamespace(wait=lambda *args: how.append("stream"), failure=None)
        monkeypatch.setattr(drafter_client, "_importer_done", lambda drafts, wait: how.append("host") or True)
        monkeypatch.setattr(proposer, "_receive", lambda conn, timeout: wire.StepResult(1, in_buffer=((0, 3),)))
        proposer.wait_on_host_next()
        proposer._answer(conn, 1.0)
        proposer._answer(conn, 1.0)
        assert how == ["host", "stream"]
        assert (proposer.link.host_waits, proposer.link.device_waits) == (1, 1)
    finally:
        proposer._waits = None
        proposer.close()


def test_with_device_waits_a_chained_propose_sent_ahead_is_taken_before_its_answer_and_checked_after(
        pair, monkeypatch):
    """`RemoteProposer._take_unanswered`: with device waits, the drafts of the chained propose sent ahead are
    taken when the step asks for the same (sequences, k, feed tensors) before the answer is read, our stream
    first waiting for the propose's done value; the answer is read by the connection's next use (`_live`:
    chain_commit's, after the verify launched), checked then, and filed as nothing: one for other sequences
    drops the drafter, and a drop with it still out forgets the take. Without device waits, with our host
    asked to wait (wait_on_host_next), with verbs queued, after the watchdog gave up, or for another batch,
    the answer is read first, as before. (The connection's drafts and DONE buffers are stand-ins: the real
    ones are GPU-only, tests/test_split_gpu.py, which also checks the drafts accepted against host polls.)"""
    from types import SimpleNamespace

    from specsplit.target_service.drafter_client import RemoteChainBatch, _feed_key

    _, _, address, _ = pair
    order: list = []
    monkeypatch.setattr(drafter_client, "_importer_done", lambda drafts, wait=0.0: order.append("host") or True)
    monkeypatch.setattr(RemoteProposer, "_note_read", staticmethod(lambda conn: order.append("read noted")))
    anchors, positions = torch.tensor([5, 6]), torch.tensor([10, 11])
    buffer = torch.arange(4 * 6, dtype=torch.int32).reshape(4, 6)

    def sent_ahead(proposer, answer_rows, *, waits=True, ids=(0, 2)):
        """The state `chain_prefetch` leaves: a chained propose for sequences 0 and 2, k = 3, out unanswered;
        a Step sent instead (another batch) is answered the same."""
        conn = proposer._conn
        conn.drafts = SimpleNamespace(tensor=buffer)
        conn.offered, conn.done_sent, conn.sent_at = True, 5, time.perf_counter()
        _stand_in_done(conn, torch.zeros(1, 2, dtype=torch.int32))
        proposer._waits = SimpleNamespace(wait=lambda tensor, value, deadline: order.append(("wait", value)),
                                          failure=None, release=lambda: None) if waits else None
        answer = wire.StepResult(proposer._step_id, in_buffer=answer_rows)
        monkeypatch.setattr(proposer, "_receive", lambda conn, timeout: order.append("answer") or answer)
        proposer._send = lambda *args, **kwargs: order.append("send")
        proposer._chain_ahead = ((0, 2), 3, _feed_key(anchors), _feed_key(positions), conn, 0)
        proposer._unanswered = proposer._unanswered_chain = True
        return RemoteChainBatch(ids, (0,) * len(ids), conn)

    proposer = RemoteProposer(address, max_batch=4)
    try:
        batch = sent_ahead(proposer, ((0, 3), (2, 3)))
        got = proposer.chain_propose(batch, anchors, positions, 3)
        assert got.tolist() == buffer[:2, :3].tolist() and order == [("wait", 5), "read noted"]
        assert proposer._unanswered  # (not read: the verify launches first)
        proposer._live()  # the connection's next use reads it and finds it right
        assert order[2:] == ["answer"] and not proposer._unanswered and proposer._conn is not None
        assert proposer._chain_ahead_result is None and proposer._ahead_result is None  # (filed as nothing)
        assert (proposer.link.taken_unanswered, proposer.link.device_waits, proposer.link.chain_taken_ahead) == (1, 1, 1)

        order.clear()  # a request's attach queued on the stream since: taken all the same, the attach still queued
        batch = sent_ahead(proposer, ((0, 3), (2, 3)))
        assert proposer.attach_on_stream(7, 64, [3, 4], torch.zeros(2, proposer.spec.feature_dim))
        proposer.chain_propose(batch, anchors, positions, 3)
        assert order == [("wait", 5), "read noted"] and proposer.link.taken_unanswered == 2, order
        assert proposer._pending[7].attach is not None
        proposer._live()
        proposer._pending.clear()
        proposer._attaches.clear()

        order.clear()  # an answer for other sequences than the drafts taken: dropped when it is read
        batch = sent_ahead(proposer, ((0, 3),))
        proposer.chain_propose(batch, anchors, positions, 3)
        with pytest.raises(DrafterUnavailable, match="whose drafts were taken for other sequences"):
            proposer._live()
        assert proposer._conn is None and not proposer._unanswered and proposer._taken_unanswered is None
    finally:
        proposer._waits = None
        proposer.close()

    proposer = RemoteProposer(address, max_batch=4)  # a drop with the answer still out forgets the take
    try:
        batch = sent_ahead(proposer, ((0, 3), (2, 3)))
        proposer.chain_propose(batch, anchors, positions, 3)
        assert proposer._taken_unanswered is not None
        proposer.reset()
        assert proposer._taken_unanswered is None and not proposer._unanswered
    finally:
        proposer._waits = None
        proposer.close()

    cases = ("no device waits", "host asked to wait", "verbs queued", "watchdog gave up", "another batch",
             "another batch, host asked to wait")
    for case in cases:
        order.clear()
        proposer = RemoteProposer(address, max_batch=4)
        try:
            batch = sent_ahead(proposer, ((0, 3), (2, 3)), waits=case != "no device waits",
                               ids=(0, 1) if case.startswith("another batch") else (0, 2))
            if case.endswith("host asked to wait"):
                proposer.wait_on_host_next()
            if case == "verbs queued":
                proposer._chain_commit = ((0, 2), 4, 0)
            if case == "watchdog gave up":
                proposer._waits.failure = "a done value never came"
            try:
                proposer.chain_propose(batch, anchors, positions, 3)
            except DrafterUnavailable:  # (the watchdog's failure; another batch's answer does not fit it)
                assert case.startswith("another batch") or case == "watchdog gave up", case
            assert proposer.link.taken_unanswered == 0, case
            if case != "watchdog gave up":  # (that one drops the drafter before anything is read)
                assert order[0] == "answer", (case, order)
            assert ("send" in order) == (case.startswith("another batch") or case == "verbs queued"), (case, order)
            if case.endswith("host asked to wait"):  # the drafts used (or the Step sent instead's) waited on
                # our host, never our stream: work after them may load a kernel (Engine._quiesce)
                assert ("wait", 5) not in order and "host" in order, (case, order)
                assert not proposer._host_waits_next, case
        finally:
            proposer._waits = None
            proposer.close()


def test_a_chained_propose_sent_ahead_is_taken_for_the_rows_the_engine_names_and_nothing_else(pair, monkeypatch):
    """`RemoteProposer.chain_propose(..., ahead_rows)`: the propose sent ahead for sequences 0 and 2 with 3
    joining is taken, with no Step of its own, for a batch of some of them in any order, its drafts those
    rows of the drafts buffer, a free of another sequence queued meanwhile riding on the next Step. A Step
    goes instead (and its answer must fit the new batch) when the engine names no rows, rows of other
    sequences or rows past the propose, for another k, or with a verb queued for one of the batch's
    sequences. An answer that is not the whole propose sent ahead drops the drafter. (The drafts buffer is
    a stand-in: on the CPU the drafts come in the answer; tests/test_split_gpu.py runs the real one.)"""
    from types import SimpleNamespace

    from specsplit.target_service.drafter_client import RemoteChainBatch, _Pending, _feed_key

    _, _, address, _ = pair
    order: list = []
    monkeypatch.setattr(drafter_client, "_importer_done", lambda drafts, wait=0.0: True)
    monkeypatch.setattr(RemoteProposer, "_note_read", staticmethod(lambda conn: None))
    anchors, positions = torch.tensor([5, 6, 7]), torch.tensor([10, 11, 12])
    buffer = torch.arange(4 * 6, dtype=torch.int32).reshape(4, 6)

    def sent_ahead(proposer, answer_rows=((0, 3), (2, 3), (3, 3)), ids=(2, 3)):
        conn = proposer._conn
        conn.drafts = SimpleNamespace(tensor=buffer)
        conn.offered, conn.done_sent, conn.sent_at = True, 0, time.perf_counter()
        answer = wire.StepResult(proposer._step_id, in_buffer=answer_rows)
        monkeypatch.setattr(proposer, "_receive", lambda conn, timeout: answer)
        proposer._send = lambda *args, **kwargs: order.append("send")
        proposer._chain_ahead = ((0, 2, 3), 3, _feed_key(anchors), _feed_key(positions), conn, 0)
        proposer._unanswered = proposer._unanswered_chain = True
        return RemoteChainBatch(ids, (0,) * len(ids), conn)

    def propose(ids=(2, 3), rows=(1, 2), k=3, queued=None, answer_rows=((0, 3), (2, 3), (3, 3))):
        order.clear()
        proposer = RemoteProposer(address, max_batch=4)
        try:
            batch = sent_ahead(proposer, answer_rows, ids)
            if queued is not None:
                proposer._pending[queued[0]] = queued[1]
            try:
                got = proposer.chain_propose(batch, anchors[:len(ids)], positions[:len(ids)], k,
                                             None if rows is None else list(rows))
            except DrafterUnavailable:
                got = None  # (a Step's answer that does not fit: the stand-in answers the same each time)
            return got, list(order), proposer.link.chain_taken_regrouped, proposer._pending
        finally:
            proposer.close()

    got, sent, regrouped, _ = propose()
    assert got.tolist() == buffer[[1, 2], :3].tolist() and sent == [] and regrouped == 1
    got, sent, _, _ = propose(ids=(3, 0), rows=(2, 0))  # (any order)
    assert got.tolist() == buffer[[2, 0], :3].tolist() and sent == []
    got, sent, _, pending = propose(queued=(0, _Pending(free=True)))  # the ended sequence's free waits
    assert got.tolist() == buffer[[1, 2], :3].tolist() and sent == [] and pending[0].free
    for refused in (dict(rows=None), dict(rows=(0, 2)), dict(rows=(1, 7)), dict(rows=(1,)), dict(k=2),
                    dict(queued=(2, _Pending(free=True)))):
        got, sent, regrouped, _ = propose(**refused)
        assert sent == ["send"] and regrouped == 0, refused
    with pytest.raises(DrafterUnavailable, match="for other sequences"):
        proposer = RemoteProposer(address, max_batch=4)
        try:
            proposer.chain_propose(sent_ahead(proposer, ((0, 3), (2, 3))), anchors[:2], positions[:2], 3, [1, 2])
        finally:
            assert proposer._conn is None
            proposer.close()


@pytest.mark.slow  # (10-12 s on the CPU: the default run stays under five minutes)
def test_every_row_taken_from_a_propose_sent_ahead_was_sent_with_the_anchor_and_position_the_step_feeds(
        pair, tiny_chat_dir):
    """Requests greedy and sampled (a sampled one near its end sits a chained step out, then is back in the
    next), some ending at a stop string, arriving in waves through four slots: at every step that takes
    rows of the chained propose sent ahead, each sequence's anchor and position in the step's feed are
    those it was sent with (as one of the step's sequences, as attached since, or as back from sitting
    out, its values gathered from the step not read yet), the drafts and tokens are those of proposes
    sent as their own steps launch, and nothing falls back. The target's host waits for 4 Step answers
    (109 when only the same batch took them, 50 without the sequences coming back). (A sequence sent as
    attached while a step of its own was unread went with a stale anchor: the tokens stayed right, the
    verify being exact, the drafts did not.)"""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.sequence import Request

    target, _, address, _ = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    specs = [(27, 0.0, None), (52, 0.8, ["th"]), (60, 0.8, None), (29, 0.0, None), (45, 0.8, None), (36, 0.0, [" a"]),
             (70, 0.8, None), (31, 0.8, None), (41, 0.0, None)]

    def requests():
        return [Request(f"r{i}", tokenizer.encode(PROMPTS[i % len(PROMPTS)]),
                        SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=100 + i if t else None,
                                       stop_strings=stops or []))
                for i, (n, t, stops) in enumerate(specs)]

    def run(proposer):
        """Each request's tokens; the first three at once, the rest two at a time every few steps. (Attached by
        PrefillDrafter: on the Step stream a sequence joins when the answer carrying its attach is read, which
        comes a step later with proposes sent ahead; tests/test_stream_attach.py)"""
        engine = _engine(target, proposer, stream_attach=False)
        waiting, tokens = requests(), {}
        for step in itertools.count():
            if step == 0 or (step % 4 == 0 and waiting):
                for request in waiting[:3 if step == 0 else 2]:
                    engine.add(request)
                waiting = waiting[3 if step == 0 else 2:]
            for e in engine.step():
                tokens.setdefault(e.request_id, []).extend(e.token_ids)
            if not engine.has_work and not waiting:
                assert engine.counters.fallbacks == 0
                return tokens

    each = RemoteProposer(address, max_batch=4, chain_ahead=False)
    each_drafts = Recorded(each)
    try:
        want = run(each)
    finally:
        each.close()
    proposer = RemoteProposer(address, max_batch=4)
    sent_with: dict = {}  # the last propose sent ahead: each sequence's (anchor, position)
    wrong: list = []
    prefetch, propose = proposer.chain_prefetch, proposer.chain_propose

    def chain_prefetch(seq_ids, ahead, anchors, positions, k):
        sent = prefetch(seq_ids, ahead, anchors, positions, k)
        sent_with.clear()
        if sent is not None:
            sent_with.update(zip(sent, zip(anchors.tolist(), positions.tolist())))
        return sent

    def chain_propose(batch, anchors, positions, k, *ahead_rows):
        taken = proposer.link.chain_taken_ahead
        drafts = propose(batch, anchors, positions, k, *ahead_rows)
        if proposer.link.chain_taken_ahead > taken:
            wrong.extend((seq_id, sent_with.get(seq_id), fed) for seq_id, fed in
                         zip(batch.seq_ids, zip(anchors.tolist(), positions.tolist())) if sent_with.get(seq_id) != fed)
        return drafts

    proposer.chain_prefetch, proposer.chain_propose = chain_prefetch, chain_propose
    drafts = Recorded(proposer)
    try:
        assert run(proposer) == want
        assert not wrong, wrong[:5]
        assert drafts.drafts == each_drafts.drafts
        assert proposer.link.chain_taken_regrouped > 20 and len(proposer.link.step_seconds) <= 4
    finally:
        proposer.close()


@pytest.mark.slow  # (6 s on the CPU: the default run stays under five minutes)
def test_sampled_sequences_near_their_end_still_let_the_chained_propose_go_ahead(pair, tiny_chat_dir):
    """A sampled sequence offers the drafts a step-by-step step would (fewer near its end), so it leaves a
    chained step whose draft count it cannot know yet (Engine._chain_plan). The propose sent ahead still
    asks for it (its writes within what was reserved), and the next step takes the others' rows, or all of
    them: two seeded sampled requests wait for a Step answer at 4 steps of 79 (24 when a sequence that may
    not offer k drafts kept the propose from going ahead); their tokens and every draft are those of
    proposes sent as their own steps launch."""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.sequence import Request

    target, _, address, _ = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)

    def requests():
        return [Request(f"r{i}", tokenizer.encode(PROMPTS[i]), SamplingParams(max_tokens=80, ignore_eos=True,
                                                                              temperature=0.8, seed=i))
                for i in range(2)]

    runs = []
    for ahead in (False, True):
        proposer = RemoteProposer(address, max_batch=4, chain_ahead=ahead)
        drafts = Recorded(proposer)
        try:
            engine = _engine(target, proposer, stream_attach=False)  # (a unary attach, as the waits counted)
            events = engine.generate(requests())
            runs.append(({r: [t for e in evs for t in e.token_ids] for r, evs in events.items()}, drafts.drafts,
                         len(proposer.link.step_seconds), engine.counters))
        finally:
            proposer.close()
    (tokens, each, _, _), (ahead_tokens, taken, waited, counters) = runs
    assert ahead_tokens == tokens and taken == each
    assert counters.fallbacks == 0 and counters.chained > 60 and waited <= 4, (waited, counters.chained)
