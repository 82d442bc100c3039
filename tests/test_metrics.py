"""Prometheus metrics of both services, scraped over HTTP after real requests: the counters move, and they
agree with what the request's own stats say (τ, drafts verified and accepted, per draft position).

In this process: the tiny chat target (tests/conftest.py) and a random DFlash drafter on unix sockets."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specsplit.local import LocalSetup
from specsplit.protos.v1 import drafter_pb2_grpc
from specsplit.services import DrafterSettings, TargetSettings, start_drafter, start_target
from specsplit.shared import wire
from specsplit.client import ServiceError
from specsplit.shared.errors import InvalidRequest
from specsplit.shared.metrics import MetricsAddress
from specsplit.shared.sampling import SamplingParams
from tests.raw_client import RawClient
from specsplit.target_service.engine import Engine, EngineConfig
from specsplit.target_service.metrics import TargetMetrics, engine_state
from specsplit.target_service.model import load_target
from specsplit.target_service.sequence import Request
from tests.test_cancellation import wait_until
from tests.oracle import OracleDrafter
from tests.test_engine import FlakyDrafter, drafter

LOCAL = MetricsAddress("127.0.0.1", 0)  # any free port
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from http://127.0.0.1:PORT/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        return parse(answer.read().decode())


def parse(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_chat_dir):
    """(drafter server, target client, drafter address, target port, drafter port), both exposing metrics."""
    folder = tmp_path_factory.mktemp("metrics")
    drafter_address, target_address = f"unix:{folder}/d.sock", f"unix:{folder}/t.sock"
    drafter_obj, drafter_served = start_drafter(DrafterSettings(
        (drafter_address,), LocalSetup(target=str(tiny_chat_dir), drafter="random-dflash"), metrics=LOCAL))
    loop, target_served = start_target(TargetSettings(
        (target_address,), LocalSetup(target=str(tiny_chat_dir)), drafter_address, EngineConfig(max_batch=4),
        metrics=LOCAL))
    client = RawClient(target_address, timeout=120)
    yield drafter_obj, client, drafter_address, target_served._metrics.port, drafter_obj.metrics.port
    client.close()
    target_served.stop(None).wait()
    loop.stop()
    drafter_served.stop(None).wait()
    drafter_obj.close()


def test_a_request_moves_the_target_and_drafter_counters_consistently(pair):
    drafter_obj, client, _, target_port, drafter_port = pair
    before_t, before_d = scrape(target_port), scrape(drafter_port)
    result = client.generate("The capital of France is", GREEDY)
    after_t = scrape(target_port)
    assert wait_until(lambda: value(scrape(drafter_port), "specsplit_drafter_sequences") == 0)  # freed by a flush
    after_d = scrape(drafter_port)

    def moved(samples_before, samples_after, name, **labels):
        return value(samples_after, name, **labels) - value(samples_before, name, **labels)

    t = lambda name, **labels: moved(before_t, after_t, f"specsplit_target_{name}", **labels)  # noqa: E731
    d = lambda name, **labels: moved(before_d, after_d, f"specsplit_drafter_{name}", **labels)  # noqa: E731
    stats = result.stats
    assert t("requests_total", outcome="length") == 1
    assert t("rpcs_total", method="/specsplit.v1.TargetService/Generate", code="OK") == 1
    assert t("tokens_total") == len(result.token_ids) == 12
    assert t("prefills_total") == 1
    # One sequence: every batched step is one verify of it; τ's parts are the request's own stats.
    assert t("steps_total") == t("accepted_drafts_count") == t("verified_drafts_count") == stats.steps - 1
    assert t("verified_drafts_sum") == stats.drafted > 0
    assert t("accepted_drafts_sum") == stats.accepted
    assert 1 + t("accepted_drafts_sum") / t("accepted_drafts_count") == pytest.approx(
        (stats.tau * stats.steps - 1) / (stats.steps - 1), rel=1e-3)
    # Per draft position: summed over positions they are the drafts verified and accepted.
    positions = range(1, 17)
    assert sum(t("draft_position_proposed_total", position=str(p)) for p in positions) == stats.drafted
    assert sum(t("draft_position_accepted_total", position=str(p)) for p in positions) == stats.accepted
    # A step with no drafts (the last token is decoded serially) counts at no position.
    proposing = t("steps_total") - t("verified_drafts_bucket", le="0.0")
    assert t("draft_position_proposed_total", position="1") == proposing > 0
    assert t("step_seconds_count", phase="propose") == proposing
    assert t("step_seconds_count", phase="verify") == t("step_seconds_count", phase="control") == t("steps_total")
    assert value(after_t, "specsplit_target_drafter_attached") == 1
    assert value(after_t, "specsplit_target_drafter_step_transport", transport="socket") == 1  # one host
    assert value(after_t, "specsplit_target_drafter_step_transport", transport="grpc") == 0
    # After the first step, each step's drafts were proposed with the step before's commits.
    assert 0 < t("drafter_drafts_taken_ahead_total") <= t("drafter_steps_sent_ahead_total") <= proposing
    # (device waits: on a GPU with --device-waits only)
    assert t("drafter_device_waits_total") == t("drafter_device_waits_released_total") == 0
    assert t("drafter_drafts_taken_unanswered_total") == 0
    # (exported; no chained steps on the CPU)
    assert after_t[("specsplit_target_drafter_chain_proposes_taken_regrouped_total", ())] == 0
    assert value(after_t, "specsplit_target_sequences", state="running") == 0
    assert value(after_t, "specsplit_target_sequences", state="prefilling") == 0
    # The drafter proposed every draft the target verified, one Step message per step (and the free).
    assert d("draft_tokens_total") == stats.drafted
    assert d("proposals_total") == proposing
    assert d("step_seconds_count") >= proposing
    # The parts of the Step messages add up to within their whole.
    phases = ("parse", "ready", "lock", "commit", "rows", "context", "propose", "replay", "wait", "encode")
    assert all(d("step_phase_seconds_total", phase=p) >= 0 for p in phases)
    assert 0 < sum(d("step_phase_seconds_total", phase=p) for p in phases) <= d("step_seconds_sum")
    assert d("step_phase_seconds_total", phase="propose") > 0
    # (no GPU, so no fused chained steps: exported, all zero)
    graphed = {o: after_d.get(("specsplit_drafter_chain_graph_steps_total", (("outcome", o),)))
               for o in ("uncaptured", "captured", "replayed", "failed", "prepared", "waited")}
    assert graphed == dict.fromkeys(graphed, 0.0), graphed
    # One call attached the sequence: its prefill allocated it (its parts timed, the context forward among them;
    # none rode a Step: EngineConfig.stream_attach is off)
    assert d("rpcs_total", method="/specsplit.v1.DrafterService/PrefillDrafter", code="OK") == d("prefills_total") == 1
    assert d("rpcs_total", method="/specsplit.v1.DrafterService/AllocState", code="OK") == 0
    assert d("step_attaches_total") == 0
    prefill_phases = ("ready", "lock", "alloc", "rows", "context", "wait")
    assert all(d("prefill_phase_seconds_total", phase=p) >= 0 for p in prefill_phases)
    assert d("prefill_phase_seconds_total", phase="context") > 0
    assert value(after_d, "specsplit_drafter_sessions", stream="open") == 1
    assert value(after_d, "specsplit_drafter_buffers") >= 2  # step and bulk row buffers (shared memory)
    assert value(after_d, "specsplit_drafter_buffer_bytes") > 0
    assert value(after_d, "process_resident_memory_bytes") > 0


def test_refused_calls_are_counted_by_status_code(pair):
    _, client, drafter_address, target_port, drafter_port = pair
    before_t, before_d = scrape(target_port), scrape(drafter_port)
    with pytest.raises(ServiceError) as refused:
        client.generate("hello", GREEDY, request_id="not an id\n")  # a space and a newline
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(drafter_address) as channel:  # no client header: INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            drafter_pb2_grpc.DrafterServiceStub(channel).AllocState(wire.alloc_to_proto(0, 8), timeout=30)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    after_t, after_d = scrape(target_port), scrape(drafter_port)
    for samples_before, samples_after, name, labels in (
            (before_t, after_t, "specsplit_target_requests_total", {"outcome": "invalid_argument"}),
            (before_t, after_t, "specsplit_target_rpcs_total",
             {"method": "/specsplit.v1.TargetService/Generate", "code": "INVALID_ARGUMENT"}),
            (before_d, after_d, "specsplit_drafter_rpcs_total",
             {"method": "/specsplit.v1.DrafterService/AllocState", "code": "INVALID_ARGUMENT"})):
        assert value(samples_after, name, **labels) - value(samples_before, name, **labels) == 1, name


def test_a_cancelled_stream_is_counted_as_cancelled(pair):
    _, client, _, target_port, _ = pair
    generate = {"method": "/specsplit.v1.TargetService/Generate", "code": "CANCELLED"}
    before = scrape(target_port)
    stream = client.stub.Generate(wire.generate_to_proto(wire.GenerateCall(
        "Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))), timeout=120)
    next(stream)
    stream.cancel()
    # The call is counted as it ends, after the request's outcome: once it is, both are.
    assert wait_until(lambda: value(scrape(target_port), "specsplit_target_rpcs_total", **generate)
                      == value(before, "specsplit_target_rpcs_total", **generate) + 1)
    after = scrape(target_port)
    assert value(after, "specsplit_target_requests_total", outcome="cancelled") == value(
        before, "specsplit_target_requests_total", outcome="cancelled") + 1


def test_drafter_fallbacks_and_reattaches_are_counted(tiny_chat_dir, tiny_chat_tokenizer_prompts):
    target = load_target(tiny_chat_dir, dtype=torch.float32)
    flaky = FlakyDrafter(drafter("mtp", target), fail_after=2)
    engine = Engine(target, flaky, EngineConfig(max_batch=2))
    metrics = TargetMetrics(lambda: engine_state(engine), open_streams=lambda: 0)
    for i, prompt in enumerate(tiny_chat_tokenizer_prompts):
        engine.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=16, ignore_eos=True)))
    steps = 0
    while engine.has_work:
        steps += 1
        if steps == 6:
            flaky.up = True  # back: the engine re-attaches
        engine.step()
    samples = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "specsplit_target_drafter_fallbacks_total") == 1  # one outage, however many verbs failed
    assert value(samples, "specsplit_target_drafter_reattaches_total") == 1
    assert value(samples, "specsplit_target_drafter_rests_total") == 0  # (no batch size drafts nothing)
    assert value(samples, "specsplit_target_drafter_attached") == 1
    assert value(samples, "specsplit_target_tokens_total") == 32
    assert value(samples, "specsplit_target_verified_drafts_bucket", le="0.0") > 0  # serial steps while detached


def test_acceptance_by_draft_position_adds_up_to_the_requests_stats(tiny_chat_dir, tiny_chat_tokenizer_prompts):
    """An oracle drafter (the target's own continuation, a few mistakes) gives long accepted runs."""
    target = load_target(tiny_chat_dir, dtype=torch.float32)
    make = lambda: [Request(f"r{i}", p, SamplingParams(max_tokens=24, ignore_eos=True))  # noqa: E731
                    for i, p in enumerate(tiny_chat_tokenizer_prompts)]
    reference = Engine(target, None, EngineConfig(max_batch=2)).generate(make())
    continuations = {tuple(r.prompt_ids): r.prompt_ids + [t for e in reference[r.request_id] for t in e.token_ids]
                     for r in make()}
    oracle = OracleDrafter(drafter("dflash", target, block_size=8, window=12), continuations, mistake_rate=0.1)
    engine = Engine(target, oracle, EngineConfig(max_batch=2))
    metrics = TargetMetrics(lambda: engine_state(engine), open_streams=lambda: 0)
    stats = [events[-1].stats for events in engine.generate(make()).values()]
    samples = parse(generate_latest(metrics.registry).decode())
    proposed = [value(samples, "specsplit_target_draft_position_proposed_total", position=str(p)) for p in range(1, 8)]
    accepted = [value(samples, "specsplit_target_draft_position_accepted_total", position=str(p)) for p in range(1, 8)]
    assert sum(proposed) == sum(s.drafted for s in stats) and sum(accepted) == sum(s.accepted for s in stats)
    assert accepted[0] > 0 and accepted[6] > 0  # long runs: the 7th draft accepted too
    assert all(a <= n for a, n in zip(accepted, proposed))  # no position accepts more than it was offered
    assert accepted == sorted(accepted, reverse=True)  # a draft is accepted only after all before it
    assert value(samples, "specsplit_target_accepted_drafts_sum") == sum(accepted)


def test_learned_draft_lengths_are_exported(tiny_chat_dir, tiny_chat_tokenizer_prompts):
    target = load_target(tiny_chat_dir, dtype=torch.float32)
    engine = Engine(target, drafter("dflash", target, block_size=8), EngineConfig(max_batch=2, auto_drafts=True))
    metrics = TargetMetrics(lambda: engine_state(engine), open_streams=lambda: 0)
    assert "specsplit_target_draft_length{" not in generate_latest(metrics.registry).decode()  # nothing seen yet
    engine.generate([Request(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True))
                     for i, p in enumerate(tiny_chat_tokenizer_prompts)])
    samples = parse(generate_latest(metrics.registry).decode())
    learned = engine.tuner.learned()
    exported = {dict(labels)["batch"]: v for (name, labels), v in samples.items()
                if name == "specsplit_target_draft_length"}
    assert learned and exported == {str(b): k for b, k in learned.items()}
    assert set(learned.values()) <= set(engine.tuner.choices)


@pytest.fixture(scope="module")
def tiny_chat_tokenizer_prompts(tiny_chat_dir):
    from specsplit.shared.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_chat_dir)
    return [tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]


def test_two_servers_in_one_process_keep_their_own_registries(pair):
    _, _, _, target_port, drafter_port = pair
    target_names = {name for name, _ in scrape(target_port)}
    drafter_names = {name for name, _ in scrape(drafter_port)}
    assert "specsplit_target_tokens_total" in target_names and "specsplit_target_tokens_total" not in drafter_names
    assert "specsplit_drafter_sessions" in drafter_names and "specsplit_drafter_sessions" not in target_names


def test_metrics_address_is_checked_and_a_taken_port_is_a_clear_error(pair):
    _, _, _, target_port, _ = pair
    with pytest.raises(InvalidRequest, match="metrics-port"):
        MetricsAddress("127.0.0.1", 70000)
    from specsplit.shared.metrics import ServiceMetrics

    metrics = ServiceMetrics("specsplit_test")
    with pytest.raises(InvalidRequest, match=f"cannot serve metrics on 127.0.0.1:{target_port}"):
        metrics.expose(MetricsAddress("127.0.0.1", target_port))


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Ports free now, all different: each is held until all are picked (a port picked and let go can be picked
    again at once, and the two services then fought over one: "Address already in use" in a CI run)."""
    import contextlib
    import socket

    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


@pytest.mark.slow
def test_spawned_services_serve_metrics_and_json_logs_from_flags_and_environment(
        specsplit_factory, tiny_chat_dir, monkeypatch):
    """The command line end to end: --metrics-port on each, SPECSPLIT_LOG_FORMAT=json for both (inherited)."""
    import json

    from specsplit.harness import ServiceSpec

    monkeypatch.setenv("SPECSPLIT_LOG_FORMAT", "json")
    ports = dict(zip(("target", "drafter"), free_ports(2)))
    services = specsplit_factory(ServiceSpec(
        target=str(tiny_chat_dir), drafter="random-dflash", startup_timeout=300,
        target_args=("--metrics-port", str(ports["target"])), drafter_args=("--metrics-port", str(ports["drafter"]))))
    client = RawClient(services.target_address)
    call = client.stub.Generate(wire.generate_to_proto(wire.GenerateCall("Hello", GREEDY)), timeout=120,
                                metadata=(("x-request-id", "spawned-1"),))
    assert list(call)[-1].finish_reason and dict(call.initial_metadata())["x-request-id"] == "spawned-1"
    client.close()
    target, drafter_samples = scrape(ports["target"]), scrape(ports["drafter"])
    assert value(target, "specsplit_target_requests_total", outcome="length") == 1
    assert value(target, "specsplit_target_tokens_total") == 12
    assert value(drafter_samples, "specsplit_drafter_draft_tokens_total") == value(
        target, "specsplit_target_verified_drafts_sum") > 0
    services.stop()  # the target first: the drafter logs its disconnect
    logged = {name: [json.loads(line) for line in services.log(name).splitlines() if line.startswith("{")]
              for name in ("target", "drafter")}
    assert any(line.get("request_id") == "spawned-1" and "finished" in line["message"] for line in logged["target"])
    assert any(line.get("client_id") and "disconnected" in line["message"] for line in logged["drafter"])


def test_drafts_written_into_the_targets_buffer_are_counted_as_proposals():
    """A Step answered with its drafts in the target's buffer has no Proposal objects: its sequences and
    draft tokens still count."""
    from specsplit.drafter_service.metrics import DrafterMetrics
    from specsplit.shared.proposer import Proposal
    from specsplit.shared.wire import StepResult

    metrics = DrafterMetrics(lambda: [])
    metrics.answered(StepResult(1, {4: Proposal(tokens=[1, 2])}), 0.001)
    metrics.answered(StepResult(2, {}, (), in_buffer=((5, 3), (6, 7))), 0.001)
    assert metrics.proposals._value.get() == 3
    assert metrics.draft_tokens._value.get() == 12


def test_sequences_resting_from_the_drafter_are_counted(tiny_chat_dir, tiny_chat_tokenizer_prompts):
    """EngineConfig.resume_after: two sequences a step draft nothing (drafts_by_batch (2, 0)), so both rest from
    the drafter as they are admitted; the longer one, alone after the shorter ends, is attached again."""
    target = load_target(tiny_chat_dir, dtype=torch.float32)
    engine = Engine(target, drafter("mtp", target), EngineConfig(max_batch=2, drafts_by_batch=((2, 0),),
                                                                 resume_after=2))
    metrics = TargetMetrics(lambda: engine_state(engine), open_streams=lambda: 0)
    for i, (prompt, n) in enumerate(zip(tiny_chat_tokenizer_prompts[:2], (4, 16))):
        engine.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
    while engine.has_work:
        engine.step()
    samples = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "specsplit_target_drafter_rests_total") == 2
    assert value(samples, "specsplit_target_drafter_resumes_total") == 1
