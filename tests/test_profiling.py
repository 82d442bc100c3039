"""--profile-steps: a torch profile of a window of the drafter service's Step messages."""

from __future__ import annotations

import json

import pytest

from specsplit.cli import main
from specsplit.drafter_service.server import DrafterServer, serve
from specsplit.shared.profiling import StepWindow, parse_window
from specsplit.target_service.drafter_client import RemoteProposer
from tests.test_drafter_server import make_drafter
from tests.test_step_socket import drafts


def test_parse_window():
    assert parse_window("3:7") == (3, 7) and parse_window("5:5") == (5, 5)
    for bad in ("7", "0:4", "5:4", "a:b", "-1:3", "3:", ":3", "1:2:3"):
        with pytest.raises(ValueError):
            parse_window(bad)


@pytest.mark.parametrize("host_only", [False, True], ids=["default", "host-only"])
def test_the_window_of_step_messages_is_profiled_once(tmp_path, host_only):
    """Steps 2..3 of the served Step messages are recorded (the drafter's own ops among them); the trace
    is written once, when step 3 ends, and later steps record nothing. Host only (--profile-host): the
    summary also groups the ops by the Python lines that called them."""
    made = make_drafter()
    server_obj = DrafterServer(made, head=made.head, device="cpu")
    server_obj.profile = window = StepWindow(2, 3, tmp_path / "out" / "trace.json", host_only=host_only)
    address = f"unix:{tmp_path}/d.sock"
    server = serve(server_obj, [address])
    try:
        proposer = RemoteProposer(address)
        drafts(proposer)  # Step messages: two proposes (their commits ride along) and the frees
        assert window.written and window._count >= 3
        trace = json.loads((tmp_path / "out" / "trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert any(n and n.startswith("aten::") for n in names)  # the drafter's tensor ops were recorded
        summary = (tmp_path / "out" / "trace.json.txt").read_text()
        assert "Self CPU" in summary
        assert ("session.py(" in summary) == host_only  # Python frames, with their lines
        before = (tmp_path / "out" / "trace.json").stat().st_mtime_ns
        drafts(proposer)  # more steps: nothing more is recorded or written
        assert (tmp_path / "out" / "trace.json").stat().st_mtime_ns == before
        proposer.close()
    finally:
        server.stop(None).wait()
        server_obj.close()


def test_a_window_on_signal_counts_from_each_arm(tmp_path):
    """--profile-on-signal: steps before the first SIGUSR1 (arm) record nothing; after it, steps 2..3
    counted from it are recorded; counting stops after the window, and a later arm records another over
    the same path. An arm while a window records lets that window finish as it would."""
    import torch

    out = tmp_path / "trace.json"
    window = StepWindow(2, 3, out, on_signal=True)

    def step():
        number = window.enter()
        torch.ones(4).sum()
        window.exit(number)
        return number

    assert [step() for _ in range(5)] == [0] * 5 and not out.exists()
    window.arm()
    assert [step() for _ in range(2)] == [1, 2]
    window.arm()  # while step 2 of the window... (the profiler runs): no effect until it is written
    assert step() == 3 and window.written and out.exists()
    first = out.stat().st_mtime_ns
    assert [step() for _ in range(3)] == [1, 2, 3]  # the arm taken once the window ended: a second window
    assert out.stat().st_mtime_ns != first
    assert [step() for _ in range(3)] == [0] * 3  # and then nothing until the next signal


@pytest.mark.parametrize("flags", [["--profile-steps", "3:9"], ["--profile-out", "x.json"], ["--profile-on-signal"],
                                   ["--profile-steps", "9:3", "--profile-out", "x.json"],
                                   ["--profile-steps", "three", "--profile-out", "x.json"], ["--profile-host"]])
def test_bad_profile_flags_are_refused_before_anything_loads(flags, capsys):
    assert main(["drafter", "serve", "--listen", "unix:/nonexistent/d.sock", *flags]) == 2
    assert "--profile-" in capsys.readouterr().err
