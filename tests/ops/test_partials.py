"""The deterministic partial-sum reduction shared by ops with weight gradients."""

from __future__ import annotations

import pytest
import torch

from onca.ops._partials import sum_partials
from tests.helpers import assert_close


@pytest.mark.parametrize("shape", [(1, 7), (3, 1000), (264, 4096), (40, 33)])
def test_sum_partials_matches_torch(profile, device, shape):
    partials = torch.randn(*shape, device=device)
    total = sum_partials(partials)
    assert_close(total, partials.double().sum(0), torch.float32, "sum")
    assert torch.equal(total, sum_partials(partials))  # the same bits every time
    assert sum_partials(partials, torch.bfloat16).dtype == torch.bfloat16
