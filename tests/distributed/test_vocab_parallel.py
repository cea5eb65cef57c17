"""Vocabulary-parallel cross entropy and fused linear cross entropy on two ranks (gloo on the CPU,
NCCL where two GPUs are visible), against the unsharded float64 loss: ``vp_checks.py``."""

from __future__ import annotations

import pytest

from tests.distributed.launch import assert_ok, run_checks
from tests.distributed.vp_checks import CHECKS

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def outcomes():
    return run_checks("tests.distributed.vp_checks:CHECKS")


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_vocab_parallel(outcomes, name):
    assert_ok(outcomes, name)
