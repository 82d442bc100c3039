"""Acceptance of a drafter on held-out prompts: τ, acceptance by draft position, and speed against the target alone.

Terms: τ = generated tokens / target steps, the engine's own figure (its prefill counts as a step);
τ without prefill = (generated - 1) / (steps - 1) per request, summed over requests, the usual
"acceptance length". Acceptance at draft position j is the share of verified proposals whose first
j+1 drafts were all accepted, so it never rises with j. The runs (target-only; speculative with the
drafter behind a recorder of what each proposal offered, for τ and acceptance; and speculative with the
bare drafter, the engine's fast paths, for the speed) use the same prompts, model and engine settings in
one process; with greedy decoding their outputs must match token for token, and every mismatch is counted.

Teacher forcing (DFlash, greedy): every generated token of the target-only run as an anchor, the
training forward's block drafts scored against the continuation (what the training loss sees). It
differs from the real run only in where anchors fall (every token, not just bonus tokens), so a large
gap between the two means training and inference disagree on what a block sees or predicts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from specsplit.drafter_service.base import DraftVocab, pick
from specsplit.drafter_service.dflash import DFlashDrafter, DFlashModel, RefinePolicy
from specsplit.drafter_service.heads import TargetHead
from specsplit.drafter_service.training import dflash_block_hidden
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.proposer import Proposal, ProposeRequest, Proposer
from specsplit.shared.sampling import SamplingParams
from specsplit.shared.tree import MAX_TREE_NODES
from specsplit.target_service.dense import capture_features
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.model import CaptureSpec, TargetModel
from specsplit.target_service.sequence import Request, RequestStats
from specsplit.train import block_targets


@dataclass(frozen=True)
class EvalPrompt:
    kind: str  # a label for the per-kind breakdown (chat, code, ...)
    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(self.ids))
        if not self.ids:
            raise InvalidRequest("an evaluation prompt needs at least one token")


@dataclass(frozen=True)
class EvalSettings:
    max_tokens: int = 128
    temperature: float = 0.0
    batch: int = 16  # sequences the engine decodes together
    num_drafts: int | None = None  # None: the drafter's max
    seed: int = 0  # seeds sampling when temperature > 0
    # Teacher-forced figures again for each policy of a refining second pass (DFlash, greedy)
    refine: tuple[RefinePolicy, ...] = ()
    draft_tree: int = 0  # EngineConfig.draft_tree: greedy steps verify a tree of this many nodes (0: chains)

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.batch < 1 or self.temperature < 0:
            raise InvalidRequest("max_tokens and batch must be ≥ 1, temperature ≥ 0")
        object.__setattr__(self, "refine", tuple(self.refine))
        if not all(isinstance(policy, RefinePolicy) for policy in self.refine):
            raise InvalidRequest("refine takes RefinePolicy values")
        if len({str(policy) for policy in self.refine}) != len(self.refine):
            raise InvalidRequest(f"refine names a policy twice: {', '.join(map(str, self.refine))}")
        if self.refine and self.temperature > 0:
            raise InvalidRequest("a refining pass is scored greedy only (teacher forcing): give temperature 0")
        if isinstance(self.draft_tree, bool) or not isinstance(self.draft_tree, int) \
                or not 0 <= self.draft_tree <= MAX_TREE_NODES:
            raise InvalidRequest(f"draft_tree is a number of nodes in 0..{MAX_TREE_NODES}, got {self.draft_tree!r}")
        if self.draft_tree and (self.temperature > 0 or self.refine):
            raise InvalidRequest("draft trees are verified greedily and drafted in one pass: temperature 0, "
                                 "no refine")

    def params(self, index: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed + index)


class AcceptanceRecorder:
    """A pass-through Proposer noting, per verified proposal, how many drafts it offered and how many held."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.spec = inner.spec
        self.offered: dict[int, int] = {}
        self.records: list[tuple[int, int]] = []  # (drafts offered, drafts accepted)

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        proposals = self.inner.propose(requests)
        for request, proposal in zip(requests, proposals):
            self.offered[request.seq_id] = len(proposal.tokens)
        return proposals

    def propose_on_device(self, requests: Sequence[ProposeRequest]):
        """The engine's fast path, kept (this measures its speed): device drafts are always num_drafts."""
        drafts = self.inner.propose_on_device(requests) if hasattr(type(self.inner), "propose_on_device") else None
        if drafts is not None:
            for request in requests:
                self.offered[request.seq_id] = request.num_drafts
        return drafts

    def propose_candidates(self, requests: Sequence[ProposeRequest], keep: int):
        """A draft tree's candidates (EngineConfig.draft_tree): each request offers its rows, num_drafts deep."""
        got = self.inner.propose_candidates(requests, keep)
        for request in requests:
            self.offered[request.seq_id] = request.num_drafts
        return got

    def catchup(self, seq_id: int, token_ids, rows, base_pos: int) -> int:
        # A tree none of whose nodes held commits its root alone, as a catch-up: still a verified proposal
        if self.offered.get(seq_id, 0) > 0:
            self.records.append((self.offered.pop(seq_id), 0))
        return self.inner.catchup(seq_id, token_ids, rows, base_pos)

    def trim(self, seq_id: int, num_accepted: int) -> None:
        # The engine trims once per verified proposal with drafts, after commit.
        self.records.append((self.offered.pop(seq_id, 0), num_accepted))
        self.inner.trim(seq_id, num_accepted)

    def commit_verified(self, seq_id: int, rows, num_accepted: int, base_pos: int, token_ids) -> None:
        if not hasattr(type(self.inner), "commit_verified"):  # the plain verbs, as the engine would call them
            self.inner.stash(seq_id, rows)
            self.inner.commit(seq_id, num_accepted + 1, base_pos, token_ids)
            (self.trim if rows.shape[0] > 1 else self.inner.trim)(seq_id, num_accepted)  # one row: a catch-up
            return
        if rows.shape[0] > 1:  # one row: a catch-up, no drafts were verified
            self.records.append((self.offered.pop(seq_id, 0), num_accepted))
        self.inner.commit_verified(seq_id, rows, num_accepted, base_pos, token_ids)

    def commit_verified_many(self, seq_ids, rows, row_starts, row_counts, num_accepted, base_pos, token_ids) -> None:
        if not hasattr(type(self.inner), "commit_verified_many"):
            for entry in zip(seq_ids, row_starts, row_counts, num_accepted, base_pos, token_ids):
                seq_id, start, count, accepted, pos, tokens = entry
                self.commit_verified(seq_id, rows[start:start + count], accepted, pos, tokens)
            return
        self.records += [(self.offered.pop(seq_id, 0), accepted)
                         for seq_id, count, accepted in zip(seq_ids, row_counts, num_accepted) if count > 1]
        self.inner.commit_verified_many(seq_ids, rows, row_starts, row_counts, num_accepted, base_pos, token_ids)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@dataclass
class Run:
    tokens: list[list[int]]
    stats: list[RequestStats]
    seconds: float
    engine: dict = field(default_factory=dict)  # how the engine ran its steps (run_engine)

    @property
    def generated(self) -> int:
        return sum(s.generated for s in self.stats)


def _sync(model: TargetModel) -> None:
    if model.embed_weight.device.type == "cuda":
        torch.cuda.synchronize(model.embed_weight.device)


def make_engine(model: TargetModel, proposer: Proposer | None, settings: EvalSettings,
                eos_ids: Sequence[int]) -> Engine:
    return Engine(model, proposer, EngineConfig(max_batch=settings.batch, num_drafts=settings.num_drafts,
                                                draft_tree=settings.draft_tree), eos_ids=eos_ids)


def run_engine(engine: Engine, prompts: Sequence[EvalPrompt], settings: EvalSettings, tag: str = "p") -> Run:
    """Every prompt through the engine's slots, admitted as others end; timed, with what the engine counted
    during the run (an engine goes on across runs, as a server's does: its captures stay)."""
    speculative = engine.proposer is not None
    requests = [Request(f"{tag}{i}", list(p.ids), settings.params(i), speculative=speculative)
                for i, p in enumerate(prompts)]
    before = _tally(engine)
    _sync(engine.model)
    start = time.perf_counter()
    events = engine.generate(requests)
    _sync(engine.model)
    seconds = time.perf_counter() - start
    ordered = [events[r.request_id] for r in requests]
    ran = {name: value - before[name] for name, value in _tally(engine).items()}
    return Run([[t for e in evs for t in e.token_ids] for evs in ordered], [evs[-1].stats for evs in ordered],
               seconds, ran)


def _tally(engine: Engine) -> dict[str, float]:
    """How an engine has run its steps so far: engine steps, chained ones, replays of a captured chained step
    and captures (with their host seconds), prefills (with the host seconds in them)."""
    c = engine.counters
    return {"steps": c.steps, "chained": c.chained, "replayed_whole": c.chain_replays, "captures": c.chain_captures,
            "capture_s": c.chain_capture_seconds, "prefills": c.prefills, "prefill_s": engine.prefill_seconds}


def evaluate(model: TargetModel, proposer: Proposer, prompts: Sequence[EvalPrompt], settings: EvalSettings, *,
             eos_ids: Sequence[int] = ()) -> dict:
    """Run the prompts with the drafter and without (after a warm-up of each); the report, with
    teacher-forced acceptance on the target-only outputs when the drafter is an in-process DFlash one
    and decoding is greedy. On a GPU the warm-up is the whole run, untimed: each batch bucket's graphs
    and each Triton kernel's shapes are built on first use, and a short warm-up left most of that in the
    timed run of whichever was measured first (a checkpoint measured 0.23x target-only, then the one it
    continued 0.89x, in one process)."""
    if not prompts:
        raise InvalidRequest("no prompts to evaluate")
    if settings.refine and not isinstance(proposer, DFlashDrafter):
        raise InvalidRequest("a refining pass is a DFlash drafter's, in this process")
    if settings.draft_tree and not isinstance(proposer, DFlashDrafter):
        raise InvalidRequest("draft trees are drafted by a DFlash drafter, in this process")
    recorder = AcceptanceRecorder(proposer)
    if model.embed_weight.device.type == "cuda":
        warm_prompts, warm = prompts, settings
    else:
        warm_prompts = prompts[:1]
        warm = EvalSettings(max_tokens=min(4, settings.max_tokens), batch=settings.batch,
                            num_drafts=settings.num_drafts, draft_tree=settings.draft_tree)
    # One engine each, warmed up and then timed, as a server's goes on: its CUDA graphs (the chained steps'
    # shapes are captured on their ninth run) are paid for once, not in the timed run
    engines = {name: make_engine(model, drafter, settings, eos_ids)
               for name, drafter in (("recorded", recorder), ("served", proposer), ("base", None))}
    for engine in engines.values():
        run_engine(engine, warm_prompts, warm, "w")
    recorder.records.clear()
    base = run_engine(engines["base"], prompts, settings)
    spec = run_engine(engines["recorded"], prompts, settings)
    # The recorder counts what each proposal offered through the plain verbs, so the engine takes none of its
    # fast paths with it (chained steps, fused commits: see target_service.engine._capability): the speed is
    # the bare drafter's, the serving path, timed in its own run beside the others
    served = run_engine(engines["served"], prompts, settings)
    rep = report(prompts, spec, base, recorder.records, proposer.spec.max_drafts, settings, served=served)
    if isinstance(proposer, DFlashDrafter) and settings.temperature == 0.0:
        rep["teacher_forced"] = teacher_forced(model, proposer.model, proposer.head, [p.ids for p in prompts],
                                               base.tokens, settings.num_drafts or proposer.spec.max_drafts,
                                               settings.refine, [p.kind for p in prompts])
        rep["refined_runs"] = {str(policy): refined_run(model, proposer, policy, prompts, base, settings, eos_ids)
                               for policy in settings.refine}
        if settings.draft_tree:
            rep["teacher_forced"]["tree_walk"] = tree_walk(model, proposer, prompts, base, settings)
    return rep


def tree_walk(model: TargetModel, drafter: DFlashDrafter, prompts: Sequence[EvalPrompt], base: Run,
              settings: EvalSettings) -> dict:
    """The engine's draft trees (`EngineConfig.draft_tree`) walked teacher-forced over the target-only run's
    tokens, over every row of a block (`tree_eval.walk`): its tau_excl_prefill is the run's where no step was
    asked for fewer drafts (`num_drafts`, or a request's last steps)."""
    from specsplit.tree_eval import TreePolicy, walk  # (it reads this module's walk_steps)

    policy = TreePolicy(budget=settings.draft_tree, keep=EngineConfig.draft_tree_keep, scores=drafter.tree_scores)
    steps = tokens = 0
    for prompt, generated in zip(prompts, base.tokens):
        if len(generated) > 1:
            steps += walk(model, drafter.model, drafter.head, prompt.ids, generated, [policy])[0]
            tokens += len(generated) - 1
    return {"steps": steps, "tokens": tokens, "tau_excl_prefill": tokens / steps if steps else 0.0}


def refined_run(model: TargetModel, drafter: DFlashDrafter, policy: RefinePolicy, prompts: Sequence[EvalPrompt],
                base: Run, settings: EvalSettings, eos_ids: Sequence[int]) -> dict:
    """Real speculative decoding with every block drafted twice (`DFlashDrafter.refine`, eager forwards):
    τ overall and by kind, to set beside the teacher-forced walk's, and its mismatches against `base`
    (greedy: none, or verification is broken)."""
    before, drafter.refine = drafter.refine, policy
    try:
        run = run_engine(make_engine(model, drafter, settings, eos_ids), prompts, settings, "r")
    finally:
        drafter.refine = before
    return {**tau_figures(run.stats), "by_kind": tau_by_kind(run.stats, prompts),
            "mismatches": sum(a != b for a, b in zip(run.tokens, base.tokens))}


# ---- teacher forcing ----------------------------------------------------------------------------


@torch.no_grad()
def anchor_matches(drafter: DFlashModel, head: TargetHead, rows: torch.Tensor, tokens: torch.Tensor, length: int,
                   anchors: Sequence[int], *, chunk: int = 32, refine: RefinePolicy | None = None) -> list[int]:
    """Per anchor index a of one sequence (tokens [S] real up to `length`, the target's feature rows
    [S, feature_dim]): how many leading drafts of the training forward's block at a equal x_{a+1}, ...
    — what greedy verification accepts when the sequence is the target's greedy continuation.

    With `refine`, a second pass given the policy's r leading drafts of the first drafts the rest: the
    count is the first pass's where it missed within its first r drafts, else r plus the second pass's
    leading matches past them (given the true tokens, which the first pass's drafts then are). The policy
    reads all γ-1 drafts, as `DFlashDrafter.draft` does whatever a step asks."""
    gamma = drafter.cfg.block_size
    vocab = DraftVocab(drafter.d2t, head.vocab_size)
    positions = torch.arange(tokens.shape[0], device=tokens.device)[None]
    valid, lengths = positions < length, torch.tensor([length], device=tokens.device)
    k = torch.arange(1, gamma, device=tokens.device)
    out = []
    for start in range(0, len(anchors), chunk):
        index = torch.tensor(list(anchors[start:start + chunk]), device=tokens.device)[None]  # [1, N]
        targets, ok = block_targets(tokens[None], lengths, index, torch.ones_like(index, dtype=torch.bool), gamma)
        targets, ok = targets[0, :, 1:], ok[0, :, 1:]

        def hits(reveal: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = dflash_block_hidden(drafter, head, rows[None], tokens[None], positions, valid, index,
                                         None if reveal is None else reveal[None])
            ids, logp = pick(drafter.logits(hidden[0, :, 1:], head), None)  # [N, γ-1], as the drafter picks
            drafts = vocab.to_target(ids).to(targets.device)
            return (drafts == targets) & ok, logp.exp()

        hit, probs = hits(None)
        if refine is not None:
            reveal = refine.reveal(probs).to(tokens.device)  # [N]
            hit = torch.where(k <= reveal[:, None], hit, hits(reveal)[0])
        out += hit.long().cumprod(1).sum(1).tolist()
    return out


def walk_steps(matches: Sequence[int], offered: int) -> int:
    """Steps greedy decoding takes over a continuation whose anchor i gets matches[i] leading drafts right."""
    i = steps = 0
    while i < len(matches):
        i += min(matches[i], offered) + 1
        steps += 1
    return steps


def teacher_forced(target: TargetModel, drafter: DFlashModel, head: TargetHead, prompts: Sequence[Sequence[int]],
                   continuations: Sequence[Sequence[int]], num_drafts: int | None = None,
                   refine: Sequence[RefinePolicy] = (), kinds: Sequence[str] | None = None) -> dict:
    """Acceptance by draft position with teacher forcing over the greedy `continuations` of `prompts`:
    every generated token with one after it is an anchor offered γ-1 drafts (`position_acceptance`'s
    records); tau_excl_prefill = 1 + their sum, the tokens per step a verify of every block would give.

    That average weighs every position alike, where decoding spends more steps (anchors) where drafts
    fail: it is not the τ a run shows. `walk` is: the steps greedy speculative decoding takes over the
    same continuations with these drafts (`num_drafts` offered per step, default γ-1), each next anchor
    one past the last accepted draft; its tau_excl_prefill is comparable with the run's (equal when the
    run's features are these), so a gap between the two is an alignment bug and not the averaging.

    `refined` has both figures again for each `refine` policy: every block drafted twice, the second pass
    given the first's leading drafts (`anchor_matches`). With `kinds` (one per prompt) each walk is also
    split by kind (`walk.by_kind`)."""
    gamma = drafter.cfg.block_size
    offered = gamma - 1 if num_drafts is None else min(num_drafts, gamma - 1)
    sequences = [list(p) + list(c) for p, c in zip(prompts, continuations)]
    device = target.embed_weight.device
    width = max(map(len, sequences))
    tokens = torch.tensor([s + [0] * (width - len(s)) for s in sequences], dtype=torch.long, device=device)
    lengths = torch.tensor([len(s) for s in sequences], device=device)
    rows = capture_features(target, tokens, lengths, CaptureSpec(layer_ids=drafter.cfg.target_layer_ids))

    if kinds is not None and len(kinds) != len(prompts):
        raise InvalidRequest("teacher_forced takes one kind per prompt")

    def walk(steps: int, tokens: int) -> dict:
        return {"steps": steps, "tokens": tokens, "tau_excl_prefill": tokens / steps if steps else 0.0}

    def figures(policy: RefinePolicy | None) -> dict:
        records, by_kind = [], {}
        for b, (prompt, seq) in enumerate(zip(prompts, sequences)):
            # matches[i]: the anchor at len(prompt) + i, the first one the token the prefill emitted
            matches = anchor_matches(drafter, head, rows[b], tokens[b], len(seq), range(len(prompt), len(seq) - 1),
                                     refine=policy)
            records += [(gamma - 1, m) for m in matches]
            tally = by_kind.setdefault(None if kinds is None else kinds[b], [0, 0])
            tally[0] += walk_steps(matches, offered)
            tally[1] += len(matches)
        accept = position_acceptance(records, gamma - 1)
        walked = walk(sum(t[0] for t in by_kind.values()), sum(t[1] for t in by_kind.values()))
        if kinds is not None:
            walked["by_kind"] = {kind: walk(*tally) for kind, tally in by_kind.items()}
        return {"anchors": len(records), "tau_excl_prefill": 1 + sum(accept), "position_acceptance": accept,
                "walk": walked}

    rep = figures(None)
    if refine:
        rep["refined"] = {str(policy): figures(policy) for policy in refine}
    return rep


# ---- the report ---------------------------------------------------------------------------------


def tau_figures(stats: Sequence[RequestStats]) -> dict:
    generated, steps = sum(s.generated for s in stats), sum(s.steps for s in stats)
    return {"requests": len(stats), "generated": generated, "steps": steps,
            "tau": generated / steps if steps else 0.0,
            "tau_excl_prefill": (generated - len(stats)) / (steps - len(stats)) if steps > len(stats) else 0.0,
            "drafted": sum(s.drafted for s in stats), "accepted": sum(s.accepted for s in stats)}


def tau_by_kind(stats: Sequence[RequestStats], prompts: Sequence[EvalPrompt]) -> dict:
    """`tau_figures` of each kind's requests, kinds in order."""
    return {k: tau_figures([s for s, p in zip(stats, prompts) if p.kind == k]) for k in sorted({p.kind for p in prompts})}


def position_acceptance(records: Sequence[tuple[int, int]], max_drafts: int) -> list[float]:
    """For j = 0..max_drafts-1: share of verified proposals whose first j+1 drafts were all accepted."""
    if not records:
        return [0.0] * max_drafts
    return [sum(accepted > j for _, accepted in records) / len(records) for j in range(max_drafts)]


def report(prompts: Sequence[EvalPrompt], spec: Run, base: Run, records: Sequence[tuple[int, int]],
           max_drafts: int, settings: EvalSettings, *, served: Run | None = None) -> dict:
    """τ and acceptance from `spec` (the recorded run); speed from `served`, the bare drafter's run (the
    engine's fast paths), when given, else from `spec`."""
    greedy = settings.temperature == 0.0
    overall = tau_figures(spec.stats)
    overall["acceptance_rate"] = overall["accepted"] / overall["drafted"] if overall["drafted"] else 0.0
    timed = served if served is not None else spec
    spec_tps, base_tps = timed.generated / timed.seconds, base.generated / base.seconds
    rep = {
        "prompts": len(prompts), "max_tokens": settings.max_tokens, "temperature": settings.temperature,
        "batch": settings.batch, "max_drafts": max_drafts, "draft_tree": settings.draft_tree, **overall,
        "proposals": len(records), "position_acceptance": position_acceptance(records, max_drafts),
        "by_kind": tau_by_kind(spec.stats, prompts),
        "tokens_per_s": {"speculative": spec_tps, "target_only": base_tps, "speedup": spec_tps / base_tps},
        "seconds": {"speculative": timed.seconds, "target_only": base.seconds},
        "decode": decode_speed(timed, base),
        "mismatches": sum(a != b for a, b in zip(spec.tokens, base.tokens)) if greedy else None,
    }
    if served is not None:
        rep["served"] = {"tau": tau_figures(served.stats)["tau"],
                         "mismatches": sum(a != b for a, b in zip(served.tokens, base.tokens)) if greedy else None,
                         # the recorded run's speed: the plain verbs, step by step
                         "recorded_tokens_per_s": spec.generated / spec.seconds,
                         # how its steps ran: engine steps, chained ones, replays of a captured chained step
                         # and captures, prefills and the host seconds in them (the target-only run's beside it)
                         "engine": served.engine, "target_only_engine": base.engine}
    return rep


def decode_speed(spec: Run, base: Run) -> dict | None:
    """Tokens/s of the decode steps alone, what a stream sees once its first token is out: each run's tokens
    after the first of each request over its seconds less the host seconds its prefills took (launching the
    prompts' forwards and reading their first tokens, which waits for the GPU). An approximation: that wait also
    holds whatever GPU work was queued before the prefill (a step launched ahead), left out with it. None where a
    run did not count its prefills."""
    def tps(run: Run) -> float | None:
        prefill_s = run.engine.get("prefill_s")
        if prefill_s is None or run.seconds <= prefill_s:
            return None
        return (run.generated - len(run.stats)) / (run.seconds - prefill_s)
    spec_tps, base_tps = tps(spec), tps(base)
    if spec_tps is None or not base_tps:
        return None
    return {"speculative": spec_tps, "target_only": base_tps, "speedup": spec_tps / base_tps}


def format_report(rep: dict) -> str:
    kinds = list(rep["by_kind"])
    cols = ["all"] + kinds
    figures = [rep] + [rep["by_kind"][k] for k in kinds]
    counts = ", ".join(f"{k} {rep['by_kind'][k]['requests']}" for k in kinds)
    lines = [(f"{rep['prompts']} prompts ({counts}), max_tokens {rep['max_tokens']}, "
              f"temperature {rep['temperature']}, batch {rep['batch']}, max drafts {rep['max_drafts']}"),
             f"{'':<22}" + "".join(f"{c:>10}" for c in cols)]
    for name, key, fmt in (("tau", "tau", "{:.3f}"), ("tau excl. prefill", "tau_excl_prefill", "{:.3f}"),
                           ("generated", "generated", "{}"), ("target steps", "steps", "{}"),
                           ("drafted", "drafted", "{}"), ("accepted", "accepted", "{}")):
        lines.append(f"{name:<22}" + "".join(f"{fmt.format(f[key]):>10}" for f in figures))
    lines.append(f"acceptance rate {rep['acceptance_rate']:.3f} over {rep['proposals']} proposals; by draft position:")
    lines.append("  " + "  ".join(f"{j + 1}:{a:.3f}" for j, a in enumerate(rep["position_acceptance"])))
    forced = rep.get("teacher_forced")
    if forced is not None:
        lines.append(f"teacher forced: tau excl. prefill {forced['tau_excl_prefill']:.3f} over {forced['anchors']} "
                     "anchors; by draft position:")
        lines.append("  " + "  ".join(f"{j + 1}:{a:.3f}" for j, a in enumerate(forced["position_acceptance"])))
        walk = forced["walk"]
        lines.append(f"teacher forced, decoding's walk (comparable with tau excl. prefill above): "
                     f"{walk['tau_excl_prefill']:.3f} over {walk['steps']} steps")
        for name, refined in [("", forced)] + list(forced.get("refined", {}).items()):
            by_kind = refined["walk"].get("by_kind", {})
            if name:
                lines.append(f"teacher forced, refined ({name} given): tau excl. prefill "
                             f"{refined['tau_excl_prefill']:.3f} over every anchor, "
                             f"{refined['walk']['tau_excl_prefill']:.3f} over decoding's walk")
                real = rep.get("refined_runs", {}).get(name)
                if real is not None:
                    lines.append(f"  decoded so: tau {real['tau']:.3f}, excl. prefill {real['tau_excl_prefill']:.3f} "
                                 f"(" + ", ".join(f"{k} {v['tau']:.3f}" for k, v in real["by_kind"].items())
                                 + f"); {real['mismatches']} mismatches")
            if by_kind:
                lines.append("  the walk by kind: " + ", ".join(f"{kind} {w['tau_excl_prefill']:.3f}"
                                                                for kind, w in by_kind.items()))
        tree = forced.get("tree_walk")
        if tree is not None:
            scored = {True: " (grown from the checkpoint's tree scores)", False: " (grown from the drafter's "
                      "log-probabilities)"}.get(rep.get("tree_scores"), "")
            lines.append(f"the steps above verified draft trees of {rep['draft_tree']} nodes{scored}; their "
                         f"teacher-forced walk: {tree['tau_excl_prefill']:.3f} over {tree['steps']} steps")
    tps = rep["tokens_per_s"]
    lines.append(f"tokens/s: speculative {tps['speculative']:.1f}, target-only {tps['target_only']:.1f}, "
                 f"speedup {tps['speedup']:.2f}x")
    decode = rep.get("decode")
    if decode is not None:
        lines.append(f"decode tokens/s (prefill forwards' host time and first tokens left out): speculative "
                     f"{decode['speculative']:.1f}, target-only {decode['target_only']:.1f}, "
                     f"speedup {decode['speedup']:.2f}x"
                     + (f" = {decode['speedup'] / rep['tau_excl_prefill']:.2f} tau" if rep["tau_excl_prefill"] else ""))
    served = rep.get("served")
    if served is not None:
        lines.append(f"  (speculative: the bare drafter's run, tau {served['tau']:.3f}; the recorded run's plain "
                     f"verbs {served['recorded_tokens_per_s']:.1f} tokens/s)")
        for name, seconds, run in (("speculative", rep["seconds"]["speculative"], served["engine"]),
                                   ("target-only", rep["seconds"]["target_only"], served["target_only_engine"])):
            if run:
                lines.append(f"  {name} engine: {run['steps']} steps ({run['chained']} chained, {run['replayed_whole']} "
                             f"replayed whole, {run['captures']} captures in {run['capture_s']:.3f} s), "
                             f"{run['prefills']} prefills in {run['prefill_s']:.3f} s of {seconds:.3f} s")
    mism = rep["mismatches"]
    lines.append("outputs vs target-only: not compared (sampling)" if mism is None
                 else f"outputs vs target-only: {mism} mismatches of {rep['prompts']}"
                 + ("" if served is None else f" (the bare drafter's run: {served['mismatches']})"))
    return "\n".join(lines)


# ---- the command ------------------------------------------------------------------------------


def run(*, target: str, drafter: str, prompts_path: str | Path, settings: EvalSettings, device: str,
        dtype: str | None, limit: int | None, seed: int = 0, tree_scores: bool = True) -> dict:
    """`specsplit eval-acceptance`: load the target, the drafter and the prompts; evaluate (draft trees from
    the scores the drafter's checkpoint ships unless not `tree_scores`)."""
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.local import LocalSetup, make_drafter, target_dir
    from specsplit.train_data import read_prompts
    from specsplit.target_service.model import load_target

    if drafter == "none":
        raise InvalidRequest("eval-acceptance needs a drafter: dflash, mtp or a checkpoint folder")
    setup = LocalSetup(target=target, drafter=drafter, device=device, dtype=dtype, seed=seed)
    folder = target_dir(target)
    model = load_target(folder, dtype=setup.torch_dtype, device=device)
    tokenizer = Tokenizer.from_dir(folder)
    prompts = [EvalPrompt(p.kind, p.encode(tokenizer)) for p in read_prompts(prompts_path, limit)]
    proposer = make_drafter(drafter, model, setup)
    if not tree_scores and getattr(proposer, "tree_scores", None) is not None:
        proposer.use_tree_scores(None)
    rep = evaluate(model, proposer, prompts, settings, eos_ids=tokenizer.eos_token_ids)
    rep["tree_scores"] = getattr(proposer, "tree_scores", None) is not None
    rep["drafter"] = drafter
    return rep


def dumps(rep: dict) -> str:
    return json.dumps(rep, sort_keys=True)
