"""``onca.nn.Sparsemax``: liger-kernel's ``LigerSparsemax`` (``dim`` defaults to the last)."""

from __future__ import annotations

import pytest
import torch

import onca
from tests.helpers import randn
from tests.ops.test_sparsemax import reference


def test_module(device):
    m = onca.nn.Sparsemax()
    assert m.dim == -1 and list(m.state_dict()) == [] and "dim=-1" in repr(m)
    x = randn(3, 40, device=device)
    torch.testing.assert_close(m(x), reference(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(onca.nn.Sparsemax(0)(x), reference(x, 0), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="dim must be an int"):
        onca.nn.Sparsemax(dim="last")
