"""The in-process engine is lossless: greedy speculative output == target-only output, token for token.

The engine runs on a tiny random target that speaks the default model's tokenizer (tests/conftest.py):
losslessness, stop strings and failover hold for any weights. The shipped drafters, trained for the
default model, are checked on it.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from specsplit.drafter_service.checkpoint import random_drafter
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.proposer import Proposal
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.tokenizer import Tokenizer
from specsplit.local import target_head, target_info
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.model import load_target
from specsplit.target_service.sequence import FinishReason, Request, Sequence
from tests.oracle import OracleDrafter

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def target(tiny_chat_dir):
    return load_target(tiny_chat_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_dir):
    return Tokenizer.from_dir(tiny_chat_dir)


def requests(tokenizer, prompts=PROMPTS, **params):
    params.setdefault("max_tokens", MAX_TOKENS)
    params.setdefault("ignore_eos", True)
    return [Request(f"r{i}", tokenizer.encode(p), SamplingParams(**params)) for i, p in enumerate(prompts)]


def run(target, proposer, reqs, **config):
    engine = Engine(target, proposer, EngineConfig(**config))
    events = engine.generate(reqs)
    tokens = {rid: [t for e in evs for t in e.token_ids] for rid, evs in events.items()}
    stats = {rid: evs[-1].stats for rid, evs in events.items()}
    assert not engine.running and not engine.waiting
    return tokens, stats


@pytest.fixture(scope="module")
def reference(target, tokenizer):
    tokens, stats = run(target, None, requests(tokenizer))
    for s in stats.values():
        assert s.tau == pytest.approx(1.0) and s.drafted == 0
    return tokens


def drafter(kind, target, **kw):
    return random_drafter(kind, target_info(target), target_head(target), seed=0, dtype=torch.float32, **kw)


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
@pytest.mark.parametrize("batched", [True, False])
def test_random_drafter_is_lossless(kind, batched, target, tokenizer, reference):
    reqs = requests(tokenizer)
    tokens, stats = run(target, drafter(kind, target), reqs if batched else reqs[:1],
                        max_batch=4 if batched else 1)
    for rid, toks in tokens.items():
        assert toks == reference[rid]
        assert stats[rid].drafted > 0


@pytest.mark.parametrize("batched", [True, False])
def test_oracle_drafter_hits_long_runs_partial_accepts_and_slides(batched, target, tokenizer, reference):
    reqs = requests(tokenizer)
    continuations = {tuple(r.prompt_ids): r.prompt_ids + reference[r.request_id] for r in reqs}
    inner = drafter("dflash", target, block_size=8, window=12)
    oracle = OracleDrafter(inner, continuations, mistake_rate=0.08)
    tokens, stats = run(target, oracle, reqs, max_batch=4 if batched else 1)
    assert tokens == reference
    for s in stats.values():
        assert s.accepted > s.drafted // 2  # long accepted runs
        assert s.accepted < s.drafted  # and rejections
        assert s.tau > 2.0
    prompt_rows = max(len(r.prompt_ids) for r in reqs)
    assert prompt_rows + MAX_TOKENS > 12  # the 12-row window slid


@pytest.fixture(scope="module")
def smollm2_reference(smollm2, smollm2_tokenizer):
    return run(smollm2, None, requests(smollm2_tokenizer))[0]


@pytest.mark.slow  # ~20 s on 2 cores; the default run checks the shipped DFlash drafter in test_split
@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_shipped_drafters_load_and_are_lossless(kind, smollm2, smollm2_tokenizer, smollm2_reference):
    from specsplit.local import LocalSetup, make_drafter

    proposer = make_drafter(kind, smollm2, LocalSetup(drafter=kind))
    tokens, stats = run(smollm2, proposer, requests(smollm2_tokenizer), max_batch=4)
    assert tokens == smollm2_reference
    if kind == "dflash":
        assert sum(s.accepted for s in stats.values()) > 0  # trained: it does accept drafts


def test_sampling_is_seeded_and_reproducible(target, tokenizer):
    reqs = requests(tokenizer, prompts=PROMPTS[:2], temperature=0.8, top_p=0.9, seed=7, max_tokens=16)
    first, _ = run(target, drafter("dflash", target), reqs, max_batch=4)
    again, _ = run(target, drafter("dflash", target), requests(
        tokenizer, prompts=PROMPTS[:2], temperature=0.8, top_p=0.9, seed=7, max_tokens=16))
    assert first == again


def test_eos_and_stop_strings(target, tokenizer, reference):
    stop_token = reference["r0"][5]
    reqs = [Request("a", tokenizer.encode(PROMPTS[0]),
                    SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop_token,), ignore_eos=True))]
    engine = Engine(target, drafter("dflash", target), eos_ids=tokenizer.eos_token_ids, text_stream=tokenizer.stream)
    events = engine.generate(reqs)["a"]
    toks = [t for e in events for t in e.token_ids]
    assert toks == reference["r0"][: reference["r0"].index(stop_token) + 1]
    assert events[-1].finish_reason is FinishReason.STOP

    full_text = tokenizer.decode(reference["r0"])
    stop = full_text[10:14]
    reqs = [Request("b", tokenizer.encode(PROMPTS[0]),
                    SamplingParams(max_tokens=MAX_TOKENS, stop_strings=(stop,), ignore_eos=True))]
    events = engine.generate(reqs)["b"]
    text = "".join(e.text_delta for e in events)
    assert text == full_text[: full_text.find(stop)]
    assert events[-1].finish_reason is FinishReason.STOP


def _reference_stop(tokenizer, tokens, stops):
    """The plain definition: the shortest token prefix whose text holds a stop, text cut before it."""
    for n in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return tokens[:n], text[: min(hits)]
    return tokens, tokenizer.decode(tokens)


def test_incremental_text_and_stop_strings_match_plain_decoding(target, tokenizer, reference):
    """Stops of every length, across token boundaries, several per request, with many tokens per step."""
    reqs = requests(tokenizer)
    continuations = {tuple(r.prompt_ids): r.prompt_ids + reference[r.request_id] for r in reqs}
    oracle = OracleDrafter(drafter("dflash", target, block_size=8), continuations, mistake_rate=0.05)
    engine = Engine(target, oracle, EngineConfig(max_batch=3), text_stream=tokenizer.stream)
    full = {rid: tokenizer.decode(toks) for rid, toks in reference.items()}
    cases = [(), (full["r0"][11:12],), (full["r1"][6:9], "\u00a7never"), (full["r2"][20:26],),
             ("zz-not-there", full["r0"][30:32], full["r0"][25:27])]
    for stops in cases:
        reqs = requests(tokenizer, stop_strings=stops)
        events = engine.generate(reqs)
        for r in reqs:
            tokens = [t for e in events[r.request_id] for t in e.token_ids]
            text = "".join(e.text_delta for e in events[r.request_id])
            want_tokens, want_text = _reference_stop(tokenizer, reference[r.request_id], stops)
            assert (tokens, text) == (want_tokens, want_text), (stops, r.request_id)
            finish = events[r.request_id][-1].finish_reason
            hit = any(s in full[r.request_id] for s in stops)
            assert finish is (FinishReason.STOP if hit else FinishReason.LENGTH)
    assert not engine.running


class _CutCharacter:
    """A detokenizer whose last token leaves a character unfinished: push gives '', flush U+FFFD."""

    def push(self, token_id: int) -> str:
        return "ab" if token_id == 5 else ""

    def flush(self) -> str:
        return "\ufffd"


@pytest.mark.parametrize("stops, text, finish", [((), "ab\ufffd", FinishReason.LENGTH),
                                                 (("b\ufffd",), "a", FinishReason.STOP)])
def test_text_flushed_at_the_end_is_checked_for_stops(target, stops, text, finish):
    engine = Engine(target, None, text_stream=_CutCharacter)
    params = SamplingParams(max_tokens=2, stop_strings=stops, ignore_eos=True)
    seq = Sequence(0, Request("a", [1, 2], params), torch.Generator(), frozenset(), [1, 2, 5],
                   detok=_CutCharacter())
    emitted = engine._text_delta(seq, [5])
    seq.tokens.append(7)
    seq.finish_reason = FinishReason.LENGTH  # the request ends on a token that leaves a character open
    emitted += engine._text_delta(seq, [7])
    assert (emitted, seq.finish_reason) == (text, finish)


def test_bad_requests_are_refused(target, tokenizer):
    engine = Engine(target, None)
    with pytest.raises(InvalidRequest):
        engine.add(Request("x", [], SamplingParams()))
    with pytest.raises(InvalidRequest):
        engine.add(Request("x", [10**9], SamplingParams()))
    with pytest.raises(InvalidRequest):
        engine.add(Request("x", [1], SamplingParams(max_tokens=10**6)))
    engine.add(Request("x", [1, 2], SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidRequest):
        engine.add(Request("x", [1, 2], SamplingParams(max_tokens=2)))


class FlakyDrafter:
    """Delegates to a real drafter but raises from propose after `fail_after` calls."""

    def __init__(self, inner, fail_after):
        self.inner, self.spec, self.calls, self.fail_after = inner, inner.spec, 0, fail_after
        self.up = False

    def propose(self, requests):
        self.calls += 1
        if self.calls > self.fail_after and not self.up:
            raise ConnectionError("drafter went away")
        return self.inner.propose(requests)

    def available(self):
        return self.up

    def __getattr__(self, name):
        return getattr(self.inner, name)


class MisbehavingDrafter:
    """Delegates to a real drafter; `propose_bad` spoils its answers, `refuse` makes prefill refuse
    the sequences whose first prompt token is in it."""

    def __init__(self, inner, propose_bad=None, refuse=()):
        self.inner, self.spec, self.propose_bad, self.refuse = inner, inner.spec, propose_bad, set(refuse)

    def propose(self, requests):
        proposals = self.inner.propose(requests)
        return [self.propose_bad(r, p) for r, p in zip(requests, proposals)] if self.propose_bad else proposals

    def prefill(self, seq_id, token_ids, rows, start_pos=0):
        if token_ids[0] in self.refuse:
            raise InvalidRequest("this drafter cannot take that sequence")
        return self.inner.prefill(seq_id, token_ids, rows, start_pos)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("spoil", ["id past the vocabulary", "more drafts than asked"])
def test_a_drafter_answering_out_of_contract_is_detached_not_fatal(spoil, target, tokenizer, reference):
    def bad(request, proposal):
        if spoil == "id past the vocabulary":
            return Proposal(tokens=[target.config.vocab_size + 3] * request.num_drafts)
        return Proposal(tokens=[7] * (request.num_drafts + 5))

    inner = drafter("dflash", target)
    tokens, stats = run(target, MisbehavingDrafter(inner, propose_bad=bad), requests(tokenizer), max_batch=4)
    assert tokens == reference and len(inner.store) == 0  # detaching freed what it held


def test_a_sequence_the_drafter_refuses_is_decoded_serially_and_the_others_speculate(target, tokenizer, reference):
    reqs = requests(tokenizer)
    inner = drafter("dflash", target)
    refusing = MisbehavingDrafter(inner, refuse={reqs[1].prompt_ids[0]})
    engine = Engine(target, refusing, EngineConfig(max_batch=4))
    events = engine.generate(reqs)
    tokens = {rid: [t for e in evs for t in e.token_ids] for rid, evs in events.items()}
    stats = {rid: evs[-1].stats for rid, evs in events.items()}
    assert tokens == reference and engine.drafter_ok and len(inner.store) == 0
    assert stats["r1"].drafted == 0 and stats["r0"].drafted > 0 and stats["r2"].drafted > 0


def test_drafter_failure_is_not_request_failure(target, tokenizer, reference):
    flaky = FlakyDrafter(drafter("mtp", target), fail_after=3)
    engine = Engine(target, flaky, EngineConfig(max_batch=4))
    for r in requests(tokenizer):
        engine.add(r)
    out: dict[str, list[int]] = {}
    steps = 0
    while engine.has_work:
        steps += 1
        if steps == 12:
            flaky.up = True  # the drafter is back: the engine re-attaches and rebuilds state
        for e in engine.step():
            out.setdefault(e.request_id, []).extend(e.token_ids)
    assert out == reference
    assert engine.drafter_ok


class ForwardLog:
    """Wraps the target: records each eager forward's token counts per sequence, and which forwards were
    prefills (logits of each sequence's last row only) rather than decode/verify steps."""

    def __init__(self, model) -> None:
        self.model, self.forwards, self.prefills = model, [], []

    def __call__(self, batch, cache, capture):
        cu = batch.cu_seqlens.tolist()
        self.forwards.append([b - a for a, b in zip(cu, cu[1:])])
        self.prefills.append(batch.logits_index is not None)
        return self.model(batch, cache, capture)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("kind", [None, "dflash", "mtp"])
def test_prompts_admitted_together_are_prefilled_together(kind, target, tokenizer, monkeypatch):
    """Admitting many prompts costs a few packed forwards, not one each (eager prefill is launch-bound
    on a GPU), and changes no token: packed == one prompt per forward, with and without a drafter.
    Long prompts go in chunks, a forward stays within its token budget, and there is one prefill forward
    per engine step: the prompts already in decode between them."""
    prompts = PROMPTS + ["x " * 30, "Tell me a story about a dragon.", "1, 2, 3, 4, 5, 6,", "Hello"]
    reqs = requests(tokenizer, prompts, max_tokens=12)
    lengths = sorted(len(r.prompt_ids) for r in reqs)
    assert lengths[-1] > 16  # at least one prompt needs several chunks

    def go(prefill_tokens):
        proposer = drafter(kind, target) if kind else None
        engine = Engine(target, proposer, EngineConfig(max_batch=8, prefill_chunk=16, prefill_tokens=prefill_tokens))
        log = ForwardLog(engine.model)
        monkeypatch.setattr(engine, "model", log)  # the eager forwards; decode steps too (no graphs on the CPU)
        batches, prefilled = [], {}  # batches: the drafter's context forwards while prompts go in
        if proposer is not None:
            inner, prefill = proposer.append_rows_batch, proposer.prefill
            finish, inside = engine._finish_prefill, []  # (where the prompts a forward completed are attached)
            monkeypatch.setattr(engine, "_finish_prefill",
                                lambda prefill: (inside.append(1), finish(prefill), inside.clear())[1])
            monkeypatch.setattr(proposer, "append_rows_batch",
                                lambda appends: (inside and batches.append(len(appends)), inner(appends)))

            def record(seq_id, token_ids, rows, start_pos=0):
                prefilled[seq_id] = (list(token_ids), rows.clone(), start_pos)
                return prefill(seq_id, token_ids, rows, start_pos)
            monkeypatch.setattr(proposer, "prefill", record)
        events = engine.generate(reqs)
        tokens = {rid: ([t for e in evs for t in e.token_ids], evs[-1].stats.drafted, evs[-1].stats.accepted)
                  for rid, evs in events.items()}
        return tokens, log, batches, engine, prefilled

    packed, packed_log, packed_batches, engine, packed_rows = go(40)
    single, single_log, _, _, single_rows = go(1)
    assert packed == single
    assert packed_rows.keys() == single_rows.keys() and len(single_rows) == (0 if kind is None else len(reqs))
    for seq_id, (tokens, rows, start) in single_rows.items():  # the drafter got each prompt's own rows
        assert packed_rows[seq_id][0] == tokens and packed_rows[seq_id][2] == start == 0
        torch.testing.assert_close(packed_rows[seq_id][1], rows)
    prefill = [f for f, p in zip(packed_log.forwards, packed_log.prefills) if p]
    assert sum(map(sum, prefill)) == sum(lengths)
    assert all(sum(f) <= 40 and max(f) <= 16 for f in prefill)
    assert 1 < len(prefill) < len(reqs)  # packed, and the budget split it
    assert sum(single_log.prefills) == sum(-(-n // 16) for n in lengths)  # one prompt chunk per forward
    # decode steps between the prefill forwards, once the first prompts were in: never two prefills in a row
    first = packed_log.prefills.index(True)
    last = len(packed_log.prefills) - 1 - packed_log.prefills[::-1].index(True)
    assert not any(a and b for a, b in zip(packed_log.prefills[first + 1:last + 1], packed_log.prefills[first + 2:last + 1]))
    assert not all(packed_log.prefills[first:last + 1])
    if kind == "dflash":  # the prompts completed by one forward go to the drafter in one context forward
        assert sum(packed_batches) == len(reqs) and len(packed_batches) < len(reqs)
    assert engine.counters.prefills == len(reqs)


def test_a_request_cancelled_between_its_prefill_chunks_ends_alone(target, tokenizer):
    """Packed prefill, one forward per step: cancelling one long prompt between its chunks stops it
    there; the prompts packed with it go on and equal their uncancelled run, and its blocks come back."""
    prompts = ["x " * 40, PROMPTS[0], PROMPTS[1]]
    reqs = requests(tokenizer, prompts, max_tokens=8)
    want, _ = run(target, None, reqs[1:], prefill_chunk=16)
    engine = Engine(target, None, EngineConfig(max_batch=4, prefill_chunk=16, prefill_tokens=64))
    log = ForwardLog(engine.model)
    engine.model = log
    for r in reqs:
        engine.add(r)
    events: dict[str, list[int]] = {}
    for n in itertools.count():
        if n == 1:
            assert 0 < engine._prefilling[0].offset < len(reqs[0].prompt_ids)  # r0 is part way in
            assert engine.abort("r0")
        for e in engine.step():
            events.setdefault(e.request_id, []).extend(e.token_ids)
        if not engine.has_work:
            break
    assert "r0" not in events and events == want
    # one prefill forward: r0's first chunk with both short prompts whole; r0 never sent its other chunks
    assert sum(log.prefills) == 1 and log.forwards[0] == [16] + [len(r.prompt_ids) for r in reqs[1:]]
    assert not engine.running and engine.cache.num_free_blocks == engine.config.kv_blocks


@pytest.mark.parametrize("kind", [None, "dflash"])
def test_a_long_prompt_does_not_stall_the_running_sequences(kind, target, tokenizer):
    """A long prompt admitted while others decode goes in a chunk per engine step: the running
    sequences emit a token (or more) at every one of those steps instead of waiting out its whole
    prefill, and every request's tokens equal its run alone."""
    short, long = requests(tokenizer, [PROMPTS[0], "word " * 120], max_tokens=30)
    chunks = -(-len(long.prompt_ids) // 16)
    assert chunks >= 6
    alone = {r.request_id: run(target, None, [r])[0][r.request_id] for r in (short, long)}
    engine = Engine(target, drafter(kind, target) if kind else None,
                    EngineConfig(max_batch=4, prefill_chunk=16, prefill_tokens=16))
    engine.add(short)
    emitted: dict[str, list[int]] = {}
    per_step = []
    for n in itertools.count():
        if n == 2:
            engine.add(long)  # r0 is decoding by now
        events = engine.step()
        for e in events:
            emitted.setdefault(e.request_id, []).extend(e.token_ids)
        if n >= 2 and "r1" not in emitted:  # the long prompt's prefill steps
            per_step.append(sum(len(e.token_ids) for e in events if e.request_id == "r0"))
            assert engine.prefilling == 1  # (the metrics' sequences{state="prefilling"})
        if not engine.has_work:
            break
    assert emitted == alone
    assert len(per_step) == chunks - 1 and all(k >= 1 for k in per_step)


def test_draft_length_follows_the_batch_size_and_stays_lossless(target, tokenizer, reference):
    # Three requests of different lengths: steps of 3, then 2, then 1 sequence.
    reqs = requests(tokenizer)
    for r, n in zip(reqs, (MAX_TOKENS, 24, 12)):
        r.params = SamplingParams(max_tokens=n, ignore_eos=True)
    continuations = {tuple(r.prompt_ids): r.prompt_ids + reference[r.request_id] for r in reqs}
    oracle = OracleDrafter(drafter("dflash", target, block_size=8), continuations, mistake_rate=0.1)
    asked: dict[int, set[int]] = {}
    propose = oracle.propose

    def spy(reqs_):
        for r in reqs_:
            asked.setdefault(len(reqs_), set()).add(r.num_drafts)
        return propose(reqs_)

    oracle.propose = spy
    tokens, _ = run(target, oracle, reqs, max_batch=4, drafts_by_batch=((2, 3), (3, 1)))
    assert tokens == {r.request_id: reference[r.request_id][:r.params.max_tokens] for r in reqs}
    assert max(asked[3]) == 1 and max(asked[2]) == 3 and max(asked[1]) == 7  # 7: the block's most


def test_drafts_by_batch_is_checked():
    with pytest.raises(InvalidRequest):
        EngineConfig(drafts_by_batch=((0, 3),))
    with pytest.raises(InvalidRequest):
        EngineConfig(drafts_by_batch=((4, -1),))
    conf = EngineConfig(num_drafts=5, drafts_by_batch=((8, 3), (32, 1)))
    assert [conf.drafts_for(n, 15) for n in (1, 7, 8, 31, 32, 64)] == [5, 5, 3, 3, 1, 1]
    assert EngineConfig().drafts_for(64, 15) == 15


def test_steps_without_drafts_keep_the_drafter_current_in_one_call(target, tokenizer, reference, monkeypatch):
    # Three requests of different lengths; no drafts while 2 or more share a step, and the sequences kept
    # attached (resume_after=None: no rest), so the drafter only receives catch-up rows until one sequence is
    # left, then drafts from that context. Its drafts must be the same whether the catch-ups went one call
    # per sequence or in the step's one call.
    reqs = requests(tokenizer)
    for r, n in zip(reqs, (12, 24, MAX_TOKENS)):  # the last in the batch goes on alone
        r.params = SamplingParams(max_tokens=n, ignore_eos=True)

    def run_recording(one_call: bool):
        from specsplit.target_service import engine as engine_module

        inner = drafter("dflash", target, block_size=8)
        calls = {"many": 0, "catchup": 0}
        drafts = []
        propose, many, catchup = inner.propose, inner.commit_verified_many, inner.catchup

        def recording(rs):  # each propose's drafts, and the context it drafted from
            out = propose(rs)
            drafts.append(([p.tokens for p in out], [inner.held(inner.store.get(r.seq_id))[1] for r in rs]))
            return out

        inner.propose = recording

        def count_many(*args):
            calls["many"] += 1
            return many(*args)

        def count_catchup(*args):
            calls["catchup"] += 1
            return catchup(*args)

        inner.catchup = count_catchup
        capability = engine_module._capability

        def lookup(proposer, name):
            if name == "commit_verified_many":
                return count_many if one_call else None
            return capability(proposer, name)

        with monkeypatch.context() as patch:
            patch.setattr(engine_module, "_capability", lookup)
            tokens, _ = run(target, inner, reqs, max_batch=4, drafts_by_batch=((2, 0),), resume_after=None)
        return tokens, drafts, calls

    tokens, drafts, calls = run_recording(one_call=True)
    plain_tokens, plain_drafts, plain_calls = run_recording(one_call=False)
    assert tokens == plain_tokens == {r.request_id: reference[r.request_id][:r.params.max_tokens] for r in reqs}
    assert len(drafts) == len(plain_drafts) > 0
    for (tokens_, context), (plain_tokens_, plain_context) in zip(drafts, plain_drafts):
        assert tokens_ == plain_tokens_
        for k, plain_k in zip(context, plain_context):
            torch.testing.assert_close(k, plain_k)
    assert calls["catchup"] == 0 and calls["many"] > 0 and plain_calls["catchup"] > 0


def test_a_batch_size_that_drafts_nothing_rests_its_sequences_from_the_drafter(target, tokenizer, reference):
    """EngineConfig.resume_after: one request drafts alone; two more join, and while two or more share a step
    (`drafts_by_batch` (2, 0)) the drafter is called for nothing but to free the first one's state (those
    admitted then are never attached); once one sequence is left and the schedule has given drafts
    `resume_after` steps in a row it is attached again from re-captured rows, and drafts. Every token is
    target-only's, and the drafter holds nothing at the end."""
    reqs = requests(tokenizer)
    for r, n in zip(reqs, (MAX_TOKENS, 10, 14)):
        r.params = SamplingParams(max_tokens=n, ignore_eos=True)
    inner = drafter("dflash", target, block_size=8)
    calls: list[str] = []
    for verb in ("alloc", "prefill", "propose", "catchup", "commit_verified", "commit_verified_many", "stash",
                 "commit", "trim", "free"):
        if hasattr(inner, verb):
            def recorded(*args, _verb=verb, _call=getattr(inner, verb), **kw):
                calls.append(_verb)
                return _call(*args, **kw)
            setattr(inner, verb, recorded)
    engine = Engine(target, inner, EngineConfig(max_batch=4, drafts_by_batch=((2, 0),), resume_after=3))
    out: dict[str, list[int]] = {}
    per_step: list[tuple[int, list[str]]] = []

    def step() -> None:
        calls.clear()
        batch = sum(1 for s in engine.running.values() if s.seq_id not in engine._prefilling)
        for event in engine.step():
            out.setdefault(event.request_id, []).extend(event.token_ids)
        per_step.append((batch, list(calls)))

    engine.add(reqs[0])
    for _ in range(3):
        step()
    drafted_alone = engine.running["r0"].stats.drafted
    engine.add(reqs[1])
    engine.add(reqs[2])
    while engine.has_work:
        step()
    assert out == {r.request_id: reference[r.request_id][:r.params.max_tokens] for r in reqs}
    assert drafted_alone > 0
    shared = [verbs for batch, verbs in per_step if batch >= 2]
    assert shared and [v for verbs in shared for v in verbs] == ["free"]  # r0's, once; r1 and r2 never attached
    assert engine.counters.rests == 3 and engine.counters.resumes == 1  # r0 freed, r1 and r2 at admission
    last_shared = max(i for i, (batch, _) in enumerate(per_step) if batch >= 2)
    alone_again = [verbs for _, verbs in per_step[last_shared + 1:]]
    # two steps alone without the drafter, then in the third (resume_after) re-attached, and drafting at once
    assert alone_again[:2] == [[], []] and alone_again[2][:3] == ["alloc", "prefill", "propose"]
    assert engine.counters.drafts[0] < sum(engine.counters.drafts) and not engine.running
    assert len(inner.store) == 0


def test_a_drafter_back_from_an_outage_while_the_batch_drafts_nothing_is_rested_from(target, tokenizer, reference):
    """A drafter that comes back while two sequences share a step (`drafts_by_batch` (2, 0)) is attached again, but
    the sequences rest from it at once: nothing re-captured, no drafter prefill; the one left alone after the
    other ends is attached as resting ones are, and drafts. Every token is target-only's."""
    reqs = requests(tokenizer)[:2]
    for r, n in zip(reqs, (MAX_TOKENS, 8)):
        r.params = SamplingParams(max_tokens=n, ignore_eos=True)
    flaky = FlakyDrafter(drafter("dflash", target, block_size=8), fail_after=1)
    prefills = []
    flaky.prefill = lambda *args, **kw: prefills.append(args[0]) or flaky.inner.prefill(*args, **kw)
    engine = Engine(target, flaky, EngineConfig(max_batch=2, drafts_by_batch=((2, 0),), resume_after=2))
    out: dict[str, list[int]] = {}

    def step() -> None:
        for event in engine.step():
            out.setdefault(event.request_id, []).extend(event.token_ids)

    engine.add(reqs[0])
    while engine.drafter_ok:  # r0 drafts alone, then the drafter fails
        step()
    engine.add(reqs[1])
    step()  # r1 in, the drafter still down
    before = list(prefills)
    flaky.up = True
    step()  # back: both rest
    assert engine.drafter_ok and engine.counters.reattaches == 1 and prefills == before
    assert all(s.drafter_resting and not s.drafter_attached for s in engine.running.values())
    while engine.has_work:
        step()
    assert out == {r.request_id: reference[r.request_id][:r.params.max_tokens] for r in reqs}
    assert engine.counters.resumes == 1 and prefills[-1] == prefills[0] and len(prefills) == len(before) + 1


@pytest.mark.slow  # (6 s on the CPU: the default run stays under five minutes)
def test_a_batch_going_back_and_forth_does_not_resume_before_resume_after_steps(target, tokenizer, reference):
    """While short requests keep arriving (a step of two sequences drafts nothing, (2, 0)), the long one never
    goes `resume_after` steps alone, so it is re-attached (a re-capture of its rows) only once they stop coming;
    with resume_after 1 the same traffic re-attaches it between arrivals. Every token is target-only's."""

    def serve(resume_after: int) -> tuple[Engine, list[int]]:
        engine = Engine(target, drafter("dflash", target, block_size=8),
                        EngineConfig(max_batch=2, drafts_by_batch=((2, 0),), resume_after=resume_after))
        engine.add(requests(tokenizer)[0])
        out: dict[str, list[int]] = {}
        batches = []
        for n in itertools.count():
            if n < 24 and n % 3 == 0:
                engine.add(Request(f"s{n}", tokenizer.encode(PROMPTS[1]),
                                   SamplingParams(max_tokens=2, ignore_eos=True)))
            batches.append(sum(1 for s in engine.running.values() if s.seq_id not in engine._prefilling))
            for event in engine.step():
                out.setdefault(event.request_id, []).extend(event.token_ids)
            if not engine.has_work:
                break
        assert out["r0"] == reference["r0"]
        return engine, batches

    engine, batches = serve(resume_after=4)
    alone = max(len(run) for run in "".join("a" if b == 1 else "." for b in batches[:24]).split("."))
    assert 1 <= alone < 4 and engine.counters.resumes == 1
    eager, _ = serve(resume_after=1)
    assert eager.counters.resumes > 2


def test_resume_after_is_checked():
    for bad in (0, -1, True, 2.5):
        with pytest.raises(InvalidRequest):
            EngineConfig(resume_after=bad)
    assert EngineConfig(resume_after=None).resume_after is None


@pytest.mark.parametrize("kind", [None, "dflash"])
def test_a_prefill_is_read_after_the_decode_step_launches_when_a_step_is_out(kind, target, tokenizer, monkeypatch):
    """`Engine.step` reads a prefill's first tokens (a wait for the device) after launching the step of the
    sequences already decoding when a step launched ahead is out (target-only here; a chained step on a
    GPU), so the device is not left idle while the host samples, attaches and emits; otherwise first, as
    before. Every request's tokens, greedy and seeded sampled ones, are those of the same engine reading
    its prefills first, and target-only's those of each request run alone."""
    reqs = [Request(f"r{i}", tokenizer.encode(p), SamplingParams(max_tokens=n, ignore_eos=True, **extra))
            for i, (p, n, extra) in enumerate([(PROMPTS[0], 14, {}), (PROMPTS[1], 5, {"temperature": 0.8, "seed": 3}),
                                               (PROMPTS[2], 9, {"temperature": 0.7, "seed": 5}), (PROMPTS[1], 6, {})])]

    def serve(overlap: bool | None) -> tuple[dict[str, list[int]], list[str]]:
        engine = Engine(target, drafter(kind, target) if kind else None, EngineConfig(max_batch=2))
        order: list[str] = []
        decode, first = engine._decode_step, engine._first_tokens
        monkeypatch.setattr(engine, "_decode_step", lambda seqs: order.append("decode") or decode(seqs))
        monkeypatch.setattr(engine, "_first_tokens", lambda *a: order.append("first") or first(*a))
        if overlap is not None:
            monkeypatch.setattr(engine, "_overlaps_prefill", lambda: overlap)
        for r in reqs:
            engine.add(Request(r.request_id, r.prompt_ids, r.params))
        emitted: dict[str, list[int]] = {}
        while engine.has_work:
            order.append("step")
            for e in engine.step():
                emitted.setdefault(e.request_id, []).extend(e.token_ids)
        steps = "".join({"step": "|", "decode": "d", "first": "f"}[o] for o in order).split("|")[1:]
        return emitted, [s for s in steps if "f" in s and "d" in s]  # steps where a prompt completed as others decoded

    emitted, admitting = serve(None)
    assert admitting
    assert all(s == "fd" for s in admitting), admitting  # (on the CPU no step is ever launched ahead)
    for overlap in (True, False):
        tokens, steps = serve(overlap)
        assert tokens == emitted and set(steps) == {"df" if overlap else "fd"}
    if kind is None:
        assert emitted == {r.request_id: run(target, None, [r])[0][r.request_id] for r in reqs}


def test_a_prefill_is_read_after_the_decode_step_only_when_that_step_runs_ahead(target):
    """Target-only with a decode step launched ahead, or an in-process drafter with a chained step out; never
    through a drafter service (its attach waits for the step just launched: `chain_prefetch` marks one), nor
    with device waits (reading the prefill may launch a kernel for the first time, `Engine._quiesce`), nor
    with `overlap_prefill` off."""
    engine = Engine(target, None, EngineConfig())
    assert not engine._overlaps_prefill()  # nothing out: the decode step reads its own step at once
    engine._ahead = object()
    assert engine._overlaps_prefill()
    engine._ahead = None
    engine._chain = object()
    engine.proposer = type("InProcess", (), {})()
    assert engine._overlaps_prefill()
    engine.proposer = type("Service", (), {"chain_prefetch": lambda self, *a: None})()
    assert not engine._overlaps_prefill()
    engine.proposer = type("Waiting", (), {"waits_on_device": True})()
    assert not engine._overlaps_prefill()
    engine.config = dataclasses.replace(engine.config, overlap_attach=True)  # (measurement only: see the flag)
    assert engine._overlaps_prefill()
    engine.proposer = type("Service", (), {"chain_prefetch": lambda self, *a: None})()
    assert engine._overlaps_prefill()
    engine.config = dataclasses.replace(engine.config, overlap_attach=False)
    engine._chain = None
    engine.proposer = type("InProcess", (), {})()
    assert not engine._overlaps_prefill()
    off = Engine(target, None, EngineConfig(overlap_prefill=False))
    off._ahead = object()
    assert not off._overlaps_prefill()


def test_a_prompts_first_token_picked_on_the_device_is_the_one_verify_sampled_gives(target, tokenizer, monkeypatch):
    """`Engine._first_picks` (a completed prompt's first token, picked on the device so the host can read it
    after a step launched since): the argmax for greedy requests, and for sampled ones the token
    `verify_sampled` with no drafts gives from the same generator state, top-k/top-p and temperature too."""
    from specsplit.shared.verify import verify_sampled

    params = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, temperature=0.9, seed=3),
              SamplingParams(max_tokens=4, temperature=1.3, top_k=5, seed=5),
              SamplingParams(max_tokens=4, temperature=0.7, top_p=0.8, seed=7)]
    engine = Engine(target, None, EngineConfig(max_batch=4))
    seen = []
    picks = engine._first_picks

    def record(done, logits):
        states = [seq.generator.get_state() for seq in done]
        got = picks(done, logits)
        seen.append((done, logits, states, got.tolist()))
        return got
    monkeypatch.setattr(engine, "_first_picks", record)
    for i, (p, sp) in enumerate(zip(PROMPTS + PROMPTS[:1], params)):
        engine.add(Request(f"r{i}", tokenizer.encode(p), sp))
    engine.step()
    (done, logits, states, got), = seen
    assert len(done) == 4
    generators = []
    for seq, state in zip(done, states):
        g = torch.Generator(device=seq.generator.device)
        g.set_state(state)
        generators.append(g)
    cu = torch.arange(len(done) + 1)
    want = verify_sampled([[] for _ in done], logits, cu, [s.request.params for s in done], generators).tokens
    assert [[t] for t in got] == want
    assert got[0] == int(logits[0].argmax())
