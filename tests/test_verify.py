"""Greedy and sampled verification: accept/recover/bonus tables, losslessness, seeded reproducibility."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_sampling import CHI2_CRITICAL_P001, chi_square

from specsplit.shared.errors import InvalidRequest
from specsplit.shared.sampling import SamplingParams, make_generator, target_probs
from specsplit.shared.verify import (
    PLACEHOLDER_TOKEN_ID,
    VerifyResult,
    verify_greedy,
    verify_greedy_batched,
    verify_sampled,
)

VOCAB = 10
SAMPLED = SamplingParams(temperature=1.0)


@pytest.fixture(autouse=True)
def one_thread():
    """Verify runs many tiny per-sequence ops: waking OpenMP workers on a busy host costs more
    than the ops themselves (milliseconds per softmax), so run them on the calling thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def logits_with_argmax(argmax: list[list[int]], vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat target logits whose row argmaxes are `argmax` (one list per sequence), and cu_rows."""
    flat = [t for seq in argmax for t in seq]
    logits = torch.randn(len(flat), vocab, generator=torch.Generator().manual_seed(len(flat)))
    logits[torch.arange(len(flat)), torch.tensor(flat, dtype=torch.long)] = 10.0
    cu_rows = torch.tensor([0] + [len(seq) for seq in argmax]).cumsum(0)
    return logits, cu_rows


def cu_rows_for(drafts: list[list[int]]) -> torch.Tensor:
    return torch.tensor([0] + [len(d) + 1 for d in drafts]).cumsum(0)


# --- greedy --------------------------------------------------------------------------------------

GREEDY_CASES = [
    # drafts, target argmax per row, emitted tokens
    ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5]]),  # mismatch at slot 1: recovered 5
    ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),  # all accepted: bonus 4
    ([[1]], [[2, 3]], [[2]]),  # first draft rejected
    ([[]], [[5]], [[5]]),  # k = 0: just the target's token
    ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4]]),
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]], [[1, 2, 7], [4, 8]]),
    ([[1, 2], [], [3, 4], [7]], [[9, 2, 5], [7], [3, 4, 0], [7, 7]], [[9], [7], [3, 4, 0], [7, 7]]),
]


@pytest.mark.parametrize("drafts, argmax, expected", GREEDY_CASES)
def test_verify_greedy_table(drafts, argmax, expected):
    logits, cu_rows = logits_with_argmax(argmax)
    result = verify_greedy(drafts, logits, cu_rows)
    assert result == VerifyResult(num_accepted=[len(t) - 1 for t in expected], tokens=expected)


@pytest.mark.parametrize("drafts, argmax, expected", GREEDY_CASES)
def test_greedy_params_in_verify_sampled_use_greedy_acceptance(drafts, argmax, expected):
    logits, cu_rows = logits_with_argmax(argmax)
    generators = [make_generator(0, "cpu") for _ in drafts]
    states = [g.get_state() for g in generators]
    assert verify_sampled(drafts, logits, cu_rows, SamplingParams(), generators).tokens == expected
    # Greedy sequences draw no random numbers.
    assert all(torch.equal(g.get_state(), s) for g, s in zip(generators, states))


@pytest.mark.parametrize("drafts, argmax, expected", GREEDY_CASES)
def test_greedy_acceptance_from_an_argmax_the_caller_read(drafts, argmax, expected):
    """The engine reads the argmax back with the drafts in one wait; greedy acceptance follows it, not
    the logits (given a different argmax, different tokens), and a wrong count is refused."""
    logits, cu_rows = logits_with_argmax(argmax)
    flat = [a for row in argmax for a in row]
    generators = [make_generator(0, "cpu") for _ in drafts]
    assert verify_sampled(drafts, logits, cu_rows, SamplingParams(), generators, target_argmax=flat).tokens == expected
    shifted = [a + 1 for a in flat]  # every sequence's first emitted token then changes
    assert verify_sampled(drafts, logits, cu_rows, SamplingParams(), generators, target_argmax=shifted).tokens != expected
    with pytest.raises(InvalidRequest, match="argmax values"):
        verify_sampled(drafts, logits, cu_rows, SamplingParams(), generators, target_argmax=flat[:-1])


@pytest.mark.parametrize("drafts, argmax, expected", GREEDY_CASES)
def test_batched_greedy_table(drafts, argmax, expected):
    logits, cu_rows = logits_with_argmax(argmax)
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
    num_accepted, tokens = verify_greedy_batched(flat, logits, cu_rows)
    width = max(len(a) for a in argmax)
    padded = [t + [PLACEHOLDER_TOKEN_ID] * (width - len(t)) for t in expected]
    assert num_accepted.tolist() == [len(t) - 1 for t in expected]
    assert tokens.tolist() == padded


def test_batched_greedy_equals_the_loop_on_random_ragged_batches():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        num_seqs = int(torch.randint(1, 7, (1,), generator=gen))
        ks = torch.randint(0, 6, (num_seqs,), generator=gen).tolist()
        cu_rows = torch.tensor([0] + [k + 1 for k in ks]).cumsum(0)
        logits = torch.randn(int(cu_rows[-1]), 5, generator=gen)
        argmax = logits.argmax(-1)
        # Drafts mostly copy the argmax so that long accepted runs and bonuses occur.
        drafts = [
            [
                int(argmax[s + j])
                if torch.rand(1, generator=gen) < 0.8
                else int(torch.randint(0, 5, (1,), generator=gen))
                for j in range(k)
            ]
            for s, k in zip(cu_rows.tolist(), ks)
        ]
        reference = verify_greedy(drafts, logits, cu_rows)
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
        num_accepted, tokens = verify_greedy_batched(flat, logits, cu_rows)
        assert num_accepted.tolist() == reference.num_accepted
        assert [row[: a + 1] for row, a in zip(tokens.tolist(), reference.num_accepted)] == reference.tokens
        assert all(
            t == PLACEHOLDER_TOKEN_ID for row, a in zip(tokens.tolist(), reference.num_accepted) for t in row[a + 1 :]
        )


# --- sampled: degenerate cases -------------------------------------------------------------------


def test_sampled_accepts_every_draft_when_p_equals_q():
    drafts = [[3, 1, 4], [1, 5]]
    cu_rows = cu_rows_for(drafts)
    logits = torch.randn(int(cu_rows[-1]), VOCAB, generator=torch.Generator().manual_seed(3))
    p = target_probs(logits, SAMPLED)
    q = [p[0:3], p[4:6]]  # the draft distribution is the target's own
    for seed in range(200):
        generators = [make_generator(seed, "cpu"), make_generator(seed + 1000, "cpu")]
        result = verify_sampled(drafts, logits, cu_rows, SAMPLED, generators, draft_probs=q)
        assert result.num_accepted == [3, 2]
        assert [t[:-1] for t in result.tokens] == drafts


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_sampled_always_rejects_a_draft_the_target_forbids(with_draft_probs):
    drafts = [[2, 6]]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    logits[0, 2] = -math.inf  # p(d_0) = 0
    q = (
        [torch.softmax(torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5)), -1)]
        if with_draft_probs
        else None
    )
    for seed in range(300):
        result = verify_sampled(drafts, logits, cu_rows_for(drafts), SAMPLED, [make_generator(seed, "cpu")], q)
        assert result.num_accepted == [0]
        assert result.tokens[0][0] != 2


def test_sampled_one_hot_recovered_token_never_equals_the_rejected_draft():
    # p(d_0) = 0.9: most drafts pass; each rejection must recover one of the other tokens.
    logits = torch.full((2, 4), -math.inf)
    logits[0] = torch.tensor([0.9, 0.05, 0.05, 0.0]).log()
    logits[1, 3] = 0.0
    rejections = 0
    for seed in range(400):
        result = verify_sampled([[0]], logits, cu_rows_for([[0]]), SAMPLED, [make_generator(seed, "cpu")])
        if result.num_accepted == [0]:
            rejections += 1
            assert result.tokens[0][0] in (1, 2)
        else:
            assert result.tokens == [[0, 3]]  # the bonus row allows token 3 only
    assert 15 < rejections < 80  # about 10% of 400


def test_sampled_one_hot_accepts_a_draft_of_target_probability_one():
    logits = torch.full((3, VOCAB), -math.inf)
    logits[0, 4] = logits[1, 7] = logits[2, 1] = 0.0
    for seed in range(50):
        result = verify_sampled([[4, 7]], logits, cu_rows_for([[4, 7]]), SAMPLED, [make_generator(seed, "cpu")])
        assert result.tokens == [[4, 7, 1]]


def test_sampled_k0_samples_one_token_from_the_target():
    logits = torch.full((2, VOCAB), -math.inf)
    logits[0, 8] = 0.0
    logits[1, 2:4] = 0.0
    result = verify_sampled(
        [[], []], logits, cu_rows_for([[], []]), SAMPLED, [make_generator(s, "cpu") for s in (0, 1)]
    )
    assert result.num_accepted == [0, 0]
    assert result.tokens[0] == [8] and result.tokens[1][0] in (2, 3)


# --- sampled: random-number protocol and reproducibility -----------------------------------------


def _random_batch(drafts: list[list[int]], seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(len(d) + 1 for d in drafts), VOCAB, generator=gen)
    q = [torch.softmax(torch.randn(len(d), VOCAB, generator=gen), -1) for d in drafts]
    return logits, q


def test_same_seed_same_tokens_and_different_seeds_differ():
    drafts = [[1, 2, 3, 4], [5, 6], [7]]
    logits, q = _random_batch(drafts, seed=6)
    params = SamplingParams(temperature=1.3)

    def run(seed: int) -> list[list[int]]:
        generators = [make_generator(seed + i, "cpu") for i in range(3)]
        return verify_sampled(drafts, logits, cu_rows_for(drafts), params, generators, q).tokens

    assert run(10) == run(10)
    assert len({str(run(seed)) for seed in range(20)}) > 1


def test_a_request_gets_the_same_tokens_whatever_else_is_in_the_batch():
    drafts = [[9, 0, 3], [1], [], [4, 4]]
    logits, q = _random_batch(drafts, seed=7)
    cu = cu_rows_for(drafts).tolist()
    mixed = [SamplingParams(temperature=0.8, top_k=5), SamplingParams(), SamplingParams(temperature=1.0), SAMPLED]
    for seed in range(30):
        batch = verify_sampled(
            drafts, logits, cu_rows_for(drafts), mixed, [make_generator(seed, "cpu") for _ in drafts], q
        )
        for i, d in enumerate(drafts):
            alone = verify_sampled(
                [d], logits[cu[i] : cu[i + 1]], cu_rows_for([d]), mixed[i], [make_generator(seed, "cpu")], [q[i]]
            )
            assert alone.tokens[0] == batch.tokens[i]


def test_vectorised_sampling_equals_the_per_sequence_reference():
    """Mixed batches (greedy, temperature, top-k, top-p, both; k = 0..5; one-hot and shipped draft
    distributions; generators shared between sequences) emit exactly the reference's tokens."""
    choices = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.2, top_k=3),
               SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.9, top_k=4, top_p=0.8)]
    rng = torch.Generator().manual_seed(99)
    rejected = 0
    for trial in range(150):
        num = int(torch.randint(1, 7, (1,), generator=rng))
        drafts = [torch.randint(0, VOCAB, (int(torch.randint(0, 6, (1,), generator=rng)),), generator=rng).tolist()
                  for _ in range(num)]
        logits, q = _random_batch(drafts, seed=1000 + trial)
        q = [qi if int(torch.randint(0, 2, (1,), generator=rng)) else None for qi in q]
        params = [choices[int(torch.randint(0, len(choices), (1,), generator=rng))] for _ in drafts]
        shared = make_generator(trial, "cpu")
        outputs = []
        for per_sequence in (False, True):
            gens = [shared if i % 2 else make_generator(trial * 10 + i, "cpu") for i in range(num)]
            shared.manual_seed(trial)
            outputs.append(verify_sampled(drafts, logits, cu_rows_for(drafts), params, gens, q,
                                          per_sequence=per_sequence).tokens)
        assert outputs[0] == outputs[1], trial
        rejected += sum(len(t) - 1 < len(d) for t, d in zip(outputs[0], drafts))
    assert rejected > 50  # rejections, recoveries and bonus tokens were all exercised


def test_sampling_on_the_device_equals_verify_sampled_with_no_drafts():
    """`sample_tokens` (a decode step launched ahead samples its tokens on the device, nothing read
    back) gives each sequence the token verify_sampled gives it with no drafts, from the same uniform;
    rows in any order, mixed params, each generator advanced as verify_sampled advances it."""
    from specsplit.shared.verify import sample_tokens

    choices = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.2, top_k=3),
               SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.9, top_k=4, top_p=0.8)]
    rng = torch.Generator().manual_seed(7)
    for trial in range(60):
        num = int(torch.randint(1, 7, (1,), generator=rng))
        logits = torch.randn(num + 2, VOCAB, generator=rng) * 3
        rows = torch.randperm(num + 2, generator=rng)[:num].tolist()
        params = [choices[int(torch.randint(0, len(choices), (1,), generator=rng))] for _ in range(num)]
        ahead = [make_generator(trial * 10 + i, "cpu") for i in range(num)]
        steps = [make_generator(trial * 10 + i, "cpu") for i in range(num)]
        for _ in range(2):  # twice: the generators stay in step
            got = sample_tokens(logits, rows, params, ahead).tolist()
            want = verify_sampled([[] for _ in rows], logits[rows], cu_rows_for([[] for _ in rows]), params, steps).tokens
            assert got == [t[0] for t in want], trial


@pytest.mark.parametrize("k", [0, 1, 4])
def test_a_sampled_sequence_draws_exactly_k_plus_1_uniforms(k):
    drafts = [[3] * k]
    logits, _ = _random_batch(drafts, seed=8)
    used, reference = make_generator(21, "cpu"), make_generator(21, "cpu")
    verify_sampled(drafts, logits, cu_rows_for(drafts), SAMPLED, [used])
    torch.rand(k + 1, generator=reference)
    assert torch.equal(used.get_state(), reference.get_state())


# --- sampled: losslessness -----------------------------------------------------------------------

LOSSLESS_VOCAB = 6
TRIALS = 20_000


def _world(seed: int) -> SimpleNamespace:
    """A fixed target and drafter over a 6-token vocabulary; each row depends on the token before it."""
    gen = torch.Generator().manual_seed(seed)
    v = LOSSLESS_VOCAB
    return SimpleNamespace(
        target0=torch.randn(v, generator=gen),  # [V] logits for slot 0
        target1=torch.randn(v, v, generator=gen),  # [V, V] logits for slot 1, by d_0
        target2=torch.randn(v, v, generator=gen),  # [V, V] bonus-row logits, by d_1
        draft0=torch.softmax(torch.randn(v, generator=gen), -1),  # [V] q for slot 0
        draft1=torch.softmax(torch.randn(v, v, generator=gen), -1),  # [V, V] q for slot 1, by d_0
    )


def _run_trials(world: SimpleNamespace, params: SamplingParams, one_hot: bool) -> tuple[torch.Tensor, VerifyResult]:
    """TRIALS independent two-draft steps in one batch → (drafts [TRIALS, 2], result)."""
    gen = torch.Generator().manual_seed(99)
    if one_hot:  # a greedy drafter: the draft is a fixed function of the context
        d0 = world.draft0.argmax().expand(TRIALS)
        d1 = world.draft1.argmax(-1)[d0]
    else:
        d0 = torch.multinomial(world.draft0, TRIALS, replacement=True, generator=gen)
        d1 = torch.multinomial(world.draft1[d0], 1, generator=gen).squeeze(1)
    rows = torch.stack([world.target0.expand(TRIALS, -1), world.target1[d0], world.target2[d1]], dim=1)
    drafts = torch.stack([d0, d1], dim=1)  # [TRIALS, 2]
    q = None if one_hot else list(torch.stack([world.draft0.expand(TRIALS, -1), world.draft1[d0]], dim=1))
    cu_rows = torch.arange(0, 3 * TRIALS + 1, 3)
    generator = make_generator(1234, "cpu")  # shared: the protocol consumes it in sequence order
    result = verify_sampled(drafts.tolist(), rows.reshape(-1, LOSSLESS_VOCAB), cu_rows, params, [generator] * TRIALS, q)
    return drafts, result


def _first_token_statistic(world, params, result) -> tuple[float, int]:
    counts = torch.bincount(torch.tensor([t[0] for t in result.tokens]), minlength=LOSSLESS_VOCAB)
    return chi_square(counts, target_probs(world.target0[None], params)[0])


def _later_token_statistic(logits_by_prev, position, params, drafts, result) -> tuple[float, int]:
    """Once drafts 0..position-1 were accepted, the token emitted at `position` must follow
    p(· | the draft before it): one chi-square per previous draft, summed."""
    probs = target_probs(logits_by_prev, params)  # [V, V]
    reached = torch.tensor(result.num_accepted) >= position
    emitted = torch.tensor([t[position] if len(t) > position else -1 for t in result.tokens])
    stat, df = 0.0, 0
    for prev in range(LOSSLESS_VOCAB):
        group = reached & (drafts[:, position - 1] == prev)
        if group.sum() < 200:  # too few for the chi-square approximation
            continue
        s, d = chi_square(torch.bincount(emitted[group], minlength=LOSSLESS_VOCAB), probs[prev])
        stat, df = stat + s, df + d
    return stat, df


LOSSLESS_CASES = {
    "draft_probs": (SamplingParams(temperature=1.0), False),
    "one_hot": (SamplingParams(temperature=1.0), True),
    # Filters chosen so that each cuts tokens from row 0 yet leaves several (df >= 2).
    "filtered_draft_probs": (SamplingParams(temperature=1.5, top_k=4, top_p=0.9), False),
    "filtered_one_hot": (SamplingParams(temperature=3.0, top_k=5, top_p=0.8), True),
}


@pytest.mark.parametrize("case", LOSSLESS_CASES)
def test_emitted_tokens_follow_the_target_distribution(case):
    params, one_hot = LOSSLESS_CASES[case]
    world = _world(seed=3)
    drafts, result = _run_trials(world, params, one_hot)
    stat, df = _first_token_statistic(world, params, result)
    assert stat < CHI2_CRITICAL_P001[df], f"first token: chi2 {stat:.1f} with {df} df"
    # Second token: recovered at slot 1 or d_1 itself; third: the bonus token (row 2 follows d_1).
    for position, table in ((1, world.target1), (2, world.target2)):
        stat, df = _later_token_statistic(table, position, params, drafts, result)
        assert df > 0, f"too few trials reached position {position}"
        assert stat < CHI2_CRITICAL_P001[df], f"token {position}: chi2 {stat:.1f} with {df} df"


def test_the_lossless_check_can_tell_the_draft_from_the_target():
    # Power check: the same statistic rejects emitted tokens that followed the draft instead.
    world = _world(seed=3)
    gen = torch.Generator().manual_seed(5)
    as_drafted = torch.multinomial(world.draft0, TRIALS, replacement=True, generator=gen)
    counts = torch.bincount(as_drafted, minlength=LOSSLESS_VOCAB)
    stat, df = chi_square(counts, target_probs(world.target0[None], SAMPLED)[0])
    assert stat > CHI2_CRITICAL_P001[df]


# --- validation ----------------------------------------------------------------------------------


def _bad_calls():
    logits = torch.randn(5, VOCAB)
    ok_cu = torch.tensor([0, 3, 5])
    gens = [make_generator(0, "cpu"), make_generator(1, "cpu")]
    drafts = [[1, 2], [3]]
    return {
        "cu_rows too short": lambda: verify_sampled(drafts, logits, torch.tensor([0, 5]), SAMPLED, gens),
        "cu_rows not from 0": lambda: verify_sampled(drafts, logits, torch.tensor([1, 3, 5]), SAMPLED, gens),
        "cu_rows past the rows": lambda: verify_sampled(drafts, logits, torch.tensor([0, 3, 6]), SAMPLED, gens),
        "cu_rows float": lambda: verify_sampled(drafts, logits, ok_cu.float(), SAMPLED, gens),
        "rows disagree with drafts": lambda: verify_sampled([[1], [3, 4]], logits, ok_cu, SAMPLED, gens),
        "draft out of vocab": lambda: verify_sampled([[1, VOCAB], [3]], logits, ok_cu, SAMPLED, gens),
        "negative draft": lambda: verify_greedy([[1, -1], [3]], logits, ok_cu),
        "1-D logits": lambda: verify_greedy([[]], torch.randn(VOCAB), torch.tensor([0, 1])),
        "integer logits": lambda: verify_greedy(drafts, logits.long(), ok_cu),
        "one generator short": lambda: verify_sampled(drafts, logits, ok_cu, SAMPLED, gens[:1]),
        "params list short": lambda: verify_sampled(drafts, logits, ok_cu, [SAMPLED], gens),
        "draft_probs list short": lambda: verify_sampled(drafts, logits, ok_cu, SAMPLED, gens, [None]),
        "draft_probs wrong shape": lambda: verify_sampled(
            drafts, logits, ok_cu, SAMPLED, gens, [torch.rand(1, VOCAB), None]
        ),
        "draft_probs zero on the draft": lambda: verify_sampled(
            drafts, logits, ok_cu, SAMPLED, gens, [torch.zeros(2, VOCAB), None]
        ),
        "batched: drafts disagree with rows": lambda: verify_greedy_batched(torch.tensor([1, 2]), logits, ok_cu),
        "batched: non-monotone cu_rows": lambda: verify_greedy_batched(
            torch.tensor([1, 2, 3]), logits, torch.tensor([0, 0, 5])
        ),
        "batched: draft out of vocab": lambda: verify_greedy_batched(torch.tensor([1, 2, VOCAB]), logits, ok_cu),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_malformed_batches_raise_invalid_request(name):
    with pytest.raises(InvalidRequest):
        _bad_calls()[name]()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_verify_on_cuda_is_seeded_and_matches_batched_greedy():
    drafts = [[1, 2, 3], [], [4, 5]]
    logits, q = _random_batch(drafts, seed=9)
    logits, q, cu_rows = logits.cuda(), [t.cuda() for t in q], cu_rows_for(drafts).cuda()

    def run() -> list[list[int]]:
        generators = [make_generator(7 + i, "cuda") for i in range(3)]
        return verify_sampled(drafts, logits, cu_rows, SAMPLED, generators, q).tokens

    assert run() == run()
    num_accepted, _ = verify_greedy_batched(torch.tensor([1, 2, 3, 4, 5], device="cuda"), logits, cu_rows)
    assert num_accepted.tolist() == verify_greedy(drafts, logits, cu_rows).num_accepted
    with pytest.raises(InvalidRequest):
        verify_sampled(drafts, logits, cu_rows, SAMPLED, [make_generator(0, "cpu")] * 3, q)


@pytest.mark.parametrize("ragged", [False, True])  # each sequence offering its own number of drafts
@pytest.mark.parametrize("k", [1, 4])
def test_sample_accept_on_the_device_equals_verify_sampled(k, ragged):
    """The chained step's sampled acceptance (`sample_accept`: every tensor stays where it is) emits
    what `verify_sampled` emits for one-hot drafts: same accepted counts, same tokens, from generators
    in the same states, with requests of three sampling settings in one batch and drafts taken from the
    likely tokens (long accepted runs) or not (early rejections)."""
    from specsplit.shared.verify import sample_accept

    gen = torch.Generator().manual_seed(k)
    count, vocab = 24, 40
    logits = torch.randn(count, k + 1, vocab, generator=gen) * 3
    likely = logits[:, :k].argmax(-1)
    drafts = torch.where(torch.rand(count, k, generator=gen) < 0.8, likely, torch.randint(0, vocab, (count, k), generator=gen))
    settings = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
                SamplingParams(temperature=1.2, top_p=0.8)]
    params = [settings[i % 3] for i in range(count)]
    counts = [i % (k + 1) for i in range(count)] if ragged else [k] * count
    for i, n in enumerate(counts):  # rows past a sequence's count are not read: NaN there changes nothing
        logits[i, n + 1:] = float("nan")
    accepted, tokens = sample_accept(drafts, logits, params, [make_generator(100 + i, "cpu") for i in range(count)],
                                     counts if ragged else None)
    offered = [d[:n] for d, n in zip(drafts.tolist(), counts)]
    rows = torch.cat([logits[i, :n + 1] for i, n in enumerate(counts)])
    bounds = torch.tensor([0] + counts).cumsum(0) + torch.arange(count + 1)
    want = verify_sampled(offered, rows, bounds, params, [make_generator(100 + i, "cpu") for i in range(count)])
    assert accepted.tolist() == want.num_accepted
    assert [d[:a] + [t] for d, a, t in zip(drafts.tolist(), accepted.tolist(), tokens.tolist())] == want.tokens
    assert 0 in want.num_accepted and max(want.num_accepted) >= min(k, 2)
