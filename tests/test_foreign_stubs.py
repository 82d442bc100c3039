"""The protos are the contract for other languages: stubs generated fresh from protos/ by grpcio-tools,
in a virtual environment without our package, drive a spawned target service.

The venv gets grpcio, protobuf and grpcio-tools at the versions pyproject.toml asks for (pip reaches the
package index), and nothing of ours but the .proto files.
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from specsplit.client import Client
from specsplit.pair import ServiceSpec, spawn
from specsplit.shared.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Count to ten:"
MAX_TOKENS = 12

# Run in the foreign venv: only the generated stubs and grpc. Prints one JSON object.
FOREIGN_CLIENT = f"""
import importlib.util, json, sys
import grpc
from protos.specsplit.v1 import common_pb2, target_pb2, target_pb2_grpc

assert importlib.util.find_spec("specsplit") is None, "specsplit is importable in the foreign venv"
stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(sys.argv[1]))
request = target_pb2.GenerateRequest(
    text={PROMPT!r}, sampling=common_pb2.SamplingParams(max_tokens={MAX_TOKENS}, ignore_eos=True))
replies = list(stub.Generate(request, timeout=120))
try:
    list(stub.Generate(target_pb2.GenerateRequest(), timeout=120))  # no prompt at all
    refused = "OK"
except grpc.RpcError as err:
    refused = err.code().name
print(json.dumps({{
    "token_ids": [t for r in replies for t in r.token_ids],
    "text": "".join(r.text for r in replies),
    "finish_reason": target_pb2.FinishReason.Name(replies[-1].finish_reason),
    "refused": refused,
    "ours": sorted(m for m in sys.modules if m.startswith("specsplit")),
}}))
"""


def pinned_requirements() -> list[str]:
    """grpcio and protobuf as our dependencies name them, grpcio-tools as the [dev] extra does."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {"grpcio", "protobuf", "grpcio-tools"}
    found = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["dev"]]]
    picked = [str(r) for r in found if r.name in wanted]
    assert {Requirement(r).name for r in picked} == wanted, picked
    return picked


def protoc_stubs(python: Path, out: Path) -> None:
    """protoc roots imports at the repository, so the stubs come out as the `protos.specsplit.v1` package."""
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos/specsplit/v1").glob("*.proto"))
    subprocess.run([str(python), "-m", "grpc_tools.protoc", "-I", str(ROOT), f"--python_out={out}",
                    f"--grpc_python_out={out}", *protos], check=True, cwd=out, capture_output=True)


@pytest.mark.slow
def test_stubs_generated_from_the_protos_drive_the_target_service(tmp_path, tiny_chat_dir):
    env_dir, out = tmp_path / "venv", tmp_path / "stubs"
    out.mkdir()
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", *pinned_requirements()], check=True,
                   capture_output=True)
    protoc_stubs(python, out)
    (out / "foreign_client.py").write_text(FOREIGN_CLIENT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}

    with spawn(ServiceSpec(target=str(tiny_chat_dir), drafter="random-dflash"), tmp_path / "pair") as services:
        ran = subprocess.run([str(python), "foreign_client.py", services.target_address], cwd=out, env=env,
                             capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr[-3000:]
        with Client(services.target_address, timeout=120) as client:
            ours = client.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))

    foreign = json.loads(ran.stdout)
    assert foreign["ours"] == [] and foreign["refused"] == "INVALID_ARGUMENT"
    assert foreign["token_ids"] == ours.token_ids and len(ours.token_ids) == MAX_TOKENS
    assert foreign["text"] == ours.text and foreign["finish_reason"] == "FINISH_REASON_LENGTH"
