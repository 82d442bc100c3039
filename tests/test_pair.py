"""specsplit.pair: a service pair as subprocesses, as `specsplit up` and `specsplit demo` start it."""

from __future__ import annotations


import pytest

from specsplit.cli import main
from specsplit.pair import ServiceSpec, spawn
from specsplit.shared.errors import InvalidRequest


def test_a_service_that_dies_at_startup_is_reported_at_once_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="exited before it became healthy") as failure:  # not a timeout
        spawn(ServiceSpec(target=str(tmp_path / "absent"), drafter="none", startup_timeout=120.0), tmp_path)
    assert "no such checkpoint folder" in str(failure.value)  # the service's own words, from its log


def test_a_pair_on_a_gpu_links_its_streams_by_default():
    """On a CUDA device the pair's drafter serves its one target with device waits and the target asks for tree
    candidates ahead; elsewhere, or with device_waits=False, each service gets only what it was given."""
    gpu = ServiceSpec(device="cuda", target_args=("--draft-tree", "15"), drafter_args=("--metrics-port", "9"))
    assert gpu.service_args("drafter") == ("--device-waits", "--max-targets", "1", "--metrics-port", "9")
    assert gpu.service_args("target") == ("--trees-ahead", "--drafts-by-batch", "9:0", "--draft-tree", "15")
    for spec in (ServiceSpec(device="cuda:1", device_waits=False, speculate_below=0, target_args=("--draft-tree", "15")),
                 ServiceSpec(target_args=("--draft-tree", "15")),  # (the CPU)
                 ServiceSpec(device="cuda", drafter="none", target_args=("--draft-tree", "15"))):
        assert spec.service_args("drafter") == () and spec.service_args("target") == ("--draft-tree", "15")
    with pytest.raises(InvalidRequest, match="--device-waits .* needs a CUDA device, not 'cpu'"):
        ServiceSpec(device_waits=True)
    with pytest.raises(InvalidRequest, match="give a drafter"):
        ServiceSpec(device="cuda", drafter="none", device_waits=True)


@pytest.mark.parametrize("clash", [("--max-targets", "4"), ("--max-targets=2",), ("--no-chain-graphs",),
                                   ("--no-prepare-chains",)])
def test_drafter_args_a_linked_drafter_cannot_take_leave_the_pair_unlinked(clash):
    """Drafter arguments that a drafter serving with device waits refuses (DrafterSettings) keep the pair as it
    was before (unlinked), given on their own; asked for with device_waits=True they are refused at once."""
    spec = ServiceSpec(device="cuda", drafter_args=("--metrics-port", "9", *clash),
                       target_args=("--draft-tree", "15"))
    assert not spec.waits_on_device
    assert spec.service_args("drafter") == ("--metrics-port", "9", *clash)
    assert spec.service_args("target") == ("--drafts-by-batch", "9:0", "--draft-tree", "15")
    with pytest.raises(InvalidRequest, match=f"the drafter's {clash[0]} says otherwise"):
        ServiceSpec(device="cuda", drafter_args=clash, device_waits=True)


def test_a_pair_sharing_a_gpu_drafts_in_steps_of_up_to_eight_sequences_by_default():
    """SHARED_GPU_SPECULATE_BELOW: on a CUDA device the target drafts nothing from nine sequences a step (its
    sequences rest from the drafter, `--drafts-by-batch 9:0`), as asked with speculate_below, never where the
    target's own arguments give --drafts-by-batch; on the CPU, with no drafter or with 0, no limit."""
    from specsplit.pair import SHARED_GPU_SPECULATE_BELOW

    assert SHARED_GPU_SPECULATE_BELOW == 9
    assert ServiceSpec(device="cuda", device_waits=False).service_args("target") == ("--drafts-by-batch", "9:0")
    assert ServiceSpec(device="cuda", device_waits=False, speculate_below=4).service_args("target") \
        == ("--drafts-by-batch", "4:0")
    assert ServiceSpec(device_waits=False, speculate_below=2).service_args("target") == ("--drafts-by-batch", "2:0")
    for own in (("--drafts-by-batch", "8:3"), ("--drafts-by-batch=8:3",)):
        assert ServiceSpec(device="cuda", device_waits=False, target_args=own).service_args("target") == own
    for spec in (ServiceSpec(), ServiceSpec(device="cuda", speculate_below=0),
                 ServiceSpec(device="cuda", drafter="none")):
        assert "--drafts-by-batch" not in spec.service_args("target")
    for bad in (-1, True, 2.5):
        with pytest.raises(InvalidRequest, match="--speculate-below is a number of sequences"):
            ServiceSpec(device="cuda", speculate_below=bad)


@pytest.mark.parametrize("spec, trees", [(ServiceSpec(device="cuda"), 15), (ServiceSpec(device="cuda:1", mps=False), 15),
                                         (ServiceSpec(device="cuda", speculate_below=0), 15),
                                         (ServiceSpec(device="cuda", target_args=("--num-drafts", "7")), 0),
                                         (ServiceSpec(device="cuda", target_args=("--drafts-by-batch", "2:7")), 0),
                                         (ServiceSpec(), 0)])
def test_the_target_of_a_pair_on_a_gpu_verifies_draft_trees(spec, trees, monkeypatch):
    """The target's own command line as the pair starts it (`service_args`), parsed as `target serve` parses it:
    trees of 15 nodes on a GPU, also where its schedule turns speculation off from some batch size on (the
    fiftieth session's `--drafts-by-batch 4:0` had made `--draft-tree auto` verify chains); chains where the
    draft length is set, and on the CPU."""
    import specsplit.services
    from specsplit.shared import logs

    monkeypatch.setattr(logs, "configure", lambda *args, **kwargs: None)  # (the root logger outlives the test)
    seen = []

    def start_target(settings):
        seen.append(settings.engine.draft_tree)
        raise SystemExit(0)

    monkeypatch.setattr(specsplit.services, "start_target", start_target)
    with pytest.raises(SystemExit):
        main(["target", "serve", "--listen", "unix:/nonexistent/t.sock", "--drafter", "unix:/nonexistent/d.sock",
              "--device", spec.device, *spec.service_args("target")])
    assert seen == [trees]


def test_up_and_demo_refuse_device_waits_on_the_cpu_and_a_negative_speculate_below(capsys):
    assert main(["up", "--device-waits", "--device", "cpu"]) == 2
    assert "--device-waits orders the two services' CUDA streams: it needs a CUDA device" in capsys.readouterr().err
    assert main(["demo", "--speculate-below", "-1", "--device", "cpu"]) == 2
    assert "--speculate-below is a number of sequences >= 0" in capsys.readouterr().err


def test_the_pair_with_device_waits_starts_services_that_accept_them(tmp_path):
    """The flags the pair adds are ones `drafter serve` and `target serve` take together (their parsers and the
    drafter's settings check), whatever the device: checked here without starting either."""
    from specsplit.cli import build_parser
    from specsplit.services import DrafterSettings
    from specsplit.local import LocalSetup
    from specsplit.drafter_service.limits import DrafterLimits

    spec = ServiceSpec(device="cuda")
    parser = build_parser()
    drafter = parser.parse_args(["drafter", "serve", "--listen", "unix:x", *spec.service_args("drafter")])
    target = parser.parse_args(["target", "serve", "--listen", "unix:y", *spec.service_args("target")])
    assert drafter.device_waits and drafter.max_targets == 1 and target.trees_ahead
    assert target.drafts_by_batch == ((9, 0),)
    DrafterSettings(("unix:x",), LocalSetup(), limits=DrafterLimits(max_targets=drafter.max_targets),
                    device_waits=drafter.device_waits)  # (refused unless with --max-targets 1)


def test_a_services_lifeline_grace_follows_its_own_drain():
    """Each service is ended by its lifeline STOP_MARGIN_SECONDS past its own drain (its last --drain-seconds,
    as argparse takes it, else the pair's); a drain that is no number of seconds is refused when the spec is made."""
    spec = ServiceSpec(drain_seconds=3.0, target_args=("--drain-seconds", "7", "--drain-seconds=40"),
                       drafter_args=("--metrics-port", "9"))
    assert spec.drain_for("target") == 40.0 and spec.drain_for("drafter") == 3.0
    for bad in [dict(drain_seconds=-1.0), dict(drain_seconds=float("nan")), dict(target_args=("--drain-seconds",)),
                dict(drafter_args=("--drain-seconds=soon",)), dict(target_args=("--drain-seconds", "inf"))]:
        with pytest.raises(InvalidRequest, match="--drain-seconds is a number of seconds"):
            ServiceSpec(**bad)
