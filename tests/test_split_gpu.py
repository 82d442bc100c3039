"""The split on one GPU: rows cross by CUDA IPC handle; output equals the in-process engine."""

from __future__ import annotations

import pytest
import torch

from specsplit.shared.sampling import SamplingParams
from specsplit.harness import ServiceSpec
from specsplit.local import LocalSetup, load_local
from specsplit.target_service.sequence import Request

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPTS = ["The capital of France is", "def add(a, b):\n    ", "A short poem about the sea:\n"]
GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)


def local_tokens(drafter: str, params: SamplingParams = GREEDY) -> list[list[int]]:
    engine, tokenizer = load_local(LocalSetup(drafter=drafter, device="cuda", dtype="float32", seed=0))
    reqs = [Request(str(i), tokenizer.encode(p), params) for i, p in enumerate(PROMPTS)]
    events = engine.generate(reqs)
    return [[t for e in events[str(i)] for t in e.token_ids] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("kind", ["dflash", "random-mtp"])
def test_cuda_ipc_split_equals_in_process(kind, specsplit_factory):
    services = specsplit_factory(ServiceSpec(drafter=kind, device="cuda", dtype="float32"))
    client = services.client()
    remote = [client.generate(p, GREEDY) for p in PROMPTS]
    target_only, local = local_tokens("none"), local_tokens(kind)
    for i in range(len(PROMPTS)):
        assert remote[i].token_ids == local[i] == target_only[i]
        assert remote[i].stats.drafted > 0
    assert "cuda_ipc" in services.log("target")
