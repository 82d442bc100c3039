"""Drafter checkpoints: z-lab / DeepSeek-V3 layouts, exact round trips, seeded init, every bad-folder case."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specsplit.drafter_service.checkpoint import (
    load_drafter, random_drafter, random_model, save_dflash, save_mtp, write_random_drafter,
)
from specsplit.drafter_service.dflash import DFlashDrafter
from specsplit.drafter_service.heads import TargetHead, TargetInfo
from specsplit.drafter_service.mtp import MTPDrafter
from specsplit.shared.config import RopeConfig
from specsplit.shared.errors import CheckpointError, InvalidRequest
from specsplit.shared.layers import RMSNorm
from specsplit.shared.proposer import ProposeRequest

INFO = TargetInfo(hidden_size=32, vocab_size=97, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=64, rms_norm_eps=1e-5,
                  rope=RopeConfig(theta=500.0), model_type="qwen3")
HEAD = TargetHead.random(INFO, seed=11)


def zlab_tensor_names(num_layers: int) -> set[str]:
    """The state dict of z-lab's DFlashDraftModel (dflash/model.py): fc, hidden_norm, norm and Qwen3 layers
    with q/k norms, no biases (attention_bias false), no embedding or LM head; rotary_emb has no
    persistent buffer."""
    per_layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    return names | {f"layers.{i}.{n}" for i in range(num_layers) for n in per_layer}


def mtp_tensor_names(layer: int) -> set[str]:
    parts = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
             "input_layernorm.weight", "post_attention_layernorm.weight",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    parts += [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    return {f"model.layers.{layer}.{p}" for p in parts}


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def same_weights(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def drafts(drafter, seed=0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    drafter.alloc(0, 64)
    rows = torch.randn(6, drafter.spec.feature_dim, generator=gen).to(drafter.dtype)
    drafter.prefill(0, [3, 1, 4, 1, 5, 9], rows)
    out = drafter.propose([ProposeRequest(0, 2, 6, drafter.spec.max_drafts)])[0].tokens
    drafter.free(0)
    return out


# ---- layout ---------------------------------------------------------------------------------------


def test_dflash_folder_has_zlab_tensor_names_and_a_qwen3_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    write_random_drafter(tmp_path, "dflash", INFO, seed=0, num_layers=2, block_size=8)
    names = set(tensors_of(tmp_path))
    assert names == zlab_tensor_names(2)
    cfg = transformers.Qwen3Config.from_pretrained(tmp_path)
    rope_theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    assert rope_theta == 500.0 and cfg.rms_norm_eps == 1e-5 and cfg.head_dim == 8
    assert cfg.block_size == 8 and cfg.num_target_layers == 6
    assert cfg.dflash_config == {"target_layer_ids": [1, 3], "mask_token_id": 96}
    assert cfg.architectures == ["DFlashDraftModel"] and cfg.tie_word_embeddings is False
    # The per-layer names are exactly those of transformers' Qwen3 decoder layer, which z-lab's layer mirrors.
    layer = transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer(cfg, 0)
    assert {n for n in names if n.startswith("layers.0.")} == {f"layers.0.{n}" for n in layer.state_dict()}


def test_dflash_sliding_layers_are_written_for_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    write_random_drafter(tmp_path, "dflash", INFO, seed=0, num_layers=2,
                         layer_types=("sliding_attention", "full_attention"), sliding_window=16)
    cfg = transformers.Qwen3Config.from_pretrained(tmp_path)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] and cfg.sliding_window == 16


def test_mtp_folder_uses_deepseek_v3_names(tmp_path):
    write_random_drafter(tmp_path, "mtp", INFO, seed=0)
    assert set(tensors_of(tmp_path)) == mtp_tensor_names(6)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1 and raw["mtp_layer_index"] == 6
    assert raw["num_hidden_layers"] == 6 and raw["hidden_size"] == 32


# ---- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,kw", [
    ("dflash", {"num_layers": 2, "block_size": 6}),
    ("dflash", {"num_layers": 1, "draft_vocab_size": 40, "mask_token_id": 7}),
    ("dflash", {"num_layers": 2, "layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3}),
    ("mtp", {}),
    ("mtp", {"draft_vocab_size": 25}),
])
def test_round_trip_is_exact(tmp_path, kind, kw):
    drafter = random_drafter(kind, INFO, HEAD, seed=3, **kw)
    (save_dflash if kind == "dflash" else save_mtp)(tmp_path, drafter)
    loaded = load_drafter(tmp_path, HEAD, target_info=INFO, dtype=torch.float32, device="cpu")
    assert type(loaded) is type(drafter)
    assert loaded.model.cfg == drafter.model.cfg
    assert loaded.spec == drafter.spec
    assert same_weights(loaded, drafter)
    assert drafts(loaded) == drafts(drafter)


def test_load_keeps_the_stored_dtype_or_casts(tmp_path):
    write_random_drafter(tmp_path, "dflash", INFO, seed=0)  # bfloat16 on disk
    as_stored = load_drafter(tmp_path, HEAD, target_info=INFO)
    assert as_stored.dtype == torch.bfloat16
    assert as_stored.model.rotary_emb.inv_freq.dtype == torch.float32
    cast = load_drafter(tmp_path, HEAD, target_info=INFO, dtype=torch.float32, window=12)
    assert cast.dtype == torch.float32 and cast.spec.window == 12
    assert isinstance(load_drafter(write_random_drafter(tmp_path / "m", "mtp", INFO, seed=0), HEAD,
                                   target_info=INFO, max_drafts=2), MTPDrafter)


# ---- random init ----------------------------------------------------------------------------------


def test_random_init_is_seeded_and_shaped_as_asked():
    a = random_model("dflash", INFO, seed=5, num_layers=3, block_size=4)
    b = random_model("dflash", INFO, seed=5, num_layers=3, block_size=4)
    c = random_model("dflash", INFO, seed=6, num_layers=3, block_size=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["fc.weight"], sc["fc.weight"])
    assert a.cfg.target_layer_ids == (1, 2, 3) and a.cfg.mask_token_id == INFO.vocab_size - 1
    assert a.fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in a.modules() if isinstance(m, RMSNorm))
    drafter = random_drafter("dflash", INFO, HEAD, seed=5, num_layers=3, block_size=4)
    assert isinstance(drafter, DFlashDrafter) and drafter.spec.max_drafts == 3


def test_random_init_rejects_bad_arguments():
    with pytest.raises(CheckpointError, match="mask_token_id"):
        random_model("dflash", INFO, seed=0, mask_token_id=INFO.vocab_size)
    with pytest.raises(CheckpointError, match="block_size"):
        random_model("dflash", INFO, seed=0, block_size=1)
    with pytest.raises(InvalidRequest):
        random_model("mtp", INFO, seed=0, num_layers=2)
    with pytest.raises(InvalidRequest):
        random_model("eagle", INFO, seed=0)
    with pytest.raises(CheckpointError):
        random_drafter("dflash", INFO, TargetHead.random(replace(INFO, vocab_size=50), seed=0), seed=0)


# ---- bad checkpoints ------------------------------------------------------------------------------


def edit_config(folder: Path, **changes) -> None:
    raw = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            raw.pop(key, None)
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))


def edit_dflash_config(folder: Path, **changes) -> None:
    raw = json.loads((folder / "config.json").read_text())
    extra = raw["dflash_config"]
    for key, value in changes.items():
        if value is ...:
            extra.pop(key, None)
        else:
            extra[key] = value
    (folder / "config.json").write_text(json.dumps(raw))


def edit_tensors(folder: Path, drop=(), add=None) -> None:
    tensors = tensors_of(folder)
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, str(folder / "model.safetensors"))


DFLASH_CASES = [
    ("missing tensor", lambda f: edit_tensors(f, drop=["layers.1.mlp.up_proj.weight"]), "layers.1.mlp.up_proj.weight"),
    ("unexpected tensor", lambda f: edit_tensors(f, add={"embed_tokens.weight": torch.zeros(97, 32)}),
     "embed_tokens.weight"),
    ("mis-shaped tensor", lambda f: edit_tensors(f, add={"norm.weight": torch.ones(31)}), "norm.weight"),
    ("fc width", lambda f: edit_dflash_config(f, target_layer_ids=[1, 2, 3]), "fc.weight"),
    ("no target_layer_ids", lambda f: edit_dflash_config(f, target_layer_ids=...), "target_layer_ids"),
    ("ids beyond the target", lambda f: edit_dflash_config(f, target_layer_ids=[1, 6]), "target_layer_ids"),
    ("negative id", lambda f: edit_dflash_config(f, target_layer_ids=[-1, 2]), "target_layer_ids"),
    ("ids not ints", lambda f: edit_dflash_config(f, target_layer_ids="1,3"), "target_layer_ids"),
    ("no mask_token_id", lambda f: edit_dflash_config(f, mask_token_id=...), "mask_token_id"),
    ("mask_token_id out of vocab", lambda f: edit_dflash_config(f, mask_token_id=97), "mask_token_id"),
    ("block_size < 2", lambda f: edit_config(f, block_size=1), "block_size"),
    ("hidden_size", lambda f: edit_config(f, hidden_size=48), "hidden_size"),
    ("vocab_size", lambda f: edit_config(f, vocab_size=98), "vocab_size"),
    ("num_target_layers", lambda f: edit_config(f, num_target_layers=8), "num_target_layers"),
    ("not qwen3", lambda f: edit_config(f, model_type="llama"), "model_type"),
    ("no dflash_config object", lambda f: edit_config(f, dflash_config=[1, 3]), "dflash_config"),
    ("both markers", lambda f: edit_config(f, num_nextn_predict_layers=1), "exactly one"),
    ("no config.json", lambda f: (f / "config.json").unlink(), "config.json"),
    ("bad json", lambda f: (f / "config.json").write_text("{"), "JSON"),
    ("no weights", lambda f: (f / "model.safetensors").unlink(), "safetensors"),
    ("corrupt weights", lambda f: (f / "model.safetensors").write_bytes(b"nonsense"), "safetensors"),
    ("d2t without lm_head", lambda f: edit_tensors(f, add={"d2t": torch.zeros(10, dtype=torch.long)}),
     "lm_head.weight"),
    ("float d2t", lambda f: edit_tensors(f, add={"d2t": torch.zeros(10), "lm_head.weight": torch.zeros(10, 32)}),
     "d2t"),
    ("d2t out of vocab", lambda f: edit_tensors(f, add={"d2t": torch.full((10,), 90, dtype=torch.long),
                                                        "lm_head.weight": torch.zeros(10, 32)}), "d2t"),
    ("draft_vocab_size disagrees", lambda f: (edit_config(f, draft_vocab_size=11), edit_tensors(
        f, add={"d2t": torch.zeros(10, dtype=torch.long), "lm_head.weight": torch.zeros(10, 32)})),
     "draft_vocab_size"),
]


@pytest.mark.parametrize("name,damage,needle", DFLASH_CASES, ids=[c[0] for c in DFLASH_CASES])
def test_bad_dflash_checkpoint_is_refused(tmp_path, name, damage, needle):
    write_random_drafter(tmp_path, "dflash", INFO, seed=0, num_layers=2)
    damage(tmp_path)
    with pytest.raises(CheckpointError, match=needle):
        load_drafter(tmp_path, HEAD, target_info=INFO, dtype=torch.float32)


def test_dflash_for_another_target_is_refused(tmp_path):
    write_random_drafter(tmp_path, "dflash", INFO, seed=0, num_layers=2)
    wider = replace(INFO, hidden_size=48)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_drafter(tmp_path, TargetHead.random(wider, seed=0), target_info=wider)
    shallower = replace(INFO, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="num_target_layers"):
        load_drafter(tmp_path, HEAD, target_info=shallower)


MTP_CASES = [
    ("missing enorm", lambda f: edit_tensors(f, drop=["model.layers.6.enorm.weight"]), "model.layers.6.enorm.weight"),
    ("target's embedding copy", lambda f: edit_tensors(f, add={"model.layers.6.embed_tokens.weight":
                                                               torch.zeros(97, 32)}), "embed_tokens"),
    ("eh_proj shape", lambda f: edit_tensors(f, add={"model.layers.6.eh_proj.weight": torch.zeros(32, 32)}),
     "eh_proj"),
    ("layer index", lambda f: edit_config(f, mtp_layer_index=5), "mtp_layer_index"),
    ("two MTP layers", lambda f: edit_config(f, num_nextn_predict_layers=2), "num_nextn_predict_layers"),
    ("hidden_size", lambda f: edit_config(f, hidden_size=64), "hidden_size"),
    ("missing heads field", lambda f: edit_config(f, num_attention_heads=...), "num_attention_heads"),
]


@pytest.mark.parametrize("name,damage,needle", MTP_CASES, ids=[c[0] for c in MTP_CASES])
def test_bad_mtp_checkpoint_is_refused(tmp_path, name, damage, needle):
    write_random_drafter(tmp_path, "mtp", INFO, seed=0)
    damage(tmp_path)
    with pytest.raises(CheckpointError, match=needle):
        load_drafter(tmp_path, HEAD, target_info=INFO)


def test_large_drafters_are_saved_in_shards_that_load_exactly(tmp_path):
    drafter = random_drafter("dflash", INFO, HEAD, seed=5, num_layers=3, block_size=6)
    save_dflash(tmp_path, drafter)  # first one file, then shards over it: the old file must go
    limit = max(t.numel() * t.element_size() for t in drafter.model.state_dict().values())
    save_dflash(tmp_path, drafter, max_file_bytes=limit)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all((tmp_path / f).stat().st_size <= limit + 4096 for f in files)  # + the safetensors header
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(drafter.model.state_dict())
    assert set(index["weight_map"].values()) == set(files)
    loaded = load_drafter(tmp_path, HEAD, target_info=INFO, dtype=torch.float32, device="cpu")
    assert same_weights(loaded, drafter) and drafts(loaded) == drafts(drafter)
    (tmp_path / files[-1]).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_drafter(tmp_path, HEAD, target_info=INFO)
    with pytest.raises(InvalidRequest, match="alone"):
        save_dflash(tmp_path, drafter, max_file_bytes=limit - 1)


def test_the_shipped_dflash_drafter_keeps_z_labs_layout():
    """The checkpoint we ship loads unchanged in z-lab's DFlashDraftModel.from_pretrained: its shards hold
    exactly that model's tensors for its layer count, and its config carries the fields the reference
    reads at top level and under dflash_config (with the rope/norm values it was trained with)."""
    from specsplit.local import SHIPPED, SHIPPED_DIR

    folder = SHIPPED_DIR / SHIPPED["dflash"]
    config = json.loads((folder / "config.json").read_text())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == zlab_tensor_names(config["num_hidden_layers"])
    assert set(index["weight_map"].values()) == {f.name for f in folder.glob("model-*.safetensors")}
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 16
    assert config["num_target_layers"] == 30 and config["dflash_config"]["mask_token_id"] == 49151
    fc = load_file(str(folder / index["weight_map"]["fc.weight"]))["fc.weight"]  # it reads every target layer
    width = config["hidden_size"]
    assert tuple(fc.shape) == (width, len(config["dflash_config"]["target_layer_ids"]) * width)
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == pytest.approx(1e-5)
    for shard in folder.glob("model-*.safetensors"):
        assert shard.stat().st_size <= 16 * 1024 * 1024  # what one file back from the GPU host may weigh
