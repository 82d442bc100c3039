"""HF-format checkpoint folders: config.json plus one or sharded safetensors files, read and written."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from specsplit.shared.config import ModelConfig, read_config_json
from specsplit.shared.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_config(folder: Path | str) -> ModelConfig:
    return ModelConfig.from_hf(read_config_json(Path(folder)))


def load_state_dict(folder: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors file(s), by checkpoint name, on the CPU."""
    folder = Path(folder)
    if (folder / SINGLE_FILE).is_file():
        return _load_file(folder / SINGLE_FILE)
    if (folder / INDEX_FILE).is_file():
        return _load_sharded(folder)
    raise CheckpointError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None


def _load_sharded(folder: Path) -> dict[str, torch.Tensor]:
    weight_map = _read_weight_map(folder / INDEX_FILE)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (folder / shard).is_file():
            raise CheckpointError(f"{folder / INDEX_FILE}: shard {shard} is missing")
        tensors.update(_load_file(folder / shard))
    absent = sorted(name for name in weight_map if name not in tensors)
    if absent:
        raise CheckpointError(f"{folder}: tensor {absent[0]} is listed in the index but in no shard")
    return tensors


def _read_weight_map(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    except (KeyError, TypeError):
        raise CheckpointError(f"{path}: lacks a 'weight_map' object") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path}: 'weight_map' must map tensor names to shard file names")
    return weight_map


def assign_parameters(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    ignore: Iterable[str] = (),
) -> None:
    """Copy checkpoint tensors into the module's parameters of the same name (cast to their dtype/device).

    `ignore` holds fnmatch patterns of checkpoint names to skip (e.g. `*.rotary_emb.inv_freq`).
    Tied parameters appear once, under their first name, as `named_parameters` lists them.
    """
    patterns = tuple(ignore)
    wanted = {name: t for name, t in tensors.items() if not any(fnmatch.fnmatch(name, p) for p in patterns)}
    params = dict(module.named_parameters())
    missing = [name for name in params if name not in wanted]
    if missing:
        raise CheckpointError(f"checkpoint lacks tensor {missing[0]}" + _more(missing))
    unexpected = [name for name in wanted if name not in params]
    if strict and unexpected:
        raise CheckpointError(f"checkpoint has unexpected tensor {unexpected[0]}" + _more(unexpected))
    for name, param in params.items():
        _copy(name, param, wanted[name])


def _copy(name: str, param: nn.Parameter, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise CheckpointError(
            f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more: {', '.join(names[1:4])}...)" if len(names) > 1 else ""


def save_checkpoint(
    folder: Path | str,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype | None = None,
) -> Path:
    """Write config.json + model.safetensors into a temp dir beside `folder`, then rename it into place.

    An existing `folder` is replaced; readers never see a half-written checkpoint.
    """
    folder = Path(folder)
    tmp = temp_dir_beside(folder)
    try:
        write_checkpoint(tmp, config, tensors, dtype)
        replace_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def write_checkpoint(
    folder: Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> None:
    """config.json + model.safetensors into an existing folder (not atomic; see save_checkpoint)."""
    (folder / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    save_file(_storable(tensors, dtype), str(folder / SINGLE_FILE), metadata={"format": "pt"})
    (folder / SINGLE_FILE).chmod(0o644)  # safetensors creates it 0600


def _storable(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two entries sharing memory (safetensors refuses aliased tensors)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def temp_dir_beside(folder: Path) -> Path:
    """An empty hidden folder next to `folder` (same filesystem, so a rename publishes it)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    return tmp


def replace_dir(src: Path, dst: Path) -> None:
    """Rename the finished folder `src` to `dst`, moving an existing `dst` aside first."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old.{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
