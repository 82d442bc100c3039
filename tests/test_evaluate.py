"""The acceptance report: τ, per-position acceptance and counts agree with each other and with the engine."""

from __future__ import annotations

import json

import pytest

from specsplit.drafter_service.checkpoint import random_drafter
from specsplit.drafter_service.dflash import RefinePolicy
from specsplit.cli import main
from specsplit.shared.errors import InvalidRequest
from specsplit.evaluate import EvalPrompt, EvalSettings, evaluate, format_report, position_acceptance
from specsplit.local import target_head, target_info
from specsplit.target_service.dense import generate
from specsplit.target_service.model import load_target
from specsplit.train import eval_summary
from tests.oracle import OracleDrafter

PROMPTS = [EvalPrompt("chat", [5, 6, 7, 8, 9]), EvalPrompt("code", [30, 31, 32])]


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_target(tiny_llama_dir)


def check_report(rep: dict, prompts, max_tokens: int) -> None:
    assert rep["prompts"] == len(prompts) and rep["mismatches"] == 0
    assert rep["generated"] == len(prompts) * max_tokens  # no EOS given: every request runs to max_tokens
    assert rep["tau"] == pytest.approx(rep["generated"] / rep["steps"]) and rep["tau"] >= 1.0
    assert rep["tau_excl_prefill"] == pytest.approx((rep["generated"] - 2) / (rep["steps"] - 2))
    assert 0 <= rep["accepted"] <= rep["drafted"]
    # Each generated token comes from a prefill, a bonus token per step, or an accepted draft.
    assert rep["generated"] == rep["steps"] + rep["accepted"]
    acc = rep["position_acceptance"]
    assert len(acc) == rep["max_drafts"] and all(0 <= a <= 1 for a in acc)
    assert all(a >= b for a, b in zip(acc, acc[1:]))
    assert sum(acc) * rep["proposals"] == pytest.approx(rep["accepted"])
    assert set(rep["by_kind"]) == {p.kind for p in prompts}
    assert sum(k["generated"] for k in rep["by_kind"].values()) == rep["generated"]
    assert rep["tokens_per_s"]["speedup"] > 0
    # The speed is the bare drafter's run (the engine's fast paths): the same tokens and τ as the recorded one
    served = rep["served"]
    assert served["mismatches"] == 0 and served["tau"] == pytest.approx(rep["tau"])
    assert rep["tokens_per_s"]["speculative"] == pytest.approx(rep["generated"] / rep["seconds"]["speculative"])
    assert served["recorded_tokens_per_s"] > 0
    for run in (served["engine"], served["target_only_engine"]):
        assert run["prefills"] == len(prompts) and run["steps"] > 0 and run["prefill_s"] >= 0
    # target-only decodes one token a step: a step per generated token but each prompt's first (its prefill's)
    assert served["target_only_engine"]["steps"] >= max_tokens - 1
    assert "engine:" in format_report(rep)
    decode, seconds = rep["decode"], rep["seconds"]
    for name, run in (("speculative", served["engine"]), ("target_only", served["target_only_engine"])):
        assert decode[name] == pytest.approx((rep["generated"] - len(prompts)) / (seconds[name] - run["prefill_s"]))
    assert decode["speedup"] == pytest.approx(decode["speculative"] / decode["target_only"])
    assert "decode tokens/s" in format_report(rep)
    json.dumps(rep)
    assert "mismatches" in format_report(rep)


def test_random_drafter_report_is_well_formed(llama):
    drafter = random_drafter("dflash", target_info(llama), target_head(llama), seed=0, block_size=4)
    rep = evaluate(llama, drafter, PROMPTS, EvalSettings(max_tokens=12, batch=2))
    check_report(rep, PROMPTS, 12)
    assert rep["proposals"] > 0 and rep["max_drafts"] == 3


def test_refined_runs_are_reported_beside_their_teacher_forced_walks(llama):
    """--refine: per policy, the teacher-forced figures of a second pass and a real run drafted so, in the
    report and TRAINING.log's line. (This random drafter's drafts are all rejected, so the walk's steps equal
    the run's whatever the passes draft: the slow shipped-drafter test in test_alignment checks that on
    drafts that are accepted.)"""
    drafter = random_drafter("dflash", target_info(llama), target_head(llama), seed=0, block_size=4)
    policies = (RefinePolicy(fixed=1), RefinePolicy(confident=0.01))
    rep = evaluate(llama, drafter, PROMPTS, EvalSettings(max_tokens=12, batch=2, refine=policies))
    check_report(rep, PROMPTS, 12)
    assert drafter.refine is None  # the drafter is left as it was
    forced = rep["teacher_forced"]
    assert set(forced["walk"]["by_kind"]) == {"chat", "code"}
    assert set(forced["refined"]) == set(rep["refined_runs"]) == {"1", "p0.01"}
    for name, real in rep["refined_runs"].items():
        walk = forced["refined"][name]["walk"]
        assert real["mismatches"] == 0 and real["generated"] == rep["generated"]
        assert walk["steps"] == real["steps"] - len(PROMPTS) and walk["tokens"] == real["generated"] - len(PROMPTS)
        assert sum(k["steps"] for k in walk["by_kind"].values()) == walk["steps"]
        assert f"refined ({name} given)" in format_report(rep)
    for bad in ({"refine": ("2",)}, {"refine": policies + (RefinePolicy(fixed=1),)},
                {"refine": policies, "temperature": 0.8}):
        with pytest.raises(InvalidRequest):
            EvalSettings(**bad)
    mtp = random_drafter("mtp", target_info(llama), target_head(llama), seed=0)
    with pytest.raises(InvalidRequest):
        evaluate(llama, mtp, PROMPTS, EvalSettings(max_tokens=4, batch=2, refine=policies))
    line = eval_summary(rep)  # TRAINING.log's line
    assert "over decoding's walk (walk: chat " in line and "refined (p0.01 given) " in line
    assert line.count("decoded tau ") == 2 and line.count("0 mismatches") == 2


def test_oracle_drafter_accepts_long_runs(llama):
    full = generate(llama, [list(p.ids) for p in PROMPTS], 16).rows()
    inner = random_drafter("dflash", target_info(llama), target_head(llama), seed=0, block_size=5)
    oracle = OracleDrafter(inner, {tuple(p.ids): row for p, row in zip(PROMPTS, full)}, mistake_rate=0.1)
    rep = evaluate(llama, oracle, PROMPTS, EvalSettings(max_tokens=16, batch=1))
    check_report(rep, PROMPTS, 16)
    assert rep["tau"] > 2 and rep["position_acceptance"][0] > 0.5


def test_position_acceptance_counts_prefixes():
    assert position_acceptance([(3, 0), (3, 3), (2, 1), (3, 2)], 3) == [0.75, 0.5, 0.25]
    assert position_acceptance([], 2) == [0.0, 0.0]


def test_cli_evaluates_a_target_on_text_prompts(tiny_chat_dir, tmp_path, capsys):
    """The command's wiring (text prompts, the target's tokenizer, a named drafter); a tiny target that
    speaks the default model's tokenizer does it at a fraction of the default model's load time."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"kind": "chat", "text": "Name a color."}\n{"kind": "code", "text": "def add(a, b):"}\n')
    assert main(["eval-acceptance", "--target", str(tiny_chat_dir), "--drafter", "random-mtp", "--prompts",
                 str(prompts), "--max-tokens", "3", "--batch", "2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["prompts"] == 2 and rep["mismatches"] == 0 and rep["drafter"] == "random-mtp"
    assert rep["steps"] + rep["accepted"] == rep["generated"] <= 6
    assert set(rep["by_kind"]) == {"chat", "code"}
    with pytest.raises(SystemExit):
        main(["eval-acceptance", "--target", str(tiny_chat_dir), "--prompts", str(prompts), "--refine", "1,p2"])
    assert "--refine: a refine policy's confidence lies in (0, 1), got 2.0" in capsys.readouterr().err


def test_decode_speed_leaves_out_prefill_and_first_tokens():
    from specsplit.evaluate import Run, decode_speed
    from specsplit.target_service.sequence import RequestStats
    stats = [RequestStats(steps=5, generated=11), RequestStats(steps=3, generated=9)]  # 20 tokens, 2 first ones
    spec = Run([], stats, seconds=2.0, engine={"prefill_s": 0.5})
    base = Run([], stats, seconds=4.0, engine={"prefill_s": 1.0})
    assert decode_speed(spec, base) == pytest.approx({"speculative": 12.0, "target_only": 6.0, "speedup": 2.0})
    assert decode_speed(Run([], stats, seconds=2.0), base) is None  # a run that did not count its prefills
    assert decode_speed(Run([], stats, 0.5, {"prefill_s": 0.5}), base) is None  # nothing left to time
