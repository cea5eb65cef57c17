"""The chunk driver of the post-training losses: per-token log-probabilities and entropies of
``hidden @ W.T + b`` (at a temperature) forward and backward against float64 full logits."""

from __future__ import annotations

import pytest
import torch

from onca.ops import _chunked_head
from onca.ops._chunked_head import chunk_plan, chunked_logprobs, grad_tiles, plan
from tests.contract import assert_op_contract
from tests.helpers import assert_close, leaf, non_contiguous, randn
from tests.ops.posttrain_reference import BASE, CHUNK, SHAPES, make_inputs, reference_logps


def check(hidden, weight, bias, labels, temperature=1.0, entropy=True, chunk_tokens=CHUNK, keep_logits=False):
    dtype = hidden.dtype
    hk, wk = leaf(hidden), leaf(weight)
    bk = leaf(bias) if bias is not None else None
    logp, ent = chunked_logprobs(hk, wk, labels, bk, temperature=temperature, entropy=entropy,
                                 chunk_tokens=chunk_tokens, keep_logits=keep_logits)
    per, ref_ent, _, (h64, w64, b64) = reference_logps(hidden, weight, bias, labels, temperature)
    assert logp.dtype == torch.float32 and logp.shape == labels.shape
    # fp32 from the rounded logits; a 16-bit GEMM's fp32 accumulation (cuBLAS's order, not the
    # reference's) can round a logit one step the other way, so 16-bit inputs are judged at theirs.
    assert_close(logp, per, dtype, "logp")
    g_lp = torch.randn(labels.shape, dtype=torch.float64, device=hidden.device)
    total64 = (per * g_lp).sum()
    total = (logp * g_lp.float()).sum()
    if entropy:
        assert_close(ent, ref_ent, dtype, "entropy")
        g_ent = torch.randn(labels.shape, dtype=torch.float64, device=hidden.device)
        total64 = total64 + (ref_ent * g_ent).sum()
        total = total + (ent * g_ent.float()).sum()
    else:
        assert ent is None
    total.backward()
    total64.backward()
    assert_close(hk.grad, h64.grad, dtype, "dhidden")
    assert_close(wk.grad, w64.grad, dtype, "dweight")
    if bias is not None:
        assert_close(bk.grad, b64.grad, dtype, "dbias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference(profile, device, dtype):
    h, w, b, labels = make_inputs(BASE, dtype, device, bias=True, empty_row=1)
    assert chunk_plan(labels.numel(), h.shape[-1], w.shape[0], dtype, chunk_tokens=CHUNK).n_chunks > 1
    check(h, w, b, labels, temperature=0.7)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes_no_entropy(device, shape):
    h, w, _, labels = make_inputs(shape, torch.float32, device)
    check(h, w, None, labels, entropy=False, chunk_tokens=None)


def test_one_token_and_column_tiles(device, onchip_bytes):
    """One token; a vocabulary wider than the on-chip budget (the online log-sum-exp's tiles)."""
    onchip_bytes(4096)
    h, w, b, labels = make_inputs((1, 1, 8, 1000), torch.float32, device, bias=True, prompt=0)
    check(h, w, b, labels, temperature=1.3)


def test_non_contiguous_hidden(device):
    h, w, _, labels = make_inputs((2, 5, 12, 77), torch.float32, device, prompt=1)
    check(non_contiguous(h), w, None, labels)


def test_bad_label_is_nan(device):
    h, w, _, labels = make_inputs((1, 4, 8, 50), torch.float32, device, prompt=0)
    labels[0, 2] = 50
    logp, _ = chunked_logprobs(h, w, labels)
    assert torch.isnan(logp[0, 2]) and torch.isfinite(logp[0, :2]).all()


def test_zero_tokens(device):
    h = randn(0, 8, device=device, requires_grad=True)
    w = randn(10, 8, device=device, requires_grad=True)
    logp, ent = chunked_logprobs(h, w, torch.zeros(0, dtype=torch.long, device=device), entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert w.grad is not None and (w.grad == 0).all()


def test_bad_input(device):
    h, w, _, labels = make_inputs((2, 5, 12, 77), torch.float32, device)
    with pytest.raises(ValueError, match="labels"):
        chunked_logprobs(h, w, labels[:, :3])
    with pytest.raises(TypeError, match="labels"):
        chunked_logprobs(h, w, labels.float())
    with pytest.raises(ValueError, match="weight"):
        chunked_logprobs(h, w[:, :5], labels)
    with pytest.raises(TypeError, match="weight"):
        chunked_logprobs(h, w.double(), labels)
    with pytest.raises(ValueError, match="bias"):
        chunked_logprobs(h, w, labels, torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(h, w, labels, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_logprobs(h, w, labels, chunk_tokens=0)


def test_plan():
    p = plan((100, 16, 1000), torch.bfloat16)
    assert p["chunks"].tokens == 100 and p["logprob"].cols == 1000
    assert p["backward_chunks"].tokens == 100


def test_grad_tiles_reshape_the_forward_scratch():
    """The backward's tiles: GRAD_TILE_TOKENS tokens tall (the weight-gradient GEMM's depth), the
    vocabulary split evenly into multiples of 128 that hold the forward's scratch (within one
    multiple); whole-vocabulary chunks where the forward's chunk is already that tall, or where
    chunk_tokens is given."""
    tokens, vocab = 16384, 128256  # a GRPO batch on a Llama-3 head, bf16, bf16 accumulator
    forward = chunk_plan(tokens, 4096, vocab, torch.bfloat16, accum_fp32=False, device="cpu")
    if forward.chunk != 512:
        pytest.skip("this host's free memory caps the default forward chunk")
    chunks, width = grad_tiles(tokens, 4096, vocab, torch.bfloat16, accum_fp32=False, device="cpu")
    # 512 x 128256 reshaped to 4096 tokens: eight tiles of 16032 columns, 16128 as multiples of 128
    assert (chunks.chunk, chunks.n_chunks, width) == (4096, 4, 16128)
    assert chunks.chunk * width <= forward.chunk * vocab + chunks.chunk * 128
    assert grad_tiles(1000, 64, vocab, torch.bfloat16, device="cpu")[1] == vocab  # one chunk is all tokens
    assert grad_tiles(tokens, 64, vocab, torch.bfloat16, chunk_tokens=256, device="cpu") == (
        chunk_plan(tokens, 64, vocab, torch.bfloat16, chunk_tokens=256), vocab)


@pytest.mark.parametrize("accum_dtype", [None, torch.float32], ids=["bf16-dw", "fp32-dw"])
def test_forward_takes_the_backward_budget(monkeypatch, device, accum_dtype):
    """The forward's chunks are planned with the backward's accumulator (an fp32 weight gradient
    doubles the scratch, and the forward's GEMM gets the deeper chunks the backward holds anyway)."""
    seen = []
    plan_chunks = _chunked_head.chunk_plan
    monkeypatch.setattr(_chunked_head, "chunk_plan",
                        lambda *a, **k: seen.append(k["accum_fp32"]) or plan_chunks(*a, **k))
    h, w = randn(2, 5, 8, dtype=torch.bfloat16, device=device), randn(24, 8, dtype=torch.bfloat16, device=device)
    labels = torch.randint(0, 24, (2, 5), device=device)
    with torch.no_grad():
        chunked_logprobs(h, w, labels, accum_dtype=accum_dtype)
    assert seen == [accum_dtype is not None]


@pytest.fixture
def vocab_tiles(monkeypatch):
    """Forward chunks of 8 tokens and backward tiles 24 tokens tall: a few hundred columns take
    several vocabulary tiles (the widths asserted, so the tiled path really runs)."""
    monkeypatch.setattr(_chunked_head, "FORWARD_CHUNK_TOKENS", 8)
    monkeypatch.setattr(_chunked_head, "GRAD_TILE_TOKENS", 24)
    monkeypatch.setattr(_chunked_head, "VOCAB_TILE_MULTIPLE", 16)
    widths = []
    tiles = _chunked_head.grad_tiles
    monkeypatch.setattr(_chunked_head, "grad_tiles",
                        lambda *a, **k: (lambda r: widths.append(r[1]) or r)(tiles(*a, **k)))
    return widths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_over_vocabulary_tiles(profile, device, dtype, vocab_tiles):
    """Targets in every tile, an ignored sequence, a bias, the entropy's gradient: the tiled
    backward (dx summed over the tiles in fp32) matches the float64 reference."""
    h, w, b, labels = make_inputs((4, 9, 16, 203), dtype, device, bias=True, empty_row=1)
    check(h, w, b, labels, temperature=0.7, chunk_tokens=None)
    assert vocab_tiles and all(width < 203 for width in vocab_tiles)


def test_gradients_never_read_unwritten_memory(device, vocab_tiles, poisoned_empty):
    """The tiled backward (several token chunks and vocabulary tiles, an fp32 and a bf16 weight
    gradient, the logits recomputed or kept) and the pair-aligned DPO path, with every fresh buffer
    NaN: the same gradients."""
    from onca.ops.fused_linear_dpo import fused_linear_dpo

    h, w, b, labels = make_inputs((4, 9, 16, 203), torch.float32, device, bias=True, empty_row=1)
    check(h, w, b, labels, chunk_tokens=None)
    check(h, w, b, labels, chunk_tokens=None, keep_logits=True)
    for accum_dtype in (None, torch.float32):
        hk, wk = leaf(h.bfloat16()), leaf(w.bfloat16())
        logp, _ = chunked_logprobs(hk, wk, labels, accum_dtype=accum_dtype)
        logp.sum().backward()
        assert torch.isfinite(hk.grad).all() and torch.isfinite(wk.grad).all()
    hk, wk = leaf(h), leaf(w)
    fused_linear_dpo(hk, wk, labels, ref_chosen_logps=torch.zeros(2, device=device),
                     ref_rejected_logps=torch.zeros(2, device=device)).backward()
    assert torch.isfinite(hk.grad).all() and torch.isfinite(wk.grad).all()


def test_op_contract(device):
    h, w, b, labels = make_inputs((2, 5, 8, 24), torch.float32, device, bias=True, prompt=1)

    def fn(h, w, b, labels):
        logp, ent = chunked_logprobs(h, w, labels, b, temperature=0.9, entropy=True, chunk_tokens=4)
        return logp, ent

    assert_op_contract(fn, (h.requires_grad_(), w.requires_grad_(), b.requires_grad_(), labels),
                       expect_ops={"chunked_logprob_forward", "chunked_logprob_backward"})


def _accumulator_dtypes(monkeypatch) -> list:
    """The dtype of the weight-gradient accumulator each chunk adds into (spied on both drivers:
    the chunked head's and the pair-aligned one)."""
    from onca.ops import _chunked_head, _paired_head

    seen = []
    add = _chunked_head.accumulate_dw
    for module in (_chunked_head, _paired_head):
        monkeypatch.setattr(module, "accumulate_dw",
                            lambda dw, g, h, **k: seen.append(dw.dtype) or add(dw, g, h, **k))
    return seen


@pytest.mark.parametrize("accum_dtype", [None, torch.bfloat16, torch.float32], ids=str)
def test_weight_gradient_accumulator(monkeypatch, device, accum_dtype):
    """The weight's dtype by default (liger-kernel's chunked losses), fp32 when asked; both close to
    the float64 reference, and fp32 at least as close over many chunks."""
    h, w, _, labels = make_inputs(BASE, torch.bfloat16, device)
    seen = _accumulator_dtypes(monkeypatch)
    wk = leaf(w)
    logp, _ = chunked_logprobs(h, wk, labels, chunk_tokens=CHUNK, accum_dtype=accum_dtype)
    logp.sum().backward()
    expected = torch.float32 if accum_dtype == torch.float32 else torch.bfloat16
    assert len(seen) > 1 and set(seen) == {expected}
    assert wk.grad.dtype == torch.bfloat16
    per, _, _, (_, w64, _) = reference_logps(h, w, None, labels, 1.0)
    per.sum().backward()
    assert_close(wk.grad, w64.grad, torch.bfloat16, "dweight")


def test_fp32_accumulator_is_at_least_as_exact(device):
    h, w, _, labels = make_inputs(BASE, torch.bfloat16, device)
    per, _, _, (_, w64, _) = reference_logps(h, w, None, labels, 1.0)
    per.sum().backward()
    errors = {}
    for accum_dtype in (None, torch.float32):
        wk = leaf(w)
        chunked_logprobs(h, wk, labels, chunk_tokens=2, accum_dtype=accum_dtype)[0].sum().backward()
        errors[accum_dtype] = (wk.grad.double() - w64.grad).norm().item()
    assert errors[torch.float32] <= errors[None]


def test_bad_accum_dtype(device):
    h, w, _, labels = make_inputs((2, 5, 12, 77), torch.bfloat16, device)
    with pytest.raises(ValueError, match="accum_dtype"):
        chunked_logprobs(h, w, labels, accum_dtype=torch.float16)
    with pytest.raises(ValueError, match="accum_dtype"):
        chunked_logprobs(h, w, labels, accum_dtype="float32")


# ------------------------------------------------------------------------------------ keep_logits


def _head_matmuls(monkeypatch) -> list:
    """One entry per head matmul the chunk driver runs (forward chunks and backward tiles)."""
    calls = []
    head_logits = _chunked_head.head_logits
    monkeypatch.setattr(_chunked_head, "head_logits", lambda *a, **k: calls.append(1) or head_logits(*a, **k))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_keep_logits_matches_reference(profile, device, dtype, vocab_tiles):
    """The kept logits read by the tiled backward (several token chunks, vocabulary tiles, a bias,
    an ignored sequence, the entropy's gradient) against the float64 reference."""
    h, w, b, labels = make_inputs((4, 9, 16, 203), dtype, device, bias=True, empty_row=1)
    check(h, w, b, labels, temperature=0.7, chunk_tokens=None, keep_logits=True)
    assert vocab_tiles and all(width < 203 for width in vocab_tiles)


@pytest.mark.parametrize("keep_chunk", [None, 8], ids=["one-chunk", "8-token-chunks"])
def test_keep_logits_runs_three_head_matmuls(monkeypatch, device, keep_chunk):
    """Kept: one head matmul per forward chunk of up to ``GRAD_TILE_TOKENS`` tokens (one here, or
    several written into their rows of the kept logits), none in the backward; recomputed: one per
    forward chunk and one per backward tile. The results agree to rounding."""
    if keep_chunk:
        monkeypatch.setattr(_chunked_head, "GRAD_TILE_TOKENS", keep_chunk)
    h, w, b, labels = make_inputs(BASE, torch.float32, device, bias=True, empty_row=1)
    tokens = labels.numel()
    kept_chunks = -(-tokens // keep_chunk) if keep_chunk else 1
    results = {}
    for keep in (False, True):
        calls = _head_matmuls(monkeypatch)
        hk, wk, bk = leaf(h), leaf(w), leaf(b)
        logp, ent = chunked_logprobs(hk, wk, labels, bk, entropy=True, chunk_tokens=CHUNK, keep_logits=keep)
        forward = len(calls)
        (logp.sum() + ent.sum()).backward()
        results[keep] = (forward, len(calls) - forward, logp, ent, hk.grad, wk.grad, bk.grad)
    assert results[True][:2] == (kept_chunks, 0) and (kept_chunks > 1) == bool(keep_chunk)
    assert results[False][0] > 1 and results[False][1] > 1
    names = ("logp", "entropy", "dh", "dw", "db")
    for kept, recomputed, name in zip(results[True][2:], results[False][2:], names):
        assert_close(kept, recomputed, torch.float32, name)


def test_keep_logits_second_backward(device):
    """The backward reads the kept logits and writes its gradient elsewhere: a second backward
    through the same graph gives the same gradients."""
    h, w, _, labels = make_inputs((2, 5, 12, 77), torch.float32, device, prompt=1)
    hk, wk = leaf(h), leaf(w)
    logp, ent = chunked_logprobs(hk, wk, labels, entropy=True, chunk_tokens=4, keep_logits=True)
    total = (logp * torch.randn_like(logp)).sum() + ent.sum()
    first = torch.autograd.grad(total, (hk, wk), retain_graph=True)
    second = torch.autograd.grad(total, (hk, wk))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_keep_logits_op_contract(device):
    h, w, b, labels = make_inputs((2, 5, 8, 24), torch.float32, device, bias=True, prompt=1)

    def fn(h, w, b, labels):
        return chunked_logprobs(h, w, labels, b, temperature=0.9, entropy=True, keep_logits=True)

    assert_op_contract(fn, (h.requires_grad_(), w.requires_grad_(), b.requires_grad_(), labels),
                       expect_ops={"chunked_logprob_forward", "chunked_logprob_backward"})


def test_bad_keep_logits(device):
    h, w, _, labels = make_inputs((2, 5, 12, 77), torch.float32, device)
    with pytest.raises(TypeError, match="keep_logits"):
        chunked_logprobs(h, w, labels, keep_logits=1)
