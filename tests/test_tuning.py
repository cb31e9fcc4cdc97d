"""The allocator settings of broker.tuning: applied once per process on glibc, and can be turned off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "from broker.tuning import tune_allocator; print(tune_allocator(), tune_allocator())"


def _probe(**env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_tuning_applies_once_on_glibc() -> None:
    assert _probe() == "True True"


def test_tuning_can_be_turned_off() -> None:
    assert _probe(GDRL_BROKER_MALLOC_TUNING="0") == "False False"
