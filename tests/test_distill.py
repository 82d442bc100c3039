"""Distillation on the target's distribution: the pooled rows give the target's own next-token logits
at the right positions, and the loss equals a naive per-row sum of CE and KL(target ‖ drafter)."""

from __future__ import annotations

import math

import pytest
import torch

from specsplit.drafter_service.checkpoint import random_drafter
from specsplit.drafter_service.training import dflash_block_hidden, mtp_step_outputs
from specsplit.local import target_head, target_info
from specsplit.shared.errors import InvalidRequest
from specsplit.target_service.dense import DenseDecoder, dense_forward, generate
from specsplit.target_service.model import load_target
from specsplit.train import Batch, Pool, TrainConfig, capture_for_model, dflash_loss, mtp_loss, sample_anchors

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_target(tiny_llama_dir)


def pooled(target, model, temperature=0.0):
    """A Batch of every generated sequence, as the training loop reads it from the pool."""
    decoder = DenseDecoder(target, len(PROMPTS), 13 + 12)
    decoder.set_capture(capture_for_model(model), final=True)
    out = generate(target, PROMPTS, 12, temperature=temperature, generator=torch.Generator().manual_seed(0),
                   decoder=decoder)
    hidden = target.config.hidden_size
    pool = Pool(out.tokens.numel(), len(PROMPTS), out.features.shape[2], hidden, out.features.dtype,
                out.features.device)
    pool.add(out, out.features, out.final)
    return pool.batch(torch.arange(len(PROMPTS)))


def target_logits(target, tokens, j):
    """The target's logits for token j of a sequence, from a fresh forward over tokens[:j]."""
    ids = tokens[None, :j]
    positions = torch.arange(j)[None]
    return dense_forward(target, ids, positions, torch.ones_like(ids, dtype=torch.bool), last_logits=True).logits[0]


def test_pooled_final_rows_give_the_targets_logits_for_each_next_token(llama):
    drafter = random_drafter("dflash", target_info(llama), target_head(llama), seed=1, num_layers=2, block_size=4)
    batch = pooled(llama, drafter.model)
    for b in range(len(PROMPTS)):
        for j in range(int(batch.starts[b]), int(batch.lengths[b])):
            got = torch.nn.functional.linear(batch.final[b, j - 1], llama.lm_head_weight)
            torch.testing.assert_close(got, target_logits(llama, batch.tokens[b], j), atol=1e-4, rtol=1e-4)
            assert int(got.argmax()) == int(batch.tokens[b, j])  # greedy data: the label is the target's argmax


@pytest.mark.parametrize("ce,kl", [(0.2, 1.0), (1.0, 0.0), (0.0, 1.0)])
def test_dflash_loss_equals_a_naive_sum_over_rows(llama, ce, kl):
    info, head = target_info(llama), target_head(llama)
    drafter = random_drafter("dflash", info, head, seed=2, num_layers=2, block_size=4)
    model = drafter.model.train()
    batch = pooled(llama, drafter.model, temperature=1.0)  # sampled: labels are not the target's argmax
    cfg = TrainConfig(steps=1, block_size=4, anchors=3, ce_weight=ce, kl_weight=kl)
    loss, _ = dflash_loss(model, head, batch, cfg, torch.Generator().manual_seed(5))
    anchors, real = sample_anchors(batch, 3, torch.Generator().manual_seed(5))
    hidden = dflash_block_hidden(model, head, batch.rows, batch.tokens, batch.positions, batch.valid, anchors)
    total = weights = 0.0
    for b in range(len(PROMPTS)):
        for n in range(3):
            for k in range(1, 4):
                a = int(anchors[b, n])
                if not real[b, n] or a + k >= int(batch.lengths[b]):
                    continue
                log_q = torch.log_softmax(model.logits(hidden[b, n, k], head), -1)
                log_p = torch.log_softmax(target_logits(llama, batch.tokens[b], a + k), -1)
                w = math.exp(-(k - 1) / cfg.decay)
                row = ce * -log_q[batch.tokens[b, a + k]] + kl * (log_p.exp() * (log_p - log_q)).sum()
                total, weights = total + w * row, weights + w
    torch.testing.assert_close(loss, total / weights, atol=1e-4, rtol=1e-4)


def test_mtp_loss_equals_a_naive_sum_over_rows(llama):
    info, head = target_info(llama), target_head(llama)
    model = random_drafter("mtp", info, head, seed=3).model.train()
    batch = pooled(llama, model, temperature=1.0)
    cfg = TrainConfig(kind="mtp", steps=1, mtp_steps=2, ce_weight=0.5, kl_weight=1.0)
    loss, _ = mtp_loss(model, head, batch, cfg, torch.Generator())
    outs = mtp_step_outputs(model, head, batch.rows, batch.tokens, batch.positions, batch.valid, 2)
    total = weights = 0.0
    for b in range(len(PROMPTS)):
        for step, out in enumerate(outs, 1):
            for i in range(1, int(batch.lengths[b]) - step):  # step s at index i predicts x_{i+s}
                if i + step < int(batch.starts[b]):
                    continue
                log_q = torch.log_softmax(model.logits(out[b, i - 1], head), -1)
                log_p = torch.log_softmax(target_logits(llama, batch.tokens[b], i + step), -1)
                w = math.exp(-(step - 1) / cfg.decay)
                row = 0.5 * -log_q[batch.tokens[b, i + step]] + (log_p.exp() * (log_p - log_q)).sum()
                total, weights = total + w * row, weights + w
    torch.testing.assert_close(loss, total / weights, atol=1e-4, rtol=1e-4)
    with pytest.raises(InvalidRequest):
        mtp_loss(model, head, Batch(**{**batch.__dict__, "final": None}), cfg, torch.Generator())
