"""The target service's Prometheus metrics: requests by outcome, and what the engine counted
(`target_service.counters`), read at scrape time. Names and meanings are listed in the README
("Observability")."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from specsplit.shared.drafter_kind import DrafterKind
from specsplit.shared.metrics import ServiceMetrics, buckets
from specsplit.target_service.counters import EngineCounters

PREFIX = "specsplit_target"
_MIN_DRAFT_BOUNDS = 17  # buckets 0..16 always (the shipped DFlash drafts up to 15), more if seen


class TargetMetrics(ServiceMetrics):
    """Requests by outcome (counted by the servicer) plus the engine's counters and state (`state()` at each scrape)."""

    def __init__(self, state: Callable[[], EngineState], open_streams: Callable[[], int]) -> None:
        super().__init__(PREFIX)
        self.requests = Counter(f"{PREFIX}_requests", "Generate requests by outcome: a finish reason (length, eos, "
                                "stop), cancelled, or the refusing status code (invalid_argument, ...)",
                                ["outcome"], registry=self.registry)
        self.registry.register(_EngineCollector(state, open_streams))


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", documentation, value=value)


def _by_count(name: str, documentation: str, counts: list[int]) -> HistogramMetricFamily:
    """A histogram of small integers: counts[n] observations of n."""
    counts = counts + [0] * (_MIN_DRAFT_BOUNDS - len(counts))
    family = HistogramMetricFamily(f"{PREFIX}_{name}", documentation)
    family.add_metric([], buckets(tuple(range(len(counts))), counts + [0]), sum(n * c for n, c in enumerate(counts)))
    return family


def _at_least(counts: list[int]) -> list[int]:
    """[p-1] = observations >= p, for p = 1..len-1 (steps that reached draft position p)."""
    out, running = [], 0
    for count in reversed(counts[1:]):
        running += count
        out.append(running)
    return out[::-1]


@dataclass
class EngineState:
    """What a scrape (and Describe) reads of the engine, taken in one go wherever the engine runs (this process,
    or the engine's own: `target_service.engine_process`), so it crosses a pipe as one message."""

    counters: EngineCounters
    drafter_attached: bool
    drafter_kind: DrafterKind | None  # the attached drafter's, None while none is
    running: int  # sequences decoding or prefilling
    prefilling: int
    waiting: int
    link: dict[str, int] | None = None  # a drafter service's connection's counters (RemoteProposer.link)
    step_transport: str | None = None  # its Step stream's carrier while attached: socket or grpc
    draft_lengths: dict[int, int] | None = None  # --num-drafts auto: learned, by batch bucket


def engine_state(engine) -> EngineState:
    """The engine's state now: plain numbers and a copy of its counters' growing lists (the engine thread appends)."""
    c = engine.counters
    proposer = engine.proposer
    attached = bool(engine.drafter_ok)
    link = getattr(proposer, "link", None)  # a drafter service's connection (RemoteProposer)
    link_counts = None if link is None else {
        "sent_ahead": link.sent_ahead, "drafts_ahead": link.drafts_ahead,
        "chain_taken_regrouped": link.chain_taken_regrouped, "device_waits": link.device_waits,
        "taken_unanswered": link.taken_unanswered, "waits_released": getattr(proposer, "waits_released", 0)}
    prefilling = engine.prefilling
    return EngineState(
        counters=replace(c, drafts=list(c.drafts), accepted=list(c.accepted)),
        drafter_attached=attached,
        drafter_kind=proposer.spec.kind if attached and proposer.spec is not None else None,
        running=len(engine.running), prefilling=prefilling, waiting=len(engine.waiting),
        link=link_counts,
        step_transport=proposer.step_transport if attached and link is not None else None,
        draft_lengths=engine.tuner.learned() if engine.tuner is not None else None)


class _EngineCollector(Collector):
    def __init__(self, state: Callable[[], EngineState], open_streams: Callable[[], int]) -> None:
        self.state = state
        self.open_streams = open_streams

    def collect(self) -> Iterator:
        state = self.state()
        c = state.counters
        drafts, accepted = c.drafts, c.accepted
        yield _counter("steps", "batched decode/verify steps (target forwards)", c.steps)
        yield _counter("prefills", "prompts prefilled (a target forward that produced a token)", c.prefills)
        yield _counter("graphed_prefills", "prefill forwards replayed as captured graphs (prompts' chunks; "
                       "a re-attach's recomputed rows)", c.graphed_prefills)
        yield _counter("chained_steps", "speculative steps chained on the device: accepted there, the next one "
                       "launched before the host read this one", c.chained)
        yield _counter("chain_captures", "shapes of chained steps captured as one CUDA graph (whole in-process; "
                       "through a drafter service, what follows the drafts), a replay a step from then on", c.chain_captures)
        yield _counter("chain_capture_seconds", "host seconds spent capturing them (the step that captures "
                       "waits for it)", c.chain_capture_seconds)
        yield _counter("chain_programs_dropped", "chained-step programs dropped as the least recently used past "
                       "EngineConfig.chain_programs (their shapes run uncaptured again when they come back)",
                       c.chain_programs_dropped)
        yield _counter("tokens", "tokens generated and sent to clients", c.tokens)
        yield _by_count("verified_drafts", "drafts verified per sequence per step (0: serial decoding)", drafts)
        yield _by_count("accepted_drafts", "drafts accepted per sequence per step; tau = 1 + sum / count", accepted)
        yield from self._positions(drafts, accepted)
        yield _counter("drafter_fallbacks", "drafter failures: every sequence went on by serial decoding", c.fallbacks)
        yield _counter("drafter_refusals", "sequences the drafter refused (its limits); each decodes serially",
                       c.refusals)
        yield _counter("drafter_reattaches", "drafter attached after a fallback (or after starting without one)",
                       c.reattaches)
        yield _counter("drafter_rests", "sequences set to rest from the drafter at a batch size that drafts nothing "
                       "(target serve --drafts-by-batch N:0): decoded as target only", c.rests)
        yield _counter("drafter_resumes", "resting sequences attached again once their batch drafted", c.resumes)
        yield _gauge("drafter_attached", "1 while a drafter is attached", float(state.drafter_attached))
        link = state.link
        if link is not None:
            yield _counter("drafter_steps_sent_ahead", "Step messages sent before their answer was needed (a "
                           "step's commits, with the next step's proposes), their answers read later", link["sent_ahead"])
            yield _counter("drafter_drafts_taken_ahead", "proposals taken from a Step sent ahead (no round trip "
                           "of their own)", link["drafts_ahead"])
            yield _counter("drafter_chain_proposes_taken_regrouped", "chained proposes sent ahead taken by a step "
                           "whose batch had changed (sequences ended, attached, or back from sitting a step out)",
                           link["chain_taken_regrouped"])
            yield _counter("drafter_device_waits", "chained steps' drafts our stream waited for on the device "
                           "(device waits: on the drafter's host page by default, --device-waits), not our host",
                           link["device_waits"])
            yield _counter("drafter_drafts_taken_unanswered", "of those, chained proposes sent ahead whose drafts "
                           "the verify took before their answer was read (the answer checked after the launch)",
                           link["taken_unanswered"])
            yield _counter("drafter_device_waits_released", "releases of device waits by the target itself (per "
                           "DONE buffer): a drafter that missed a step's deadline (it is dropped), or a drafter "
                           "dropped for any reason with waits pending", link["waits_released"])
            transport = GaugeMetricFamily(f"{PREFIX}_drafter_step_transport", "1 for the carrier of the Step stream "
                                          "while a drafter is attached: socket (its step socket) or grpc",
                                          labels=["transport"])
            for name in ("socket", "grpc"):
                transport.add_metric([name], float(state.step_transport == name))
            yield transport
        if state.draft_lengths is not None:
            lengths = GaugeMetricFamily(f"{PREFIX}_draft_length", "--num-drafts auto: the draft length the engine "
                                        "learned for steps of up to `batch` sequences (a power of two)",
                                        labels=["batch"])
            for bucket, k in state.draft_lengths.items():
                lengths.add_metric([str(bucket)], k)
            yield lengths
        yield self._sequences(state)
        yield _gauge("streams", "Generate streams open", self.open_streams())
        phases = HistogramMetricFamily(f"{PREFIX}_step_seconds", "host seconds of a step's phases: propose (drafts "
                                       "back), verify (forward and acceptance), control (telling the drafter)",
                                       labels=["phase"])
        for phase in ("propose", "verify", "control"):
            tally = getattr(c, phase)
            phases.add_metric([phase], buckets(tally.bounds, list(tally.counts)), tally.sum)
        yield phases

    def _positions(self, drafts: list[int], accepted: list[int]) -> Iterator:
        proposed = CounterMetricFamily(f"{PREFIX}_draft_position_proposed", "drafts verified at each draft "
                                       "position (1 = the first draft of a step)", labels=["position"])
        taken = CounterMetricFamily(f"{PREFIX}_draft_position_accepted", "drafts accepted at each draft position",
                                    labels=["position"])
        reached, kept = _at_least(drafts), _at_least(accepted)
        kept += [0] * (len(reached) - len(kept))
        for position, (n, a) in enumerate(zip(reached, kept), start=1):
            proposed.add_metric([str(position)], n)
            taken.add_metric([str(position)], a)
        yield proposed
        yield taken

    @staticmethod
    def _sequences(state: EngineState) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"{PREFIX}_sequences", "sequences in the engine: decoding (running), admitted "
                                   "with their prompt still going in (prefilling), queued (waiting)", labels=["state"])
        family.add_metric(["running"], state.running - state.prefilling)
        family.add_metric(["prefilling"], state.prefilling)
        family.add_metric(["waiting"], state.waiting)
        return family
