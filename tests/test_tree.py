"""Draft trees: building them, verifying them greedily, the target's tree forward, and tree decoding's output."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from specsplit.drafter_service.checkpoint import random_drafter
from specsplit.local import target_head, target_info
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.tree import (DraftTree, accept_greedy, accept_trees, best_first, from_paths, grow_trees, matched,
                                   tree_ancestors, tree_words)
from specsplit.target_service.dense import dense_forward, generate, tree_forward
from specsplit.target_service.model import CaptureSpec, ForwardBatch, load_target
from specsplit.tree_eval import TreePolicy, chain_policy, decode, frequent_paths, true_ranks, walk

#        root
#      /   |   \
#    0:5  1:6   2:7
#    |  \
#   3:8  4:9
#   |
#  5:10
TREE = DraftTree(tokens=(5, 6, 7, 8, 9, 10), parents=(-1, -1, -1, 0, 0, 3))


def test_a_tree_knows_its_depths_paths_and_what_each_node_sees():
    assert TREE.depths == (1, 1, 1, 2, 2, 3)
    assert TREE.path_to(5) == [0, 3, 5] and TREE.path_to(2) == [2]
    seen = TREE.visibility()
    for i in range(len(TREE)):
        assert seen[i].nonzero().flatten().tolist() == sorted(TREE.path_to(i))


@pytest.mark.parametrize("tokens, parents", [((1, 2), (-1,)), ((1, 2), (-1, 1)), ((1, 2), (-2, -1)),
                                             ((1, 1), (-1, -1)), ((-3,), (-1,))])
def test_a_malformed_tree_is_refused(tokens, parents):
    with pytest.raises(InvalidRequest):
        DraftTree(tokens, parents)


def test_greedy_acceptance_follows_the_targets_picks_down_the_tree():
    # picks: after the root, then after each node 0..5
    assert accept_greedy(TREE, [5, 9, 0, 0, 0, 0, 0]) == ([0, 4], [5, 9, 0])  # node 4's pick is the bonus
    assert accept_greedy(TREE, [5, 8, 0, 0, 10, 0, 3]) == ([0, 3, 5], [5, 8, 10, 3])
    assert accept_greedy(TREE, [7, 0, 0, 4, 0, 0, 0]) == ([2], [7, 4])
    assert accept_greedy(TREE, [11, 0, 0, 0, 0, 0, 0]) == ([], [11])  # nothing accepted: the recovered token
    with pytest.raises(InvalidRequest):
        accept_greedy(TREE, [5, 8])
    # teacher forcing reads the same path
    assert matched(TREE, [5, 8, 10, 3]) == 3 and matched(TREE, [6, 5]) == 1 and matched(TREE, [1]) == 0
    assert matched(DraftTree.chain([4, 5, 6]), [4, 5, 7]) == 2


def brute_force_best(logp: list[list[float]], budget: int) -> set[tuple[int, ...]]:
    """Every rank path of every length, scored, the best `budget` kept."""
    paths = [p for d in range(1, len(logp) + 1) for p in itertools.product(*(range(len(r)) for r in logp[:d]))]
    return set(sorted(paths, key=lambda p: -sum(logp[j][r] for j, r in enumerate(p)))[:budget])


@pytest.mark.parametrize("seed", range(5))
def test_best_first_keeps_the_highest_scoring_paths(seed):
    rng = random.Random(seed)
    logp = []
    for _ in range(4):
        raw = sorted((rng.random() for _ in range(4)), reverse=True)
        total = sum(raw)
        logp.append([math.log(x / total) for x in raw])
    ids = [[10 * j + r for r in range(4)] for j in range(4)]
    for budget in (1, 3, 7, 15, 30):
        tree = best_first(logp, ids, budget)
        assert len(tree) == budget
        got = {tuple(ids[d].index(tree.tokens[n]) for d, n in enumerate(tree.path_to(i))) for i in range(budget)}
        assert got == brute_force_best(logp, budget)
    assert from_paths([(0,), (0, 0), (1,)], ids) == DraftTree((0, 1, 10), (-1, -1, 0))  # shallow first
    with pytest.raises(InvalidRequest):
        from_paths([(0, 1)], ids)  # its prefix is missing
    with pytest.raises(InvalidRequest):
        from_paths([(4,)], ids)  # past the row's candidates


def test_frequent_paths_form_the_tree_the_true_tokens_took_most():
    ranks = [[0, 0, 1], [0, 0, -1], [1, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 0]]
    assert frequent_paths(ranks, 3) == ((0,), (0, 0), (0, 0, 0))  # taken 5, 4 and 2 times
    assert frequent_paths(ranks, 4)[3] == (1,)  # of those taken once, the shortest first
    assert true_ranks(torch.tensor([[3, 4], [5, 6], [7, 8]]), [4, 9]) == [1, -1, -2]  # -2: past the end
    assert chain_policy(3).paths == ((0,), (0, 0), (0, 0, 0)) and str(chain_policy(3)) == "chain 3"
    with pytest.raises(InvalidRequest):
        TreePolicy(budget=2, paths=((0,), (0, 0), (1,)))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])  # mistral's layers slide a window, some of qwen3's
def test_each_nodes_row_is_a_plain_forward_over_its_path(family, request):
    """A node's logits and captured rows are those of the context followed by its path alone."""
    model = load_target(request.getfixturevalue(f"tiny_{family}_dir"))
    capture = CaptureSpec(layer_ids=(0, model.config.num_hidden_layers - 1))
    context = [3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    out = tree_forward(model, context, TREE, capture)
    assert out.logits.shape[0] == len(TREE) + 1 and out.features.shape[0] == len(context) + len(TREE)
    for node in [-1] + list(range(len(TREE))):
        path = [] if node < 0 else TREE.path_to(node)
        ids = torch.tensor([context + [TREE.tokens[i] for i in path]])
        plain = dense_forward(model, ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool),
                              capture=capture, last_logits=True)
        torch.testing.assert_close(out.logits[node + 1], plain.logits[0], atol=1e-4, rtol=1e-4)
        row = out.features[len(context) + node] if node >= 0 else out.features[len(context) - 1]
        torch.testing.assert_close(row, plain.layer_features[0, -1], atol=1e-4, rtol=1e-4)


def paged_batch(parts, trees=None):
    """A ForwardBatch of sequences (seq_id, first position, tokens)."""
    tokens = [t for _, _, toks in parts for t in toks]
    positions = [p for _, first, toks in parts for p in range(first, first + len(toks))]
    cu = [0]
    for _, _, toks in parts:
        cu.append(cu[-1] + len(toks))
    return ForwardBatch(torch.tensor(tokens), torch.tensor(positions), torch.tensor(cu), [s for s, _, _ in parts],
                        trees=trees)


@pytest.mark.parametrize("path", ["batched", "per_sequence"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_a_paged_tree_verify_equals_the_dense_reference_beside_a_plain_sequence(family, path, request):
    """Through the KV cache, a tree's rows (written at the positions after its root, rotated at root + depth)
    give the dense reference's logits and rows, and a plain sequence in the same batch its own."""
    model = load_target(request.getfixturevalue(f"tiny_{family}_dir"))
    model.attention_path = path
    capture = CaptureSpec(layer_ids=(0, model.config.num_hidden_layers - 1))
    context, other = [3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [7, 1, 8, 2, 8]
    cache = model.new_cache(num_blocks=8, block_size=4)
    for seq_id in (0, 1):
        cache.allocate(seq_id)
    model(paged_batch([(0, 0, context[:-1]), (1, 0, other)]), cache, capture)
    out = model(paged_batch([(1, len(other), [4]), (0, len(context) - 1, [context[-1], *TREE.tokens])],
                            trees=[None, TREE.parents]), cache, capture)
    ref = tree_forward(model, context, TREE, capture)
    torch.testing.assert_close(out.logits[1:], ref.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.layer_features[1:], ref.features[len(context) - 1:], atol=1e-4, rtol=1e-4)
    plain = dense_forward(model, torch.tensor([other + [4]]), torch.arange(len(other) + 1)[None],
                          torch.ones(1, len(other) + 1, dtype=torch.bool), last_logits=True)
    torch.testing.assert_close(out.logits[0], plain.logits[0], atol=1e-4, rtol=1e-4)
    for bad in ([TREE.parents], [None, TREE.parents[:-1]], [None, (-1, 1, 0, 0, 0, 3)]):
        with pytest.raises(InvalidRequest):
            model(paged_batch([(1, len(other), [4]), (0, len(context) - 1, [context[-1], *TREE.tokens])],
                              trees=bad), cache, capture)


def test_the_accepted_path_moved_into_place_is_what_a_plain_run_cached(tiny_llama_dir):
    """The target's greedy path hidden on a later branch: the verify accepts it, its k/v move to the positions
    its tokens take, and the next step's logits equal a plain forward over the whole sequence."""
    model = load_target(tiny_llama_dir)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    c = generate(model, [prompt], 4).rows()[0][len(prompt):]
    #   root -> 0: wrong, 1: c0 -> (2: wrong, 3: c1 -> 4: c2)
    tree = DraftTree((c[0] + 1, c[0], c[1] + 1, c[1], c[2]), (-1, -1, 1, 1, 3))
    cache = model.new_cache(num_blocks=8, block_size=4)
    cache.allocate(0)
    model(paged_batch([(0, 0, prompt[:-1])]), cache)
    root = len(prompt) - 1
    out = model(paged_batch([(0, root, [prompt[-1], *tree.tokens])], trees=[tree.parents]), cache)
    accepted, emitted = accept_greedy(tree, out.logits.argmax(-1).tolist())
    assert accepted == [1, 3, 4] and emitted == c[:4]
    cache.move(0, [root + 1 + i for i in accepted], [root + 1 + d for d in range(len(accepted))])
    cache.truncate(0, root + 1 + len(accepted))
    seq = prompt + emitted
    step = model(paged_batch([(0, len(seq) - 1, [seq[-1]])]), cache)
    plain = dense_forward(model, torch.tensor([seq]), torch.arange(len(seq))[None],
                          torch.ones(1, len(seq), dtype=torch.bool), last_logits=True)
    torch.testing.assert_close(step.logits[0], plain.logits[0], atol=1e-4, rtol=1e-4)
    for src, dst in (([root], [root, root + 1]), ([root + 9], [root]), ([root, root + 1], [root, root])):
        with pytest.raises(InvalidRequest):
            cache.move(0, src, dst)


def test_slots_moved_on_the_device_are_the_checked_move(tiny_llama_dir):
    """`PagedKVCache.move_slots` (a chained tree step's: slots on the device, every layer, unchecked) leaves the
    pool as `move` of the same positions does; a pair meant for nothing goes scratch to scratch."""
    model = load_target(tiny_llama_dir)
    caches = [model.new_cache(num_blocks=8, block_size=4) for _ in range(2)]
    for cache in caches:
        cache.allocate(0)
        model(paged_batch([(0, 0, list(range(5, 19)))]), cache)
    src, dst = [9, 11, 12], [7, 8, 9]
    caches[0].move(0, src, dst)
    scratch = caches[1].num_blocks - 1  # a block the sequence does not hold
    slots = lambda p: caches[1].slots(0, torch.tensor(p))  # noqa: E731
    caches[1].move_slots(torch.cat([slots(src), torch.tensor([scratch * 4])]),
                         torch.cat([slots(dst), torch.tensor([scratch * 4])]))
    for layer in range(model.config.num_hidden_layers):
        for a, b in zip(caches[0].gather(layer, 0, 14), caches[1].gather(layer, 0, 14)):
            assert torch.equal(a, b)


def test_fed_tree_verifies_refuse_what_they_cannot_hold(tiny_llama_dir):
    """A chain bucket's fed verify takes no tree, a tree bucket's needs one of its own width; words hold 64 rows;
    chained candidates want one anchor and position a sequence and keep >= 1."""
    from specsplit.target_service.graphs import StepGraphs

    model = load_target(tiny_llama_dir)
    cache = model.new_cache(num_blocks=16, block_size=4)
    graphs = StepGraphs(model, cache, CaptureSpec(), max_batch=2, query_lens=(1, 5), max_len=32, use_graphs=False,
                        tree_lens=(5,))
    cache.allocate(0)
    model(paged_batch([(0, 0, [1, 2, 3])]), cache)
    tokens, starts = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([3])
    chain = graphs.chain_tables([0], 5, [3], [8])
    tree = graphs.chain_tables([0], 5, [3], [8], tree=True)
    words = tree_words(torch.tensor([[-1, 0, 0, 2]]))
    with pytest.raises(InvalidRequest):
        graphs.chain_run(chain, tokens, starts, (starts[:, None] + torch.arange(5), words))
    with pytest.raises(InvalidRequest):
        graphs.chain_run(tree, tokens, starts)
    with pytest.raises(InvalidRequest):
        graphs.chain_run(tree, tokens, starts, (starts[:, None] + torch.arange(4), words[:, :4]))
    with pytest.raises(InvalidRequest):
        tree_words(torch.full((1, 64), -1))
    drafter = random_drafter("dflash", target_info(model), target_head(model), seed=0, dtype=torch.float32,
                             block_size=8, max_drafts=7, num_layers=1, window=40)
    drafter.use_static_forwards(use_graphs=False)
    drafter.alloc(3, 64)
    drafter.prefill(3, [5, 6, 7], torch.randn(3, drafter.spec.feature_dim), 0)
    batch = drafter.chain_batch([3], [0])
    anchor, position = torch.tensor([9]), torch.tensor([3])
    logp, ids = drafter.chain_candidates(batch, anchor, position, 4)
    assert logp.shape == ids.shape == (1, 7, 4) and bool((logp[..., :-1] >= logp[..., 1:]).all())
    for keep, anchors in ((0, anchor), (True, anchor), ("4", anchor), (4, torch.tensor([9, 9]))):
        with pytest.raises(ValueError):
            drafter.chain_candidates(batch, anchors, position, keep)


def test_tree_decoding_equals_the_targets_greedy_output_and_its_teacher_forced_walk(tiny_llama_dir):
    """With a random drafter few drafts land, so the policy that accepts most here is a wide tree; either way
    every token is the target's, and decoding takes the steps the teacher-forced walk counts."""
    model = load_target(tiny_llama_dir)
    drafter = random_drafter("dflash", target_info(model), target_head(model), seed=0, block_size=4)
    dm, head = drafter.model, drafter.head
    prompts = [[5, 6, 7, 8, 9], [30, 31, 32]]
    greedy = generate(model, prompts, 12).rows()
    policies = [chain_policy(3), TreePolicy(budget=24, keep=8), TreePolicy(budget=6, paths=((0,), (1,), (0, 0)))]
    for prompt, full in zip(prompts, greedy):
        continuation = full[len(prompt):]
        steps = walk(model, dm, head, prompt, continuation, policies)
        for policy, walked in zip(policies, steps):
            got = decode(model, dm, head, prompt, 12, policy)
            assert got.tokens == continuation, policy
            assert got.steps == walked, policy
            assert decode(model, dm, head, prompt, 12, policy, paged=True) == got
    with pytest.raises(InvalidRequest):
        decode(model, dm, head, [], 4, policies[0])


@pytest.mark.slow  # (34 s: the default suite stays under five minutes; CI runs it with the slow tests)
def test_the_shipped_drafters_trees_accept_more_and_stay_lossless(smollm2, smollm2_tokenizer):
    """The shipped drafter on two held-out chat prompts: a best-first tree of 15 nodes (today's verify width)
    accepts more tokens a step than the chain, its output is the target's greedy output, and decoding takes
    exactly the steps of its teacher-forced walk (drafting and verification see the same rows)."""
    from specsplit.local import LocalSetup, make_drafter
    from specsplit.train_data import HELDOUT_PATH, read_prompts

    drafter = make_drafter("dflash", smollm2, LocalSetup(drafter="dflash", device="cpu", dtype="float32"))
    dm, head = drafter.model, drafter.head
    chats = [p for p in read_prompts(HELDOUT_PATH) if p.kind == "chat"][:2]
    prompts = [p.encode(smollm2_tokenizer) for p in chats]
    policies = [chain_policy(15), TreePolicy(budget=15)]
    totals = [0, 0]
    for prompt, full in zip(prompts, generate(smollm2, prompts, 32).rows()):
        continuation = full[len(prompt):]
        for n, (policy, walked) in enumerate(zip(policies, walk(smollm2, dm, head, prompt, continuation, policies))):
            got = decode(smollm2, dm, head, prompt, 32, policy)
            assert got.tokens == continuation and got.steps == walked
            assert decode(smollm2, dm, head, prompt, 32, policy, paged=True) == got
            totals[n] += got.steps
    assert totals[1] < totals[0]


def random_rows(seed: int, batch: int, rows: int, width: int, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(batch, rows, vocab, generator=gen) * 3, -1)
    return logp.topk(width, -1)


def token_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[n] for n in tree.path_to(i)) for i in range(len(tree))}


@pytest.mark.parametrize("seed", range(4))
def test_trees_grown_on_the_device_are_best_firsts(seed):
    logp, ids = random_rows(seed, batch=3, rows=6, width=5)
    for budget in (1, 4, 15, 31):
        grown = grow_trees(logp, ids, budget)
        for b in range(3):
            tree = grown.tree(b)
            assert token_paths(tree) == token_paths(best_first(logp[b].tolist(), ids[b].tolist(), budget))
            assert len(tree) == budget and grown.depths[b].tolist() == list(tree.depths)
    # a row sure of its token (log-probability 0) ties child and parent: the parent is kept first, at scores
    # where a hair per depth would round away (a review's case: the child kept, its parent dropped)
    sure = torch.zeros(1, 3, 1), torch.tensor([[[4], [5], [6]]])
    assert grow_trees(*sure, 2).tree(0) == DraftTree((4, 5), (-1, 0))
    far = torch.tensor([[[0.0, -20, -21], [0, -200, -201], [0, -200, -201]]]), torch.arange(1, 10).view(1, 3, 3)
    for budget in range(1, 10):
        tree = grow_trees(*far, budget)
        assert token_paths(tree.tree(0)) == token_paths(best_first(far[0][0].tolist(), far[1][0].tolist(), budget))
        assert ((tree.parents >= 0) | (tree.depths == 1)).all()


@pytest.mark.parametrize("seed", range(4))
def test_trees_accepted_on_the_device_as_on_the_host(seed):
    logp, ids = random_rows(seed, batch=4, rows=5, width=3, vocab=6)
    grown = grow_trees(logp, ids, 12)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(20):
        picks = torch.randint(0, 6, (4, 13), generator=gen)
        if trial % 2:  # walk down a real path so long acceptances occur too
            for b in range(4):
                tree, node = grown.tree(b), -1
                for _ in range(3):
                    kids = [i for i, p in enumerate(tree.parents) if p == node]
                    if not kids:
                        break
                    node = kids[trial % len(kids)]
                    picks[b, tree.parents[node] + 1] = tree.tokens[node]
        count, nodes = accept_trees(grown, picks)
        by_words = accept_trees(grown, picks, tree_words(grown.parents))  # (the ancestors read from the words)
        assert torch.equal(by_words[0], count) and torch.equal(by_words[1], nodes)
        for b in range(4):
            accepted, _ = accept_greedy(grown.tree(b), picks[b].tolist())
            assert count[b] == len(accepted) and nodes[b].tolist() == accepted + [-1] * (12 - len(accepted))
    seen = tree_ancestors(torch.tensor([TREE.parents]))[0]
    assert seen[1:, 1:].equal(TREE.visibility()) and seen[:, 0].all() and not seen[0, 1:].any()


def engine_run(model, drafter, prompts, max_tokens, **config):
    from specsplit.shared.sampling import SamplingParams
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request

    engine = Engine(model, drafter, EngineConfig(**{"max_batch": len(prompts), **config}))
    requests = [Request(f"r{i}", list(p), SamplingParams(max_tokens=max_tokens), speculative=drafter is not None)
                for i, p in enumerate(prompts)]
    events = engine.generate(requests)
    return [[t for e in events[r.request_id] for t in e.token_ids] for r in requests], \
        [events[r.request_id][-1].stats for r in requests], engine


@pytest.mark.slow  # (13-14 s on the CPU: the default run stays under five minutes; GPU tests run the trees too)
def test_the_engines_tree_steps_equal_target_only_and_take_fewer_steps(smollm2, smollm2_tokenizer):
    """EngineConfig.draft_tree with the shipped drafter, two held-out chat prompts in one batch: every token
    the target-only engine's, fewer steps than chains, and each request's steps those of `decode(paged=True)`
    (the trees the engine builds are the reference's)."""
    from specsplit.local import LocalSetup, make_drafter
    from specsplit.train_data import HELDOUT_PATH, read_prompts

    prompts = [p.encode(smollm2_tokenizer) for p in read_prompts(HELDOUT_PATH) if p.kind == "chat"][:2]
    base, _, _ = engine_run(smollm2, None, prompts, 24)
    chained = engine_run(smollm2, make_drafter("dflash", smollm2, LocalSetup(drafter="dflash", dtype="float32")),
                         prompts, 24)
    drafter = make_drafter("dflash", smollm2, LocalSetup(drafter="dflash", dtype="float32"))
    tokens, stats, engine = engine_run(smollm2, drafter, prompts, 24, draft_tree=15, draft_tree_keep=8)
    assert tokens == base == chained[0]
    assert sum(s.steps for s in stats) < sum(s.steps for s in chained[1])
    for prompt, got, st in zip(prompts, tokens, stats):
        ref = decode(smollm2, drafter.model, drafter.head, prompt, 24,
                     TreePolicy(budget=15, keep=8, scores=drafter.tree_scores), paged=True)  # (the shipped scores)
        assert ref.tokens == got and st.steps == ref.steps + 1  # the engine counts its prefill a step
        assert st.accepted == len(got) - st.steps and 0 < st.drafted <= 15 * ref.steps
    assert engine.cache.num_free_blocks == engine.config.kv_blocks  # every block back, the trees' rows included


@pytest.mark.slow  # (~45 s on two cores: three engines of the shipped model; CI runs it with the slow ones)
def test_chained_tree_steps_equal_target_only_and_accept_as_the_eager_tree_steps(smollm2, smollm2_tokenizer):
    """Chained steps of draft trees (`Engine._chain_tree`: candidates, trees, verify, accept, k/v moved and the
    drafter's rows committed, all on the device; the static forwards uncaptured on the CPU), with a request
    joining mid-run and short ones ending: every token the target-only engine's, each request's accepted
    count the eager tree steps' (so the moved k/v and the committed rows are what those steps leave), fewer
    steps than chained chains, and nothing left allocated."""
    from specsplit.local import LocalSetup, make_drafter
    from specsplit.shared.sampling import SamplingParams
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.graphs import StepGraphs
    from specsplit.target_service.sequence import Request
    from specsplit.train_data import HELDOUT_PATH, read_prompts

    prompts = [p.encode(smollm2_tokenizer) for p in read_prompts(HELDOUT_PATH)][:3]
    lengths = [24, 9, 20]

    def run(chained: bool, **config):
        drafter = make_drafter("dflash", smollm2, LocalSetup(drafter="dflash", dtype="float32"))
        drafter.use_static_forwards(use_graphs=False)
        engine = Engine(smollm2, drafter, EngineConfig(max_batch=3, chain_steps=chained, **config))
        engine.graphs = StepGraphs(smollm2, engine.cache, engine.capture, max_batch=3, query_lens=(1, 16),
                                   max_len=512, use_graphs=False, tree_lens=(16,) if config else ())
        engine.add(Request("r0", list(prompts[0]), SamplingParams(max_tokens=lengths[0])))
        engine.add(Request("r1", list(prompts[1]), SamplingParams(max_tokens=lengths[1])))
        events: dict[str, list] = {}
        for n in itertools.count():
            if n == 2:
                engine.add(Request("r2", list(prompts[2]), SamplingParams(max_tokens=lengths[2])))
            for e in engine.step():
                events.setdefault(e.request_id, []).append(e)
            if not engine.has_work:
                break
        assert engine.cache.num_free_blocks == engine.cache.num_blocks - 1  # all but the scratch block
        assert drafter.pool.num_free_blocks == drafter.pool.num_blocks and len(drafter.store) == 0
        tokens = [[t for e in events[f"r{i}"] for t in e.token_ids] for i in range(3)]
        chunks = [[len(e.token_ids) for e in events[f"r{i}"]] for i in range(3)]  # what each step emitted
        return tokens, [events[f"r{i}"][-1].stats for i in range(3)], engine, chunks

    base, _, _ = engine_run(smollm2, None, prompts, 24)
    trees, stats, engine, chunks = run(True, draft_tree=15, draft_tree_keep=8)
    assert engine.counters.chained > 3 and any(key[2] for key in engine._chain_programs)
    assert [t == b[:len(t)] for t, b in zip(trees, base)] == [True] * 3 and list(map(len, trees)) == lengths
    eager, _, _, eager_chunks = run(False, draft_tree=15, draft_tree_keep=8)
    assert eager == trees
    # step by step the same accepted paths, up to the last step (where the eager trees grow only as deep as
    # the tokens left, and a chained step launched before the host knew the end may run on past it)
    assert [c[:-1] for c in chunks] == [c[:-1] for c in eager_chunks] and max(map(max, chunks)) > 4
    _, chain_stats, _, _ = run(True)
    assert sum(s.steps for s in stats) < sum(s.steps for s in chain_stats)


def test_chained_trees_keep_the_draft_length_limits(tiny_llama_dir):
    """Chained trees grow only from the rows a chain step would draft (`_tree_depth`: the draft length, its
    schedule by batch), none where speculation is off; their outputs stay the target's."""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.graphs import StepGraphs
    from specsplit.target_service.sequence import Request

    model = load_target(tiny_llama_dir)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]

    def run(lengths=(14, 14), **config):
        drafter = random_drafter("dflash", target_info(model), target_head(model), seed=0, dtype=torch.float32,
                                 block_size=8, max_drafts=7, num_layers=1, window=64)
        drafter.use_static_forwards(use_graphs=False)
        engine = Engine(model, drafter, EngineConfig(max_batch=2, draft_tree=7, draft_tree_keep=4, **config))
        engine.graphs = StepGraphs(model, engine.cache, engine.capture, max_batch=2, query_lens=(1, 4, 8),
                                   max_len=256, use_graphs=False, tree_lens=(8,))
        requests = [Request(f"r{i}", p, SamplingParams(max_tokens=n)) for i, (p, n) in enumerate(zip(prompts, lengths))]
        events = engine.generate(requests)
        return [[t for e in events[r.request_id] for t in e.token_ids] for r in requests], set(engine._chain_programs)

    base, _, _ = engine_run(model, None, prompts, 14)
    tokens, keys = run()
    assert tokens == base and {key[2] for key in keys} == {7}  # trees of 7 nodes from all 7 rows
    tokens, keys = run(num_drafts=3)
    assert tokens == base and {key[2] for key in keys if key[1] == 7} == {3}  # ... from the 3 a chain would draft
    tokens, keys = run(drafts_by_batch=((1, 0),))
    assert tokens == base and not any(key[2] for key in keys)  # no drafts at any batch size: no trees either
    base = [engine_run(model, None, [p], n)[0][0] for p, n in zip(prompts, (14, 40))]
    tokens, keys = run((14, 40), draft_tree_batch=1)  # trees only where one sequence is left
    assert tokens == base and {key[2] for key in keys if key[0] == 2} == {0} \
        and {key[2] for key in keys if key[0] == 1} == {7}


@pytest.mark.parametrize("chained", [True, False])
def test_trees_by_batch_verify_smaller_trees_in_larger_steps(tiny_llama_dir, chained):
    """`trees_by_batch`: a step of two sequences verifies trees of the nodes given from two on (5, or chains for 0)
    and the one sequence left trees of `draft_tree`'s 13 (more than the drafter's 7 rows), chained or step by step,
    each in a tree bucket the engine's graphs hold for its size; the tokens stay the target's."""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request

    model = load_target(tiny_llama_dir)
    prompts, lengths = [[5, 6, 7, 8, 9], [11, 12, 13]], (14, 40)
    base = [engine_run(model, None, [p], n)[0][0] for p, n in zip(prompts, lengths)]

    def run(pairs):
        drafter = random_drafter("dflash", target_info(model), target_head(model), seed=0, dtype=torch.float32,
                                 block_size=8, max_drafts=7, num_layers=1, window=64)
        drafter.use_static_forwards(use_graphs=False)
        engine = Engine(model, drafter, EngineConfig(max_batch=2, draft_tree=13, draft_tree_keep=4,
                                                     trees_by_batch=pairs, chain_steps=chained))
        engine.graphs = engine._capture_graphs(use_graphs=False)
        verified, forward_tree = [], engine.graphs.forward_tree
        engine.graphs.forward_tree = lambda step: verified.append(
            (len(step.seq_ids), max(map(len, step.tokens)))) or forward_tree(step)
        requests = [Request(f"r{i}", p, SamplingParams(max_tokens=n)) for i, (p, n) in enumerate(zip(prompts, lengths))]
        events = engine.generate(requests)
        tokens = [[t for e in events[r.request_id] for t in e.token_ids] for r in requests]
        if chained:  # (batch, k, rows) of the chained programs that verified trees
            return tokens, engine.graphs, {key[:2] for key in engine._chain_programs if key[2]}
        return tokens, engine.graphs, {(n, max(rows for m, rows in verified if m == n)) for n, _ in verified}

    tokens, graphs, trees = run(((2, 5),))
    assert tokens == base and graphs.tree_bucket(1, 14) == (1, -14) and graphs.tree_bucket(2, 6) == (2, -6)
    assert graphs.tree_bucket(2, 14) is None  # (a 14-row verify is captured for one sequence only)
    assert trees == ({(2, 5), (1, 13)} if chained else {(2, 6), (1, 14)})
    tokens, graphs, trees = run(((2, 0),))
    assert tokens == base and graphs.tree_batches == (1,)
    assert trees == ({(1, 13)} if chained else {(1, 14)})


@pytest.mark.parametrize("max_drafts", [pytest.param(7, marks=pytest.mark.slow), 4])  # (the default run: one)
def test_a_tree_step_planned_for_more_sequences_than_can_chain_never_runs_as_a_chain_of_its_nodes(tiny_llama_dir,
                                                                                                max_drafts):
    """`trees_by_batch` ((2, 5)) with trees of 13 at one stream: when one of two sequences cannot chain (it nears the
    context's end with a step not read yet) the step planned as two sequences' trees of 5 is not launched as one
    sequence's (whose trees have 13 nodes): it goes as usual. It once ran as a chain of k = 5, or, with no chain
    bucket of 6 rows (4 drafts), raised out of the engine's step and failed every request. (A helper's review.)"""
    import itertools

    from specsplit.shared.sampling import SamplingParams
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request

    model = load_target(tiny_llama_dir)
    limit = model.config.max_position_embeddings
    prompts, lengths = [[5, 6, 7, 8, 9], [11, 12, 13]], (limit - 5, 40)
    base = [engine_run(model, None, [p], n)[0][0] for p, n in zip(prompts, lengths)]
    drafter = random_drafter("dflash", target_info(model), target_head(model), seed=0, dtype=torch.float32,
                             block_size=8, max_drafts=max_drafts, num_layers=1, window=64)
    drafter.use_static_forwards(use_graphs=False)
    engine = Engine(model, drafter, EngineConfig(max_batch=2, draft_tree=13, draft_tree_keep=4,
                                                 trees_by_batch=((2, 5),)))
    engine.graphs = engine._capture_graphs(use_graphs=False)
    engine.add(Request("r0", prompts[0], SamplingParams(max_tokens=lengths[0], ignore_eos=True)))
    tokens: dict[str, list[int]] = {}
    late = None
    for step in itertools.count():
        seq = next(iter(engine.running.values()), None)
        if late is None and seq is not None and len(seq.tokens) > limit - 45:  # r1 runs while r0 meets the end
            late = step
            engine.add(Request("r1", prompts[1], SamplingParams(max_tokens=lengths[1], ignore_eos=True)))
        for e in engine.step():
            tokens.setdefault(e.request_id, []).extend(e.token_ids)
        if not engine.has_work:
            break
    assert late is not None and [tokens["r0"], tokens["r1"]] == base
    keys = set(engine._chain_programs)
    assert {key[1] for key in keys if key[0] == 1 and key[2]} <= {13}  # one sequence's trees: 13 nodes
    assert not any(key[1] == 5 and not key[2] for key in keys), keys  # never a chain of the trees' 5
    assert any(key[0] == 2 and key[1] == 5 and key[2] for key in keys), keys  # (two sequences' trees ran)


def test_chained_trees_wider_than_the_drafters_rows_accept_as_step_by_step_trees(tiny_llama_dir):
    """Trees of more nodes than the drafter has rows (13 from 7 rows of 4 candidates): the chained steps (verify
    13 + 1 rows, commit the root and at most 7 path rows) emit what step-by-step tree steps emit, step by step, and
    the target-only tokens; the drafter is never asked to commit more rows than a chain's. The candidates are
    scripted from the target-only continuation, the true token ranked second at some rows, so paths run deep only
    through the runners-up a wide tree holds."""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.graphs import StepGraphs
    from specsplit.target_service.sequence import Request

    model = load_target(tiny_llama_dir)
    vocab, rows, keep = model.config.vocab_size, 7, 4
    prompts, lengths = [[5, 6, 7, 8, 9], [11, 12, 13]], (30, 22)
    base = [engine_run(model, None, [p], n)[0][0] for p, n in zip(prompts, lengths)]
    full = {f"r{i}": p + b for i, (p, b) in enumerate(zip(prompts, base))}
    scores = torch.tensor([-0.2, -0.9, -2.0, -3.0])

    def scripted(engine, seq_ids, positions) -> tuple[torch.Tensor, torch.Tensor]:
        by_id = {s.seq_id: full[s.request.request_id] for s in engine.running.values()}
        ids = torch.zeros((len(seq_ids), rows, keep), dtype=torch.int64)
        for b, (seq_id, at) in enumerate(zip(seq_ids, positions)):
            tokens = by_id[seq_id]
            for r in range(rows):
                true = tokens[at + 1 + r] if at + 1 + r < len(tokens) else 0
                others = [t for t in range(1, vocab) if t != true][(at + r) % 50:][:keep - 1]
                rank = 1 if (at + r) % 3 == 2 else 0
                ids[b, r] = torch.tensor(others[:rank] + [true] + others[rank:])
        return scores.expand(len(seq_ids), rows, keep).clone(), ids

    def run(chained: bool):
        drafter = random_drafter("dflash", target_info(model), target_head(model), seed=0, dtype=torch.float32,
                                 block_size=8, max_drafts=7, num_layers=1, window=64)
        drafter.use_static_forwards(use_graphs=False)
        widths, commit = [], drafter.chain_commit
        drafter.chain_commit = lambda batch, rows, at, width: widths.append(width) or commit(batch, rows, at, width)
        engine = Engine(model, drafter, EngineConfig(max_batch=2, draft_tree=13, draft_tree_keep=keep,
                                                     chain_steps=chained))
        drafter.chain_candidates = lambda batch, anchors, positions, k: scripted(engine, batch.seq_ids,
                                                                                 positions.tolist())
        drafter.propose_candidates = lambda requests, k: scripted(engine, [r.seq_id for r in requests],
                                                                  [r.position for r in requests])
        engine.graphs = StepGraphs(model, engine.cache, engine.capture, max_batch=2, query_lens=(1, 8),
                                   max_len=256, use_graphs=False, tree_lens=(14,))
        requests = [Request(f"r{i}", p, SamplingParams(max_tokens=n)) for i, (p, n) in enumerate(zip(prompts, lengths))]
        events = engine.generate(requests)
        assert engine.cache.num_free_blocks == engine.cache.num_blocks - 1 and len(drafter.store) == 0
        return ([[t for e in events[r.request_id] for t in e.token_ids] for r in requests],
                [[len(e.token_ids) for e in events[r.request_id]] for r in requests], engine, widths)

    tokens, chunks, engine, widths = run(True)
    eager, eager_chunks, _, _ = run(False)
    assert tokens == eager == base
    assert {key[1:] for key in engine._chain_programs if key[2]} == {(13, 7)} and engine.counters.chained > 3
    assert set(widths) == {8}  # the root and the 7 rows' deepest path
    # the same accepted paths step by step, up to the eager steps' last (where their trees grow only as deep as the
    # tokens left, and a chained step launched before the host knew the end runs on past it); deeper than a chain
    # of the top candidates reaches (every third true token ranks second: at most 2 drafts, 3 tokens a step)
    assert [c[:len(e) - 1] for c, e in zip(chunks, eager_chunks)] == [e[:-1] for e in eager_chunks]
    assert max(map(max, chunks)) >= 4, chunks


def test_tree_buckets_stop_at_the_tree_batch(tiny_llama_dir):
    """`draft_tree_batch` bounds the batch buckets a tree verify is captured for (and refuses what it cannot be)."""
    from specsplit.target_service.engine import EngineConfig
    from specsplit.target_service.graphs import StepGraphs

    model = load_target(tiny_llama_dir)
    cache = model.new_cache(num_blocks=64, block_size=16)
    for tree_batch, buckets in ((None, (1, 2, 4, 8)), (3, (1, 2, 4)), (1, (1,)), (100, (1, 2, 4, 8))):
        graphs = StepGraphs(model, cache, CaptureSpec(), max_batch=8, query_lens=(1, 8), max_len=256,
                            use_graphs=False, tree_lens=(8,), tree_batch=tree_batch)
        assert graphs.tree_batches == buckets and graphs.bucket(8, 8) == (8, 8)
        assert graphs.tree_bucket(buckets[-1], 8) == (buckets[-1], -8)
        assert graphs.tree_bucket(buckets[-1] + 1, 8) is None
    for bad in (0, -1, 3, True, 1.5):
        with pytest.raises(InvalidRequest, match="draft_tree_batch"):
            EngineConfig(max_batch=2, draft_tree=7, draft_tree_batch=bad)


def test_a_sequence_holds_a_trees_rows_past_its_budget_only_where_the_drafter_offers_trees(tiny_llama_dir):
    """`Engine._overhang`: a verify of draft trees of 13 nodes may write 14 rows past a sequence's budget where the
    drafter answers candidates (DFlash), where it does not (MTP) only its own drafts' (so a target asking for trees
    by default holds no more KV for an MTP drafter than for chains)."""
    from specsplit.target_service.engine import Engine, EngineConfig

    model = load_target(tiny_llama_dir)
    info, head = target_info(model), target_head(model)
    dflash = random_drafter("dflash", info, head, seed=0, block_size=8, max_drafts=7, num_layers=1)
    mtp = random_drafter("mtp", info, head, seed=0, max_drafts=3)
    for drafter, tree, rows in ((dflash, 13, 14), (dflash, 0, 8), (mtp, 13, 4), (mtp, 0, 4)):
        engine = Engine(model, drafter, EngineConfig(max_batch=2, draft_tree=tree, chain_steps=False))
        assert engine._overhang() == rows, (type(drafter).__name__, tree)


class BadCandidates:
    """A pass-through drafter whose tree candidates break the contract in one way."""

    def __init__(self, inner, how: str) -> None:
        self.inner, self.how = inner, how

    def propose_candidates(self, requests, keep):
        logp, ids = self.inner.propose_candidates(requests, keep)
        if self.how == "ids":
            return logp, ids + 10 ** 6
        if self.how == "nan":
            return logp * float("nan"), ids
        if self.how == "floats":
            return logp, ids.float()
        if self.how == "list":
            return [logp.tolist(), ids.tolist()]
        return logp[:, :1], ids[:, :1]  # one row, where more were asked for

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("how", ["ids", "nan", "shallow", "floats", "list"])
def test_candidates_out_of_contract_detach_the_drafter_and_lose_no_token(tiny_llama_dir, how):
    from specsplit.target_service.engine import EngineConfig

    model = load_target(tiny_llama_dir)
    prompts = [[5, 6, 7, 8, 9], [30, 31, 32]]
    base, _, _ = engine_run(model, None, prompts, 10)
    drafter = random_drafter("dflash", target_info(model), target_head(model), seed=0, block_size=4)
    tokens, _, engine = engine_run(model, BadCandidates(drafter, how), prompts, 10, draft_tree=6)
    assert tokens == base and not engine.drafter_ok
    for bad in ({"draft_tree": 64}, {"draft_tree": -1}, {"draft_tree_keep": 0}, {"draft_tree": True}):
        with pytest.raises(InvalidRequest):
            EngineConfig(**bad)


def test_evaluate_reports_draft_trees_beside_their_teacher_forced_walk(tiny_llama_dir):
    from specsplit.evaluate import EvalPrompt, EvalSettings, evaluate

    model = load_target(tiny_llama_dir)
    drafter = random_drafter("dflash", target_info(model), target_head(model), seed=0, block_size=4)
    prompts = [EvalPrompt("chat", [5, 6, 7, 8, 9]), EvalPrompt("code", [30, 31, 32])]
    rep = evaluate(model, drafter, prompts, EvalSettings(max_tokens=12, batch=2, draft_tree=6))
    assert rep["mismatches"] == 0 and rep["served"]["mismatches"] == 0
    assert rep["generated"] == rep["steps"] + rep["accepted"]
    assert sum(rep["position_acceptance"]) * rep["proposals"] == pytest.approx(rep["accepted"])
    walk = rep["teacher_forced"]["tree_walk"]
    assert walk["tokens"] == rep["generated"] - len(prompts) and walk["steps"] == rep["steps"] - len(prompts)
    for bad in ({"draft_tree": -1}, {"draft_tree": 4, "temperature": 0.5}, {"draft_tree": True}, {"draft_tree": 64}):
        with pytest.raises(InvalidRequest):
            EvalSettings(**bad)
    mtp = random_drafter("mtp", target_info(model), target_head(model), seed=0)
    with pytest.raises(InvalidRequest):
        evaluate(model, mtp, prompts, EvalSettings(max_tokens=4, batch=2, draft_tree=6))


@pytest.mark.parametrize("fused", [True, False])
def test_a_tree_bucket_of_the_static_step_equals_the_eager_tree_verify(tiny_llama_dir, tiny_mistral_dir, fused):
    """The captured step's forward with draft trees (a tree bucket: rotary positions and the kernel's words as
    inputs), run uncaptured on the CPU as the graphs' reference, gives the eager paged verify's logits and rows,
    with a tree smaller than its bucket and a plain sequence beside it; a sliding window is refused."""
    from specsplit.target_service.graphs import StepBatch, StepGraphs

    model = load_target(tiny_llama_dir)
    capture = CaptureSpec(layer_ids=(0, model.config.num_hidden_layers - 1))
    context, other = [3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [7, 1, 8, 2, 8]
    outs = []
    for static in (False, True):
        cache = model.new_cache(num_blocks=16, block_size=4)
        for seq_id in (0, 1):
            cache.allocate(seq_id)
        model(paged_batch([(0, 0, context[:-1]), (1, 0, other)]), cache, capture)
        parts, trees = [(0, len(context) - 1, [context[-1], *TREE.tokens]), (1, len(other), [4])], [TREE.parents, None]
        if static:
            graphs = StepGraphs(model, cache, capture, max_batch=2, query_lens=(1,), max_len=64, use_graphs=False,
                                fused=fused, tree_lens=(8,))
            outs.append(graphs.forward_tree(StepBatch([0, 1], [p[2] for p in parts], [p[1] for p in parts],
                                                      trees=[tuple(t) if t else None for t in trees])))
        else:
            outs.append(model(paged_batch(parts, trees=trees), cache, capture))
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1].layer_features, outs[0].layer_features, atol=1e-4, rtol=1e-4)
    sliding = load_target(tiny_mistral_dir)
    with pytest.raises(InvalidRequest):
        StepGraphs(sliding, sliding.new_cache(num_blocks=4, block_size=4), CaptureSpec(), max_batch=1,
                   query_lens=(1,), max_len=16, use_graphs=False, tree_lens=(8,))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_engines_tree_steps_replay_a_tree_bucket_on_the_gpu(smollm2_dir, monkeypatch):
    """On a GPU (float32) the engine's tree steps verify in a captured tree bucket: every token the target-only
    engine's, fewer steps than the chains' at eight held-out prompts through four slots."""
    from specsplit.local import LocalSetup, make_drafter
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.train_data import HELDOUT_PATH, read_prompts

    model = load_target(smollm2_dir, dtype=torch.float32, device="cuda")
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    prompts = [p.encode(tokenizer) for p in read_prompts(HELDOUT_PATH)[:8]]
    setup = LocalSetup(drafter="dflash", device="cuda", dtype="float32")
    base, _, _ = engine_run(model, None, prompts, 64, max_batch=4)
    _, chained, _ = engine_run(model, make_drafter("dflash", model, setup), prompts, 64, max_batch=4)
    from specsplit.target_service.graphs import StepGraphs

    replayed = []
    forward_tree = StepGraphs.forward_tree
    monkeypatch.setattr(StepGraphs, "forward_tree", lambda self, step: replayed.append(
        self.graphs.get(self.tree_bucket(len(step.seq_ids), max(map(len, step.tokens)))) is not None)
        or forward_tree(self, step))
    tokens, stats, engine = engine_run(model, make_drafter("dflash", model, setup), prompts, 64, max_batch=4,
                                       draft_tree=15, chain_steps=False)
    assert replayed and all(replayed)  # every tree step's verify replayed a captured tree bucket
    assert tokens == base
    assert sum(s.steps for s in stats) < sum(s.steps for s in chained)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("max_batch", [1, 4])
def test_chained_tree_steps_replay_whole_on_the_gpu(smollm2_dir, max_batch):
    """On a GPU (float32) the engine's tree steps chain and are captured whole (candidates, trees, verify,
    accept, k/v move and commit as one graph): every token the target-only engine's, fewer steps than the
    chained chains', at one and four slots."""
    from specsplit.local import LocalSetup, make_drafter
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.train_data import HELDOUT_PATH, read_prompts

    model = load_target(smollm2_dir, dtype=torch.float32, device="cuda")
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    prompts = [p.encode(tokenizer) for p in read_prompts(HELDOUT_PATH)[:6]]
    setup = LocalSetup(drafter="dflash", device="cuda", dtype="float32")
    base, _, _ = engine_run(model, None, prompts, 64, max_batch=max_batch)
    _, chained, _ = engine_run(model, make_drafter("dflash", model, setup), prompts, 64, max_batch=max_batch)
    tokens, stats, engine = engine_run(model, make_drafter("dflash", model, setup), prompts, 64, max_batch=max_batch,
                                       draft_tree=15)
    assert tokens == base
    trees = [p for key, p in engine._chain_programs.items() if key[2]]
    assert trees and any(p.graph is not None for p in trees) and engine.counters.chain_replays > 10
    assert sum(s.steps for s in stats) < sum(s.steps for s in chained)
