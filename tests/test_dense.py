"""The dense batched path: graph-shaped decode steps see exactly the keys of a full forward, and one
decoder reused across batches of different sizes and prompt widths gives what a fresh one gives."""

from __future__ import annotations

import pytest
import torch

from specsplit.shared.errors import InvalidRequest
from specsplit.target_service.dense import DenseDecoder, capture_rows, dense_forward, generate, left_pad
from specsplit.target_service.model import CaptureSpec, load_target

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_dir):  # sliding-window layers: two masks per step
    return load_target(tiny_qwen3_dir)


@pytest.mark.parametrize("bucket", [1, 4, 64])
def test_each_decode_step_equals_a_full_forward(qwen3, bucket):
    ids, positions, valid = left_pad(PROMPTS, torch.device("cpu"))
    decoder = DenseDecoder(qwen3, len(PROMPTS), ids.shape[1] + 6, bucket=bucket)
    logits = decoder.prefill(ids, positions, valid)
    for step in range(5):
        token = logits.argmax(-1)
        ids, positions = torch.cat([ids, token[:, None]], 1), torch.cat([positions, positions[:, -1:] + 1], 1)
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], 1)
        logits = decoder.step(token, positions[:, -1], ids.shape[1] - 1).clone()
        full = dense_forward(qwen3, ids, positions, valid, last_logits=True).logits
        torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)


def test_a_reused_decoder_equals_a_fresh_one(qwen3):
    decoder = DenseDecoder(qwen3, 4, 13 + 10, bucket=8)
    for prompts in (PROMPTS, PROMPTS[1:], [[9, 8, 7]] * 4):
        assert generate(qwen3, prompts, 10, decoder=decoder).rows() == generate(qwen3, prompts, 10).rows()
    with pytest.raises(InvalidRequest):
        generate(qwen3, PROMPTS * 2, 4, decoder=decoder)  # more rows than the decoder holds
    with pytest.raises(InvalidRequest):
        generate(qwen3, PROMPTS, 11, decoder=decoder)  # wider than its cache


@pytest.mark.parametrize("capture", [CaptureSpec(layer_ids=(2, 0)), CaptureSpec(last_hidden=True)])
def test_rows_kept_while_decoding_equal_a_second_pass(qwen3, capture):
    decoder = DenseDecoder(qwen3, 4, 13 + 9, bucket=8)
    generate(qwen3, [[7, 7, 7, 7]] * 4, 9, decoder=decoder)  # leaves stale rows behind
    decoder.set_capture(capture, final=True)
    out = generate(qwen3, PROMPTS, 9, temperature=1.0, generator=torch.Generator().manual_seed(3), decoder=decoder)
    fresh = DenseDecoder(qwen3, 4, 13 + 9)  # as many rows: the same random draws
    assert out.rows() == generate(qwen3, PROMPTS, 9, temperature=1.0, generator=torch.Generator().manual_seed(3),
                                  decoder=fresh).rows()
    again = capture_rows(qwen3, out.tokens, out.lengths, CaptureSpec(capture.layer_ids, last_hidden=True))
    features = again.layer_features if capture.layer_ids else again.last_hidden
    for b, n in enumerate(out.lengths.tolist()):  # every row but the last token's, which is never fed back
        torch.testing.assert_close(out.features[b, :n - 1], features[b, :n - 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.final[b, :n - 1], qwen3.model.norm(again.last_hidden[b, :n - 1]),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replays_equal_eager_steps_on_cuda(smollm2_dir):
    """The same steps captured as CUDA graphs and run eagerly (identical kernels) give the same tokens and rows,
    bf16, greedy and sampled, with one decoder reused across batches (graphs captured once per key width)."""
    target = load_target(smollm2_dir, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 4000, (int(n),), generator=gen).tolist() for n in torch.randint(5, 90, (48,))]
    decoders = [DenseDecoder(target, 64, 96 + 80, use_graphs=graphs) for graphs in (True, False)]
    for decoder in decoders:
        decoder.set_capture(CaptureSpec(layer_ids=(1, 27)), final=True)
    for temperature, batch in ((0.0, prompts), (0.8, prompts[:40])):
        got = [generate(target, batch, 80, temperature=temperature, decoder=d,
                        generator=torch.Generator(device="cuda").manual_seed(1)) for d in decoders]
        assert got[0].rows() == got[1].rows()
        for b, n in enumerate(got[0].lengths.tolist()):
            torch.testing.assert_close(got[0].features[b, :n - 1], got[1].features[b, :n - 1])
            torch.testing.assert_close(got[0].final[b, :n - 1], got[1].final[b, :n - 1])
    assert len(decoders[0].graphs) >= 2
