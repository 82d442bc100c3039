"""The wheel installs one top-level package, `specsplit`, holding every folder of the layout and its data;
it installs with its dependencies in a clean venv, and `specsplit --version` runs from there."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import venv
import zipfile
from importlib.metadata import version
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
                 *(f"specsplit/drafter_service/checkpoints/smollm2-135m-dflash/model-0000{i}-of-00004.safetensors"
                   for i in (1, 2, 3, 4)),
                 "specsplit/drafter_service/checkpoints/smollm2-135m-dflash/model.safetensors.index.json",
                 "specsplit/drafter_service/checkpoints/smollm2-135m-mtp/model.safetensors",
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


@pytest.mark.slow
def test_the_wheel_installs_in_a_clean_venv_and_specsplit_version_runs(wheel, tmp_path):
    """pip resolves the wheel's own dependency list in an empty venv. torch is held to the build these tests
    run on (here the CPU wheel pip finds through its find-links setting, see the README's torch note):
    left free, pip takes the newest torch it can see, on Linux the multi-GB CUDA build."""
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"torch=={version('torch')}\n")
    subprocess.run([str(env / "bin/python"), "-m", "pip", "install", "-q", "-c", str(constraints), str(wheel)],
                   check=True, capture_output=True)
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    shown = subprocess.run([str(env / "bin/specsplit"), "--version"], cwd=tmp_path, capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.strip() == f"specsplit {expected}", shown.stderr[-2000:]
    code = ("import specsplit.client, specsplit.services, specsplit.cli, sys; "
            "assert specsplit.cli.__file__.startswith(sys.prefix), specsplit.cli.__file__")
    imported = subprocess.run([str(env / "bin/python"), "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert imported.returncode == 0, imported.stderr[-2000:]


def test_version_and_help_import_neither_torch_nor_grpc():
    """`specsplit --version` (a probe, a packaging check) answers without loading the model stack."""
    code = ("import sys, specsplit.cli as cli\n"
            "for argv in (['--version'], ['--help'], ['generate', '--help']):\n"
            "    try:\n        cli.main(argv)\n    except SystemExit as done:\n        assert done.code == 0, argv\n"
            "heavy = sorted({'torch', 'numpy', 'grpc'} & set(sys.modules))\n"
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
