"""Train a DFlash or MTP drafter online against its frozen target, on the target's own continuations.

Recipe: (0) the target writes questions of its own from the chat prefix of a user turn
(`self_prompts`), which join the offline prompts; (1) the target continues training prompts in large
dense batches (greedy, plus a share sampled at a temperature) and the finished sequences are run
through it once more to capture the drafter's feature rows and the target's own final-normed last
hidden rows (its next-token distribution, for distillation), building a pool on the device; (2)
epochs over the pool, each batch with fresh random anchors, loss = ce_weight·CE on the target's
tokens + kl_weight·KL(target ‖ drafter) at temperature 1, AdamW with warmup and a cosine decay over
the whole training time, bf16 autocast on CUDA over float32 master weights, gradients clipped; (3)
the drafter is saved in bfloat16 in the loader's format, in shards of at most 16 MiB.

Terms: γ is the DFlash block size; an anchor is the committed token a block starts from (inference
calls it the bonus token); the loss weight of a block's draft k is exp(-(k-1)/w) (w = `loss_decay`).
"""

from __future__ import annotations

import copy
import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from specsplit.drafter_service.base import DraftVocab
from specsplit.drafter_service.checkpoint import DrafterModel, load_model, random_model, save_dflash, save_mtp
from specsplit.drafter_service.dflash import DFlashModel, RefinePolicy, build_target_layer_ids
from specsplit.drafter_service.heads import TargetHead, TargetInfo
from specsplit.drafter_service.mtp import MTPModel
from specsplit.drafter_service.training import dflash_block_hidden, mtp_step_outputs
from specsplit.shared.errors import CapacityExceeded, InvalidRequest, StateConflict
from specsplit.shared.layers import head_logits
from specsplit.target_service.dense import DenseDecoder, Generated, generate
from specsplit.target_service.model import CaptureSpec, TargetModel
from specsplit.train_data import KINDS as PROMPT_KINDS

MAX_FILE_BYTES = 16 * 1024 * 1024  # what one file back from the GPU host may weigh (its device tool)
MAX_SAMPLED = 4.0  # sampled continuations a prompt may get (--sampled-by-kind)
Log = Callable[[str], None]


@dataclass(frozen=True)
class TrainConfig:
    kind: str = "dflash"  # dflash | mtp
    layers: int | None = None  # DFlash decoder layers (MTP has one); None: 2, or --init's
    block_size: int = 16  # γ
    target_layers: tuple[int, ...] | None = None  # DFlash feature layers of the target; None: see below
    num_target_layers: int | None = None  # that many spread over depth (z-lab's rule); None: one per layer
    batch: int = 32  # sequences per optimizer step
    anchors: int = 32  # DFlash blocks per sequence per step
    mtp_steps: int = 3  # MTP chained steps trained (teacher-forced)
    seq_len: int = 256  # tokens the target generates per prompt
    max_prompt_tokens: int = 192
    gen_batch: int = 1024  # sequences generated together (decode is launch-bound: wide batches are cheap)
    gen_graphs: bool = True  # on CUDA, decode steps replay captured graphs (False: eager, for diagnosis)
    sampled_fraction: float = 0.25  # prompts that also get a sampled continuation
    # Sampled continuations per prompt of a kind, where given (in place of sampled_fraction): ((kind, n), ...)
    sampled_by_kind: tuple[tuple[str, float], ...] = ()
    temperature: float = 0.7
    self_prompts: int = 16384  # rows the target samples questions in (about 3 in 4 survive the filters)
    ce_weight: float = 0.2  # CE on the target's token
    kl_weight: float = 1.0  # KL(target ‖ drafter) on the target's distribution, temperature 1
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup: float = 0.04  # share of training spent warming up
    weight_decay: float = 0.01
    loss_decay: float | None = None  # w; None: 1 + 3γ/8 for DFlash (7 at γ=16), 2 for MTP
    # DFlash: the share of each row's anchors moved one step of decoding's walk, from a random anchor a to
    # a + m + 1 past the m drafts its block gets right (`walk_anchors`): where decoding's next step starts
    walk_share: float = 0.0
    walk_steps: int = 1  # steps of the walk each of those anchors takes (a scoring forward each)
    # DFlash: the share of blocks trained as a refining pass's (`drafter_service.training`'s reveal): rows
    # 1..r hold the true tokens x_{a+1..a+r}, r drawn uniformly from 1..reveal_max, and only rows past r are
    # scored. Decoding may then draft a block twice, the second pass given the first's leading drafts.
    reveal_share: float = 0.0
    reveal_max: int = 4
    steps: int | None = None
    minutes: float | None = None  # wall-time bound for everything, generation included
    gen_fraction: float = 0.35  # of `minutes`, the most spent generating
    pool_gb: float = 48.0  # device memory for the feature pool
    # The run in this many rounds, each generating a fresh pool (from prompts not yet used) and training on
    # it: more distinct data in a run whose pool fills the GPU long before the prompts run out.
    pool_rounds: int = 1
    seed: int = 0
    log_every: int = 50

    def __post_init__(self) -> None:
        if self.kind not in ("dflash", "mtp"):
            raise InvalidRequest(f"--kind must be dflash or mtp, got {self.kind!r}")
        if self.steps is None and self.minutes is None:
            raise InvalidRequest("give --steps, --minutes or both")
        if self.layers is not None and self.layers < 1:
            raise InvalidRequest("layers must be ≥ 1")
        for name in ("batch", "anchors", "mtp_steps", "seq_len", "max_prompt_tokens", "gen_batch",
                     "log_every", "pool_rounds", "walk_steps"):
            if getattr(self, name) < 1:
                raise InvalidRequest(f"{name} must be ≥ 1")
        if self.block_size < 2:
            raise InvalidRequest("block size must be ≥ 2")
        if (self.steps is not None and self.steps < 1) or (self.minutes is not None and self.minutes <= 0):
            raise InvalidRequest("--steps and --minutes must be positive")
        if not (0 <= self.sampled_fraction <= 1 and 0 < self.gen_fraction < 1 and 0 <= self.warmup < 1):
            raise InvalidRequest("sampled_fraction must lie in [0, 1], gen_fraction in (0, 1), warmup in [0, 1)")
        if not 0 <= self.walk_share <= 1:
            raise InvalidRequest(f"walk_share must lie in [0, 1], got {self.walk_share}")
        if self.walk_share > 0 and self.kind != "dflash":
            raise InvalidRequest("walk_share moves DFlash anchors; MTP trains at every index")
        if not 0 <= self.reveal_share <= 1:
            raise InvalidRequest(f"reveal_share must lie in [0, 1], got {self.reveal_share}")
        if self.reveal_share > 0 and (self.kind != "dflash" or not 1 <= self.reveal_max <= self.block_size - 2):
            raise InvalidRequest(f"reveal_share trains DFlash blocks with 1..reveal_max of their γ-1 drafts given: "
                                 f"reveal_max must lie in 1..{self.block_size - 2}, got {self.reveal_max}")
        kinds = [kind for kind, _ in self.sampled_by_kind]
        if len(set(kinds)) != len(kinds) or any(kind not in PROMPT_KINDS for kind in kinds) or \
                any(not 0 <= n <= MAX_SAMPLED for _, n in self.sampled_by_kind):
            raise InvalidRequest(f"sampled_by_kind names each of {', '.join(PROMPT_KINDS)} at most once, with "
                                 f"0 to {MAX_SAMPLED} sampled continuations a prompt; got {self.sampled_by_kind!r}")
        if self.lr <= 0 or self.temperature <= 0 or self.pool_gb <= 0:
            raise InvalidRequest("lr, temperature and pool_gb must be positive")
        if self.ce_weight < 0 or self.kl_weight < 0 or self.ce_weight + self.kl_weight == 0 or self.self_prompts < 0:
            raise InvalidRequest("ce_weight and kl_weight must be ≥ 0, not both 0; self_prompts ≥ 0")
        if self.target_layers is not None and self.num_target_layers is not None:
            raise InvalidRequest("give --target-layers or --num-target-layers, not both")
        if self.target_layers is not None:
            object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
        if (self.target_layers is not None and not self.target_layers) or \
                (self.num_target_layers is not None and self.num_target_layers < 1):
            raise InvalidRequest("a DFlash drafter needs at least one target layer")

    def target_layer_ids(self, num_hidden_layers: int) -> tuple[int, ...]:
        """The target layers a fresh DFlash drafter reads: as given, or spread over depth."""
        if self.target_layers is not None:
            bad = [i for i in self.target_layers if not 0 <= i < num_hidden_layers]
            if bad or len(set(self.target_layers)) != len(self.target_layers):
                raise InvalidRequest(f"--target-layers {self.target_layers} must be distinct layers of "
                                     f"0..{num_hidden_layers - 1}")
            return self.target_layers
        chosen = build_target_layer_ids(num_hidden_layers, self.num_target_layers or self.layers or 2)
        if len(set(chosen)) != len(chosen) or not all(0 <= i < num_hidden_layers for i in chosen):
            raise InvalidRequest(f"{len(chosen)} target layers do not spread over {num_hidden_layers}; "
                                 "give --target-layers")
        return chosen

    def sampled_for(self, kind: str) -> float:
        """Sampled continuations a prompt of `kind` gets (on average: the fraction by chance)."""
        return dict(self.sampled_by_kind).get(kind, self.sampled_fraction)

    @property
    def decay(self) -> float:
        if self.loss_decay is not None:
            return self.loss_decay
        return 1 + 3 * self.block_size / 8 if self.kind == "dflash" else 2.0


@dataclass
class Clock:
    """Wall-time budget of one run: when generation must stop and when training must end."""

    minutes: float | None
    gen_fraction: float
    start: float = field(default_factory=time.monotonic)
    margin_s: float = 15.0  # saving and shutdown
    rounds_from: float = 0.0  # seconds from the start at which pool rounds begin (their shares split the rest)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def gen_budget(self, round_: int | None = None, rounds: int = 1) -> float:
        """Seconds from the start by which generation must stop: the run's (gen_fraction of it), or that
        of pool round `round_` of `rounds`, each an equal share of the time from `rounds_from` to the
        end less the margin (inf without a wall-time bound)."""
        if self.minutes is None:
            return math.inf
        if round_ is None:
            return self.minutes * 60 * self.gen_fraction
        return self.rounds_from + self._share(rounds) * (round_ + self.gen_fraction)

    def round_end(self, round_: int, rounds: int) -> float:
        """Seconds from the start at which round `round_`'s training gives way to the next round's
        generation (inf for the last round, or without a wall-time bound: the budget ends that one)."""
        if self.minutes is None or round_ == rounds - 1:
            return math.inf
        return self.rounds_from + self._share(rounds) * (round_ + 1)

    def _share(self, rounds: int) -> float:
        """A round's seconds: the rounds share the time from `rounds_from` to the end less the margin."""
        return max(0.0, self.minutes * 60 - self.margin_s - self.rounds_from) / rounds

    def gen_over(self) -> bool:
        return self.elapsed() > self.gen_budget()

    def train_seconds(self) -> float | None:
        """Seconds training may take from now, or None without a wall-time bound."""
        if self.minutes is None:
            return None
        return max(1.0, self.minutes * 60 - self.elapsed() - self.margin_s)


# ---- the pool of self-distilled sequences -------------------------------------------------------


@dataclass
class Job:
    prompt: list[int]
    temperature: float  # 0 = greedy


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, S] int64, packed to the left
    positions: torch.Tensor  # [B, S]
    valid: torch.Tensor  # [B, S] bool
    starts: torch.Tensor  # [B] index of the first generated token
    lengths: torch.Tensor  # [B] real tokens
    rows: torch.Tensor  # [B, S, feature_dim] the target's feature rows
    final: torch.Tensor | None = None  # [B, S, hidden] the target's final-normed last hidden rows (KL only)


class Pool:
    """Generated sequences back to back, flat over tokens, with their feature rows and (for distillation)
    the target's final-normed last hidden rows, preallocated on the device. Flat storage keeps only
    real tokens: a chat answer that ends after 80 tokens takes 80 rows, not the longest sequence's."""

    def __init__(self, tokens: int, sequences: int, feature_dim: int, final_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.tokens = torch.zeros(tokens, dtype=torch.long, device=device)
        # Left uninitialised (a large pool need not be written twice); `add` writes every row it counts.
        self.rows = torch.empty((tokens, feature_dim), dtype=dtype, device=device)
        self.final = torch.empty((tokens, final_dim), dtype=dtype, device=device) if final_dim else None
        self.offsets = torch.zeros(sequences, dtype=torch.long, device=device)  # first token of each sequence
        self.starts = torch.zeros(sequences, dtype=torch.long, device=device)  # its first generated index
        self.lengths = torch.zeros(sequences, dtype=torch.long, device=device)
        self.host_lengths = torch.zeros(sequences, dtype=torch.long)  # batch widths without a device read
        self.size = 0  # sequences
        self.used = 0  # tokens

    @staticmethod
    def bytes_per_token(feature_dim: int, final_dim: int, element_size: int) -> int:
        return (feature_dim + final_dim) * element_size + 8

    def room(self) -> tuple[int, int]:
        """Free (tokens, sequences)."""
        return self.tokens.numel() - self.used, self.offsets.numel() - self.size

    def add(self, gen: Generated, rows: torch.Tensor, final: torch.Tensor | None) -> int:
        """Keep the sequences with at least two generated tokens, as many as fit in order; returns how many.

        rows/final [B, S, ...] are packed like gen.tokens [B, S]."""
        keep = (gen.lengths - gen.prompt_lengths >= 2).nonzero().squeeze(1)
        free_tokens, free_seqs = self.room()
        host = gen.lengths[keep].cpu()
        keep = keep[: min(int((host.cumsum(0) <= free_tokens).sum()), free_seqs)]
        n, host = keep.numel(), host[: keep.numel()]
        if n == 0:
            return 0
        lengths = gen.lengths[keep]
        width = gen.tokens.shape[1]
        real = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]  # [n, S]
        span, total = slice(self.size, self.size + n), int(host.sum())
        flat = slice(self.used, self.used + total)
        # Each kept token's row in [B * S], gathered straight into the pool: a generation batch's rows
        # are GiBs, and `rows[keep][real]` would copy them twice on the way.
        at = (keep[:, None] * width + torch.arange(width, device=keep.device)[None, :])[real]
        if at.numel() != total:  # out= below would resize rather than fail
            raise StateConflict(f"generated lengths disagree: {at.numel()} rows for {total} tokens")
        for source, dest in ((gen.tokens, self.tokens), (rows, self.rows), (final, self.final)):
            if dest is not None:
                torch.index_select(source.flatten(0, 1), 0, at, out=dest[flat])
        self.offsets[span] = self.used + torch.cumsum(lengths, 0) - lengths
        self.starts[span], self.lengths[span], self.host_lengths[span] = gen.prompt_lengths[keep], lengths, host
        self.size, self.used = self.size + n, self.used + total
        return n

    def batch(self, index: torch.Tensor) -> Batch:
        """The sequences at pool rows `index` (a CPU tensor) in [B, S] form, S their longest; token ids and
        rows are 0 past each one's end."""
        width = int(self.host_lengths[index].max())
        index = index.to(self.tokens.device)
        lengths = self.lengths[index]
        cols = torch.arange(width, device=index.device)[None, :]
        valid = cols < lengths[:, None]
        at = self.offsets[index][:, None] + torch.minimum(cols, lengths[:, None] - 1)  # [B, S], in its own span

        def take(flat: torch.Tensor) -> torch.Tensor:
            return flat[at].masked_fill(~valid.view(*valid.shape, *[1] * (flat.dim() - 1)), 0)

        return Batch(take(self.tokens), cols.expand(index.numel(), -1), valid, self.starts[index], lengths,
                     take(self.rows), None if self.final is None else take(self.final))

    def generated_tokens(self) -> int:
        return int((self.lengths - self.starts)[:self.size].sum())


def plan_jobs(prompts: Sequence[list[int]], samples: Sequence[float], cfg: TrainConfig) -> list[list[Job]]:
    """Generation batches: each prompt greedy, plus `samples[i]` sampled continuations on average
    (the whole part always, the fraction by chance); similar lengths are batched together."""
    rng = random.Random(cfg.seed)
    greedy = [Job(p, 0.0) for p in prompts]
    sampled = [Job(p, cfg.temperature) for p, n in zip(prompts, samples)
               for _ in range(int(n) + (rng.random() < n - int(n)))]
    batches = []
    for jobs in (greedy, sampled):
        rng.shuffle(jobs)
        window = cfg.gen_batch * 8
        for i in range(0, len(jobs), window):
            chunk = sorted(jobs[i:i + window], key=lambda j: len(j.prompt))
            batches += [chunk[k:k + cfg.gen_batch] for k in range(0, len(chunk), cfg.gen_batch)]
    rng.shuffle(batches)
    return batches


def fit_prompt(ids: list[int], max_tokens: int, keep_tail: bool) -> list[int] | None:
    """A prompt within `max_tokens`: raw text keeps its last tokens; None for a chat prompt that is too long."""
    if len(ids) <= max_tokens:
        return ids
    return ids[-max_tokens:] if keep_tail else None


def new_decoder(target: TargetModel, cfg: TrainConfig) -> DenseDecoder:
    """One decoder for every generation of a run, so its CUDA graphs are captured once."""
    return DenseDecoder(target, cfg.gen_batch, cfg.max_prompt_tokens + cfg.seq_len,
                        use_graphs=cfg.gen_graphs and target.embed_weight.device.type == "cuda")


GENERATION_SLACK = 4 * 2**30  # bytes a generation batch's prefill and sampling take beyond its rows


def pool_bytes_that_fit(requested: int, free: int, batch_rows: int) -> int:
    """What a pool may take of `free` device bytes (after the decoder's own buffers): what is asked, less
    what generating needs beside it, two batches' gathered rows (the one being added while the next is
    made) and some slack. 0 when nothing fits."""
    return max(0, min(requested, free - 2 * batch_rows - GENERATION_SLACK))


def fit_pool(cfg: TrainConfig, per_token: int, device: torch.device, log: Log) -> int:
    """--pool-gb in bytes, cut to what fits beside generation on a GPU (a pool that fills the GPU would
    stop the run minutes in, at the first long batch), and said so. A GPU that cannot hold a batch's
    worth of pool is an error before anything is generated."""
    requested = int(cfg.pool_gb * 2**30)
    if device.type != "cuda":
        return requested
    # free on the device, plus what the caching allocator holds unused (earlier generation's buffers)
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    batch_rows = cfg.gen_batch * (cfg.max_prompt_tokens + cfg.seq_len) * per_token
    fits = pool_bytes_that_fit(requested, free, batch_rows)
    if fits < batch_rows:
        raise CapacityExceeded(
            f"the GPU has {free / 2**30:.1f} GiB free beside the generator; a pool for --gen-batch {cfg.gen_batch} "
            f"needs {(batch_rows * 3 + GENERATION_SLACK) / 2**30:.1f} GiB: lower --gen-batch or --seq-len")
    if fits < requested:
        log(f"pool: --pool-gb {cfg.pool_gb:g} does not fit beside generation ({free / 2**30:.1f} GiB free, "
            f"{(2 * batch_rows + GENERATION_SLACK) / 2**30:.1f} GiB kept for it); using {fits / 2**30:.1f} GiB")
    return fits


def build_pool(target: TargetModel, batches: Sequence[list[Job]], capture: CaptureSpec, cfg: TrainConfig,
               clock: Clock, eos_ids: Sequence[int], log: Log, *, gen_deadline: float | None = None,
               seed: int = 0) -> tuple[Pool, int]:
    """A pool generated from `batches` in order until it is full or the clock passes `gen_deadline`
    (default: the run's generation budget; one batch is always generated), and how many batches that
    took. `seed` is added to cfg.seed for the sampled continuations."""
    device = target.embed_weight.device
    hidden = target.config.hidden_size
    feature_dim = hidden * (len(capture.layer_ids) or 1)
    final_dim = hidden if cfg.kl_weight > 0 else 0
    per_token = Pool.bytes_per_token(feature_dim, final_dim, target.embed_weight.element_size())
    planned = sum(map(len, batches))
    # The decoder first (its KV cache and row buffers are fixed sizes), then the pool in what is left
    decoder = new_decoder(target, cfg)  # its cache and graphs are freed when this returns
    decoder.set_capture(capture, final=final_dim > 0)  # rows kept while decoding: no second pass
    pool_bytes = fit_pool(cfg, per_token, device, log)
    capacity = min(planned * (cfg.max_prompt_tokens + cfg.seq_len), pool_bytes // per_token)
    pool = Pool(capacity, planned, feature_dim, final_dim, target.embed_weight.dtype, device)
    log(f"pool: room for {capacity} tokens ({capacity * per_token / 2**30:.1f} GiB) of {planned} planned sequences; "
        f"features {feature_dim}{f' + final {final_dim}' if final_dim else ''} per token")
    gen = torch.Generator(device=device).manual_seed(cfg.seed + seed)
    deadline = clock.gen_budget() if gen_deadline is None else gen_deadline
    tokens, start, generated = 0, clock.elapsed(), 0
    for i, jobs in enumerate(batches):
        if pool.room()[0] < cfg.max_prompt_tokens + cfg.seq_len or (i > 0 and clock.elapsed() > deadline):
            break
        generated = i + 1
        temperature = jobs[0].temperature
        out = generate(target, [j.prompt for j in jobs], cfg.seq_len, temperature=temperature, generator=gen,
                       eos_ids=eos_ids, decoder=decoder)
        pool.add(out, out.features, out.final)
        tokens += int((out.lengths - out.prompt_lengths).sum())
        out = None  # its rows go before the next batch's are made
        if i < 3 or (i + 1) % 10 == 0:
            log(f"gen batch {i + 1}/{len(batches)} ({'greedy' if temperature == 0 else f'T={temperature}'}, "
                f"{len(jobs)} seqs): pool {pool.size}, {tokens} generated tokens, "
                f"{tokens / max(clock.elapsed() - start, 1e-9):.0f} tok/s, {clock.elapsed():.0f}s")
    if pool.size == 0:
        raise InvalidRequest("no training sequences were generated")
    return pool, generated


# ---- losses -------------------------------------------------------------------------------------


def sample_anchors(batch: Batch, count: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` distinct anchors per row among generated indices with a token after them.

    Returns anchors [B, N] (0 where a row has fewer) and whether each is real [B, N].
    """
    rows, width = batch.tokens.shape
    cols = torch.arange(width, device=batch.tokens.device)[None, :]
    allowed = (cols >= batch.starts[:, None]) & (cols <= batch.lengths[:, None] - 2)
    scores = torch.rand((rows, width), generator=gen, device=cols.device).masked_fill(~allowed, 2.0)
    order = scores.argsort(1)[:, :min(count, width)]
    real = allowed.gather(1, order)
    return order.masked_fill(~real, 0), real


@torch.no_grad()
def walk_anchors(model: DFlashModel, head: TargetHead, batch: Batch, anchors: torch.Tensor,
                 real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors [B, N] each moved one step of decoding's walk: a → a + m + 1, m the leading drafts of a's
    block equal to x_{a+1}, ... (greedy verification's accepted count, as `evaluate.anchor_matches`).
    That is the anchor decoding's next step starts from, right after a rejected draft when m < γ-1:
    where decoding spends its steps, and where the drafter does worst (teacher-forced τ 3.59 over
    decoding's walk against 5.43 over every anchor, session 25). An anchor whose step leaves the
    generated tokens with one after them (or that was not real) is no longer real."""
    gamma = model.cfg.block_size
    hidden = dflash_block_hidden(model, head, batch.rows, batch.tokens, batch.positions, batch.valid, anchors)
    drafts = DraftVocab(model.d2t, head.vocab_size).to_target(model.logits(hidden[:, :, 1:], head).argmax(-1))
    targets, ok = block_targets(batch.tokens, batch.lengths, anchors, real, gamma)
    matched = ((drafts == targets[:, :, 1:]) & ok[:, :, 1:]).long().cumprod(-1).sum(-1)  # [B, N]
    moved = anchors + matched + 1
    still = real & (moved <= batch.lengths[:, None] - 2)
    return moved.masked_fill(~still, 0), still


def distill_loss(hidden: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor | None, weights: torch.Tensor,
                 model: DrafterModel, head: TargetHead, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ w·(ce_weight·CE(x) + kl_weight·KL(p ‖ q)) / Σ w over the rows with weight > 0, and the drafter's
    greedy accuracy there. q is the drafter's distribution from `hidden`, x the target's token, p the
    target's distribution for it: softmax(lm_head(teacher row)), the target's final-normed last hidden
    row at the position before x. Logits only for the weighted rows."""
    chosen = weights > 0
    logits = model.logits(hidden[chosen], head)  # [R, vocab] float32
    w, y = weights[chosen], targets[chosen]
    log_q = F.log_softmax(logits, -1)
    per_row = cfg.ce_weight * F.nll_loss(log_q, y, reduction="none") if cfg.ce_weight > 0 else 0.0
    if cfg.kl_weight > 0:
        if teacher is None:
            raise InvalidRequest("KL distillation needs the target's final hidden rows in the pool")
        with torch.no_grad():
            log_p = F.log_softmax(head_logits(teacher[chosen].to(head.lm_head.dtype), head.lm_head), -1)
        per_row = per_row + cfg.kl_weight * F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    loss = (per_row * w).sum() / w.sum().clamp(min=1e-6)
    accuracy = (logits.argmax(-1) == y).float().mean() if y.numel() else logits.new_zeros(())
    return loss, accuracy.detach()


def teacher_rows(final: torch.Tensor | None, label_index: torch.Tensor) -> torch.Tensor | None:
    """final [B, S, hidden] at label_index - 1, the row that predicts each label → [*label_index.shape, hidden]."""
    if final is None:
        return None
    index = (label_index - 1).clamp(0, final.shape[1] - 1).reshape(final.shape[0], -1)
    rows = final.gather(1, index[:, :, None].expand(-1, -1, final.shape[2]))
    return rows.view(*label_index.shape, final.shape[2])


def block_targets(tokens: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, real: torch.Tensor,
                  gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels of the blocks anchored at sequence indices anchors [B, N]: row k of a block is labelled
    x_{a+k}, the token at the row's own position (unshifted: inference's draft k is row k, verified
    against the target's token at p+k). Returns targets and whether each is a real draft label, [B, N, γ]
    (row 0, the anchor, never is)."""
    k = torch.arange(gamma, device=anchors.device)
    index = anchors[:, :, None] + k  # [B, N, γ]
    ok = real[:, :, None] & (index < lengths[:, None, None]) & (k >= 1)
    targets = tokens.gather(1, index.clamp(max=tokens.shape[1] - 1).flatten(1)).view_as(index)
    return targets, ok


def dflash_loss(model: DFlashModel, head: TargetHead, batch: Batch, cfg: TrainConfig,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Block k of an anchor a predicts x_{a+k}, k = 1..γ-1, weighted exp(-(k-1)/w) where a+k is real.
    The first walk_share of each row's (randomly ordered) anchors are moved walk_steps steps of decoding's
    walk (`walk_anchors`, once a step). A reveal_share of the blocks, drawn after, are a refining pass's:
    given their first r labels (r uniform in 1..reveal_max), scored past them (`block_weights`)."""
    gamma = model.cfg.block_size
    anchors, real = sample_anchors(batch, cfg.anchors, gen)
    walked = math.floor(cfg.walk_share * anchors.shape[1] + 0.5)  # columns scored (real anchors come first)
    if walked:
        # A row's share of its real anchors (a row short of anchors, its sequence ended early, walks no more
        # than its share); the rest of those columns stay as drawn
        count = torch.floor(cfg.walk_share * real.sum(1, keepdim=True) + 0.5)
        chosen = real[:, :walked] & (torch.arange(walked, device=real.device) < count)
        moved, still = anchors[:, :walked], chosen
        for _ in range(cfg.walk_steps):
            moved, still = walk_anchors(model, head, batch, moved, still)
        if torch.is_autocast_enabled(moved.device.type):
            # (the no-grad forwards must not leave autocast's cast weights, made without gradient history, to
            # the training forward: older torch reused them and the weights got no gradient, pytorch#112583)
            torch.clear_autocast_cache()
        anchors = torch.cat([torch.where(chosen, moved, anchors[:, :walked]), anchors[:, walked:]], 1)
        real = torch.cat([torch.where(chosen, still, real[:, :walked]), real[:, walked:]], 1)
    reveal = None
    if cfg.reveal_share > 0:
        drawn = torch.randint(1, cfg.reveal_max + 1, anchors.shape, generator=gen, device=gen.device)
        chosen = torch.rand(anchors.shape, generator=gen, device=gen.device) < cfg.reveal_share
        reveal = (drawn * chosen).to(anchors.device)
    hidden = dflash_block_hidden(model, head, batch.rows, batch.tokens, batch.positions, batch.valid, anchors,
                                 reveal=reveal)
    targets, ok = block_targets(batch.tokens, batch.lengths, anchors, real, gamma)
    teacher = teacher_rows(batch.final, anchors[:, :, None] + torch.arange(gamma, device=anchors.device))
    return distill_loss(hidden, targets, teacher, block_weights(ok, reveal, cfg.decay), model, head, cfg)


def block_weights(ok: torch.Tensor, reveal: torch.Tensor | None, decay: float) -> torch.Tensor:
    """[B, N, γ] loss weights of blocks whose labels are real where `ok`: exp(-(j-1)/decay) at a block's j-th
    drafted row. A refining pass's block (`reveal` [B, N] = r > 0) drafts rows r+1.. only: its rows 1..r
    are given and weigh nothing, and its row r+1 weighs as a first draft."""
    k = torch.arange(ok.shape[-1], device=ok.device)
    if reveal is not None:
        ok = ok & (k > reveal[:, :, None])
        k = k - reveal[:, :, None]
    return ok * torch.exp(-(k - 1).clamp(min=0) / decay)


def mtp_loss(model: MTPModel, head: TargetHead, batch: Batch, cfg: TrainConfig,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Step s at sequence index i predicts x_{i+s}, weighted exp(-(s-1)/w) where it is a generated token."""
    outs = mtp_step_outputs(model, head, batch.rows, batch.tokens, batch.positions, batch.valid, cfg.mtp_steps)
    index = torch.arange(1, batch.tokens.shape[1], device=batch.tokens.device)[None, :]  # i = r + 1
    hidden, targets, weights, labels = [], [], [], []
    for step, out in enumerate(outs, 1):
        label = index + step
        ok = (label < batch.lengths[:, None]) & (label >= batch.starts[:, None])
        hidden.append(out)
        labels.append(label.expand_as(ok))
        targets.append(batch.tokens.gather(1, label.clamp(max=batch.tokens.shape[1] - 1).expand_as(ok)))
        weights.append(ok * math.exp(-(step - 1) / cfg.decay))
    teacher = teacher_rows(batch.final, torch.cat(labels, 1))
    return distill_loss(torch.cat(hidden, 1), torch.cat(targets, 1), teacher, torch.cat(weights, 1), model, head,
                        cfg)


# ---- the optimizer loop -------------------------------------------------------------------------


def lr_at(progress: float, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine from lr down to min_lr_ratio·lr."""
    if progress < cfg.warmup:
        return cfg.lr * max(progress / cfg.warmup, 0.01)
    t = min(1.0, (progress - cfg.warmup) / (1 - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass
class TrainResult:
    model: DrafterModel
    losses: list[float]
    accuracies: list[float]
    pool_size: int


def new_drafter(cfg: TrainConfig, info: TargetInfo, device: torch.device, init: str | Path | None) -> DrafterModel:
    """A float32 drafter to train: fresh and seeded, or read from `init` (which fixes its shape)."""
    if init is None:
        dflash = cfg.kind == "dflash"
        model = random_model(cfg.kind, info, seed=cfg.seed, num_layers=(cfg.layers or 2) if dflash else 1,
                             block_size=cfg.block_size, dtype=torch.float32, device=device,
                             **({"target_layer_ids": cfg.target_layer_ids(info.num_hidden_layers)} if dflash else {}))
    else:
        model = load_model(init, target_info=info, dtype=torch.float32, device=device)
        if isinstance(model, DFlashModel) != (cfg.kind == "dflash"):
            raise InvalidRequest(f"--init {init} is not a {cfg.kind} drafter")
        if isinstance(model, DFlashModel):
            layers = model.cfg.decoder.num_hidden_layers if cfg.layers is None else cfg.layers
            given = cfg.target_layers is not None or cfg.num_target_layers is not None
            ids = cfg.target_layer_ids(info.num_hidden_layers) if given else model.cfg.target_layer_ids
            if (layers, tuple(ids)) != (model.cfg.decoder.num_hidden_layers, model.cfg.target_layer_ids):
                model = grow_dflash(model, layers, tuple(ids), seed=cfg.seed)
    if cfg.kl_weight > 0 and model.d2t is not None:
        raise InvalidRequest("KL distillation needs a drafter over the target's whole vocabulary (no d2t)")
    if cfg.reveal_share > 0 and cfg.reveal_max > model.cfg.block_size - 2:
        raise InvalidRequest(f"--reveal-max {cfg.reveal_max} leaves no row to draft in the drafter's blocks of "
                             f"{model.cfg.block_size}: at most {model.cfg.block_size - 2}")
    return model.train().requires_grad_(True)


def grow_dflash(model: DFlashModel, layers: int, target_layer_ids: tuple[int, ...], *, seed: int) -> DFlashModel:
    """`model` with more decoder layers and more target layers read as features, computing exactly what
    it computed before: each new layer's residual branches end in zeroed projections (attention o_proj,
    MLP down_proj), so it passes its input through until trained, and the fc columns that read the new
    target layers are zero. A session can so continue a trained checkpoint at a bigger shape instead of
    training the bigger drafter from scratch (Net2Net-style growth)."""
    cfg = model.cfg
    old = cfg.decoder.num_hidden_layers
    if layers < old or not set(cfg.target_layer_ids) <= set(target_layer_ids):
        raise InvalidRequest(f"a checkpoint of {old} layers reading target layers {list(cfg.target_layer_ids)} can "
                             f"only grow: {layers} layers reading {list(target_layer_ids)} drop some of it")
    types = cfg.decoder.layer_types
    decoder = replace(cfg.decoder, num_hidden_layers=layers,
                      layer_types=None if types is None else types + ("full_attention",) * (layers - old))
    bigger = DFlashModel(replace(cfg, decoder=decoder, target_layer_ids=tuple(target_layer_ids)))
    ref = next(model.parameters())
    bigger.to(device=ref.device, dtype=ref.dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in bigger.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02 if p.dim() == 2 else torch.ones(p.shape))
        state = model.state_dict()
        for name, tensor in bigger.state_dict().items():
            if name in state and name != "fc.weight" and state[name].shape == tensor.shape:
                tensor.copy_(state[name])
        width = cfg.decoder.hidden_size
        bigger.fc.weight.zero_()
        for j, layer in enumerate(cfg.target_layer_ids):
            k = target_layer_ids.index(layer)
            bigger.fc.weight[:, k * width:(k + 1) * width] = model.fc.weight[:, j * width:(j + 1) * width]
        for layer in bigger.layers[old:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return bigger


def checkpoint_bytes(model: DrafterModel) -> int:
    """Bytes of the bfloat16 checkpoint's tensors."""
    return sum(t.numel() * 2 if t.is_floating_point() else t.numel() * t.element_size()
               for t in model.state_dict().values())


def train_drafter(cfg: TrainConfig, target: TargetModel, prompts: Sequence[list[int]], *,
                  samples: Sequence[float] | None = None, eos_ids: Sequence[int] = (),
                  init: str | Path | None = None, log: Log = print, clock: Clock | None = None) -> TrainResult:
    """Generate the pool from `prompts` (token ids within max_prompt_tokens; `samples` sampled continuations
    each, cfg.sampled_fraction by default), then train; with cfg.pool_rounds > 1, that many times over,
    each round's pool from the generation batches the earlier ones did not reach (the batch that filled a
    pool is not generated again, though the pool may have kept only part of it), one optimizer and one
    learning-rate schedule throughout."""
    clock = clock or Clock(cfg.minutes, cfg.gen_fraction)
    device = target.embed_weight.device
    torch.manual_seed(cfg.seed)
    info, head = TargetInfo.from_config(target.config), TargetHead(target.embed_weight, target.lm_head_weight)
    model = new_drafter(cfg, info, device, init)
    capture = capture_for_model(model)
    log(f"drafter: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters"
        + (f", target layers {list(model.cfg.target_layer_ids)}" if isinstance(model, DFlashModel) else ""))
    samples = [cfg.sampled_fraction] * len(prompts) if samples is None else samples
    batches = plan_jobs(prompts, samples, cfg)
    trainer = _Trainer(model, head, cfg, clock, log)
    rounds = cfg.pool_rounds
    if rounds > 1:
        clock.rounds_from = clock.elapsed()  # the prompts are written: the rounds share the time left
    first, sequences, pool = 0, 0, None
    for round_ in range(rounds):
        if first >= len(batches):  # every prompt generated: the last pool serves the rest of the run
            if pool is None:
                raise InvalidRequest("no training sequences were generated")
            log(f"round {round_ + 1}/{rounds}: no prompts left to generate; training on the last pool")
        else:
            pool = None  # the last round's pool goes before the next is made (two would not fit)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                pool, used = build_pool(target, batches[first:], capture, cfg, clock, eos_ids, log, seed=round_,
                                        gen_deadline=clock.gen_budget(round_, rounds) if rounds > 1 else None)
            except (InvalidRequest, CapacityExceeded) as exc:
                if round_ == 0:
                    raise
                # a later round that cannot make its pool keeps what the earlier rounds trained
                log(f"round {round_ + 1}/{rounds}: no new pool ({exc}); the run ends with what it trained")
                break
            first, sequences = first + used, sequences + pool.size
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the generation cache is gone; training's buffers are shaped differently
            log(f"pool{f' {round_ + 1}/{rounds}' if rounds > 1 else ''}: {pool.size} sequences, "
                f"{pool.generated_tokens()} generated tokens, {int(pool.host_lengths[:pool.size].sum())} tokens "
                f"in all, {clock.elapsed():.0f}s")
        trainer.train(pool, round_, until_step=None if cfg.steps is None else cfg.steps * (round_ + 1) // rounds,
                      until=clock.round_end(round_, rounds))
    return TrainResult(model.eval(), *trainer.history(), sequences)


def capture_for_model(model: DrafterModel) -> CaptureSpec:
    if isinstance(model, DFlashModel):
        return CaptureSpec(layer_ids=model.cfg.target_layer_ids)
    return CaptureSpec(last_hidden=True)


class _Trainer:
    """The drafter's optimizer over a run: one AdamW and one learning-rate schedule across its pool rounds.

    The schedule's progress is the larger of steps taken / cfg.steps and a time part: at each round's
    start it stands where the last round left it, p0, and goes on to 1 over the training seconds planned
    from there (the time left, less the later rounds' generation budgets: at most what they will take,
    so it ends in the last round), p0 + (1 - p0) * seconds / planned. Monotone across rounds, whatever
    a round's generation took."""

    def __init__(self, model: DrafterModel, head: TargetHead, cfg: TrainConfig, clock: Clock, log: Log) -> None:
        self.model, self.head, self.cfg, self.clock, self.log = model, head, cfg, clock, log
        device = next(model.parameters()).device
        self.device = device
        # Norm gains are left out of weight decay, as usual.
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
        self.loss_fn = dflash_loss if isinstance(model, DFlashModel) else mtp_loss
        self.gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
        self.spent = 0.0  # training seconds so far (for the log)
        self.start_progress = 0.0  # the time part of the schedule where this round started (p0)
        self.planned: float | None = None  # training seconds planned from this round's start to the end
        self.losses: list[torch.Tensor] = []
        self.accs: list[torch.Tensor] = []
        self.tokens = 0

    def time_progress(self, running: float) -> float:
        if self.planned is None:
            return 0.0
        return min(1.0, self.start_progress + (1 - self.start_progress) * running / self.planned)

    def progress(self, running: float) -> float:
        cfg = self.cfg
        return max(len(self.losses) / cfg.steps if cfg.steps else 0.0, self.time_progress(running))

    def train(self, pool: Pool, round_: int, *, until_step: int | None, until: float) -> None:
        """Steps on `pool` until `until_step` steps in all, the clock's `until` (seconds from the run's
        start) or the end of the schedule."""
        cfg, clock = self.cfg, self.clock
        if clock.minutes is not None:  # re-planned each round: a round whose generation ended early trains longer
            rounds = cfg.pool_rounds
            later_gen = (rounds - 1 - round_) * clock._share(rounds) * clock.gen_fraction
            self.planned = max(1.0, (clock.train_seconds() or 0.0) - later_gen)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext()
        order = _epochs(pool.size, cfg.batch, cfg.seed + round_)
        start = time.monotonic()
        while True:
            progress = self.progress(time.monotonic() - start)
            if progress >= 1.0 or (until_step is not None and len(self.losses) >= until_step) or clock.elapsed() >= until:
                break
            for group in self.opt.param_groups:
                group["lr"] = lr_at(progress, cfg)
            index = next(order)
            batch = pool.batch(index)
            with autocast:
                loss, acc = self.loss_fn(self.model, self.head, batch, cfg, self.gen)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.losses.append(loss.detach())
            self.accs.append(acc)
            self.tokens += int(pool.host_lengths[index].sum())
            step = len(self.losses)
            if step % cfg.log_every == 0 or step == cfg.steps:
                _log_step(self.log, step, self.losses, self.accs, self.tokens, self.spent + time.monotonic() - start,
                          clock, self.opt)
        elapsed = time.monotonic() - start
        self.spent += elapsed
        self.start_progress = self.time_progress(elapsed)

    def history(self) -> tuple[list[float], list[float]]:
        if not self.losses:
            raise InvalidRequest("the time budget ended before the first training step")
        return torch.stack(self.losses).tolist(), torch.stack(self.accs).tolist()


def _log_step(log: Log, step: int, losses: list, accs: list, tokens: int, seconds: float, clock: Clock, opt) -> None:
    recent = slice(-min(len(losses), 20), None)
    loss = torch.stack(losses[recent]).mean().item()
    acc = torch.stack(accs[recent]).mean().item()
    log(f"step {step}: loss {loss:.4f}, acc {acc:.3f}, lr {opt.param_groups[0]['lr']:.2e}, "
        f"{tokens / max(seconds, 1e-9):.0f} tok/s, train {seconds:.0f}s, total {clock.elapsed():.0f}s")


def _epochs(size: int, batch: int, seed: int):
    """Batches of pool indices, a fresh permutation each epoch."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(size, generator=gen)
        if size <= batch:
            yield perm
            continue
        for i in range(0, size - batch + 1, batch):
            yield perm[i:i + batch]


def save_drafter(model: DrafterModel, out: str | Path) -> Path:
    """The drafter in bfloat16, in the folder format `load_drafter` reads, in shards when over 16 MiB."""
    half = copy.deepcopy(model).to(torch.bfloat16)
    save = save_dflash if isinstance(half, DFlashModel) else save_mtp
    folder = save(out, half, max_file_bytes=MAX_FILE_BYTES - 2**20)  # room for each file's header
    too_big = [f.name for f in folder.glob("*.safetensors") if f.stat().st_size > MAX_FILE_BYTES]
    if too_big:
        raise InvalidRequest(f"{folder}: {too_big[0]} is over the 16 MiB a weights file may hold")
    return folder


# ---- the command ------------------------------------------------------------------------------


def run(cfg: TrainConfig, *, target: str, out: str | Path, device: str, init: str | None = None,
        log: Log = print, eval_tokens: int = 0, eval_limit: int | None = None,
        eval_dtype: torch.dtype | None = None, eval_refine: Sequence[RefinePolicy] = ()) -> Path:
    """`specsplit train-drafter`: load the target and the training prompts, have the target write more,
    train, save; with `eval_tokens`, then evaluate the new checkpoint (and `init`) on the held-out
    prompts with the target already loaded (`specsplit eval-acceptance`'s figures, batch 16), or loaded
    again in `eval_dtype` when that differs from the training's."""
    from specsplit.shared.tokenizer import Tokenizer
    from specsplit.local import target_dir
    from specsplit.target_service.model import load_target

    clock = Clock(cfg.minutes, cfg.gen_fraction)
    folder = target_dir(target)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = load_target(folder, dtype=dtype, device=device)
    tokenizer = Tokenizer.from_dir(folder)
    log(f"target {folder} on {device} ({dtype}); {clock.elapsed():.0f}s")
    prompts = session_prompts(cfg, model, tokenizer, clock, log)
    fitted = [(fit_prompt(p.encode(tokenizer), cfg.max_prompt_tokens, p.kind == "code"), p.kind) for p in prompts]
    ids = [i for i, _ in fitted if i]
    samples = [cfg.sampled_for(k) for i, k in fitted if i]
    kinds = ", ".join(f"{sum(1 for i, k in fitted if i and k == kind)} {kind}" for kind in PROMPT_KINDS)
    log(f"{len(ids)} training prompts within {cfg.max_prompt_tokens} tokens ({kinds}); {clock.elapsed():.0f}s")
    if cfg.sampled_by_kind:
        log("sampled continuations a prompt: " + ", ".join(f"{kind} {cfg.sampled_for(kind):g}" for kind in PROMPT_KINDS))
    result = train_drafter(cfg, model, ids, samples=samples, eos_ids=tokenizer.eos_token_ids, init=init, log=log, clock=clock)
    saved = save_drafter(result.model, out)
    size = sum(f.stat().st_size for f in saved.glob("*.safetensors"))
    epochs = len(result.losses) * cfg.batch / result.pool_size
    log(f"saved {saved} ({size / 2**20:.1f} MiB); {len(result.losses)} steps on {result.pool_size} sequences "
        f"({epochs:.1f} epochs); final loss {sum(result.losses[-20:]) / len(result.losses[-20:]):.4f}; "
        f"total {clock.elapsed():.0f}s")
    if eval_tokens:
        del result  # the pool went with train_drafter; the drafter in training goes too
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        where = "held-out eval"
        if eval_dtype is not None and eval_dtype != dtype:
            model = load_target(folder, dtype=eval_dtype, device=device)
            where = f"held-out eval in {str(eval_dtype).removeprefix('torch.')}"
        for name, folder_ in (("this checkpoint", saved), ("the --init checkpoint", init)):
            if folder_ is not None:
                rep = evaluate_checkpoint(model, tokenizer, str(folder_), device, eval_tokens, eval_limit,
                                          eval_refine)
                log(f"{where}, {name}: {eval_summary(rep)}")
    return saved


def evaluate_checkpoint(model: TargetModel, tokenizer, drafter: str, device: str, max_tokens: int,
                        limit: int | None, refine: Sequence[RefinePolicy] = ()) -> dict:
    """`specsplit eval-acceptance`'s report for a drafter checkpoint, on a target already loaded."""
    from specsplit.evaluate import EvalPrompt, EvalSettings, evaluate
    from specsplit.local import LocalSetup, make_drafter
    from specsplit.train_data import HELDOUT_PATH, read_prompts

    prompts = [EvalPrompt(p.kind, p.encode(tokenizer)) for p in read_prompts(HELDOUT_PATH, limit)]
    dtype = str(model.embed_weight.dtype).removeprefix("torch.")  # the drafter computes as the target does
    proposer = make_drafter(drafter, model, LocalSetup(drafter=drafter, device=device, dtype=dtype))
    return evaluate(model, proposer, prompts, EvalSettings(max_tokens=max_tokens, refine=tuple(refine)),
                    eos_ids=tokenizer.eos_token_ids)


def eval_summary(rep: dict) -> str:
    """One line, as TRAINING.log reports a checkpoint."""
    kinds = ", ".join(f"{k} {v['tau']:.2f}" for k, v in rep["by_kind"].items())
    positions = " / ".join(f"{p:.2f}" for p in rep["position_acceptance"][:5])
    forced = rep.get("teacher_forced")
    speed = rep["tokens_per_s"]
    return (f"tau {rep['tau']:.2f} ({kinds}); acceptance by draft position {positions} ...; "
            + (f"teacher-forced tau {forced['tau_excl_prefill']:.2f} over every anchor, "
               f"{forced['walk']['tau_excl_prefill']:.2f} over decoding's walk{_walk_kinds(forced)}; " if forced else "")
            + "".join(f"refined ({name} given) {r['tau_excl_prefill']:.2f} / {r['walk']['tau_excl_prefill']:.2f}"
                      + _walk_kinds(r) + _decoded(rep, name) + "; "
                      for name, r in (forced or {}).get("refined", {}).items())
            + f"speculative {speed['speculative']:.0f} vs target-only {speed['target_only']:.0f} tok/s "
            f"({speed['speedup']:.2f}x), batch {rep['batch']}, {rep['prompts']} prompts, {rep['max_tokens']} tokens")


def _walk_kinds(forced: dict) -> str:
    """' (walk: chat 3.10, code 4.60, ...)' where the teacher-forced walk is split by kind."""
    by_kind = forced["walk"].get("by_kind")
    if not by_kind:
        return ""
    return " (walk: " + ", ".join(f"{kind} {w['tau_excl_prefill']:.2f}" for kind, w in by_kind.items()) + ")"


def _decoded(rep: dict, name: str) -> str:
    """', decoded tau 3.71 (chat 3.30, ...)' for a refine policy's real run, where there was one."""
    real = rep.get("refined_runs", {}).get(name)
    if real is None:
        return ""
    kinds = ", ".join(f"{kind} {v['tau']:.2f}" for kind, v in real["by_kind"].items())
    return f", decoded tau {real['tau']:.2f} ({kinds}; {real['mismatches']} mismatches)"


def session_prompts(cfg: TrainConfig, target: TargetModel, tokenizer, clock: Clock, log: Log) -> list:
    """The offline training prompts drawn with cfg.seed, and the questions the target writes this session."""
    from specsplit.self_prompts import write_questions
    from specsplit.train_data import HELDOUT_PATH, read_prompts, training_prompts

    prompts = training_prompts(cfg.seed)
    log(f"{len(prompts)} offline training prompts (seed {cfg.seed}); {clock.elapsed():.0f}s")
    if cfg.self_prompts == 0:
        return prompts
    banned = frozenset(p.text for p in read_prompts(HELDOUT_PATH))
    gen = torch.Generator(device=target.embed_weight.device).manual_seed(cfg.seed + 7)
    eos = set(tokenizer.eos_token_ids)
    decoder = new_decoder(target, cfg)

    def sample(rows, max_tokens, temperature):
        max_tokens = min(max_tokens, decoder.width - max(map(len, rows)))  # the decoder's cache is the bound
        out = generate(target, rows, max_tokens, temperature=temperature, generator=gen,
                       eos_ids=tokenizer.eos_token_ids, decoder=decoder)
        done = []
        for row, start, end in zip(out.tokens.tolist(), out.prompt_lengths.tolist(), out.lengths.tolist()):
            new = row[start:end]
            ended = bool(new) and new[-1] in eos
            done.append((new[:-1] if ended else new, ended))
        return done

    questions = write_questions(sample, tokenizer, cfg.self_prompts, cfg.gen_batch, seed=cfg.seed, banned=banned,
                                deadline=lambda: clock.elapsed() > 0.25 * clock.gen_budget())
    log(f"{len(questions)} questions written by the target from {cfg.self_prompts} samples; {clock.elapsed():.0f}s")
    return prompts + questions
