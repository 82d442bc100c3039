"""The wheel installs one top-level package, `specsplit`, holding every folder of the layout and its data."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True)
    (found,) = out.glob("specsplit-*.whl")
    return found


@pytest.mark.slow
def test_the_wheel_installs_only_the_specsplit_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"specsplit", wheel.name.split("-py3")[0] + ".dist-info"}
    for generic in ("shared", "kernels", "protos", "target_service", "drafter_service"):
        assert not any(n.startswith(generic + "/") for n in names)
        assert any(n.startswith(f"specsplit/{generic}/") for n in names)
    for data in ("specsplit/protos/v1/drafter.proto", "specsplit/protos/v1/drafter_pb2.pyi",
                 "specsplit/drafter_service/checkpoints/smollm2-135m-dflash/model.safetensors",
                 "specsplit/data/heldout_prompts.jsonl"):
        assert data in names


@pytest.mark.slow
def test_the_installed_packages_import_from_the_wheel(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    site = tmp_path / "site"
    code = (f"import sys; sys.path.insert(0, {str(site)!r}); "
            "import specsplit.cli, specsplit.shared.wire, specsplit.protos.v1.drafter_pb2_grpc, "
            "specsplit.target_service.engine, specsplit.drafter_service.server, specsplit.kernels.paged_attention; "
            f"mods = [m for n, m in sys.modules.items() if n.startswith('specsplit')]; "
            f"assert all(m.__file__.startswith({str(site)!r}) for m in mods if getattr(m, '__file__', None)), mods")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
