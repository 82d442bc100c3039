"""specsplit.pair: a service pair as subprocesses, as `specsplit up` and `specsplit demo` start it."""

from __future__ import annotations


import pytest

from specsplit.pair import ServiceSpec, spawn


def test_a_service_that_dies_at_startup_is_reported_at_once_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="exited before it became healthy") as failure:  # not a timeout
        spawn(ServiceSpec(target=str(tmp_path / "absent"), drafter="none", startup_timeout=120.0), tmp_path)
    assert "no such checkpoint folder" in str(failure.value)  # the service's own words, from its log
