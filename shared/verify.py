"""Lossless verification of drafted tokens against the target's logits, in pure torch.

The algorithm is speculative sampling from Leviathan et al., "Fast Inference from Transformers via
Speculative Decoding" (arXiv 2211.17192). Terms, defined once:

- draft tokens d_0..d_{k-1}: what the drafter proposed for one sequence; q_j is the draft
  distribution d_j was sampled from (one-hot on d_j for greedy drafters such as DFlash).
- target rows: the target scores [last token, d_0, .., d_{k-1}] in one forward, giving k+1 rows of
  logits. Row j is the target's distribution p_j for the token in draft slot j; row k follows the
  last draft. p_j = target_probs(row j, the request's SamplingParams).
- accepted tokens: the longest prefix of drafts that pass. Greedy: d_j == argmax(row j). Sampled:
  u_j < p_j(d_j) / q_j(d_j) with u_j uniform in [0, 1), i.e. accept with probability
  min(1, p_j(d_j) / q_j(d_j)). With one-hot q that is probability p_j(d_j).
- recovered token: at the first rejected slot j, a token sampled from the residual
  norm(max(0, p_j - q_j)) (greedy: argmax(row j)). With one-hot q the residual is p_j with d_j
  zeroed, so a recovered token never equals the draft it replaces.
- bonus token: when all k drafts are accepted, a token sampled from p_k (greedy: argmax(row k)).

Each step emits the accepted tokens followed by exactly one recovered-or-bonus token, and the
emitted tokens are distributed exactly as if the target had sampled them one at a time.

Random numbers: a sampled sequence with k drafts draws exactly k + 1 uniforms from its own
generator, in one `torch.rand(k + 1)`: u_0..u_{k-1} for the acceptance tests, u_k to pick the
emitted token by inverse CDF. The count depends on k alone, never on the outcome, so a request's
tokens do not depend on what else is in the batch and a batched kernel can reproduce them. Greedy
sequences draw nothing.

`verify_sampled` runs the batch vectorised; with `per_sequence=True` it runs the one-sequence-at-a-time
reference that the vectorised path is tested to equal token for token.

Batches are ragged and flat: sequence i owns target rows cu_rows[i]:cu_rows[i+1] and has
cu_rows[i+1] - cu_rows[i] - 1 drafts (k = 0 is allowed: just sample one token).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specsplit.shared.errors import InvalidRequest
from specsplit.shared.sampling import SamplingParams, check_generator_device, inverse_cdf, target_probs

PLACEHOLDER_TOKEN_ID = -1  # pads the batched greedy output past each sequence's emitted tokens


@dataclass
class VerifyResult:
    """What one verify step emits per sequence."""

    num_accepted: list[int]  # [num_seqs] drafts accepted per sequence
    tokens: list[list[int]]  # [num_seqs] accepted drafts, then one recovered-or-bonus token

    @staticmethod
    def from_tokens(tokens: list[list[int]]) -> VerifyResult:
        return VerifyResult(num_accepted=[len(t) - 1 for t in tokens], tokens=tokens)


def verify_greedy(
    draft_tokens: Sequence[Sequence[int]],
    target_logits: torch.Tensor,  # [sum(k_i + 1), V]
    cu_rows: torch.Tensor,  # [num_seqs + 1]
) -> VerifyResult:
    """Accept drafts while they equal the target's argmax, then emit the argmax of the next row."""
    bounds = _row_bounds(draft_tokens, target_logits, cu_rows)
    argmax = target_logits.argmax(dim=-1).tolist()  # [num_rows]
    tokens = [_greedy_tokens(list(d), argmax[start:end]) for d, (start, end) in zip(draft_tokens, bounds)]
    return VerifyResult.from_tokens(tokens)


def verify_sampled(
    draft_tokens: Sequence[Sequence[int]],
    target_logits: torch.Tensor,  # [sum(k_i + 1), V]
    cu_rows: torch.Tensor,  # [num_seqs + 1]
    params: Sequence[SamplingParams] | SamplingParams,
    generators: Sequence[torch.Generator],  # [num_seqs], one per request
    draft_probs: Sequence[torch.Tensor | None] | None = None,  # [num_seqs] of [k_i, V] or None (one-hot)
    *,
    per_sequence: bool = False,
    target_argmax: Sequence[int] | None = None,  # argmax of every logits row, when the caller has it already
) -> VerifyResult:
    """Speculative sampling for the batch; greedy requests use greedy acceptance.

    Sampled sequences run vectorised, with one host synchronisation for the batch. `per_sequence`
    runs the reference instead, one sequence at a time as the module docstring states the
    algorithm; both draw the same uniforms from the same generators and emit the same tokens.
    """
    bounds, params, draft_probs = _checked_batch(draft_tokens, target_logits, cu_rows, params, generators,
                                                 draft_probs)
    tokens: list[list[int]] = [[] for _ in bounds]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        argmax = target_logits.argmax(dim=-1).tolist() if target_argmax is None else list(target_argmax)
        if len(argmax) != target_logits.shape[0]:
            raise InvalidRequest(f"{len(argmax)} argmax values for {target_logits.shape[0]} logits rows")
        for i in greedy:
            start, end = bounds[i]
            tokens[i] = _greedy_tokens(list(draft_tokens[i]), argmax[start:end])
    sampled = [_Sampled(list(draft_tokens[i]), bounds[i], params[i], generators[i], draft_probs[i])
               for i, p in enumerate(params) if not p.greedy]
    if per_sequence:
        picked = [_sampled_tokens(s.drafts, target_logits[s.rows[0]:s.rows[1]], s.params, s.generator, s.draft_probs)
                  for s in sampled]
    else:
        picked = _sample_batch(sampled, target_logits) if sampled else []
    for i, emitted in zip([i for i, p in enumerate(params) if not p.greedy], picked):
        tokens[i] = emitted
    return VerifyResult.from_tokens(tokens)


def sample_tokens(logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator]) -> torch.Tensor:
    """[S] int64 on the device, nothing read back: for sequence i a token sampled from logits row
    rows[i] with params[i], exactly what `verify_sampled` emits for it with no drafts (the same
    probabilities, one uniform drawn from its generator, the same inverse CDF)."""
    seqs = [_Sampled([], (r, r + 1), p, g, None) for r, p, g in zip(rows, params, generators)]
    count = len(seqs)
    p = _compacted_probs(seqs, logits, [1] * count, list(range(count)))
    for s in seqs:
        check_generator_device(s.generator, p.device)
    return inverse_cdf(p, torch.cat([torch.rand(1, generator=s.generator, device=p.device) for s in seqs]))


def sample_accept(drafts: torch.Tensor, logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator], counts: Sequence[int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling on the device, nothing read back, for S sequences of one-hot drafts: drafts
    [S, k], their target rows logits [S, k + 1, V], and how many of its drafts each sequence offers
    (`counts`, each 0..k; all k by default) → (drafts accepted [S], the token emitted after them [S]).
    Exactly what `verify_sampled` emits for sequence i's first counts[i] drafts and their rows without
    draft_probs: the same probabilities, the same counts[i] + 1 uniforms from its generator, the same
    tests and inverse CDF. Rows past a sequence's count are not read."""
    count, k = drafts.shape
    counts = [k] * count if counts is None else list(counts)
    if logits.dim() != 3 or logits.shape[:2] != (count, k + 1) \
            or not len(params) == count == len(generators) == len(counts) or not all(0 <= n <= k for n in counts):
        raise InvalidRequest(f"sample_accept takes drafts [S, k] and logits [S, k + 1, V], one params, generator "
                             f"and count in 0..k per sequence; got {tuple(drafts.shape)}, {tuple(logits.shape)}")
    device, vocab = logits.device, logits.shape[-1]
    groups: dict[tuple, list[int]] = {}
    for i, params_i in enumerate(params):
        groups.setdefault((params_i.temperature, params_i.top_k, params_i.top_p), []).append(i)
    if len(groups) > 1:
        p = torch.empty((count, k + 1, vocab), dtype=torch.float32, device=device)
    for members in groups.values():
        index = _longs(members, device) if len(members) < count else None
        rows = logits if index is None else logits.index_select(0, index)
        probs = target_probs(rows.reshape(-1, vocab), params[members[0]]).view(len(members), k + 1, vocab)
        if index is None:
            p = probs
        else:
            p.index_copy_(0, index, probs)
    for g in generators:
        check_generator_device(g, device)
    # [S, k + 1]: sequence i's counts[i] + 1 uniforms, then padding
    uniforms = torch.stack([torch.rand(n + 1, generator=g, device=device) if n == k else
                            torch.cat([torch.rand(n + 1, generator=g, device=device), torch.zeros(k - n, device=device)])
                            for g, n in zip(generators, counts)])
    offered = _longs(counts, device) if any(n < k for n in counts) else None
    passed = uniforms[:, :k] < p[:, :k].gather(2, drafts[..., None]).squeeze(-1)  # u < p / q, q one-hot
    if offered is not None:
        passed &= torch.arange(k, device=device) < offered[:, None]
    accepted = passed.long().cumprod(dim=1).sum(dim=1)  # [S]
    p_emit = p.gather(1, accepted[:, None, None].expand(-1, 1, vocab)).squeeze(1)  # [S, V]
    q_emit = torch.zeros_like(p_emit)  # one-hot on the first rejected draft; zero when all passed (bonus)
    if k:
        rejected = accepted < (k if offered is None else offered)
        q_emit.scatter_(1, drafts.gather(1, accepted.clamp(max=k - 1)[:, None]), rejected.float()[:, None])
    residual = (p_emit - q_emit).clamp(min=0)
    weights = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_emit)
    last = uniforms[:, k] if offered is None else uniforms.gather(1, offered[:, None]).squeeze(1)
    return accepted, inverse_cdf(weights, last)


def _checked_batch(draft_tokens, target_logits, cu_rows, params, generators, draft_probs):
    bounds = _row_bounds(draft_tokens, target_logits, cu_rows)
    num_seqs = len(bounds)
    params = [params] * num_seqs if isinstance(params, SamplingParams) else list(params)
    draft_probs = [None] * num_seqs if draft_probs is None else list(draft_probs)
    if len(params) != num_seqs or len(generators) != num_seqs or len(draft_probs) != num_seqs:
        raise InvalidRequest(
            f"need one params, generator and draft_probs entry per sequence ({num_seqs}), "
            f"got {len(params)}, {len(generators)}, {len(draft_probs)}"
        )
    return bounds, params, draft_probs


@dataclass(frozen=True)
class _Sampled:
    """One sampled sequence of the batch."""

    drafts: list[int]
    rows: tuple[int, int]  # [start, end) of its target rows
    params: SamplingParams
    generator: torch.Generator
    draft_probs: torch.Tensor | None  # [k, V], or None for one-hot drafts


def _sample_batch(seqs: list[_Sampled], logits: torch.Tensor) -> list[list[int]]:
    """Vectorised `_sampled_tokens` over sequences (rows compacted to the sampled ones, in order)."""
    counts = [len(s.drafts) + 1 for s in seqs]
    firsts = list(itertools.accumulate([0] + counts[:-1]))  # each sequence's first compacted row
    p = _compacted_probs(seqs, logits, counts, firsts)  # [R, V]
    device, vocab = p.device, p.shape[-1]
    for s in seqs:
        check_generator_device(s.generator, device)
    uniforms = torch.cat([torch.rand(n, generator=s.generator, device=device) for s, n in zip(seqs, counts)])
    draft_rows = _longs([f + j for f, s in zip(firsts, seqs) for j in range(len(s.drafts))], device)  # [D]
    drafts = _longs([d for s in seqs for d in s.drafts], device)  # [D]
    q_draft = _draft_prob_at_drafts(seqs, device, vocab)  # [D]
    p_draft = p[draft_rows, drafts]
    passed = uniforms[draft_rows] * q_draft < p_draft  # u < p/q without dividing by a tiny q
    num_drafts = _longs([n - 1 for n in counts], device)  # [S]
    owner = _longs([i for i, n in enumerate(counts) for _ in range(n - 1)], device)  # [D]
    slot = draft_rows - _longs([f for f, n in zip(firsts, counts) for _ in range(n - 1)], device)
    misses = torch.where(passed, max(counts), slot)
    accepted = num_drafts.scatter_reduce(0, owner, misses, "amin")  # [S] leading drafts that passed
    first_rows = _longs(firsts, device)  # [S]
    emit_rows = first_rows + accepted
    q_emit = _draft_row_at(seqs, accepted, num_drafts, device, vocab)  # [S, V], zero where all passed (bonus)
    p_emit = p[emit_rows]
    residual = (p_emit - q_emit).clamp(min=0)
    # Positive in exact arithmetic whenever a rejection is possible; float rounding can cancel it.
    weights = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_emit)
    token = inverse_cdf(weights, uniforms[first_rows + num_drafts])  # u_k picks the token
    impossible = (q_draft <= 0).any().long() if len(drafts) else torch.zeros((), dtype=torch.long, device=device)
    result = torch.cat([accepted, token, impossible[None]]).tolist()
    if result[-1]:
        raise InvalidRequest("a draft token has zero draft probability; it cannot have been sampled from q")
    num = len(seqs)
    return [s.drafts[:a] + [t] for s, a, t in zip(seqs, result[:num], result[num:2 * num])]


def _compacted_probs(seqs: list[_Sampled], logits: torch.Tensor, counts: list[int], firsts: list[int]) -> torch.Tensor:
    """target_probs of every sampled row, one call per distinct (temperature, top-k, top-p).

    On a CPU the rows go through in cache-sized chunks: target_probs makes several passes over its
    input, and [R, V] for a large vocabulary falls out of cache long before it is done.
    """
    source = [r for s in seqs for r in range(*s.rows)]
    device, vocab = logits.device, logits.shape[-1]
    chunk = max(1, (1 << 19) // vocab) if device.type == "cpu" else len(source)
    p = torch.empty((len(source), vocab), dtype=torch.float32, device=device)
    for members in _by_sampling(seqs).values():
        rows = [firsts[m] + j for m in members for j in range(counts[m])]
        for at in range(0, len(rows), chunk):
            part = rows[at:at + chunk]
            picked = _rows_of(logits, [source[r] for r in part])
            probs = target_probs(picked, seqs[members[0]].params)
            if part == list(range(part[0], part[0] + len(part))):
                p[part[0]:part[0] + len(part)] = probs
            else:
                p[_longs(part, device)] = probs
    return p


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]: a view when the rows are consecutive (the usual case), else a gather."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0]:rows[0] + len(rows)]
    return logits[_longs(rows, logits.device)]


def _by_sampling(seqs: list[_Sampled]) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(seqs):
        groups.setdefault((s.params.temperature, s.params.top_k, s.params.top_p), []).append(i)
    return groups


def _draft_prob_at_drafts(seqs: list[_Sampled], device: torch.device, vocab: int) -> torch.Tensor:
    """q_j(d_j) for every draft: 1 for one-hot drafts, else read from the sequence's draft_probs."""
    parts = []
    for s in seqs:
        k = len(s.drafts)
        if s.draft_probs is None:
            parts.append(torch.ones(k, device=device))
        else:
            ids = _longs(s.drafts, device)
            q = _draft_distribution(ids, s.draft_probs, vocab)  # validates the shape: [k, V]
            parts.append(q[torch.arange(k, device=device), ids])
    return torch.cat(parts) if parts else torch.ones(0, device=device)


def _draft_row_at(seqs: list[_Sampled], accepted: torch.Tensor, num_drafts: torch.Tensor, device: torch.device,
                  vocab: int) -> torch.Tensor:
    """[S, V]: each sequence's draft distribution at its first rejected slot; zeros where none was."""
    widest = max(len(s.drafts) for s in seqs)
    padded = _longs([s.drafts + [0] * (widest - len(s.drafts)) for s in seqs], device).view(len(seqs), widest)
    slot = torch.minimum(accepted, (num_drafts - 1).clamp(min=0))  # [S]
    rejected = (accepted < num_drafts).float()  # [S]; all passed (or k = 0): the bonus row, q = 0
    q = torch.zeros((len(seqs), vocab), dtype=torch.float32, device=device)
    if widest:  # one-hot drafts: q is 1 on the rejected draft
        q.scatter_(1, padded.gather(1, slot[:, None]), rejected[:, None])
    for i, s in enumerate(seqs):  # drafters that ship their distributions (rare): that row, no host sync
        if s.draft_probs is not None and s.drafts:
            row = s.draft_probs.to(device=device, dtype=torch.float32).index_select(0, slot[i:i + 1])[0]
            q[i] = row * rejected[i]
    return q


def _longs(values: list, device: torch.device) -> torch.Tensor:
    return device_longs(values, device)


def device_longs(values: list, device: torch.device | str) -> torch.Tensor:
    """An int64 tensor of `values` on `device`, copied from pinned memory on a GPU: a copy from pageable
    memory may wait for the work already queued on the stream, which a step launched ahead must not."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _greedy_tokens(drafts: list[int], row_argmax: list[int]) -> list[int]:
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == row_argmax[accepted]:
        accepted += 1
    # Accepted drafts equal their rows' argmax, so the output is simply the first accepted+1 argmaxes.
    return row_argmax[: accepted + 1]


def _sampled_tokens(
    drafts: list[int],
    logits: torch.Tensor,  # [k + 1, V]
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None,  # [k, V] or None
) -> list[int]:
    k = len(drafts)
    p = target_probs(logits, params)  # [k + 1, V]
    check_generator_device(generator, p.device)
    uniforms = torch.rand(k + 1, generator=generator, device=p.device)  # [k + 1]
    ids = torch.tensor(drafts, dtype=torch.long, device=p.device)  # [k]
    q = _draft_distribution(ids, draft_probs, p.shape[-1])  # [k, V]
    accepted = _num_accepted(ids, p[:k], q, uniforms[:k])
    emit_from = p[k] if accepted == k else _residual(p[accepted], q[accepted])  # [V]
    token = int(inverse_cdf(emit_from[None], uniforms[k:]).item())
    return drafts[:accepted] + [token]


def _draft_distribution(ids: torch.Tensor, draft_probs: torch.Tensor | None, vocab: int) -> torch.Tensor:
    if draft_probs is None:  # greedy drafter: all its mass sits on the draft token
        return torch.nn.functional.one_hot(ids, vocab).float()
    if draft_probs.shape != (ids.numel(), vocab) or not draft_probs.is_floating_point():
        raise InvalidRequest(
            f"draft_probs must be a floating [{ids.numel()}, {vocab}] tensor, got "
            f"{tuple(draft_probs.shape)} {draft_probs.dtype}"
        )
    return draft_probs.to(device=ids.device, dtype=torch.float32)


def _num_accepted(
    ids: torch.Tensor,  # [k]
    p: torch.Tensor,  # [k, V]
    q: torch.Tensor,  # [k, V]
    uniforms: torch.Tensor,  # [k]
) -> int:
    p_draft = p.gather(1, ids[:, None]).squeeze(1)  # [k]
    q_draft = q.gather(1, ids[:, None]).squeeze(1)  # [k]
    passed = uniforms * q_draft < p_draft  # u < p/q without dividing by a tiny q
    leading = passed.long().cumprod(dim=0).sum()
    impossible, accepted = torch.stack([(q_draft <= 0).any().long(), leading]).tolist()
    if impossible:
        raise InvalidRequest("a draft token has zero draft probability; it cannot have been sampled from q")
    return accepted


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)), left unnormalised: inverse_cdf scales by the row's mass."""
    residual = (p - q).clamp(min=0)  # [V]
    # Positive in exact arithmetic whenever a rejection is possible; float rounding can cancel it.
    return torch.where(residual.sum() > 0, residual, p)


def verify_greedy_batched(
    draft_ids: torch.Tensor,  # [sum(k_i)] int, sequence i's drafts at cu_rows[i]-i : cu_rows[i+1]-i-1
    target_logits: torch.Tensor,  # [sum(k_i + 1), V]
    cu_rows: torch.Tensor,  # [num_seqs + 1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised `verify_greedy` on device → (num_accepted [num_seqs], tokens [num_seqs, max_k + 1]).

    Row i of tokens holds its num_accepted[i] + 1 emitted tokens, then PLACEHOLDER_TOKEN_ID.
    """
    shapes_ok = target_logits.dim() == 2 and cu_rows.dim() == 1 and cu_rows.numel() >= 1 and draft_ids.dim() == 1
    ints_ok = not cu_rows.is_floating_point() and not draft_ids.is_floating_point()
    if not shapes_ok or not ints_ok or not target_logits.is_floating_point():
        raise InvalidRequest("need floating target_logits [rows, V], integer cu_rows [num_seqs + 1] and draft_ids")
    num_rows, vocab = target_logits.shape
    num_seqs = cu_rows.numel() - 1
    if num_seqs == 0 or draft_ids.numel() != num_rows - num_seqs:
        raise InvalidRequest(f"{num_seqs} sequences over {num_rows} rows need {num_rows - num_seqs} drafts")
    device = target_logits.device
    cu_rows = cu_rows.to(device=device, dtype=torch.long)
    counts = cu_rows.diff()  # [num_seqs] k_i + 1
    bad = (counts < 1).any() | (cu_rows[0] != 0) | (cu_rows[-1] != num_rows)
    bad = bad | ((draft_ids < 0) | (draft_ids >= vocab)).any()
    max_rows, bad = torch.stack([counts.max(), bad.long()]).tolist()
    if bad:
        raise InvalidRequest("cu_rows must rise from 0 to the row count by >= 1, drafts must be < vocab")
    rows = torch.arange(num_rows, device=device)
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), counts, output_size=num_rows)
    slot = rows - cu_rows[seq]  # [num_rows] draft slot j judged by this row; k for the bonus row
    # Row r of sequence i judges draft r - i; the padding stands in for bonus rows, which judge nothing.
    padding = torch.full((1,), -1, dtype=torch.long, device=device)
    padded = torch.cat([draft_ids.to(device=device, dtype=torch.long), padding])  # [sum(k_i) + 1]
    judged = torch.where(slot == counts[seq] - 1, -1, padded[rows - seq])  # [num_rows]
    argmax = target_logits.argmax(dim=-1)  # [num_rows]
    first_miss = torch.where(judged != argmax, slot, num_rows)  # bonus rows always "miss"
    num_accepted = torch.full((num_seqs,), num_rows, device=device).scatter_reduce(0, seq, first_miss, "amin")
    emitted = torch.where(slot <= num_accepted[seq], argmax, PLACEHOLDER_TOKEN_ID)
    tokens = torch.full((num_seqs, max_rows), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    tokens[seq, slot] = emitted
    return num_accepted, tokens


def _row_bounds(
    draft_tokens: Sequence[Sequence[int]], target_logits: torch.Tensor, cu_rows: torch.Tensor
) -> list[tuple[int, int]]:
    """Validate the ragged batch and return each sequence's [start, end) target rows."""
    if target_logits.dim() != 2 or not target_logits.is_floating_point():
        raise InvalidRequest(f"target_logits must be floating [rows, V], got {tuple(target_logits.shape)}")
    if cu_rows.dim() != 1 or cu_rows.is_floating_point() or cu_rows.numel() != len(draft_tokens) + 1:
        raise InvalidRequest(f"cu_rows must be an integer [num_seqs + 1] = [{len(draft_tokens) + 1}] tensor")
    cu = cu_rows.tolist()
    num_rows, vocab = target_logits.shape
    if cu[0] != 0 or cu[-1] != num_rows:
        raise InvalidRequest(f"cu_rows must run from 0 to the {num_rows} target rows, got {cu}")
    for i, drafts in enumerate(draft_tokens):
        if cu[i + 1] - cu[i] != len(drafts) + 1:
            raise InvalidRequest(f"sequence {i} has {len(drafts)} drafts but {cu[i + 1] - cu[i]} target rows")
        if any(not 0 <= t < vocab for t in drafts):
            raise InvalidRequest(f"sequence {i} has a draft token outside [0, {vocab})")
    return list(itertools.pairwise(cu))
