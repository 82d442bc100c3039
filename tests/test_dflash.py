"""DFlash drafter: cached, windowed, batched proposes equal a from-scratch recomputation; verbs validate."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specsplit.drafter_service.checkpoint import random_drafter
from specsplit.drafter_service.dflash import DFlashDrafter, build_target_layer_ids
from specsplit.drafter_service.heads import TargetInfo
from specsplit.shared.config import RopeConfig
from specsplit.shared.errors import AlreadyExists, CapacityExceeded, InvalidRequest, StateConflict, UnknownSequence
from specsplit.shared.layers import RMSNorm
from specsplit.shared.proposer import ProposeRequest, Proposer, bool_to_bitmask
from tests.rounding import conf_atol, network_atol

INFO = TargetInfo(hidden_size=32, vocab_size=97, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=64, rope=RopeConfig(theta=500.0))
GAMMA = 5


def roughen(model: nn.Module, seed: int) -> None:
    """Weights large enough that the context visibly moves every draft (N(0, 0.02) barely does)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) / m.weight.shape[1] ** 0.5)
            elif isinstance(m, RMSNorm):
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=gen))


def make(seed: int = 0, info: TargetInfo = INFO, **kw) -> DFlashDrafter:
    kw.setdefault("num_layers", 2)
    drafter = random_drafter("dflash", info, seed=seed, block_size=GAMMA, **kw)
    roughen(drafter.model, seed)
    return drafter


class History:
    """What the test committed for one sequence: rows with their positions (the reference's input)."""

    def __init__(self, drafter: DFlashDrafter, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.width = drafter.spec.feature_dim
        self.rows: list[torch.Tensor] = []
        self.positions: list[int] = []

    def fresh(self, n: int) -> torch.Tensor:
        return torch.randn(n, self.width, generator=self.gen)

    def add(self, rows: torch.Tensor, base_pos: int) -> None:
        self.rows += list(rows)
        self.positions += range(base_pos, base_pos + rows.shape[0])

    @property
    def next_pos(self) -> int:
        return self.positions[-1] + 1 if self.positions else 0


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, H, D] rotated by angle pos * theta^(-2i/D), the rotate-half convention."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half))
    ang = (pos.double()[:, None] * inv)[:, None, :]
    cos, sin = ang.cos().float(), ang.sin().float()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


@torch.no_grad()
def reference_logits(drafter: DFlashDrafter, rows: list[torch.Tensor], positions: list[int], anchor: int,
                     position: int) -> torch.Tensor:
    """z-lab's forward without caches: context and block concatenated in every layer, from scratch."""
    model, head, cfg = drafter.model, drafter.head, drafter.model.cfg
    dec = cfg.decoder
    ctx = model.hidden_norm(model.fc(torch.stack(rows))) if rows else torch.zeros(0, dec.hidden_size)
    ids = torch.tensor([anchor] + [cfg.mask_token_id] * (GAMMA - 1))
    h = F.embedding(ids, head.embed) * cfg.input_embedding_scale
    q_pos = torch.arange(position, position + GAMMA)
    all_pos = torch.cat([torch.tensor(positions, dtype=torch.long), q_pos])
    groups = dec.num_attention_heads // dec.num_key_value_heads
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_norm(a.q_proj(x).view(GAMMA, -1, dec.head_dim))
        k = a.k_norm(torch.cat([a.k_proj(ctx), a.k_proj(x)]).view(-1, dec.num_key_value_heads, dec.head_dim))
        v = torch.cat([a.v_proj(ctx), a.v_proj(x)]).view(-1, dec.num_key_value_heads, dec.head_dim)
        q, k = rope(q, q_pos, dec.rope.theta), rope(k, all_pos, dec.rope.theta)
        mask = None
        window = dec.layer_window(i)
        if window is not None:  # the reference's causal sliding mask, by row index
            qi = k.shape[0] - GAMMA + torch.arange(GAMMA)[:, None]
            ki = torch.arange(k.shape[0])[None, :]
            mask = (ki <= qi) & (qi - ki < window)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(groups, 1).transpose(0, 1),
            v.repeat_interleave(groups, 1).transpose(0, 1), attn_mask=mask,
        ).transpose(0, 1)
        h = h + a.o_proj(out.reshape(GAMMA, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = model.norm(h)[1:]
    if model.lm_head is None:
        return h @ head.lm_head.T
    return h @ model.lm_head.weight.T  # draft vocabulary


def reference(drafter, history: History, anchor: int, num_drafts: int, window: int | None = None,
              allowed: torch.Tensor | None = None) -> tuple[list[int], list[float], float]:
    """Drafts, their confidences and the largest |logit| (the scale the confidences are rounded at)."""
    keep = len(history.rows) if window is None else min(window, len(history.rows))
    rows, positions = history.rows[len(history.rows) - keep:], history.positions[len(history.rows) - keep:]
    logits = reference_logits(drafter, rows, positions, anchor, history.next_pos)[:num_drafts]
    scale = logits.abs().max().item()
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    logp = torch.log_softmax(logits, -1)
    ids = logp.argmax(-1)
    if drafter.model.d2t is not None:
        ids = ids + drafter.model.d2t[ids]
    return ids.tolist(), logp.max(-1).values.tolist(), scale


def assert_confidence_close(got: list[float], want: list[float], logit_scale: float) -> None:
    """The drafter and what it is compared with (the reference from scratch, or the same drafter
    unbatched) sum in different orders: the longest sum is the 97-token softmax, chained after the
    fc, 2 layers and the head (tests/rounding.py)."""
    atol = conf_atol(logit_scale, INFO.vocab_size, depth=5)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=atol, rtol=0)


def propose_one(drafter, seq, anchor, position, n, **kw):
    return drafter.propose([ProposeRequest(seq, anchor, position, n, want_confidence=True, **kw)])[0]


def assert_matches(drafter, seq, history, anchor, n, window=None, **kw):
    got = propose_one(drafter, seq, anchor, history.next_pos, n, **kw)
    tokens, conf, scale = reference(drafter, history, anchor, n, window)
    assert got.tokens == tokens
    assert_confidence_close(got.confidence, conf, scale)
    return got


def step(drafter, seq, history, accept: int, verified: int = GAMMA) -> None:
    """One verify of `verified` rows that accepted `accept` drafts: stash, commit, trim."""
    rows = history.fresh(verified)
    base = history.next_pos
    drafter.stash(seq, rows)
    drafter.commit(seq, accept + 1, base, [3] * (accept + 1))
    drafter.trim(seq, accept)
    history.add(rows[:accept + 1], base)


def test_is_a_proposer_with_dflash_spec():
    drafter = make()
    assert isinstance(drafter, Proposer)
    spec = drafter.spec
    assert (spec.block_size, spec.max_drafts, spec.window) == (GAMMA, GAMMA - 1, 4096)
    assert spec.target_layer_ids == build_target_layer_ids(6, 2) == (1, 3)
    assert spec.feature_dim == 2 * INFO.hidden_size


def test_target_layer_ids_default_as_dflash():
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert build_target_layer_ids(36, 1) == (18,)
    assert build_target_layer_ids(28, 3) == (1, 13, 25)


def test_propose_matches_reference_through_prefill_commit_catchup():
    drafter = make()
    history = History(drafter, 1)
    drafter.alloc(7, 200)
    rows = history.fresh(9)
    assert drafter.prefill(7, list(range(9)), rows) == 9
    history.add(rows, 0)
    assert_matches(drafter, 7, history, anchor=11, n=GAMMA - 1)
    for accept in (2, 0, GAMMA - 1):
        step(drafter, 7, history, accept)
        assert_matches(drafter, 7, history, anchor=5 + accept, n=GAMMA - 1)
    rows = history.fresh(1)
    assert drafter.catchup(7, [4], rows, history.next_pos) == 1
    history.add(rows, history.next_pos)
    got = assert_matches(drafter, 7, history, anchor=40, n=2)  # fewer drafts: the first ones
    assert len(got.tokens) == 2


def test_context_moves_the_drafts():
    drafter = make()
    a, b = History(drafter, 1), History(drafter, 2)
    for seq, history in ((1, a), (2, b)):
        drafter.alloc(seq, 50)
        rows = history.fresh(6)
        drafter.prefill(seq, [1] * 6, rows)
        history.add(rows, 0)
    conf_a = propose_one(drafter, 1, 9, 6, GAMMA - 1).confidence
    conf_b = propose_one(drafter, 2, 9, 6, GAMMA - 1).confidence
    assert max(abs(x - y) for x, y in zip(conf_a, conf_b)) > 1e-2


def test_window_slides_keeping_stamped_positions():
    window = 6
    drafter = make(window=window)
    history = History(drafter, 3)
    drafter.alloc(0, 1000)
    rows = history.fresh(10)  # longer than the window: only the newest 6 are kept
    drafter.prefill(0, [2] * 10, rows)
    history.add(rows, 0)
    assert_matches(drafter, 0, history, 17, GAMMA - 1, window=window)
    for accept in (3, 1, 4, 0, 2, 4, 4):
        step(drafter, 0, history, accept)
        assert_matches(drafter, 0, history, 17 + accept, GAMMA - 1, window=window)
    state = drafter.store.get(0)
    assert state.rows_held == window
    assert drafter.held(state)[0].tolist() == history.positions[-window:]


def test_window_is_sized_by_budget_and_budget_is_enforced():
    drafter = make(window=64)
    drafter.alloc(0, 8)
    assert drafter.store.get(0).window == 8
    drafter.prefill(0, [1] * 6, torch.randn(6, drafter.spec.feature_dim))
    with pytest.raises(CapacityExceeded):
        drafter.catchup(0, [1] * 3, torch.randn(3, drafter.spec.feature_dim), 6)
    drafter.catchup(0, [1] * 2, torch.randn(2, drafter.spec.feature_dim), 6)
    with pytest.raises(CapacityExceeded):
        propose_one(drafter, 0, 1, 8, 1)


def test_batched_propose_equals_per_sequence():
    drafter = make(max_batch=2)  # three sequences: two forwards, one padded
    twin = make()
    histories = {}
    for seq, n in ((0, 3), (1, 11), (2, 0)):
        histories[seq] = History(drafter, seq)
        rows = histories[seq].fresh(n)
        for d in (drafter, twin):
            d.alloc(seq, 100)
            d.prefill(seq, [5] * n, rows)
        histories[seq].add(rows, 0)
    requests = [ProposeRequest(s, 10 + s, h.next_pos, n, want_confidence=True)
                for (s, h), n in zip(histories.items(), (4, 2, 3))]
    batched = drafter.propose(requests)
    for request, got in zip(requests, batched):
        alone = twin.propose([request])[0]
        assert got.tokens == alone.tokens and len(got.tokens) == request.num_drafts
        tokens, _, scale = reference(drafter, histories[request.seq_id], request.last_token, request.num_drafts)
        assert_confidence_close(got.confidence, alone.confidence, scale)
        assert got.tokens == tokens


def test_batched_appends_equal_one_at_a_time_and_the_reference():
    """Commits and catch-ups of several sequences inside `batched_appends` enter their contexts in one
    forward at the block's end; windows slide as they would one call at a time."""
    window = 7
    drafter, twin = make(window=window), make(window=window)
    histories = {s: History(drafter, 40 + s) for s in range(3)}
    for seq, n in ((0, 4), (1, 9), (2, 1)):
        rows = histories[seq].fresh(n)
        for d in (drafter, twin):
            d.alloc(seq, 100)
            d.prefill(seq, [5] * n, rows)
        histories[seq].add(rows, 0)
    for accepts in ((2, 0, 4), (4, 4, 1), (0, 3, 2)):
        verified = {s: histories[s].fresh(GAMMA) for s in histories}
        catchup = histories[2].fresh(1)
        pool = drafter.pool.k.clone()
        with drafter.batched_appends():
            for d_seq, accept in zip(histories, accepts):
                drafter.stash(d_seq, verified[d_seq])
                drafter.commit(d_seq, accept + 1, histories[d_seq].next_pos, [3] * (accept + 1))
                drafter.trim(d_seq, accept)
            drafter.catchup(2, [4], catchup, histories[2].next_pos + accepts[2] + 1)
            assert torch.equal(drafter.pool.k, pool)  # nothing entered yet
        for d_seq, accept in zip(histories, accepts):
            twin.stash(d_seq, verified[d_seq])
            twin.commit(d_seq, accept + 1, histories[d_seq].next_pos, [3] * (accept + 1))
            twin.trim(d_seq, accept)
            histories[d_seq].add(verified[d_seq][:accept + 1], histories[d_seq].next_pos)
        twin.catchup(2, [4], catchup, histories[2].next_pos)
        histories[2].add(catchup, histories[2].next_pos)
        for seq in histories:
            got, alone = snapshot(drafter, seq), snapshot(twin, seq)
            assert got[0] == alone[0] and torch.equal(got[2][0], alone[2][0])  # next_pos, stamped positions
            # Context keys, values: rows entered in one forward or one call at a time go through the
            # fc's 64-term sums, its norm, the k/v projection and k-norm in other orders.
            for x, y in zip(got[2][1:], alone[2][1:]):
                atol = network_atol(y.abs().max().item(), drafter.spec.feature_dim, depth=4)
                torch.testing.assert_close(x, y, atol=atol, rtol=0)
            assert_matches(drafter, seq, histories[seq], 11, GAMMA - 1, window=window)


def test_zero_drafts_and_no_confidence():
    drafter = make()
    for seq in (0, 1):
        drafter.alloc(seq, 10)
        drafter.prefill(seq, [1, 2], torch.randn(2, drafter.spec.feature_dim))
    empty, plain = drafter.propose([ProposeRequest(0, 1, 2, 0), ProposeRequest(1, 1, 2, 2)])
    assert empty.tokens == [] and plain.confidence is None and len(plain.tokens) == 2
    assert drafter.propose([ProposeRequest(0, 1, 2, 0)])[0].tokens == []


def test_bitmask_limits_drafts():
    drafter = make()
    history = History(drafter, 4)
    drafter.alloc(0, 50)
    rows = history.fresh(5)
    drafter.prefill(0, [1] * 5, rows)
    history.add(rows, 0)
    free = propose_one(drafter, 0, 8, 5, GAMMA - 1)
    allowed = torch.zeros(INFO.vocab_size, dtype=torch.bool)
    allowed[[3, 50, 96] + [t + 1 for t in free.tokens]] = True
    allowed[free.tokens] = False
    got = propose_one(drafter, 0, 8, 5, GAMMA - 1, bitmask=bool_to_bitmask(allowed))
    assert all(allowed[t] for t in got.tokens)
    tokens, conf, scale = reference(drafter, history, 8, GAMMA - 1, allowed=allowed)
    assert got.tokens == tokens
    assert_confidence_close(got.confidence, conf, scale)


def test_draft_vocabulary_maps_through_d2t():
    drafter = make(draft_vocab_size=40)
    d2t = drafter.model.d2t
    assert d2t is not None and d2t.numel() == 40
    history = History(drafter, 5)
    drafter.alloc(0, 50)
    rows = history.fresh(6)
    drafter.prefill(0, [1] * 6, rows)
    history.add(rows, 0)
    got = assert_matches(drafter, 0, history, 8, GAMMA - 1)
    targets = set((torch.arange(40) + d2t).tolist())
    assert set(got.tokens) <= targets
    # A target-vocabulary bitmask is mapped into the draft vocabulary before the argmax.
    allowed = torch.zeros(INFO.vocab_size, dtype=torch.bool)
    only = sorted(targets)[7]
    allowed[only] = True
    allowed[sorted(set(range(97)) - targets)[:5]] = True  # unreachable ids change nothing
    assert propose_one(drafter, 0, 8, 6, 3, bitmask=bool_to_bitmask(allowed)).tokens == [only] * 3
    unreachable = torch.zeros(INFO.vocab_size, dtype=torch.bool)
    unreachable[sorted(set(range(97)) - targets)[0]] = True
    with pytest.raises(InvalidRequest):
        propose_one(drafter, 0, 8, 6, 3, bitmask=bool_to_bitmask(unreachable))


def test_sliding_attention_layers_are_causal_with_window():
    drafter = make(layer_types=("sliding_attention", "full_attention"), sliding_window=4)
    history = History(drafter, 6)
    drafter.alloc(0, 50)
    rows = history.fresh(8)
    drafter.prefill(0, [1] * 8, rows)
    history.add(rows, 0)
    assert_matches(drafter, 0, history, 30, GAMMA - 1)
    step(drafter, 0, history, 2)
    assert_matches(drafter, 0, history, 31, GAMMA - 1)


def test_take_and_install_carry_the_context():
    drafter = make(window=8)
    history = History(drafter, 7)
    drafter.alloc(1, 100)
    rows = history.fresh(6)
    drafter.prefill(1, [1] * 6, rows)
    history.add(rows, 0)
    step(drafter, 1, history, 3)
    carried = drafter.take_kv(1)
    assert (carried.rows, carried.last_position) == (8, 9)
    # The source now behaves as freshly allocated.
    drafter.prefill(1, [1], torch.randn(1, drafter.spec.feature_dim))
    drafter.alloc(2, 100)
    installed = drafter.install_kv(2, carried.handle)
    assert (installed.rows, installed.last_position) == (8, 9)
    assert_matches(drafter, 2, history, 12, GAMMA - 1, window=8)
    with pytest.raises(StateConflict):  # the turn continues at last position + 1 only
        drafter.prefill(2, [1], torch.randn(1, drafter.spec.feature_dim), start_pos=11)
    rows = history.fresh(3)
    drafter.prefill(2, [1, 2, 3], rows, start_pos=10)
    history.add(rows, 10)
    assert_matches(drafter, 2, history, 12, GAMMA - 1, window=8)
    with pytest.raises(UnknownSequence):
        drafter.install_kv(2, carried.handle)  # consumed


def test_install_checks_leave_the_handle_usable():
    drafter = make()
    drafter.alloc(1, 100)
    drafter.prefill(1, [1] * 4, torch.randn(4, drafter.spec.feature_dim))
    handle = drafter.take_kv(1).handle
    drafter.prefill(1, [1], torch.randn(1, drafter.spec.feature_dim))
    with pytest.raises(StateConflict):
        drafter.install_kv(1, handle)  # not fresh
    drafter.alloc(2, 3)
    with pytest.raises(CapacityExceeded):
        drafter.install_kv(2, handle)  # 4 positions do not fit a budget of 3
    drafter.free_kv(handle)
    with pytest.raises(UnknownSequence):
        drafter.free_kv(handle)


def test_stash_copies_the_callers_rows():
    drafter = make()
    history = History(drafter, 8)
    drafter.alloc(0, 50)
    rows = history.fresh(4)
    drafter.prefill(0, [1] * 4, rows)
    history.add(rows, 0)
    buffer = history.fresh(GAMMA)
    kept = buffer.clone()
    drafter.stash(0, buffer)
    buffer.zero_()  # the target reuses its verify buffer
    drafter.commit(0, 3, 4, [1, 2, 3])
    history.add(kept[:3], 4)
    assert_matches(drafter, 0, history, 9, GAMMA - 1)


def test_rows_borrowed_in_a_batched_block_are_copied_when_it_ends():
    # Inside batched_appends a stash borrows the caller's rows (valid until the block ends): one that is
    # committed in the block is used before then; one left stashed is copied as the block ends, so the
    # caller may overwrite its buffer afterwards.
    drafter = make()
    history = History(drafter, 8)
    for seq in (0, 1):
        drafter.alloc(seq, 50)
    rows = history.fresh(4)
    for seq in (0, 1):
        drafter.prefill(seq, [1] * 4, rows)
    history.add(rows, 0)
    buffer = history.fresh(2 * GAMMA)
    kept = buffer.clone()
    with drafter.batched_appends():
        drafter.stash(0, buffer[:GAMMA])
        drafter.commit(0, 3, 4, [1, 2, 3])
        drafter.trim(0, 2)
        drafter.stash(1, buffer[GAMMA:])
    buffer.zero_()  # the caller reuses its buffer once the block has ended
    drafter.commit(1, 2, 4, [1, 2])
    both = History(drafter, 8)
    both.add(rows, 0)
    both.add(kept[:3], 4)
    assert_matches(drafter, 0, both, 9, GAMMA - 1)
    other = History(drafter, 8)
    other.add(rows, 0)
    other.add(kept[GAMMA:GAMMA + 2], 4)
    assert_matches(drafter, 1, other, 8, GAMMA - 1)


def snapshot(drafter: DFlashDrafter, seq: int):
    state = drafter.store.get(seq)
    stash = None if state.stash is None else state.stash.clone()
    return state.next_pos, stash, [t.clone() for t in drafter.held(state)]


def assert_same(a, b):
    assert a[0] == b[0]
    assert (a[1] is None) == (b[1] is None) and (a[1] is None or torch.equal(a[1], b[1]))
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


F_DIM = 2 * INFO.hidden_size
def many(d, ids=(0, 1), starts=(0, 3), counts=(3, 3), accepted=(1, 1), pos=(4, 4), tokens=([1, 2], [3, 4]),
         rows=6, width=F_DIM):
    """`commit_verified_many` for sequences 0 and 1 (both at position 4), valid unless told otherwise."""
    d.commit_verified_many(list(ids), torch.randn(rows, width), list(starts), list(counts), list(accepted),
                           list(pos), [list(t) for t in tokens])


BAD_CALLS = [
    ("prefill wrong width", lambda d: d.prefill(0, [1], torch.randn(1, F_DIM + 1), 4), InvalidRequest),
    ("prefill wrong dtype", lambda d: d.prefill(0, [1], torch.randn(1, F_DIM, dtype=torch.float64), 4),
     InvalidRequest),
    ("prefill 1-D rows", lambda d: d.prefill(0, [1], torch.randn(F_DIM), 4), InvalidRequest),
    ("prefill token count", lambda d: d.prefill(0, [1, 2], torch.randn(1, F_DIM), 4), InvalidRequest),
    ("prefill token range", lambda d: d.prefill(0, [97], torch.randn(1, F_DIM), 4), InvalidRequest),
    ("prefill gap", lambda d: d.prefill(0, [1], torch.randn(1, F_DIM), 5), StateConflict),
    ("prefill over budget", lambda d: d.prefill(0, [1] * 17, torch.randn(17, F_DIM), 4), CapacityExceeded),
    ("catchup gap", lambda d: d.catchup(0, [1], torch.randn(1, F_DIM), 3), StateConflict),
    ("catchup negative", lambda d: d.catchup(0, [1], torch.randn(1, F_DIM), -1), InvalidRequest),
    ("stash too many rows", lambda d: d.stash(0, torch.randn(GAMMA + 1, F_DIM)), InvalidRequest),
    ("stash wrong width", lambda d: d.stash(0, torch.randn(2, 5)), InvalidRequest),
    ("commit without stash", lambda d: d.commit(0, 1, 4, [1]), StateConflict),
    ("commit zero rows", lambda d: d.commit(0, 0, 4, []), InvalidRequest),
    ("trim too many", lambda d: d.trim(0, GAMMA), InvalidRequest),
    ("verified too many rows", lambda d: d.commit_verified(0, torch.randn(GAMMA + 1, F_DIM), 0, 4, [1]),
     InvalidRequest),
    ("verified wrong width", lambda d: d.commit_verified(0, torch.randn(2, 5), 0, 4, [1]), InvalidRequest),
    ("verified accepts all rows", lambda d: d.commit_verified(0, torch.randn(3, F_DIM), 3, 4, [1] * 4),
     InvalidRequest),
    ("verified negative", lambda d: d.commit_verified(0, torch.randn(3, F_DIM), -1, 4, []), InvalidRequest),
    ("verified gap", lambda d: d.commit_verified(0, torch.randn(3, F_DIM), 1, 5, [1, 2]), StateConflict),
    ("verified token count", lambda d: d.commit_verified(0, torch.randn(3, F_DIM), 1, 4, [1]), InvalidRequest),
    ("verified token range", lambda d: d.commit_verified(0, torch.randn(3, F_DIM), 1, 4, [1, 97]),
     InvalidRequest),
    ("verified unknown", lambda d: d.commit_verified(9, torch.randn(2, F_DIM), 0, 0, [1]), UnknownSequence),
    # One step's commits in one call: a bad entry anywhere refuses the whole call before any change
    # (sequence 0's entry is valid in each, and sequence 0 must be left as it was).
    ("many: second entry's gap", lambda d: many(d, pos=[4, 5]), StateConflict),
    ("many: second entry's token range", lambda d: many(d, tokens=[[1, 2], [1, 97]]), InvalidRequest),
    ("many: second entry's token count", lambda d: many(d, tokens=[[1, 2], [1]]), InvalidRequest),
    ("many: accepts all rows", lambda d: many(d, accepted=[1, 3], tokens=[[1, 2], [1] * 4]), InvalidRequest),
    ("many: rows past the end", lambda d: many(d, starts=[0, 4]), InvalidRequest),
    ("many: negative row start", lambda d: many(d, starts=[0, -1]), InvalidRequest),
    ("many: too many rows", lambda d: many(d, counts=[3, GAMMA + 1], rows=GAMMA + 4), InvalidRequest),
    ("many: a sequence twice", lambda d: many(d, ids=[0, 0]), InvalidRequest),
    ("many: unknown sequence", lambda d: many(d, ids=[0, 9]), UnknownSequence),
    ("many: a bool position", lambda d: many(d, pos=[4, True]), InvalidRequest),
    ("many: a float count", lambda d: many(d, counts=[3, 3.0]), InvalidRequest),
    ("many: short column", lambda d: many(d, accepted=[1]), InvalidRequest),
    ("many: wrong width", lambda d: many(d, width=5), InvalidRequest),
    ("propose too many drafts", lambda d: propose_one(d, 0, 1, 4, GAMMA), InvalidRequest),
    ("propose wrong position", lambda d: propose_one(d, 0, 1, 5, 2), StateConflict),
    ("propose anchor out of vocab", lambda d: propose_one(d, 0, 97, 4, 2), InvalidRequest),
    ("propose bad bitmask", lambda d: propose_one(d, 0, 1, 4, 2, bitmask=torch.zeros(2, dtype=torch.int32)),
     InvalidRequest),
    ("propose empty bitmask", lambda d: propose_one(d, 0, 1, 4, 2, bitmask=torch.zeros(4, dtype=torch.int32)),
     InvalidRequest),
    ("propose duplicate", lambda d: d.propose([ProposeRequest(0, 1, 4, 1)] * 2), InvalidRequest),
    ("propose unknown in batch", lambda d: d.propose([ProposeRequest(0, 1, 4, 1), ProposeRequest(9, 1, 0, 1)]),
     UnknownSequence),
    ("propose not a request", lambda d: d.propose([(0, 1, 4, 1)]), InvalidRequest),
    ("alloc twice", lambda d: d.alloc(0, 10), AlreadyExists),
    ("alloc zero budget", lambda d: d.alloc(5, 0), InvalidRequest),
    ("free unknown", lambda d: d.free(9), UnknownSequence),
    ("take unknown", lambda d: d.take_kv(9), UnknownSequence),
    ("install unknown handle", lambda d: d.install_kv(0, 123), UnknownSequence),
    ("prefill unknown", lambda d: d.prefill(9, [1], torch.randn(1, F_DIM)), UnknownSequence),
]


@pytest.mark.parametrize("name,call,error", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_raise_and_change_nothing(name, call, error):
    drafter = make()
    history = History(drafter, 9)
    for seq in (0, 1):
        drafter.alloc(seq, 20)
        rows = history.fresh(4)
        drafter.prefill(seq, [1] * 4, rows)
    history.add(rows, 0)
    before = [snapshot(drafter, s) for s in (0, 1)]
    with pytest.raises(error):
        call(drafter)
    for s, snap in zip((0, 1), before):
        assert_same(snapshot(drafter, s), snap)
    assert_matches(drafter, 1, history, 6, GAMMA - 1)


@pytest.mark.parametrize("batched", [False, True])
def test_commit_verified_is_stash_commit_trim(batched):
    """The in-process engine's one call after a verify leaves the drafter as the three verbs do (held
    rows, next position, drafts after it), inside a batched block or not."""
    pair = [make(), make()]
    history = History(pair[0], 11)
    for d in pair:
        d.alloc(0, 60)
    rows = history.fresh(5)
    for d in pair:
        d.prefill(0, [1] * 5, rows)
    history.add(rows, 0)
    position = 5
    for accepted in (2, 0, GAMMA - 1, 4):
        verify = history.fresh(GAMMA)
        tokens = [3] * (accepted + 1)
        three, one = pair
        with (three.batched_appends() if batched else nullcontext()):
            three.stash(0, verify)
            three.commit(0, accepted + 1, position, tokens)
            three.trim(0, accepted)
        with (one.batched_appends() if batched else nullcontext()):
            one.commit_verified(0, verify, accepted, position, tokens)
        history.add(verify[:accepted + 1], position)
        position += accepted + 1
        assert_same(snapshot(one, 0), snapshot(three, 0))
        assert snapshot(one, 0)[1] is None  # nothing left stashed
        assert propose_one(one, 0, 2, position, GAMMA - 1) == propose_one(three, 0, 2, position, GAMMA - 1)
    assert_matches(pair[1], 0, history, 7, GAMMA - 1)


@pytest.mark.parametrize("batched", [False, True])
def test_commit_verified_many_is_commit_verified_per_sequence(batched):
    """One call for a step's sequences (rows picked out of one verify output, some sequences left out)
    leaves every sequence as one `commit_verified` each does."""
    pair = [make(), make()]
    seqs = (0, 1, 2)
    for d in pair:
        for seq in seqs:
            d.alloc(seq, 80)
            d.prefill(seq, [1] * (5 + seq), torch.randn(5 + seq, F_DIM, generator=torch.Generator().manual_seed(seq)))
    position = {seq: 5 + seq for seq in seqs}
    gen = torch.Generator().manual_seed(3)
    for step, accepted in enumerate([(2, 0, GAMMA - 1), (0, 1, 1), (GAMMA - 1, 3, 0)]):
        verify = torch.randn(3 * GAMMA + 2, F_DIM, generator=gen)  # two spare rows: entries skip them
        starts = [0, GAMMA + 1, 2 * GAMMA + 2]
        chosen = [seq for seq in seqs if (seq + step) % 3]  # one sequence sits each step out
        tokens = {seq: [3 + seq] * (accepted[seq] + 1) for seq in seqs}
        one, many = pair
        with (one.batched_appends() if batched else nullcontext()):
            for seq in chosen:
                one.commit_verified(seq, verify[starts[seq]:starts[seq] + GAMMA], accepted[seq], position[seq], tokens[seq])
        with (many.batched_appends() if batched else nullcontext()):
            many.commit_verified_many(chosen, verify, [starts[s] for s in chosen], [GAMMA] * len(chosen),
                                      [accepted[s] for s in chosen], [position[s] for s in chosen],
                                      [tokens[s] for s in chosen])
        for seq in chosen:
            position[seq] += accepted[seq] + 1
        for seq in seqs:
            assert_same(snapshot(many, seq), snapshot(one, seq))
            assert propose_one(many, seq, 2, position[seq], GAMMA - 1) == propose_one(one, seq, 2, position[seq], GAMMA - 1)


def test_failed_commits_keep_the_stash_and_a_valid_commit_follows():
    drafter = make()
    history = History(drafter, 10)
    drafter.alloc(0, 50)
    rows = history.fresh(4)
    drafter.prefill(0, [1] * 4, rows)
    history.add(rows, 0)
    verify = history.fresh(3)
    drafter.stash(0, verify)
    before = snapshot(drafter, 0)
    for call, error in (
        (lambda: drafter.commit(0, 4, 4, [1] * 4), StateConflict),  # more rows than stashed
        (lambda: drafter.commit(0, 2, 5, [1] * 2), StateConflict),  # position gap
        (lambda: drafter.commit(0, 2, 4, [1]), InvalidRequest),  # token count
        (lambda: drafter.commit(0, 2, 4, [1, 200]), InvalidRequest),  # token range
    ):
        with pytest.raises(error):
            call()
        assert_same(snapshot(drafter, 0), before)
    drafter.commit(0, 2, 4, [1, 2])
    history.add(verify[:2], 4)
    assert_matches(drafter, 0, history, 6, GAMMA - 1)
    with pytest.raises(StateConflict):  # the stash is consumed
        drafter.commit(0, 1, 6, [1])


def test_free_releases_the_sequence():
    drafter = make()
    drafter.alloc(3, 10)
    drafter.free(3)
    with pytest.raises(UnknownSequence):
        drafter.free(3)
    drafter.alloc(3, 10)  # the id is reusable


def test_tree_candidates_rank_each_rows_tokens_as_the_drafts_do():
    """`propose_candidates`: each row's K best tokens, best first, the first of each row the plain propose's
    draft, log-probabilities falling; bad requests are refused as `propose` refuses them."""
    from specsplit.shared.errors import InvalidRequest, StateConflict, UnknownSequence

    drafter = make()
    history = History(drafter, 4)
    for seq in (0, 1):
        drafter.alloc(seq, 50)
        drafter.prefill(seq, [1] * 5, history.fresh(5))
    requests = [ProposeRequest(0, 8, 5, GAMMA - 1), ProposeRequest(1, 9, 5, 2)]
    logp, ids = drafter.propose_candidates(requests, 3)
    assert logp.shape == ids.shape == (2, GAMMA - 1, 3)
    assert (logp[:, :, :-1] >= logp[:, :, 1:]).all() and (logp <= 0).all()
    drafts = drafter.propose(requests)
    assert ids[0, :, 0].tolist() == drafts[0].tokens and ids[1, :2, 0].tolist() == drafts[1].tokens
    static = make()  # the same drafter on its static block forward (uncaptured here): the same candidates
    static.use_static_forwards(use_graphs=False)
    again = History(static, 4)
    for seq in (0, 1):
        static.alloc(seq, 50)
        static.prefill(seq, [1] * 5, again.fresh(5))
    got = static.propose_candidates(requests, 3)
    assert static.propose_graphs is not None and torch.equal(got[1], ids)
    torch.testing.assert_close(got[0], logp, atol=1e-5, rtol=1e-5)
    mask = bool_to_bitmask(torch.ones(INFO.vocab_size, dtype=torch.bool))
    for bad, keep, error in (([ProposeRequest(0, 8, 5, 2)], 0, InvalidRequest),  # no candidates a row
                             ([ProposeRequest(0, 8, 5, 0)], 3, InvalidRequest),  # no rows
                             ([], 3, InvalidRequest),
                             ([ProposeRequest(0, 8, 5, 2, bitmask=mask)], 3, InvalidRequest),
                             ([ProposeRequest(0, 8, 4, 2)], 3, StateConflict),  # not at the anchor's position
                             ([ProposeRequest(7, 8, 5, 2)], 3, UnknownSequence)):
        with pytest.raises(error):
            drafter.propose_candidates(bad, keep)
