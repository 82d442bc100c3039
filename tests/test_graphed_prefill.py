"""Short prompts prefilled through the static (on a GPU: captured) forwards, `EngineConfig.graphed_prefill`.

On the CPU the static forwards run eagerly (`Engine.graphed_prefill_forwards(use_graphs=False)`): the same
code the graphs capture, so these tests check the engine's use of them; the GPU tests of the step graphs
check the capture itself.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specsplit.drafter_service.checkpoint import random_drafter
from specsplit.local import target_head, target_info
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.tokenizer import Tokenizer
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.graphs import StepGraphs
from specsplit.target_service.model import load_target
from specsplit.target_service.sequence import Request

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "word " * 40, "Hello",
           "Once upon a time, in a small village by the sea,", "word " * 90, "Count: " + "one two " * 110]
LIMIT = 64  # graphed_prefill: the last two prompts are longer


@pytest.fixture(scope="module")
def target(tiny_chat_dir):
    return load_target(tiny_chat_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_dir):
    return Tokenizer.from_dir(tiny_chat_dir)


def requests(tokenizer, prompts=PROMPTS, max_tokens=24):
    return [Request(f"r{i}", tokenizer.encode(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]


def drafter(kind, target, static=False):
    if kind is None:
        return None
    made = random_drafter(kind, target_info(target), target_head(target), seed=0, dtype=torch.float32)
    if static:
        made.use_static_forwards(use_graphs=False)
    return made


class Watch:
    """Records the engine's prefill forwards, the short and long static ones and the eager ones: {seq_id:
    tokens} each."""

    def __init__(self, engine: Engine) -> None:
        self.short, self.long, self.eager = [], [], []
        self.per_step: list[tuple[int, int, int]] = []  # (short, long, eager) forwards, where a test counts them
        for forwards, log in ((engine.prefill_graphs.short, self.short), (engine.prefill_graphs.long, self.long)):
            if forwards is not None:
                forwards.forward = self._logged(forwards.forward, log)
        eager = engine._forward

        def eager_forward(seq_ids, inputs, starts, *, logits_last_only):
            if logits_last_only:  # (a prefill's: decode and verify forwards ask every row)
                self.eager.append(dict(zip(seq_ids, map(len, inputs))))
            return eager(seq_ids, inputs, starts, logits_last_only=logits_last_only)
        engine._forward = eager_forward

    @staticmethod
    def _logged(forward, log: list):
        def logged(step, *more):
            log.append(dict(zip(step.seq_ids, map(len, step.tokens))))
            return forward(step, *more)
        return logged

    @staticmethod
    def tokens(forwards: list[dict[int, int]]) -> dict[int, int]:
        total: dict[int, int] = {}
        for forward in forwards:
            for seq_id, n in forward.items():
                total[seq_id] = total.get(seq_id, 0) + n
        return total


def engine_for(target, proposer, *, graphed: int = LIMIT, steps_too: bool = False, **config) -> Engine:
    config.setdefault("prefill_chunk", 48)
    engine = Engine(target, proposer, EngineConfig(max_batch=4, graphed_prefill=graphed, **config))
    assert engine.prefill_graphs is None  # (no GPU: nothing captured)
    if graphed:
        engine.prefill_graphs = engine.graphed_prefill_forwards(use_graphs=False)
    if steps_too:  # the decode/verify steps over static forwards too: steps launched ahead, chained ones
        engine.graphs = StepGraphs(target, engine.cache, engine.capture, max_batch=4,
                                   query_lens=(1, engine._max_drafts() + 1), max_len=512, use_graphs=False)
    return engine


def tokens_of(events):
    return {rid: [t for e in evs for t in e.token_ids] for rid, evs in events.items()}


@pytest.mark.parametrize("kind, chunk", [
    ("dflash", 128),
    # (5 s each on the CPU; the default run stays under five minutes with one of them)
    *(pytest.param(kind, chunk, marks=pytest.mark.slow)
      for kind, chunk in ((None, 32), (None, 128), ("dflash", 32), ("mtp", 32), ("mtp", 128)))])
def test_prompts_go_in_through_the_static_forwards_and_change_no_token(kind, chunk, target, tokenizer):
    """Prompts with at most `graphed_prefill` tokens still to go in go in through the short static forwards
    (chunks of min(prefill_chunk, 64) tokens, up to four prompts a forward), longer ones alone through the
    long ones (chunks of prefill_chunk: 128 here) or, where prefill_chunk is no longer than the short
    chunk (32 here), eagerly until `graphed_prefill` tokens or fewer are left; one forward an engine step.
    Every request's tokens equal the all-eager run's, and the drafter gets the same rows."""
    reqs = requests(tokenizer)
    lengths = [len(r.prompt_ids) for r in reqs]  # (seq ids are 0, 1, ... in order)
    short = [i for i, n in enumerate(lengths) if n <= LIMIT]
    assert 2 < len(short) < len(reqs) and any(32 < lengths[i] for i in short)  # some take two chunks of 32
    assert any(lengths[i] > 128 for i in range(len(reqs)) if i not in short)  # one takes two long chunks

    def go(graphed):
        proposer = drafter(kind, target)
        engine = engine_for(target, proposer, graphed=graphed, prefill_chunk=chunk)
        rows = {}
        if proposer is not None:
            prefill = proposer.prefill

            def record(seq_id, token_ids, got, start_pos=0):
                rows[seq_id] = got.clone()
                return prefill(seq_id, token_ids, got, start_pos)
            proposer.prefill = record
        watch = Watch(engine) if graphed else None
        if watch is not None:  # how many forwards of each kind every engine step ran
            admit = engine._admit

            def counted():
                before = len(watch.short), len(watch.long), len(watch.eager)
                events = admit()
                watch.per_step.append(tuple(len(w) - b for w, b in zip((watch.short, watch.long, watch.eager), before)))
                return events
            engine._admit = counted
        out = tokens_of(engine.generate(reqs))
        # (the static forwards' scratch block, for padding rows, is one of the CPU cache's; a GPU engine adds it)
        assert not engine.running and engine.cache.num_free_blocks == engine.config.kv_blocks - bool(graphed)
        return out, rows, watch, engine

    eager, eager_rows, _, _ = go(0)
    graphed, graphed_rows, watch, engine = go(LIMIT)
    assert graphed == eager
    assert graphed_rows.keys() == eager_rows.keys() and len(eager_rows) == (0 if kind is None else len(reqs))
    for seq_id, rows in eager_rows.items():
        torch.testing.assert_close(graphed_rows[seq_id], rows, rtol=1e-4, atol=1e-4)
    forwards = engine.prefill_graphs
    assert forwards.short.query_lens == (min(chunk, 64),) and forwards.short.batches[-1] == 4
    assert (forwards.long is None) == (chunk == 32)
    short_in, long_in, eager_in = Watch.tokens(watch.short), Watch.tokens(watch.long), Watch.tokens(watch.eager)
    for i, n in enumerate(lengths):
        assert short_in.get(i, 0) + long_in.get(i, 0) + eager_in.get(i, 0) == n
        if i in short:  # through the short forwards alone
            assert short_in[i] == n
        elif chunk == 128:  # the long forwards, until what is left is short
            assert eager_in.get(i, 0) == 0 and long_in[i] == min(n, -(-(n - LIMIT) // 128) * 128)
        else:  # eagerly, until what is left is short
            assert long_in.get(i, 0) == 0 and eager_in[i] == -(-(n - LIMIT) // 32) * 32
    assert all(max(f.values()) <= min(chunk, 64) and len(f) <= 4 for f in watch.short)
    assert all(len(f) == 1 and max(f.values()) <= 128 for f in watch.long)
    assert all(max(f.values()) <= 32 for f in watch.eager)
    assert (watch.eager == []) == (chunk == 128)
    # an engine step: one eager forward, or at most one short and one long, a short prompt's chunk going
    # in beside a long prompt's (the first prompts wait behind no long one: admitted together, every short
    # prompt is in after its chunks' steps)
    assert all(e == 1 and s == lg == 0 or e == 0 and s <= 1 and lg <= 1 for s, lg, e in watch.per_step)
    if chunk == 128:
        assert any(s == lg == 1 for s, lg, _ in watch.per_step)
    assert engine.counters.graphed_prefills == len(watch.short) + len(watch.long)
    assert engine.counters.prefills == len(reqs)


@pytest.mark.parametrize("kind", [None, "dflash"])
def test_prompts_arriving_while_steps_run_ahead_go_in_between_them(kind, target, tokenizer):
    """With the decode/verify steps launched ahead (and DFlash's chained on the device), a prompt admitted
    while they run goes in through the static prefill forwards between two steps: every request's tokens
    equal its run alone, and the running ones emit at every step of the prefill. (The engine's side: on
    the CPU the static forwards allocate their outputs afresh, so buffer reuse and stream order are the
    GPU test's.)"""
    reqs = requests(tokenizer, [PROMPTS[0], PROMPTS[1], "Water boils at " * 6], max_tokens=30)
    alone = {r.request_id: tokens_of(engine_for(target, None, graphed=0).generate([r]))[r.request_id] for r in reqs}
    engine = engine_for(target, drafter(kind, target, static=True), steps_too=True, prefill_chunk=16)
    watch = Watch(engine)
    in_flight, forward = [], engine.prefill_graphs.short.forward

    def static_forward(step, *more):  # was a step launched ahead (target only) or chained (DFlash) unread?
        in_flight.append(engine._ahead is not None or engine._chain is not None)
        return forward(step, *more)
    engine.prefill_graphs.short.forward = static_forward
    late = reqs[2]
    assert len(late.prompt_ids) > 16  # two chunks at least
    emitted: dict[str, list[int]] = {}
    during = []
    arrivals = {0: reqs[0], 1: reqs[1], 3: late}
    for n in itertools.count():
        if n in arrivals:
            engine.add(arrivals[n])
        events = engine.step()
        for e in events:
            emitted.setdefault(e.request_id, []).extend(e.token_ids)
        if n >= 3 and late.request_id not in emitted:
            during.append({e.request_id for e in events})
        if not engine.has_work:
            break
    assert emitted == alone
    assert during and all({"r0", "r1"} <= got for got in during)  # the running ones did not wait
    assert in_flight[-len(during) - 1:] == [True] * (len(during) + 1)  # each of the late prompt's chunks
    assert (engine.counters.chained > 0) == (kind == "dflash")
    assert watch.eager == watch.long == [] and Watch.tokens(watch.short)[2] == len(late.prompt_ids)
    assert len(watch.short) >= 4


def test_graphed_prefill_is_checked():
    for bad in (-1, True, 1.5):
        with pytest.raises(InvalidRequest, match="graphed_prefill"):
            EngineConfig(graphed_prefill=bad)
    EngineConfig(graphed_prefill=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_prefill_on_the_gpu_changes_no_token(smollm2_dir):
    """On the GPU, prompts go in through captured prefill graphs, prompts admitted while others decode
    among them, and a 700-token one through the long forwards (512-token chunks): float32, target only
    and with the shipped DFlash drafter, every token equals the all-eager prefill's."""
    from specsplit.local import LocalSetup, make_drafter
    from specsplit.train_data import HELDOUT_PATH, read_prompts

    model = load_target(smollm2_dir, dtype=torch.float32, device="cuda")
    tok = Tokenizer.from_dir(smollm2_dir)
    dflash = make_drafter("dflash", model, LocalSetup(drafter="dflash", device="cuda", dtype="float32"))
    prompts = [p.encode(tok) for p in read_prompts(HELDOUT_PATH)[:10]]
    flat = [t for p in prompts for t in p]  # ten held-out prompts hold ~450 tokens: go round them
    long = [flat[i % len(flat)] for i in range(700)]  # (any tokens: the prefill's arithmetic is what is tested)
    prompts.insert(3, long)
    assert len(long) == 700

    def run(proposer, graphed):
        engine = Engine(model, proposer, EngineConfig(max_batch=3, graphed_prefill=graphed), eos_ids=tok.eos_token_ids)
        assert (engine.prefill_graphs is not None) == bool(graphed)
        watch = Watch(engine) if graphed else None
        events = engine.generate([Request(f"r{i}", p, SamplingParams(max_tokens=40)) for i, p in enumerate(prompts)])
        if graphed:  # the long prompt through the long forwards (512 + 188 tokens), the others the short ones
            assert engine.prefill_graphs.long.query_lens == (512,)
            assert Watch.tokens(watch.long) == {3: 700 - 188} and Watch.tokens(watch.short)[3] == 188
            assert watch.eager == []
        accepted = sum(evs[-1].stats.accepted for evs in events.values())
        return [[t for e in evs for t in e.token_ids] for evs in events.values()], accepted

    want, _ = run(None, 0)
    assert run(None, 256)[0] == want
    # with the drafter: the same tokens (greedy verification keeps them whatever the drafts), and about
    # as many drafts accepted as with eager prefill, so the drafter got the prompts' own rows (float32:
    # the rows agree to rounding; wrong or stale rows would draft far worse)
    eager_tokens, eager_accepted = run(dflash, 0)
    tokens, accepted = run(dflash, 256)
    assert tokens == eager_tokens == want
    assert accepted >= 0.9 * eager_accepted > 0


class LateDrafter:
    """A drafter that is down when the engine starts (no spec, not available) until `up` is set."""

    def __init__(self, inner) -> None:
        self.inner, self.up = inner, False

    @property
    def spec(self):
        return self.inner.spec if self.up else None

    def available(self) -> bool:
        return self.up

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_drafter_that_answers_late_gets_its_rows_from_the_static_prefill(target, tokenizer):
    """Issue 9's drafter down at start: the engine starts capturing no rows; once the drafter answers it
    captures what the drafter reads, in the prefill forwards too, so the next prompt's rows reach the
    drafter through them and that request speculates (before the fix the prefill forwards still captured
    nothing, the drafter got no rows and was detached)."""
    first, second = requests(tokenizer, PROMPTS[:2], max_tokens=20)
    want = {r.request_id: tokens_of(engine_for(target, None, graphed=0).generate([r]))[r.request_id]
            for r in (first, second)}
    late = LateDrafter(drafter("dflash", target))
    engine = engine_for(target, late)
    assert not engine.capture.layer_ids and engine.prefill_graphs.short.forwards[(1, 48)].capture == engine.capture
    got = engine.generate([first])
    assert got[first.request_id][-1].stats.drafted == 0  # (served alone)
    late.up = True
    got.update(engine.generate([second]))
    assert engine.capture.layer_ids and engine.counters.reattaches == 1
    assert all(f.capture == engine.capture for f in engine.prefill_graphs.short.forwards.values())
    assert tokens_of(got) == want
    assert got[second.request_id][-1].stats.drafted > 0 and engine.drafter_ok


@pytest.mark.parametrize("chunk", [pytest.param(32, marks=pytest.mark.slow), 128])  # (5 s each on the CPU)
def test_a_reattach_recomputes_the_rows_through_the_static_prefill(chunk, target, tokenizer):
    """After a drafter outage the engine rebuilds each running sequence's drafter state from its history's
    rows: through the static prefill forwards (long ones where there are, short ones otherwise), not
    eagerly; the rows equal the eager recompute's, and every token its uninterrupted run's."""
    reqs = requests(tokenizer, PROMPTS[:2] + ["word " * 50], max_tokens=40)
    want = tokens_of(engine_for(target, None, graphed=0).generate(reqs))

    def run(graphed):
        proposer = LateDrafter(drafter("dflash", target))  # (one that says when it is available)
        proposer.up = True
        engine = engine_for(target, proposer, graphed=graphed, prefill_chunk=chunk)
        watch = Watch(engine) if graphed else None
        rebuilt = {}
        prefill = proposer.prefill

        def record(seq_id, token_ids, rows, start_pos=0):
            if engine.counters.reattaches:  # (the re-attach's, not the first prefills')
                rebuilt[seq_id] = rows.clone()
            return prefill(seq_id, token_ids, rows, start_pos)
        proposer.prefill = record
        for r in reqs:
            engine.add(r)
        out: dict[str, list[int]] = {}
        for n in itertools.count():
            if n == 12:
                engine._detach()  # an outage, as a failing drafter verb causes; the next step re-attaches
            for e in engine.step():
                out.setdefault(e.request_id, []).extend(e.token_ids)
            if not engine.has_work:
                break
        assert engine.counters.reattaches == 1 and engine.drafter_ok
        return out, rebuilt, watch

    eager_out, eager_rows, _ = run(0)
    got, rows, watch = run(LIMIT)
    assert got == eager_out == want
    assert rows.keys() == eager_rows.keys() and len(rows) == 3
    for seq_id, r in rows.items():
        torch.testing.assert_close(r, eager_rows[seq_id], rtol=1e-4, atol=1e-4)
    used = watch.long if chunk == 128 else watch.short
    assert all(max(f.values()) <= (128 if chunk == 128 else 32) for f in used)
    assert sum(sum(f.values()) for f in used) >= sum(len(r) for r in rows.values())  # the re-attach's rows
    assert watch.eager == []


def test_a_long_forward_that_does_not_fit_leaves_longer_prompts_eager(target, tokenizer, monkeypatch, caplog):
    """If the long prefill forward's shape does not fit (out of device memory, or a Triton kernel out of
    resources for it: failures that leave CUDA as it was), the engine says so and sends longer prompts in
    eagerly; the short forwards still serve, and every token is the all-eager run's. Any other failure
    ends the engine's start (a capture that failed otherwise may leave CUDA in capture's state)."""
    reqs = requests(tokenizer)
    want = tokens_of(engine_for(target, None, graphed=0, prefill_chunk=128).generate(reqs))
    made = StepGraphs.__init__
    failure: list[Exception] = []

    def refuse_long(self, *args, query_lens, **kw):
        if query_lens == (128,):
            raise failure[0]
        made(self, *args, query_lens=query_lens, **kw)
    monkeypatch.setattr(StepGraphs, "__init__", refuse_long)

    class OutOfResources(Exception):  # (Triton's, by name: triton is not imported on the CPU path)
        pass

    for failed in (torch.OutOfMemoryError("no room for this graph"), OutOfResources("shared memory")):
        failure[:] = [failed]
        caplog.clear()
        with caplog.at_level("WARNING"):
            engine = engine_for(target, None, prefill_chunk=128)
        assert engine.prefill_graphs.long is None and "go in eagerly" in caplog.text
        watch = Watch(engine)
        assert tokens_of(engine.generate(reqs)) == want
        assert watch.short and watch.eager and watch.long == []
    failure[:] = [RuntimeError("operation failed due to a previous error during capture")]
    with pytest.raises(RuntimeError, match="during capture"):
        engine_for(target, None, prefill_chunk=128)
