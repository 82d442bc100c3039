"""The target service's Prometheus metrics: requests by outcome, and what the engine counted
(`target_service.counters`), read at scrape time. Names and meanings are listed in the README
("Observability")."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from specsplit.shared.metrics import ServiceMetrics, buckets
from specsplit.target_service.counters import EngineCounters

PREFIX = "specsplit_target"
_MIN_DRAFT_BOUNDS = 17  # buckets 0..16 always (the shipped DFlash drafts up to 15), more if seen


class TargetMetrics(ServiceMetrics):
    """Requests by outcome (counted by the servicer) plus the engine's counters and state."""

    def __init__(self, engine, open_streams: Callable[[], int]) -> None:
        super().__init__(PREFIX)
        self.requests = Counter(f"{PREFIX}_requests", "Generate requests by outcome: a finish reason (length, eos, "
                                "stop), cancelled, or the refusing status code (invalid_argument, ...)",
                                ["outcome"], registry=self.registry)
        self.registry.register(_EngineCollector(engine, open_streams))


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


class _EngineCollector(Collector):
    def __init__(self, engine, open_streams: Callable[[], int]) -> None:
        self.engine = engine
        self.open_streams = open_streams

    def collect(self) -> Iterator:
        engine = self.engine
        c: EngineCounters = engine.counters
        drafts, accepted = list(c.drafts), list(c.accepted)  # one copy each: the engine thread appends
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
        yield _gauge("drafter_attached", "1 while a drafter is attached", float(engine.drafter_ok))
        link = getattr(engine.proposer, "link", None)  # a drafter service's connection (RemoteProposer)
        if link is not None:
            yield _counter("drafter_steps_sent_ahead", "Step messages sent before their answer was needed (a "
                           "step's commits, with the next step's proposes), their answers read later", link.sent_ahead)
            yield _counter("drafter_drafts_taken_ahead", "proposals taken from a Step sent ahead (no round trip "
                           "of their own)", link.drafts_ahead)
            yield _counter("drafter_chain_proposes_taken_regrouped", "chained proposes sent ahead taken by a step "
                           "whose batch had changed (sequences ended, attached, or back from sitting a step out)",
                           link.chain_taken_regrouped)
            yield _counter("drafter_device_waits", "chained steps' drafts our stream waited for on the device "
                           "(device waits: on the drafter's host page by default, --device-waits), not our host",
                           link.device_waits)
            yield _counter("drafter_drafts_taken_unanswered", "of those, chained proposes sent ahead whose drafts "
                           "the verify took before their answer was read (the answer checked after the launch)",
                           link.taken_unanswered)
            yield _counter("drafter_device_waits_released", "releases of device waits by the target itself (per "
                           "DONE buffer): a drafter that missed a step's deadline (it is dropped), or a drafter "
                           "dropped for any reason with waits pending",
                           getattr(engine.proposer, "waits_released", 0))
            transport = GaugeMetricFamily(f"{PREFIX}_drafter_step_transport", "1 for the carrier of the Step stream "
                                          "while a drafter is attached: socket (its step socket) or grpc",
                                          labels=["transport"])
            for name in ("socket", "grpc"):
                transport.add_metric([name], float(engine.drafter_ok and engine.proposer.step_transport == name))
            yield transport
        tuner = engine.tuner
        if tuner is not None:
            lengths = GaugeMetricFamily(f"{PREFIX}_draft_length", "--num-drafts auto: the draft length the engine "
                                        "learned for steps of up to `batch` sequences (a power of two)",
                                        labels=["batch"])
            for bucket, k in tuner.learned().items():
                lengths.add_metric([str(bucket)], k)
            yield lengths
        yield self._sequences()
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

    def _sequences(self) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"{PREFIX}_sequences", "sequences in the engine: decoding (running), admitted "
                                   "with their prompt still going in (prefilling), queued (waiting)", labels=["state"])
        prefilling = self.engine.prefilling
        family.add_metric(["running"], len(self.engine.running) - prefilling)
        family.add_metric(["prefilling"], prefilling)
        family.add_metric(["waiting"], len(self.engine.waiting))
        return family
