"""specsplit.pair: a service pair as subprocesses, as `specsplit up` and `specsplit demo` start it."""

from __future__ import annotations

import time

import pytest

from specsplit.pair import ServiceSpec, spawn


def test_a_service_that_dies_at_startup_is_reported_at_once_with_its_log(tmp_path):
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="exited before it became healthy") as failure:
        spawn(ServiceSpec(target=str(tmp_path / "absent"), drafter="none", startup_timeout=120.0), tmp_path)
    assert time.perf_counter() - started < 60  # not the whole startup timeout
    assert "no such checkpoint folder" in str(failure.value)  # the service's own words, from its log
