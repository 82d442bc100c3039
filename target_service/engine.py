"""The speculative engine: prefill → drafter prefill → loop {propose → batched verify → accept → commit}.

The engine talks to "a drafter" only through `shared.proposer.Proposer`: in-process that is the
drafter object itself, in the split it is the gRPC client. Drafter failure is not request failure:
any drafter error detaches the drafter, every running sequence continues by serial decoding with
identical output, and `Proposer.available()` (when the proposer has it) lets the engine re-attach
later, rebuilding drafter state for the sequences still running.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from specsplit.shared.cuda_graphs import capture_serving, inlined
from specsplit.shared.errors import CapacityExceeded, InvalidRequest, StateConflict
from specsplit.shared.logs import fields
from specsplit.shared.proposer import FeatureKind, ProposeRequest, Proposer
from specsplit.shared.sampling import make_generator
from specsplit.shared.tokenizer import TextStream
from specsplit.kernels.chain_accept import accept_chain_step, write_outcome
from specsplit.kernels.tree_accept import accept_tree_step
from specsplit.kernels.tree_grow import grow_verify_inputs
from specsplit.shared.tree import MAX_TREE_KEEP, MAX_TREE_NODES, TREE_KEEP, DraftTree, best_first, holds_nodes
from specsplit.shared.tree import accept_greedy as accept_tree
from specsplit.shared.verify import device_longs, sample_accept, sample_tokens, verify_sampled
from specsplit.target_service.chain import ChainBuffers, ChainedStep, ChainProgram, accept_greedy
from specsplit.target_service.counters import EngineCounters
from specsplit.target_service.draft_tuner import DraftTuner
from specsplit.target_service.graphs import DeviceDrafts, LaunchedStep, StepBatch, StepGraphs
from specsplit.target_service.model import CaptureSpec, ForwardBatch, ForwardOutput, TargetModel
from specsplit.target_service.sequence import FinishReason, Request, Sequence, StepEvent

log = logging.getLogger(__name__)
_FAILED = object()  # what a drafter verb "returns" when it raised
# A captured prefill forward's tokens per prompt, and the most prompts in one (EngineConfig.graphed_prefill)
# (64 × 4: most chat prompts in one chunk; a replay's logits cover its 256 rows); a longer prompt's chunks
# go alone through a forward of up to this many tokens (EngineConfig.prefill_chunk, if smaller)
_GRAPHED_PREFILL_CHUNK = 64
_GRAPHED_PREFILL_BATCH = 4
_GRAPHED_PREFILL_LONG = 512


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16  # sequences decoded together in one verify forward
    prefill_chunk: int = 512  # the most tokens of one prompt in one prefill forward
    prefill_tokens: int = 4096  # the most prompt tokens in one prefill forward, short prompts packed together
    # On a GPU with CUDA graphs prompts go in through captured forwards, one forward an engine step: those
    # with at most this many tokens still to go in in chunks of `_GRAPHED_PREFILL_CHUNK` tokens, several
    # prompts a forward (each costs about a decode step where an eager forward is launch-bound: ~22-30 ms
    # for the default model on the H200, whatever its length), a longer one alone in chunks of up to
    # `prefill_chunk` tokens (at most `_GRAPHED_PREFILL_LONG`; many small chunks would read the weights once
    # a chunk). 0: every prompt eagerly.
    graphed_prefill: int = 256
    kv_blocks: int = 2048
    kv_block_size: int = 16
    num_drafts: int | None = None  # drafts per step; None = the drafter's max
    # Fewer drafts when many sequences share a step: (from this many sequences, at most this many drafts)
    # pairs. A verify's cost grows with its tokens once the batch fills the GPU, while the drafts far
    # down a block are rarely accepted, so a big batch wants a short draft (bench/draft_length.py).
    drafts_by_batch: tuple[tuple[int, int], ...] = ()
    # Where the schedule above gives no drafts at a step's batch size (a pair (N, 0), or num_drafts 0), the
    # step's sequences rest from the drafter: their drafter state is freed and they decode as target only (one
    # step launched ahead, no drafter call a step), and once the schedule has given drafts for this many steps
    # in a row they are re-attached from rows re-captured by the prefill forwards (as after a drafter outage).
    # Drafter-attached steps of no drafts told the drafter each step's row: 0.38x target only at eight and
    # sixteen streams in-process (fiftieth session, H100, `split_bench --drafts-by-batch 8:0`). None: no rest,
    # the drafter kept current a row a step (a catch-up).
    resume_after: int | None = 8
    # Learn the draft length per batch size while serving (target_service/draft_tuner.py): the k among
    # 0, 1, 3, 7, 15 (within the limits above) that gives the most tokens per second of decode step.
    auto_drafts: bool = False
    cuda_graphs: bool = True  # on a GPU, replay decode/verify steps as captured CUDA graphs
    # Steps with no drafts launch the next step before reading this one's picks (see
    # Engine._decode_step_ahead), and in-process speculative steps their next verify before emitting
    # (Engine._launch_ahead): the device works while the host emits. Needs the captured steps.
    decode_ahead: bool = True
    # In-process greedy speculative steps whose drafter can (DFlash's static forwards) go further: the
    # accept, the drafter's commit and the next propose and verify run on the device, and the host
    # reads each step's picks one step behind (target_service/chain.py). Needs `decode_ahead`.
    chain_steps: bool = True
    # A chained step of up to this many sequences, all greedy and drafting, runs as one CUDA graph
    # (propose, verify, accept, commit: target_service.chain.ChainProgram) once its shape has run a few
    # times: one launch a step (0: never). On the H200 (split_bench --also-uncaptured) it gained 1.04-1.33x
    # at one and two streams, and 1.03x / 1.02x / 1.07x at 4 / 8 / 16 once the captures' own cost is left
    # out (eighteenth session; the earlier losses there were 0.4-s runs paying a capture per shape, which a
    # server pays once). Past 16 it was not measured.
    chain_capture: int = 16
    # Through a drafter service the propose is a round trip, so a chained step cannot be captured whole:
    # with this, everything after the drafts arrive (the verify, the accept, the outcome, the next feed)
    # replays as one graph of its own (`Engine._chain_tail`), where it ran as some thirty launches around
    # the verify's graph (bench/timeline.py, twenty-third session: the GPU idle while the target's host
    # launched them). Up to `chain_capture` sequences, like the whole step's (0: never). On the H200
    # (twenty-fourth session, bf16, medians of three rounds): 1.15x / 1.09x the uncaptured services'
    # tokens/s at one / eight streams, every request's tokens equal.
    chain_capture_remote: bool = True
    # Chained-step programs (and their graphs) kept, by batch size, draft length and tree rows; the least
    # recently used past this many are dropped, and their shape runs uncaptured again when it comes back.
    chain_programs: int = 24
    # Uncaptured runs of a chained-step shape before it is captured: a shape passing through (a batch draining
    # at the end of a burst, a draft length the tuner tries) is not captured, one that comes back is. It was 8
    # (a capture costs about ten replays' worth of host time). Serving 24 held-out prompts through 8 slots
    # (trees of 15, H100, fifty-eighth session, `host_profile --serving 24 --batch 8`), shapes seen two or
    # three times a pass still reached their eighth run, and a capture of 20-50 ms, in the third pass over the
    # same prompts, and their steps before it ran uncaptured; at 2 the second pass replayed every chained step
    # (in process one 20-ms capture was left in it): 1.669 -> 1.477 ms a step in process, 2.872 -> 2.492 through
    # the services (one run each).
    chain_capture_after: int = 2
    # A step that completes a prompt reads its first token (a wait for the device) after launching the
    # decode step of the others, when a step launched ahead is out (Engine.step): with requests admitted
    # as others end, reading it first left the device idle from each prefill's end to the next launch.
    overlap_prefill: bool = True
    # Through a drafter service too (thirty-sixth session; off until measured): the prefill is read, and its
    # sequences attached to the drafter, after the chained step of the others launched, the attach's row copy
    # on a stream of its own behind the prefill alone (not behind that step), so the drafter's
    # PrefillDrafter (with its --prefill-copies) can answer while our GPU runs the step. Serving through the
    # services at eight streams each arrival's attach held the host 2.9 ms (0.38 ms a step) with the GPU idle.
    # It pays only with device waits: otherwise the attach first reads the answer to the Step just sent
    # ahead, which comes once that step is done. With them a first kernel launch may come while our stream
    # waits (`_quiesce`; the attach's kernels, a concatenation and copies, have run by then): measurement only.
    overlap_attach: bool = False
    # Through a drafter service that offers it (DrafterDescription.step_attach; fifty-ninth session): a completed
    # prompt's attach (its allocation and its rows as a catch-up from position 0) rides the next Step instead of
    # a PrefillDrafter round trip of its own, which first waited for the answer to the Step sent ahead: the
    # sequence sits the engine's steps out until the answer to the Step that carried it is read. Chaining, that
    # is read as the next step's propose goes ahead (after its verify launched), which then asks for the
    # sequence too, so it joins the step after with its drafts there: one step later than before, and no
    # round trip. A refusal is the sequence's alone, as before.
    # Serving 24 held-out prompts through 8 slots (H100, trees of 15), each attach held the host ~2.7 ms. Off until
    # measured on a GPU: its first GPU run found the rows referenced before their generation was recorded (fixed,
    # and the CPU tests now hold every buffer to that rule), and none has run since.
    stream_attach: bool = False
    # Through a drafter service: the chained propose sent ahead as a step launches also asks for the sequences
    # attached since, and the next step takes its drafts for a batch that lost or gained sequences
    # (Engine._ahead_rows). Off: a Step of its own, waited for, at each batch change (measurement only).
    chain_regroup: bool = True
    # ... and a tree step's candidates sent ahead too. Without it each batch change cost a tree step a Step of its
    # own, waited for (sixtieth session: 0.24 a step, 1.3-2.1 ms each, serving through 8 slots). With it (sixty-
    # second session, H100, `gpu_round.sh round61`, alternating): 2.234 / 2.332 ms a step against 2.457 / 2.526,
    # the Step answers waited for 0.01 a step instead of 0.24; its GPU tests passed. Off: tree steps take
    # candidates sent ahead for the same batch alone.
    tree_regroup: bool = True
    # With device waits whose DONE buffer is the host page (RemoteProposer.waits_outlive_loads: its watchdog
    # releases with a store, which gets through a kernel module's load) our stream's waits are left pending
    # across work that may launch a kernel for the first time: no `_quiesce`, no host wait for the drafts of a
    # chained step that is not the one before. Off (the waits drained as for device memory) until the H200
    # has run the hang's test with the page (thirty-eighth session; `gpu_round.sh host-flags`).
    unquiesced_host_flags: bool = False
    # Greedy steps of a DFlash drafter verify a draft tree of this many nodes a sequence instead of
    # one chain (`shared.tree`): the best rank paths of the block's rows by summed log-probability, each row
    # offering its `draft_tree_keep` best tokens. On the shipped drafter's held-out walk a tree of 15 nodes, the
    # chain's verify width, took tau 3.67 -> 4.28 (chat 3.20 -> 3.77; bench/tree_tau.py). On a GPU tree steps
    # chain and replay as one graph as chain steps do (`_chain_tree`); through a drafter service that offers
    # candidates (`RemoteProposer(tree_keep=...)`, ChainStep.tree_keep) the drafter answers each row's best
    # tokens and the rest replays as the target's graph (`_chain_tail`). A tree may have more nodes than the
    # drafter has rows (the walk: tau 4.67 at 31 nodes from the same 15 rows): its verify is wider, its paths no
    # deeper. 0: chains.
    draft_tree: int = 0
    draft_tree_keep: int = TREE_KEEP
    # Trees only in steps of at most this many sequences (None: any); larger steps verify chains. A wider batch
    # makes the verify's extra rows cost more and gains the same tau: at eight streams trees did not beat chains
    # (H100, forty-third and forty-fourth sessions), and did with the forty-eighth session's one-launch kernels
    # (1.2-1.33x, forty-ninth; `target serve --draft-tree-batch` 8). Tree buckets are captured only up to this batch.
    draft_tree_batch: int | None = None
    # Smaller trees in larger steps: `((2, 15),)` with draft_tree 31 verifies trees of 31 nodes at one stream and
    # of 15 from two sequences on (a pair (N, 0): chains from N on). A wider verify costs more the more sequences
    # share it, and a tree's extra nodes gain tau slower than its rows (the held-out walk: 4.28, 4.67, 5.00 at
    # 15, 31 and 63 nodes). Pairs lower the nodes as `drafts_by_batch` lowers drafts (`trees_for`).
    trees_by_batch: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if min(self.max_batch, self.prefill_chunk, self.prefill_tokens, self.kv_blocks, self.kv_block_size) <= 0:
            raise InvalidRequest("engine sizes must be positive")
        if isinstance(self.graphed_prefill, bool) or not isinstance(self.graphed_prefill, int) \
                or self.graphed_prefill < 0:
            raise InvalidRequest(f"graphed_prefill is a number of tokens >= 0, got {self.graphed_prefill!r}")
        if self.num_drafts is not None and self.num_drafts < 0:
            raise InvalidRequest("num_drafts must be >= 0")
        if self.resume_after is not None and (isinstance(self.resume_after, bool)
                                              or not isinstance(self.resume_after, int) or self.resume_after < 1):
            raise InvalidRequest(f"resume_after is a number of steps >= 1 or None, got {self.resume_after!r}")
        if isinstance(self.chain_capture, bool) or not isinstance(self.chain_capture, int) or self.chain_capture < 0:
            raise InvalidRequest(f"chain_capture is a number of sequences >= 0, got {self.chain_capture!r}")
        for name, least in (("chain_programs", 1), ("chain_capture_after", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidRequest(f"{name} is a number >= {least}, got {value!r}")
        for name in ("chain_capture_remote", "stream_attach", "tree_regroup"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} is true or false, got {getattr(self, name)!r}")
        for name, least, most in (("draft_tree", 0, MAX_TREE_NODES), ("draft_tree_keep", 1, MAX_TREE_KEEP),
                                  ("draft_tree_batch", 1, self.max_batch)):
            value = getattr(self, name)
            if name == "draft_tree_batch" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
                raise InvalidRequest(f"{name} is a number in {least}..{most}, got {value!r}")
        for pair in self.drafts_by_batch:
            if len(pair) != 2 or pair[0] < 1 or pair[1] < 0:
                raise InvalidRequest(f"drafts_by_batch: {pair!r} is not a (sequences >= 1, drafts >= 0) pair")
        for pair in self.trees_by_batch:
            if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in pair) or pair[0] < 1 \
                    or not 0 <= pair[1] <= MAX_TREE_NODES:
                raise InvalidRequest(f"trees_by_batch: {pair!r} is not a (sequences >= 1, nodes in "
                                     f"0..{MAX_TREE_NODES}) pair")

    def drafts_for(self, num_seqs: int, most: int) -> int:
        """The drafts per sequence in a step of `num_seqs` sequences, for a drafter that offers `most`."""
        limit = most if self.num_drafts is None else min(most, self.num_drafts)
        for from_seqs, drafts in self.drafts_by_batch:
            if num_seqs >= from_seqs:
                limit = min(limit, drafts)
        return limit

    def trees_for(self, num_seqs: int) -> int:
        """The nodes of the draft trees a step of `num_seqs` sequences verifies (0: chains): `draft_tree`, lowered
        by `trees_by_batch` and none past `draft_tree_batch`."""
        if self.draft_tree_batch is not None and num_seqs > self.draft_tree_batch:
            return 0
        nodes = self.draft_tree
        for from_seqs, most in self.trees_by_batch:
            if num_seqs >= from_seqs:
                nodes = min(nodes, most)
        return nodes


def capture_for(proposer: Proposer | None) -> CaptureSpec:
    if proposer is None or proposer.spec is None:  # a remote drafter that has not answered yet
        return CaptureSpec()
    spec = proposer.spec
    if spec.feature is FeatureKind.LAYER_CONCAT:
        return CaptureSpec(layer_ids=tuple(spec.target_layer_ids))
    return CaptureSpec(last_hidden=True)


class Engine:
    def __init__(
        self,
        model: TargetModel,
        proposer: Proposer | None = None,
        config: EngineConfig = EngineConfig(),
        *,
        eos_ids: Iterable[int] = (),
        text_stream: Callable[[], TextStream] | None = None,
    ) -> None:
        most = getattr(proposer, "max_batch", None)  # (a drafter service's client stages that many sequences' rows)
        if most is not None and most < config.max_batch:
            raise InvalidRequest(f"the drafter client takes up to {most} sequences a step and the engine steps up "
                                 f"to {config.max_batch}: give both the same max_batch")
        self.model = model
        self.proposer = proposer
        self.config = config
        self.eos_ids = frozenset(eos_ids)
        self.text_stream = text_stream  # one incremental detokenizer per request (None: no text)
        self._device = model.embed_weight.device
        use_graphs = config.cuda_graphs and self._device.type == "cuda"
        # Graphs route padding tokens to a scratch block of their own, one past the configured pool.
        self.cache = model.new_cache(config.kv_blocks + use_graphs, config.kv_block_size)
        self.capture = capture_for(proposer)
        self.tuner: DraftTuner | None = None  # with auto_drafts, set once the graphs are captured
        self.graphs = self._capture_graphs() if use_graphs else None
        # Prefill's own captured forwards (buffers apart from the steps': a step launched ahead and not read
        # yet keeps its outputs while a prompt goes in)
        self.prefill_graphs = self.graphed_prefill_forwards() if use_graphs and config.graphed_prefill else None
        self.drafter_ok = proposer is not None and proposer.spec is not None
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.counters = EngineCounters()  # read by target_service.metrics at scrape time
        # Admitted sequences whose prompts are not all in the cache yet, in admission order (see _prefill)
        self._prefilling: dict[int, _Prefill] = {}
        # Sequences whose attach rides a Step not answered yet (EngineConfig.stream_attach), and the engine
        # steps each has sat out so far: they sit steps out until it is
        self._attaching: dict[int, _Attaching] = {}
        self._prefill_seconds = 0.0  # host time in prefill steps so far (left out of a launched step's time)
        self._spec = proposer.spec if proposer is not None else None  # the spec capture and graphs follow
        self.tuner = self._new_tuner()
        # Drafts launched at the end of a step for the next (see _prefetch_drafts): (requests, drafts).
        self._prefetched: tuple[list[ProposeRequest], DeviceDrafts] | None = None
        self._prefetch_seconds = 0.0  # host time of that launch, counted in the next step's time (tuner)
        # A decode step launched ahead, its picks not yet read (see _decode_step_ahead), and its sampled
        # requests' generator states from before its draws
        self._ahead: LaunchedStep | None = None
        self._ahead_draws: list[tuple[Sequence, torch.Tensor]] = []
        # A speculative step's verify launched ahead, before the step before it emitted (see _launch_ahead)
        self._launched: _LaunchedVerify | None = None
        # A chained step launched and not yet read (see _chain_step), where their picks land, and when
        # the last one was read (a chained step's time is the time between two reads)
        self._chain: ChainedStep | None = None
        self._chain_buffers: ChainBuffers | None = None
        # (n, k, tree rows or 0) → program, least recently used first
        self._chain_programs: dict[tuple[int, int, int], ChainProgram] = {}
        # The sequences and k of the chained propose a drafter service was sent as the last step launched
        # (see _chain_send_ahead), for the next launch only
        self._sent_ahead: tuple[tuple[int, ...], object] | None = None  # (see _ahead_key)
        self._chain_pool = None  # the memory pool their captured graphs share
        self._side_stream: "torch.cuda.Stream | None" = None  # the attaches' stream (overlap_attach, made on first use)
        self._chain_capture_most = config.chain_capture if use_graphs else 0
        self._chain_read_at: float | None = None
        self._chain_prefill_clock = 0.0  # _prefill_seconds at that read
        self._chain_read_shape: tuple[list[int], int] = ([], 0)  # that step's sequences and k (for the tuner)
        self._drafting_streak = 0  # steps in a row the schedule gave drafts while sequences rested (resume_after)

    def _new_tuner(self) -> DraftTuner | None:
        if not self.config.auto_drafts or self.proposer is None or self.proposer.spec is None:
            return None
        return DraftTuner(self.config.drafts_for(1, self.proposer.spec.max_drafts))

    def _capture_graphs(self, *, use_graphs: bool = True) -> StepGraphs:
        drafts = self._max_drafts()
        longest = self.model.config.max_position_embeddings + drafts + 1
        # A verify length per draft length the schedule can pick (each captured for every batch bucket).
        shorter = {self._max_drafts(n) + 1 for n, _ in self.config.drafts_by_batch if n <= self.config.max_batch}
        if self.config.auto_drafts and self.proposer is not None and self.proposer.spec is not None:
            shorter |= {k + 1 for k in self._new_tuner().choices}
        cfg = self.model.config
        windowed = any(cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers))
        # a tree verify's rows per step size (EngineConfig.trees_for), each captured in its batch bucket
        trees = () if windowed else {(n, self.config.trees_for(n) + 1) for n in range(1, self.config.max_batch + 1)
                                     if self.config.trees_for(n)}
        return StepGraphs(self.model, self.cache, self.capture, max_batch=self.config.max_batch,
                          query_lens=(1, drafts + 1, *shorter), tree_shapes=trees, use_graphs=use_graphs,
                          max_len=min(longest + self.config.draft_tree,
                                      self.config.kv_blocks * self.config.kv_block_size))

    def graphed_prefill_forwards(self, *, use_graphs: bool = True) -> PrefillForwards:
        """The static forwards prompts go in through (`EngineConfig.graphed_prefill`), captured as CUDA
        graphs, or run eagerly with `use_graphs=False` (their reference, on any device)."""
        config = self.config
        longest = min(self.model.config.max_position_embeddings + self._max_drafts() + 1,
                      config.kv_blocks * config.kv_block_size)
        short = min(_GRAPHED_PREFILL_CHUNK, config.prefill_chunk)
        long = min(_GRAPHED_PREFILL_LONG, config.prefill_chunk)

        def forwards(batch: int, chunk: int) -> StepGraphs:
            return StepGraphs(self.model, self.cache, self.capture, max_batch=batch, query_lens=(chunk,),
                              max_len=longest, use_graphs=use_graphs)
        long_forwards = None
        if long > short:
            try:
                long_forwards = forwards(1, long)
            except Exception as exc:  # noqa: BLE001 - only what leaves CUDA as it was, see _out_of_room
                if not _out_of_room(exc):
                    raise
                log.warning("the %d-token captured prefill forward did not fit (%s: %s); longer prompts go in "
                            "eagerly", long, type(exc).__name__, str(exc)[:200])
        return PrefillForwards(forwards(min(config.max_batch, _GRAPHED_PREFILL_BATCH), short), long_forwards,
                               use_graphs)

    def _max_drafts(self, num_seqs: int = 1) -> int:
        """The most drafts per sequence in a step of `num_seqs` sequences."""
        if self.proposer is None or self.proposer.spec is None:
            return 0
        most = self.config.drafts_for(num_seqs, self.proposer.spec.max_drafts)
        return most if self.tuner is None else self.tuner.choose(num_seqs, most)

    # ---- public API -------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.validate(request)
        if request.request_id in self.running or any(s.request.request_id == request.request_id for s in self.waiting):
            raise InvalidRequest(f"request id {request.request_id!r} is already in flight")
        seq = Sequence(
            seq_id=next(self._ids),
            request=request,
            generator=make_generator(request.params.seed, self._device),
            eos_ids=self.eos_ids,
            tokens=list(request.prompt_ids),
            detok=self.text_stream() if self.text_stream is not None else None,
        )
        seq.stats.prompt_tokens = len(request.prompt_ids)
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        for seq in list(self.waiting):
            if seq.request.request_id == request_id:
                self.waiting.remove(seq)
                return True
        seq = self.running.get(request_id)
        if seq is None:
            return False
        seq.finish_reason = FinishReason.CANCELLED
        self._release(seq)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def prefilling(self) -> int:
        """Admitted sequences (counted in `running`) whose prompts are still going in, a chunk per step."""
        return len(self._prefilling)

    @property
    def prefill_seconds(self) -> float:
        """Host seconds spent so far launching admission's prefill forwards and reading their first tokens."""
        return self._prefill_seconds

    def step(self) -> list[StepEvent]:
        """Admit waiting requests and run one prefill forward, then one speculative (or serial) step for
        the sequences whose prompts were in before it.

        The prefill's first tokens are read (a wait for the device) after the decode step is launched when
        a step launched ahead is out (a chained step, or target-only decoding one step ahead): the device
        then runs that step, the prefill and the next step back to back while the host samples, attaches
        the drafter and emits, where reading them first left it idle from the prefill's end to the next
        launch (`_overlaps_prefill`)."""
        self._settle_attaches(read=False)
        self._maybe_reattach(list(self.running.values()))
        prefill = self._admit()
        done = {seq.seq_id for seq in prefill.done} if prefill is not None else set()
        decoding = [s for s in self.running.values() if s.seq_id not in done and s.seq_id not in self._prefilling
                    and s.seq_id not in self._attaching]
        if not decoding and prefill is None and self._attaching:
            self._settle_attaches(wait=True)  # (nothing else to run: their Step goes now, its answer waited for)
            return []
        overlap = prefill is not None and bool(decoding) and self._overlaps_prefill()
        events = [] if overlap else self._finish_prefill(prefill)
        if decoding:
            events += self._decode_step(decoding)
        if overlap:
            events += self._finish_prefill(prefill, overlapped=True)
            self._send_ahead_again()
        return events

    def _overlaps_prefill(self) -> bool:
        """Whether this step's prefill is read after its decode step launches (see `step`): target-only with a
        decode step launched ahead, or an in-process drafter with a chained step out. Otherwise the decode
        step reads its own step at once, and reading the prefill after it would only hold the new requests'
        first tokens back a step. Not through a drafter service: its attach (a round trip) waits for the
        chained step just launched, whose drafts the service is answering, so the host would wait a whole
        step for nothing (and with device waits a first kernel launch may come while our stream waits,
        `_quiesce`), unless `overlap_attach` asks for it."""
        if not self.config.overlap_prefill:
            return False
        if self.proposer is None:
            return self._ahead is not None
        waits = getattr(self.proposer, "waits_on_device", False)
        return self._chain is not None and (self.config.overlap_attach or (
            _capability(self.proposer, "chain_prefetch") is None and not waits))

    def generate(self, requests: list[Request]) -> dict[str, list[StepEvent]]:
        """Run requests to completion; returns each request's events in order."""
        for request in requests:
            self.add(request)
        out: dict[str, list[StepEvent]] = {r.request_id: [] for r in requests}
        while self.has_work:
            for event in self.step():
                out[event.request_id].append(event)
        return out

    # ---- admission and prefill --------------------------------------------------------------

    def validate(self, request: Request) -> None:
        """Raise InvalidRequest / CapacityExceeded for a request this engine can never serve."""
        if not request.prompt_ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        limit = self.model.config.max_position_embeddings
        budget = len(request.prompt_ids) + request.params.max_tokens
        if budget > limit:
            raise InvalidRequest(f"prompt ({len(request.prompt_ids)}) + max_tokens "
                                 f"({request.params.max_tokens}) exceeds the context length {limit}")
        if self._blocks_for(budget) > self.config.kv_blocks:
            raise CapacityExceeded(f"a {budget}-token request does not fit the KV cache")
        # Issue 9: a stop id outside the vocabulary can never match; it is a malformed request.
        if any(not 0 <= t < vocab for t in request.params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be in [0, {vocab})")

    def _blocks_for(self, tokens: int) -> int:
        return self._blocks(tokens + self._overhang())

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.config.kv_block_size)

    def _overhang(self) -> int:
        """Positions past a sequence's budget its steps may write, held for it from admission on (its KV
        blocks here, its budget at the drafter): a decode's one row; a verify's drafts and bonus row; with
        chained steps, three steps' (the one launched, the one not read yet, and the one whose propose
        went ahead to a drafter service), so that a sequence keeps chaining to its last token. (With
        one verify's, a sequence within two steps of its budget was left out of the chained steps, and
        each time it was, its batch changed: at eight streams with requests ending and arriving, some
        sequence was that close half the time, and each such step waited for a drafter service's round
        trip and the device.) The rows past the budget are computed for nothing: the sequence has ended
        by the time its step is read. A draft tree's verify holds its nodes, when the drafter offers trees."""
        spec = self.proposer.spec if self.proposer is not None else None
        if spec is None:
            return 1
        tree = self.config.draft_tree if self._offers_trees() else 0
        return (3 if self._chains() else 1) * (max(spec.max_drafts, tree) + 1)

    def _offers_trees(self) -> bool:
        """Whether the proposer answers draft-tree candidates (a drafter service's: once attached, if it does)."""
        return (_capability(self.proposer, "chain_candidates") is not None
                or _capability(self.proposer, "propose_candidates") is not None) \
            and getattr(self.proposer, "tree_candidates", True)

    def _chains(self) -> bool:
        """Whether this engine's speculative steps may chain now (see _chain_plan; a drafter service's
        `chains` goes while it is detached)."""
        return self.config.chain_steps and self.config.decode_ahead and self.graphs is not None \
            and bool(self.capture.layer_ids) and getattr(self.proposer, "chains", True) \
            and _capability(self.proposer, "chain_batch") is not None

    def _admit(self) -> "_Prefilled | None":
        """Admit what fits, then launch one prefill forward for the prompts not yet in (see _prefill); None
        when no prompt is going in."""
        reserved = sum(self._blocks(s.reserved_tokens) for s in self.running.values())
        capacity = self.config.kv_blocks * self.config.kv_block_size
        while self.waiting and len(self.running) < self.config.max_batch:
            seq = self.waiting[0]
            # (within the cache, whatever the overhang was when the request was validated: a request that
            # fits alone is never held back for good; a sequence held less room chains less near its end)
            tokens = min(seq.budget_tokens + self._overhang(), capacity)
            blocks = self._blocks(tokens)
            if reserved + blocks > self.config.kv_blocks:
                break
            reserved += blocks
            seq.reserved_tokens = tokens
            self.waiting.popleft()
            self.running[seq.request.request_id] = seq
            self.cache.allocate(seq.seq_id)
            self._prefilling[seq.seq_id] = _Prefill(seq)
        if not self._prefilling:
            return None
        self._quiesce()
        started = time.perf_counter()
        try:
            return self._prefill()
        finally:
            self._prefill_seconds += time.perf_counter() - started

    def _prefill(self) -> "_Prefilled":
        """One prefill forward per engine step, packed: it takes the next chunk of as many prompts as fit
        (see `_prefill_plan`), so admitting many short prompts costs a few forwards, not one each, and a
        long prompt goes in over several steps while the running sequences keep decoding between its
        chunks (a cancel between two of them ends it there, without an event). Through the captured
        forwards (`_graphed_prefill_plan`) it may be two: a long prompt's chunk and short prompts'. The
        prompts it completes get their first token, and the drafter their rows, in one context forward,
        when `_finish_prefill` reads what this launched."""
        pending = list(self._prefilling.values())
        offsets = {p.seq.seq_id: p.offset for p in pending}
        plans = self._graphed_prefill_plan([p.seq for p in pending], offsets) \
            or [(None, self._prefill_plan([p.seq for p in pending], offsets))]
        done, last_logits, rows = [], [], {}
        for forwards, group in plans:
            inputs = [seq.request.prompt_ids[offsets[seq.seq_id]:offsets[seq.seq_id] + n] for seq, n in group]
            ids, starts = [seq.seq_id for seq, _ in group], [offsets[s.seq_id] for s, _ in group]
            if forwards is not None:
                out = forwards.forward(StepBatch(ids, inputs, starts))  # rows in token order
                # (from pinned memory: a pageable copy would wait for the device, and a chunk that completes
                # no prompt has nothing else to wait for, so the chained step launched before runs on)
                ends = device_longs(list(itertools.accumulate(n for _, n in group)), out.logits.device) - 1
                out = ForwardOutput(out.logits.index_select(0, ends), out.layer_features, out.last_hidden)
                self.counters.graphed_prefills += 1
            else:
                out = self._forward(ids, inputs, starts, logits_last_only=True)
            features, row = self._features(out), 0
            for i, (seq, n) in enumerate(group):
                state = self._prefilling[seq.seq_id]
                if features is not None and seq.request.speculative and not seq.drafter_refused:
                    # its own rows: a view would keep the whole packed forward's rows alive until it is in
                    state.rows.append(features[row:row + n] if len(group) == 1 else features[row:row + n].clone())
                row += n
                state.offset += n
                if state.offset == len(seq.request.prompt_ids):
                    del self._prefilling[seq.seq_id]
                    done.append(seq)
                    last_logits.append(out.logits[i])
                    rows[seq.seq_id] = state.rows
        if not done:
            return _Prefilled([], {}, None, None)
        # Their first tokens picked on the device and copied into pinned memory, in stream order before
        # anything launched after: `_finish_prefill` waits for this copy alone, not for a step launched since
        picks = self._first_picks(done, torch.stack(last_logits))
        host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=picks.is_cuda)
        host.copy_(picks, non_blocking=picks.is_cuda)
        copied = None
        if picks.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        return _Prefilled(done, rows, host, copied)

    def _first_picks(self, done: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """[D] int64 on the device: each completed prompt's first token, what `_sample` with no drafts gives
        (greedy: the argmax; sampled: `sample_tokens`, from the same uniform of its generator)."""
        picks = logits.argmax(dim=-1)
        sampled = [i for i, seq in enumerate(done) if not seq.request.params.greedy]
        if sampled:
            drawn = sample_tokens(logits, sampled, [done[i].request.params for i in sampled],
                                  [done[i].generator for i in sampled])
            picks.index_copy_(0, device_longs(sampled, picks.device), drawn)
        return picks

    def _finish_prefill(self, prefill: "_Prefilled | None", overlapped: bool = False) -> list[StepEvent]:
        """The first tokens of the prompts `prefill` completed (a wait for their copy), the drafter's rows
        for them, their events. overlapped: read after the next step launched (see `_attach_stream`)."""
        if prefill is None or not prefill.done:
            return []
        started = time.perf_counter()
        try:
            if prefill.copied is not None:
                prefill.copied.synchronize()
            after = prefill.copied if overlapped and self.config.overlap_attach \
                and _capability(self.proposer, "chain_prefetch") is not None else None
            return self._first_tokens(prefill.done, [[t] for t in prefill.firsts.tolist()], prefill.rows, after)
        finally:
            self._prefill_seconds += time.perf_counter() - started

    def _attach_stream(self, after: "torch.cuda.Event | None") -> "torch.cuda.Stream | None":
        """With `after` (overlap_attach through a drafter service, on a GPU): the stream the attaches' rows go
        to the drafter on (their concatenation and their copy into its buffer), behind `after`, the prefill's
        end, not behind the step launched since: the drafter sees them written while our GPU runs that step."""
        if after is None:
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self._device)
        self._side_stream.wait_event(after)
        return self._side_stream

    def _first_tokens(self, done: list[Sequence], firsts: list[list[int]],
                      rows: dict[int, list[torch.Tensor]], after: "torch.cuda.Event | None" = None
                      ) -> list[StepEvent]:
        for seq in done:
            seq.stats.steps += 1
            self.counters.prefills += 1
        attaching = [seq for seq in done if self._speculating(seq)]
        # the next step's batch size drafts nothing: they rest from the drafter at once (EngineConfig.resume_after)
        # (sequences whose attach rides a Step count: they step again within a step or two)
        stepping = sum(1 for s in self.running.values() if s.seq_id not in self._prefilling)
        if attaching and self.config.resume_after is not None and self._schedule_drafts(stepping) == 0:
            for seq in attaching:
                seq.drafter_resting = True
                self.counters.rests += 1
            attaching = []
        if attaching:
            # The drafter's context forward: prefetched drafts are not taken past other drafter work
            # (see _prefetch_drafts).
            self._prefetched = None
            side = self._attach_stream(after)
            with self._batched_appends():  # one drafter context forward for every completed prompt
                for seq in attaching:
                    if self.drafter_ok:
                        self._attach(seq, seq.request.prompt_ids, rows[seq.seq_id], side,
                                     on_stream=self.config.stream_attach)
        return [self._emit(seq, first) for seq, first in zip(done, firsts)]

    def _graphed_prefill_plan(self, pending: list[Sequence], offsets: dict[int, int]
                              ) -> list[tuple[StepGraphs, list[tuple[Sequence, int]]]]:
        """This engine step's captured prefill forwards (`EngineConfig.graphed_prefill`), each with its
        [(sequence, tokens)], or [] when it goes eagerly. A prompt with more than `graphed_prefill` tokens
        still to go in, the first such in admission order, sends its next chunk alone through the long
        forwards (without them, while it waits first, the step goes eagerly); the next chunk of as many
        shorter ones, in admission order, as the short forwards hold (and `prefill_tokens` allows) goes
        through those in the same step, so they do not wait out a long prompt."""
        forwards = self.prefill_graphs
        if forwards is None:
            return []
        lefts = [len(seq.request.prompt_ids) - offsets[seq.seq_id] for seq in pending]
        long = next((i for i, left in enumerate(lefts) if left > self.config.graphed_prefill), None)
        if long == 0 and forwards.long is None:
            return []  # (the first goes first, eagerly)
        plans = []
        if long is not None and forwards.long is not None:
            plans.append((forwards.long, [(pending[long], min(forwards.long.query_lens[-1], lefts[long]))]))
        chunk, most = forwards.short.query_lens[-1], forwards.short.batches[-1]
        group, tokens = [], 0
        for seq, left in zip(pending, lefts):
            n = min(chunk, left)
            if left <= self.config.graphed_prefill and (not group or tokens + n <= self.config.prefill_tokens):
                group.append((seq, n))
                tokens += n
                if len(group) == most:
                    break
        if group:
            plans.append((forwards.short, group))
        return plans

    def _prefill_plan(self, pending: list[Sequence], offsets: dict[int, int]) -> list[tuple[Sequence, int]]:
        """The next prefill forward: (sequence, tokens) for the next chunk of each prompt that fits, in
        admission order. The first always goes; others join while the forward stays within
        `prefill_tokens` tokens and its padded attention (sequences × longest chunk × longest context)
        within what one lone full chunk over `prefill_tokens` of context would cost."""
        chunk, budget = self.config.prefill_chunk, self.config.prefill_tokens
        cells = max(chunk, budget) * budget
        group: list[tuple[Sequence, int]] = []
        tokens = widest = longest = 0
        for seq in pending:
            start = offsets[seq.seq_id]
            n = min(chunk, len(seq.request.prompt_ids) - start)
            grown = (len(group) + 1) * max(widest, n) * max(longest, start + n)
            if group and (tokens + n > budget or grown > cells):
                continue
            group.append((seq, n))
            tokens, widest, longest = tokens + n, max(widest, n), max(longest, start + n)
        return group

    # ---- the decode step ----------------------------------------------------------------------

    def _speculating(self, seq: Sequence) -> bool:
        return self.drafter_ok and seq.request.speculative and not seq.drafter_refused

    def _decode_step(self, seqs: list[Sequence]) -> list[StepEvent]:
        self._rest_or_resume(seqs)
        k, chained = self._chain_plan(seqs)
        if k or self._chain is not None:
            events = self._chain_step(chained, k)
            if events is not None:
                return events
        if self._tree_steps(seqs):
            return self._tree_step(seqs)
        self._chain_read_at = None
        self._quiesce()
        if self._decodes_ahead(seqs):
            self._launched = None
            return self._decode_step_ahead(seqs)
        self._drop_ahead()
        launched = self._take_launched(seqs)
        if launched is not None:  # its verify time: the host's wait for it from here, and the accepts
            return self._finish_verify(launched, time.perf_counter())
        return self._finish_verify(self._launch_verify(seqs))

    def _schedule_drafts(self, num_seqs: int) -> int | None:
        """The drafts the schedule (num_drafts, drafts_by_batch) gives a step of `num_seqs` sequences; None
        without a drafter to draft them (none, detached, or one that has not answered yet)."""
        if self.proposer is None or self.proposer.spec is None or not self.drafter_ok:
            return None
        return self.config.drafts_for(num_seqs, self.proposer.spec.max_drafts)

    def _rest_or_resume(self, seqs: list[Sequence]) -> None:
        """EngineConfig.resume_after: a step whose batch size drafts nothing rests its sequences from the
        drafter (once no chained step is out: the one out is read first, as usual); sequences resting are
        re-attached once the schedule has given drafts `resume_after` steps in a row."""
        drafts = self._schedule_drafts(len(seqs))
        if drafts is None or self.config.resume_after is None:
            return
        if drafts == 0:
            self._drafting_streak = 0
            attached = [s for s in seqs if s.drafter_attached]
            if attached and self._chain is None:
                self._rest(attached)
            return
        resting = [s for s in seqs if s.drafter_resting and self._speculating(s)]
        self._drafting_streak = self._drafting_streak + 1 if resting else 0
        if resting and self._drafting_streak >= self.config.resume_after:
            self._resume(resting)

    def _rest(self, seqs: list[Sequence]) -> None:
        """Free the drafter's state of `seqs`: they decode as target only (no drafter call a step) until
        `_resume`. Drafts prefetched or a verify launched ahead for them are dropped first."""
        self._quiesce()
        self._launched, self._prefetched, self._prefetch_seconds = None, None, 0.0
        for seq in seqs:
            self._forget(seq)
            seq.drafter_attached, seq.drafter_resting = False, True
            self.counters.rests += 1
        log.debug("%d sequences rest from the drafter: the schedule drafts nothing at this batch size", len(seqs))

    def _resume(self, seqs: list[Sequence]) -> None:
        """Attach resting sequences again, each from its rows re-captured (`_recapture`, as after an
        outage), in one drafter context forward where the drafter batches appends. A decode step launched
        ahead is dropped first (its tokens are computed again, the same way)."""
        self._quiesce()
        self._drop_ahead()
        self._launched, self._prefetched, self._prefetch_seconds = None, None, 0.0
        self._drafting_streak = 0
        with self._batched_appends():
            for seq in seqs:
                if not self.drafter_ok:
                    break
                self._attach(seq, seq.tokens[:-1], self._recapture(seq))
                self.counters.resumes += seq.drafter_attached

    def _tree_steps(self, seqs: list[Sequence]) -> bool:
        """Whether this step verifies draft trees (EngineConfig.draft_tree): every sequence greedy, an
        in-process drafter that offers candidates, one sequence attached to it at least, nothing chained or
        launched ahead pending."""
        return self.config.trees_for(len(seqs)) > 0 and self.drafter_ok and self._chain is None \
            and any(s.drafter_attached for s in seqs) \
            and _capability(self.proposer, "propose_candidates") is not None \
            and all(s.request.params.greedy for s in seqs)

    def _tree_step(self, seqs: list[Sequence]) -> list[StepEvent]:
        """One greedy step verifying a draft tree a sequence, step by step (a captured tree bucket's verify on
        a GPU, the eager one elsewhere): the drafter's candidates, each sequence's best-first tree, one forward
        over every tree (`ForwardBatch.trees`), the longest path of the target's own picks accepted, its k/v
        moved to the positions its tokens take, and the drafter told as if that path had been a chain drafted
        and accepted whole."""
        self._quiesce()
        self._drop_ahead()
        self._launched, self._prefetched, self._prefetch_seconds = None, None, 0.0
        counts = self._draft_counts(seqs)
        requests, index = self._propose_requests(seqs, counts)
        trees, nodes = [DraftTree((), ()) for _ in seqs], self.config.trees_for(len(seqs))
        started = time.perf_counter()
        if requests:
            got = self._drafter_call(self.proposer.propose_candidates, requests, self.config.draft_tree_keep)
            if got is not _FAILED and not self._candidates_fit(got, requests, counts, index):
                got = _FAILED
            if got is not _FAILED:
                logp, ids = (t.tolist() for t in got)
                for row, i in enumerate(index):
                    trees[i] = best_first(logp[row][:counts[i]], ids[row][:counts[i]], nodes)
            self.counters.propose.observe(time.perf_counter() - started)
        inputs = [[s.tokens[-1], *t.tokens] for s, t in zip(seqs, trees)]
        starts = [s.last_position for s in seqs]
        verify_started = time.perf_counter()
        parents = [t.parents if len(t) else None for t in trees]
        ids = [s.seq_id for s in seqs]
        if self.graphs is not None and self.graphs.tree_bucket(len(seqs), max(map(len, inputs))) is not None:
            out = self.graphs.forward_tree(StepBatch(ids, inputs, starts, trees=parents))
        else:
            out = self._forward(ids, inputs, starts, logits_last_only=False, trees=parents)
        picks = out.logits.argmax(-1).tolist()
        verified = time.perf_counter()
        features = self._features(out)
        done, offset = [], 0
        for seq, tree, start, rows in zip(seqs, trees, starts, inputs):
            nodes, new_tokens = accept_tree(tree, picks[offset:offset + len(rows)])
            self.cache.move(seq.seq_id, [start + 1 + n for n in nodes], [start + 1 + d for d in range(len(nodes))])
            self.cache.truncate(seq.seq_id, start + len(nodes) + 1)
            seq.stats.steps += 1
            seq.stats.drafted += len(tree)
            seq.stats.accepted += len(nodes)
            self.counters.verified(len(tree), len(nodes))
            if features is not None and self.drafter_ok:
                kept = torch.tensor([offset] + [offset + 1 + n for n in nodes], device=features.device)
                self._after_verify(seq, new_tokens[:-1], len(nodes), features[kept], start)
            done.append((seq, new_tokens, seq.accept(new_tokens)))
            offset += len(rows)
        self._count_step(verify_started, verified)
        return [self._emit(seq, new_tokens, kept) for seq, new_tokens, kept in done]

    def _candidates_fit(self, got, requests: list[ProposeRequest], counts: list[int], index: list[int]) -> bool:
        """Whether a drafter's tree candidates keep its contract (one row block a request, as deep as asked,
        target ids, finite log-probabilities); otherwise it is detached, as for drafts out of contract."""
        vocab = self.model.config.vocab_size
        deep = max(counts[i] for i in index)
        logp, ids = got if isinstance(got, tuple) and len(got) == 2 else (None, None)
        fits = isinstance(logp, torch.Tensor) and isinstance(ids, torch.Tensor) and logp.shape == ids.shape \
            and logp.dim() == 3 and logp.shape[0] == len(requests) and logp.shape[1] >= deep \
            and logp.dtype.is_floating_point and not ids.dtype.is_floating_point \
            and bool(torch.isfinite(logp).all()) and bool(((ids >= 0) & (ids < vocab)).all())
        if not fits:
            log.warning("the drafter's tree candidates are out of contract (not [%d, >= %d, K] target ids in "
                        "[0, %d) with finite scores); continuing without speculation", len(requests), deep, vocab)
            self._detach()
        return fits

    def _drop_ahead(self) -> None:
        """Drop a decode step launched ahead and not taken: its sequences' tokens are computed again, the
        same way (its K/V writes are the same values at the same positions), and the sampled ones from
        the same uniforms: their generators go back to where they were before its draws."""
        if self._ahead is not None:
            for seq, state in self._ahead_draws:
                if self._is_running(seq):
                    seq.generator.set_state(state)
        self._ahead, self._ahead_draws = None, []

    def _launch_verify(self, seqs: list[Sequence]) -> _LaunchedVerify:
        """Propose (or take the prefetched drafts) and launch the step's verify, without waiting for it."""
        step_started = time.perf_counter()
        choice = self._max_drafts(len(seqs)) if self.tuner is not None else 0
        wanted = self._draft_counts(seqs)
        drafts, on_device = self._propose(seqs, self._propose_requests(seqs, wanted))
        inputs = [[s.tokens[-1]] + d for s, d in zip(seqs, drafts)]
        starts = [s.last_position for s in seqs]
        started = time.perf_counter()
        out = self._verify_forward([s.seq_id for s in seqs], inputs, starts, on_device)
        return _LaunchedVerify(list(seqs), drafts, starts, on_device, out, choice, step_started, started,
                               self._prefetch_seconds, self.drafter_ok, [len(s.tokens) for s in seqs],
                               wanted, self._prefill_seconds)

    def _take_launched(self, seqs: list[Sequence]) -> _LaunchedVerify | None:
        """The verify launched at the end of the last step, if it holds exactly these sequences as they
        stand (those that ended since it was launched left out); otherwise it is dropped."""
        launched, self._launched = self._launched, None
        if launched is None or launched.drafter_ok != self.drafter_ok:
            return None
        going = [(s, n, k) for s, n, k in zip(launched.seqs, launched.lengths, launched.counts) if self._is_running(s)]
        if [s for s, _, _ in going] != seqs or any(len(s.tokens) != n for s, n, _ in going):
            return None
        # The draft lengths this step would ask for now: with fewer sequences (one ended since), the
        # schedule or the tuner may give a longer draft than was launched
        if self.tuner is not None and self._max_drafts(len(seqs)) != launched.choice:
            return None
        if self._draft_counts(seqs) != [k for _, _, k in going]:
            return None
        return launched

    def _is_running(self, seq: Sequence) -> bool:
        return seq.finish_reason is None and self.running.get(seq.request.request_id) is seq

    def _finish_verify(self, step: _LaunchedVerify, waited_from: float | None = None) -> list[StepEvent]:
        """Read a launched verify back, accept, tell the drafter, prefetch the next drafts, launch the next
        verify when it can go ahead (see _launch_ahead), then emit. Sequences of the step that ended
        after it was launched (a stop string, a cancel) are passed over: their rows were computed for
        nothing."""
        seqs, drafts, starts, on_device, out = step.seqs, step.drafts, step.starts, step.on_device, step.out
        argmax = None
        if on_device is not None:  # one wait for the drafts and the verify's greedy picks together
            drafts, argmax = self._read_drafts(drafts, on_device, out)
        elif any(s.request.params.greedy for s in seqs):
            (argmax,) = out.greedy_picks()
        accepted_tokens = self._sample(seqs, out.logits, drafts, argmax)  # host lists: the device is done
        verified = time.perf_counter()
        going = [self._is_running(s) for s in seqs]
        features = self._features(out)
        offset = 0
        many = _capability(self.proposer, "commit_verified_many") if self.drafter_ok else None
        batch = _VerifiedBatch()  # the step's commits, for a drafter that takes them in one call
        with self._batched_appends():
            for seq, draft, new_tokens, start, live in zip(seqs, drafts, accepted_tokens, starts, going):
                if not live:
                    offset += len(draft) + 1
                    continue
                num_accepted = len(new_tokens) - 1
                self.cache.truncate(seq.seq_id, start + num_accepted + 1)
                seq.stats.steps += 1
                seq.stats.drafted += len(draft)
                seq.stats.accepted += num_accepted
                self.counters.verified(len(draft), num_accepted)
                if many is not None and seq.drafter_attached and (draft or features is not None):
                    # A sequence offered no drafts this step (the batch's draft length, its last token)
                    # joins too: its one row is a catch-up, which is a commit of 1 row with 0 accepted.
                    batch.add(seq, offset, len(draft) + 1, num_accepted, start, [seq.tokens[-1]] + draft[:num_accepted])
                else:
                    rows = features[offset:offset + len(draft) + 1] if features is not None else None
                    self._after_verify(seq, draft, num_accepted, rows, start)
                offset += len(draft) + 1
            if batch.seq_ids:
                self._commit_many(many, batch, features)
        self._count_step(step.verify_started if waited_from is None else waited_from, verified)
        done = [(seq, new_tokens, seq.accept(new_tokens))
                for seq, new_tokens, live in zip(seqs, accepted_tokens, going) if live]
        # The step's time, with its propose when that was launched at the end of the last step; a step
        # that asked for drafts and got none (the drafter failed, refused every sequence) says nothing.
        if self.tuner is not None and self.drafter_ok and (step.choice == 0 or any(drafts)):
            # (a verify launched ahead spans the steps' boundary: a prefill run in between is not its time)
            seconds = time.perf_counter() - step.started + step.prefetch_seconds \
                - (self._prefill_seconds - step.prefill_clock)
            self.tuner.observe(len(seqs), step.choice, seconds,
                               [(len(d), len(t) - 1) for d, t in zip(drafts, accepted_tokens)])
        self._prefetch_seconds = 0.0
        # The next step's drafts can be computed now: the drafter runs on the GPU while the host
        # detokenizes, emits and starts the next step.
        stepped = [seq for seq, _, _ in done]
        prefetch_started = time.perf_counter()
        self._prefetch_drafts(stepped)
        if self._prefetched is not None:
            self._prefetch_seconds = time.perf_counter() - prefetch_started
        self._launch_ahead(stepped)
        return [self._emit(seq, new_tokens, kept) for seq, new_tokens, kept in done]

    def _launch_ahead(self, stepped: list[Sequence]) -> None:
        """Launch the next step's verify before this step's tokens are emitted, so the device verifies
        while the host detokenizes, emits and admits. Only in-process, on captured steps with drafts
        on the device: every input is known here (the accepted tokens, the drafts just prefetched), and
        nothing but eager work (a prefill) may run before it is read back. A drafter service's drafts
        come in an answer the host would have to wait for first: that path steps as before."""
        if not (self.config.decode_ahead and self.drafter_ok and self.graphs is not None
                and _capability(self.proposer, "propose_on_device") is not None
                and _capability(self.proposer, "prefetch") is None):
            return
        live = [s for s in stepped if s.finish_reason is None]
        if not live or self._decodes_ahead(live) or self.graphs.bucket(len(live), self._max_drafts(len(live)) + 1) is None \
                or self._chain_plan(live)[0]:
            return  # (plain decoding goes ahead its own way, see _decode_step_ahead; chained steps theirs)
        self._launched = self._launch_verify(live)

    def _chain_plan(self, seqs: list[Sequence]) -> tuple[int, list[Sequence]]:
        """The draft length of a chained step of `seqs` (see target_service/chain.py) and the sequences it
        launches; (0, []) when they do not chain: in-process, a drafter that chains attached to one of
        them at least (the others ride along with no drafts), captured steps, and room for the two steps
        the device may run ahead of the host (the launched one and this). A sequence that may lack that
        room once the step launched last time is read waits one step (that read brings it up to date)
        and joins the next.

        Room: anchors below each budget and rows within the context, so every write lies where a
        step-by-step propose and verify would write (and within the blocks admission reserved: the budget
        plus a verify's). A sampled sequence offers the drafts a step-by-step step would give it
        (`_num_drafts`), so that it draws the same uniforms and its seeded tokens do not depend on whether
        steps chain, as long as the draft length does not depend on the batch (with `drafts_by_batch` or
        `auto_drafts` a chained launch sees the batch as the host knew it a step before: still an exact
        sample, as it is when the batch alone changes k); when the step not read yet may leave it
        without room for k, it waits a step."""
        if not (self._chains() and self.drafter_ok):
            return 0, []
        if not any(s.drafter_attached for s in seqs):
            return 0, []  # (plain decoding goes ahead its own way)
        tree = self._tree_depth(seqs) > 0
        k = self.config.trees_for(len(seqs)) if tree else self._max_drafts(len(seqs))
        if k < 1 or (self.graphs.tree_bucket if tree else self.graphs.bucket)(len(seqs), k + 1) is None:
            return 0, []
        pending = self._chain
        ahead = {} if pending is None else {s.seq_id: n + 1 for s, n in zip(pending.seqs, pending.counts)}
        if not all(self._chain_room(s, 0, k) for s in seqs):
            return 0, []  # one that could not chain even with nothing pending
        chained = [s for s in seqs if self._chain_room(s, ahead.get(s.seq_id, 0), k)]
        if tree and self.config.trees_for(len(chained)) != k:
            return 0, []  # (fewer sequences' trees have other nodes, `trees_by_batch`: this step goes as usual)
        return (k, chained) if any(s.drafter_attached for s in chained) else (0, [])

    def _tree_depth(self, seqs: list[Sequence]) -> int:
        """How many block rows the trees of a chained step of `seqs` grow from (EngineConfig.draft_tree): the
        drafts the step would offer as a chain (`_max_drafts`: the draft length, its schedule by batch, the
        tuner's choice). 0 when its steps do not verify trees: a sequence sampled or not drafting, a drafter
        that offers no candidates (`chain_candidates`; a drafter service's `tree_candidates`), more sequences
        than `draft_tree_batch`, no tree bucket, no drafts (speculation off at this batch size), or fewer rank
        paths in those rows than the tree's nodes. A tree step of N nodes is a chained step of k = N: the same
        verify width, reservations and outcome; a tree may have more nodes than the drafter has rows (its paths
        are no deeper, and its commit holds the deepest: `ChainProgram.commit_width`)."""
        n, keep = self.config.trees_for(len(seqs)), self.config.draft_tree_keep
        if not (n > 0
                and _capability(self.proposer, "chain_candidates") is not None
                and getattr(self.proposer, "tree_candidates", True)  # (a drafter service's, when it offers them,
                and getattr(self.proposer, "tree_keep", keep) == keep  # as many a row as we ask for)
                and all(s.request.params.greedy and s.drafter_attached for s in seqs)
                and self.graphs.tree_bucket(len(seqs), n + 1) is not None):
            return 0
        depth = min(self._max_drafts(len(seqs)), self._spec.max_drafts)
        return depth if depth >= 1 and holds_nodes(depth, keep, n) else 0

    def _chain_room(self, seq: Sequence, rows: int, k: int, offers_k: bool = True) -> bool:
        """Whether a chained step of k drafts has room for `seq` when the steps launched and not read yet may
        have added `rows` (see _chain_plan): its writes within the context and what was reserved for it,
        and (`offers_k`) a sampled sequence's k drafts within what it may still generate."""
        limit = min(self.model.config.max_position_embeddings, self.graphs.max_blocks * self.cache.block_size)
        end = seq.last_position + rows + k + 1
        if end > limit or end > seq.reserved_tokens:
            return False
        return not offers_k or seq.request.params.greedy or rows == 0 or not seq.drafter_attached \
            or min(seq.remaining - rows - 1, self.model.config.max_position_embeddings - len(seq.tokens) - rows - 1) >= k

    @staticmethod
    def _chain_ends(seqs: list[Sequence], k: int, pending: ChainedStep | None) -> list[int]:
        """Each sequence's furthest position + 1 a chained step with k drafts may write: its last known
        one, plus the tokens the step launched and not read yet may add (when it is in it: its drafts
        offered and one), plus this step's rows."""
        ahead = {} if pending is None else {s.seq_id: n + 1 for s, n in zip(pending.seqs, pending.counts)}
        return [s.last_position + ahead.get(s.seq_id, 0) + k + 1 for s in seqs]

    def _chain_step(self, seqs: list[Sequence], k: int) -> list[StepEvent] | None:
        """Launch the next chained step (k > 0), fed on the device by the one launched last time, then
        read that one and emit its tokens: the device runs a step while the host reads and emits the
        one before. With k == 0 (these sequences do not chain) the last chained step is only read, and
        the next step runs as usual from what the host then knows. None: nothing was launched or read
        (the launch was refused), so this step runs as usual."""
        self._drop_ahead()
        self._launched = self._prefetched = None
        pending, self._chain = self._chain, None
        sent, self._sent_ahead = self._sent_ahead, None
        started = time.perf_counter()
        captures = self.counters.chain_captures
        if k:
            self._chain = self._chain_launch(seqs, k, pending, started, sent if pending is not None else None)
        if self._chain is None or pending is None or self.counters.chain_captures != captures:
            # no chained step follows another: nothing to time against (nor, for the draft-length tuner,
            # a step whose time holds a capture: a one-off cost, not the draft length's)
            self._chain_read_at = None
        if pending is not None:
            return self._chain_read(pending)
        return [] if self._chain is not None else None

    def _chain_launch(self, seqs: list[Sequence], k: int, pending: ChainedStep | None, started: float,
                      sent: tuple[tuple[int, ...], int] | None = None) -> ChainedStep | None:
        """Propose, verify, accept and commit on the device; nothing waits. None if the drafter failed
        before the verify (it is detached; the sequences' host records are as they were) or the cache
        lacks the blocks. sent: the sequences and k of the propose sent ahead as `pending` launched."""
        ids = [s.seq_id for s in seqs]
        planned = self.config.trees_for(len(seqs)) == k  # (the step planned as trees: see _chain_plan)
        tree = self._tree_depth(seqs) if planned else 0  # (its rows; 0: a chain step)
        if not tree and self.graphs.bucket(len(seqs), k + 1) is None:
            return None  # (planned as trees, and some of these sequences cannot take one; or no bucket): as usual
        before = pending.program if pending is not None else None
        if before is None or before is not self._chain_programs.get((len(seqs), k, tree)) \
                or [s.seq_id for s in pending.seqs] != ids or self._chain_capturable(before):
            # Only the same step again (its shape's kernels launched before, the feed in place, no capture)
            # runs while our stream may wait on the device for the drafts, the step before's or its own
            self._quiesce()
            on_host = _capability(self.proposer, "wait_on_host_next")
            if on_host is not None and not self._waits_outlive_loads():
                on_host()
        ends = self._chain_ends(seqs, k, pending)
        firsts = [s.last_position for s in seqs]
        # The drafter's sequences (the others ride along, offering no drafts), and how far each anchor may
        # lie past the drafter's next position: the rows of the step not yet read
        drafting = [i for i, s in enumerate(seqs) if s.drafter_attached]
        if not drafting:
            return None
        batch = self._drafter_call(self.proposer.chain_batch, [ids[i] for i in drafting],
                                   [ends[i] - firsts[i] - k - 1 for i in drafting])
        if batch is None or batch is _FAILED:
            return None
        ahead_rows = self._ahead_rows([ids[i] for i in drafting], self._ahead_key(k, tree), sent) \
            if self._regroups(tree) else None
        if self.cache.num_free_blocks < sum(max(0, self.cache.blocks_for(end) - self.cache.blocks_for(self.cache.length(i)))
                                            for i, end in zip(ids, ends)):
            return None
        # The host's side: tables, the drafter's tables, and the feed unless the step not read yet was
        # this program's with these sequences (its replay left their next anchors in the feed)
        fwd = self.graphs.chain_tables(ids, k + 1, firsts, ends, tree=tree > 0)
        bind = getattr(self.proposer, "chain_bind", None)  # (a drafter whose proposes take no host tables: none)
        if bind is not None and self._drafter_call(bind, batch) is _FAILED:
            return None
        program = self._chain_program(len(seqs), k, tree)
        row_of = {} if pending is None else {s.seq_id: i for i, s in enumerate(pending.seqs)}
        # (read before the feed below may overwrite the step not read yet's; a propose goes ahead only when
        # every sequence drafts)
        back = self._rejoining(ids, k, pending, tree) if len(drafting) == len(seqs) else None
        if pending is None or pending.program is not program or [s.seq_id for s in pending.seqs] != ids:
            program.feed.copy_(torch.stack(self._chain_feed(seqs, firsts, pending, row_of)))
        # each sequence's drafts offered: none without a drafter; a sampled one's as a step-by-step step
        # would offer (known on the host when the step not read yet does not hold it; otherwise it has
        # room for all k, see _chain_plan)
        counts = [0 if not s.drafter_attached else k if s.request.params.greedy or s.seq_id in row_of
                  else self._num_drafts(s, k) for s in seqs]
        among = None if len(drafting) == len(seqs) else device_longs(drafting, self._device)

        def device_work(call) -> bool:
            return self._chain_device(call, program, batch, fwd, seqs, counts, among, ahead_rows)

        whole = among is None and all(s.request.params.greedy for s in seqs)
        if whole and self.config.chain_capture_remote and not getattr(self.proposer, "chain_captured_whole", True):
            ran = self._chain_tail(program, batch, fwd, seqs, counts, ahead_rows)
        else:
            ran = self._chain_run(program, whole, device_work)
        if not ran:
            return None
        if self._chain_buffers is None:
            # as wide as the widest step a bucket holds (a tree step's k is its nodes; a drafter attached later
            # may draft more than this one, never past the buckets)
            widest = max(self.graphs.query_lens + self.graphs.tree_lens) - 1
            self._chain_buffers = ChainBuffers(self.graphs.batches[-1], widest, self._device)
        launched = self._chain_buffers.launch(seqs, k, counts, program, started)
        if among is None:
            self._sent_ahead = self._chain_send_ahead(seqs, k, counts, pending, program, back)
        return launched

    def _regroups(self, tree: int) -> bool:
        """Whether a chained step (`tree`: a tree step) that lost or gained sequences takes their rows of what was
        sent ahead (`EngineConfig.chain_regroup`, `tree_regroup`)."""
        return self.config.chain_regroup and (not tree or self.config.tree_regroup)

    def _ahead_key(self, k: int, tree: int) -> object:
        """What a propose sent ahead must have been asked for to serve a chained step of k drafts (`tree`: a tree
        step's, whatever its nodes: its candidates, the drafter's rows and `draft_tree_keep` a row)."""
        return ("tree", self._spec.max_drafts, self.config.draft_tree_keep) if tree else k

    @staticmethod
    def _ahead_rows(ids: list[int], key: object, sent: tuple[tuple[int, ...], object] | None) -> list[int] | None:
        """Where each of a chained step's drafting sequences lies in the propose sent ahead as the step before
        launched (`sent`), when all of them do and it was asked for what this step takes (`key`: its k, or a
        tree step's candidates, see _ahead_key; None otherwise). Their anchors and positions are
        what it was sent: the feed the step before left for the sequences it held (a batch that changed is
        fed from its rows, see _chain_feed), and the host's own for the others, which no step has moved
        since it was read (those attached as it launched, and those back from sitting it out, sent as the
        step not read then left them, see _chain_send_ahead). So a batch that lost or gained sequences
        takes those drafts (or a tree step's candidates) without a round trip (`RemoteProposer.chain_propose`,
        `chain_candidates`)."""
        if sent is None or sent[1] != key:
            return None
        row = {seq_id: i for i, seq_id in enumerate(sent[0])}
        if any(seq_id not in row for seq_id in ids):
            return None
        return [row[seq_id] for seq_id in ids]

    def _chain_send_ahead(self, seqs: list[Sequence], k: int, counts: list[int], pending: ChainedStep | None,
                          program: ChainProgram, back: "_Rejoining | None" = None) -> tuple[tuple[int, ...], object] | None:
        """A drafter service asked for the next chained step's drafts now, from the feed the step just launched
        leaves: its host receives them while our GPU verifies, and drafts as soon as the verify is done,
        while our host reads the step before and emits it; the next launch takes the drafts if it chains
        these sequences, or some of them, with the same k (`RemoteProposer.chain_prefetch`), else a Step
        of its own goes. Only when every sequence has room for that step with both steps not read yet
        behind it (they are the drafter's too: the steps read since go with the Step after); a sampled
        sequence near its end that may not offer k drafts then is asked for all the same (the next step
        leaves it out, see _chain_plan, and takes the others' rows). Sequences attached to the drafter
        since the last launch, which the next step will add, are asked for too (`_joining`), and those of
        the step not read yet that sit this one out (`back`, see _rejoining): so neither a request's end,
        nor its successor's arrival, nor a sampled sequence stepping out and back costs a round trip.
        A tree step asks for the next tree step's candidates (the drafter's `trees_ahead`), for the same
        sequences. Returns the sequences asked for and what for (`_ahead_key`; None: nothing was sent)."""
        if self._attaching and self.drafter_ok:  # (attached since the last launch: asked for below, see stream_attach)
            self._settle_attaches()
        prefetch = _capability(self.proposer, "chain_prefetch")
        if prefetch is None or not self.drafter_ok \
                or (program.tree and not getattr(self.proposer, "trees_ahead", False)):
            return None
        unread = {} if pending is None else {s.seq_id: n + 1 for s, n in zip(pending.seqs, pending.counts)}
        rows = [unread.get(s.seq_id, 0) + n + 1 for s, n in zip(seqs, counts)]
        if not all(self._chain_room(s, r, k, offers_k=not self.config.chain_regroup) for s, r in zip(seqs, rows)):
            # The step's commit and the settles queued go now all the same, answered later: the next
            # step's own Step then comes after the step read next, whose settles would otherwise meet
            # these in the queue and send them at once, waiting for the answer.
            send = _capability(self.proposer, "send_pending")
            if send is not None:
                self._drafter_call(send)
            return None
        ids = [s.seq_id for s in seqs]
        feeds = [program.feed]
        joining = self._joining(seqs, unread, k) if self._regroups(program.tree) else []
        if joining:  # (their anchors and positions the host's, as the next step's feed takes them)
            ids += [s.seq_id for s in joining]
            rows += [0] * len(joining)
            feeds.append(device_longs([[s.tokens[-1] for s in joining], [s.last_position for s in joining]], self._device))
        if back is not None:
            ids += back.seq_ids
            rows += back.rows
            feeds.append(back.feed)
        anchors, positions = program.feed
        if len(feeds) > 1:
            self._quiesce()  # (the join below may launch a kernel for the first time: no device wait pending)
            anchors, positions = torch.cat(feeds, dim=1)
        key = self._ahead_key(k, program.tree)
        sent = self._drafter_call(prefetch, ids, rows, anchors, positions, *(key[1:] if program.tree else (key,)))
        return None if sent is None or sent is _FAILED else (sent, key)

    def _send_ahead_again(self) -> None:
        """(overlap_attach, through a drafter service) Sequences attached behind the launch whose propose went
        ahead missed it: that propose goes again, for the launched step's sequences still running and those
        the next step may add (attached since, or back from sitting the step out: the step before has been
        read), so the next step takes its drafts (`_ahead_rows`) instead of waiting for a Step of its own.
        Each launched sequence's anchor now lies only that step's rows past the drafter's position, once the
        settles this Step carries are applied."""
        launched, prefetch = self._chain, _capability(self.proposer, "chain_prefetch")
        if launched is None or self._sent_ahead is None or prefetch is None or not self.drafter_ok \
                or (launched.program is not None and launched.program.tree):  # (chains only)
            return
        k = launched.num_drafts
        unread = {s.seq_id: n + 1 for s, n in zip(launched.seqs, launched.counts)}
        going = [i for i, s in enumerate(launched.seqs) if self._is_running(s)]
        joining = self._joining([launched.seqs[i] for i in going], unread, k)
        if not joining:
            return
        self._quiesce()  # (the kernels below may be launched for the first time: no device wait pending)
        feed = torch.stack([launched.anchors, launched.positions])
        if len(going) < len(launched.seqs):  # (an ended sequence's free rides on this Step: not proposed for)
            feed = feed.index_select(1, device_longs(going, self._device))
        anchors, positions = torch.cat([feed, device_longs([[s.tokens[-1] for s in joining],
                                                            [s.last_position for s in joining]], self._device)], dim=1)
        sent = self._drafter_call(prefetch, [launched.seqs[i].seq_id for i in going] + [s.seq_id for s in joining],
                                  [unread[launched.seqs[i].seq_id] for i in going] + [0] * len(joining),
                                  anchors, positions, k)
        if sent is _FAILED:
            return
        if sent is not None:  # (None: nothing sent, the first propose stands)
            self._sent_ahead = (sent, k)

    def _rejoining(self, ids: list[int], k: int, pending: ChainedStep | None, tree: int = 0) -> "_Rejoining | None":
        """The sequences of the step not read yet that sit out the step of `ids` (a sampled one near its end,
        see _chain_plan) and may be back in the next: for the propose sent ahead, their anchors and positions
        as that step leaves them, gathered on the device now (before the new step's feed may overwrite that
        step's program's; they are what the host will know once it has read that step), and its rows, which
        the drafter has not been told yet. None: there are none, or no propose goes ahead."""
        if pending is None or not self._regroups(tree) or _capability(self.proposer, "chain_prefetch") is None \
                or not getattr(self.proposer, "chain_ahead", True):
            return None
        held = set(ids)
        back = [(i, s, n + 1) for i, (s, n) in enumerate(zip(pending.seqs, pending.counts))
                if s.seq_id not in held and s.drafter_attached and self._is_running(s)
                and self._chain_room(s, n + 1, k, offers_k=False)]
        if not back:
            return None
        index = device_longs([i for i, _, _ in back], self._device)
        return _Rejoining([s.seq_id for _, s, _ in back], [rows for _, _, rows in back],
                          torch.stack([pending.anchors, pending.positions]).index_select(1, index))

    def _joining(self, seqs: list[Sequence], unread: dict[int, int], k: int) -> list[Sequence]:
        """The sequences the next chained step may add to `seqs`: attached to the drafter, none of their steps
        unread (their anchor and position are the host's, as the next step's feed takes them, see
        _chain_feed), with room for a step of k; in practice those whose prefill ended this step."""
        if len(self.running) == len(seqs):  # (the usual step: every sequence in it)
            return []
        held = {s.seq_id for s in seqs}
        return [s for s in self.running.values()
                if s.seq_id not in held and s.seq_id not in unread and s.drafter_attached and self._is_running(s)
                and s.seq_id not in self._prefilling and self._chain_room(s, 0, k)]

    def _chain_program(self, n: int, k: int, tree: int = 0) -> ChainProgram:
        """The program of chained steps of n sequences and k drafts, or trees of k nodes grown from `tree` rows
        (made on first use; the least recently used past `EngineConfig.chain_programs` are dropped, with their
        graphs)."""
        program = self._chain_programs.pop((n, k, tree), None)
        if program is None:
            program = ChainProgram(n, k, self._device, tree)
            self.counters.chain_programs_made += 1
            while len(self._chain_programs) >= self.config.chain_programs:
                self._chain_programs.pop(next(iter(self._chain_programs)))
                self.counters.chain_programs_dropped += 1
        self._chain_programs[(n, k, tree)] = program  # (last in order: the most recently used)
        return program

    def _chain_run(self, program: ChainProgram, whole: bool, device_work) -> bool:
        """Run a chained step's device work: replayed as one graph when `whole` (greedy, every sequence
        drafting) and CUDA graphs are on, captured once the shape has run uncaptured often enough
        (`EngineConfig.chain_capture_after`); run uncaptured otherwise, each drafter verb guarded (a failure
        detaches it). False: the drafter failed before the verify."""
        whole = whole and getattr(self.proposer, "chain_captured_whole", True)  # (the services' propose: a round trip)
        if whole and self._chain_capturable(program):
            self._chain_capture(program, lambda: device_work(None))
        if whole and program.graph is not None:
            program.graph.replay()
            self.counters.chain_replays += 1
            return True
        program.runs += 1
        return device_work(self._drafter_call)

    def _chain_capturable(self, program: ChainProgram) -> bool:
        """Not captured yet, run uncaptured often enough, never failed, and small enough."""
        return program.graph is None and program.runs >= self.config.chain_capture_after and not program.broken \
            and program.n <= self._chain_capture_most

    def _chain_capture(self, program: ChainProgram, work: Callable[[], object]) -> None:
        """Capture `work` as the program's graph (a failure marks it broken: it runs uncaptured)."""
        started = time.perf_counter()
        try:
            if self._chain_pool is None:
                self._chain_pool = torch.cuda.graph_pool_handle()
            with inlined():  # the forwards (the drafter's, the verify's) record into this graph
                program.graph = capture_serving(work, self._chain_pool)
            self.counters.chain_captures += 1
            self.counters.chain_capture_seconds += time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - a step that cannot be captured runs uncaptured
            program.broken = True
            log.warning("a chained step of %d sequences and %d drafts could not be captured (%s: %s); it "
                        "runs uncaptured", program.n, program.k, type(exc).__name__, exc)

    def _chain_device(self, call, program: ChainProgram, batch, fwd, seqs: list[Sequence], counts: list[int],
                      among: torch.Tensor | None, ahead_rows: list[int] | None = None) -> bool:
        """A chained step's device work, from `program.feed` to `program.outcome` and the next feed.
        `call` runs the drafter's verbs (`_drafter_call`; None while capturing: a failure then aborts
        the capture). False: the drafter failed before the verify (it is detached)."""
        call = call or (lambda verb, *args: verb(*args))
        if program.tree:
            return self._chain_tree(call, program, batch, fwd, ahead_rows)
        anchors, positions = program.feed
        drafts = self._chain_drafts(call, batch, anchors, positions, program.k, among, len(seqs), ahead_rows)
        if drafts is None:
            return False
        # failing (uncaptured), the drafter is detached; the picks stand (they never depended on the drafts)
        self._chain_verify(program, fwd, seqs, counts, among, drafts,
                           lambda rows, at: call(self.proposer.chain_commit, batch, rows, at, program.k + 1))
        return True

    def _chain_tree(self, call, program: ChainProgram, batch, fwd, ahead_rows: list[int] | None = None) -> bool:
        """A chained step of draft trees (`_tree_depth`), from `program.feed` to `program.outcome` and the next
        feed, all on the device: the drafter's candidates, each sequence's best-first tree of k nodes
        (`kernels.tree_grow`), one verify of the roots and nodes in a tree bucket, the longest path of the target's
        picks accepted (`kernels.tree_accept`), its k/v moved to the positions its tokens take and its rows
        committed to the drafter in their place, as if it had been a chain drafted and accepted whole. The
        rows past it lie where the next verify and propose write first. False: the drafter failed. ahead_rows:
        see _ahead_rows."""
        anchors, positions = program.feed
        got = call(self.proposer.chain_candidates, batch, anchors, positions, self.config.draft_tree_keep,
                   *(() if ahead_rows is None else (None, ahead_rows)))  # (a drafter service's sent ahead alone)
        if got is _FAILED:
            return False
        self._tree_verify(program, fwd, *got,
                          lambda rows, at: call(self.proposer.chain_commit, batch, rows, at, program.commit_width))
        return True

    def _tree_verify(self, program: ChainProgram, fwd, logp: torch.Tensor, ids: torch.Tensor, commit) -> None:
        """A chained tree step's device work from its candidates on (logp and ids [B, rows, keep], the drafter's;
        the first `program.tree` rows are read): the trees, the verify, the accept, `program.outcome`, the k/v
        move, `commit(rows, positions)` of the accepted path's rows in path order, then the next feed."""
        n, k = program.n, program.k
        anchors, positions = program.feed
        logp, ids = logp[:, :program.tree], ids[:, :program.tree]  # the rows this step's drafts may reach
        # the trees, and the verify's tokens and rotary positions (ids clamped into the vocabulary): one launch
        trees, words, tokens, rotary = grow_verify_inputs(logp, ids, k, self.model.config.vocab_size, anchors,
                                                          positions)
        out = self.graphs.chain_run(fwd, tokens, positions, (rotary, words))
        picks = out.bucket_argmax.view(fwd.batch, fwd.query_len)[:n]
        # the accepted paths, the outcome row, the commit's rows and the k/v moves: one launch on a GPU
        kept = accept_tree_step(trees, words, picks, positions, fwd.block_tables[:n], self.cache.block_size,
                                fwd.scratch_slot, program.outcome.view(n, k + 2))
        self.cache.move_slots(kept.move_from.view(-1), kept.move_to.view(-1), kept.move_from.shape[1])
        rows = out.layer_features.view(fwd.batch, fwd.query_len, -1)[:n]
        # the root, then the path in depth order, as deep as the tree's rows reach (`commit_width`)
        order = kept.order[:, :program.commit_width]
        rows = rows.gather(1, order[:, :, None].expand(-1, -1, rows.shape[-1]))
        commit(rows.reshape(-1, rows.shape[-1]), positions)
        positions.add_(kept.accepted + 1)  # the next feed, after everything above read this one
        anchors.copy_(kept.final)

    def _chain_tail(self, program: ChainProgram, batch, fwd, seqs: list[Sequence], counts: list[int],
                    ahead_rows: list[int] | None = None) -> bool:
        """A chained step through a drafter service (`EngineConfig.chain_capture_remote`; greedy, every
        sequence drafting): the propose (the drafter's round trip, or the answer to the one sent ahead),
        then everything from its drafts to the outcome and the next feed, replayed as one graph once the
        shape has run uncaptured `chain_capture_after` times (`program.drafts` its input), then the
        verified rows' commit queued for the next Step from what the graph kept. False: the drafter
        failed before the verify (it is detached)."""

        keep = self.config.draft_tree_keep
        if program.tree and program.candidates is None:  # (the graph's input, as `drafts` is a chain's)
            rows = self._spec.max_drafts
            program.candidates = (torch.zeros((program.n, rows, keep), dtype=torch.float32, device=self._device),
                                  torch.zeros((program.n, rows, keep), dtype=torch.int64, device=self._device))

        def tail() -> None:
            if program.tree:
                self._tree_verify(program, fwd, *program.candidates, program.keep)
            else:
                self._chain_verify(program, fwd, seqs, counts, None, program.drafts, program.keep)

        # Captured before the propose: the graph reads the drafts by address, and nothing waits on our stream
        # yet (with device waits the propose queues a wait for the drafter's done value, and a capture's first
        # allocations must not meet it: a cudaFree would wait for that value)
        if self._chain_capturable(program):
            self._chain_capture(program, tail)
        anchors, positions = program.feed
        if program.tree:
            got = self._drafter_call(self.proposer.chain_candidates, batch, anchors, positions, keep,
                                     program.candidates,  # (into them, straight from the drafts buffer)
                                     *(() if ahead_rows is None else (ahead_rows,)))
            if got is _FAILED:
                return False
            for into, values in zip(program.candidates, got):
                if values is into:
                    continue
                if values.shape != into.shape:  # (the engine's own ask: a drafter answering otherwise is detached)
                    self._detach()
                    return False
                into.copy_(values)
        else:
            drafts = self._chain_drafts(self._drafter_call, batch, anchors, positions, program.k, None, len(seqs),
                                        ahead_rows)
            if drafts is None:
                return False
            program.drafts.copy_(drafts)
        if program.graph is not None:
            program.graph.replay()
            self.counters.chain_replays += 1
        else:
            tail()
            program.runs += 1
        rows, at = program.kept
        self._drafter_call(self.proposer.chain_commit, batch, rows, at, program.commit_width)
        return True

    def _chain_verify(self, program: ChainProgram, fwd, seqs: list[Sequence], counts: list[int],
                      among: torch.Tensor | None, drafts: torch.Tensor, commit) -> None:
        """A chained step's device work from its drafts [B, k] on: the verify, the accept, `program.outcome`,
        `commit(rows, positions)` of the verified rows (the drafter's sequences'), then the next feed."""
        k = program.k
        anchors, positions = program.feed
        out = self.graphs.chain_run(fwd, torch.cat([anchors[:, None], drafts], dim=1), positions)
        if among is None and all(s.request.params.greedy for s in seqs):  # (one launch on a GPU)
            picks = out.bucket_argmax.view(fwd.batch, fwd.query_len)[:len(seqs)]
            accepted, final = accept_chain_step(drafts, picks, program.outcome.view(len(seqs), k + 2))
        else:
            accepted, final = self._chain_accept(seqs, counts, drafts, fwd, out, among)
            write_outcome(drafts, accepted, final, program.outcome.view(len(seqs), k + 2))
        rows = out.layer_features.view(fwd.batch, fwd.query_len, -1)[:len(seqs), :k + 1]
        at = positions
        if among is not None:
            rows, at = rows.index_select(0, among), positions[among]
        commit(rows.reshape(-1, rows.shape[-1]), at)
        positions.add_(accepted + 1)  # the next feed, after everything above read this one
        anchors.copy_(final)

    def _chain_feed(self, seqs: list[Sequence], firsts: list[int], pending: ChainedStep | None,
                    row_of: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The chained step's anchors and their positions [B] on the device: the step not read yet's own
        where it holds a sequence, the host's where not."""
        if pending is not None and [s.seq_id for s in seqs] == [s.seq_id for s in pending.seqs]:
            return pending.anchors, pending.positions  # the same batch: fed as it stands
        # one copy from pinned memory (a pageable one would wait for the device)
        carried = [i for i, s in enumerate(seqs) if s.seq_id in row_of]
        host = torch.tensor([[s.tokens[-1] for s in seqs], firsts, [0] * len(seqs), [0] * len(seqs)],
                            dtype=torch.int64, pin_memory=self._device.type == "cuda")
        host[2, :len(carried)] = torch.tensor(carried, dtype=torch.int64)
        host[3, :len(carried)] = torch.tensor([row_of[seqs[i].seq_id] for i in carried], dtype=torch.int64)
        known = host.to(self._device, non_blocking=True)
        if carried:
            into, src = known[2, :len(carried)], known[3, :len(carried)]
            known[:2].index_copy_(1, into, torch.stack([pending.anchors, pending.positions]).index_select(1, src))
        return known[0], known[1]

    def _chain_drafts(self, call, batch, anchors: torch.Tensor, positions: torch.Tensor, k: int,
                      among: torch.Tensor | None, count: int, ahead_rows: list[int] | None = None) -> torch.Tensor | None:
        """Drafts [B, k] for the verify, clamped into the vocabulary whoever drafted them (see
        _propose_on_device); the sequences without the drafter (not `among` it) get placeholders they
        will accept none of. None if the drafter failed (it is detached). ahead_rows: see _ahead_rows."""
        drafts = call(self.proposer.chain_propose, batch, anchors if among is None else anchors[among],
                      positions if among is None else positions[among], k,
                      *(() if ahead_rows is None else (ahead_rows,)))  # (a drafter service's sent ahead alone)
        if drafts is _FAILED:
            return None
        drafts = drafts.clamp(0, self.model.config.vocab_size - 1)
        if among is None:
            return drafts
        return torch.zeros((count, k), dtype=drafts.dtype, device=drafts.device).index_copy_(0, among, drafts)

    def _chain_accept(self, seqs: list[Sequence], counts: list[int], drafts: torch.Tensor, fwd, out: ForwardOutput,
                      among: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's accepted drafts and the token after them [B] each, on the device: greedy
        acceptance, speculative sampling for the sampled ones (from the uniforms a step-by-step verify
        draws), none accepted without the drafter."""
        n, k = drafts.shape
        picks = out.bucket_argmax.view(fwd.batch, fwd.query_len)[:n, :k + 1]
        accepted = accept_greedy(drafts, picks)
        if among is not None:
            accepted = accepted * (torch.arange(n, device=accepted.device)[:, None] == among).any(dim=1)
        final = picks.gather(1, accepted[:, None]).squeeze(1)  # the bonus pick, or the one that differed
        sampled = [i for i, s in enumerate(seqs) if not s.request.params.greedy]
        if sampled:
            index = device_longs(sampled, self._device)
            logits = out.logits.view(fwd.batch, fwd.query_len, -1).index_select(0, index)[:, :k + 1]
            taken, token = sample_accept(drafts.index_select(0, index), logits, [seqs[i].request.params for i in sampled],
                                         [seqs[i].generator for i in sampled], [counts[i] for i in sampled])
            accepted, final = accepted.index_copy(0, index, taken), final.index_copy(0, index, token)
        return accepted, final

    def _chain_read(self, step: ChainedStep) -> list[StepEvent]:
        """Read a chained step's outcome and bring the host's records up to it: each sequence's tokens
        and stats, the drafter's positions; then emit. Sequences that ended since it was launched are
        passed over (their rows were computed for nothing)."""
        waited_from = time.perf_counter()
        outcome = step.outcome()
        verified = time.perf_counter()
        done = [(seq, accepted, tokens) for seq, (accepted, tokens) in zip(step.seqs, outcome) if self._is_running(seq)]
        if not done:  # every sequence of it ended (or was cancelled) since it was launched
            return []
        k = step.num_drafts
        offered = dict(zip((s.seq_id for s in step.seqs), step.counts))
        for seq, accepted, _ in done:
            seq.stats.steps += 1
            seq.stats.drafted += offered[seq.seq_id]
            seq.stats.accepted += accepted
            self.counters.verified(offered[seq.seq_id], accepted)
        self._count_step(waited_from, verified)
        self.counters.chained += 1
        # A chained step's time: from the last read to this one, steps following each other on the device.
        # Timed only in steady state: the step read before and the one launched since (self._chain) ran the
        # same sequences with the same draft length, and no prefill ran in between. A prefill's device work,
        # a drafter attach's context forward, and a changed batch's or draft length's host wait for the
        # device (`_quiesce`, which un-overlaps the launch next to it) land in the reads on either side
        # whatever k ran. With requests coming and going (eight streams, 32 requests) every k was timed at
        # 2.0 ms a step where steady steps took 1.2, and the rarely timed k won (k = 1, 0.96x target-only
        # where k = 7 gave 1.25x); a one-step retry of another k was timed with its switch in it. Acceptance
        # is counted from every step.
        if self.tuner is not None and not (step.program is not None and step.program.tree):
            shape = ([s.seq_id for s in step.seqs], k)
            launched = self._chain
            steady = self._chain_read_at is not None and self._prefill_seconds == self._chain_prefill_clock \
                and shape == self._chain_read_shape and launched is not None \
                and ([s.seq_id for s in launched.seqs], launched.num_drafts) == shape
            self.tuner.observe(len(step.seqs), k, verified - self._chain_read_at if steady else None,
                               [(offered[s.seq_id], a) for s, a, _ in done])
            self._chain_read_shape = shape
        self._chain_read_at, self._chain_prefill_clock = verified, self._prefill_seconds
        events = [self._emit(seq, tokens) for seq, _, tokens in done]
        # The drafter learns what was committed for the sequences that go on (an ended one was freed;
        # its last rows may lie past its budget, where it would refuse them)
        settled = [(seq.seq_id, accepted + 1) for seq, accepted, _ in done if self._is_running(seq) and seq.drafter_attached]
        if settled and self.drafter_ok:
            self._drafter_call(self.proposer.chain_settle, [i for i, _ in settled], [c for _, c in settled])
        return events

    def _decodes_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether this step can run one ahead: plain decoding on captured steps, nothing to tell a drafter."""
        return (self.config.decode_ahead and self.graphs is not None and self.graphs.bucket(len(seqs), 1) is not None
                and not any(s.drafter_attached for s in seqs))

    def _decode_step_ahead(self, seqs: list[Sequence]) -> list[StepEvent]:
        """Decoding with the device one step ahead of the host: launch the next step, fed on the device
        by the picks of the step launched last time, then read those picks and emit them. The device
        decodes while the host detokenizes, emits and admits, so a step costs the greater of the two
        instead of their sum. Sampled requests draw their tokens on the device (`sample_tokens`: what
        the step-by-step verify would draw, from the same uniform).

        A sequence in the step launched last time emits its pick now; one that was not (just admitted,
        or after a speculative step) is launched from its last token and emits next time. A pick past a
        sequence's end (an EOS, a stop string, a cancel) is dropped with its sequence: a launched step
        that wrote K/V to blocks freed since comes before, in stream order, anything that reuses them."""
        pending, self._ahead, self._ahead_draws = self._ahead, None, []
        started = time.perf_counter()
        row_of = {} if pending is None else {seq_id: i for i, seq_id in enumerate(pending.seq_ids)}
        carried = [s for s in seqs if s.seq_id in row_of]  # their token now: pending's pick, on the device
        launch = [s for s in seqs if s.seq_id not in row_of or s.remaining > 1]
        if launch:
            fed = [i for i, s in enumerate(launch) if s.seq_id in row_of]
            step = StepBatch([s.seq_id for s in launch],
                             [[0] if s.seq_id in row_of else [s.tokens[-1]] for s in launch],
                             [s.last_position + (s.seq_id in row_of) for s in launch])
            feed = None if not fed else DeviceDrafts(pending.device_picks.view(-1, 1), fed, [1] * len(fed),
                                                    [row_of[launch[i].seq_id] for i in fed], column=0)
            self._ahead = self.graphs.launch_decode(step, feed, self._sampler(launch))
        if not carried:
            return []
        picks = pending.picks()
        verified = time.perf_counter()
        events = []
        for seq in carried:
            seq.stats.steps += 1
            self.counters.verified(0, 0)
            events.append(self._emit(seq, [picks[row_of[seq.seq_id]]]))
        self._count_step(started, verified)
        return events

    def _sampler(self, launch: list[Sequence]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """For a decode launched ahead: its sampled requests' tokens drawn on the device over the greedy
        picks, each generator's state before the draw kept (see _drop_ahead); None when all are greedy."""
        sampled = [i for i, s in enumerate(launch) if not s.request.params.greedy]
        if not sampled:
            return None
        self._ahead_draws = [(launch[i], launch[i].generator.get_state()) for i in sampled]
        params = [launch[i].request.params for i in sampled]
        generators = [launch[i].generator for i in sampled]

        def choose(logits: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
            index = device_longs(sampled, picks.device)
            return picks.index_copy(0, index, sample_tokens(logits, sampled, params, generators))
        return choose

    def _commit_many(self, many, batch: _VerifiedBatch, features: torch.Tensor) -> None:
        """The step's verified sequences told to the drafter in one call (`commit_verified_many`)."""
        self._drafter_call(many, batch.seq_ids, features, batch.row_starts, batch.row_counts, batch.num_accepted,
                           batch.base_pos, batch.token_ids)

    def _count_step(self, started: float, verified: float) -> None:
        self.counters.steps += 1
        self.counters.verify.observe(verified - started)
        self.counters.control.observe(time.perf_counter() - verified)

    @contextmanager
    def _batched_appends(self):
        """Lets an in-process drafter take every sequence's committed rows in one forward (as the drafter
        service does for one Step message); if that forward fails, the drafter is detached."""
        batched = getattr(self.proposer, "batched_appends", None)
        if batched is None or not self.drafter_ok:
            yield
            return
        block = batched()
        block.__enter__()
        try:
            yield
        finally:
            try:
                block.__exit__(None, None, None)  # always: the drafter must leave the block
            except Exception as exc:  # noqa: BLE001 - by design: a drafter fault must not fail requests
                log.warning("drafter failed appending committed rows (%s: %s); continuing without "
                            "speculation", type(exc).__name__, exc)
                self._detach()

    def _propose(self, seqs: list[Sequence], asked: tuple[list[ProposeRequest], list[int]] | None = None
                 ) -> tuple[list[list[int]], DeviceDrafts | None]:
        """Each sequence's drafts, as host lists or, from an in-process drafter that can leave them on the
        device, as placeholders of the right length plus the device tensor that fills them in. `asked`:
        the step's `_propose_requests`, when the caller has them already."""
        drafts: list[list[int]] = [[] for _ in seqs]
        requests, index = asked if asked is not None else self._propose_requests(seqs)
        if not requests:
            self._prefetched, self._prefetch_seconds = None, 0.0
            send = _capability(self.proposer, "send_pending") if self.drafter_ok else None
            if send is not None:  # a remote drafter applies the last step's commits during this verify
                self._drafter_call(send)
            return drafts, None
        started = time.perf_counter()
        on_device = self._take_prefetched(requests, index) or self._propose_on_device(seqs, requests, index)
        if on_device is not None:
            self.counters.propose.observe(time.perf_counter() - started)
            for i, k in zip(index, on_device.counts):
                drafts[i] = [0] * k  # placeholders: the verify reads the drafts from the device
            return drafts, on_device
        proposals = self._drafter_call(self.proposer.propose, requests)  # drafts come back as host lists
        self.counters.propose.observe(time.perf_counter() - started)
        if proposals is _FAILED:
            return drafts, None
        vocab = self.model.config.vocab_size
        for request, proposal in zip(requests, proposals):
            tokens = proposal.tokens
            if len(tokens) > request.num_drafts or any(not 0 <= t < vocab for t in tokens):
                # A drafter that answers out of contract must not fail the verify of every request.
                log.warning("the drafter answered sequence %s out of contract (%d drafts for %d asked, or an "
                            "id outside [0, %d)); continuing without speculation", request.seq_id, len(tokens),
                            request.num_drafts, vocab)
                self._detach()
                return [[] for _ in seqs], None
        for i, proposal in zip(index, proposals):
            drafts[i] = list(proposal.tokens)
        return drafts, None

    def _propose_requests(self, seqs: list[Sequence], counts: list[int] | None = None
                          ) -> tuple[list[ProposeRequest], list[int]]:
        """The step's propose requests, and the index in `seqs` of each one's sequence (`counts`: the
        step's `_draft_counts`, when the caller has them already)."""
        requests, index = [], []
        for i, (seq, k) in enumerate(zip(seqs, self._draft_counts(seqs) if counts is None else counts)):
            if k > 0:
                requests.append(ProposeRequest(seq.seq_id, seq.tokens[-1], seq.last_position, k))
                index.append(i)
        return requests, index

    def _draft_counts(self, seqs: list[Sequence]) -> list[int]:
        """The drafts a step of `seqs` asks for each sequence (0: none)."""
        most = self._max_drafts(len(seqs))
        return [self._num_drafts(seq, most) if seq.drafter_attached else 0 for seq in seqs]

    def _prefetch_drafts(self, seqs: list[Sequence]) -> None:
        """Launch the next step's propose for the sequences that go on, right after this step's rows
        were committed. A drafter service gets the proposes with the step's commits in one message
        (`RemoteProposer.prefetch`) and drafts while the host emits and admits. In-process, only device
        drafts are prefetched: such a propose changes nothing a later propose or commit depends on
        (DFlash's is a pure read of its context; MTP's builds exact rows from committed data only, the
        same whichever propose builds them, and drops its speculative ones before drafting again), so
        drafts nobody takes are dropped.
        They are taken only if no other drafter work ran on the device in between (a prefill drops
        them), so between the propose and the verify that reads its drafts there is nothing but what
        there is without a prefetch."""
        self._prefetched = None
        live = [s for s in seqs if s.finish_reason is None]
        if not live or not self.drafter_ok or self._chain_plan(live)[0]:
            return
        ahead = _capability(self.proposer, "prefetch")
        if ahead is not None:  # a drafter service: the proposes leave now, with this step's commits
            requests, _ = self._propose_requests(live)
            if requests:
                self._drafter_call(ahead, requests)
            return
        if self.graphs is None or _capability(self.proposer, "propose_on_device") is None:
            return
        requests, index = self._propose_requests(live)
        if requests:
            started = time.perf_counter()
            on_device = self._propose_on_device(live, requests, index)
            self.counters.propose.observe(time.perf_counter() - started)
            if on_device is not None:
                self._prefetched = (requests, on_device)

    def _take_prefetched(self, requests: list[ProposeRequest], index: list[int]) -> DeviceDrafts | None:
        """The prefetched drafts, when every request of this step was prefetched exactly as it stands
        (the same anchor token, position and count); otherwise None and they are dropped."""
        prefetched, self._prefetched = self._prefetched, None
        taken, self._prefetch_seconds = self._prefetch_seconds, 0.0  # its launch counts only if it is used
        if prefetched is None or not self.drafter_ok:
            return None
        earlier, on_device = prefetched
        row_of = {r.seq_id: (row, r) for row, r in zip(on_device.rows, earlier)}
        rows = []
        for r in requests:
            hit = row_of.get(r.seq_id)
            if hit is None or (hit[1].last_token, hit[1].position, hit[1].num_drafts) != \
                    (r.last_token, r.position, r.num_drafts):
                return None
            rows.append(hit[0])
        self._prefetch_seconds = taken
        return DeviceDrafts(on_device.tokens, index, [r.num_drafts for r in requests], rows)

    def _propose_on_device(self, seqs: list[Sequence], requests: list[ProposeRequest],
                           index: list[int]) -> DeviceDrafts | None:
        """Drafts that stay on the device until the verify has used them (in-process drafters with a
        captured propose, or a drafter service that wrote them into our drafts buffer, when the step
        fits a captured verify). They are clamped into the vocabulary on the device, into a tensor of
        ours, whoever drafted them (a peer's are its bytes; a wrapper may hide which proposer it
        forwards to): the verify's embedding reads that tensor, and what it verified is what the
        step accepts from."""
        propose = _capability(self.proposer, "propose_on_device")
        if propose is None or self.graphs is None or \
                self.graphs.bucket(len(seqs), max(r.num_drafts for r in requests) + 1) is None:
            return None
        tokens = self._drafter_call(propose, requests)
        if tokens is None or tokens is _FAILED:
            return None
        tokens = tokens.clamp(0, self.model.config.vocab_size - 1)  # one small kernel, whoever drafted
        return DeviceDrafts(tokens, index, [r.num_drafts for r in requests], list(range(len(requests))))

    def _read_drafts(self, drafts: list[list[int]], on_device: DeviceDrafts,
                     out: ForwardOutput) -> tuple[list[list[int]], list[int]]:
        """The drafts the verify used, and its rows' argmax, with one wait for the device."""
        tokens, argmax = out.greedy_picks(on_device.tokens)
        drafts = list(drafts)
        for i, k, row in zip(on_device.seqs, on_device.counts, on_device.rows):
            drafts[i] = tokens[row][:k]
        return drafts, argmax

    def _num_drafts(self, seq: Sequence, most: int) -> int:
        limit = self.model.config.max_position_embeddings - len(seq.tokens) - 1
        return max(0, min(most, seq.remaining - 1, limit))

    def _after_verify(self, seq, draft, num_accepted, rows, start) -> None:
        """Tell the drafter what was accepted: stash + commit + trim (one call to an in-process drafter
        that has it), or catch-up for serial rows."""
        if not seq.drafter_attached:
            return
        committed = [seq.tokens[-1]] + draft[:num_accepted]
        if not draft:
            self._drafter_call(self.proposer.catchup, seq.seq_id, committed, rows[:1], start)
            return
        verified = _capability(self.proposer, "commit_verified")
        if verified is not None:
            self._drafter_call(verified, seq.seq_id, rows, num_accepted, start, committed)
            return
        for verb, args in (
            (self.proposer.stash, (seq.seq_id, rows)),
            (self.proposer.commit, (seq.seq_id, num_accepted + 1, start, committed)),
            (self.proposer.trim, (seq.seq_id, num_accepted)),
        ):
            if self._drafter_call(verb, *args) is _FAILED:
                return

    # ---- drafter attachment ------------------------------------------------------------------

    def _drafter_call(self, verb, *args):
        """Run one drafter verb; any failure detaches the drafter instead of failing requests."""
        if not self.drafter_ok:
            return _FAILED
        try:
            return verb(*args)
        except Exception as exc:  # noqa: BLE001 - by design: a drafter fault must not fail requests
            log.warning("drafter failed in %s (%s: %s); continuing without speculation",
                        getattr(verb, "__name__", verb), type(exc).__name__, exc)
            self._detach()
            return _FAILED

    def _quiesce(self) -> None:
        """Before work that may launch a kernel this process has not launched yet (a prefill, a step of
        another shape, a capture, anything step by step): our stream's device waits for a drafter
        service's drafts done first (`RemoteProposer.drain_waits`). A kernel's first launch loads its
        module, which waits for the whole context, a waiting stream included, and a release of the wait
        by our watchdog could not get through meanwhile: a drafter that never writes would hang us for good
        (README, "Device waits"). The chained step of the same sequences and shape as the one before runs
        without it: that is where device waits save the host its wait."""
        drain = _capability(self.proposer, "drain_waits")
        if drain is None or self._waits_outlive_loads():
            return
        if self.drafter_ok:
            self._drafter_call(drain)  # (a failure detaches the drafter)
            return
        try:  # detached: the waits it left, released, still pass first
            drain()
        except Exception as exc:  # noqa: BLE001 - by design: a drafter fault must not fail requests
            log.warning("the detached drafter's device waits: %s: %s", type(exc).__name__, exc)

    def _waits_outlive_loads(self) -> bool:
        """Whether our stream's device waits may stay pending across a kernel's first launch (see
        EngineConfig.unquiesced_host_flags)."""
        return self.config.unquiesced_host_flags and bool(getattr(self.proposer, "waits_outlive_loads", False))

    def _detach(self) -> None:
        """Stop trusting the drafter's state: a remote drafter's connection is dropped (it frees
        everything this engine held there; re-attach rebuilds it), an in-process one is told to free."""
        self.counters.fallbacks += self.drafter_ok  # once per outage, however many verbs then fail
        self.drafter_ok = False
        self._prefetched = self._launched = self._sent_ahead = None
        if getattr(self.proposer, "chain_captured_whole", True):
            # (their graphs read the drafter's buffers: none outlives its trust; a drafter service's, the
            # tails after its drafts, read only ours, and stay for the re-attached connection)
            self._chain_programs.clear()
        attached = [s for s in self.running.values() if s.drafter_attached]
        self._attaching.clear()  # (their answers, if any come, are not taken: the connection goes below)
        for seq in self.running.values():
            seq.drafter_attached = False
        reset = getattr(self.proposer, "reset", None)
        if reset is not None:
            reset()
            return
        for seq in attached:
            self._forget(seq)

    @staticmethod
    def _prompt_rows(chunks: list[torch.Tensor], side: "torch.cuda.Stream | None") -> torch.Tensor | None:
        """A prompt's feature rows in one tensor (None: none captured); made on `side` when given."""
        if not chunks:
            return None
        if side is None:
            return torch.cat(chunks)
        for chunk in chunks:  # (made on our stream, read on the side one: not reused before that read)
            chunk.record_stream(side)
        with torch.cuda.stream(side):
            return torch.cat(chunks)

    def _attach(self, seq: Sequence, tokens: list[int], rows: "torch.Tensor | list[torch.Tensor] | None",
                side: "torch.cuda.Stream | None" = None, on_stream: bool = False) -> None:
        """rows: the prompt's feature rows, or the chunks its prefill captured (joined here, on `side` if given).
        on_stream: through a drafter service that takes it (EngineConfig.stream_attach), the attach rides the next
        Step and the sequence sits steps out until `_settle_attaches` takes its answer (the rows' copy then
        goes on our stream as that Step is sent: `side` is not used)."""
        try:
            queue = _capability(self.proposer, "attach_on_stream") if on_stream else None
            if isinstance(rows, list):
                rows = self._prompt_rows(rows, None if queue is not None else side)
            # (a chained step's anchor lies below the drafter's budget: its steps' writes past ours, see _overhang)
            budget = seq.reserved_tokens if self._chains() else seq.budget_tokens
            if queue is not None and queue(seq.seq_id, budget, tokens, rows):
                self._attaching[seq.seq_id] = _Attaching(seq)
                return
            self.proposer.alloc(seq.seq_id, budget)
            if side is None or queue is not None:  # (rows joined on our stream: copied on it too)
                self.proposer.prefill(seq.seq_id, tokens, rows, 0)
            else:  # (a drafter service: the rows' copy into its buffer on `side`)
                self.proposer.prefill(seq.seq_id, tokens, rows, 0, stream=side)
        except (InvalidRequest, CapacityExceeded, StateConflict) as exc:
            self._refused(seq, exc)
            return
        except Exception as exc:  # noqa: BLE001 - by design: a drafter fault must not fail requests
            self._attach_failed(seq, exc)
            return
        seq.drafter_attached, seq.drafter_resting = True, False

    def _refused(self, seq: Sequence, exc: Exception) -> None:
        """This sequence is what the drafter refuses, not the drafter: the others keep speculating."""
        log.warning("the drafter refused sequence %s (%s: %s); decoding it without speculation",
                    seq.request.request_id, type(exc).__name__, exc,
                    extra=fields(request_id=seq.request.request_id, seq_id=seq.seq_id))
        self.counters.refusals += 1
        seq.drafter_refused = True
        self._forget(seq)

    def _attach_failed(self, seq: Sequence, exc: Exception) -> None:
        log.warning("drafter failed attaching %s (%s: %s); continuing without speculation",
                    seq.request.request_id, type(exc).__name__, exc,
                    extra=fields(request_id=seq.request.request_id, seq_id=seq.seq_id))
        self._detach()

    def _settle_attaches(self, *, read: bool = True, wait: bool = False) -> None:
        """The attaches riding Steps (EngineConfig.stream_attach) whose answers are in. `read`: the answer to a
        Step still out that carries one is read now (`_chain_send_ahead`: its verify is launched, and the
        propose about to go ahead reads it anyway); at a step's start (`read` false) only for an attach two
        steps old (a step that sends no Step, or reads none, holds none back for long); `wait`: those still
        queued are sent now. Each sequence is then attached, or refused, or the drafter detached, as `_attach`
        would have left it."""
        for seq_id, attaching in list(self._attaching.items()):
            if self._attaching.get(seq_id) is not attaching:  # (dropped since: a detach by the attach before it)
                continue
            seq = attaching.seq
            if not read:
                attaching.steps += 1
            try:
                attached = self.proposer.attach_outcome(seq_id, read=read or attaching.steps >= 2,
                                                        wait=wait or attaching.steps >= 2)
            except (InvalidRequest, CapacityExceeded, StateConflict) as exc:
                del self._attaching[seq_id]
                self._refused(seq, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - by design: a drafter fault must not fail requests
                del self._attaching[seq_id]
                self._attach_failed(seq, exc)
                continue
            if attached:
                del self._attaching[seq_id]
                seq.drafter_attached, seq.drafter_resting = True, False

    def _maybe_reattach(self, seqs: list[Sequence]) -> None:
        """After a drafter outage, rebuild drafter state by re-capturing each sequence's rows."""
        if self.proposer is None or self.drafter_ok:
            return
        available = getattr(self.proposer, "available", None)
        if available is None or not available():
            return
        if self._chain is not None:  # a chained step is still out: rebuild from what the host has read of it
            return
        self._quiesce()  # (the released waits of the connection dropped: the re-capture below runs forwards)
        self.drafter_ok = True
        self.counters.reattaches += 1
        if self._spec is None:
            self._adopt_spec(seqs)
        stepping = [s for s in seqs if s.seq_id not in self._prefilling]  # (those attach when they are in)
        # a batch size that drafts nothing: they rest instead (EngineConfig.resume_after), nothing re-captured
        rest = self.config.resume_after is not None and self._schedule_drafts(len(stepping)) == 0
        for seq in stepping:
            if self._speculating(seq):
                self._forget(seq)
                if rest:
                    self.counters.rests += not seq.drafter_resting
                    seq.drafter_resting = True
                    continue
                self._attach(seq, seq.tokens[:-1], self._recapture(seq))

    def _adopt_spec(self, seqs: list[Sequence]) -> None:
        """Issue 9: a drafter that was down when the engine started answered for the first time; capture
        what it needs from now on. Sequences already running reserved KV blocks for no drafts, so they
        finish without speculation (as if the drafter had refused them)."""
        self._spec = self.proposer.spec
        self.capture = capture_for(self.proposer)
        self.tuner = None  # the graphs are captured for the new spec's draft lengths first
        # The prefill forwards capture the drafter's rows too from now on; the old ones let go first, before
        # anything is captured again (their memory)
        prefill, self.prefill_graphs = self.prefill_graphs, None
        if self.graphs is not None:
            self.graphs = self._capture_graphs()
        if prefill is not None:
            captured, prefill = prefill.captured, None
            self.prefill_graphs = self.graphed_prefill_forwards(use_graphs=captured)
        self.tuner = self._new_tuner()
        for seq in seqs:
            seq.drafter_refused = True

    def _forget(self, seq: Sequence) -> None:
        """Drop whatever a drafter that came back may still hold for `seq` (usually nothing)."""
        try:
            self.proposer.free(seq.seq_id)
        except Exception:  # noqa: BLE001 - unknown sequence is the normal case after a restart
            pass

    def _recapture(self, seq: Sequence) -> torch.Tensor:
        """Feature rows of every committed token but the newest (rewrites its KV with the same values, up
        to rounding), through the captured prefill forwards where there are some: a re-attach after an
        outage rebuilds every running sequence, and an eager forward is launch-bound on a GPU (22-32 ms a
        chunk for the default model on the H200, however short)."""
        history = seq.tokens[:-1]
        forwards = None if self.prefill_graphs is None else self.prefill_graphs.long or self.prefill_graphs.short
        chunk = self.config.prefill_chunk if forwards is None else forwards.query_lens[-1]
        rows = []
        for start in range(0, len(history), chunk):
            ids = history[start:start + chunk]
            if forwards is not None:
                out = forwards.forward(StepBatch([seq.seq_id], [ids], [start]))
                self.counters.graphed_prefills += 1
            else:
                out = self._forward([seq.seq_id], [ids], [start], logits_last_only=True)
            rows.append(self._features(out))
        return torch.cat(rows)

    # ---- helpers -------------------------------------------------------------------------------

    def _forward(self, seq_ids, inputs, starts, *, logits_last_only, trees=None):
        flat = [t for ids in inputs for t in ids]
        positions = [p for ids, s in zip(inputs, starts) for p in range(s, s + len(ids))]
        lengths = torch.tensor([0] + [len(ids) for ids in inputs], dtype=torch.int64)
        cu = torch.cumsum(lengths, 0)
        batch = ForwardBatch(
            token_ids=torch.tensor(flat, dtype=torch.int64, device=self._device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self._device),
            cu_seqlens=cu,
            seq_ids=list(seq_ids),
            logits_index=(cu[1:] - 1).to(self._device) if logits_last_only else None,
            trees=trees,
        )
        with torch.inference_mode():
            return self.model(batch, self.cache, self.capture)

    def _verify_forward(self, seq_ids, inputs, starts, on_device: DeviceDrafts | None = None):
        """Decode/verify rows: a captured graph when one fits the batch, the eager forward otherwise
        (device drafts only ever come with a batch that fits, see `_propose_on_device`)."""
        if self.graphs is not None and self.graphs.bucket(len(inputs), max(map(len, inputs))) is not None:
            return self.graphs.forward(StepBatch(list(seq_ids), inputs, starts), on_device)
        if on_device is not None:  # not reached while _propose_on_device checks the bucket; kept exact anyway
            tokens = on_device.tokens.tolist()
            inputs = [list(ids) for ids in inputs]
            for i, k, row in zip(on_device.seqs, on_device.counts, on_device.rows):
                inputs[i][1:] = tokens[row][:k]
        return self._forward(seq_ids, inputs, starts, logits_last_only=False)

    def _features(self, out) -> torch.Tensor | None:
        if self.capture.layer_ids:
            return out.layer_features
        return out.last_hidden if self.capture.last_hidden else None

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[list[int]],
                argmax: list[int] | None = None) -> list[list[int]]:
        sizes = torch.tensor([0] + [len(d) + 1 for d in drafts], dtype=torch.int64)
        result = verify_sampled(
            drafts, logits, torch.cumsum(sizes, 0),
            [s.request.params for s in seqs], [s.generator for s in seqs], target_argmax=argmax,
        )
        return result.tokens

    def _emit(self, seq: Sequence, new_tokens: list[int], kept: list[int] | None = None) -> StepEvent:
        """The step's event for `seq` (`kept`: what `seq.accept(new_tokens)` kept, when already called)."""
        kept = seq.accept(new_tokens) if kept is None else kept
        delta = self._text_delta(seq, kept)  # may drop tokens past a stop string
        self.counters.tokens += len(kept)
        event = StepEvent(seq.request.request_id, kept, delta, seq.finish_reason, seq.stats)
        if seq.finish_reason is not None:
            self._release(seq)
        return event

    def _text_delta(self, seq: Sequence, kept: list[int]) -> str:
        """New text since the last event; a stop string ends the request and is not emitted.

        Decoding is incremental (each token once), so a long generation costs O(n), not O(n^2).
        Text that could still become a stop string's start is held back until it cannot.
        """
        if seq.detok is None:
            return ""
        stops = [s for s in seq.request.params.stop_strings if s]
        if not stops:  # (the usual request: nothing held back, no search a token, no `decoded` beside `text`)
            delta = "".join(map(seq.detok.push, kept))
            if seq.finish_reason is not None:
                delta += seq.detok.flush()
            seq.text += delta
            return delta
        longest = max((len(s) for s in stops), default=0)
        for i, token in enumerate(kept):
            searched_from = max(0, len(seq.decoded) - longest + 1)
            seq.decoded += seq.detok.push(token)
            cut = _first_stop(seq.decoded, stops, searched_from)
            if cut is not None:
                self._drop_after(seq, kept, i + 1)
                seq.finish_reason = FinishReason.STOP
                text = seq.decoded[:cut]
                break
        else:
            if seq.finish_reason is None:
                text = seq.decoded[: max(len(seq.text), len(seq.decoded) - max(longest - 1, 0))]
            else:  # the end: a trailing partial character shows as a plain decode shows it
                searched_from = max(0, len(seq.decoded) - longest + 1)
                seq.decoded += seq.detok.flush()
                cut = _first_stop(seq.decoded, stops, searched_from)
                if cut is not None:
                    seq.finish_reason = FinishReason.STOP
                text = seq.decoded if cut is None else seq.decoded[:cut]
        delta = text[len(seq.text):]
        seq.text += delta
        return delta

    @staticmethod
    def _drop_after(seq: Sequence, kept: list[int], keep: int) -> None:
        """Drop the tokens this step emitted after the one that completed a stop string."""
        extra = len(kept) - keep
        if extra > 0:
            del kept[keep:]
            del seq.tokens[-extra:]
            seq.stats.generated -= extra

    def _release(self, seq: Sequence) -> None:
        self.running.pop(seq.request.request_id, None)
        self._prefilling.pop(seq.seq_id, None)
        self.cache.free(seq.seq_id)
        attaching = self._attaching.pop(seq.seq_id, None) is not None  # (its free takes the attach's answer first)
        if seq.drafter_attached or attaching:
            seq.drafter_attached = False
            self._drafter_call(self.proposer.free, seq.seq_id)
            # A remote proposer sends the free with the next step; with no step coming, send it now.
            flush = getattr(self.proposer, "flush", None)
            if flush is not None and not any(s.drafter_attached for s in self.running.values()):
                self._drafter_call(flush)


@dataclass(frozen=True)
class PrefillForwards:
    """The static forwards prompts go in through on a GPU (`EngineConfig.graphed_prefill`), buffers apart
    from the steps'."""

    short: StepGraphs  # the next chunk of several short prompts a forward
    long: StepGraphs | None  # one longer prompt's next chunk, up to prefill_chunk tokens (None: eagerly)
    captured: bool  # CUDA graphs (or their reference, run eagerly)


@dataclass
class _Attaching:
    """A sequence whose attach rides a Step (EngineConfig.stream_attach), and the engine steps it has sat out."""

    seq: Sequence
    steps: int = 0


@dataclass
class _Prefill:
    """A prompt going into the cache a chunk per step: how far it is, and its feature rows so far."""

    seq: Sequence
    offset: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Prefilled:
    """A prefill forward launched and not read yet: the prompts it completed, their feature rows (each one's
    chunks', by seq_id) and first tokens [D] in (pinned) host memory, there once `copied` is done (None on
    the CPU: there already)."""

    done: list[Sequence]
    rows: dict[int, list[torch.Tensor]]
    firsts: torch.Tensor | None
    copied: "torch.cuda.Event | None"


@dataclass(frozen=True)
class _LaunchedVerify:
    """A step's verify, launched; what reading it back and accepting needs."""

    seqs: list[Sequence]
    drafts: list[list[int]]  # each sequence's drafts (placeholders for drafts on the device)
    starts: list[int]  # each sequence's position of its last committed token
    on_device: DeviceDrafts | None
    out: ForwardOutput
    choice: int  # the tuner's draft length for the step (0 without a tuner)
    started: float  # perf_counter when the step began (its propose, or its launch ahead)
    verify_started: float  # ... and when its verify was launched
    prefetch_seconds: float  # host time of the propose prefetched for it (the tuner counts it)
    drafter_ok: bool  # the drafter's state at launch: a step launched before a detach or re-attach is dropped
    lengths: list[int]  # each sequence's token count at launch
    counts: list[int]  # the drafts asked for each sequence (a drafter may answer fewer)
    prefill_clock: float  # Engine._prefill_seconds at launch


@dataclass(frozen=True)
class _Rejoining:
    """Sequences of a chained step not read yet that sit the next one out (Engine._rejoining)."""

    seq_ids: list[int]
    rows: list[int]  # the rows that step adds to each, not told to the drafter yet (at most)
    feed: torch.Tensor  # [2, R] on the device: each one's next anchor and its position, as that step leaves them


@dataclass
class _VerifiedBatch:
    """Columns of `commit_verified_many`: one entry per sequence whose drafts were verified."""

    seq_ids: list[int] = field(default_factory=list)
    row_starts: list[int] = field(default_factory=list)
    row_counts: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    base_pos: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)

    def add(self, seq: Sequence, row_start: int, row_count: int, num_accepted: int, base_pos: int,
            token_ids: list[int]) -> None:
        self.seq_ids.append(seq.seq_id)
        self.row_starts.append(row_start)
        self.row_counts.append(row_count)
        self.num_accepted.append(num_accepted)
        self.base_pos.append(base_pos)
        self.token_ids.append(token_ids)


def _out_of_room(exc: BaseException) -> bool:
    """Whether a failure to build captured forwards leaves CUDA usable: out of device memory (a capture
    that runs out ends normally), or a Triton kernel out of resources for the shape (raised by the run
    before the capture). Any other failure inside a capture may leave the allocator or the current
    stream in capture's state: the caller lets it end the engine's start."""
    return isinstance(exc, torch.OutOfMemoryError) or type(exc).__name__ == "OutOfResources"


def _capability(proposer, name: str):
    """An optional fast path of an in-process proposer (`propose_on_device`, `commit_verified`), bound, or
    None. Looked up on the class: a pass-through wrapper that intercepts the plain verbs (and forwards
    the rest by `__getattr__`) must not have its interception bypassed; it gets the plain verbs."""
    if getattr(type(proposer), name, None) is None:
        return None
    return getattr(proposer, name)


def _first_stop(text: str, stops: list[str], start: int) -> int | None:
    """Where the earliest stop string found at or after `start` begins."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None
