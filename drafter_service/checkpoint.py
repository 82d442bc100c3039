"""Drafter checkpoints: z-lab DFlash and DeepSeek-V3-style MTP folders, loaded, saved or made at random.

A folder holds config.json and model.safetensors (any *.safetensors files are read), or HF-style
shards listed by model.safetensors.index.json when one file would be too large. The kind is
read from the config: `dflash_config` → DFlash, `num_nextn_predict_layers` → MTP. Neither kind stores
an embedding or LM head of its own (they use the target's, `TargetHead`), except an optional draft
vocabulary: `lm_head.weight` [draft_vocab, hidden] with `d2t` (int64, target = draft + d2t[draft]).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from specsplit.drafter_service.dflash import DFlashConfig, DFlashDrafter, DFlashModel, build_target_layer_ids
from specsplit.drafter_service.heads import TargetHead, TargetInfo
from specsplit.drafter_service.mtp import MTPConfig, MTPDrafter, MTPModel
from specsplit.drafter_service.tree_scores import SCORES_FILE, TreeScores, read_tree_scores
from specsplit.shared.checkpoint import INDEX_FILE, load_state_dict
from specsplit.shared.config import read_config_json
from specsplit.shared.errors import CheckpointError, InvalidRequest
from specsplit.shared.layers import RMSNorm, RotaryEmbedding
from specsplit.shared.proposer import DrafterKind

WEIGHTS = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DrafterModel = DFlashModel | MTPModel
AnyDrafter = DFlashDrafter | MTPDrafter


# ---- save ---------------------------------------------------------------------------------------


def save_dflash(folder: str | Path, drafter: DFlashDrafter | DFlashModel, *, max_file_bytes: int | None = None) -> Path:
    model = drafter.model if isinstance(drafter, DFlashDrafter) else drafter
    return _save(folder, model, model.cfg.to_hf(), max_file_bytes)


def save_mtp(folder: str | Path, drafter: MTPDrafter | MTPModel, *, max_file_bytes: int | None = None) -> Path:
    model = drafter.model if isinstance(drafter, MTPDrafter) else drafter
    return _save(folder, model, model.cfg.to_hf(), max_file_bytes)


def _save(folder: str | Path, model: DrafterModel, config: dict, max_file_bytes: int | None = None) -> Path:
    """config.json and the weights: one model.safetensors, or shards of at most `max_file_bytes` of
    tensor data each (model-0000k-of-0000n.safetensors + model.safetensors.index.json, HF's names)."""
    folder = Path(folder)
    # A copy of each: weights may be views of one tensor (fused projections), which safetensors refuses.
    tensors = {name: t.detach().cpu().clone().contiguous() for name, t in model.state_dict().items()}
    shards = _shards(tensors, max_file_bytes)
    folder.mkdir(parents=True, exist_ok=True)
    # A stale file would be read too; tree scores were fitted to the weights they lie beside
    for old in [*folder.glob("*.safetensors"), folder / INDEX_FILE, folder / SCORES_FILE]:
        old.unlink(missing_ok=True)
    dtype = next(model.parameters()).dtype
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    names = [WEIGHTS] if len(shards) == 1 else \
        [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for name, shard in zip(names, shards):
        save_file({k: tensors[k] for k in shard}, str(folder / name), metadata={"format": "pt"})
        (folder / name).chmod(0o644)  # safetensors creates it 0600
    if len(shards) == 1:
        return folder
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return folder


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    """Tensor names in stored order, cut into runs of at most `max_bytes` (None: one run)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_bytes is not None and nbytes > max_bytes:
            raise InvalidRequest(f"tensor {name} alone is {nbytes} bytes, over the {max_bytes}-byte file limit")
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


# ---- load ---------------------------------------------------------------------------------------


def drafter_kind(raw: dict) -> DrafterKind:
    dflash, mtp = "dflash_config" in raw, "num_nextn_predict_layers" in raw
    if dflash == mtp:
        raise CheckpointError("config.json must have exactly one of dflash_config (DFlash) and "
                              "num_nextn_predict_layers (MTP)")
    return DrafterKind.DFLASH if dflash else DrafterKind.MTP


def load_model(folder: str | Path, *, target_info: TargetInfo, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> DrafterModel:
    """Read and validate a drafter's weights for `target_info`; dtype None keeps the stored torch_dtype."""
    folder = Path(folder)
    raw = read_config_json(folder)
    kind = drafter_kind(raw)
    config_type = DFlashConfig if kind is DrafterKind.DFLASH else MTPConfig
    tensors = _read_tensors(folder)
    cfg = config_type.from_hf({**raw, "draft_vocab_size": _draft_vocab(raw, tensors)})
    cfg.check_target(target_info)
    dtype = dtype or DTYPES.get(raw.get("torch_dtype") or raw.get("dtype"), torch.float32)
    with torch.device("meta"):
        model = (DFlashModel if kind is DrafterKind.DFLASH else MTPModel)(cfg)
    _assign(model, tensors, dtype)
    _check_d2t(model, target_info.vocab_size)
    return _finish(model, dtype, device)


def load_drafter(folder: str | Path, head: TargetHead, *, target_info: TargetInfo,
                 dtype: torch.dtype | None = None, device: str | torch.device = "cpu", window: int = 4096,
                 max_batch: int = 64, max_drafts: int = 4, pool_blocks: int | None = None) -> AnyDrafter:
    """A ready drafter from a checkpoint folder. `max_drafts` applies to MTP (DFlash drafts γ-1),
    `pool_blocks` to DFlash (its context pool; None: `DFlashDrafter`'s default). A DFlash checkpoint's
    `tree_scores.json`, where it ships one, scores its draft-tree candidates (`tree_scores`)."""
    model = load_model(folder, target_info=target_info, dtype=dtype, device=device)
    scores = read_tree_scores(folder, model.cfg.block_size - 1) if isinstance(model, DFlashModel) else None
    return _wrap(model, head, window=window, max_batch=max_batch, max_drafts=max_drafts, pool_blocks=pool_blocks,
                 tree_scores=scores)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / INDEX_FILE).is_file() and not (folder / WEIGHTS).is_file():
        return load_state_dict(folder)  # the shards the index names, each tensor where it says
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            part = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors ({exc})") from None
        clash = tensors.keys() & part.keys()
        if clash:
            raise CheckpointError(f"{path}: tensor {sorted(clash)[0]} appears in two weight files")
        tensors.update(part)
    return tensors


def _draft_vocab(raw: dict, tensors: dict[str, torch.Tensor]) -> int | None:
    """The draft vocabulary size when the checkpoint ships its own head (d2t and lm_head.weight)."""
    shipped = tensors.get("d2t", tensors.get("lm_head.weight"))
    if shipped is None:
        return None
    size = shipped.shape[0]
    stated = raw.get("draft_vocab_size")
    if stated is not None and stated != size:
        raise CheckpointError(f"draft_vocab_size {stated} ≠ the shipped draft head's {size} rows")
    return size


def _assign(model: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    expected = model.state_dict()
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    if missing:
        raise CheckpointError(f"checkpoint lacks tensor(s) {', '.join(missing[:5])}")
    if unexpected:
        raise CheckpointError(f"checkpoint has unexpected tensor(s) {', '.join(unexpected[:5])}")
    ready = {}
    for name, want in expected.items():
        got = tensors[name]
        if got.shape != want.shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if want.dtype.is_floating_point != got.dtype.is_floating_point:
            raise CheckpointError(f"tensor {name} is {got.dtype}, expected {want.dtype}")
        ready[name] = got.to(dtype if want.dtype.is_floating_point else want.dtype)
    model.load_state_dict(ready, strict=True, assign=True)


def _check_d2t(model: DrafterModel, vocab: int) -> None:
    if model.d2t is None:
        return
    target = torch.arange(model.d2t.numel()) + model.d2t
    if int(target.min()) < 0 or int(target.max()) >= vocab:
        raise CheckpointError(f"d2t maps draft ids outside the target vocabulary of {vocab}")


def _finish(model: DrafterModel, dtype: torch.dtype, device: str | torch.device) -> DrafterModel:
    # RoPE frequencies stay float32 whatever the weights' dtype, and are rebuilt off the meta device.
    dec = model.cfg.decoder
    model.rotary_emb = None
    model.to(device=device, dtype=dtype)
    model.rotary_emb = RotaryEmbedding(dec.head_dim, dec.rope).to(device)
    return model


def _wrap(model: DrafterModel, head: TargetHead, *, window: int, max_batch: int, max_drafts: int,
          pool_blocks: int | None = None, tree_scores: TreeScores | None = None) -> AnyDrafter:
    # A drafter that serves never trains: no forward of its records autograd history (a forward that did would
    # hold its activations for as long as the K/V it wrote into the pool, the whole session)
    model.eval().requires_grad_(False)
    if isinstance(model, DFlashModel):
        return DFlashDrafter(model, head, window=window, max_batch=max_batch, pool_blocks=pool_blocks,
                             tree_scores=tree_scores)
    return MTPDrafter(model, head, max_drafts=max_drafts, max_batch=max_batch)


# ---- random init --------------------------------------------------------------------------------


def random_model(kind: str | DrafterKind, target_info: TargetInfo, *, seed: int, num_layers: int = 1,
                 block_size: int = 16, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 mask_token_id: int | None = None, target_layer_ids: tuple[int, ...] | None = None,
                 draft_vocab_size: int | None = None, layer_types: tuple[str, ...] | None = None,
                 sliding_window: int | None = None) -> DrafterModel:
    """A seeded drafter for `target_info`: linears ~ N(0, 0.02), norms 1, a random d2t if asked."""
    kind = _kind(kind)
    if kind is DrafterKind.DFLASH:
        decoder = target_info.decoder_config(model_type="qwen3", num_layers=num_layers, layer_types=layer_types,
                                             sliding_window=sliding_window)
        model: DrafterModel = DFlashModel(DFlashConfig(
            decoder=decoder, block_size=block_size,
            target_layer_ids=tuple(target_layer_ids or build_target_layer_ids(target_info.num_hidden_layers,
                                                                              num_layers)),
            mask_token_id=target_info.vocab_size - 1 if mask_token_id is None else mask_token_id,
            num_target_layers=target_info.num_hidden_layers, draft_vocab_size=draft_vocab_size,
        ))
    else:
        if num_layers != 1:
            raise InvalidRequest("an MTP drafter has exactly one layer (num_nextn_predict_layers: 1)")
        decoder = target_info.decoder_config(model_type=target_info.model_type,
                                             num_layers=target_info.num_hidden_layers)
        model = MTPModel(MTPConfig(decoder=decoder, layer_index=target_info.num_hidden_layers,
                                   draft_vocab_size=draft_vocab_size))
    _init_weights(model, seed, target_info.vocab_size)
    return _finish(model, dtype, device)


def random_drafter(kind: str | DrafterKind, target_info: TargetInfo, head: TargetHead | None = None, *,
                   seed: int, num_layers: int = 1, block_size: int = 16, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", window: int = 4096, max_batch: int = 64,
                   max_drafts: int = 4, pool_blocks: int | None = None, **model_args) -> AnyDrafter:
    """A ready random drafter; without a head it gets a seeded random stand-in (`TargetHead.random`).
    `pool_blocks` sizes a DFlash drafter's context pool (`DFlashDrafter`)."""
    model = random_model(kind, target_info, seed=seed, num_layers=num_layers, block_size=block_size,
                         dtype=dtype, device=device, **model_args)
    if head is None:
        head = TargetHead.random(target_info, seed=seed, dtype=dtype, device=device)
    return _wrap(model, head, window=window, max_batch=max_batch, max_drafts=max_drafts, pool_blocks=pool_blocks)


def write_random_drafter(folder: str | Path, kind: str | DrafterKind, target_info: TargetInfo, seed: int, *,
                         num_layers: int = 1, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                         **model_args) -> Path:
    """Write a randomly initialised checkpoint: the starting point for training, and a test fixture."""
    model = random_model(kind, target_info, seed=seed, num_layers=num_layers, block_size=block_size,
                         dtype=dtype, **model_args)
    return _save(folder, model, model.cfg.to_hf())


def _kind(kind: str | DrafterKind) -> DrafterKind:
    try:
        return DrafterKind(kind)
    except ValueError:
        raise InvalidRequest(f"drafter kind must be dflash or mtp, got {kind!r}") from None


def _init_weights(model: DrafterModel, seed: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.data.copy_(torch.randn(module.weight.shape, generator=gen) * 0.02)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)
    if model.d2t is not None:
        chosen = torch.randperm(vocab, generator=gen)[:model.d2t.numel()].sort().values
        model.d2t.copy_(chosen - torch.arange(chosen.numel()))
