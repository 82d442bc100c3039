"""specsplit.mps: a private MPS server beside a service pair, quit whenever the pair stops.

The CPU tests put a stand-in for `nvidia-cuda-mps-control` on PATH: `-f` runs until a client sends
`quit`, a client without a running daemon fails as the real one does, and each event is written to a record
outside the server's folder. The GPU test runs the real one (tests/test_split_gpu.py has the pair without it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specsplit.lifeline import Lifeline
from specsplit.mps import MpsServer
from specsplit.pair import Services, ServiceSpec, spawn
from specsplit.shared.errors import InvalidRequest

FAKE = """\
#!{python}
import os, sys, time
from pathlib import Path
pipe, logs = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"]), Path(os.environ["CUDA_MPS_LOG_DIRECTORY"])
record = Path(os.environ["FAKE_MPS_RECORD"])
def note(text):
    with open(record, "a") as f:
        f.write(text + "\\n")
if sys.argv[1:] == ["-f"]:
    if os.environ.get("FAKE_MPS_MODE") == "fail":
        print("fake: cannot start the control daemon", flush=True)
        sys.exit(3)
    (pipe / "daemon.pid").write_text(str(os.getpid()))
    (logs / "control.log").write_text("fake control log\\n")
    note(f"started {{os.getpid()}} {{pipe}}")
    while not (pipe / "quit").exists():
        time.sleep(0.02)
    note("quit")
    sys.exit(0)
command = sys.stdin.read().strip()
if not (pipe / "daemon.pid").exists():
    print("Cannot find MPS control daemon process")
    sys.exit(1)
if command == "quit":
    (pipe / "quit").touch()
sys.exit(0)
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    """The stand-in on PATH; returns the record's path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "nvidia-cuda-mps-control"
    program.write_text(FAKE.format(python=sys.executable))
    program.chmod(0o755)
    record = tmp_path / "record"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)  # (a machine's own server: not this test's)
    monkeypatch.setenv("FAKE_MPS_RECORD", str(record))
    return record


def wait_for(condition, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is gone as far as we care
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0


def test_the_daemon_runs_in_a_folder_of_its_own_and_is_quit_on_stop(fake_control):
    lifeline = Lifeline()
    server = MpsServer(lifeline)
    try:
        started = fake_control.read_text().split()
        assert started[0] == "started" and started[2] == server.env["CUDA_MPS_PIPE_DIRECTORY"]
        assert Path(server.env["CUDA_MPS_PIPE_DIRECTORY"]).parent == server.folder  # not the machine's own
        assert Path(server.env["CUDA_MPS_LOG_DIRECTORY"]).parent == server.folder
        assert "fake control log" in server.log()
        daemon = int(started[1])
        assert alive(daemon)
    finally:
        server.stop()
        lifeline.close()
    assert fake_control.read_text().splitlines()[-1] == "quit"
    assert not server.folder.exists() and wait_for(lambda: not alive(daemon))


def test_the_daemon_is_quit_when_the_process_that_started_it_is_killed(fake_control, tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from specsplit.lifeline import Lifeline
        from specsplit.mps import MpsServer
        server = MpsServer(Lifeline())
        print(server.folder, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        folder = Path(parent.stdout.readline().strip())
        assert folder.is_dir() and fake_control.read_text().startswith("started")
        daemon = int(fake_control.read_text().split()[1])
        parent.send_signal(signal.SIGKILL)  # no stop(), no atexit: only the lifeline tells the guard
    finally:
        parent.kill()
        parent.wait()
    assert wait_for(lambda: fake_control.read_text().splitlines()[-1] == "quit")
    assert wait_for(lambda: not folder.exists()) and wait_for(lambda: not alive(daemon))


def test_a_daemon_that_does_not_start_is_reported_with_its_words(fake_control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_MODE", "fail")
    lifeline = Lifeline()
    try:
        with pytest.raises(RuntimeError, match="did not start") as failure:
            MpsServer(lifeline)
    finally:
        lifeline.close()
    assert "fake: cannot start the control daemon" in str(failure.value)
    assert not fake_control.exists()  # it never ran


def test_without_the_control_program_mps_is_refused_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    lifeline = Lifeline()
    try:
        with pytest.raises(RuntimeError, match="needs NVIDIA's nvidia-cuda-mps-control on PATH"):
            MpsServer(lifeline)
    finally:
        lifeline.close()


def test_an_mps_client_already_is_not_given_a_second_server(fake_control, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/var/run/mps-of-the-node")
    lifeline = Lifeline()
    try:
        with pytest.raises(RuntimeError, match="clients of that MPS server already, not of a private one"):
            MpsServer(lifeline)
    finally:
        lifeline.close()
    assert not fake_control.exists()


def test_the_command_line_reports_a_missing_control_program_as_an_error(monkeypatch, tmp_path, capsys):
    from specsplit.cli import main

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    assert main(["up", "--mps", "--device", "cuda", "--target", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err  # (the server starts before the services: nothing else ran)
    assert err.startswith("specsplit: error: a private MPS server needs NVIDIA's nvidia-cuda-mps-control on PATH")


def recorded_starts(monkeypatch, fail_under_mps: bool = False) -> list[bool]:
    """Services' starts stand in: each records whether the pair's MPS server is up, and fails under it if asked."""
    starts = []

    def start(self):
        starts.append(self.mps is not None)
        if fail_under_mps and self.mps is not None:
            raise RuntimeError("the service exited before it was healthy\n--- drafter.log ---\nMPS client failed")

    monkeypatch.setattr(Services, "start_drafter", start)
    monkeypatch.setattr(Services, "start_target", start)
    return starts


def test_a_pair_asked_to_try_mps_runs_under_it_on_a_gpu(fake_control, monkeypatch, tmp_path):
    auto = dict(device="cuda", mps=None)
    assert ServiceSpec(**auto).tries_mps and ServiceSpec(device="cuda:1", mps=True).tries_mps
    assert ServiceSpec(device="cuda").tries_mps  # (auto by default: see ServiceSpec.mps)
    assert not ServiceSpec(drafter="none", **auto).tries_mps and not ServiceSpec(mps=None).tries_mps  # (the CPU)
    starts = recorded_starts(monkeypatch)
    services = spawn(ServiceSpec(target=str(tmp_path), **auto))
    try:
        assert starts == [True, True] and fake_control.read_text().startswith("started")
    finally:
        services.stop()
    assert fake_control.read_text().splitlines()[-1] == "quit"
    starts.clear()
    spawn(ServiceSpec(target=str(tmp_path), device="cuda", mps=False)).stop()
    assert starts == [False, False]


def test_where_mps_cannot_start_the_pair_starts_without_it_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no control program
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    starts = recorded_starts(monkeypatch)
    with caplog.at_level("WARNING", logger="specsplit.pair"):
        services = spawn(ServiceSpec(target=str(tmp_path), device="cuda", mps=None))
    services.stop()
    assert starts == [False, False]
    assert "without MPS" in caplog.text and "nvidia-cuda-mps-control on PATH" in caplog.text
    with pytest.raises(RuntimeError, match="nvidia-cuda-mps-control on PATH"):  # asked for: an error
        spawn(ServiceSpec(target=str(tmp_path), device="cuda", mps=True))
    assert starts == [False, False]


def test_services_that_do_not_start_under_mps_start_again_without_it(fake_control, monkeypatch, tmp_path, caplog):
    starts = recorded_starts(monkeypatch, fail_under_mps=True)
    with caplog.at_level("WARNING", logger="specsplit.pair"):
        services = spawn(ServiceSpec(target=str(tmp_path), device="cuda", mps=None))
    services.stop()
    assert starts == [True, False, False] and services.mps is None
    assert "did not start under MPS; starting them without it: the service exited" in caplog.text
    assert fake_control.read_text().splitlines()[-1] == "quit"  # the first server was quit
    starts.clear()
    with pytest.raises(RuntimeError, match="MPS client failed"):  # asked for: no second try
        spawn(ServiceSpec(target=str(tmp_path), device="cuda", mps=True))
    assert starts == [True]

@pytest.mark.parametrize("given,mps", [([], None), (["--mps"], True), (["--mps", "on"], True),
                                       (["--mps", "auto"], None), (["--mps", "off"], False)])
def test_the_command_line_asks_for_mps_on_auto_or_off(given, mps, monkeypatch):
    from specsplit import cli, pair

    specs = []
    monkeypatch.setattr(pair, "spawn", lambda spec: specs.append(spec) or (_ for _ in ()).throw(SystemExit(0)))
    for command in ("up", "demo"):
        args = cli.build_parser().parse_args([command, "--device", "cuda", *given])
        assert cli.MPS_CHOICES[args.mps] is mps
    with pytest.raises(SystemExit):
        cli.main(["up", "--device", "cuda", *given])
    assert specs[0].mps is mps
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["up", "--mps", "sometimes"])

def test_mps_needs_a_cuda_device():
    with pytest.raises(InvalidRequest, match="needs a CUDA device, not 'cpu'"):
        ServiceSpec(mps=True)
    assert ServiceSpec(device="cuda:1", mps=True).mps


def test_the_command_line_refuses_mps_on_the_cpu_before_starting_anything(capsys):
    from specsplit.cli import main

    assert main(["up", "--mps"]) != 0
    assert "--mps shares one GPU between the two services: it needs a CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_pair_under_mps_equals_the_pair_without(specsplit_factory):
    import shutil

    import torch

    if not torch.cuda.is_available() or shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("needs a CUDA GPU and nvidia-cuda-mps-control")
    from specsplit.shared.sampling import SamplingParams

    params = SamplingParams(max_tokens=48, ignore_eos=True)
    prompts = ["The capital of France is", "def add(a, b):\n    "]
    texts = {}
    for mps in (False, True):
        services = specsplit_factory(ServiceSpec(drafter="dflash", device="cuda", dtype="float32", mps=mps))
        client = services.client()
        try:
            results = [client.generate(p, params) for p in prompts]
        finally:
            client.close()
        assert all(r.stats.drafted > 0 for r in results)
        texts[mps] = [r.token_ids for r in results]
        if mps:  # both services became the private server's clients
            answer = subprocess.run(["nvidia-cuda-mps-control"], input="get_server_list\n", text=True,
                                    capture_output=True, env={**os.environ, **services.mps.env}, timeout=15)
            assert answer.returncode == 0 and answer.stdout.split(), answer
            folder = services.mps.folder
        services.stop()
    assert texts[True] == texts[False]
    assert not folder.exists()
