"""SIGKILL on one GPU with rows crossing by CUDA IPC (issue 9): a killed drafter changes no token and is
re-attached; a killed target leaves the drafter holding nothing of it (sessions, sequences, registered
IPC buffers back to zero) and serving the next target."""

from __future__ import annotations

import signal

import pytest
import torch

from specsplit.harness import ServiceSpec
from specsplit.shared.sampling import SamplingParams
from tests.test_cancellation import wait_until
from tests.test_metrics import free_port, scrape, value
from tests.test_split_gpu import PROMPTS, local_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
LONG = SamplingParams(max_tokens=64, ignore_eos=True)


def drafter_holds(port: int) -> dict[str, float]:
    samples = scrape(port)
    return {"streams": value(samples, "specsplit_drafter_sessions", stream="open"),
            "sessions": value(samples, "specsplit_drafter_sessions", stream="none"),
            **{name: value(samples, f"specsplit_drafter_{name}") for name in ("sequences", "buffers", "buffer_bytes")}}


def speculates(client, prompt: int, want: list[list[int]]) -> bool:
    """The prompt's tokens are target-only's, and the drafter took part (it is attached again)."""
    result = client.generate(PROMPTS[prompt], LONG)
    assert result.token_ids == want[prompt]
    return result.stats.drafted > 0


def test_sigkill_of_either_side_over_cuda_ipc(specsplit_factory):
    port = free_port()
    services = specsplit_factory(ServiceSpec(drafter="dflash", device="cuda", dtype="float32",
                                             drafter_args=("--metrics-port", str(port))))
    assert "cuda_ipc" in services.log("target")
    want = local_tokens("none", LONG)
    for trial in range(3):  # the drafter dies mid-stream: the stream finishes with target-only tokens
        client = services.client()
        tokens = []
        for i, chunk in enumerate(client.stream(PROMPTS[trial], LONG)):
            tokens += chunk.token_ids
            if i == 2:
                services.kill_drafter(signal.SIGKILL)
        assert tokens == want[trial]
        services.start_drafter()
        assert wait_until(lambda: speculates(client, 0, want), 60)
        client.close()
    assert drafter_holds(port)["buffers"] > 0  # the target's step, bulk and head buffers are registered
    target = services.procs.pop("target")  # the target dies: the drafter must let go of all of it
    target.send_signal(signal.SIGKILL)
    target.wait(timeout=30)
    assert wait_until(lambda: drafter_holds(port) == {"streams": 0, "sessions": 0, "sequences": 0, "buffers": 0,
                                                    "buffer_bytes": 0}, 60), drafter_holds(port)
    services.start_target()  # and serves the next target over CUDA IPC, tokens unchanged
    client = services.client()
    assert wait_until(lambda: speculates(client, 1, want), 60)
    client.close()
