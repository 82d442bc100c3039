"""Differentiable training forwards of the drafters, built from the inference modules themselves.

Training runs many predictions per sequence in one forward, but each prediction sees exactly what
the inference drafter would see at that point, through the same modules and mixers, so the trained
weights are what `DFlashDrafter` / `MTPDrafter` load:

- DFlash: N blocks per sequence share one forward. A block anchored at sequence index a (token x_a,
  position p_a) holds [x_a, mask × (γ-1)] at positions p_a..p_a+γ-1; its queries see the context
  rows with positions < p_a and their own block only, never another block.
- MTP: step 1 at sequence index i feeds (x_i, h_{i-1}) at p_i, attends causally to the step-1 rows,
  and predicts x_{i+1}. Step s ≥ 2 feeds (x_{i+s-1}, its own step-(s-1) output) at p_i + s-1 and sees
  the step-1 rows up to p_i plus its own chain (steps 2..s at i) — the rows inference would hold
  after committing x_{≤i} and drafting s-1 tokens (teacher-forced with the true tokens).
"""

from __future__ import annotations

import torch

from specsplit.drafter_service.base import visibility
from specsplit.drafter_service.dflash import DFlashModel, _block_mixer
from specsplit.drafter_service.heads import TargetHead
from specsplit.drafter_service.mtp import CachedKV, MTPModel, _cached_mixer
from specsplit.shared.errors import InvalidRequest


def _check_rows(rows: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                feature_dim: int) -> None:
    if rows.dim() != 3 or rows.shape[2] != feature_dim:
        raise InvalidRequest(f"feature rows must be [B, S, {feature_dim}], got {tuple(rows.shape)}")
    if not tokens.shape == positions.shape == valid.shape == rows.shape[:2]:
        raise InvalidRequest("tokens, positions and valid must be [B, S] like the feature rows")


# ---- DFlash -------------------------------------------------------------------------------------


def dflash_visibility(positions: torch.Tensor, valid: torch.Tensor, anchor_pos: torch.Tensor, gamma: int,
                      window: int | None) -> torch.Tensor:
    """[B, N·γ, S + N·γ]: block queries see context rows before their anchor, and their own block.

    positions/valid [B, S] of the context rows, anchor_pos [B, N]. Inside the allowed keys the
    layer's own rule applies by position, as in inference (non-causal; causal within a window).
    """
    batch, blocks = anchor_pos.shape
    q_pos = (anchor_pos[:, :, None] + torch.arange(gamma, device=anchor_pos.device)).reshape(batch, -1)
    q_anchor = anchor_pos.repeat_interleave(gamma, 1)  # [B, N·γ]
    ctx = valid[:, None, :] & (positions[:, None, :] < q_anchor[:, :, None])  # [B, N·γ, S]
    block_id = torch.arange(blocks * gamma, device=anchor_pos.device) // gamma
    own = (block_id[:, None] == block_id[None, :]).expand(batch, -1, -1)  # [B, N·γ, N·γ]
    k_pos = torch.cat([positions, q_pos], 1)
    rule = visibility(q_pos, k_pos, torch.ones_like(k_pos, dtype=torch.bool), causal=window is not None,
                      window=window)
    return torch.cat([ctx, own], 2) & rule


def dflash_block_hidden(model: DFlashModel, head: TargetHead, rows: torch.Tensor, tokens: torch.Tensor,
                        positions: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor,
                        reveal: torch.Tensor | None = None) -> torch.Tensor:
    """Final-normed hidden [B, N, γ, hidden] of the blocks anchored at sequence indices anchors [B, N].

    rows [B, S, feature_dim] are the target's captured layers, tokens/positions/valid [B, S] the
    sequence. Row k of a block is the inference drafter's block row k (its draft k for k ≥ 1).
    With `reveal` [B, N] (counts r, 0 ≤ r ≤ γ-2), rows 1..r of a block hold the sequence's own tokens
    x_{a+1..a+r} in place of the mask: a refining pass's block whose first r drafts were right.
    """
    cfg = model.cfg
    _check_rows(rows, tokens, positions, valid, cfg.feature_dim)
    batch, width, _ = rows.shape
    blocks, gamma = anchors.shape[1], cfg.block_size
    ctx_k, ctx_v = model.context(rows.reshape(batch * width, -1), positions.reshape(-1))
    ctx_k, ctx_v = (t.view(t.shape[0], batch, width, *t.shape[2:]) for t in (ctx_k, ctx_v))  # [layers, B, S, Hkv, D]
    anchor_pos = positions.gather(1, anchors)  # [B, N]
    revealed = None
    if reveal is not None:
        if reveal.shape != anchors.shape:
            raise InvalidRequest(f"reveal must be [B, N] like the anchors, got {tuple(reveal.shape)}")
        # (checked on the device: a host read here would hold up every training step)
        torch._assert_async(((reveal >= 0) & (reveal <= gamma - 2)).all(), f"reveal counts lie in 0..{gamma - 2}")
        index = (anchors[:, :, None] + torch.arange(1, gamma, device=anchors.device)).clamp(max=width - 1)
        revealed = tokens.gather(1, index.flatten(1)).view(-1, gamma - 1)  # [B·N, γ-1]
        reveal = reveal.reshape(-1)
    block = model.embed_block(tokens.gather(1, anchors).reshape(-1), head, revealed, reveal)  # [B·N, γ, hidden]
    q_pos = (anchor_pos[:, :, None] + torch.arange(gamma, device=anchors.device)).reshape(-1)
    cos, sin = model.rotary_emb(q_pos, block.dtype)
    x = block.reshape(batch * blocks * gamma, -1)
    windows = [cfg.decoder.layer_window(i) for i in range(len(model.layers))]
    masks = {w: dflash_visibility(positions, valid, anchor_pos, gamma, w) for w in set(windows)}
    for i, layer in enumerate(model.layers):
        x = layer(x, _block_mixer(ctx_k[i], ctx_v[i], cos, sin, masks[windows[i]], batch))
    return model.norm(x).view(batch, blocks, gamma, -1)


# ---- MTP ----------------------------------------------------------------------------------------


def mtp_step_outputs(model: MTPModel, head: TargetHead, hidden: torch.Tensor, tokens: torch.Tensor,
                     positions: torch.Tensor, valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Layer outputs (before shared_head.norm) of steps 1..steps, each [B, S-1, hidden].

    hidden [B, S, hidden] are the target's last hidden rows (before its final norm). Row r of every
    output belongs to sequence index i = r + 1; step s's output there predicts x_{i+s}.
    """
    _check_rows(hidden, tokens, positions, valid, model.cfg.decoder.hidden_size)
    if steps < 1:
        raise InvalidRequest("MTP training needs at least one step")
    batch, width, _ = hidden.shape
    rows = width - 1
    q_pos = positions[:, 1:]  # [B, S-1] positions of the step-1 rows
    q_valid = valid[:, 1:] & valid[:, :-1]
    exact = visibility(q_pos, q_pos, q_valid, causal=True, window=None) | ~q_valid[:, :, None]
    x = model.inputs(tokens[:, 1:].reshape(-1), hidden[:, :-1].reshape(-1, hidden.shape[2]), head)
    keys_k, keys_v, outputs = [], [], []
    own = torch.eye(rows, dtype=torch.bool, device=hidden.device).expand(batch, -1, -1)
    for step in range(1, steps + 1):
        if step > 1:
            nxt = tokens[:, step:]  # x_{i+s-1} = index r + s, for rows r < S - s
            nxt = torch.cat([nxt, nxt.new_zeros(batch, step - 1)], 1).reshape(-1)
            x = model.inputs(nxt, outputs[-1].reshape(-1, hidden.shape[2]), head)
        visible = torch.cat([exact] + [own] * (step - 1), 2)  # [B, S-1, step·(S-1)]
        out, k, v = _step(model, x, q_pos + step - 1, visible, keys_k, keys_v, batch)
        keys_k.append(k)
        keys_v.append(v)
        outputs.append(out.view(batch, rows, -1))
    return outputs


def _step(model: MTPModel, x: torch.Tensor, q_pos: torch.Tensor, visible: torch.Tensor,
          keys_k: list[torch.Tensor], keys_v: list[torch.Tensor], batch: int) -> tuple[torch.Tensor, ...]:
    """One pass of the MTP layer over x [B·R, hidden] at q_pos [B, R]; earlier steps' K/V come first."""
    rows = q_pos.shape[1]
    cos, sin = model.rotary_emb(q_pos.reshape(-1), x.dtype)
    empty = x.new_zeros(batch, 0, *_kv_shape(model))
    cache = CachedKV(k=torch.cat(keys_k, 1) if keys_k else empty, v=torch.cat(keys_v, 1) if keys_v else empty,
                     pos=q_pos[:, :0], valid=q_pos[:, :0].bool())
    q_valid = torch.ones_like(q_pos, dtype=torch.bool)
    new: dict[str, torch.Tensor] = {}
    out = model.layer(x, _cached_mixer(cache, cos, sin, visible, [rows] * batch, q_valid, new))
    return out, new["k"].view(batch, rows, *new["k"].shape[1:]), new["v"].view(batch, rows, *new["v"].shape[1:])


def _kv_shape(model: MTPModel) -> tuple[int, int]:
    dec = model.cfg.decoder
    return dec.num_key_value_heads, dec.head_dim
