"""Drafter training: the dense target path matches the engine, the training forwards match inference
exactly, a short run lowers the loss, and the checkpoint it writes loads and decodes losslessly."""

from __future__ import annotations

import random

import pytest
import torch

from specsplit.drafter_service.checkpoint import load_drafter, random_drafter
from specsplit.drafter_service.training import dflash_block_hidden, mtp_step_outputs
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.proposer import ProposeRequest
from specsplit.shared.sampling import SamplingParams
from specsplit import train_data
from specsplit.local import target_head, target_info
from specsplit.train import (Pool, TrainConfig, capture_for_model, grow_dflash, new_drafter, save_drafter,
                             train_drafter)
from specsplit.target_service.dense import Generated, capture_features, generate
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.model import CaptureSpec, ForwardBatch, load_target
from specsplit.target_service.sequence import Request
from tests.conftest import TINY
from tests.rounding import network_atol

WIDEST = TINY["intermediate_size"]  # the tiny llama's longest sum, and its drafters' (vocabulary 128)


def assert_reordered_close(got: torch.Tensor, expected: torch.Tensor, depth: int) -> None:
    """Training and inference forwards (padded dense batches against one paged sequence, whole
    blocks against cached steps) sum in different orders (tests/rounding.py)."""
    torch.testing.assert_close(got, expected, atol=network_atol(expected.abs().max().item(), WIDEST, depth), rtol=0)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_target(tiny_llama_dir)


def engine_greedy(target, prompts, max_tokens, proposer=None):
    engine = Engine(target, proposer, EngineConfig(max_batch=4))
    events = engine.generate([Request(f"r{i}", list(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                              for i, p in enumerate(prompts)])
    return [list(p) + [t for e in events[f"r{i}"] for t in e.token_ids] for i, p in enumerate(prompts)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: sliding-window layers
def test_dense_greedy_matches_the_engine(family, request):
    target = load_target(request.getfixturevalue(f"tiny_{family}_dir"))
    assert generate(target, PROMPTS, 14).rows() == engine_greedy(target, PROMPTS, 14)


def test_dense_generation_stops_at_eos_and_samples_reproducibly(llama):
    greedy = generate(llama, PROMPTS, 14)
    eos = greedy.tokens[0, len(PROMPTS[0]) + 3].item()  # the 4th token row 0 generates
    cut = generate(llama, PROMPTS, 14, eos_ids=[eos])
    assert cut.rows()[0] == greedy.rows()[0][:len(PROMPTS[0]) + 4]
    for row, full in zip(cut.rows(), greedy.rows()):
        assert row == full[:len(row)] and (len(row) == len(full) or row[-1] == eos)
    draw = [generate(llama, PROMPTS, 10, temperature=0.9, generator=torch.Generator().manual_seed(s)).rows()
            for s in (1, 1, 2)]
    assert draw[0] == draw[1] != draw[2]
    with pytest.raises(InvalidRequest):
        generate(llama, [[1], []], 4)


def test_captured_features_match_the_paged_forward(llama):
    out = generate(llama, PROMPTS, 9)
    capture = CaptureSpec(layer_ids=(0, 2), last_hidden=True)
    layers = capture_features(llama, out.tokens, out.lengths, CaptureSpec(layer_ids=(0, 2)), chunk=2)
    last = capture_features(llama, out.tokens, out.lengths, CaptureSpec(last_hidden=True))
    for b, row in enumerate(out.rows()):
        cache = llama.new_cache(16)
        cache.allocate(0)
        ref = llama(ForwardBatch(torch.tensor(row), torch.arange(len(row)), torch.tensor([0, len(row)]), [0]),
                    cache, capture)
        assert_reordered_close(layers[b, :len(row)], ref.layer_features, depth=TINY["num_hidden_layers"])
        assert_reordered_close(last[b, :len(row)], ref.last_hidden, depth=TINY["num_hidden_layers"])


def _recording(drafter):
    """Every logits tensor the drafter computes while proposing."""
    seen, logits = [], drafter.model.logits

    def record(hidden, head):
        out = logits(hidden, head)
        seen.append(out)
        return out

    drafter.model.logits = record
    return seen, logits


def _sharpened(drafter):
    with torch.no_grad():  # weights large enough that a wrong mask or position moves the logits a lot
        for p in drafter.model.parameters():
            if p.dim() == 2:
                p.mul_(5)
    return drafter


def _sequence(target, drafter):
    out = generate(target, PROMPTS, 20)
    rows = capture_features(target, out.tokens, out.lengths, capture_for_model(drafter.model))
    positions = torch.arange(out.tokens.shape[1]).expand_as(out.tokens)
    return out, rows, positions, positions < out.lengths[:, None]


@pytest.mark.parametrize("layer_types", [None, ("full_attention", "sliding_attention")])
def test_dflash_training_blocks_equal_inference_proposals(llama, layer_types):
    info, head = target_info(llama), target_head(llama)
    drafter = _sharpened(random_drafter("dflash", info, head, seed=3, num_layers=2, block_size=6,
                                        layer_types=layer_types, sliding_window=3 if layer_types else None))
    out, rows, positions, valid = _sequence(llama, drafter)
    b, tokens = 2, out.tokens[2]
    anchors = [int(out.lengths[b]) - 9, len(PROMPTS[b]) + 2, int(out.lengths[b]) - 3]
    hidden = dflash_block_hidden(drafter.model, head, rows, out.tokens, positions, valid,
                                 torch.tensor([[0, 4, 9], [1, 2, 3], anchors]))
    seen, logits = _recording(drafter)
    for n, anchor in enumerate(anchors):  # each block alone, as inference sees it
        drafter.alloc(n, 64)
        drafter.prefill(n, tokens[:anchor].tolist(), rows[b, :anchor])
        proposal = drafter.propose([ProposeRequest(n, int(tokens[anchor]), anchor, 5, want_confidence=True)])[0]
        expected = logits(hidden[b, n, 1:6], head)
        assert_reordered_close(seen[-1][0], expected, depth=4)  # fc, 2 layers, head
        assert proposal.tokens == expected.argmax(-1).tolist()


def test_mtp_training_steps_equal_inference_drafts(llama):
    info, head = target_info(llama), target_head(llama)
    drafter = _sharpened(random_drafter("mtp", info, head, seed=4, max_drafts=3))
    out, rows, _, _ = _sequence(llama, drafter)
    b, tokens = 0, out.tokens[0]
    anchor = int(out.lengths[b]) - 10
    seen, logits = _recording(drafter)
    drafter.alloc(0, 64)
    drafter.prefill(0, tokens[:anchor].tolist(), rows[b, :anchor])
    drafts = drafter.propose([ProposeRequest(0, int(tokens[anchor]), anchor, 3)])[0].tokens
    # Teacher forcing with the drafts themselves reproduces the chained inference steps.
    seq = torch.cat([tokens[:anchor + 1], torch.tensor(drafts)])[None]
    hidden = torch.cat([rows[b, :anchor + 1], rows.new_zeros(3, rows.shape[2])])[None]
    positions = torch.arange(seq.shape[1])[None]
    outs = mtp_step_outputs(drafter.model, head, hidden, seq, positions, torch.ones_like(seq, dtype=torch.bool), 3)
    expected = torch.stack([logits(o[0, anchor - 1], head) for o in outs])
    assert_reordered_close(torch.cat(seen), expected, depth=7)  # 3 chained steps of fusion and layer, head
    assert expected.argmax(-1).tolist() == drafts


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_training_lowers_the_loss_and_saves_a_lossless_drafter(kind, llama, tmp_path):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(3, 12))] for _ in range(24)]
    cfg = TrainConfig(kind=kind, layers=1, block_size=4, batch=8, anchors=8, mtp_steps=2, seq_len=24,
                      max_prompt_tokens=16, gen_batch=12, steps=24, lr=3e-3, warmup=0.0, log_every=100)
    lines = []
    result = train_drafter(cfg, llama, prompts, log=lines.append)
    assert result.pool_size >= 24 and any(line.startswith("gen batch") for line in lines)
    assert sum(result.losses[-3:]) / 3 < result.losses[0] * 0.8
    folder = save_drafter(result.model, tmp_path / kind)
    drafter = load_drafter(folder, target_head(llama), target_info=target_info(llama), dtype=torch.float32)
    assert next(drafter.model.parameters()).dtype == torch.float32
    reference = engine_greedy(llama, PROMPTS, 16)
    assert engine_greedy(llama, PROMPTS, 16, drafter) == reference


def test_config_is_validated():
    with pytest.raises(InvalidRequest):
        TrainConfig(kind="eagle", steps=1)
    with pytest.raises(InvalidRequest):
        TrainConfig(kind="dflash")  # neither steps nor minutes
    with pytest.raises(InvalidRequest):
        TrainConfig(kind="dflash", steps=1, block_size=1)
    assert TrainConfig(steps=1, block_size=16).decay == 7.0
    assert TrainConfig(steps=1, block_size=8).decay == 4.0
    for bad in ({"ce_weight": 0.0, "kl_weight": 0.0}, {"kl_weight": -1.0}, {"target_layers": ()},
                {"target_layers": (1, 2), "num_target_layers": 2}, {"num_target_layers": 0},
                {"sampled_by_kind": (("poetry", 1.0),)}, {"sampled_by_kind": (("chat", 1.0), ("chat", 2.0))},
                {"sampled_by_kind": (("code", -0.5),)}, {"sampled_by_kind": (("math", 4.5),)},
                {"walk_share": 1.5}, {"walk_share": -0.1}, {"kind": "mtp", "walk_share": 0.5},
                {"walk_steps": 0}, {"reveal_share": 1.5}, {"reveal_share": -0.5},
                {"reveal_share": 0.5, "reveal_max": 0}, {"reveal_share": 0.5, "reveal_max": 15},
                {"kind": "mtp", "reveal_share": 0.5}):
        with pytest.raises(InvalidRequest):
            TrainConfig(steps=1, **bad)
    assert TrainConfig(steps=1, reveal_share=0.5, reveal_max=14).reveal_max == 14  # γ-2: one row left to draft
    cfg = TrainConfig(steps=1, sampled_fraction=0.25, sampled_by_kind=(("chat", 2.0), ("code", 0.0)))
    assert (cfg.sampled_for("chat"), cfg.sampled_for("code"), cfg.sampled_for("math")) == (2.0, 0.0, 0.25)


def test_target_layers_are_chosen_as_asked_and_kept_from_init(llama, tmp_path):
    info, device = target_info(llama), torch.device("cpu")
    assert TrainConfig(steps=1, layers=2).target_layer_ids(30) == (1, 27)  # session 1-5 drafters
    assert TrainConfig(steps=1, num_target_layers=5).target_layer_ids(30) == (1, 8, 14, 20, 27)  # sessions 6-13 drafters
    model = new_drafter(TrainConfig(steps=1, layers=1, target_layers=(0, 2)), info, device, None)
    assert model.cfg.target_layer_ids == (0, 2) and model.cfg.feature_dim == 2 * info.hidden_size
    with pytest.raises(InvalidRequest):
        new_drafter(TrainConfig(steps=1, target_layers=(0, 9)), info, device, None)  # the tiny llama has 3
    folder = save_drafter(model, tmp_path / "d")
    with pytest.raises(InvalidRequest):  # the checkpoint's blocks of 4 leave no row past 5 given ones
        new_drafter(TrainConfig(steps=1, reveal_share=0.5, reveal_max=5), info, device,
                    save_drafter(new_drafter(TrainConfig(steps=1, layers=1, block_size=4, target_layers=(0, 2)),
                                             info, device, None), tmp_path / "b4"))
    again = new_drafter(TrainConfig(steps=1), info, device, folder)
    assert again.cfg.target_layer_ids == (0, 2) and len(again.layers) == 1  # nothing asked: the checkpoint's
    grown = new_drafter(TrainConfig(steps=1, layers=3, target_layers=(0, 1, 2)), info, device, folder)
    assert grown.cfg.target_layer_ids == (0, 1, 2) and len(grown.layers) == 3
    with pytest.raises(InvalidRequest):  # would drop target layer 0
        new_drafter(TrainConfig(steps=1, target_layers=(1, 2)), info, device, folder)
    with pytest.raises(InvalidRequest):  # fewer layers than the checkpoint's
        new_drafter(TrainConfig(steps=1, layers=1), info, device, save_drafter(grown, tmp_path / "g"))


def test_a_grown_drafter_computes_what_it_grew_from_and_trains_its_new_parts(llama):
    info, head = target_info(llama), target_head(llama)
    small = random_drafter("dflash", info, head, seed=3, num_layers=1, target_layer_ids=(0, 2)).model
    big = grow_dflash(small, 3, (0, 1, 2), seed=4)
    gen = torch.Generator().manual_seed(0)
    hidden = info.hidden_size
    rows = torch.randn(1, 12, 3 * hidden, generator=gen)  # target layers 0, 1, 2
    tokens = torch.randint(0, info.vocab_size, (1, 12), generator=gen)
    positions, valid = torch.arange(12)[None], torch.ones(1, 12, dtype=torch.bool)
    anchors = torch.tensor([[3, 7]])
    narrow = torch.cat([rows[..., :hidden], rows[..., 2 * hidden:]], -1)  # what the small one reads
    expected = dflash_block_hidden(small, head, narrow, tokens, positions, valid, anchors)
    got = dflash_block_hidden(big, head, rows, tokens, positions, valid, anchors)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # A mutant that keeps the fc columns in the old order (layer 2's where layer 1's go) differs.
    swapped = grow_dflash(small, 3, (0, 1, 2), seed=4)
    with torch.no_grad():
        swapped.fc.weight[:, hidden:2 * hidden], swapped.fc.weight[:, 2 * hidden:] = \
            swapped.fc.weight[:, 2 * hidden:].clone(), swapped.fc.weight[:, hidden:2 * hidden].clone()
    assert not torch.allclose(dflash_block_hidden(swapped, head, rows, tokens, positions, valid, anchors), expected,
                              atol=1e-3)
    big.requires_grad_(True)
    dflash_block_hidden(big, head, rows, tokens, positions, valid, anchors).square().sum().backward()
    assert big.layers[2].self_attn.o_proj.weight.grad.abs().sum() > 0  # the new layers learn
    assert big.layers[2].mlp.down_proj.weight.grad.abs().sum() > 0
    assert big.fc.weight.grad[:, hidden:2 * hidden].abs().sum() > 0  # and so do the new feature columns


@pytest.mark.slow  # (7-9 s on the CPU, building a session's training prompts: the default run stays under five minutes)
def test_heldout_prompts_are_never_trained_on():
    heldout = train_data.read_prompts(train_data.HELDOUT_PATH)
    assert len(heldout) == 80 and [p.kind for p in heldout].count("math") == 16
    assert {p.kind for p in heldout} == set(train_data.KINDS) == {"chat", "code", "math"}
    assert all(train_data.is_heldout(p.key) for p in heldout)
    training = train_data.training_prompts(0, code_per_file=2, requests_per_file=1, word_problem_count=400)
    assert training and not any(train_data.is_heldout(p.key) for p in training)
    assert not {p.text for p in heldout} & {p.text for p in training}
    assert not {p.key for p in heldout if p.kind in ("code", "math")} & {p.key for p in training}


@pytest.mark.slow  # (~5 s: the standard library's files are read)
def test_the_trained_side_draw_is_the_held_out_draws_twin():
    """heldout_prompts(trained=True): as many prompts of each kind as the held-out set, none of them held out
    by key or text (so a drafter's tau on them is its tau on prompts like those it trained on)."""
    heldout = train_data.read_prompts(train_data.HELDOUT_PATH)
    trained = train_data.heldout_prompts(trained=True)
    kinds = [p.kind for p in heldout]
    assert sorted(p.kind for p in trained) == sorted(kinds)
    assert not any(train_data.is_heldout(p.key) for p in trained)
    assert not {p.text for p in heldout} & {p.text for p in trained}
    assert all(train_data.is_heldout(p.key) for p in train_data.heldout_prompts())


def test_word_problems_are_held_out_by_template():
    """A held-out template's problems never reach training, whatever numbers are drawn into them; the
    held-out file's math prompts come only from templates no checkpoint was trained on."""
    # training_prompts keeps exactly the prompts whose key is not held out (the test above)
    drawn = train_data.word_problems(2000, 3)
    templates = {p.key for p in drawn if not train_data.is_heldout(p.key)}
    assert len(templates) > len(train_data.WORD_PROBLEMS) // 2  # most templates train
    assert all(p.key.startswith(train_data.HELDOUT_KEY_PREFIX) for p in train_data.read_prompts(
        train_data.HELDOUT_PATH) if p.kind == "math")
    held = train_data.word_problems(50, 0, heldout_templates=True)
    assert held and all(train_data.is_heldout(p.key) and p.kind == "math" for p in held)
    assert not {p.key for p in held} & templates


def test_adding_a_kind_keeps_the_held_out_prompts_of_record(tmp_path):
    path = tmp_path / "heldout.jsonl"
    record = [train_data.Prompt("chat", "Name a color.", "Name a color."), train_data.Prompt("code", "def f():", "x.py")]
    train_data.write_prompts(path, record)
    drawn = [train_data.Prompt("chat", "Another question?", "Another question?")] + \
        train_data.word_problems(3, 0, heldout_templates=True)
    train_data.add_kind(path, drawn)
    assert train_data.read_prompts(path) == record + drawn[1:]
    train_data.add_kind(path, drawn)  # nothing new the second time
    assert train_data.read_prompts(path) == record + drawn[1:]


@pytest.mark.slow
def test_the_command_writes_questions_trains_and_saves(tiny_chat_dir, tmp_path, monkeypatch):
    """The whole `train-drafter` path on a tiny model with the real tokenizer: offline prompts, the
    target's own questions (a random model writes none that pass the filters), generation within the
    time budget, training, a checkpoint that loads."""
    from specsplit import train
    from specsplit.train import run

    lines, given = [], []
    original = train.train_drafter
    monkeypatch.setattr(train, "train_drafter", lambda *a, samples=None, **kw: given.append(samples) or original(
        *a, samples=samples, **kw))
    cfg = TrainConfig(layers=1, target_layers=(0, 2), block_size=4, batch=8, anchors=4, seq_len=8,
                      max_prompt_tokens=32, gen_batch=64, self_prompts=64, minutes=0.5, log_every=10, pool_gb=0.1,
                      sampled_by_kind=(("code", 1.0), ("math", 0.0)))
    folder = run(cfg, target=str(tiny_chat_dir), out=tmp_path / "d", device="cpu", log=lines.append,
                 eval_tokens=4, eval_limit=3, eval_dtype=torch.bfloat16)
    text = "\n".join(lines)
    for needle in ("offline training prompts (seed 0)", "questions written by the target from 64 samples",
                   "training prompts within 32 tokens", "target layers [0, 2]", "generated tokens", "epochs",
                   "held-out eval in bfloat16, this checkpoint: tau ", "3 prompts, 4 tokens",
                   "sampled continuations a prompt: chat 0.25, code 1, math 0"):
        assert needle in text
    (samples,) = given  # per prompt, by its kind (within 32 tokens only code prompts fit: chat's template is longer)
    assert "(0 chat, " in text and set(samples) == {1.0}
    assert "the --init checkpoint" not in text  # none was given
    target = load_target(tiny_chat_dir)
    drafter = load_drafter(folder, target_head(target), target_info=target_info(target))
    assert drafter.model.cfg.target_layer_ids == (0, 2)


def test_a_later_sessions_seed_draws_new_prompts():
    files = train_data.stdlib_files()[:30]
    code = [{p.text for p in train_data.code_prefixes(files, 2, seed, per_kchars=1.0)} for seed in (0, 1)]
    math_ = [{p.text for p in train_data.word_problems(300, seed)} for seed in (0, 1)]
    for first, second in (code, math_):
        assert len(first) > 50 and len(first & second) < 0.2 * len(first)
    assert len(train_data.code_prefixes(files, 2, 0, per_kchars=3.0)) > len(code[0])  # more per character


def test_the_pool_stores_sequences_back_to_back_and_returns_them_padded():
    """Two batches of different widths; the second fits only in part. Every sequence comes back as it
    went in, zero past its end, whatever batch it shares."""
    gen = torch.Generator().manual_seed(0)

    def made(lengths, prompt, width):
        lengths = torch.tensor(lengths)
        cols = torch.arange(width)[None, :]
        tokens = torch.randint(1, 100, (len(lengths), width), generator=gen).masked_fill(cols >= lengths[:, None], 0)
        rows = torch.randn(len(lengths), width, 3, generator=gen)
        return Generated(tokens, torch.full_like(lengths, prompt), lengths), rows, rows[..., :2] * 2

    first, second = made([5, 9, 3, 4], 2, 9), made([12, 5, 7, 5], 3, 12)  # 3: one generated token, left out
    pool = Pool(18 + 17, 10, 3, 2, torch.float32, torch.device("cpu"))
    assert pool.add(*first) == 3 and pool.add(*second) == 2 and pool.room() == (0, 5)  # 12 + 5; then 7 does not fit
    kept = [(*first, 0), (*first, 1), (*first, 3), (*second, 0), (*second, 1)]
    seqs = [kept[k] for k in (4, 0, 3, 1, 2)]
    batch = pool.batch(torch.tensor([4, 0, 3, 1, 2]))
    for i, (g, rows, final, b) in enumerate(seqs):
        n, width = int(g.lengths[b]), batch.tokens.shape[1]
        assert width == 12 and batch.lengths[i] == n and batch.starts[i] == g.prompt_lengths[b]
        assert batch.tokens[i, :n].tolist() == g.tokens[b, :n].tolist() and not batch.tokens[i, n:].any()
        assert torch.equal(batch.rows[i, :n], rows[b, :n]) and not batch.rows[i, n:].any()
        assert torch.equal(batch.final[i, :n], final[b, :n]) and batch.valid[i].sum() == n


def test_the_pool_is_cut_to_what_fits_beside_generation(monkeypatch):
    """On a GPU --pool-gb is cut to the memory left once the generator's buffers are in, keeping two
    batches' rows and some slack for generating (a 90 GiB pool that left too little once ran out of
    memory minutes into a run); the cut is logged, and a GPU that cannot hold a batch's worth of pool
    is refused before anything is generated. On the CPU the request stands."""
    from specsplit import train
    from specsplit.shared.errors import CapacityExceeded

    gib = 2**30
    assert train.pool_bytes_that_fit(10 * gib, 100 * gib, gib) == 10 * gib
    assert train.pool_bytes_that_fit(90 * gib, 100 * gib, 5 * gib) == 100 * gib - 10 * gib - train.GENERATION_SLACK
    assert train.pool_bytes_that_fit(90 * gib, gib, gib) == 0

    cfg = TrainConfig(kind="dflash", pool_gb=90, gen_batch=64, max_prompt_tokens=32, seq_len=32, steps=1)
    per_token = 1000
    batch_rows = 64 * 64 * per_token
    logged = []
    assert train.fit_pool(cfg, per_token, torch.device("cpu"), logged.append) == 90 * gib and not logged

    free, reserved_unused = 60 * gib, 4 * gib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * gib + reserved_unused)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 30 * gib)
    cuda = torch.device("cuda", 0)
    fits = train.fit_pool(cfg, per_token, cuda, logged.append)
    assert fits == free + reserved_unused - 2 * batch_rows - train.GENERATION_SLACK
    assert len(logged) == 1 and "--pool-gb 90 does not fit" in logged[0]
    free, reserved_unused = train.GENERATION_SLACK + 2 * batch_rows, 0  # nothing left for the pool itself
    with pytest.raises(CapacityExceeded, match="lower --gen-batch"):
        train.fit_pool(cfg, per_token, cuda, logged.append)


def test_pool_rounds_generate_fresh_pools_from_unused_prompts_under_one_schedule(llama, monkeypatch):
    """--pool-rounds 2 with a pool that holds a batch or two of four: each round generates from prompts
    the other did not use, the steps split between the rounds, one optimizer and one learning-rate
    schedule throughout; rounds with no prompts left train on the last pool."""
    from specsplit import train

    made = []
    real = train.generate

    def recording(model, prompts, *args, **kwargs):
        made.append([tuple(p) for p in prompts])
        return real(model, prompts, *args, **kwargs)

    monkeypatch.setattr(train, "generate", recording)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(3, 10))] for _ in range(32)]
    one_batch = (10 + 12) * 8  # a gen batch's tokens at most: the pool holds one or two
    per_token = train.Pool.bytes_per_token(2 * llama.config.hidden_size, llama.config.hidden_size, 4)
    base = dict(kind="dflash", layers=1, target_layers=(0, 2), block_size=4, batch=4, anchors=4, seq_len=12,
                max_prompt_tokens=10, gen_batch=8, sampled_fraction=0.0, warmup=0.0, log_every=100,
                pool_gb=one_batch * per_token / 2**30)
    lrs = []
    original = train.lr_at
    monkeypatch.setattr(train, "lr_at", lambda progress, cfg: lrs.append(progress) or original(progress, cfg))
    lines = []
    result = train.train_drafter(TrainConfig(steps=12, pool_rounds=2, **base), llama, prompts, log=lines.append)
    assert 2 <= len(made) <= 4 and len(set().union(*made)) == sum(map(len, made))  # no prompt twice
    sizes = [int(line.split(": ")[1].split()[0]) for line in lines if line.startswith(("pool 1/2:", "pool 2/2:"))]
    assert len(sizes) == 2 and min(sizes) > 0 and result.pool_size == sum(sizes)
    assert len(result.losses) == 12
    assert lrs == sorted(lrs) and lrs[0] == 0 and lrs[-1] == 11 / 12  # one schedule across the rounds

    made.clear()
    lines.clear()
    result = train.train_drafter(TrainConfig(steps=12, pool_rounds=6, **base), llama, prompts, log=lines.append)
    assert len(made) == 4 and len(set().union(*made)) == 32 and len(result.losses) == 12  # each batch once
    assert "round 6/6: no prompts left to generate; training on the last pool" in lines


def test_a_rounds_clock_splits_the_run_in_equal_shares():
    clock = train_module().Clock(minutes=10, gen_fraction=0.3, start=0.0, margin_s=0.0)
    assert clock.gen_budget() == 180 and clock.round_end(0, 1) == float("inf")
    assert clock.gen_budget(0, 3) == pytest.approx(60) and clock.gen_budget(2, 3) == pytest.approx(460)
    assert clock.round_end(0, 3) == 200 and clock.round_end(1, 3) == 400 and clock.round_end(2, 3) == float("inf")
    clock.rounds_from, clock.margin_s = 60, 15  # the rounds share what is left once the prompts are written
    assert clock.gen_budget() == 180 and clock.gen_budget(0, 3) == pytest.approx(60 + 52.5)
    assert clock.round_end(0, 3) == pytest.approx(235) and clock.round_end(1, 3) == pytest.approx(410)
    untimed = train_module().Clock(minutes=None, gen_fraction=0.3)
    assert untimed.gen_budget(1, 2) == float("inf") and untimed.round_end(0, 2) == float("inf")
    with pytest.raises(InvalidRequest):
        TrainConfig(steps=1, pool_rounds=0)


def train_module():
    from specsplit import train
    return train


def test_a_timed_run_in_rounds_keeps_one_monotone_schedule_and_trains_every_round(llama, monkeypatch):
    """Minutes, not steps: the time part of the schedule goes on from where each round left it, though the
    rounds' pools fill early (their generation ends before its budget), and ends in the last round; every
    round trains. Time is simulated: each clock read advances it 20 ms."""
    from specsplit import train

    now = [0.0]

    def ticking() -> float:
        now[0] += 0.02
        return now[0]

    monkeypatch.setattr(train.time, "monotonic", ticking)
    progress = []
    original = train.lr_at
    monkeypatch.setattr(train, "lr_at", lambda p, cfg: progress.append(p) or original(p, cfg))
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(3, 10))] for _ in range(48)]
    per_token = train.Pool.bytes_per_token(2 * llama.config.hidden_size, llama.config.hidden_size, 4)
    cfg = TrainConfig(kind="dflash", layers=1, target_layers=(0, 2), block_size=4, batch=4, anchors=4, seq_len=12,
                      max_prompt_tokens=10, gen_batch=8, sampled_fraction=0.0, warmup=0.0, log_every=1,
                      minutes=0.5, gen_fraction=0.3, pool_rounds=3, pool_gb=2 * 22 * 8 * per_token / 2**30)
    lines = []
    clock = train.Clock(cfg.minutes, cfg.gen_fraction, start=ticking())  # (the default reads the real clock)
    steps = []
    monkeypatch.setattr(train, "_log_step", lambda log, step, *rest: steps.append((step, clock.elapsed())))
    train.train_drafter(cfg, llama, prompts, log=lines.append, clock=clock)
    pools = [line for line in lines if line.startswith("pool ")]
    assert len(pools) == 2 and "round 3/3: no prompts left to generate; training on the last pool" in lines
    assert progress == sorted(progress) and progress[-1] > 0.97, progress[-5:]
    assert 30 - 15 - 0.5 < clock.elapsed() < 30 - 15 + 0.5  # trained to the end, less the margin
    ends = [clock.round_end(r, 3) for r in range(2)]
    # every round trained (steps logged before the first round's end, between the two, after the second)
    assert [sum(1 for _, t in steps if lo <= t < hi) > 0 for lo, hi in ((0, ends[0]), (ends[0], ends[1]),
                                                                        (ends[1], 99))] == [True] * 3
