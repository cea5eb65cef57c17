"""Onca-patched Hugging Face models trained under FSDP2 (``fully_shard``) on two ranks (gloo on the
CPU, NCCL where two GPUs are visible): loss and gradient parity with the unpatched model sharded
the same way, bf16 mixed precision, gradient checkpointing, a tied head, a mixture of experts, a
head or embedding sharded in its own group, sharded checkpoints: ``fsdp_checks.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.distributed.fsdp_checks import CHECKS  # noqa: E402
from tests.distributed.launch import assert_ok, run_checks  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def outcomes():
    return run_checks("tests.distributed.fsdp_checks:CHECKS")


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_fsdp(outcomes, name):
    assert_ok(outcomes, name)
