"""Session fixtures: the converted default model and tiny random HF checkpoints of each supported family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the embedded GGUF, cached under $SPECSPLIT_CACHE (once per run)."""
    from specsplit.shared.gguf_import import default_target_dir

    return default_target_dir()


def write_tiny(folder: Path, family: str) -> Path:
    """A random checkpoint written by transformers itself; weights drawn large enough that a wrong
    rotary, norm or mask changes the logits far beyond float32 noise."""
    import transformers

    model_cls, config = _tiny_config(family)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _tiny_config(family: str):
    import transformers

    if family == "llama":  # llama3 rope scaling, tied embeddings
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return "LlamaForCausalLM", transformers.LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters=rope)
    if family == "qwen3":  # per-head q/k norm, untied head, layers 1.. slide over a 5-position window
        return "Qwen3ForCausalLM", transformers.Qwen3Config(
            **TINY, tie_word_embeddings=False, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    if family == "qwen2":  # q/k/v biases
        return "Qwen2ForCausalLM", transformers.Qwen2Config(**TINY, tie_word_embeddings=False)
    if family == "mistral":  # every layer slides
        return "MistralForCausalLM", transformers.MistralConfig(**TINY, tie_word_embeddings=False, sliding_window=6)
    raise ValueError(family)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("tiny_mistral"), "mistral")


@pytest.fixture(params=["llama", "qwen3", "qwen2", "mistral"])
def tiny_dir(request) -> Path:
    """Each tiny family in turn."""
    return request.getfixturevalue(f"tiny_{request.param}_dir")
