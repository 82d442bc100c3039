"""Draft-tree scores: a DFlash block row's candidates scored by how often such a token is the target's.

A draft tree keeps the rank paths of highest summed score (`shared.tree.best_first`), which maximises the
tokens a step accepts when a node's score is the log-probability that the target takes it, given that it takes
its ancestors. The drafter's own log-probabilities are not that. Its γ-1 rows are drafted in one parallel pass,
and they are under-sure of their runners-up in a way that depends on the row: over the target's greedy
continuations, the true token's chance grows about as p^1.6-2.2 with the drafter's p, and by a row's depth.

`TreeScores` maps row j's candidates' log-probabilities `lp` to log σ(a_j + b_j·lp + c_j·lp₀), lp₀ being the
row's best. It is a per-row logistic calibration fitted on training-side continuations (`fit`). With b_j > 0 it
keeps each row's order, so the candidates stay best first. Every score is below 0, so no node outscores its
parent, and the chain (each row's best) is unchanged. Only which runners-up a tree keeps changes. The drafter
applies it to the candidates it answers (in-process and through the service alike), so the target grows its
trees from these scores with no change of its own. The parameters ship beside the weights as `tree_scores.json`,
a file z-lab's loader ignores.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specsplit.kernels.top_k import scored
from specsplit.shared.errors import CheckpointError

SCORES_FILE = "tree_scores.json"
FORMAT = "specsplit-tree-scores/1"
PAST_END = -2  # a fit's rank for a row past its continuation's end (-1: the target's token not among the K)
BOUND = 1e4  # every parameter's magnitude at most (b at least 1 / BOUND): finite scores in float32


@dataclass(frozen=True)
class TreeScores:
    a: tuple[float, ...]  # per block row (row 0 the anchor's next token): the offset
    b: tuple[float, ...]  # ... the weight of the candidate's log-probability (> 0: order kept)
    c: tuple[float, ...]  # ... the weight of the row's best log-probability
    fit: dict | None = field(default=None, compare=False)  # what it was fitted on (prompts, anchors, keep): a record

    def __post_init__(self) -> None:
        rows = len(self.a)
        if rows < 1 or len(self.b) != rows or len(self.c) != rows:
            raise CheckpointError(f"tree scores need a, b and c for each of one or more rows, got "
                                  f"{len(self.a)}, {len(self.b)} and {len(self.c)}")
        for name, values in (("a", self.a), ("b", self.b), ("c", self.c)):
            if not all(isinstance(v, float) and math.isfinite(v) and abs(v) <= BOUND for v in values):
                raise CheckpointError(f"tree scores' {name} must be finite numbers within ±{BOUND:g}")
        if min(self.b) < 1 / BOUND:
            raise CheckpointError(f"tree scores' b must be at least {1 / BOUND:g} (a row's candidates keep their "
                                  f"order)")

    @property
    def rows(self) -> int:
        return len(self.a)

    def on(self, device: torch.device | str) -> torch.Tensor:
        """The parameters [3, rows] (a, b, c) on `device`: made once, before any graph captures `apply`."""
        return torch.tensor([self.a, self.b, self.c], dtype=torch.float32, device=device)

    def apply(self, logp: torch.Tensor, params: torch.Tensor | None = None) -> torch.Tensor:
        """Candidates' scores from their log-probabilities [..., R, K], each row's best first (R ≤ rows); `params`
        this object's `on(logp.device)`, where the caller holds them."""
        rows = logp.shape[-2]
        if rows > self.rows:
            raise CheckpointError(f"tree scores for {self.rows} rows, asked for {rows}")
        return scored(logp, self.on(logp.device) if params is None else params)

    def to_json(self) -> dict:
        return {"format": FORMAT, "a": list(self.a), "b": list(self.b), "c": list(self.c), "fit": self.fit}

    @staticmethod
    def from_json(raw: object, where: str = SCORES_FILE) -> TreeScores:
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not {FORMAT} (a JSON object whose format says so)")
        values = []
        for name in "abc":
            got = raw.get(name)
            if not isinstance(got, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                    for v in got):
                raise CheckpointError(f"{where}: {name} must be a list of numbers")
            try:
                values.append(tuple(float(v) for v in got))
            except OverflowError:
                raise CheckpointError(f"{where}: {name} holds a number past a float's range") from None
        fit = raw.get("fit")
        if fit is not None and not isinstance(fit, dict):
            raise CheckpointError(f"{where}: fit must be an object")
        try:
            return TreeScores(*values, fit=fit)
        except CheckpointError as exc:
            raise CheckpointError(f"{where}: {exc}") from None

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / SCORES_FILE
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def read_tree_scores(folder: str | Path, rows: int) -> TreeScores | None:
    """The checkpoint's tree scores for a block of `rows` draft rows, or None where it ships none."""
    path = Path(folder) / SCORES_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    scores = TreeScores.from_json(raw, str(path))
    if scores.rows != rows:
        raise CheckpointError(f"{path}: scores for {scores.rows} rows, the drafter drafts {rows}")
    return scores


def fit(logp: torch.Tensor, ranks: torch.Tensor, *, iterations: int = 200) -> TreeScores:
    """The scores' logistic fit over anchors' candidates: logp [N, R, K] each row's best first, ranks [N, R] the
    target's token's rank in each row (-1: not among the K). A row is an example where the target's tokens took
    every row before it among the candidates (a tree could have reached it), each of its K candidates labelled
    with whether it is the target's (PAST_END: a row past the continuation's end, left out); the loss is their
    mean binary cross-entropy. Deterministic on the CPU."""
    n, rows, width = logp.shape
    if ranks.shape != (n, rows) or n < 1:
        raise ValueError(f"fit takes logp [N, R, K] and ranks [N, R], got {tuple(logp.shape)}, {tuple(ranks.shape)}")
    hit = (ranks >= 0) & (ranks < width)
    reached = torch.cat([torch.ones(n, 1, dtype=torch.bool), hit[:, :-1].cumprod(1).bool()], 1)  # [N, R]
    reached &= ranks != PAST_END  # (a row past the continuation's end has no token to miss)
    label = F.one_hot(ranks.clamp(0, width - 1), width).float() * hit[..., None]
    lp = logp.float().clamp(min=-30.0)  # (a candidate past the drafter's vocabulary mask weighs nothing)
    weight = reached[..., None].float().expand(-1, -1, width)
    a = torch.zeros(rows, requires_grad=True)
    log_b = torch.zeros(rows, requires_grad=True)  # b = exp(log_b) stays above 0
    c = torch.zeros(rows, requires_grad=True)
    opt = torch.optim.LBFGS([a, log_b, c], max_iter=iterations, line_search_fn="strong_wolfe")

    def loss_fn() -> torch.Tensor:
        opt.zero_grad()
        z = a[:, None] + log_b.exp()[:, None] * lp + c[:, None] * lp[..., :1]
        loss = F.binary_cross_entropy_with_logits(z, label, weight=weight, reduction="sum") / weight.sum()
        # a faint pull toward the log-probabilities themselves (a = c = 0, b = 1), for rows few anchors reach
        loss = loss + 1e-4 * (a.square().sum() + log_b.square().sum() + c.square().sum())
        loss.backward()
        return loss

    opt.step(loss_fn)
    return TreeScores(tuple(a.tolist()), tuple(log_b.exp().tolist()), tuple(c.tolist()),
                      fit={"anchors": n, "rows": rows, "keep": width})

