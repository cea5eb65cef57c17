"""fused_linear_logprobs (TRL's fused-LM-head contract on the chunk driver): every per-token output
forward and the log-probs' and entropy's gradients against float64 full logits, and against TRL's
own ``ChunkedLogProbFunction`` (its torch path on the CPU)."""

from __future__ import annotations

import pytest
import torch

from onca.ops._chunked_head import chunk_plan
from onca.ops.fused_linear_logprobs import OPTIONAL_OUTPUTS, fused_linear_logprobs, plan
from tests.contract import assert_op_contract
from tests.helpers import SCALE, assert_close, leaf, non_contiguous, randn, rounded
from tests.ops.posttrain_reference import BASE, IGNORE, make_inputs
from tests.ops.test_chunked_head import vocab_tiles  # noqa: F401 (a fixture)

# (sequences, tokens, hidden, vocab): awkward vocabularies; real widths on the GPU.
SHAPES = {
    "cpu": [(3, 7, 16, 203)],
    "gpu": [(4, 1024, 1024, 151936), (2, 1024, 4096, 128256)],
}[SCALE]
CHUNK = {"cpu": 8, "gpu": 1024}[SCALE]  # forces several chunks
HEADS = {  # (temperature, softcap, logit_scale)
    "plain": (1.0, None, 1.0),
    "capped": (0.7, 3.0, 0.8),
}


def with_argmax_labels(hidden, weight, bias, labels, every=3):
    """Every ``every``-th scored label set to its row's argmax: the top-1 flags are tested both ways."""
    logits = hidden.float() @ weight.float().T + (bias.float() if bias is not None else 0)
    pick = torch.zeros_like(labels, dtype=torch.bool)
    pick.view(-1)[::every] = True
    pick &= labels != IGNORE
    return torch.where(pick, logits.argmax(-1), labels)


def reference(hidden, weight, bias, labels, temperature, softcap, logit_scale):
    """float64: every output from the full logits (rounded to the input dtype, as the head's matmul
    rounds them), and the float64 leaves."""
    h64 = hidden.detach().to(torch.float64).requires_grad_(True)
    w64 = weight.detach().to(torch.float64).requires_grad_(True)
    b64 = bias.detach().to(torch.float64).requires_grad_(True) if bias is not None else None
    x = h64 @ w64.T
    if b64 is not None:
        x = x + b64
    z = rounded(x, hidden.dtype) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logsm = torch.log_softmax(z, -1)
    mask = labels != IGNORE
    zero = torch.zeros((), dtype=torch.float64, device=hidden.device)
    logp = torch.where(mask, logsm.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), zero)
    entropy = torch.where(mask, -(logsm.exp() * logsm).sum(-1), zero)
    sq = torch.where(mask, torch.logsumexp(2 * logsm, -1), zero)
    mean = torch.where(mask, z.mean(-1), zero)
    top = z.topk(2, -1).values
    top1 = mask & (z.argmax(-1) == labels)
    near_tie = (top[..., 0] - top[..., 1]) < 1e-4 * top[..., 0].abs().clamp(min=1)
    return (logp, entropy, sq.detach(), mean.detach(), top1, near_tie), (h64, w64, b64)


def check(hidden, weight, bias, labels, head=HEADS["capped"], outputs=OPTIONAL_OUTPUTS, grads=("lp", "ent"),
          chunk_tokens=CHUNK, keep_logits=False):
    temperature, softcap, logit_scale = head
    dtype = hidden.dtype
    hk, wk = leaf(hidden), leaf(weight)
    bk = leaf(bias) if bias is not None else None
    out = fused_linear_logprobs(hk, wk, labels, bk, temperature=temperature, softcap=softcap,
                                logit_scale=logit_scale, outputs=outputs, chunk_tokens=chunk_tokens,
                                keep_logits=keep_logits)
    (logp, ent, sq, mean, top1, near_tie), (h64, w64, b64) = reference(hidden, weight, bias, labels, *head)
    assert out.log_probs.dtype == torch.float32 and out.log_probs.shape == labels.shape
    # fp32 from the rounded logits; a 16-bit GEMM (cuBLAS's accumulation order, not the
    # reference's) can round a logit one step the other way: 16-bit inputs are judged at theirs.
    judge = torch.float32 if dtype == torch.float32 else dtype
    assert_close(out.log_probs, logp, judge, "log_probs")
    for name, ref in (("entropy", ent), ("log_sum_sq_probs", sq), ("mean_logits", mean)):
        got = getattr(out, name)
        if name in outputs:
            assert got.dtype == torch.float32 and got.shape == labels.shape
            assert_close(got, ref, judge, name)
        else:
            assert got is None, name
    if "is_top1" in outputs:
        assert out.is_top1.dtype == torch.bool and out.is_top1.shape == labels.shape
        agree = (out.is_top1 == top1) | near_tie
        assert agree.all(), f"is_top1 differs at {(~agree).nonzero().tolist()}"
    else:
        assert out.is_top1 is None
    total64 = total = 0
    if "lp" in grads:
        g = torch.randn(labels.shape, dtype=torch.float64, device=hidden.device)
        total64, total = (logp * g).sum(), (out.log_probs * g.float()).sum()
    if "ent" in grads:
        g = torch.randn(labels.shape, dtype=torch.float64, device=hidden.device)
        total64, total = total64 + (ent * g).sum(), total + (out.entropy * g.float()).sum()
    total.backward()
    total64.backward()
    assert_close(hk.grad, h64.grad, dtype, "dhidden")
    assert_close(wk.grad, w64.grad, dtype, "dweight")
    if bias is not None:
        assert_close(bk.grad, b64.grad, dtype, "dbias")
    return out


def inputs(shape, dtype, device, bias=True, **kw):
    h, w, b, labels = make_inputs(shape, dtype, device, bias=bias, **kw)
    return h, w, b, with_argmax_labels(h, w, b, labels)


@pytest.mark.parametrize("head", HEADS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference(profile, device, dtype, head):
    h, w, b, labels = inputs(SHAPES[0], dtype, device, empty_row=1)
    assert chunk_plan(labels.numel(), h.shape[-1], w.shape[0], dtype, chunk_tokens=CHUNK).n_chunks > 1
    out = check(h, w, b, labels, HEADS[head])
    assert out.is_top1.any() and not out.is_top1.all()  # the flags were tested both ways


@pytest.mark.parametrize("grads", [("lp",), ("ent",)], ids=str)
def test_one_output_takes_the_gradient(device, grads):
    """Only the log-probs, or only the entropy, take a gradient (the other's is None, not zeros)."""
    h, w, _, labels = inputs(SHAPES[-1], torch.float32, device, bias=False)
    check(h, w, None, labels, outputs=("entropy", "is_top1"), grads=grads, chunk_tokens=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_over_vocabulary_tiles(profile, device, dtype, vocab_tiles):  # noqa: F811
    """Soft-capping, a logit scale and a temperature, with the backward over several vocabulary
    tiles (each tile's one-hot column and the entropy term taken at its offset)."""
    h, w, b, labels = inputs((3, 7, 16, 203), dtype, device, empty_row=1)
    check(h, w, b, labels, HEADS["capped"], chunk_tokens=None)
    assert vocab_tiles and all(width < 203 for width in vocab_tiles)


@pytest.mark.parametrize("head", HEADS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_keep_logits(profile, device, dtype, head, vocab_tiles):  # noqa: F811
    """Every output and both gradients with the logits kept from the forward (soft-capped or not),
    the backward reading them over several vocabulary tiles."""
    h, w, b, labels = inputs(SHAPES[0], dtype, device, empty_row=1)
    check(h, w, b, labels, HEADS[head], chunk_tokens=None, keep_logits=True)
    assert vocab_tiles


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is measured on a GPU")
def test_keep_logits_memory():
    """Kept logits cost their own size at the peak, and no more; they are freed with the graph
    (after the backward, only the gradients are left)."""
    tokens, hidden, vocab = 4096, 1024, 32768
    h, w, _, labels = make_inputs((1, tokens, hidden, vocab), torch.bfloat16, "cuda")
    peaks, left = {}, {}
    for keep in (False, True):
        hk, wk = leaf(h), leaf(w)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fused_linear_logprobs(hk, wk, labels, outputs=("entropy",), keep_logits=keep)
        (out.log_probs.sum() + out.entropy.sum()).backward()
        del out
        torch.cuda.synchronize()
        peaks[keep] = torch.cuda.max_memory_allocated() - start
        left[keep] = torch.cuda.memory_allocated() - start
        del hk, wk
    kept = tokens * vocab * 2
    grads = (tokens + vocab) * hidden * 2
    assert 0.5 * kept <= peaks[True] - peaks[False] <= kept + (64 << 20), (peaks, kept)
    assert left[True] <= grads + (8 << 20) and left[False] <= grads + (8 << 20), (left, grads)


def test_fp16_no_outputs(device):
    h, w, b, labels = inputs(SHAPES[0], torch.float16, device)
    check(h, w, b, labels, HEADS["plain"], outputs=(), grads=("lp",))


def test_one_token_and_column_tiles(device, onchip_bytes):
    """One token; a vocabulary wider than the on-chip budget (every statistic across tiles)."""
    onchip_bytes(4096)
    h, w, b, labels = inputs((1, 1, 8, 1000), torch.float32, device, prompt=0)
    check(h, w, b, labels)


def test_non_contiguous_hidden(device):
    h, w, _, labels = inputs((2, 5, 12, 77), torch.float32, device, bias=False, prompt=1)
    check(non_contiguous(h), w, None, labels)


def test_zero_tokens(device):
    h = randn(0, 8, device=device, requires_grad=True)
    w = randn(10, 8, device=device, requires_grad=True)
    out = fused_linear_logprobs(h, w, torch.zeros(0, dtype=torch.long, device=device), outputs=OPTIONAL_OUTPUTS)
    assert all(t.shape == (0,) for t in out)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert w.grad is not None and (w.grad == 0).all()


def test_bad_input(device):
    h, w, _, labels = make_inputs((2, 5, 12, 77), torch.float32, device)
    with pytest.raises(ValueError, match="outputs"):
        fused_linear_logprobs(h, w, labels, outputs=("entropy", "logits"))
    with pytest.raises(TypeError, match="outputs"):
        fused_linear_logprobs(h, w, labels, outputs="entropy")
    with pytest.raises(ValueError, match="softcap"):
        fused_linear_logprobs(h, w, labels, softcap=0.0)
    with pytest.raises(ValueError, match="logit_scale"):
        fused_linear_logprobs(h, w, labels, logit_scale=float("inf"))
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_logprobs(h, w, labels, temperature=-1.0)
    with pytest.raises(ValueError, match="labels"):
        fused_linear_logprobs(h, w, labels[:, :2])
    with pytest.raises(TypeError, match="weight"):
        fused_linear_logprobs(h, w.half(), labels)
    with pytest.raises(TypeError, match="keep_logits"):
        fused_linear_logprobs(h, w, labels, keep_logits="yes")


def test_plan():
    p = plan((100, 16, 1000), torch.bfloat16)
    assert p["chunks"].tokens == 100 and p["logprob"].cols == 1000 and p["logprob_grad"].cols == 1000


def test_matches_trl(device):
    """TRL's own function (its Triton kernels on a GPU, its torch tiles on the CPU) and Onca's on
    the same inputs, with TRL's calling convention (only scored positions, no ignore index)."""
    pytest.importorskip("trl.kernels.chunked_logprob")
    from onca.bench.ops.fused_linear_logprobs import _trl_function  # works without accelerate/datasets

    trl_function = _trl_function()
    h, w, b, labels = inputs(SHAPES[0], torch.float32, device)
    mask = labels != IGNORE
    hidden, targets = h[mask], labels[mask]
    temperature, softcap, logit_scale = HEADS["capped"]
    runs = []
    for fn in ("trl", "onca"):
        hk, wk, bk = leaf(hidden), leaf(w), leaf(b)
        if fn == "trl":
            out = trl_function.apply(hk, wk, bk, targets, temperature, 64, softcap, logit_scale,
                                                           OPTIONAL_OUTPUTS)
        else:
            out = fused_linear_logprobs(hk, wk, targets, bk, temperature=temperature, softcap=softcap,
                                        logit_scale=logit_scale, outputs=OPTIONAL_OUTPUTS, chunk_tokens=CHUNK)
        torch.manual_seed(1)
        g_lp, g_ent = torch.randn_like(out[0]), torch.randn_like(out[1])
        ((out[0] * g_lp).sum() + (out[1] * g_ent).sum()).backward()
        runs.append((out, hk.grad, wk.grad, bk.grad))
    (trl_out, *trl_grads), (onca_out, *onca_grads) = runs
    for name, a, c in zip(("log_probs",) + OPTIONAL_OUTPUTS, trl_out, onca_out):
        if name == "is_top1":
            assert torch.equal(a, c) and a.any()
        else:
            assert_close(c, a, torch.float32, name)
    for name, a, c in zip(("dhidden", "dweight", "dbias"), trl_grads, onca_grads):
        assert_close(c, a, torch.float32, name)


def test_op_contract(device):
    h, w, b, labels = inputs((2, 5, 8, 24), torch.float32, device, prompt=1)

    def fn(h, w, b, labels):
        out = fused_linear_logprobs(h, w, labels, b, temperature=0.9, softcap=2.0, logit_scale=1.1,
                                    outputs=OPTIONAL_OUTPUTS, chunk_tokens=4)
        return out.log_probs, out.entropy, out.log_sum_sq_probs, out.mean_logits

    assert_op_contract(fn, (h.requires_grad_(), w.requires_grad_(), b.requires_grad_(), labels),
                       expect_ops={"chunked_logprob_forward", "chunked_logprob_backward"})


def test_weight_gradient_accumulates_in_fp32_by_default(monkeypatch, device):
    """TRL's contract: its kernel accumulates the weight gradient in fp32; ``accum_dtype=None`` opts
    into the weight's dtype."""
    from tests.ops.test_chunked_head import _accumulator_dtypes

    h, w, _, labels = make_inputs(BASE, torch.bfloat16, device)
    for accum_dtype, expected in (("default", torch.float32), (None, torch.bfloat16)):
        seen = _accumulator_dtypes(monkeypatch)
        kwargs = {} if accum_dtype == "default" else {"accum_dtype": accum_dtype}
        wk = leaf(w)
        fused_linear_logprobs(h, wk, labels, chunk_tokens=CHUNK, **kwargs).log_probs.sum().backward()
        assert seen and set(seen) == {expected}
        monkeypatch.undo()
