"""What a drafter borrows from its target: the embedding and LM head, and the target's geometry."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specsplit.shared.config import ModelConfig, RopeConfig
from specsplit.shared.errors import CheckpointError


@dataclass(frozen=True)
class TargetHead:
    """The target's token embedding and LM head; drafters use these instead of owning copies.

    In the split service they arrive through shared buffers; in-process they are the target's tensors.
    """

    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden]

    def __post_init__(self) -> None:
        if self.embed.dim() != 2 or self.lm_head.dim() != 2:
            raise CheckpointError("target embed and lm_head must be 2-D [vocab, hidden]")
        if self.embed.shape != self.lm_head.shape:
            raise CheckpointError(
                f"target embed {tuple(self.embed.shape)} and lm_head {tuple(self.lm_head.shape)} differ"
            )

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed.shape[1]

    @staticmethod
    def random(info: "TargetInfo", *, seed: int, std: float = 1.0, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> "TargetHead":
        """A seeded stand-in head, for drafters made without a target (fixtures, smoke runs)."""
        gen = torch.Generator().manual_seed(seed)
        shape = (info.vocab_size, info.hidden_size)
        embed = torch.randn(shape, generator=gen) * std
        lm_head = torch.randn(shape, generator=gen) * std
        return TargetHead(embed.to(device, dtype), lm_head.to(device, dtype))


@dataclass(frozen=True)
class TargetInfo:
    """The target geometry a drafter is built for: sizes, attention shape, RoPE and norm epsilon."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 8192
    model_type: str = "llama"
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size"):
            if int(getattr(self, name)) <= 0:
                raise CheckpointError(f"target {name} must be a positive integer")

    @staticmethod
    def from_config(cfg: ModelConfig) -> "TargetInfo":
        return TargetInfo(
            hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
            rope=cfg.rope, max_position_embeddings=cfg.max_position_embeddings, model_type=cfg.model_type,
            attention_bias=cfg.attention_bias,
        )

    def decoder_config(self, *, model_type: str, num_layers: int,
                       layer_types: tuple[str, ...] | None = None,
                       sliding_window: int | None = None) -> ModelConfig:
        """Decoder layers shaped like the target's (what a fresh drafter is made of)."""
        return ModelConfig(
            model_type=model_type, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=num_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope=self.rope,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias and model_type == self.model_type,
            qk_norm=model_type == "qwen3", layer_types=layer_types, sliding_window=sliding_window,
        )
