"""Draft trees through the drafter service (ChainStep.tree_keep): the drafter answers each block row's best tokens,
the target grows, verifies and accepts the trees; the same tokens and steps as the in-process trees, and a target
asking for what the drafter cannot answer ends only its own connection."""

from __future__ import annotations

import time

import pytest
import torch

from specsplit.drafter_service.session import served_tree_keep
from specsplit.shared import frames, wire
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.tree import MAX_TREE_KEEP, TREE_KEEP
from specsplit.target_service.drafter_client import RemoteProposer
from specsplit.target_service.graphs import StepGraphs
from tests.test_remote_chain import _chained_once, _run, pair  # noqa: F401 (the fixture)

NODES, KEEP = 7, TREE_KEEP  # (the candidates a row the drafter serves)


def _engine(target, proposer, **config):
    from specsplit.target_service.engine import Engine, EngineConfig

    engine = Engine(target, proposer, EngineConfig(max_batch=4, **config))
    drafts = engine._max_drafts()
    engine.graphs = StepGraphs(target, engine.cache, engine.capture, max_batch=4, query_lens=(1, drafts + 1),
                               max_len=target.config.max_position_embeddings + drafts + 1, use_graphs=False,
                               tree_lens=(config["draft_tree"] + 1,) if config.get("draft_tree") else (),
                               tree_batch=config.get("draft_tree_batch"))
    return engine


def _recorded(proposer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every (logp, ids) `proposer.chain_candidates` returns from now on, copied."""
    seen, ask = [], proposer.chain_candidates

    def chain_candidates(*args):
        got = ask(*args)
        seen.append(tuple(t.clone() for t in got))
        return got

    proposer.chain_candidates = chain_candidates
    return seen


def _asks(proposer) -> list[tuple[str, tuple[int, ...]]]:
    """In order from now on: ("step", the sequences) of each `chain_candidates` call and ("ahead", the sequences) of
    each `chain_prefetch` that sent candidates ahead."""
    asks, candidates, prefetch = [], proposer.chain_candidates, proposer.chain_prefetch

    def chain_candidates(batch, *args):
        asks.append(("step", tuple(batch.seq_ids)))
        return candidates(batch, *args)

    def chain_prefetch(*args):
        sent = prefetch(*args)
        if sent is not None:
            asks.append(("ahead", tuple(sent)))
        return sent

    proposer.chain_candidates, proposer.chain_prefetch = chain_candidates, chain_prefetch
    return asks


def test_candidates_in_the_drafts_buffer_are_taken_by_the_rows_asked_for():
    """A batch that changed takes its sequences' rows of the candidates sent ahead (`taken`, in the step's order):
    each row's ids, then its log-probabilities' float32 bits, gathered; none given or the first rows in order
    read the first n rows as they lie."""
    import types

    rows, keep, n_rows = 3, 2, 4
    cut = rows * keep
    ids = torch.arange(n_rows * cut, dtype=torch.int32).view(n_rows, cut)
    logp = -torch.rand(n_rows, cut)
    buffer = torch.cat([ids, logp.view(torch.int32)], dim=1)
    conn = types.SimpleNamespace(drafts=types.SimpleNamespace(tensor=buffer))
    notes = []
    me = types.SimpleNamespace(_note_read=notes.append, link=types.SimpleNamespace(drafts_on_device=0))
    for taken in ([2, 0], [1, 2, 3], [0, 1], None):
        n = len(taken) if taken is not None else 3
        index = taken if taken is not None else list(range(n))
        got_logp, got_ids = RemoteProposer._candidates_in_buffer(me, conn, n, rows, keep, None, taken)
        assert torch.equal(got_ids, ids[index].to(torch.int64).view(n, rows, keep))
        assert torch.equal(got_logp, logp[index].view(n, rows, keep))
    assert len(notes) == 4 and me.link.drafts_on_device == 2 + 3 + 2 + 3


def _tree_steps(engine) -> int:
    return sum(1 for key in engine._chain_programs if key[2])


_SLOW = pytest.mark.slow  # (4-6 s each on the CPU: the default run keeps the captured one, as a GPU serves)


@pytest.mark.parametrize("captured, nodes, ahead, regroup", [
    (True, NODES, False, False), pytest.param(False, NODES, False, False, marks=_SLOW),
    pytest.param(True, 2 * NODES - 1, False, False, marks=_SLOW), pytest.param(False, 2 * NODES - 1, False, False, marks=_SLOW),
    pytest.param(True, NODES, True, True, marks=_SLOW), pytest.param(False, 2 * NODES - 1, True, True, marks=_SLOW),
    pytest.param(True, NODES, True, False, marks=_SLOW)],
    ids=["as-tail", "verb-by-verb", "wider-than-rows-as-tail", "wider-than-rows-verb-by-verb", "sent-ahead-as-tail",
         "sent-ahead-wider-verb-by-verb", "sent-ahead-same-batch-only"])
def test_trees_through_the_services_equal_the_in_process_trees_and_target_only(pair, tiny_chat_dir, captured, nodes,
                                                                               ahead, regroup):
    """Each chained tree step asks the drafter service for its rows' candidates (answered inline on the CPU) and
    grows, verifies and accepts its trees here (`chain_capture_remote`: as the tail a graph would hold, or
    uncaptured, verb by verb): every candidate, every token and every step the in-process trees', and the tokens
    target-only decoding's, a request joining mid-run included; nothing stays allocated on either side. Trees of
    as many nodes as the drafter's 7 rows, and of 13 (wider, no deeper: each commit still holds at most 8 rows).
    With `trees_ahead` the next tree step's candidates are asked for as each step launches, and taken by the next
    step (most steps here) instead of a Step of its own; with `tree_regroup`, when the batch changed too, the rows
    of its sequences (and a sequence joining is asked for ahead)."""
    from specsplit.shared.tokenizer import Tokenizer

    target, local, address, remote = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    alone = _run(_engine(target, None, chain_steps=False), tokenizer)
    trees = dict(draft_tree=nodes, draft_tree_keep=KEEP)
    here = _recorded(local)
    widths, commit = [], local.chain_commit
    local.chain_commit = lambda batch, rows, at, width: widths.append(width) or commit(batch, rows, at, width)
    in_process = _engine(target, local, **trees)
    want = _run(in_process, tokenizer)
    proposer = RemoteProposer(address, max_batch=4, tree_keep=KEEP, trees_ahead=ahead)
    try:
        assert proposer.tree_candidates
        there = _recorded(proposer)
        asked = _asks(proposer)
        # (attached by PrefillDrafter, as the in-process drafter attaches: a request attached on the Step stream
        # joins a step later, so the steps' candidates would differ from the in-process ones from there)
        through = _engine(target, proposer, chain_capture_remote=captured, stream_attach=False, tree_regroup=regroup,
                          **trees)
        got = _run(through, tokenizer)
        assert got == want == alone
        # every step's candidates, as the engine got them: the in-process drafter's, ids and log-probabilities
        assert len(there) == len(here) > 10
        for (logp, ids), (want_logp, want_ids) in zip(there, here):
            assert torch.equal(ids, want_ids) and torch.allclose(logp, want_logp, atol=1e-5)
        assert _tree_steps(through) > 0 and through.counters.fallbacks == 0 and through.drafter_ok
        assert through.counters.chained == in_process.counters.chained > 10
        assert {key[1:] for key in through._chain_programs if key[2]} == {(nodes, local.spec.max_drafts)}
        assert set(widths) == {min(nodes, local.spec.max_drafts) + 1}  # (the in-process trees' commits)
        taken, regrouped = proposer.link.chain_taken_ahead, proposer.link.chain_taken_regrouped
        assert (taken > len(there) // 2) if ahead else taken == 0, (taken, len(there))
        # (requests ending and one joining: those steps took the rows sent ahead for their sequences; the one
        # joining was asked for ahead, beside the step's own, as the step before it launched)
        assert (regrouped > 0) if regroup else regrouped == 0, regrouped
        joined = any(then == "ahead" and set(ids) > set(before)
                     for (was, before), (then, ids) in zip(asked, asked[1:]) if was == "step")
        assert joined == regroup, asked
        proposer.flush()
        assert len(remote.store) == 0 and remote.pool.num_free_blocks == remote.pool.num_blocks
        assert through.cache.num_free_blocks == through.cache.num_blocks - 1  # all but the scratch block
    finally:
        proposer.close()


def test_trees_through_the_services_stop_at_the_tree_batch(pair, tiny_chat_dir):
    """`draft_tree_batch` 1: the steps of several sequences chain as chains through the service, the one left
    alone at the end grows trees; every token still target-only decoding's."""
    from specsplit.shared.tokenizer import Tokenizer

    target, _, address, _ = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    alone = _run(_engine(target, None, chain_steps=False), tokenizer, lengths=(10, 12, 40))
    proposer = RemoteProposer(address, max_batch=4, tree_keep=KEEP)
    try:
        through = _engine(target, proposer, draft_tree=NODES, draft_tree_keep=KEEP, draft_tree_batch=1)
        assert _run(through, tokenizer, lengths=(10, 12, 40)) == alone
        keys = set(through._chain_programs)
        assert {key[2] for key in keys if key[0] > 1} == {0} and {key[2] for key in keys if key[0] == 1} == {NODES}
    finally:
        proposer.close()


@pytest.mark.slow  # (6-7 s on the CPU: the default run stays under five minutes)
def test_a_target_without_tree_keep_or_a_drafter_without_candidates_chains_as_chains(pair, tiny_chat_dir):
    """A RemoteProposer made without tree_keep offers no candidates: the engine's tree steps chain as chains
    (the same tokens). A tree_keep out of range is refused where the proposer is made."""
    from specsplit.shared.tokenizer import Tokenizer

    target, _, address, _ = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    alone = _run(_engine(target, None, chain_steps=False), tokenizer)
    proposer = RemoteProposer(address, max_batch=4)
    try:
        assert not proposer.tree_candidates
        through = _engine(target, proposer, draft_tree=NODES, draft_tree_keep=KEEP)
        assert _run(through, tokenizer) == alone
        assert _tree_steps(through) == 0 and through.counters.chained > 10 and through.drafter_ok
    finally:
        proposer.close()
    for bad in (-1, 1025, True, 2.0):
        with pytest.raises(InvalidRequest, match="tree_keep"):
            RemoteProposer(address, tree_keep=bad)
    # asking for other than what the drafter serves, or than the engine's trees want: chains, nothing detached
    for asked, wanted in ((KEEP // 2, KEEP // 2), (KEEP, KEEP // 2)):
        proposer = RemoteProposer(address, max_batch=4, tree_keep=asked)
        try:
            assert proposer.tree_candidates == (asked == KEEP)
            through = _engine(target, proposer, draft_tree=NODES, draft_tree_keep=wanted)
            assert _run(through, tokenizer) == alone
            assert _tree_steps(through) == 0 and through.counters.fallbacks == 0 and through.drafter_ok
        finally:
            proposer.close()


@pytest.mark.parametrize("fields", [dict(tree_keep=-1), dict(tree_keep=1025), dict(tree_keep=4)])
def test_a_malformed_tree_ask_is_refused_as_it_is_parsed(fields):
    """tree_keep is 0..1024 and goes with a propose (here there is none)."""
    with pytest.raises(InvalidRequest, match="tree_keep"):
        wire.ChainStep(**fields)


@pytest.mark.parametrize("keep, vocab", [(-1, 100), (1025, 5000), (9, 8)])
def test_a_drafter_description_offering_impossible_candidates_is_refused(keep, vocab):
    """A drafter's description is a peer's bytes too: its tree_keep is 0..1024 and at most its vocabulary."""
    from specsplit.protos.v1 import drafter_pb2

    pb = drafter_pb2.DrafterDescription(hidden_size=8, vocab_size=vocab, max_drafts=3, max_batch=2, tree_keep=keep)
    with pytest.raises(InvalidRequest, match="tree_keep"):
        wire.description_from_proto(pb)


@pytest.mark.parametrize("keep", [MAX_TREE_KEEP + 1, -3, "no propose", KEEP // 2, KEEP + 1])
def test_a_tree_ask_the_drafter_cannot_answer_ends_only_that_connection(pair, keep):
    """A Step asking for candidates beyond tree_keep's range (its bytes, past our own wire checks) is refused as it
    is parsed (INVALID_ARGUMENT) and ends only that target's stream; one asking for candidates with no propose
    too, and one asking for other than the drafter serves (its top-k is built for that one value) as it runs.
    Another target connected all along goes on getting its candidates, and the drafter serves the next."""
    target, _, address, remote = pair
    vocab = remote.spec.vocab_size
    innocent = RemoteProposer(address, max_batch=4, tree_keep=KEEP)
    innocent_batch = _chained_once(innocent, vocab)
    proposer = RemoteProposer(address, max_batch=4, tree_keep=KEEP)
    try:
        _chained_once(proposer, vocab)
        conn = proposer._conn
        proposer._write_feed(conn, 1, torch.tensor([3, 4]))
        proposer._write_feed(conn, 2, torch.tensor([6, 6]))
        conn.feed.record()
        feed = conn.feed.ref(0, 3)
        chain = wire.ChainStep(seq_ids=(1, 2), ahead=(0, 0), num_drafts=3, feed=feed, tree_keep=2)
        proposer._step_id += 1
        pb = wire.step_to_proto(wire.StepBatch(proposer._step_id, chain=chain), columns=True)
        pb.chain.tree_keep = KEEP if keep == "no propose" else keep
        if keep == "no propose":  # (in range, but with nothing to propose: no sequences, no drafts)
            del pb.chain.seq_ids[:], pb.chain.ahead[:]
            pb.chain.num_drafts = 0
        frames.send_frame(conn.sock, pb.SerializeToString())
        with pytest.raises(InvalidRequest, match="tree_keep"):
            proposer._answer(conn, 10.0)
        logp, ids = innocent.chain_candidates(innocent_batch, torch.tensor([3, 4]), torch.tensor([6, 6]), KEEP)
        assert logp.shape == ids.shape == (2, remote.spec.max_drafts, KEEP) and logp.dtype == torch.float32
        assert bool((ids >= 0).all() and (ids < vocab).all()) and bool((logp.diff(dim=2) <= 0).all())
    finally:
        proposer.close()
        innocent.close()
    again = RemoteProposer(address, max_batch=4, tree_keep=KEEP)
    try:
        logp, ids = again.chain_candidates(_chained_once(again, vocab), torch.tensor([3, 4]), torch.tensor([6, 6]),
                                           KEEP)
        assert ids.shape == (2, remote.spec.max_drafts, KEEP)
        with pytest.raises(ValueError, match="candidates a row"):
            again.chain_candidates(again.chain_batch([1, 2], [0, 0]), torch.tensor([3, 4]), torch.tensor([6, 6]), 3)
    finally:
        again.close()


def test_a_drafter_without_candidates_is_not_asked_for_trees_and_refuses_them(pair, tiny_chat_dir, monkeypatch):
    """A drafter that offers no candidates (DrafterDescription.tree_keep 0: MTP, or here a DFlash drafter told so)
    is not asked for trees: the engine's tree steps chain as chains, every token target-only's. Asked all the
    same (a peer's bytes), it refuses with FAILED_PRECONDITION, ending only that target's stream."""
    from specsplit.drafter_service import server, session
    from specsplit.drafter_service.checkpoint import random_drafter
    from specsplit.local import target_head, target_info
    from specsplit.shared.errors import StateConflict
    from specsplit.shared.tokenizer import Tokenizer

    target, local, address, remote = pair
    mtp = random_drafter("mtp", target_info(target), target_head(target), seed=0, dtype=torch.float32)
    assert served_tree_keep(mtp) == 0 and served_tree_keep(local) == KEEP
    monkeypatch.setattr(server, "served_tree_keep", lambda proposer: 0)
    monkeypatch.setattr(session, "served_tree_keep", lambda proposer: 0)
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    alone = _run(_engine(target, None, chain_steps=False), tokenizer)
    proposer = RemoteProposer(address, max_batch=4, tree_keep=KEEP)
    try:
        assert proposer._conn is not None and not proposer.tree_candidates
        through = _engine(target, proposer, draft_tree=NODES, draft_tree_keep=KEEP)
        assert _run(through, tokenizer) == alone
        assert _tree_steps(through) == 0 and through.counters.chained > 10 and through.counters.fallbacks == 0
        proposer._conn.tree_candidates = True  # (as if it had said otherwise)
        with pytest.raises(StateConflict, match="offers no draft-tree candidates"):
            proposer.chain_candidates(_chained_once(proposer, remote.spec.vocab_size), torch.tensor([3, 4]),
                                      torch.tensor([6, 6]), KEEP)
    finally:
        proposer.close()


def test_a_drafter_answering_a_tree_without_its_candidates_is_dropped_and_no_token_is_lost(pair, tiny_chat_dir,
                                                                                         monkeypatch):
    """A drafter whose answer to a tree's ask holds too few candidates is dropped (DrafterUnavailable in
    `chain_candidates`); the engine detaches it and decodes on as target-only decoding would."""
    from specsplit.drafter_service import session
    from specsplit.shared.proposer import Proposal
    from specsplit.shared.tokenizer import Tokenizer

    target, _, address, _ = pair
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    alone = _run(_engine(target, None, chain_steps=False), tokenizer)
    real = session.Session._chain_propose
    calls = []

    def short(self, chain, drafts_buffer):
        in_buffer, proposals = real(self, chain, drafts_buffer)
        calls.append(chain.tree_keep)
        if chain.tree_keep and len(calls) > 3:
            proposals = {seq_id: Proposal(tokens=p.tokens[:-1], confidence=p.confidence[:-1])
                         for seq_id, p in proposals.items()}
        return in_buffer, proposals

    monkeypatch.setattr(session.Session, "_chain_propose", short)
    proposer = RemoteProposer(address, max_batch=4, tree_keep=KEEP)
    try:
        through = _engine(target, proposer, draft_tree=NODES, draft_tree_keep=KEEP)
        assert _run(through, tokenizer) == alone
        assert through.counters.fallbacks >= 1 and calls.count(KEEP) > 3
    finally:
        proposer.close()


def test_with_device_waits_a_trees_candidates_sent_ahead_are_taken_before_their_answer_only_as_candidates(
        pair, monkeypatch):
    """`trees_ahead` with device waits: the candidates a tree step asked for as the step before launched are taken
    by `chain_candidates` for the same sequences, rows and feed before their answer is read (our stream first
    waiting for the propose's done value), ids and log-probabilities read from the drafts buffer as the drafter
    wrote them; the answer is read by the connection's next use and checked then. A chain's propose for the same
    sequences and k never takes them as drafts (the answer is read first, and a Step of its own goes), nor does a
    tree ask for other sequences (a Step of its own goes, which the stand-in answers as it answered the first: for
    other sequences than it asked for, so the drafter is dropped). (Stand-in buffers, as the chains' test in
    tests/test_remote_chain.py; the real ones are GPU-only: tests/test_split_gpu.py.)"""
    from types import SimpleNamespace

    from specsplit.shared.errors import DrafterUnavailable
    from specsplit.target_service import drafter_client
    from specsplit.target_service.drafter_client import RemoteChainBatch, _feed_key

    _, local, address, _ = pair
    rows, keep = local.spec.max_drafts, KEEP
    cut = rows * keep
    order: list = []
    monkeypatch.setattr(drafter_client, "_importer_done", lambda drafts, wait=0.0: order.append("host") or True)
    monkeypatch.setattr(RemoteProposer, "_note_read", staticmethod(lambda conn: order.append("read noted")))
    anchors, positions = torch.tensor([5, 6]), torch.tensor([10, 11])
    ids = torch.arange(2 * cut, dtype=torch.int32).reshape(2, cut) % 97
    logp = -torch.rand(2, cut)
    buffer = torch.zeros(4, 2 * cut, dtype=torch.int32)
    buffer[:2, :cut], buffer[:2, cut:] = ids, logp.view(torch.int32)

    def sent_ahead(proposer, answer_rows, *, ask_ids=(0, 2)):
        """The state `chain_prefetch(..., tree_keep)` leaves: candidates for sequences 0 and 2, out unanswered."""
        conn = proposer._conn
        conn.drafts, conn.tree_candidates = SimpleNamespace(tensor=buffer), True
        conn.offered, conn.done_sent, conn.sent_at = True, 5, time.perf_counter()
        proposer._waits = SimpleNamespace(wait=lambda tensor, value, deadline: order.append(("wait", value)),
                                          failure=None, release=lambda: None)
        conn.done_flags = (None,)
        answer = wire.StepResult(proposer._step_id, in_buffer=answer_rows)
        monkeypatch.setattr(proposer, "_receive", lambda conn, timeout: order.append("answer") or answer)
        monkeypatch.setattr(proposer, "_check_rows", lambda conn, answer: None)
        proposer._send = lambda *args, **kwargs: order.append("send")
        proposer._chain_ahead = ((0, 2), rows, _feed_key(anchors), _feed_key(positions), conn, keep)
        proposer._unanswered = proposer._unanswered_chain = True
        return RemoteChainBatch(ask_ids, (0,) * len(ask_ids), conn)

    want = ((0, rows), (2, rows))
    for ask in ("candidates", "candidates into the engine's", "a chain's drafts", "candidates for others"):
        order.clear()
        proposer = RemoteProposer(address, max_batch=4, tree_keep=keep, trees_ahead=True)
        try:
            proposer._live()
            batch = sent_ahead(proposer, want, ask_ids=(0, 1) if ask == "candidates for others" else (0, 2))
            if ask.startswith("candidates into"):  # (the engine's graph inputs, filled straight from the buffer)
                into = torch.full((2, rows, keep), 9.0), torch.full((2, rows, keep), -1, dtype=torch.int64)
                for wrong in ((into[0], into[1][:1]), (into[0].double(), into[1])):
                    with pytest.raises(ValueError, match="go into"):
                        proposer.chain_candidates(batch, anchors, positions, keep, wrong)
                got = proposer.chain_candidates(batch, anchors, positions, keep, into)
                assert got[0] is into[0] and got[1] is into[1] and order == [("wait", 5), "read noted"]
                assert torch.equal(into[1], ids.long().view(2, rows, keep))
                assert torch.equal(into[0], logp.view(2, rows, keep))
            elif ask == "candidates":
                got_logp, got_ids = proposer.chain_candidates(batch, anchors, positions, keep)
                assert order == [("wait", 5), "read noted"] and proposer._unanswered  # (read after the verify)
                assert torch.equal(got_ids, ids.long().view(2, rows, keep))
                assert torch.equal(got_logp, logp.view(2, rows, keep))
                proposer._live()  # the connection's next use reads the answer and finds it right
                assert order[2:] == ["answer"] and proposer._conn is not None
                assert (proposer.link.taken_unanswered, proposer.link.chain_taken_ahead) == (1, 1)
            elif ask == "a chain's drafts":  # (the stand-in answers the Step sent instead as it answered the first)
                proposer.chain_propose(batch, anchors, positions, rows)
                assert [o for o in order if o in ("answer", "send")][:3] == ["answer", "send", "answer"], order
                assert proposer.link.taken_unanswered == proposer.link.chain_taken_ahead == 0
            else:
                with pytest.raises(DrafterUnavailable, match="other sequences"):  # (the answer, for 0 and 2)
                    proposer.chain_candidates(batch, anchors, positions, keep)
                assert [o for o in order if o in ("answer", "send")][:2] == ["answer", "send"], order
                assert proposer.link.taken_unanswered == 0
        finally:
            proposer._waits = None
            proposer.close()
