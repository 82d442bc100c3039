"""Draft-tree scores (`drafter_service.tree_scores`): what they keep, how they are fitted, shipped and refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specsplit.drafter_service.checkpoint import load_drafter, random_drafter, save_dflash
from specsplit.drafter_service.tree_scores import PAST_END, SCORES_FILE, TreeScores, fit, read_tree_scores
from specsplit.local import target_head, target_info
from specsplit.shared.errors import CheckpointError
from specsplit.shared.tree import best_first, matched
from specsplit.target_service.model import load_target
from specsplit.tree_eval import TreePolicy


def scores(rows: int, seed: int = 0) -> TreeScores:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, generator=g) * 2
    b = torch.rand(rows, generator=g) * 3 + 0.2
    c = torch.randn(rows, generator=g)
    return TreeScores(tuple(a.tolist()), tuple(b.tolist()), tuple(c.tolist()))


def candidates(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(rows, 64, generator=g) * 3, -1).topk(width, -1).values


def test_scores_keep_each_rows_order_and_stay_below_their_parents():
    s = scores(5)
    for seed in range(5):
        logp = candidates(5, 8, seed)
        got = s.apply(logp)
        assert got.shape == logp.shape and bool((got < 0).all())
        assert bool((got[:, :-1] >= got[:, 1:]).all())  # each row still best first: the chain is each row's best
    # rows past the scores' are refused, fewer are scored by their own row's parameters
    with pytest.raises(CheckpointError):
        s.apply(candidates(6, 8))
    assert torch.equal(s.apply(candidates(5, 8)[:3]), s.apply(candidates(5, 8))[:3])


def synthetic(anchors: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of two rows, two candidates each, the drafter saying 0.6 / 0.4 in both rows; the target takes row
    0's best 60 % of the time, and where a tree reached row 1, its best 95 % (the drafter under-sure there)."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.tensor([[0.6, 0.4], [0.6, 0.4]]).log().expand(anchors, -1, -1).clone()
    first = (torch.rand(anchors, generator=g) >= 0.6).long()
    second = (torch.rand(anchors, generator=g) >= 0.95).long()
    return logp, torch.stack([first, second], 1)


def test_fitted_scores_grow_the_tree_that_accepts_more():
    """Raw log-probabilities spend a two-node tree on row 0's runner-up (0.4 against 0.6 x 0.6); the fitted scores
    know row 1's best is the target's 95 % of the time and go down the chain instead, accepting more."""
    logp, ranks = synthetic(4000)
    fitted = fit(logp, ranks)
    assert fitted == fit(logp, ranks)  # deterministic
    assert fitted.fit == {"anchors": 4000, "rows": 2, "keep": 2}
    ids = [[10, 11], [20, 21]]
    raw = best_first(logp[0].tolist(), ids, 2)
    scored = best_first(fitted.apply(logp[0]).tolist(), ids, 2)
    assert raw.tokens == (10, 11) and scored.tokens == (10, 20)
    test_logp, test_ranks = synthetic(4000, seed=1)

    def accepted(tree):
        return sum(matched(tree, [ids[j][r] for j, r in enumerate(row)]) for row in test_ranks.tolist())

    assert accepted(scored) > 1.1 * accepted(raw)
    # a row past its continuation's end has no token to miss: left out, it leaves row 1's odds as they are
    reaching = (ranks[:, 0] == 0).nonzero().squeeze(1)[:800]
    for past, row_1 in ((PAST_END, (0.92, 0.98)), (-1, (0.5, 0.8))):
        cut = ranks.clone()
        cut[reaching, 1] = past
        best = fit(logp, cut).apply(logp[0])[1, 0].exp()
        assert row_1[0] < best < row_1[1], past
    with pytest.raises(ValueError):
        fit(logp, ranks[:, :1])


def test_scores_round_trip_and_a_checkpoint_ships_them(tiny_llama_dir, tmp_path):
    model = load_target(tiny_llama_dir)
    drafter = random_drafter("dflash", target_info(model), target_head(model), seed=0, block_size=4)
    folder = tmp_path / "ckpt"
    save_dflash(folder, drafter)
    assert read_tree_scores(folder, 3) is None
    assert load_drafter(folder, target_head(model), target_info=target_info(model)).tree_scores is None
    s = scores(3)
    s.save(folder)
    assert read_tree_scores(folder, 3) == s
    loaded = load_drafter(folder, target_head(model), target_info=target_info(model))
    assert loaded.tree_scores == s
    save_dflash(folder, drafter)  # new weights in the folder: the scores fitted to the old ones go
    assert read_tree_scores(folder, 3) is None


def test_a_drafter_answers_its_candidates_scored(tiny_llama_dir):
    """Eager and from the static block forward alike: the scored candidates are the scores of the unscored
    ones, same ids, and trees grown from them are what the policy with those scores grows. Scores are set before
    the drafter answers: a captured step would go on scoring as it was captured."""
    from specsplit.shared.errors import StateConflict
    from specsplit.shared.proposer import ProposeRequest

    model = load_target(tiny_llama_dir)
    s = scores(3, seed=2)

    def drafter_with(tree_scores, static):
        drafter = random_drafter("dflash", target_info(model), target_head(model), seed=0, block_size=4)
        drafter.use_tree_scores(tree_scores)
        if static:
            drafter.use_static_forwards(use_graphs=False)
        g = torch.Generator().manual_seed(0)
        for n, prompt in enumerate([[5, 6, 7, 8], [30, 31, 32]]):
            drafter.alloc(n, 50)
            drafter.prefill(n, prompt, torch.randn(len(prompt), drafter.spec.feature_dim, generator=g))
        return drafter

    requests = [ProposeRequest(seq_id=0, last_token=9, position=4, num_drafts=3),
                ProposeRequest(seq_id=1, last_token=33, position=3, num_drafts=3)]
    for static in (False, True):
        raw, raw_ids = drafter_with(None, static).propose_candidates(requests, 8)
        drafter = drafter_with(s, static)
        got, ids = drafter.propose_candidates(requests, 8)
        assert torch.equal(ids, raw_ids) and torch.allclose(got, s.apply(raw)) and not torch.allclose(got, raw)
        policy = TreePolicy(budget=6, keep=8, scores=s)
        assert policy.tree(raw[0], ids[0]) == best_first(got[0].tolist(), ids[0].tolist(), 6)
        drafter.use_tree_scores(s)  # (the same: nothing changes)
        with pytest.raises(StateConflict):
            drafter.use_tree_scores(None)
    with pytest.raises(CheckpointError):
        drafter_with(scores(4), False)


@pytest.mark.parametrize("bad", [
    "not json {",
    json.dumps([1, 2]),
    json.dumps({"format": "other", "a": [0.0], "b": [1.0], "c": [0.0]}),
    json.dumps({"format": "specsplit-tree-scores/1", "a": [0.0, 0.0], "b": [1.0], "c": [0.0]}),
    json.dumps({"format": "specsplit-tree-scores/1", "a": [0.0], "b": [0.0], "c": [0.0]}),
    json.dumps({"format": "specsplit-tree-scores/1", "a": [0.0], "b": [-1.0], "c": [0.0]}),
    json.dumps({"format": "specsplit-tree-scores/1", "a": [True], "b": [1.0], "c": [0.0]}),
    json.dumps({"format": "specsplit-tree-scores/1", "a": ["0"], "b": [1.0], "c": [0.0]}),
    json.dumps({"format": "specsplit-tree-scores/1", "a": [], "b": [], "c": []}),
    '{"format": "specsplit-tree-scores/1", "a": [NaN], "b": [1.0], "c": [0.0]}',
    '{"format": "specsplit-tree-scores/1", "a": [0.0], "b": [Infinity], "c": [0.0]}',
    json.dumps({"format": "specsplit-tree-scores/1", "a": [0.0], "b": [1.0], "c": [0.0], "fit": 3}),
    json.dumps({"format": "specsplit-tree-scores/1", "a": [0.0] * 2, "b": [1.0] * 2, "c": [0.0] * 2}),  # rows
    '{"format": "specsplit-tree-scores/1", "a": [1' + "0" * 400 + '], "b": [1.0], "c": [0.0]}',  # past a float
    json.dumps({"format": "specsplit-tree-scores/1", "a": [0.0], "b": [1e300], "c": [0.0]}),  # inf in float32
    json.dumps({"format": "specsplit-tree-scores/1", "a": [0.0], "b": [1e-300], "c": [0.0]}),  # 0 in float32
    json.dumps({"format": "specsplit-tree-scores/1", "a": [1e39], "b": [1.0], "c": [0.0]}),
    "[" * 100_000 + "]" * 100_000,  # nested past the parser's recursion
    b"\xff\xfe not text",
])
def test_malformed_scores_refuse_the_checkpoint_with_the_reason(tiny_llama_dir, tmp_path, bad):
    model = load_target(tiny_llama_dir)
    drafter = random_drafter("dflash", target_info(model), target_head(model), seed=0, block_size=2)
    folder = tmp_path / "ckpt"
    save_dflash(folder, drafter)
    (folder / SCORES_FILE).write_bytes(bad if isinstance(bad, bytes) else bad.encode())
    with pytest.raises(CheckpointError, match=SCORES_FILE):
        load_drafter(folder, target_head(model), target_info=target_info(model))
    shutil.rmtree(folder)


@pytest.mark.slow
def test_the_shipped_drafters_scored_trees_decode_as_their_walk(smollm2, smollm2_tokenizer):
    """The shipped checkpoint's tree scores through eval-acceptance's engine (eager tree steps on the CPU): every
    token the target's, and exactly the steps of the scored trees' teacher-forced walk, which over these prompts'
    tokens differs from the unscored trees' walk (an engine growing trees from the raw log-probabilities would
    not match it)."""
    from specsplit.evaluate import EvalPrompt, EvalSettings, evaluate
    from specsplit.local import LocalSetup, make_drafter
    from specsplit.target_service.dense import generate
    from specsplit.train_data import HELDOUT_PATH, read_prompts
    from specsplit.tree_eval import walk

    drafter = make_drafter("dflash", smollm2, LocalSetup(drafter="dflash", device="cpu", dtype="float32"))
    assert drafter.tree_scores is not None  # the checkpoint ships them
    prompts = [EvalPrompt(p.kind, p.encode(smollm2_tokenizer)) for p in read_prompts(HELDOUT_PATH)[:4]]
    rep = evaluate(smollm2, drafter, prompts, EvalSettings(max_tokens=32, batch=4, draft_tree=15))
    tree_walk = rep["teacher_forced"]["tree_walk"]
    assert rep["mismatches"] == 0 and tree_walk["steps"] == rep["steps"] - len(prompts)
    policies = [TreePolicy(budget=15, keep=8, scores=drafter.tree_scores), TreePolicy(budget=15, keep=8)]
    ids = [p.ids for p in prompts]
    steps = [0, 0]
    for prompt, full in zip(ids, generate(smollm2, ids, 32).rows()):
        for n, walked in enumerate(walk(smollm2, drafter.model, drafter.head, prompt, full[len(prompt):], policies)):
            steps[n] += walked
    assert steps[0] == tree_walk["steps"] and steps[0] != steps[1]
