"""MTP drafter: lazily built exact rows, multi-draft steps and batching equal a from-scratch recomputation."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specsplit.drafter_service.checkpoint import random_drafter
from specsplit.drafter_service.heads import TargetInfo
from specsplit.drafter_service.mtp import MTPDrafter
from specsplit.shared.config import RopeConfig
from specsplit.shared.errors import CapacityExceeded, InvalidRequest, StateConflict, UnknownSequence
from specsplit.shared.layers import RMSNorm
from specsplit.shared.proposer import FeatureKind, ProposeRequest, Proposer, bool_to_bitmask
from tests.rounding import conf_atol

INFO = TargetInfo(hidden_size=32, vocab_size=97, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=64, rope=RopeConfig(theta=300.0),
                  model_type="qwen3")
MAX_DRAFTS = 4


def roughen(model: nn.Module, seed: int) -> None:
    """Weights large enough that every input visibly moves the drafts (N(0, 0.02) barely does)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) / m.weight.shape[1] ** 0.5)
            elif isinstance(m, RMSNorm):
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=gen))


def make(seed: int = 0, **kw) -> MTPDrafter:
    drafter = random_drafter("mtp", INFO, seed=seed, max_drafts=MAX_DRAFTS, **kw)
    roughen(drafter.model, seed)
    return drafter


class History:
    """Committed target rows h_i and tokens x_i of one sequence, positions 0.. in order."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.hidden: list[torch.Tensor] = []
        self.tokens: list[int] = []

    def fresh(self, n: int) -> tuple[list[int], torch.Tensor]:
        tokens = torch.randint(0, INFO.vocab_size, (n,), generator=self.gen).tolist()
        return tokens, torch.randn(n, INFO.hidden_size, generator=self.gen)

    def add(self, tokens: list[int], rows: torch.Tensor) -> None:
        self.tokens += tokens
        self.hidden += list(rows)

    @property
    def next_pos(self) -> int:
        return len(self.tokens)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half))
    ang = (pos.double()[:, None] * inv)[:, None, :]
    cos, sin = ang.cos().float(), ang.sin().float()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def run_layer(layer, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The MTP decoder layer over a whole sequence, causal, no cache."""
    a, dec = layer.self_attn, INFO
    h = layer.input_layernorm(x)
    q = rope(a.q_norm(a.q_proj(h).view(len(x), -1, dec.head_dim)), pos, dec.rope.theta)
    k = rope(a.k_norm(a.k_proj(h).view(len(x), -1, dec.head_dim)), pos, dec.rope.theta)
    v = a.v_proj(h).view(len(x), -1, dec.head_dim)
    groups = dec.num_attention_heads // dec.num_key_value_heads
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(groups, 1).transpose(0, 1),
        v.repeat_interleave(groups, 1).transpose(0, 1), is_causal=True,
    ).transpose(0, 1)
    x = x + a.o_proj(out.reshape(len(x), -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


@torch.no_grad()
def reference(drafter: MTPDrafter, history: History, anchor: int, num_drafts: int,
              allowed: torch.Tensor | None = None) -> tuple[list[int], list[float], float]:
    """Every draft recomputed from scratch: pairs (h_{i-1}, x_i) at positions 1..L, then own outputs.
    Also returns the largest |logit| (the scale the confidences are rounded at)."""
    model, head = drafter.model, drafter.head
    layer = model.layer

    def fuse(token: int, hidden: torch.Tensor) -> torch.Tensor:
        return layer.eh_proj(torch.cat([layer.enorm(head.embed[token]), layer.hnorm(hidden)]))

    tokens = history.tokens[1:] + [anchor]
    inputs = [fuse(t, h) for t, h in zip(tokens, history.hidden)]
    drafts, conf, scale = [], [], 0.0
    for step in range(num_drafts):
        out = run_layer(layer, torch.stack(inputs), torch.arange(1, len(inputs) + 1))[-1]
        normed = layer.shared_head.norm(out)
        logits = normed @ (head.lm_head if model.lm_head is None else model.lm_head.weight).T
        scale = max(scale, logits.abs().max().item())
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        logp = torch.log_softmax(logits, -1)
        draft = int(logp.argmax())
        if model.d2t is not None:
            draft += int(model.d2t[draft])
        drafts.append(draft)
        conf.append(float(logp.max()))
        inputs.append(fuse(draft, out))
    return drafts, conf, scale


def assert_confidence_close(got: list[float], want: list[float], logit_scale: float) -> None:
    """The drafter and what it is compared with (the reference from scratch, or the same drafter
    unbatched) sum in different orders: the longest sum is the 97-token softmax, and draft i chains
    i rounds of the fusing projection and the layer before the head and the softmax (tests/rounding.py)."""
    atol = conf_atol(logit_scale, INFO.vocab_size, depth=2 * len(want) + 2)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=atol, rtol=0)


def propose_one(drafter, seq, anchor, position, n, **kw):
    return drafter.propose([ProposeRequest(seq, anchor, position, n, want_confidence=True, **kw)])[0]


def assert_matches(drafter, seq, history, anchor, n, allowed=None, **kw):
    """`allowed`: the reference's mask, in the draft vocabulary."""
    got = propose_one(drafter, seq, anchor, history.next_pos, n, **kw)
    tokens, conf, scale = reference(drafter, history, anchor, n, allowed)
    assert got.tokens == tokens
    assert_confidence_close(got.confidence, conf, scale)
    return got


def start(drafter, seq, history, n, budget=200):
    drafter.alloc(seq, budget)
    tokens, rows = history.fresh(n)
    assert drafter.prefill(seq, tokens, rows) == n
    history.add(tokens, rows)


def verify(drafter, seq, history, anchor, drafts, accept):
    """Verify [anchor, drafts] and accept `accept` of them: stash, commit, trim."""
    _, rows = history.fresh(len(drafts) + 1)
    committed = [anchor] + drafts[:accept]
    base = history.next_pos
    drafter.stash(seq, rows)
    drafter.commit(seq, accept + 1, base, committed)
    drafter.trim(seq, accept)
    history.add(committed, rows[:accept + 1])


def test_is_a_proposer_with_mtp_spec():
    drafter = make()
    assert isinstance(drafter, Proposer)
    assert drafter.spec.feature is FeatureKind.LAST_HIDDEN
    assert (drafter.spec.feature_dim, drafter.spec.max_drafts, drafter.spec.block_size) == (32, MAX_DRAFTS, 0)


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_propose_matches_reference(num_drafts):
    drafter = make()
    history = History(1)
    start(drafter, 0, history, 7)
    assert_matches(drafter, 0, history, 11, num_drafts)


def test_steps_with_partial_accepts_match_reference():
    drafter = make()
    history = History(2)
    start(drafter, 0, history, 5)
    anchor = 9
    for accept in (2, 0, 4, 1, 3):
        got = assert_matches(drafter, 0, history, anchor, MAX_DRAFTS)
        verify(drafter, 0, history, anchor, got.tokens, accept)
        anchor = (got.tokens[accept] + 1) % INFO.vocab_size if accept < MAX_DRAFTS else 5  # a bonus token
    assert_matches(drafter, 0, history, anchor, MAX_DRAFTS)


def test_trim_drops_speculative_rows():
    drafter = make()
    history = History(3)
    start(drafter, 0, history, 6)
    got = propose_one(drafter, 0, 14, 6, MAX_DRAFTS)
    state = drafter.store.get(0)
    assert state.exact == 5  # positions 1..5; the anchor's row and three draft rows are speculative
    assert len(state.kv) == 5 + MAX_DRAFTS
    assert state.kv["pos"].tolist() == list(range(1, 10))
    verify(drafter, 0, history, 14, got.tokens, 1)
    assert len(state.kv) == state.exact == 5
    assert_matches(drafter, 0, history, 60, MAX_DRAFTS)


def test_repeated_propose_and_serial_catchup():
    drafter = make()
    history = History(4)
    start(drafter, 0, history, 4)
    first = assert_matches(drafter, 0, history, 8, 3)
    assert propose_one(drafter, 0, 8, 4, 3).tokens == first.tokens  # the anchor row is rebuilt, not reused
    for token in (8, 21, 33):  # speculation suspended: serial rows, one at a time
        _, rows = history.fresh(1)
        assert drafter.catchup(0, [token], rows, history.next_pos) == 1
        history.add([token], rows)
    assert_matches(drafter, 0, history, 2, MAX_DRAFTS)


def prefill_three(*drafters: MTPDrafter, seed: int) -> dict[int, "History"]:
    """Sequences 0, 1, 2 with prompts of 3, 9 and 1 tokens, prefilled alike into every drafter given."""
    histories = {}
    for seq, n in ((0, 3), (1, 9), (2, 1)):
        histories[seq] = History(seed + seq)
        tokens, rows = histories[seq].fresh(n)
        for d in drafters:
            d.alloc(seq, 100)
            d.prefill(seq, tokens, rows.to(d.device))
        histories[seq].add(tokens, rows)
    return histories


def test_batched_propose_equals_per_sequence():
    drafter, twin = make(max_batch=2), make()
    histories = prefill_three(drafter, twin, seed=10)
    for _ in range(2):
        requests = [ProposeRequest(s, 20 + s, h.next_pos, n, want_confidence=True)
                    for (s, h), n in zip(histories.items(), (4, 1, 3))]
        batched = drafter.propose(requests)
        for request, got in zip(requests, batched):
            alone = twin.propose([request])[0]
            assert got.tokens == alone.tokens and len(got.tokens) == request.num_drafts
            tokens, _, scale = reference(drafter, histories[request.seq_id], request.last_token, request.num_drafts)
            assert_confidence_close(got.confidence, alone.confidence, scale)
            assert got.tokens == tokens
        for request, got in zip(requests, batched):  # accept one draft each, in both drafters
            history = histories[request.seq_id]
            _, rows = history.fresh(2)
            committed = [request.last_token, got.tokens[0]]
            for d in (drafter, twin):
                d.stash(request.seq_id, rows)
                d.commit(request.seq_id, 2, request.position, committed)
                d.trim(request.seq_id, 1)
            history.add(committed, rows)


def test_commits_in_a_batched_block_equal_commits_one_by_one():
    """A step's commits wait for the end of a batched block and enter every sequence's pending rows
    together (a stash, a commit of it, a trim and a catch-up of the same sequence among them): the
    drafter then holds and proposes what the same verbs one by one give."""
    batched, alone = make(max_batch=4), make(max_batch=4)
    histories = prefill_three(batched, alone, seed=50)
    for round_ in range(3):
        requests = [ProposeRequest(s, 30 + s + round_, h.next_pos, 3) for s, h in histories.items()]
        want = alone.propose(requests)
        assert [p.tokens for p in batched.propose(requests)] == [p.tokens for p in want]
        steps = []
        for request, proposal in zip(requests, want):
            accept = (round_ + request.seq_id) % 4
            _, rows = histories[request.seq_id].fresh(4)
            steps.append((request, rows, accept, [request.last_token] + proposal.tokens[:accept]))
        extra_tokens, extra_rows = histories[2].fresh(5)
        for drafter in (batched, alone):
            block = drafter.batched_appends() if drafter is batched else nullcontext()
            with block:
                for request, rows, accept, committed in steps:
                    if request.seq_id == 0:
                        drafter.stash(0, rows)
                        drafter.commit(0, accept + 1, request.position, committed)
                        drafter.trim(0, accept)
                    else:
                        drafter.commit_verified(request.seq_id, rows, accept, request.position, committed)
                    if request.seq_id == 2:  # the same sequence again in the block: rows of a catch-up
                        drafter.catchup(2, extra_tokens, extra_rows, request.position + accept + 1)
                if drafter is batched:
                    assert all(len(drafter.store.get(s).pending) <= 1 for s in histories)  # not entered yet
        for request, rows, accept, committed in steps:
            histories[request.seq_id].add(committed, rows[:accept + 1])
        histories[2].add(extra_tokens, extra_rows)
        with batched.batched_appends():  # a propose while its rows wait in the block: refused, not wrong
            _, rows = histories[0].fresh(1)
            batched.commit_verified(0, rows, 0, histories[0].next_pos, [5])
            with pytest.raises(StateConflict, match="not all in"):
                batched.propose([ProposeRequest(0, 6, histories[0].next_pos + 1, 2)])
        alone.commit_verified(0, rows, 0, histories[0].next_pos, [5])
        histories[0].add([5], rows)
        for seq_id in histories:
            mine, theirs = batched.store.get(seq_id), alone.store.get(seq_id)
            assert mine.next_pos == theirs.next_pos
            assert torch.equal(mine.pending["tok"], theirs.pending["tok"])
            assert torch.equal(mine.pending["h"], theirs.pending["h"])


def test_drafts_left_on_the_device_equal_the_host_paths():
    """`propose_on_device` (the in-process engine's device drafts, the drafter service's drafts buffer)
    gives each request its drafts in its row, as `propose` gives them, through a batch whose sequences
    stop drafting at different steps; the state it leaves proposes on as the host path's does."""
    drafter, twin = make(), make()
    histories = prefill_three(drafter, twin, seed=30)
    for counts in ((1, 4, 2), (4, 4, 4), (3, 1, 1)):
        requests = [ProposeRequest(s, 20 + s, h.next_pos, n) for (s, h), n in zip(histories.items(), counts)]
        on_device = drafter.propose_on_device(requests)
        assert on_device is not None and on_device.shape == (3, max(counts))
        on_host = twin.propose(requests)
        assert [row[:n] for row, n in zip(on_device.tolist(), counts)] == [p.tokens for p in on_host]
        for request, got in zip(requests, on_host):  # accept the first draft in both drafters
            _, rows = histories[request.seq_id].fresh(2)
            committed = [request.last_token, got.tokens[0]]
            for d in (drafter, twin):
                d.commit_verified(request.seq_id, rows, 1, request.position, committed)
            histories[request.seq_id].add(committed, rows)


def test_bitmask_confidence_and_d2t():
    drafter = make(draft_vocab_size=30)
    d2t = drafter.model.d2t
    targets = sorted(set((torch.arange(30) + d2t).tolist()))
    history = History(5)
    start(drafter, 0, history, 6)
    got = assert_matches(drafter, 0, history, 3, MAX_DRAFTS)
    assert set(got.tokens) <= set(targets)
    allowed = torch.zeros(INFO.vocab_size, dtype=torch.bool)
    allowed[targets[::3]] = True
    allowed[got.tokens[0]] = False
    masked = assert_matches(drafter, 0, history, 3, MAX_DRAFTS, bitmask=bool_to_bitmask(allowed),
                            allowed=allowed[torch.arange(30) + d2t])
    assert all(allowed[t] for t in masked.tokens)


def test_take_and_install_carry_exact_rows():
    drafter = make()
    history = History(6)
    start(drafter, 1, history, 5)
    got = propose_one(drafter, 1, 7, 5, 2)
    verify(drafter, 1, history, 7, got.tokens, 2)
    carried = drafter.take_kv(1)
    assert (carried.rows, carried.last_position) == (4, 7)
    with pytest.raises(StateConflict):  # the source is fresh again: nothing to draft from
        propose_one(drafter, 1, 7, 0, 1)
    drafter.alloc(2, 100)
    drafter.install_kv(2, carried.handle)
    assert_matches(drafter, 2, history, 12, MAX_DRAFTS)
    tokens, rows = history.fresh(2)
    tokens[0] = 12
    drafter.prefill(2, tokens, rows, start_pos=8)
    history.add(tokens, rows)
    assert_matches(drafter, 2, history, 50, MAX_DRAFTS)


@pytest.mark.parametrize("call,error", [
    (lambda d: propose_one(d, 0, 1, 4, MAX_DRAFTS + 1), InvalidRequest),
    (lambda d: propose_one(d, 0, 1, 3, 1), StateConflict),
    (lambda d: propose_one(d, 2, 1, 0, 1), StateConflict),  # nothing committed
    (lambda d: d.prefill(0, [1], torch.randn(1, 32), 3), StateConflict),
    (lambda d: d.prefill(0, [1], torch.randn(1, 33), 4), InvalidRequest),
    (lambda d: d.prefill(0, [1] * 7, torch.randn(7, 32), 4), CapacityExceeded),
    (lambda d: d.commit(0, 1, 4, [1]), StateConflict),
    (lambda d: d.trim(0, -1), InvalidRequest),
    (lambda d: d.free(5), UnknownSequence),
])
def test_bad_calls_raise_and_change_nothing(call, error):
    drafter = make()
    history = History(7)
    start(drafter, 0, history, 4, budget=10)
    drafter.alloc(2, 10)
    state = drafter.store.get(0)
    before = (state.next_pos, state.exact, len(state.kv), len(state.pending), state.pending["h"].clone())
    with pytest.raises(error):
        call(drafter)
    after = (state.next_pos, state.exact, len(state.kv), len(state.pending), state.pending["h"])
    assert before[:4] == after[:4] and torch.equal(before[4], after[4])
    assert_matches(drafter, 0, history, 5, 2)


# ---- the static chain (mtp_graphs.ChainGraphs) ------------------------------------------------------


def drive_twins(static: MTPDrafter, eager: MTPDrafter, device: str = "cpu",
                rounds=((1, 4, 2), (4, 4, 4), (3, 0, 1), (2, 3, 1), (2, 3, 4), (4, 1, 3), (4, 4, 2))) -> int:
    """Propose the same requests from both drafters round after round (one sequence's cache grown past
    two length buckets first, so its first propose has more pending pairs than the static chain
    builds), accepting every draft, none or one by turns (all of 4: the most pending pairs a propose
    can have); the drafts must be the same, and the confidences equal to rounding. Returns the
    proposes made."""
    histories = prefill_three(static, eager, seed=40)
    history = histories[1]
    tokens, rows = history.fresh(25)  # 9 + 25 rows: past the 16 and 32 buckets
    for d in (static, eager):
        d.catchup(1, tokens, rows.to(device), history.next_pos)
    history.add(tokens, rows)
    made = 0
    for counts in rounds:
        requests = [ProposeRequest(s, 20 + s + made, h.next_pos, n, want_confidence=True)
                    for (s, h), n in zip(histories.items(), counts)]
        got, want = static.propose(requests), eager.propose(requests)
        made += 1
        assert [p.tokens for p in got] == [p.tokens for p in want], counts
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.confidence or []), torch.tensor(w.confidence or []),
                                       atol=1e-4, rtol=1e-4)
        for request, proposal in zip(requests, want):
            accept = min((request.num_drafts, 0, 1)[made % 3], request.num_drafts)
            _, rows = histories[request.seq_id].fresh(accept + 1)
            committed = [request.last_token] + proposal.tokens[:accept]
            for d in (static, eager):
                d.commit_verified(request.seq_id, rows.to(device), accept, request.position, committed)
            histories[request.seq_id].add(committed, rows[:accept + 1])
    for seq_id in histories:  # the same exact rows in both caches (the eager one also holds speculative ones)
        mine, theirs = static.store.get(seq_id), eager.store.get(seq_id)
        assert mine.exact == theirs.exact and len(mine.kv) == mine.exact
        assert torch.equal(mine.kv["pos"], theirs.kv["pos"][:theirs.exact])
        torch.testing.assert_close(mine.kv["k"], theirs.kv["k"][:theirs.exact], atol=1e-4, rtol=1e-4)
    return made


@pytest.mark.parametrize("draft_vocab", [None, 30], ids=["full-vocab", "d2t"])
def test_the_static_chain_drafts_what_the_eager_chain_drafts(draft_vocab):
    """Batches whose sequences draft different counts (one none), caches of several length buckets, a
    draft vocabulary: the static chain (run without capture on the CPU) gives the eager chain's drafts
    and confidences, and leaves state that proposes on alike; a bitmask takes the eager chain."""
    kw = {} if draft_vocab is None else {"draft_vocab_size": draft_vocab}
    static, eager = make(max_batch=4, **kw), make(max_batch=4, **kw)
    static.use_static_chain(use_graphs=False)
    made = drive_twins(static, eager)
    assert static.chain_graphs.replays == made
    (runs,) = static.chain_graphs._runs.values()
    assert {(4, 64, 3), (4, 64, 4)} <= set(runs)  # one (batch, cache) bucket's buffers, two draft counts
    allowed = torch.zeros(INFO.vocab_size, dtype=torch.bool)
    allowed[::2] = True
    on_device = static.propose_on_device([ProposeRequest(2, 7, _next_pos(static, 2), 3)])
    assert on_device is not None and static.chain_graphs.replays == made + 1
    masked = ProposeRequest(2, 7, _next_pos(static, 2), 3, bitmask=bool_to_bitmask(allowed))
    assert static.propose([masked])[0].tokens == eager.propose([masked])[0].tokens
    assert static.chain_graphs.replays == made + 1  # the bitmask took the eager chain


def _next_pos(drafter: MTPDrafter, seq_id: int) -> int:
    return drafter.store.get(seq_id).next_pos


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_chain_graphs_draft_what_the_eager_chain_drafts_on_cuda():
    static, eager = make(max_batch=4, device="cuda"), make(max_batch=4, device="cuda")
    assert eager.chain_graphs is not None  # on a GPU the graphs are the default: the twin goes eager
    eager.chain_graphs = None
    static.use_static_chain(use_graphs=True)
    made = drive_twins(static, eager, device="cuda")
    assert static.chain_graphs.replays == made


def test_the_static_chain_keeps_graphs_per_target_head_and_forgets_them():
    """Graphs read the head by address: another target's head gets its own (drafting with that head, as
    the eager chain does), and a head forgotten (its target left) takes its graphs with it."""
    from specsplit.drafter_service.heads import TargetHead

    static, eager = make(max_batch=4), make(max_batch=4)
    static.use_static_chain(use_graphs=False)
    histories = prefill_three(static, eager, seed=50)
    requests = [ProposeRequest(s, 30 + s, h.next_pos, 3) for s, h in histories.items()]
    assert [p.tokens for p in static.propose(requests)] == [p.tokens for p in eager.propose(requests)]
    other = TargetHead.random(INFO, seed=9)
    first = static.head
    for d in (static, eager):
        d.head = other
    assert [p.tokens for p in static.propose(requests)] == [p.tokens for p in eager.propose(requests)]
    assert len(static.chain_graphs._runs) == 2
    static.forget_head(other)
    assert len(static.chain_graphs._runs) == 1
    for d in (static, eager):
        d.head = first
    assert [p.tokens for p in static.propose(requests)] == [p.tokens for p in eager.propose(requests)]
