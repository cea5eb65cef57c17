"""``onca.nn.Embedding`` is a drop-in for ``torch.nn.Embedding``: same state dict, same results."""

from __future__ import annotations

import pytest
import torch

import onca
from tests.helpers import SCALE, assert_close, randn

VOCAB, DIM = {"cpu": (40, 72), "gpu": (32000, 4096)}[SCALE]
TOKENS = {"cpu": (3, 17), "gpu": (4, 4096)}[SCALE]


def _pair(dtype, device, **kwargs):
    ref = torch.nn.Embedding(VOCAB, DIM, **kwargs).to(device=device, dtype=dtype)
    ours = onca.nn.Embedding(VOCAB, DIM, **kwargs).to(device=device, dtype=dtype)
    result = ours.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    return ref, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kwargs", [{}, {"padding_idx": 0}, {"padding_idx": -1, "scale_grad_by_freq": True}],
                         ids=["plain", "padding", "padding-freq"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_matches_torch_module(device, dtype, kwargs, deterministic):
    ref, ours = _pair(dtype, device, **kwargs)
    ours.deterministic = deterministic
    idx = torch.randint(0, VOCAB, TOKENS, device=device)
    idx[0, :3] = ref.padding_idx if ref.padding_idx is not None else 5
    y_ref, y_ours = ref(idx), ours(idx)
    assert y_ours.dtype == y_ref.dtype and torch.equal(y_ours, y_ref)
    dy = randn(*y_ref.shape, dtype=dtype, device=device)
    y_ref.backward(dy)
    y_ours.backward(dy)
    # torch accumulates in fp32 and rounds once, as Onca does; the order of the sums differs.
    assert_close(ours.weight.grad, ref.weight.grad, dtype, "dW")


def test_defaults_match_torch():
    torch.manual_seed(1)
    ref = torch.nn.Embedding(VOCAB, DIM, padding_idx=3)
    torch.manual_seed(1)
    ours = onca.nn.Embedding(VOCAB, DIM, padding_idx=3)
    assert torch.equal(ours.weight, ref.weight)  # N(0, 1), padding row zeroed
    assert torch.equal(ours.weight[3], torch.zeros(DIM))
    assert list(ours.state_dict()) == ["weight"]
    assert (ours.num_embeddings, ours.embedding_dim, ours.padding_idx) == (VOCAB, DIM, 3)
    assert repr(ours) == f"Embedding({VOCAB}, {DIM}, padding_idx=3)"
    assert onca.nn.Embedding(10, 4, padding_idx=-1).padding_idx == 9


def test_from_pretrained_and_freeze(device):
    table = randn(VOCAB, DIM, device=device)
    frozen = onca.nn.Embedding.from_pretrained(table)
    assert not frozen.weight.requires_grad and frozen.weight.data_ptr() == table.data_ptr()
    idx = torch.randint(0, VOCAB, TOKENS, device=device)
    assert torch.equal(frozen(idx), torch.nn.functional.embedding(idx, table))
    trainable = onca.nn.Embedding.from_pretrained(table, freeze=False, padding_idx=2, deterministic=True)
    assert trainable.weight.requires_grad and trainable.deterministic and trainable.padding_idx == 2


def test_bounds_check_is_opt_in(device):
    """By default no host-side check (it would synchronise); ``check_bounds=True`` raises IndexError."""
    assert not onca.nn.Embedding(10, 4).check_bounds
    checked = onca.nn.Embedding(10, 4, check_bounds=True).to(device)
    assert repr(checked) == "Embedding(10, 4, check_bounds=True)"
    with pytest.raises(IndexError, match="indices holds 10"):
        checked(torch.tensor([1, 10], device=device))


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_norm is not supported"):
        onca.nn.Embedding(10, 4, max_norm=1.0)
    with pytest.raises(ValueError, match="sparse=True is not supported"):
        onca.nn.Embedding(10, 4, sparse=True)
    with pytest.raises(ValueError, match="num_embeddings must be a positive int"):
        onca.nn.Embedding(0, 4)
    with pytest.raises(ValueError, match="embedding_dim must be a positive int"):
        onca.nn.Embedding(10, 4.0)
    with pytest.raises(ValueError, match="padding_idx must be within"):
        onca.nn.Embedding(10, 4, padding_idx=10)
    with pytest.raises(ValueError, match="_weight must have shape"):
        onca.nn.Embedding(10, 4, _weight=torch.zeros(4, 10))
    with pytest.raises(ValueError, match="embeddings must be 2-D"):
        onca.nn.Embedding.from_pretrained(torch.zeros(10))
