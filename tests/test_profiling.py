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


@pytest.mark.parametrize("flags", [["--profile-steps", "3:9"], ["--profile-out", "x.json"],
                                   ["--profile-steps", "9:3", "--profile-out", "x.json"],
                                   ["--profile-steps", "three", "--profile-out", "x.json"], ["--profile-host"]])
def test_bad_profile_flags_are_refused_before_anything_loads(flags, capsys):
    assert main(["drafter", "serve", "--listen", "unix:/nonexistent/d.sock", *flags]) == 2
    assert "--profile-" in capsys.readouterr().err
