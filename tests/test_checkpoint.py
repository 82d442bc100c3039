"""Checkpoint folders: round trips, shards, and a clear CheckpointError naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specsplit.shared.checkpoint import assign_parameters, load_state_dict, save_checkpoint
from specsplit.shared.errors import CheckpointError
from specsplit.target_service.model import load_target


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def copy_with(tmp_path: Path, source: Path, edit_tensors=None, edit_config=None) -> Path:
    """A copy of `source` whose tensors and/or config.json are passed through the edit functions."""
    folder = tmp_path / "ckpt"
    shutil.copytree(source, folder)
    if edit_tensors is not None:
        save_file(edit_tensors(tensors_of(folder)), str(folder / "model.safetensors"))
    if edit_config is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(edit_config(config))
    return folder


def test_save_then_load_round_trips_and_casts(tmp_path):
    tensors = {"a.weight": torch.randn(3, 4), "b.bias": torch.arange(5, dtype=torch.float32)}
    folder = save_checkpoint(tmp_path / "out", {"model_type": "llama", "x": 1}, tensors, dtype=torch.bfloat16)
    loaded = load_state_dict(folder)
    assert loaded.keys() == tensors.keys() and loaded["a.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["b.bias"].float(), tensors["b.bias"])
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "llama", "x": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dirs left behind


def test_save_replaces_an_existing_folder_and_unties_shared_tensors(tmp_path):
    save_checkpoint(tmp_path / "out", {}, {"old": torch.zeros(2)})
    shared = torch.randn(4, 2)
    save_checkpoint(tmp_path / "out", {}, {"embed": shared, "head": shared})
    loaded = load_state_dict(tmp_path / "out")
    assert sorted(loaded) == ["embed", "head"] and torch.equal(loaded["head"], shared)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_sharded_checkpoint_loads_every_shard(tmp_path, tiny_llama_dir):
    tensors = tensors_of(tiny_llama_dir)
    names = sorted(tensors)
    half = len(names) // 2
    folder = tmp_path / "sharded"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "model.safetensors").unlink()
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / shard))
        weight_map.update({n: shard for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = load_state_dict(folder)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[n], tensors[n]) for n in names)
    assert load_target(folder).config.num_hidden_layers == 3

    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is missing"):
        load_state_dict(folder)
    (folder / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_state_dict(folder)


def test_missing_tensor_is_named(tmp_path, tiny_llama_dir):
    name = "model.layers.1.mlp.up_proj.weight"
    folder = copy_with(tmp_path, tiny_llama_dir, edit_tensors=lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=f"lacks tensor {name}"):
        load_target(folder)


def test_wrong_shape_is_named_with_both_shapes(tmp_path, tiny_llama_dir):
    name = "model.layers.0.self_attn.k_proj.weight"
    folder = copy_with(tmp_path, tiny_llama_dir, edit_tensors=lambda t: {**t, name: t[name][:16]})
    with pytest.raises(CheckpointError, match=rf"{name} has shape \(16, 64\), expected \(32, 64\)"):
        load_target(folder)


def test_unexpected_tensor_is_named(tmp_path, tiny_llama_dir):
    folder = copy_with(tmp_path, tiny_llama_dir, edit_tensors=lambda t: {**t, "model.extra.weight": torch.ones(2)})
    with pytest.raises(CheckpointError, match="unexpected tensor model.extra.weight"):
        load_target(folder)


def test_tied_checkpoint_may_also_store_the_head(tmp_path, tiny_llama_dir):
    """Some tied checkpoints save lm_head.weight too; it is the embedding, so it is ignored."""
    folder = copy_with(tmp_path, tiny_llama_dir,
                       edit_tensors=lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"].clone()})
    model = load_target(folder)
    assert model.lm_head_weight is model.embed_weight


def test_missing_config_field_is_named(tmp_path, tiny_llama_dir):
    folder = copy_with(tmp_path, tiny_llama_dir,
                       edit_config=lambda c: json.dumps({k: v for k, v in c.items() if k != "hidden_size"}))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_target(folder)


def test_bad_config_json_and_missing_files(tmp_path, tiny_llama_dir):
    folder = copy_with(tmp_path, tiny_llama_dir, edit_config=lambda c: json.dumps(c)[:-5])
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        load_target(folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_target(folder)
    shutil.copy(tiny_llama_dir / "config.json", folder / "config.json")
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        load_target(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_target(folder)


def test_assign_parameters_ignore_and_strict():
    module = torch.nn.Linear(3, 2)
    tensors = {"weight": torch.ones(2, 3), "bias": torch.zeros(2), "rotary.inv_freq": torch.ones(1)}
    with pytest.raises(CheckpointError, match="unexpected tensor rotary.inv_freq"):
        assign_parameters(module, tensors)
    assign_parameters(module, tensors, ignore=["*.inv_freq"])
    assert torch.equal(module.weight, torch.ones(2, 3))
    assign_parameters(module, {**tensors, "weight": torch.full((2, 3), 2.0)}, strict=False)
    assert torch.equal(module.weight, torch.full((2, 3), 2.0))
    with pytest.raises(CheckpointError, match="lacks tensor bias"):
        assign_parameters(module, {"weight": torch.ones(2, 3)}, strict=False)
