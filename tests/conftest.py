"""Session fixtures: the default model (converted, loaded, served) once per run, and tiny random HF
checkpoints of each supported family plus one that speaks the default model's tokenizer."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch


def _import_installed_kernels_package() -> None:
    """Put an installed package named `kernels` into sys.modules before the repository's folder can shadow it.

    Under pytest the repository's root is on sys.path, so `import kernels` finds our top-level kernels/
    folder (installed as specsplit.kernels) before any installed package of that name. transformers >= 5.25
    depends on Hugging Face's `kernels` package and imports it when it is installed, so every test that
    imports transformers failed with "cannot import name 'CUDAProperties' from 'kernels'". Importing the
    installed one first, with the root off the path, makes later imports find it in sys.modules. Our code
    never imports the top-level name (only specsplit.kernels)."""
    root = Path(__file__).resolve().parent.parent

    def ours(module) -> bool:
        return Path(getattr(module, "__file__", None) or "/").resolve().parent == root / "kernels"

    if "kernels" in sys.modules and ours(sys.modules["kernels"]):
        del sys.modules["kernels"]  # (imported under the top-level name already: make room for the installed one)
    saved = list(sys.path)
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != root]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass  # none installed: nothing to shadow
    finally:
        sys.path[:] = saved
    if "kernels" in sys.modules and ours(sys.modules["kernels"]):
        del sys.modules["kernels"]  # (our own folder after all: never leave it under the top-level name)


_import_installed_kernels_package()

# One intra-op thread in this process and in every service it spawns (they inherit the variable).
# Tests run a pytest process and two services at once on CI machines of 2 cores shared with other
# jobs; OpenMP workers that spin-wait for cores they do not get made a 135M-model decode step 30x
# slower there (3 s instead of 0.1 s). Set OMP_NUM_THREADS yourself to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2)
CHAT_VOCAB = 49152  # the default model's tokenizer


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the embedded GGUF, cached under $SPECSPLIT_CACHE (once per run)."""
    from specsplit.shared.gguf_import import default_target_dir

    return default_target_dir()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """The default model in float32, loaded once: engines share it read-only (each has its own KV cache)."""
    from specsplit.target_service.model import load_target

    return load_target(smollm2_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from specsplit.shared.tokenizer import Tokenizer

    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="session")
def specsplit_services(tmp_path_factory):
    """One drafter + target pair (the shipped DFlash drafter, default model) for the whole run: overrides
    the plugin's pair per module, so the services start once. Tests must leave it serving."""
    from specsplit.harness import ServiceSpec, spawn

    services = spawn(ServiceSpec(), tmp_path_factory.mktemp("specsplit"))
    yield services
    services.stop()


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A random tiny Llama with the default model's vocabulary and tokenizer: text in, text out, at a
    fraction of the cost, for tests of the engine, services and failover that real weights prove
    nothing in (they only make each step slower)."""
    folder = write_tiny(tmp_path_factory.mktemp("tiny_chat"), "chat")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return folder


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
    if family == "chat":  # the default model's vocabulary, room for long generations
        chat = {**TINY, "vocab_size": CHAT_VOCAB, "max_position_embeddings": 4096}
        return "LlamaForCausalLM", transformers.LlamaConfig(**chat, tie_word_embeddings=True)
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
