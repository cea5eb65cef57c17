"""``onca.nn.TVDLoss``: liger-kernel's ``LigerTVDLoss`` (default reduction ``batchmean``)."""

from __future__ import annotations

import pytest
import torch

import onca
from tests.ops.test_tvd import IGNORE, make_inputs, make_labels, reference


def test_module(device):
    m = onca.nn.TVDLoss()
    assert m.reduction == "batchmean" and m.ignore_index == IGNORE and list(m.state_dict()) == []
    p, q = make_inputs((6, 50), torch.float32, device)
    labels = make_labels((6, 50), device)
    torch.testing.assert_close(m(p, q, labels), reference(p, q, labels).float())
    torch.testing.assert_close(onca.nn.TVDLoss("sum")(p, q), reference(p, q, None, "sum").float())
    with pytest.raises(ValueError, match="reduction"):
        onca.nn.TVDLoss("elementwise")
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        onca.nn.TVDLoss(ignore_index=-100.0)
