"""Onca's zero fill (the embedding's weight gradient) against torch.zeros, never writing past the
tensor."""

from __future__ import annotations

import pytest
import torch

from onca.ops import _fill
from tests.helpers import SCALE

SIZES = {"cpu": [1, 7, 64, 1000, 4097], "gpu": [1, 8191, 8193, 151936 * 1024 + 3]}[SCALE]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32], ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_zero_fill_writes_zeros_and_nothing_past_the_tensor(profile, monkeypatch, device, dtype, n):
    if SCALE == "cpu":
        # Blocks of 64 elements: on the interpreter's few programs, each loops over several blocks
        # and the last block is partial.
        monkeypatch.setattr(_fill, "BLOCK", 64)
    poison = torch.full((n + 100,), 7, dtype=dtype, device=device)
    out = _fill.zero_(poison[:n])
    assert out.data_ptr() == poison.data_ptr()
    assert not poison[:n].any(), "an element was left unwritten"
    assert (poison[n:] == 7).all(), "written past the tensor"


def test_zeros_as_torch(device):
    out = _fill.zeros((3, 0, 5), torch.bfloat16, torch.device(device))
    assert out.shape == (3, 0, 5) and out.dtype == torch.bfloat16
    out = _fill.zeros((37, 11), torch.float32, torch.device(device))
    assert torch.equal(out, torch.zeros(37, 11, device=device)) and out.is_contiguous()
