"""Programmatic dependent launch (kernels/_triton.py): which launches ask for it, and on a Hopper GPU that a
fused layer stack launched with it, eagerly and captured in a CUDA graph, gives the very same bits as without
(each kernel waits for the one before it before touching memory, so nothing may change but the gaps)."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels import _triton
from specsplit.shared.config import ModelConfig
from tests.kernel_checks import captured
from tests.test_skinny_linear import fused_outputs, random_layers

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                            reason="needs a CUDA GPU of compute capability 9.0 or later")


def test_which_launches_ask_for_it(monkeypatch):
    monkeypatch.setattr(_triton, "PDL", False)
    assert _triton.dependent_launch(torch.device("cuda", 0)) == {"USE_GDC": False}, "off unless asked"
    monkeypatch.setattr(_triton, "PDL", True)
    assert _triton.dependent_launch(torch.device("cpu")) == {"USE_GDC": False}, "never on the CPU"
    if not _triton.HAVE_TRITON:
        return
    monkeypatch.setattr(_triton, "_hopper_or_later", lambda index: index == 1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _triton.dependent_launch(torch.device("cuda", 1)) == {"USE_GDC": True, "launch_pdl": True}
    assert _triton.dependent_launch(torch.device("cuda", 0)) == {"USE_GDC": False}, "before Hopper"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _triton.dependent_launch(torch.device("cuda", 1)) == {"USE_GDC": False}, "never interpreted"


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_dependent_launches_change_no_bit(monkeypatch, rows):
    """Two SmolLM2-wide layers (every projection folding: the few-rows kernel, RMSNorm, RoPE-free stand-in
    attention) plus a norm, eager and replayed from a graph, with and without PDL: equal bit for bit."""
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    layers = random_layers(cfg, "cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(rows, cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    norm = (1 + 0.3 * torch.randn(cfg.hidden_size, generator=gen)).to("cuda", torch.bfloat16)
    results = {}
    for pdl in (False, True):
        monkeypatch.setattr(_triton, "PDL", pdl)
        eager = fused_outputs(cfg, layers, x, norm)
        with torch.no_grad():
            graph, out = captured(lambda: fused_outputs(cfg, layers, x, norm))
        graph.replay()
        torch.cuda.synchronize()
        results[pdl] = (eager[0].clone(), eager[1].clone(), out[0].clone(), out[1].clone())
    for off, on in zip(results[False], results[True]):
        assert torch.equal(off, on)
