"""Decoder geometry read from an HF-style config.json, validated once at load."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from specsplit.shared.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE base and optional scaling (`rope_scaling` / `rope_parameters` in HF configs)."""

    theta: float = 10000.0
    scaling_type: str = "default"  # default | linear | llama3 | dynamic is refused
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.scaling_type not in ("default", "linear", "llama3"):
            raise CheckpointError(f"unsupported rope scaling type {self.scaling_type!r}")
        if self.theta <= 0 or self.factor <= 0:
            raise CheckpointError("rope theta and factor must be positive")

    @staticmethod
    def from_hf(raw: dict[str, Any]) -> "RopeConfig":
        params = dict(raw.get("rope_parameters") or {})
        scaling = dict(raw.get("rope_scaling") or {})
        params.update(scaling)
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        return RopeConfig(
            theta=float(theta),
            scaling_type=kind,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
            ),
        )

    def to_hf(self) -> dict[str, Any]:
        """Both spellings, so transformers 4.x (rope_theta/rope_scaling) and 5.x (rope_parameters) agree."""
        params: dict[str, Any] = {"rope_type": self.scaling_type, "rope_theta": self.theta}
        if self.scaling_type != "default":
            params["factor"] = self.factor
        if self.scaling_type == "llama3":
            params.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        out: dict[str, Any] = {"rope_theta": self.theta, "rope_parameters": params}
        out["rope_scaling"] = None if self.scaling_type == "default" else dict(params)
        return out


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: Llama (no q/k norm) or Qwen3 (per-head q/k RMSNorm)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # Per layer: "full_attention" or "sliding_attention" (None = all full).
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise CheckpointError(f"config field {name} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise CheckpointError("layer_types must have one entry per hidden layer")
        if self.layer_types and "sliding_attention" in self.layer_types and not self.sliding_window:
            raise CheckpointError("sliding_attention layers need a positive sliding_window")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """The attention window of `layer`, or None for full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @staticmethod
    def from_hf(raw: dict[str, Any]) -> "ModelConfig":
        try:
            model_type = raw.get("model_type", "llama")
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            layer_types = raw.get("layer_types")
            if model_type == "mistral" and raw.get("sliding_window") and not layer_types:
                # Mistral's window covers every layer, and its config has no layer_types to say so.
                layer_types = ["sliding_attention"] * int(raw["num_hidden_layers"])
            return ModelConfig(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_hf(raw),
                max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type == "qwen3",
                sliding_window=raw.get("sliding_window") if layer_types else None,
                layer_types=tuple(layer_types) if layer_types else None,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=eos_ids,
            )
        except KeyError as exc:
            raise CheckpointError(f"config.json lacks required field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"config.json has a malformed field: {exc}") from None

    def to_hf(self) -> dict[str, Any]:
        arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[self.model_type]
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("rope", "qk_norm", "layer_types", "eos_token_id")}
        out.update(self.rope.to_hf())
        out["architectures"] = [arch]
        out["hidden_act"] = "silu"
        if self.layer_types:
            out["layer_types"] = list(self.layer_types)
        if self.eos_token_id:
            out["eos_token_id"] = list(self.eos_token_id) if len(self.eos_token_id) > 1 else self.eos_token_id[0]
        return out


def read_config_json(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
