"""The pytest plugin: fixtures that spawn drafter + target pairs (`specsplit.pair`) for users' test suites.

The package registers this module as a pytest plugin, so the fixtures `specsplit_services` (one pair
per test module, the shipped DFlash drafter on the default model) and `specsplit_factory` (spawn any
pair) are available wherever specsplit is installed. Only this module imports pytest.
"""

from __future__ import annotations

import pytest

from specsplit.pair import ServiceSpec, Services, spawn

__all__ = ["ServiceSpec", "Services", "spawn", "specsplit_services", "specsplit_factory"]


@pytest.fixture(scope="module")
def specsplit_services(tmp_path_factory):
    """A drafter + target pair (the shipped DFlash drafter, default model) shared by a test module."""
    services = spawn(ServiceSpec(), tmp_path_factory.mktemp("specsplit"))
    yield services
    services.stop()


@pytest.fixture
def specsplit_factory(tmp_path_factory):
    """Spawn service pairs with any ServiceSpec; all are stopped at the end of the test."""
    started: list[Services] = []

    def make(spec: ServiceSpec = ServiceSpec()) -> Services:
        started.append(spawn(spec, tmp_path_factory.mktemp("specsplit")))
        return started[-1]

    yield make
    for services in started:
        services.stop()
