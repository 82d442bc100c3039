"""The static (graph-shaped) decode/verify forward equals the eager forward; on a GPU, so does its CUDA graph."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close

from specsplit.shared.errors import CapacityExceeded, InvalidRequest, StateConflict
from specsplit.shared.cuda_graphs import batch_buckets
from specsplit.target_service.graphs import DeviceDrafts, StepBatch, StepGraphs
from specsplit.target_service.model import CaptureSpec, ForwardBatch, load_target
from tests.rounding import network_atol



def atol(model, value: torch.Tensor) -> float:
    """Both sides are float32 over the same weights and differ only in sum order (one padded paged
    attention vs per-sequence attention; fused vs separate projections), so the tolerance is the
    rounding bound of the network on values of this size (tests/rounding.py)."""
    cfg = model.config
    return network_atol(float(value.abs().max()), max(cfg.hidden_size, cfg.intermediate_size, 128),
                        cfg.num_hidden_layers + 2)


def eager(model, cache, step: StepBatch, capture: CaptureSpec):
    lengths = torch.tensor([0] + [len(t) for t in step.tokens])
    batch = ForwardBatch(
        token_ids=torch.tensor([t for ids in step.tokens for t in ids]),
        positions=torch.tensor([p for ids, s in zip(step.tokens, step.starts) for p in range(s, s + len(ids))]),
        cu_seqlens=torch.cumsum(lengths, 0),
        seq_ids=list(step.seq_ids),
    )
    return model(batch, cache, capture)


def prefilled_pair(model, lengths: list[int], block_size: int = 4, seed: int = 0):
    """Two caches with the same random prompts prefilled (one for each path). Prompts go in one
    block at a time, round robin, so each sequence's blocks interleave with the others'."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    caches = [model.new_cache(num_blocks=96, block_size=block_size) for _ in range(2)]
    for cache in caches:
        for seq_id in range(len(prompts)):
            cache.allocate(seq_id)
        for start in range(0, max(lengths), block_size):
            for seq_id, prompt in enumerate(prompts):
                if start < len(prompt):
                    eager(model, cache, StepBatch([seq_id], [prompt[start:start + block_size]], [start]), CaptureSpec())
    return caches, prompts


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [4, 2, 5], [3]])
@pytest.mark.parametrize("fused", [True, False])
def test_static_forward_equals_eager(family, query_lens, fused, request):
    model = load_target(request.getfixturevalue(f"tiny_{family}_dir"))
    capture = CaptureSpec(layer_ids=(0, model.config.num_hidden_layers - 1), last_hidden=True)
    lengths = [9, 14, 6][:len(query_lens)]
    (ref_cache, cache), _ = prefilled_pair(model, lengths)
    graphs = StepGraphs(model, cache, capture, max_batch=4, query_lens=(1, 6), max_len=64, use_graphs=False,
                        fused=fused)
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in query_lens]
    starts = list(lengths)
    for _ in range(3):  # positions move on (as if every token were accepted), crossing block boundaries
        step = StepBatch(list(range(len(tokens))), tokens, starts)
        want = eager(model, ref_cache, step, capture)
        got = graphs.forward(step)
        for name in ("logits", "layer_features", "last_hidden"):
            expected = getattr(want, name).float()
            assert_close(getattr(got, name).float(), expected, atol=atol(model, expected), rtol=0)
        starts = [s + len(t) for s, t in zip(starts, tokens)]


def fused_step_equals_eager(model) -> None:
    """One fused static step of two sequences (three tokens and one) against the eager forward."""
    capture = CaptureSpec(layer_ids=(0,), last_hidden=True)
    (ref_cache, cache), _ = prefilled_pair(model, [9, 14])
    graphs = StepGraphs(model, cache, capture, max_batch=4, query_lens=(1, 6), max_len=64, use_graphs=False,
                        fused=True)
    step = StepBatch([0, 1], [[5, 6, 7], [8]], [9, 14])
    want, got = eager(model, ref_cache, step, capture), graphs.forward(step)
    for name in ("logits", "layer_features", "last_hidden"):
        expected = getattr(want, name).float()
        assert_close(getattr(got, name).float(), expected, atol=atol(model, expected), rtol=0)


def test_embed_rows_by_indexing_equals_the_embedding(monkeypatch):
    """shared.layers.embed_rows: weight[ids] (SPECSPLIT_EMBED_BY_INDEXING) gives F.embedding's rows exactly, for
    ids of any shape, repeated ids included."""
    from specsplit.shared import layers

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(50, 12, generator=gen).to(torch.bfloat16)
    for shape in ((16,), (1, 16), (3, 5), (1,)):
        ids = torch.randint(0, 50, shape, generator=gen)
        ids.view(-1)[0] = ids.view(-1)[-1]
        want = torch.nn.functional.embedding(ids, weight)
        for by_indexing in (False, True):
            monkeypatch.setattr(layers, "EMBED_BY_INDEXING", by_indexing)
            got = layers.embed_rows(weight, ids)
            assert got.shape == want.shape and torch.equal(got, want)


def test_static_forward_embeds_by_indexing_as_eager(tiny_llama_dir, monkeypatch):
    """With SPECSPLIT_EMBED_BY_INDEXING the fused static step's embeddings go through weight[ids], and the step
    equals the eager forward."""
    from specsplit.shared import layers

    monkeypatch.setattr(layers, "EMBED_BY_INDEXING", True)
    indexed = []
    plain = layers.embed_rows
    monkeypatch.setattr("specsplit.target_service.graphs.embed_rows", lambda w, i: indexed.append(i) or plain(w, i))
    model = load_target(tiny_llama_dir)
    fused_step_equals_eager(model)
    assert indexed


@pytest.mark.parametrize("in_rope", [True, False], ids=["in-rope", "apart"])
def test_static_forward_norms_q_and_k_in_the_rotary_launch(tiny_qwen3_dir, monkeypatch, in_rope):
    """kernels.rope.QK_NORM_IN_ROPE (on by default): a Qwen3 target's fused layers hand their per-head q and k norms
    to the rotary kernel (its reference on the CPU): the step equals the eager forward, and each layer's norms went
    in. Off, the layers norm q and k themselves and hand none over; the step is the same."""
    from specsplit.kernels import rope

    monkeypatch.setattr(rope, "QK_NORM_IN_ROPE", in_rope)
    given = []
    plain = rope.rope_and_cache_write  # (shared.fused.PagedAttend calls it through the module)
    monkeypatch.setattr(rope, "rope_and_cache_write", lambda *a: given.append(a[8]) or plain(*a))
    model = load_target(tiny_qwen3_dir)
    fused_step_equals_eager(model)
    layers = model.model.layers
    assert len(given) == len(layers)
    if not in_rope:
        assert all(norms is None for norms in given)
        return
    assert all(q is layer.self_attn.q_norm.weight and k is layer.self_attn.k_norm.weight
               for (q, k), layer in zip(given, layers))


def test_padding_never_touches_real_sequences(tiny_llama_dir):
    """A step in a larger bucket leaves other sequences' cached keys exactly as they were."""
    model = load_target(tiny_llama_dir)
    (_, cache), _ = prefilled_pair(model, [7, 5])
    graphs = StepGraphs(model, cache, CaptureSpec(), max_batch=4, query_lens=(8,), max_len=64, use_graphs=False)
    before_k, before_v = cache.k_pool.clone(), cache.v_pool.clone()
    graphs.forward(StepBatch([0], [[5]], [7]))  # 1 sequence of 1 token in the (1, 8) bucket
    changed = (cache.k_pool != before_k).any(-1).any(-1)  # [layers, blocks, rows]
    slot0 = cache.blocks(0)[7 // 4] * 4 + 7 % 4
    scratch = cache.blocks(-1)[0]
    for layer in range(model.config.num_hidden_layers):
        rows = changed[layer].flatten().nonzero().flatten().tolist()
        assert set(rows) <= {slot0} | set(range(scratch * 4, scratch * 4 + 4))
        assert slot0 in rows
    assert torch.equal(cache.v_pool[:, cache.blocks(1)], before_v[:, cache.blocks(1)])


def test_capture_warm_up_writes_only_scratch(tiny_llama_dir):
    """Capturing runs every bucket on its initial buffers, after sequences may already hold KV."""
    model = load_target(tiny_llama_dir)
    (_, cache), _ = prefilled_pair(model, [7, 5])
    graphs = StepGraphs(model, cache, CaptureSpec(), max_batch=4, query_lens=(1, 8), max_len=64, use_graphs=False)
    before = cache.k_pool.clone()
    for fwd in graphs.forwards.values():
        fwd.run()  # what `capture` runs before recording
    scratch = cache.blocks(-1)[0]
    others = [b for b in range(cache.num_blocks) if b != scratch]
    assert torch.equal(cache.k_pool[:, others], before[:, others])


def test_buckets_and_refusals(tiny_llama_dir):
    assert batch_buckets(1) == [1] and batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(12) == [1, 2, 4, 8, 12]
    model = load_target(tiny_llama_dir)
    cache = model.new_cache(num_blocks=4, block_size=4)
    graphs = StepGraphs(model, cache, CaptureSpec(), max_batch=2, query_lens=(1, 4), max_len=64, use_graphs=False)
    assert graphs.bucket(2, 3) == (2, 4) and graphs.bucket(3, 1) is None and graphs.bucket(1, 5) is None
    cache.allocate(0)
    with pytest.raises(InvalidRequest):
        graphs.forward(StepBatch([0], [[1] * 5], [0]))  # longer than any captured query length
    with pytest.raises(InvalidRequest):
        graphs.forward(StepBatch([0], [[1]], [64]))  # past what a block table row can address
    cache.reserve(0, 12)  # the scratch block is the fourth: nothing is left
    with pytest.raises(CapacityExceeded):
        graphs.forward(StepBatch([0], [[1]], [12]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_cuda_graph_replay_equals_eager(family, fused, dtype, request):
    folder = request.getfixturevalue(f"tiny_{family}_dir")
    model = load_target(folder, dtype=dtype, device="cuda")
    # bf16: both paths round at every stage, in different places (the fused layers of a few rows fold their
    # norms, residual adds and SiLU·mul into the projections' kernel: shared.fused); each is held to the
    # float32 forward's, at most twice as far as the eager bf16 forward is (on the CPU, emulating the folds in
    # torch: 0.7-1.5x as far, where the two bf16 paths differed by up to 0.02 of the largest logit)
    truth = load_target(folder, dtype=torch.float32, device="cuda") if dtype == torch.bfloat16 else None
    truth_cache = prefilled_pair(truth, [9, 14, 6])[0][0] if truth is not None else None
    # (the last layer's rows are captured after the final norm: the fused step hands over its head's input)
    capture = CaptureSpec(layer_ids=(0, model.config.num_hidden_layers - 1), last_hidden=True)
    (ref_cache, cache), _ = prefilled_pair(model, [9, 14, 6])
    graphs = StepGraphs(model, cache, capture, max_batch=4, query_lens=(1, 6), max_len=64, fused=fused)
    assert len(graphs.graphs) == len(graphs.forwards) == 3 * 2
    gen = torch.Generator().manual_seed(1)
    ends = [9, 14, 6]
    for query_lens in [[1, 1, 1], [4, 2, 6], [1], [6, 6]]:
        tokens = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in query_lens]
        step = StepBatch(list(range(len(tokens))), tokens, ends[:len(tokens)])
        ends[:len(tokens)] = [e + n for e, n in zip(ends, query_lens)]
        want = eager(model, ref_cache, step, capture)
        exact = eager(truth, truth_cache, step, capture) if truth is not None else None
        got = graphs.forward(step)
        for name in ("logits", "layer_features"):
            got_t, want_t = getattr(got, name).float(), getattr(want, name).float()
            if exact is None:
                assert_close(got_t, want_t, atol=atol(model, want_t), rtol=0)
                continue
            exact_t = getattr(exact, name).float()
            eager_err, got_err = (float((t - exact_t).abs().max()) for t in (want_t, got_t))
            assert got_err <= 2 * eager_err + 2 ** -8 * float(exact_t.abs().max()), (name, got_err, eager_err)
            assert_close(got_t, want_t, atol=2 ** -5 * float(want_t.abs().max()), rtol=0)  # and near eager itself


def test_engine_on_static_steps_is_lossless(tiny_chat_dir):
    """The engine with its verify forwards on the static step (as on a GPU, without capture) emits the
    target-only tokens, through partial accepts and every bucket a shrinking batch passes through."""
    from specsplit.drafter_service.checkpoint import random_drafter
    from specsplit.local import target_head, target_info
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request
    from tests.oracle import OracleDrafter

    target = load_target(tiny_chat_dir)
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time"]
    reqs = lambda: [Request(f"r{i}", tokenizer.encode(p), SamplingParams(max_tokens=12 + 6 * i, ignore_eos=True))  # noqa: E731
                    for i, p in enumerate(prompts)]

    def run(proposer, static: bool):
        engine = Engine(target, proposer, EngineConfig(max_batch=4))
        if static:
            engine.graphs = StepGraphs(target, engine.cache, engine.capture, max_batch=4,
                                       query_lens=(1, engine._max_drafts() + 1), max_len=256, use_graphs=False)
        events = engine.generate(reqs())
        return {rid: [t for e in evs for t in e.token_ids] for rid, evs in events.items()}, events

    reference, _ = run(None, static=False)
    inner = random_drafter("dflash", target_info(target), target_head(target), seed=0, dtype=torch.float32,
                           block_size=8, max_drafts=6)
    oracle = OracleDrafter(inner, {tuple(r.prompt_ids): r.prompt_ids + reference[r.request_id] for r in reqs()},
                           mistake_rate=0.15)
    tokens, events = run(oracle, static=True)
    assert tokens == reference
    stats = [evs[-1].stats for evs in events.values()]
    assert all(0 < s.accepted < s.drafted for s in stats)
    assert run(None, static=True)[0] == reference  # target-only decode (Q = 1) too


@pytest.mark.parametrize("chain", ["eager", "static"])
def test_engine_with_mtp_drafts_on_the_device_is_lossless(tiny_chat_dir, chain):
    """The MTP drafter's drafts stay on the device too (its chain reads nothing back between steps):
    the engine verifies them there, prefetched ones included, and emits the target-only tokens; so
    through the static chain (`mtp_graphs.ChainGraphs`, run without capture here)."""
    from specsplit.drafter_service.checkpoint import random_drafter
    from specsplit.local import target_head, target_info
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request

    target = load_target(tiny_chat_dir)
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time"]
    reqs = lambda: [Request(f"r{i}", tokenizer.encode(p), SamplingParams(max_tokens=12 + 6 * i, ignore_eos=True))  # noqa: E731
                    for i, p in enumerate(prompts)]
    reference = {rid: [t for e in evs for t in e.token_ids]
                 for rid, evs in Engine(target, None, EngineConfig(max_batch=4)).generate(reqs()).items()}
    drafter = random_drafter("mtp", target_info(target), target_head(target), seed=0, dtype=torch.float32,
                             max_drafts=3)
    if chain == "static":
        drafter.use_static_chain(use_graphs=False)
    engine = Engine(target, drafter, EngineConfig(max_batch=4))
    engine.graphs = StepGraphs(target, engine.cache, engine.capture, max_batch=4,
                               query_lens=(1, engine._max_drafts() + 1), max_len=256, use_graphs=False)
    read = engine._read_drafts
    reads = []
    engine._read_drafts = lambda *a: reads.append(1) or read(*a)
    events = engine.generate(reqs())
    assert {rid: [t for e in evs for t in e.token_ids] for rid, evs in events.items()} == reference
    assert reads and sum(evs[-1].stats.drafted for evs in events.values()) > 0
    assert chain == "eager" or drafter.chain_graphs.replays > 0


@pytest.mark.parametrize("max_batch", [4, 2])
def test_engine_with_device_drafts_is_lossless(tiny_chat_dir, max_batch):
    """Drafts that reach the verify on the device (an in-process drafter's, without a host round trip)
    give the target-only tokens: each sequence reads only its own row and only its num_drafts tokens,
    through partial accepts, sequences with no drafts beside ones with drafts, and a shrinking batch;
    drafts prefetched at the end of a step are taken when the next step asks exactly for them and
    dropped when it does not (a request admitted in between: max_batch 2 admits while others run)."""
    from specsplit.drafter_service.checkpoint import random_drafter
    from specsplit.local import target_head, target_info
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request
    from tests.oracle import DeviceOracle

    target = load_target(tiny_chat_dir)
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time", "Hello"]
    reqs = lambda: [Request(f"r{i}", tokenizer.encode(p), SamplingParams(max_tokens=10 + 7 * i, ignore_eos=True),  # noqa: E731
                            speculative=i != 3) for i, p in enumerate(prompts)]

    taken = []

    def run(proposer, prefetch=True):
        engine = Engine(target, proposer, EngineConfig(max_batch=max_batch))
        engine.graphs = StepGraphs(target, engine.cache, engine.capture, max_batch=max_batch,
                                   query_lens=(1, engine._max_drafts() + 1), max_len=256, use_graphs=False)
        if not prefetch:
            engine._prefetch_drafts = lambda seqs: None
        take = engine._take_prefetched

        def counted(*args):
            drafts = take(*args)
            taken.append(drafts is not None)
            return drafts

        engine._take_prefetched = counted
        events = engine.generate(reqs())
        return {rid: [t for e in evs for t in e.token_ids] for rid, evs in events.items()}, events

    reference, _ = run(None)
    inner = random_drafter("dflash", target_info(target), target_head(target), seed=0, dtype=torch.float32,
                           block_size=8, max_drafts=6)
    oracle = DeviceOracle(inner, {tuple(r.prompt_ids): r.prompt_ids + reference[r.request_id] for r in reqs()},
                          mistake_rate=0.15)
    taken.clear()
    tokens, events = run(oracle)
    assert tokens == reference
    assert oracle.device_steps > 0
    # All four start together: only the first decode step has nothing prefetched. Two at a time: each
    # admission brings a sequence nobody prefetched for.
    assert taken.count(False) == 1 if max_batch == 4 else taken.count(True) > taken.count(False) > 1
    # Output is lossless whatever the drafts, so check the drafts themselves: the oracle's depend only on
    # (sequence, position), so prefetched ones must be accepted exactly as freshly proposed ones.
    unprefetched = run(oracle, prefetch=False)[1]
    count = lambda evs: {rid: (e[-1].stats.drafted, e[-1].stats.accepted, e[-1].stats.steps)  # noqa: E731
                         for rid, e in evs.items()}
    assert count(events) == count(unprefetched)
    stats = {rid: evs[-1].stats for rid, evs in events.items()}
    assert stats["r3"].drafted == 0  # the non-speculative request rode along with placeholders of none
    assert all(0 < s.accepted < s.drafted for rid, s in stats.items() if rid != "r3")


def test_device_drafts_with_a_learned_draft_length_are_lossless(tiny_chat_dir):
    """--num-drafts auto on the device-draft path: the draft length changes between steps (each length
    measured, then the tuner's pick), prefetched drafts are taken only when the next step asks for the
    same length, and the tokens are target-only's."""
    from specsplit.drafter_service.checkpoint import random_drafter
    from specsplit.local import target_head, target_info
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request
    from tests.oracle import DeviceOracle

    target = load_target(tiny_chat_dir)
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time"]
    reqs = lambda: [Request(f"r{i}", tokenizer.encode(p), SamplingParams(max_tokens=50, ignore_eos=True))  # noqa: E731
                    for i, p in enumerate(prompts)]

    def run(proposer, **config):
        engine = Engine(target, proposer, EngineConfig(max_batch=4, **config))
        engine.graphs = StepGraphs(target, engine.cache, engine.capture, max_batch=4, query_lens=(1, 2, 4, 8),
                                   max_len=256, use_graphs=False)
        events = engine.generate(reqs())
        return {rid: [t for e in evs for t in e.token_ids] for rid, evs in events.items()}, engine

    reference, _ = run(None)
    inner = random_drafter("dflash", target_info(target), target_head(target), seed=0, dtype=torch.float32,
                           block_size=8, max_drafts=6)
    oracle = DeviceOracle(inner, {tuple(r.prompt_ids): r.prompt_ids + reference[r.request_id] for r in reqs()},
                          mistake_rate=0.15)
    tokens, engine = run(oracle, auto_drafts=True)
    assert tokens == reference
    assert oracle.device_steps > 0
    assert engine.tuner.choices == (7, 3, 1, 0)  # the block's 7 drafts at most
    assert set(engine.tuner._buckets[4].seconds) == {7, 3, 1, 0}


def test_engine_with_a_static_dflash_drafter_drafts_on_the_device(tiny_chat_dir):
    """The DFlash drafter's static propose (its CUDA graph's code, here without capture) hands its drafts
    over on the device, and the output is still target-only's."""
    from specsplit.drafter_service.checkpoint import random_drafter
    from specsplit.local import target_head, target_info
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request

    target = load_target(tiny_chat_dir)
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    reqs = [Request(f"r{i}", tokenizer.encode(p), SamplingParams(max_tokens=16, ignore_eos=True))
            for i, p in enumerate(["The capital of France is", "Once upon a time"])]
    drafter = random_drafter("dflash", target_info(target), target_head(target), seed=0, dtype=torch.float32,
                             block_size=8, max_drafts=6)
    drafter.use_static_forwards(use_graphs=False)
    used = []
    on_device = drafter.propose_on_device
    drafter.propose_on_device = lambda requests: used.append(on_device(requests)) or used[-1]

    def run(proposer):
        # (chained steps propose their own way: tests/test_chain.py)
        engine = Engine(target, proposer, EngineConfig(max_batch=2, chain_steps=False))
        engine.graphs = StepGraphs(target, engine.cache, engine.capture, max_batch=2,
                                   query_lens=(1, engine._max_drafts() + 1), max_len=256, use_graphs=False)
        return {rid: [t for e in evs for t in e.token_ids] for rid, evs in engine.generate(reqs).items()}

    assert run(drafter) == run(None)
    assert used and all(t is not None and t.shape[1] >= 6 for t in used)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("schedule", [(), ((2, 3), (3, 1))])  # also: a draft length per batch size
def test_device_drafts_on_the_gpu_survive_requests_admitted_mid_run(smollm2_dir, schedule):
    """On a GPU the drafter's graphs share a memory pool and replay in any order, so a graph's outputs
    may sit where another keeps its intermediates: drafts handed to the verify on the device (prefetched
    ones too) must not be read after other drafter work. eval-acceptance on the H200, with requests
    admitted while others decoded, once read such drafts and the verify's embedding asserted on an id
    out of range. float32: the tokens equal target-only's."""
    from specsplit.local import LocalSetup, make_drafter
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request
    from specsplit.train_data import HELDOUT_PATH, read_prompts

    target = load_target(smollm2_dir, dtype=torch.float32, device="cuda")
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    drafter = make_drafter("dflash", target, LocalSetup(drafter="dflash", device="cuda", dtype="float32"))
    prompts = [p.encode(tokenizer) for p in read_prompts(HELDOUT_PATH)[:12]]

    def run(proposer):
        engine = Engine(target, proposer, EngineConfig(max_batch=3, drafts_by_batch=schedule),
                        eos_ids=tokenizer.eos_token_ids)
        events = engine.generate([Request(f"r{i}", p, SamplingParams(max_tokens=48)) for i, p in enumerate(prompts)])
        return [[t for e in evs for t in e.token_ids] for evs in events.values()], [evs[-1].stats for evs in events.values()]

    want, _ = run(None)
    got, stats = run(drafter)
    assert got == want
    assert sum(s.accepted for s in stats) > 0


def test_decoding_one_step_ahead_is_lossless(tiny_chat_dir):
    """Target-only decoding on static steps runs the device one step ahead of the host (each step
    fed the last step's picks on the device): it emits what the eager engine emits, token for token and
    character for character, through an EOS, a stop string, a stop id, max_tokens, admissions while
    others run (max_batch 2), a cancel, and a sampled request beside greedy ones (its tokens drawn on the
    device from the uniforms the step-by-step verify would draw)."""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request

    target = load_target(tiny_chat_dir)
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time", "Hello", "1 2 3 4"]

    def engine(static: bool, eos=()):
        e = Engine(target, None, EngineConfig(max_batch=2), eos_ids=eos, text_stream=tokenizer.stream)
        if static:
            e.graphs = StepGraphs(target, e.cache, e.capture, max_batch=2, query_lens=(1,), max_len=256,
                                  use_graphs=False)
        return e

    def outputs(events):
        return {rid: ([t for e in evs for t in e.token_ids], "".join(e.text_delta for e in evs),
                      evs[-1].finish_reason) for rid, evs in events.items()}

    plain = [Request(f"r{i}", tokenizer.encode(p), SamplingParams(max_tokens=9 + 4 * i, ignore_eos=True))
             for i, p in enumerate(prompts)]
    free = outputs(engine(False).generate(plain))
    eos, stop_id = free["r1"][0][4], free["r3"][0][6]
    stop_text = tokenizer.decode(free["r2"][0][3:6])
    reqs = lambda: [  # noqa: E731
        Request("r0", plain[0].prompt_ids, SamplingParams(max_tokens=20)),  # may meet the EOS
        Request("r1", plain[1].prompt_ids, SamplingParams(max_tokens=20)),  # meets it at its 5th token
        Request("r2", plain[2].prompt_ids, SamplingParams(max_tokens=20, ignore_eos=True, stop_strings=(stop_text,))),
        Request("r3", plain[3].prompt_ids, SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop_id,))),
        Request("r4", plain[4].prompt_ids, SamplingParams(max_tokens=11, ignore_eos=True)),
        Request("r5", plain[0].prompt_ids, SamplingParams(max_tokens=7, temperature=0.8, seed=3, ignore_eos=True)),
        Request("r6", plain[2].prompt_ids, SamplingParams(max_tokens=15, ignore_eos=True)),
    ]
    reference = outputs(engine(False, {eos}).generate(reqs()))
    assert reference["r1"][2] == "eos" and reference["r2"][2] == reference["r3"][2] == "stop"

    ahead = engine(True, {eos})
    launches = []
    launch = ahead.graphs.launch_decode
    ahead.graphs.launch_decode = lambda *a: launches.append(1) or launch(*a)
    assert outputs(ahead.generate(reqs())) == reference
    assert len(launches) > 20 and ahead.cache.num_free_blocks == ahead.cache.num_blocks - 1  # scratch kept

    # A cancel while a step for the request is in flight: the others are unchanged, the blocks come back.
    ahead = engine(True, {eos})
    for r in reqs()[:4]:
        ahead.add(r)
    events: dict[str, list] = {}
    for n in range(40):
        if n == 4:
            assert ahead._ahead is not None and ahead.abort("r0")
        for e in ahead.step():
            events.setdefault(e.request_id, []).append(e)
        if not ahead.has_work:
            break
    got = outputs(events)
    assert all(got[r] == reference[r] for r in ("r1", "r2", "r3"))
    assert got["r0"][0] == reference["r0"][0][:len(got["r0"][0])]
    assert ahead.cache.num_free_blocks == ahead.cache.num_blocks - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decoding_ahead_on_the_gpu_equals_step_by_step(smollm2_dir):
    """On a GPU the step launched ahead is queued behind the one whose picks the host has not read yet,
    reads its tokens from that step's argmax buffer before the same graph overwrites it, and its picks
    land in the other of two pinned buffers: the default model, real EOS, requests admitted while
    others decode (max_batch 3, 12 prompts), sampled ones among them, and a cancel mid-run emit what
    step-by-step decoding emits."""
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request
    from specsplit.train_data import HELDOUT_PATH, read_prompts

    # float32: steps ahead may run in other batch buckets than step by step (a sequence on its last token
    # is not launched ahead), and bf16 GEMMs of other shapes may part at near-ties
    target = load_target(smollm2_dir, dtype=torch.float32, device="cuda")
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    prompts = [p.encode(tokenizer) for p in read_prompts(HELDOUT_PATH)[:12]]

    def run(ahead: bool):
        engine = Engine(target, None, EngineConfig(max_batch=3, decode_ahead=ahead), eos_ids=tokenizer.eos_token_ids)
        for i, p in enumerate(prompts):
            sampled = dict(temperature=0.8, seed=i) if i % 4 == 0 else {}  # drawn on the device, CUDA generators
            engine.add(Request(f"r{i}", p, SamplingParams(max_tokens=40 + 7 * (i % 3), **sampled)))
        events: dict[str, list[int]] = {}
        for n in itertools.count():
            if n == 9:
                engine.abort("r1")
            for e in engine.step():
                events.setdefault(e.request_id, []).extend(e.token_ids)
            if not engine.has_work:
                return events, engine

    want, _ = run(False)
    got, engine = run(True)
    cut, full = sorted((got.pop("r1", []), want.pop("r1", [])), key=len)  # cancelled at a step, not a token
    assert cut == full[:len(cut)]
    assert got == want
    assert engine.cache.num_free_blocks == engine.cache.num_blocks - 1  # all but the scratch block


@pytest.mark.parametrize("short_when_full", [False, True])  # full batches draft 1 (drafts_by_batch)
@pytest.mark.parametrize("max_batch", [4, 2])
def test_speculative_steps_launched_ahead_are_lossless(tiny_chat_dir, max_batch, short_when_full):
    """In-process with drafts on the device, a step's verify is launched before the step before it emits
    (the device verifies while the host detokenizes and admits). The same run with it off gives the same
    tokens, text, finish reasons and per-request draft counts, through partial accepts, a sampled request,
    a stop string, a request that does not speculate, a cancel, and admissions while others run (max_batch
    2), with draft lengths that follow the batch size (a verify launched for a full batch is not taken
    once a sequence of it ended: the smaller batch asks for longer drafts); most steps take the verify
    launched for them, and every block comes back."""
    from specsplit.drafter_service.checkpoint import random_drafter
    from specsplit.local import target_head, target_info
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request
    from tests.oracle import DeviceOracle

    target = load_target(tiny_chat_dir)
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time", "Hello", "1 2 3"]
    plain = Engine(target, None, EngineConfig(max_batch=4), text_stream=tokenizer.stream)
    free = {rid: evs for rid, evs in plain.generate(
        [Request(f"r{i}", tokenizer.encode(p), SamplingParams(max_tokens=30, ignore_eos=True))
         for i, p in enumerate(prompts)]).items()}
    stop_text = tokenizer.decode([t for e in free["r1"] for t in e.token_ids][14:16])
    reqs = lambda: [  # noqa: E731
        Request("r0", tokenizer.encode(prompts[0]), SamplingParams(max_tokens=30, ignore_eos=True)),
        Request("r1", tokenizer.encode(prompts[1]), SamplingParams(max_tokens=30, ignore_eos=True,
                                                                   stop_strings=(stop_text,))),
        Request("r2", tokenizer.encode(prompts[2]), SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9,
                                                                   seed=5)),
        Request("r3", tokenizer.encode(prompts[3]), SamplingParams(max_tokens=20, ignore_eos=True), speculative=False),
        Request("r4", tokenizer.encode(prompts[4]), SamplingParams(max_tokens=26, ignore_eos=True)),
    ]
    inner = random_drafter("dflash", target_info(target), target_head(target), seed=0, dtype=torch.float32,
                           block_size=8, max_drafts=6)
    greedy_ref = {f"r{i}": tokenizer.encode(prompts[i]) + [t for e in free[f"r{i}"] for t in e.token_ids]
                  for i in range(5)}
    oracle = DeviceOracle(inner, {tuple(tokenizer.encode(p)): greedy_ref[f"r{i}"] for i, p in enumerate(prompts)},
                          mistake_rate=0.2)

    def run(ahead: bool):
        schedule = ((max_batch, 1),) if short_when_full else ()
        engine = Engine(target, oracle, EngineConfig(max_batch=max_batch, decode_ahead=ahead, drafts_by_batch=schedule),
                        text_stream=tokenizer.stream)
        engine.graphs = StepGraphs(target, engine.cache, engine.capture, max_batch=max_batch,
                                   query_lens=(1, engine._max_drafts() + 1), max_len=256, use_graphs=False)
        took = []
        take = engine._take_launched
        engine._take_launched = lambda seqs: _counted(take, seqs, took)
        stashed: dict[int, list[torch.Tensor]] = {}  # each sequence's verify rows, as the drafter got them
        oracle.stash = lambda seq_id, rows: stashed.setdefault(seq_id, []).append(rows.clone()) or inner.stash(seq_id, rows)
        for r in reqs():
            engine.add(r)
        events: dict[str, list] = {}
        for n in itertools.count():
            if n == 7:
                engine.abort("r0")
            for e in engine.step():
                events.setdefault(e.request_id, []).append(e)
            if not engine.has_work:
                break
        out = {rid: ([t for e in evs for t in e.token_ids], "".join(e.text_delta for e in evs), evs[-1].finish_reason,
                     (evs[-1].stats.drafted, evs[-1].stats.accepted, evs[-1].stats.steps))
               for rid, evs in events.items()}
        del oracle.stash
        return out, took, engine, stashed

    want, took_off, _, rows_off = run(False)
    got, took, engine, rows = run(True)
    assert got == want
    assert rows.keys() == rows_off.keys() and all(
        len(rows[i]) == len(rows_off[i]) and all(map(torch.equal, rows[i], rows_off[i])) for i in rows)
    assert not any(took_off) and took.count(True) > took.count(False)
    assert want["r1"][2] == "stop" and want["r0"][2] is None  # r0 cancelled: no last event
    assert want["r3"][3][0] == 0 and all(want[r][3][1] > 0 for r in ("r1", "r4"))
    assert engine.cache.num_free_blocks == engine.cache.num_blocks - 1  # all but the scratch block


def _counted(take, seqs, took):
    launched = take(seqs)
    took.append(launched is not None)
    return launched


def test_a_sampled_step_launched_ahead_and_dropped_rewinds_its_draws(tiny_chat_dir):
    """A sampled request decoding ahead draws its next token's uniform at launch; when a speculative
    request joins, the step launched ahead is dropped and computed again by the verify path. Its
    generator goes back to where it was, so the request's tokens are those of step-by-step decoding
    with the same seed and the same schedule."""
    from specsplit.drafter_service.checkpoint import random_drafter
    from specsplit.local import target_head, target_info
    from specsplit.shared.sampling import SamplingParams
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.target_service.engine import Engine, EngineConfig
    from specsplit.target_service.sequence import Request
    from tests.oracle import DeviceOracle

    target = load_target(tiny_chat_dir)
    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    inner = random_drafter("dflash", target_info(target), target_head(target), seed=0, dtype=torch.float32,
                           block_size=8, max_drafts=6)
    oracle = DeviceOracle(inner, {}, mistake_rate=0.0)

    def run(ahead: bool):
        engine = Engine(target, oracle, EngineConfig(max_batch=4, decode_ahead=ahead))
        engine.graphs = StepGraphs(target, engine.cache, engine.capture, max_batch=4,
                                   query_lens=(1, engine._max_drafts() + 1), max_len=256, use_graphs=False)
        engine.add(Request("sampled", tokenizer.encode("Once upon a time"),
                           SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True), speculative=False))
        out: dict[str, list[int]] = {}
        dropped = []
        drop = engine._drop_ahead
        engine._drop_ahead = lambda: dropped.append(engine._ahead is not None) or drop()
        for n in itertools.count():
            if n == 6:
                engine.add(Request("greedy", tokenizer.encode("Hello"), SamplingParams(max_tokens=8, ignore_eos=True)))
            for e in engine.step():
                out.setdefault(e.request_id, []).extend(e.token_ids)
            if not engine.has_work:
                return out, any(dropped)

    want, _ = run(False)
    got, dropped = run(True)
    assert dropped and got == want


@pytest.mark.parametrize("query_lens", [(1, 6), (4,)])  # (4,): no Q = 1 bucket, picks gathered by row
def test_decode_launches_chain_on_the_device(tiny_llama_dir, query_lens):
    """Three decode steps launched back to back, each fed the last one's picks on the device (one of
    the sequences dropping out, as one that ended would), the middle one choosing its own tokens: the
    picks equal eager greedy decoding fed the same tokens, whichever bucket the steps run in."""
    model = load_target(tiny_llama_dir)
    (static_cache, eager_cache), prompts = prefilled_pair(model, [5, 9, 3])
    graphs = StepGraphs(model, static_cache, CaptureSpec(), max_batch=4, query_lens=query_lens, max_len=64,
                        use_graphs=False)
    last = [p[-1] for p in prompts]
    pos = [len(p) - 1 for p in prompts]
    # the first step: host tokens; the second: fed all three; the third: fed sequences 0 and 2
    first = graphs.launch_decode(StepBatch([0, 1, 2], [[t] for t in last], pos))
    bump = lambda logits, picks: (picks + 1) % model.config.vocab_size  # noqa: E731 - a chooser of its own
    second = graphs.launch_decode(StepBatch([0, 1, 2], [[0]] * 3, [p + 1 for p in pos]),
                                  DeviceDrafts(first.device_picks.view(-1, 1), [0, 1, 2], [1, 1, 1], [0, 1, 2], column=0),
                                  bump)
    picks = [first.picks()]  # before the launch after next, as the engine reads them
    third = graphs.launch_decode(StepBatch([0, 2], [[0]] * 2, [pos[0] + 2, pos[2] + 2]),
                                 DeviceDrafts(second.device_picks.view(-1, 1), [0, 1], [1, 1], [0, 2], column=0))
    picks += [second.picks(), third.picks()]
    with pytest.raises(StateConflict, match="overwritten"):  # read too late: refused, not someone else's
        first.picks()

    want, tokens = [], last
    for n, seqs in enumerate(([0, 1, 2], [0, 1, 2], [0, 2])):
        out = eager(model, eager_cache, StepBatch(seqs, [[tokens[s]] for s in seqs], [pos[s] + n for s in seqs]),
                    CaptureSpec())
        argmax = out.logits.argmax(-1).tolist()
        chosen = [(a + 1) % model.config.vocab_size for a in argmax] if n == 1 else argmax
        want.append(chosen)
        tokens = dict(zip(seqs, chosen))
    assert picks == want
