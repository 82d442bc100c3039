"""bench/ scripts imported as modules by the tests of their arithmetic (the benches themselves run on the device)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).parents[1] / "bench"


def bench_module(name: str) -> Iterator[ModuleType]:
    """bench/NAME.py loaded as a module, with bench/ on sys.path while it is used (it imports its siblings): the
    body of a module-scoped fixture."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # (what dataclasses look their module's annotations up in)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(BENCH))
