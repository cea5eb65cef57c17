"""Tiled gated MLP against a float64 reference (the Hugging Face MLP expression) and its modules."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import onca
from tests.contract import assert_op_contract
from tests.helpers import SCALE, assert_close, leaf, randn

tiled_mlp = onca.functional.tiled_mlp

# (batch, seq, hidden, intermediate, num_shards)
SHAPES = {
    "cpu": [(2, 9, 16, 40, 3), (1, 5, 24, 36, None), (1, 1, 8, 24, 4)],
    "gpu": [(1, 32768, 4096, 14336, None), (2, 8192, 3584, 18944, 4), (1, 1, 4096, 14336, 1)],
}[SCALE]

_ACT = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}


def make(shape, dtype, device):
    b, s, h, i, _ = shape
    x = randn(b, s, h, dtype=dtype, device=device)
    ws = [randn(i, h, dtype=dtype, device=device, std=h ** -0.5), randn(i, h, dtype=dtype, device=device, std=h ** -0.5),
          randn(h, i, dtype=dtype, device=device, std=i ** -0.5)]
    return x, ws


def reference(x, ws, activation, dtype):
    """float64, rounding where the model rounds: the projections, act(gate), the product."""
    x64 = x.detach().double().requires_grad_(True)
    w64 = [w.detach().double().requires_grad_(True) for w in ws]
    r = (lambda t: t) if dtype == torch.float32 else (lambda t: t.to(dtype).double())
    gate, up = r(x64 @ w64[0].t()), r(x64 @ w64[1].t())
    h = r(r(_ACT[activation](gate)) * up)
    return h @ w64[2].t(), x64, w64


def check(shape, dtype, device, activation="silu"):
    x, ws = make(shape, dtype, device)
    xl, wl = leaf(x), [leaf(w) for w in ws]
    out = tiled_mlp(xl, *wl, activation=activation, num_shards=shape[-1])
    assert out.shape == x.shape and out.dtype == dtype
    ref, x64, w64 = reference(x, ws, activation, dtype)
    assert_close(out, ref, dtype, "out")
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g.double())
    assert_close(xl.grad, x64.grad, dtype, "dx")
    for a, e, name in zip(wl, w64, ("dW_gate", "dW_up", "dW_down")):
        assert_close(a.grad, e.grad, dtype, name)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shapes(profile, device, shape, dtype):
    check(shape, dtype, device)


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu"])
def test_geglu(device, activation):
    check(SHAPES[0], torch.float32, device, activation)


def test_fp16(device):
    check(SHAPES[0], torch.float16, device)


def test_shards_do_not_change_the_result(device):
    """Every shard count (one shard, uneven shards, more shards than tokens) gives the same output
    and gradients as the untiled MLP (fp32: the shards change only the weight-gradient sums' order)."""
    x, ws = make((2, 9, 16, 40, None), torch.float32, device)
    results = []
    for n in (1, 2, 4, 18, 50):
        xl, wl = leaf(x), [leaf(w) for w in ws]
        out = tiled_mlp(xl, *wl, num_shards=n)
        out.backward(torch.ones_like(out))
        results.append([out, xl.grad] + [w.grad for w in wl])
    for other in results[1:]:
        for a, e in zip(other, results[0]):
            assert_close(a, e, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is measured on a GPU")
def test_one_shard_backward_keeps_at_most_four_activation_sized_tensors():
    """With one shard and ``tokens == hidden`` a shard's activation and a weight have one size: the
    backward's peak above what it started with is ``dx`` and four such tensors (the weight
    gradients allocated as they are computed, the activations dropped after their last use); it
    was six while the three gradients were zeroed up front."""
    t, i = 2048, 8192
    x, ws = make((1, t, t, i, 1), torch.bfloat16, "cuda")
    xl, wl = leaf(x), [leaf(w) for w in ws]
    out = tiled_mlp(xl, *wl, num_shards=1)
    g = torch.randn_like(out)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(g)
    torch.cuda.synchronize()
    unit = t * i * 2  # bytes of one (shard, intermediate) activation, and of one weight
    peak = torch.cuda.max_memory_allocated() - start
    assert peak <= x.numel() * 2 + 4.5 * unit, f"{peak / unit:.2f} activation-sized tensors"


def test_default_num_shards():
    from onca.ops.tiled_mlp import default_num_shards

    assert default_num_shards((2, 100, 16), 16) == 7 and default_num_shards((3, 16), 16) == 1
    assert default_num_shards((0, 16), 16) == 1


def test_non_contiguous_input_and_no_tokens(device):
    x, ws = make((2, 6, 16, 24, 2), torch.float32, device)
    xt = x.transpose(0, 1)  # (6, 2, 16) non-contiguous
    xl = leaf(xt)
    out = tiled_mlp(xl, *ws, num_shards=2)
    ref, x64, _ = reference(xt, ws, "silu", torch.float32)
    assert_close(out, ref, torch.float32)
    out.sum().backward()
    ref.sum().backward()
    assert_close(xl.grad, x64.grad, torch.float32, "dx")
    empty = torch.zeros(0, 16, device=device, requires_grad=True)
    w = [leaf(t) for t in ws]
    out = tiled_mlp(empty, *w)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert empty.grad.shape == (0, 16) and torch.equal(w[0].grad, torch.zeros_like(ws[0]))


def test_modules_match_hugging_face_mlp(device):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    for cls, hf_cls, act in ((onca.nn.TiledSwiGLUMLP, LlamaMLP, "silu"),
                             (onca.nn.TiledGeGLUMLP, GemmaMLP, "gelu_pytorch_tanh")):
        config = types.SimpleNamespace(hidden_size=16, intermediate_size=40, hidden_act=act,
                                       hidden_activation=act, mlp_bias=False)
        hf = hf_cls(config).to(device)
        ours = cls(config, num_shards=3).to(device)
        ours.load_state_dict(hf.state_dict())
        x = randn(2, 9, 16, device=device)
        x1, x2 = leaf(x), leaf(x)
        a, e = ours(x1), hf(x2)
        assert_close(a, e, torch.float32, cls.__name__)
        a.sum().backward()
        e.sum().backward()
        assert_close(x1.grad, x2.grad, torch.float32, "dx")
        assert_close(ours.gate_proj.weight.grad, hf.gate_proj.weight.grad, torch.float32, "dW_gate")
    del transformers


def test_bad_input(device):
    x, ws = make(SHAPES[0], torch.float32, device)
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        tiled_mlp(x.long(), *ws)
    with pytest.raises(ValueError, match="x must be at least 2-D"):
        tiled_mlp(x[0, 0], *ws)
    with pytest.raises(TypeError, match="up_weight must have x's dtype"):
        tiled_mlp(x, ws[0], ws[1].double(), ws[2])
    with pytest.raises(ValueError, match="gate_weight and up_weight must be"):
        tiled_mlp(x, ws[0][:, :-1], ws[1], ws[2])
    with pytest.raises(ValueError, match="down_weight must be"):
        tiled_mlp(x, ws[0], ws[1], ws[2][:, :-1])
    with pytest.raises(ValueError, match="activation must be one of"):
        tiled_mlp(x, *ws, activation="relu")
    with pytest.raises(ValueError, match="num_shards must be a positive int"):
        tiled_mlp(x, *ws, num_shards=0)


def test_op_contract(device):
    x, ws = make((2, 5, 8, 24, 2), torch.float32, device)
    fn = lambda x, a, b, c: tiled_mlp(x, a, b, c, num_shards=2)  # noqa: E731
    assert_op_contract(fn, (x.requires_grad_(), *(w.requires_grad_() for w in ws)),
                       expect_ops={"tiled_mlp_forward", "tiled_mlp_backward"})
