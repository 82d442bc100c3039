"""Programmatic dependent launch (kernels/_triton.py): which launches ask for it, and on a Hopper GPU that a
fused layer stack launched with it, eagerly and captured in a CUDA graph, gives the very same bits as without
(each kernel waits for the one before it before touching memory, so nothing may change but the gaps)."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels._triton import tl, triton

from specsplit.kernels import _triton
from specsplit.shared.config import ModelConfig
from tests.kernel_checks import captured
from tests.test_skinny_linear import fused_outputs, random_layers

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                            reason="needs a CUDA GPU of compute capability 9.0 or later")


def test_which_launches_ask_for_it(monkeypatch):
    cuda = torch.device("cuda", 1)
    monkeypatch.setattr(_triton, "PDL", False)
    assert _triton.dependent_launch(cuda, "rope") == {"USE_GDC": 0}, "off unless asked"
    monkeypatch.setattr(_triton, "PDL", True)
    assert _triton.dependent_launch(torch.device("cpu"), "rope") == {"USE_GDC": 0}, "never on the CPU"
    with pytest.raises(AssertionError):
        _triton.dependent_launch(cuda, "ropes")  # a family PDL_SKIP could not name
    if not _triton.HAVE_TRITON:
        return
    monkeypatch.setattr(_triton, "_hopper_or_later", lambda index: index == 1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _triton.dependent_launch(cuda, "rope") == {"USE_GDC": 1, "launch_pdl": True}
    assert _triton.dependent_launch(torch.device("cuda", 0), "rope") == {"USE_GDC": 0}, "before Hopper"
    monkeypatch.setattr(_triton, "PDL_TRIGGER", "exit")
    assert _triton.dependent_launch(cuda, "rope") == {"USE_GDC": 2, "launch_pdl": True}
    monkeypatch.setattr(_triton, "PDL_SKIP", frozenset({"rope"}))
    assert _triton.dependent_launch(cuda, "rope") == {"USE_GDC": 0}, "a family left out"
    assert _triton.dependent_launch(cuda, "rms_norm") == {"USE_GDC": 2, "launch_pdl": True}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _triton.dependent_launch(cuda, "rms_norm") == {"USE_GDC": 0}, "never interpreted"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert _triton.PDL_SUPPORTED  # (this Triton's)
    monkeypatch.setattr(_triton, "PDL_SUPPORTED", False)
    assert _triton.dependent_launch(cuda, "rms_norm") == {"USE_GDC": 0}, "a Triton without it"


def test_the_switch_reads_as_the_services_read_theirs(monkeypatch):
    for value, expected in (("0", False), ("off", False), ("No", False), ("1", True), ("true", True), (" on ", True)):
        monkeypatch.setenv("SPECSPLIT_PDL", value)
        assert _triton._switch("SPECSPLIT_PDL", not expected) is expected
    monkeypatch.delenv("SPECSPLIT_PDL")
    assert _triton._switch("SPECSPLIT_PDL", True) is True
    monkeypatch.setenv("SPECSPLIT_PDL", "flase")
    with pytest.raises(ValueError, match="SPECSPLIT_PDL"):
        _triton._switch("SPECSPLIT_PDL", True)


def test_heavy_projections_launch_as_their_own_family(monkeypatch):
    """The few-rows kernel names its PDL family by its weight's bytes: from PDL_HEAVY_BYTES up,
    "skinny_linear_heavy", which PDL_SKIP leaves plain by default (a stand-in kernel records the launch)."""
    from specsplit.kernels import skinny_linear

    launches = []

    class StandIn:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw)

    families = []
    monkeypatch.setattr(skinny_linear, "_skinny_linear_kernel", StandIn())
    monkeypatch.setattr(skinny_linear, "dependent_launch",
                        lambda device, family: families.append(family) or {"USE_GDC": 0})
    x, weight = torch.ones(2, 64, dtype=torch.float16), torch.ones(32, 64, dtype=torch.float16)
    for heavy_bytes in (weight.numel() * 2 + 1, weight.numel() * 2):  # just below the bound, at it
        monkeypatch.setattr(skinny_linear, "PDL_HEAVY_BYTES", heavy_bytes)
        skinny_linear._launch(x, weight, None, None, False, None, None, 0.0, None)
    assert families == ["skinny_linear", "skinny_linear_heavy"] and len(launches) == 2
    assert _triton.PDL_SKIP == frozenset({"skinny_linear_heavy"}) and set(_triton.PDL_SKIP) <= set(_triton.FAMILIES)


# Each kernel with constexprs of a real launch (a decode of the default model's shapes) and its pointers' types;
# every other argument an int32 but the float ones named here.
KERNELS = {
    "activation._silu_mul_kernel": ({"BLOCK": 1024}, {}),
    "norm._rms_norm_kernel": ({"ADD": True, "BLOCK": 1024}, {}),
    "paged_attention._paged_attention_kernel": (
        {"Q_LEN": 1, "Q_HEADS": 9, "GROUPS": 3, "HEAD_DIM": 64, "BLOCK_SIZE": 16, "ROWS": 16, "BLOCK_N": 64,
         "WINDOW": 0, "NUM_SPLITS": 8, "DOT_PRECISION": "tf32", "TILES": 1},
        {"tables_ptr": "*i32", "positions_ptr": "*i64", "out_ptr": "*fp32", "lse_ptr": "*fp32"}),
    "paged_attention._combine_splits_kernel": ({"NUM_SPLITS": 8, "HEAD_DIM": 64}, {"partial_ptr": "*fp32",
                                                                                  "lse_ptr": "*fp32"}),
    "rope._rope_kernel": ({"NORM": True, "DIM": 64, "BLOCK_HQ": 16, "BLOCK_HKV": 4}, {"slots_ptr": "*i64"}),
    "rope._context_kv_kernel": ({"NORM": True, "DIM": 64, "BLOCK_HKV": 4}, {"slots_ptr": "*i64"}),
    "rope._rotary_tables_kernel": ({"HALF": 32, "BLOCK_T": 16}, {"positions_ptr": "*i64", "inv_freq_ptr": "*fp32"}),
    "row_max._row_max_kernel": ({"SPLITS": 12, "SPLITS_POW2": 16, "BLOCK": 4096},
                                {"part_val_ptr": "*fp32", "part_idx_ptr": "*i32", "arrivals_ptr": "*i32",
                                 "val_ptr": "*fp32", "idx_ptr": "*i64"}),
    "top_k._top_k_kernel": ({"K": 8, "KP": 8, "SPLITS": 24, "SPLITS_POW2": 32, "BLOCK": 2048, "SCORED": True},
                            {"x_ptr": "*fp32", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32", "part_max_ptr": "*fp32",
                             "part_sum_ptr": "*fp32", "arrivals_ptr": "*i32", "val_ptr": "*fp32", "idx_ptr": "*i64",
                             "scores_ptr": "*fp32"}),
    "tree_grow._best_first_kernel": ({"N": 15, "NP": 16, "F": 16, "ROOTS": True},
                                     {"logp_ptr": "*fp32", "ids_ptr": "*i64", "tokens_ptr": "*i64",
                                      "parents_ptr": "*i64", "depths_ptr": "*i64", "words_ptr": "*i64",
                                      "anchors_ptr": "*i64", "positions_ptr": "*i64", "verify_tokens_ptr": "*i64",
                                      "rotary_ptr": "*i64"}),
    "tree_accept._accept_tree_kernel": ({"N": 15, "NP": 16}, {"tables_ptr": "*i32", **{name: "*i64" for name in (
        "tokens_ptr", "parents_ptr", "depths_ptr", "words_ptr", "picks_ptr", "positions_ptr", "outcome_ptr",
        "accepted_ptr", "final_ptr", "order_ptr", "move_from_ptr", "move_to_ptr")}}),
    "fed_inputs._fed_inputs_kernel": ({"Q": 16, "QP": 16, "TREE": True}, {"tables_ptr": "*i32", **{
        name: "*i64" for name in ("tokens_ptr", "starts_ptr", "token_ids_ptr", "positions_ptr", "slots_ptr",
                                  "rotary_ptr", "words_ptr", "rotary_out_ptr", "words_out_ptr")}}),
    "chain_meta._chain_meta_kernel": ({"ROWS": 48, "ROWS_P2": 64, "COMMIT": True}, {"stacked_ptr": "*i32", **{
        name: "*i64" for name in ("meta_ptr", "anchors_ptr", "positions_ptr", "periods_ptr")}}),
    "chain_accept._accept_chain_kernel": ({"K": 15, "KP": 16}, {name: "*i64" for name in (
        "drafts_ptr", "picks_ptr", "outcome_ptr", "accepted_ptr", "final_ptr")}),
    "kv_move._move_rows_kernel": ({"WIDTH": 192, "ROWS": 16, "BLOCK_C": 64}, {"src_ptr": "*i64", "dst_ptr": "*i64"}),
    "skinny_linear._skinny_linear_kernel": (
        {"HAS_BIAS": False, "SWIGLU": True, "ADD": False, "NORM_OUT": False, "NORM_IN": True, "SQUARES_BLOCK": 64,
         "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 256}, {"squares_ptr": "*fp32"}),
}
FLOATS = {"eps", "norm_eps", "scale_log2"}
MEMORY_OPS = ("ld.global", "st.global", "atom.global", "red.global", "cp.async", "ld.volatile.global")


# The other sides of the kernels' constexpr switches, compiled too (test_each_kernel_variant_compiles)
VARIANTS = {
    "top_k._top_k_kernel": {"SCORED": False},
    "rope._rope_kernel": {"NORM": False},
    "tree_grow._best_first_kernel": {"ROOTS": False},
    "fed_inputs._fed_inputs_kernel": {"TREE": False, "Q": 8},
    "chain_meta._chain_meta_kernel": {"COMMIT": False},
    "tree_accept._accept_tree_kernel": {"N": 63, "NP": 64},
}


def sm90_ptx(name: str, use_gdc: int, variant: dict | None = None) -> str:
    """The kernel compiled on this machine (no GPU needed) for compute capability 9.0, as PTX."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, kernel_name = name.split(".")
    kernel = getattr(importlib.import_module(f"specsplit.kernels.{module}"), kernel_name)
    constexprs, pointers = KERNELS[name]
    constexprs = {**constexprs, **(variant or {}), "USE_GDC": use_gdc}
    signature = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name, "*bf16") if p.name.endswith("_ptr")
                 else "fp32" if p.name in FLOATS else "i32" for p in kernel.params}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": bool(use_gdc)})
    return compiled.asm["ptx"]


def touches_memory(line: str) -> bool:
    """Whether a PTX line is a global load, store, atomic or async copy (predicated or not)."""
    words = line.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return bool(words) and any(words[0].startswith(op) for op in MEMORY_OPS)


def assert_waits_first(ptx: str, trigger: bool = True) -> None:
    """The PTX's griddepcontrol.wait comes before its first global load, store or atomic, and it lets the
    next kernel launch (`trigger`: explicitly; else not at all, the next launching as this one ends)."""
    lines = [line.strip() for line in ptx.splitlines()]
    wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait"))
    first_memory = next(i for i, line in enumerate(lines) if touches_memory(line))
    assert wait < first_memory, lines[first_memory]
    assert any(line.startswith("griddepcontrol.launch_dependents") for line in lines) == trigger


needs_triton = pytest.mark.skipif(not _triton.HAVE_TRITON, reason="needs triton")


@needs_triton
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_each_kernel_waits_before_it_touches_memory(name):
    """Compiled for Hopper (on this machine: ~1 s a kernel) with USE_GDC, a kernel's first global load, store
    or atomic comes after its griddepcontrol.wait (a read before it could see the kernel before it unfinished);
    without, no grid dependency control at all. Every Triton kernel of kernels/ is here."""
    assert_waits_first(sm90_ptx(name, _triton.TRIGGERS["start"]))
    assert "griddepcontrol" not in sm90_ptx(name, 0)


@needs_triton
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_kernel_variant_compiles_and_waits_first(name):
    """A kernel's other constexpr branches (scored or not, a tree's or a chain's, ...) compile for Hopper too, and
    wait before they touch memory."""
    assert_waits_first(sm90_ptx(name, _triton.TRIGGERS["start"], VARIANTS[name]))


@needs_triton
def test_a_kernel_triggered_at_exit_only_waits():
    """USE_GDC 2 (PDL_TRIGGER "exit"): the wait first, no explicit trigger (gdc_enter is every kernel's, so
    one kernel shows it)."""
    assert_waits_first(sm90_ptx("rope._rope_kernel", _triton.TRIGGERS["exit"]), trigger=False)
    with pytest.raises(AssertionError):
        assert_waits_first(sm90_ptx("rope._rope_kernel", _triton.TRIGGERS["exit"]))


@needs_triton
def test_a_kernel_that_reads_first_fails_the_check():
    """The check catches a kernel that loads before it waits (a module of its own, compiled the same way)."""
    KERNELS["test_pdl._reads_first_kernel"] = ({"USE_GDC": 1}, {})
    try:
        import importlib
        import sys

        sys.modules.setdefault("specsplit.kernels.test_pdl", importlib.import_module(__name__))
        with pytest.raises(AssertionError):
            assert_waits_first(sm90_ptx("test_pdl._reads_first_kernel", 1))
    finally:
        del KERNELS["test_pdl._reads_first_kernel"]
        sys.modules.pop("specsplit.kernels.test_pdl", None)


if _triton.HAVE_TRITON:
    @triton.jit
    def _reads_first_kernel(x_ptr, out_ptr, USE_GDC: tl.constexpr):
        x = tl.load(x_ptr)
        _triton.gdc_enter(USE_GDC)
        tl.store(out_ptr, x)


def test_every_kernel_is_checked():
    """A Triton kernel added to kernels/ without a place in KERNELS (and its USE_GDC) fails here."""
    import pkgutil
    import importlib

    import specsplit.kernels as package

    found = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"specsplit.kernels.{info.name}")
        for attr, value in vars(module).items():
            if attr.endswith("_kernel") and hasattr(value, "params"):
                found.add(f"{info.name}.{attr}")
                assert any(p.name == "USE_GDC" and p.is_constexpr for p in value.params), attr
    if _triton.HAVE_TRITON:
        assert found == set(KERNELS), found ^ set(KERNELS)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_dependent_launches_change_no_bit(monkeypatch, rows):
    """Two SmolLM2-wide layers (every projection folding: the few-rows kernel, RMSNorm, RoPE-free stand-in
    attention) plus a norm, eager and replayed from a graph, without PDL and with it (each kernel letting
    the next launch at its start, or at its exit): equal bit for bit."""
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    layers = random_layers(cfg, "cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(rows, cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    norm = (1 + 0.3 * torch.randn(cfg.hidden_size, generator=gen)).to("cuda", torch.bfloat16)
    results = {}
    for pdl, trigger in ((False, "start"), (True, "start"), (True, "exit")):
        monkeypatch.setattr(_triton, "PDL", pdl)
        monkeypatch.setattr(_triton, "PDL_TRIGGER", trigger)
        eager = fused_outputs(cfg, layers, x, norm)
        with torch.no_grad():
            graph, out = captured(lambda: fused_outputs(cfg, layers, x, norm))
        graph.replay()
        torch.cuda.synchronize()
        results[pdl, trigger] = (eager[0].clone(), eager[1].clone(), out[0].clone(), out[1].clone())
    for mode in ((True, "start"), (True, "exit")):
        for off, on in zip(results[False, "start"], results[mode]):
            assert torch.equal(off, on), mode
