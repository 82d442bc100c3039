"""The drafter service's Prometheus metrics: what its sessions hold (read at scrape time, without the drafter
lock, so a scrape never waits behind a step), its steps and proposals, and the errors it answers."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from specsplit.drafter_service.session import CHAIN_GRAPH_OUTCOMES
from specsplit.shared.metrics import ServiceMetrics
from specsplit.shared.wire import SeqError, StepResult

PREFIX = "specsplit_drafter"
# Seconds a Step message takes here (lock wait included): a GPU step is well under a millisecond.
PREFILL_PHASES = ("ready", "lock", "alloc", "rows", "context", "wait")
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class DrafterMetrics(ServiceMetrics):
    """`sessions` returns the server's sessions now (a copy: the collector never holds the drafter lock)."""

    def __init__(self, sessions: Callable[[], list]) -> None:
        super().__init__(PREFIX)
        self.steps = Histogram(f"{PREFIX}_step_seconds", "seconds to answer one Step message (the drafter lock's "
                               "wait included)", buckets=STEP_BUCKETS, registry=self.registry)
        # A counter, not a histogram: six observations per message must cost next to nothing.
        self.phases = Counter(f"{PREFIX}_step_phase_seconds", "host seconds spent in each part of the Step "
                              "messages: parse, ready (polling, outside the lock, until the target's GPU writes "
                              "into the rows it sends are done), lock (the wait for the drafter lock), commit (less "
                              "rows and context; for a chained step prepared before the wait, its preparation), "
                              "rows (resolving row references and their checks), context (the batched context "
                              "forward: its launch on a GPU), propose (the drafts' GPU work and read-back; their "
                              "launch alone when they go into the target's drafts buffer; less the next), replay "
                              "(launching chained steps' CUDA graphs: the host's side of cudaGraphLaunch), wait "
                              "(for the target's rows to be read), encode",
                              ["phase"], registry=self.registry)
        self._phase = {}  # phase → its counter child, looked up once
        self.prefills = Counter(f"{PREFIX}_prefills", "PrefillDrafter calls answered (a sequence's prompt rows)",
                                registry=self.registry)
        self.prefill_phases = Counter(f"{PREFIX}_prefill_phase_seconds", "host seconds spent in each part of the "
                                      "PrefillDrafter calls answered: ready (polling, outside the lock, until the "
                                      "target's GPU writes into the rows are done), lock, alloc (a prefill that "
                                      "allocates its sequence), rows, context (the context forward: its launch on a "
                                      "GPU), wait (for the rows to be read, the stream's work before them included)",
                                      ["phase"], registry=self.registry)
        self._prefill_phase = {p: self.prefill_phases.labels(p) for p in PREFILL_PHASES}
        self.step_attaches = Counter(f"{PREFIX}_step_attaches", "sequences attached on the Step stream (a SeqStep "
                                     "that allocates its sequence, its prompt's rows as a catch-up) and not refused",
                                     registry=self.registry)
        self.proposals = Counter(f"{PREFIX}_proposals", "sequences drafts were proposed for", registry=self.registry)
        self.draft_tokens = Counter(f"{PREFIX}_draft_tokens", "draft tokens proposed", registry=self.registry)
        self.sequence_errors = Counter(f"{PREFIX}_sequence_errors", "sequences refused or failed inside a Step "
                                       "answer (the stream itself goes on), by status code", ["code"],
                                       registry=self.registry)
        self.chain_graph_steps = Counter(f"{PREFIX}_chain_graph_steps", "chained steps whose commit and propose "
                                         "ran fused (on a GPU unless --no-chain-graphs), by how: uncaptured (their shape not "
                                         "captured yet, or given up), captured (then replayed), replayed, "
                                         "failed (the capture failed; run uncaptured, the shape given up), "
                                         "prepared (replayed, its host work done before the target's writes "
                                         "were: a chained step sent ahead), waited (prepared, and launched at "
                                         "once, our stream waiting on the device for those writes: --device-waits)",
                                         ["outcome"], registry=self.registry)
        self._chain_graph = {o: self.chain_graph_steps.labels(o) for o in CHAIN_GRAPH_OUTCOMES}
        self.registry.register(_SessionCollector(sessions))

    def answered(self, result: StepResult, seconds: float, phases: Mapping[str, float] | None = None,
                 attached: int = 0) -> None:
        """One Step message answered in `seconds`, spent on `phases` (name → seconds), `attached` sequences
        attached by it."""
        self.steps.observe(seconds)
        if attached:
            self.step_attaches.inc(attached)
        for phase, spent in (phases or {}).items():
            child = self._phase.get(phase)
            if child is None:
                child = self._phase[phase] = self.phases.labels(phase)
            child.inc(spent)
        self.proposed(result.proposals.values())
        if result.in_buffer:  # drafts written into the target's buffer: counted as well
            self.proposals.inc(len(result.in_buffer))
            self.draft_tokens.inc(sum(n for _, n in result.in_buffer))
        self.failed(result.errors)

    def prefilled(self, phases: Mapping[str, float]) -> None:
        """One PrefillDrafter answered, its host seconds spent on `phases` (PREFILL_PHASES)."""
        self.prefills.inc()
        for phase, spent in phases.items():
            self._prefill_phase[phase].inc(spent)

    def chain_graph_step(self, outcome: str) -> None:
        self._chain_graph[outcome].inc()

    def proposed(self, proposals: Iterable) -> None:
        proposals = list(proposals)
        if proposals:
            self.proposals.inc(len(proposals))
            self.draft_tokens.inc(sum(len(p.tokens) for p in proposals))

    def failed(self, errors: Iterable[SeqError]) -> None:
        for error in errors:
            self.sequence_errors.labels(error.code).inc()


class _SessionCollector(Collector):
    def __init__(self, sessions: Callable[[], list]) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sessions = self.sessions()
        connected = GaugeMetricFamily(f"{PREFIX}_sessions", "connections held: with an open Step stream (a "
                                      "connected target) or without one", labels=["stream"])
        streaming = sum(s.streaming for s in sessions)
        connected.add_metric(["open"], streaming)
        connected.add_metric(["none"], len(sessions) - streaming)
        yield connected
        usage = [s.usage() for s in sessions]
        for name, documentation in (
                ("sequences", "sequences held, all connections"),
                ("carried_kvs", "carried drafter KVs held (taken, not yet installed or freed)"),
                ("buffers", "registered row and head buffers"),
                ("buffer_bytes", "bytes of the registered buffers")):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", documentation, value=sum(getattr(u, name) for u in usage))
