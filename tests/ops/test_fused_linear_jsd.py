"""Fused linear JSD forward and backward against a float64 PyTorch reference that materialises both
models' logits."""

from __future__ import annotations

import pytest
import torch

from onca.ops import fused_linear_jsd as op
from onca.ops.fused_linear_jsd import fused_linear_jsd
from tests.contract import assert_op_contract
from tests.helpers import MEMCHECK, SCALE, assert_close, leaf, randn, zero_fills_during
from tests.ops.test_jsd import IGNORE, divergence_per_token, reduce_tokens

# (tokens, student hidden, teacher hidden, vocab); vocabularies scaled down on the CPU.
CASES = {
    "cpu": [(50, 32, 48, 1519), (1, 16, 16, 1000), (33, 24, 24, 2621)],
    "gpu": [(4096, 2048, 4096, 32000), (2048, 1024, 2048, 151936), (512, 512, 512, 262144)],
}[SCALE]
BASE = CASES[0]


@pytest.fixture
def chunk_tokens(monkeypatch):
    """Force chunks of ``n`` tokens (a multiple of 16) by shrinking the free memory the planner sees."""

    def force(n: int, vocab: int):
        bytes_per_token = 2 * vocab * 4
        monkeypatch.setattr(op, "free_memory", lambda device=None: 4 * n * bytes_per_token)
        assert op.chunk_plan(10**6, vocab, 64).chunk == n

    return force


def make_inputs(tokens, hidden, teacher_hidden, vocab, dtype, device, ignore_every=0, batch=None):
    lead = (tokens,) if batch is None else (batch, tokens // batch)
    sh = randn(*lead, hidden, device=device).to(dtype)
    sw = randn(vocab, hidden, device=device, std=hidden ** -0.5 * 2).to(dtype)
    th = randn(*lead, teacher_hidden, device=device).to(dtype)
    tw = randn(vocab, teacher_hidden, device=device, std=teacher_hidden ** -0.5 * 2).to(dtype)
    labels = torch.randint(0, vocab, lead, device=device)
    if ignore_every:
        labels.view(-1)[::ignore_every] = IGNORE
    return sh, sw, th, tw, labels


def reference(sh, sw, th, tw, labels, beta, temperature, reduction="mean"):
    sh64 = sh.detach().to(torch.float64).requires_grad_(True)
    sw64 = sw.detach().to(torch.float64).requires_grad_(True)
    log_q = torch.log_softmax(sh64 @ sw64.T / temperature, -1)
    log_p = torch.log_softmax(th.to(torch.float64) @ tw.to(torch.float64).T / temperature, -1)
    return reduce_tokens(divergence_per_token(log_q, log_p, beta), labels, reduction), sh64, sw64


def check(sh, sw, th, tw, labels=None, beta=0.5, temperature=1.0, reduction="mean", grad=1.0,
          accum_dtype=None):
    shk, swk = leaf(sh), leaf(sw)
    loss = fused_linear_jsd(shk, swk, th, tw, labels, beta, IGNORE, temperature, reduction, accum_dtype)
    ref, sh64, sw64 = reference(sh, sw, th, tw, labels, beta, temperature, reduction)
    assert loss.dtype == sh.dtype and loss.shape == ()
    assert_close(loss, ref, sh.dtype, "loss")
    loss.backward(torch.tensor(grad, dtype=loss.dtype, device=sh.device))
    (ref * grad).backward()
    assert shk.grad.dtype == sh.dtype and swk.grad.dtype == sw.dtype
    assert_close(shk.grad, sh64.grad, sh.dtype, "dstudent_hidden")
    assert_close(swk.grad, sw64.grad, sw.dtype, "dstudent_weight")
    return loss, shk.grad, swk.grad


@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 2.0), (1.0, 0.7)])
@pytest.mark.parametrize("dtype, accum_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                (torch.bfloat16, torch.float32)], ids=str)
def test_matches_reference(profile, device, chunk_tokens, dtype, accum_dtype, beta, temperature):
    tokens, hidden, _, vocab = BASE
    chunk_tokens(16, vocab)  # several chunks, the last one short
    assert op.chunk_plan(tokens, vocab, hidden, device).n_chunks > 1
    check(*make_inputs(*BASE, dtype, device, ignore_every=3), beta=beta, temperature=temperature,
          accum_dtype=accum_dtype)


@pytest.mark.parametrize("accum_dtype", [None, torch.float32], ids=str)
def test_weight_gradient_written_by_the_first_chunk(device, chunk_tokens, poisoned_empty, accum_dtype):
    """Several chunks with every fresh buffer NaN: the weight gradient (in the head's dtype or an
    fp32 accumulator) is written by the first chunk, not zero-filled and added into."""
    tokens, hidden, _, vocab = BASE
    chunk_tokens(16, vocab)
    check(*make_inputs(*BASE, torch.bfloat16, device, ignore_every=3), beta=0.5, accum_dtype=accum_dtype)


def test_both_accumulations_give_the_head_s_dtype_and_agree(device, chunk_tokens):
    """bf16 head over many chunks: the default sums the weight gradient in bf16 (a rounding per
    chunk), ``accum_dtype=torch.float32`` in fp32 (one rounding at the end); both come out in the
    head's dtype, each within bf16's tolerance of the float64 reference (``check``) and of each other."""
    tokens, hidden, _, vocab = BASE
    chunk_tokens(16, vocab)
    inputs = make_inputs(*BASE, torch.bfloat16, device, ignore_every=3)
    _, _, dw_head = check(*inputs)
    _, _, dw_fp32 = check(*inputs, accum_dtype=torch.float32)
    assert dw_head.dtype == dw_fp32.dtype == torch.bfloat16
    assert_close(dw_head, dw_fp32, torch.bfloat16, "dW: head dtype vs fp32 accumulation")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is measured on a GPU")
def test_default_accumulation_holds_no_fp32_head_sized_buffer():
    """The forward's peak with the default (the head's dtype) is at least a bf16 head below the
    fp32 accumulator's (which holds twice the head's size, then its cast beside it)."""
    tokens, hidden, vocab = 1024, 1024, 32768
    sh, sw, th, tw, labels = make_inputs(tokens, hidden, hidden, vocab, torch.bfloat16, "cuda")
    peaks = {}
    for accum_dtype in (None, torch.float32):
        shk, swk = leaf(sh), leaf(sw)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fused_linear_jsd(shk, swk, th, tw, labels, accum_dtype=accum_dtype)
        torch.cuda.synchronize()
        peaks[accum_dtype] = torch.cuda.max_memory_allocated() - start
        del loss, shk, swk
    head = vocab * hidden * 2
    assert peaks[torch.float32] - peaks[None] >= head, {k: v / head for k, v in peaks.items()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_shapes(device, case):
    check(*make_inputs(*case, torch.bfloat16, device, ignore_every=4), beta=0.3, temperature=1.5)


def test_column_tiled_divergence(profile, device, onchip_bytes, chunk_tokens):
    tokens, hidden, teacher_hidden, vocab = 20, 16, 24, 2621
    forced = onchip_bytes(65536)
    chunk_tokens(16, vocab)
    plans = op.plan((tokens, hidden, vocab), torch.bfloat16, forced)
    assert plans["divergence"].col_tiles > 1 and plans["chunks"].n_chunks > 1
    check(*make_inputs(tokens, hidden, teacher_hidden, vocab, torch.bfloat16, device, ignore_every=5),
          beta=0.5, temperature=2.0)


def test_chunking_does_not_change_the_result(device, chunk_tokens):
    """fp32: one chunk and many chunks agree to rounding; dW is summed chunk by chunk in order."""
    inputs = make_inputs(*BASE, torch.float32, device, ignore_every=3)
    one = check(*inputs)
    chunk_tokens(16, BASE[-1])
    many = check(*inputs)
    for a, b in zip(one, many):
        assert_close(a, b, torch.float32)
    again = check(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(many, again)), "chunked dW must be deterministic"


def test_forward_gradients_become_the_grads_without_a_copy(device):
    """The student's gradients computed in the forward pass become its ``.grad``, rescaled in place
    by the incoming gradient: no second head-sized gradient at the backward's peak."""
    sh, sw, th, tw, labels = make_inputs(*BASE, torch.bfloat16, device, ignore_every=3)
    shk, swk = leaf(sh), leaf(sw)
    loss = op.fused_linear_jsd(shk, swk, th, tw, labels)
    written = [g.data_ptr() for g in loss.grad_fn.grads.tensors if g is not None]
    (3 * loss).backward()
    # Under compute-sanitizer autograd hands the weight a copy after a rescaled backward (H100,
    # 2026-11-25: memcheck reports 0 errors; not without the sanitizer, at either test scale).
    if not MEMCHECK:
        assert [shk.grad.data_ptr(), swk.grad.data_ptr()] == written
    sh2, sw2 = leaf(sh), leaf(sw)
    op.fused_linear_jsd(sh2, sw2, th, tw, labels).backward()
    assert_close(swk.grad, 3 * sw2.grad, torch.bfloat16, "dstudent_weight x3")


def test_backward_fills_no_zeros_for_the_returned_gradients(device):
    """dW and dX come out of the forward op as outputs taking no gradient: no zero fill of their
    size in backward (a head-sized buffer)."""
    sh, sw, th, tw, labels = make_inputs(48, 32, 40, 1000, torch.float32, device, ignore_every=7)
    sh, sw = leaf(sh), leaf(sw)
    loss = fused_linear_jsd(sh, sw, th, tw, labels)
    assert zero_fills_during(loss.backward, sh.numel() * sh.element_size()) == []


def test_three_dimensional_inputs_and_sum(device):
    sh, sw, th, tw, labels = make_inputs(48, 32, 40, 1000, torch.float32, device, ignore_every=7, batch=3)
    assert sh.shape == (3, 16, 32)
    check(sh, sw, th, tw, labels, beta=0.5, reduction="sum", grad=0.5)
    check(sh, sw, th, tw, labels.view(-1), beta=0.5)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_every_token_ignored(device, temperature):
    sh, sw, th, tw, labels = make_inputs(*BASE, torch.bfloat16, device)
    labels.fill_(IGNORE)
    loss, dh, dw = check(sh, sw, th, tw, labels, temperature=temperature)
    assert loss.item() == 0 and torch.count_nonzero(dh) == 0 and torch.count_nonzero(dw) == 0


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_one_token(device, beta):
    check(*make_inputs(1, 32, 32, 1519, torch.bfloat16, device), beta=beta, temperature=1.3)


def test_without_labels(device):
    sh, sw, th, tw, _ = make_inputs(*BASE, torch.float32, device)
    check(sh, sw, th, tw, None, beta=0.5)


def test_frozen_head_and_no_grad(device):
    sh, sw, th, tw, labels = make_inputs(*BASE, torch.float32, device, ignore_every=3)
    ref, sh64, _ = reference(sh, sw, th, tw, labels, 0.5, 1.0)
    ref.backward()
    shk = leaf(sh)
    fused_linear_jsd(shk, sw, th, tw, labels).backward()  # the head does not require a gradient
    assert_close(shk.grad, sh64.grad, torch.float32, "dstudent_hidden")
    swk = leaf(sw)
    fused_linear_jsd(sh, swk, th, tw, labels).backward()  # only the head does
    assert swk.grad is not None
    with torch.no_grad():
        loss = fused_linear_jsd(leaf(sh), leaf(sw), th, tw, labels)
    assert_close(loss, ref, torch.float32, "loss")
    thk, twk = leaf(th), leaf(tw)
    fused_linear_jsd(leaf(sh), leaf(sw), thk, twk, labels).backward()
    assert thk.grad is None and twk.grad is None, "the teacher gets no gradient"


def test_scaled_and_repeated_backward(device):
    sh, sw, th, tw, labels = make_inputs(*BASE, torch.float32, device, ignore_every=3)
    check(sh, sw, th, tw, labels, grad=-3.0)
    shk, swk = leaf(sh), leaf(sw)
    loss = fused_linear_jsd(shk, swk, th, tw, labels)
    g1 = torch.autograd.grad(loss * 2.0, (shk, swk), retain_graph=True)
    g2 = torch.autograd.grad(loss, (shk, swk))
    assert torch.equal(g1[0], g2[0] * 2.0) and torch.equal(g1[1], g2[1] * 2.0)


def test_does_not_modify_caller_tensors(device):
    sh, sw, th, tw, labels = make_inputs(*BASE, torch.bfloat16, device, ignore_every=3)
    before = [t.clone() for t in (sh, sw, th, tw, labels)]
    fused_linear_jsd(leaf(sh), leaf(sw), th, tw, labels, temperature=2.0).backward()
    assert all(torch.equal(a, b) for a, b in zip(before, (sh, sw, th, tw, labels)))


def test_chunk_plan_respects_budget(monkeypatch):
    vocab, hidden = 128256, 4096
    monkeypatch.setattr(op, "free_memory", lambda device=None: 80 << 30)
    plan = op.chunk_plan(8192, vocab, hidden)
    # Never the whole logits of 8192 tokens at once, and chunks long enough for the matmuls.
    assert 1 < plan.n_chunks and plan.chunk >= op.MIN_CHUNK_TOKENS
    assert plan.bytes_per_chunk <= max(vocab * hidden * 2, op.MIN_CHUNK_TOKENS * 8 * vocab)
    monkeypatch.setattr(op, "free_memory", lambda device=None: 1 << 30)
    assert op.chunk_plan(8192, vocab, hidden).bytes_per_chunk <= (1 << 30) // 4


def test_bad_input(device):
    sh, sw, th, tw, labels = make_inputs(8, 16, 24, 100, torch.float32, device)
    with pytest.raises(ValueError, match="student_hidden must have last dimension 16"):
        fused_linear_jsd(sh[:, :8], sw, th, tw)
    with pytest.raises(ValueError, match="teacher_hidden must have last dimension 24"):
        fused_linear_jsd(sh, sw, th[:, :8], tw)
    with pytest.raises(ValueError, match="the two heads must share one vocabulary"):
        fused_linear_jsd(sh, sw, th, tw[:99])
    with pytest.raises(ValueError, match="teacher_hidden must have the student's tokens"):
        fused_linear_jsd(sh, sw, th[:7], tw)
    with pytest.raises(ValueError, match="student_weight must be 2-D"):
        fused_linear_jsd(sh, sw[None], th, tw)
    with pytest.raises(TypeError, match="student_hidden .* and student_weight .* must have one dtype"):
        fused_linear_jsd(sh.to(torch.bfloat16), sw, th, tw)
    with pytest.raises(TypeError, match="teacher_hidden must have a floating dtype"):
        fused_linear_jsd(sh, sw, th.to(torch.int64), tw)
    with pytest.raises(ValueError, match="beta"):
        fused_linear_jsd(sh, sw, th, tw, beta=1.01)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_jsd(sh, sw, th, tw, temperature=0.0)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_jsd(sh, sw, th, tw, reduction="none")
    with pytest.raises(ValueError, match="accum_dtype must be None, torch.float32 or the weight's dtype"):
        fused_linear_jsd(sh, sw, th, tw, accum_dtype=torch.float16)
    with pytest.raises(ValueError, match="labels must have shape"):
        fused_linear_jsd(sh, sw, th, tw, labels[:5])
    with pytest.raises(TypeError, match="labels must be an int32 or int64"):
        fused_linear_jsd(sh, sw, th, tw, labels.float())
    with pytest.raises(ValueError, match="teacher_weight is on meta"):
        fused_linear_jsd(sh, sw, th, torch.empty(100, 24, device="meta"))
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        fused_linear_jsd(sh, sw, th, tw, labels, ignore_index=None)
    with pytest.raises(TypeError, match="temperature must be a number"):
        fused_linear_jsd(sh, sw, th, tw, temperature="2")
    with pytest.raises(TypeError, match="teacher_weight must be a torch.Tensor"):
        fused_linear_jsd(sh, sw, th, None)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("with_labels", [False, True])
def test_empty_input(device, reduction, with_labels):
    """No tokens: the reference's loss (a sum of 0; a mean of 0 with labels, NaN without), an empty
    hidden-state gradient and a zero head gradient."""
    sh, sw, th, tw, labels = make_inputs(0, 16, 24, 100, torch.float32, device, batch=2)
    labels = labels if with_labels else None
    shk, swk = leaf(sh), leaf(sw)
    loss = fused_linear_jsd(shk, swk, th, tw, labels, reduction=reduction)
    ref, _, sw64 = reference(sh, sw, th, tw, labels, 0.5, 1.0, reduction)
    torch.testing.assert_close(loss, ref.to(loss.dtype), equal_nan=True)
    loss.backward()
    ref.backward()
    assert shk.grad.shape == sh.shape
    assert torch.equal(swk.grad, sw64.grad.to(swk.dtype)) and not swk.grad.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast(device, dtype):
    """Under torch.autocast the fp32 hidden states and heads are used in the autocast dtype, as
    F.linear would use them; the gradients reach the fp32 leaves."""
    sh, sw, th, tw, labels = make_inputs(20, 16, 24, 300, torch.float32, device, ignore_every=3)
    shk, swk = leaf(sh), leaf(sw)
    with torch.autocast(torch.device(device).type, dtype=dtype):
        loss = fused_linear_jsd(shk, swk, th, tw, labels, 0.5, IGNORE, 2.0)
    ref, sh64, sw64 = reference(*(t.to(dtype) for t in (sh, sw, th, tw)), labels, 0.5, 2.0)
    assert loss.dtype == dtype
    assert_close(loss, ref, dtype, "loss")
    loss.backward()
    ref.backward()
    assert shk.grad.dtype == torch.float32 and swk.grad.dtype == torch.float32
    assert_close(shk.grad, sh64.grad, dtype, "dstudent_hidden")
    assert_close(swk.grad, sw64.grad, dtype, "dstudent_weight")


@pytest.mark.parametrize("dtype, head_grad", [(torch.float32, True), (torch.bfloat16, False)], ids=str)
def test_op_contract(device, dtype, head_grad):
    """Custom op (opcheck), fullgraph compile equal to eager, no host synchronisation; with and
    without the head's gradient, fp32 and bf16 (the gradient written over the fp32 logits)."""
    sh, sw, th, tw, labels = make_inputs(6, 8, 12, 24, dtype, device, ignore_every=4, batch=2)
    def fn(sh, sw, th, tw, labels):
        return fused_linear_jsd(sh, sw, th, tw, labels, 0.5, IGNORE, 2.0)

    inputs = (sh.requires_grad_(), sw.requires_grad_(head_grad), th, tw, labels)
    assert_op_contract(fn, inputs, expect_ops={"fused_linear_jsd_forward"})
