"""Fused linear cross entropy forward and backward against a float64 reference of the eager head + loss
(``cross_entropy(hidden @ W.T + b, target)``, logits rounded to the input dtype as the model's
matmul rounds them), with the tokens forced into several chunks."""

from __future__ import annotations

import pytest
import torch

from onca.ops import fused_linear_cross_entropy as op
from onca.ops.fused_linear_cross_entropy import chunk_plan, fused_linear_cross_entropy
from tests.contract import assert_op_contract
from tests.helpers import (
    SCALE,
    assert_close,
    assert_within_rounding,
    leaf,
    non_contiguous,
    randn,
    rounded,
    zero_fills_during,
)
from tests.ops.test_cross_entropy import (
    IGNORE,
    OPTIONS,
    class_weights,
    expected_metrics,
    loss_reference,
    make_target,
    reduce_reference,
    reference_terms,
)

# (tokens, hidden, vocab): awkward vocabularies of real models scaled down on the CPU.
SHAPES = {
    "cpu": [(48, 32, 1000), (40, 24, 1519), (33, 16, 2621)],
    "gpu": [(4096, 4096, 128256), (2048, 3584, 151936), (1024, 2048, 262144)],
}[SCALE]
BASE = SHAPES[0]
CHUNK = {"cpu": 16, "gpu": 1024}[SCALE]  # forces several chunks


def make_inputs(shape, dtype, device, bias=False, ignore_every=4):
    tokens, hidden, vocab = shape
    h = randn(tokens, hidden, dtype=dtype, device=device)
    w = randn(vocab, hidden, dtype=dtype, device=device, std=hidden ** -0.5 * 2)
    b = randn(vocab, dtype=dtype, device=device, std=0.5) if bias else None
    return h, w, b, make_target(tokens, vocab, device, ignore_every)


def reference(h, w, b, target, reduction="mean", **options):
    """float64 loss of the eager computation, and its float64 leaves for the gradients."""
    h64 = h.detach().to(torch.float64).requires_grad_(True)
    w64 = w.detach().to(torch.float64).requires_grad_(True)
    b64 = b.detach().to(torch.float64).requires_grad_(True) if b is not None else None
    logits = h64.reshape(-1, h.shape[-1]) @ w64.T
    if b64 is not None:
        logits = logits + b64
    logits = rounded(logits, h.dtype)  # the head's matmul output has the input dtype
    per, z, valid = reference_terms(logits, target.reshape(-1), **options)
    loss = reduce_reference(per, valid, reduction)
    if reduction == "none":
        loss = loss.view(target.shape)
    return loss, (h64, w64, b64), (z, valid)


def check(h, w, b, target, reduction="mean", grad_scale=None, accum_dtype=None, chunk_tokens=CHUNK, **options):
    dtype = h.dtype
    hk, wk = leaf(h), leaf(w)
    bk = leaf(b) if b is not None else None
    loss = fused_linear_cross_entropy(hk, wk, target, bk, reduction=reduction, accum_dtype=accum_dtype,
                                      chunk_tokens=chunk_tokens, **options)
    ref, leaves, _ = reference(h, w, b, target, reduction, **options)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close(loss, ref, dtype, "loss")
    if grad_scale is None:
        dy = randn(*ref.shape, device=h.device) if ref.dim() else torch.tensor(0.75, device=h.device)
    else:
        dy = torch.tensor(float(grad_scale), device=h.device)
    loss.backward(dy)
    ref.backward(dy.to(torch.float64))
    h64, w64, b64 = leaves
    assert_close(hk.grad, h64.grad, dtype, "dhidden")
    assert_close(wk.grad, w64.grad, dtype, "dweight")
    assert hk.grad.dtype == dtype and wk.grad.dtype == w.dtype
    if b is not None:
        assert_close(bk.grad, b64.grad, dtype, "dbias")
    return loss, hk, wk, bk


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference(profile, device, dtype, reduction):
    h, w, b, t = make_inputs(BASE, dtype, device)
    check(h, w, b, t, reduction)


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_options_with_bias(device, name, dtype):
    h, w, b, t = make_inputs(BASE, dtype, device, bias=True)
    check(h, w, b, t, "mean", **OPTIONS[name])
    if name == "all":
        check(h, w, b, t, "none", **OPTIONS[name])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_vocab_sizes_3d(profile, device, shape):
    tokens, hidden, vocab = shape
    h, w, _, t = make_inputs(shape, torch.bfloat16, device)
    # (B, S, H) hidden states, as a causal LM's forward hands them over.
    check(h.view(1, tokens, hidden), w, None, t.view(1, tokens), "mean", softcap=30.0)


def test_column_tiled_cross_entropy(device, onchip_bytes):
    forced = onchip_bytes(16384)
    tokens, hidden, vocab = SHAPES[1]
    assert op.plan(SHAPES[1], torch.bfloat16, forced)["cross_entropy"].col_tiles > 1
    h, w, b, t = make_inputs(SHAPES[1], torch.bfloat16, device, bias=True)
    check(h, w, b, t, "mean", **OPTIONS["all"])


def test_chunks_from_free_memory(monkeypatch, device):
    """Without chunk_tokens the chunks come from the free memory; a small budget forces several."""
    tokens, hidden, vocab = BASE
    itemsize = 4
    free = int(20 * vocab * itemsize / op.FREE_FRACTION)  # room for ~20 tokens of logits
    monkeypatch.setattr(op, "free_memory", lambda device=None: free)
    plan = chunk_plan(tokens, hidden, vocab, torch.float32)
    assert plan.n_chunks > 1 and plan.bytes_per_chunk <= free * op.FREE_FRACTION
    seen = []
    real = op.chunk_plan
    monkeypatch.setattr(op, "chunk_plan", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    h, w, b, t = make_inputs(BASE, torch.float32, device, ignore_every=0)
    check(h, w, b, t, "mean", chunk_tokens=None)
    assert seen and seen[0].n_chunks > 1


def test_chunk_plan_policy():
    gib = 1 << 30
    # Llama-3 head in bf16: CHUNK_TOKENS tokens of logits, not more than there are tokens.
    p = chunk_plan(8192, 4096, 128256, torch.bfloat16, free_bytes=100 * gib)
    assert p.chunk == op.CHUNK_TOKENS and p.n_chunks == 8192 // op.CHUNK_TOKENS
    assert p.bytes_per_chunk == op.CHUNK_TOKENS * 128256 * 2
    assert chunk_plan(100, 4096, 128256, torch.bfloat16, free_bytes=100 * gib).n_chunks == 1
    # fp32 accumulation of dW moves twice the bytes per chunk: twice the tokens.
    assert chunk_plan(8192, 4096, 128256, torch.bfloat16, accum_bytes=4, free_bytes=100 * gib).chunk == 2 * op.CHUNK_TOKENS
    # Another aim (the post-training heads' forward chunks), doubled the same way.
    aimed = chunk_plan(8192, 4096, 128256, torch.bfloat16, free_bytes=100 * gib, target_tokens=256)
    assert aimed.chunk == 256
    assert chunk_plan(8192, 4096, 128256, torch.bfloat16, accum_bytes=4, free_bytes=100 * gib,
                      target_tokens=256).chunk == 512
    # Little free memory: the scratch shrinks to a fraction of it.
    small = chunk_plan(8192, 4096, 128256, torch.bfloat16, free_bytes=256 << 20)
    assert small.bytes_per_chunk <= (256 << 20) * op.FREE_FRACTION and small.chunk >= 16
    # chunk_tokens fixes the chunk: one row of logits per token, whatever the ignored targets.
    g = chunk_plan(8192, 4096, 128256, torch.bfloat16, chunk_tokens=100)
    assert g.chunk == 100 and g.bytes_per_chunk == 100 * 128256 * 2


def test_every_token_ignored_as_torch(device):
    """As torch on the logits: the mean is 0/0 = NaN, the sum 0, per token 0; the gradients zero."""
    h, w, b, _ = make_inputs(BASE, torch.float32, device, bias=True)
    t = torch.full((BASE[0],), IGNORE, device=device)
    for reduction in ("mean", "sum", "none"):
        hk, wk, bk = leaf(h), leaf(w), leaf(b)
        loss, z = fused_linear_cross_entropy(hk, wk, t, bk, reduction=reduction, lse_square_scale=1e-3,
                                             return_z_loss=True, chunk_tokens=CHUNK)
        expected = torch.nn.functional.cross_entropy(h @ w.T + b, t, reduction=reduction)
        torch.testing.assert_close(loss, expected, equal_nan=True)
        z_expected = expected if reduction == "mean" else torch.zeros_like(z)
        torch.testing.assert_close(z, z_expected, equal_nan=True)
        loss.sum().backward()
        for grad, ref in ((hk.grad, h), (wk.grad, w), (bk.grad, b)):
            assert torch.equal(grad, torch.zeros_like(ref))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16)])
def test_empty_input_as_torch(device, shape, reduction):
    """No tokens: torch's results (mean NaN, sum 0, none empty), zero weight and bias gradients."""
    h = randn(*shape, device=device)
    w, b = randn(50, 16, device=device), randn(50, device=device)
    t = torch.zeros(shape[:-1], dtype=torch.int64, device=device)
    hk, wk, bk = leaf(h), leaf(w), leaf(b)
    hr, wr, br = leaf(h), leaf(w), leaf(b)
    loss = fused_linear_cross_entropy(hk, wk, t, bk, reduction=reduction)
    expected = torch.nn.functional.cross_entropy((hr @ wr.T + br).reshape(-1, 50), t.reshape(-1),
                                                 reduction=reduction)
    expected = expected.view(t.shape) if reduction == "none" else expected
    assert loss.shape == expected.shape
    torch.testing.assert_close(loss, expected, equal_nan=True)
    loss.sum().backward()
    expected.sum().backward()
    for ours, ref in ((hk.grad, hr.grad), (wk.grad, wr.grad), (bk.grad, br.grad)):
        assert torch.equal(ours, ref)


def test_ignored_tokens_masked_across_chunk_boundaries(device):
    """Chunks are taken by position, ignored tokens masked in place: runs of ignored tokens that
    start, end and straddle chunk boundaries (and a whole ignored chunk) match the reference."""
    h, w, b, _ = make_inputs(BASE, torch.float32, device, bias=True)
    tokens, _, vocab = BASE
    t = torch.randint(0, vocab, (tokens,), device=device)
    t[CHUNK - 3:CHUNK + 2] = IGNORE  # straddles the first boundary
    t[2 * CHUNK:3 * CHUNK] = IGNORE  # a whole chunk
    t[-1] = IGNORE
    for reduction in ("mean", "none"):
        check(h, w, b, t, reduction)


def test_offset_and_strided_hidden(device):
    """Hidden states that are a view into a larger buffer (a storage offset, padded rows, a 3-D
    (B, S, H) slice as compiled graphs hand over) are read where they are, not from the buffer's
    start: the same loss and gradients as a contiguous copy."""
    tokens, hidden, _ = BASE
    h, w, b, t = make_inputs(BASE, torch.bfloat16, device, bias=True)
    buffer = randn(3, tokens + 5, hidden + 8, dtype=torch.bfloat16, device=device)
    view = buffer[1, 5:, 4:4 + hidden]
    view.copy_(h)
    assert view.storage_offset() > 0 and not view.is_contiguous()
    check(view, w, b, t, "mean")
    check(view.view(2, tokens // 2, hidden), w, b, t.view(2, tokens // 2), "none")


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_one_token(device, reduction):
    h, w, b, _ = make_inputs(BASE, torch.bfloat16, device, bias=True)
    check(h[:1], w, b, torch.tensor([3], device=device), reduction, **OPTIONS["all"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_weight_gradient_accumulation(device, dtype, poisoned_empty):
    """Every fresh buffer NaN: the fp32 accumulator is written by the first chunk, not zero-filled."""
    h, w, b, t = make_inputs(BASE, dtype, device, bias=True)
    check(h, w, b, t, "mean", accum_dtype=torch.float32)
    check(h, w, b, t, "none", accum_dtype=torch.float32)


@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_sum_divided_by_num_items_in_batch(device, scale):
    """Hugging Face's gradient accumulation: reduction="sum", then loss / num_items_in_batch."""
    h, w, _, t = make_inputs(BASE, torch.bfloat16, device)
    hk, wk = leaf(h), leaf(w)
    num_items = 1.0 / scale
    loss = fused_linear_cross_entropy(hk, wk, t, reduction="sum", chunk_tokens=CHUNK) / num_items
    ref, (h64, w64, _), _ = reference(h, w, None, t, "sum")
    ref = ref / num_items
    assert_close(loss, ref, torch.bfloat16, "loss")
    loss.backward()
    ref.backward()
    assert_close(hk.grad, h64.grad, torch.bfloat16, "dhidden")
    assert_close(wk.grad, w64.grad, torch.bfloat16, "dweight")


def test_non_contiguous_hidden(device):
    h, w, b, t = make_inputs(BASE, torch.bfloat16, device, bias=True)
    for how in ("rows", "cols"):
        check(non_contiguous(h, how), w, b, t, "mean")


def test_strided_targets(device):
    """A strided 1-D target (``labels[::2]``), read per chunk by the cross-entropy kernel."""
    h, w, b, _ = make_inputs(BASE, torch.float32, device, bias=True)
    wide = make_target(2 * BASE[0], BASE[2], device, ignore_every=3)
    check(h, w, b, wide[::2], "none")
    check(h, w, b, wide[::2], "mean", lse_square_scale=1e-2)


def test_frozen_head_and_frozen_hidden(monkeypatch, device):
    h, w, _, t = make_inputs(BASE, torch.float32, device)
    ref, (h64, w64, _), _ = reference(h, w, None, t)
    ref.backward()
    hk = leaf(h)
    fused_linear_cross_entropy(hk, w, t, chunk_tokens=CHUNK).backward()  # LoRA-style frozen head
    assert_close(hk.grad, h64.grad, torch.float32, "dhidden")
    wk = leaf(w)
    fused_linear_cross_entropy(h, wk, t, chunk_tokens=CHUNK).backward()
    assert_close(wk.grad, w64.grad, torch.float32, "dweight")
    calls = []
    real = op._grad_buffers
    monkeypatch.setattr(op, "_grad_buffers", lambda *a: calls.append(a) or real(*a))
    with torch.no_grad():  # evaluation: the loss alone, no gradient matmuls
        assert_close(fused_linear_cross_entropy(leaf(h), leaf(w), t), ref, torch.float32, "loss")
    assert not calls


def test_tied_embedding_weight(device):
    """A head tied to the input embedding: both gradients reach the one shared parameter."""
    vocab, hidden, batch, seq = 300, 16, 2, 9

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, hidden)
            self.proj = torch.nn.Linear(hidden, hidden)

        def hidden_states(self, ids):
            return torch.tanh(self.proj(self.embed(ids)))

    torch.manual_seed(1)
    model = TinyLM().to(device)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    labels = torch.nn.functional.pad(ids, (0, 1), value=IGNORE)[:, 1:]  # shifted labels, last ignored
    h = model.hidden_states(ids)
    loss = fused_linear_cross_entropy(h, model.embed.weight, labels, chunk_tokens=4)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model.hidden_states(ids) @ model.embed.weight.T
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).double(), labels.reshape(-1))
    ref.backward()
    assert_close(loss, ref, torch.float32, "loss")
    for name, p in model.named_parameters():
        assert_close(ours[name], p.grad, torch.float32, name)


def test_autocast(device):
    """Under torch.autocast the head's matmul runs in the autocast dtype, as F.linear would."""
    h, w, _, t = make_inputs(BASE, torch.float32, device)
    hk, wk = leaf(h), leaf(w)
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hk, wk, t, chunk_tokens=CHUNK)
    ref, (h64, w64, _), _ = reference(h.to(torch.bfloat16), w.to(torch.bfloat16), None, t)
    assert_close(loss, ref, torch.bfloat16, "loss")
    loss.backward()
    ref.backward()
    assert wk.grad.dtype == torch.float32 and hk.grad.dtype == torch.float32
    assert_close(hk.grad, h64.grad, torch.bfloat16, "dhidden")
    assert_close(wk.grad, w64.grad, torch.bfloat16, "dweight")


def test_return_z_loss(device):
    h, w, b, t = make_inputs(BASE, torch.float32, device, bias=True)
    for reduction in ("mean", "none"):
        loss, z = fused_linear_cross_entropy(leaf(h), leaf(w), t, leaf(b), reduction=reduction,
                                             lse_square_scale=1e-2, return_z_loss=True, chunk_tokens=CHUNK)
        ref, _, (z_ref, valid) = reference(h, w, b, t, reduction, lse_square_scale=1e-2)
        z_ref = reduce_reference(z_ref, valid, reduction)
        assert_close(loss, ref, torch.float32, "loss")
        assert_close(z, z_ref, torch.float32, "z_loss")
        assert not z.requires_grad


def test_does_not_modify_inputs_and_is_deterministic(device):
    h, w, b, t = make_inputs(BASE, torch.bfloat16, device, bias=True)
    copies = [x.clone() for x in (h, w, b, t)]
    grads = []
    for _ in range(2):
        hk, wk, bk = leaf(h), leaf(w), leaf(b)
        fused_linear_cross_entropy(hk, wk, t, bk, chunk_tokens=CHUNK).backward()
        grads.append((hk.grad, wk.grad, bk.grad))
    for x, c in zip((h, w, b, t), copies):
        assert torch.equal(x, c)
    for a, b_ in zip(*grads):
        assert torch.equal(a, b_)


def test_backward_twice(device):
    """retain_graph=True (or a benchmark timing backward alone): the forward-pass gradients are handed
    over again, as new tensors rescaled to the new incoming gradient, unless someone modified the
    first backward's (which became the .grad) meanwhile."""
    h, w, _, t = make_inputs(BASE, torch.float32, device)
    ref, (h64, _, _), _ = reference(h, w, None, t)
    ref.backward()
    hk, wk = leaf(h), leaf(w)
    loss = fused_linear_cross_entropy(hk, wk, t, chunk_tokens=CHUNK)
    loss.backward(torch.tensor(2.0), retain_graph=True)
    assert_close(hk.grad, 2 * h64.grad, torch.float32, "dhidden x2")
    first = hk.grad
    hk.grad = wk.grad = None
    loss.backward(torch.tensor(0.5), retain_graph=True)
    assert_close(hk.grad, 0.5 * h64.grad, torch.float32, "dhidden x0.5")
    assert_close(first, 2 * h64.grad, torch.float32, "the first backward's result, unchanged")
    loss.backward(torch.tensor(0.5), retain_graph=True)  # accumulated into the second's tensor
    assert_close(hk.grad, h64.grad, torch.float32, "dhidden accumulated")
    # Accumulating into the first backward's own tensors modifies them: a further backward is refused.
    hk.grad = wk.grad = None
    loss = fused_linear_cross_entropy(hk, wk, t, chunk_tokens=CHUNK)
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    assert_close(hk.grad, 2 * h64.grad, torch.float32, "dhidden accumulated into the first")
    with pytest.raises(RuntimeError, match="modified after the first backward"):
        loss.backward(torch.tensor(0.5))


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_forward_gradients_become_the_grads_without_a_copy(device, bias):
    """Peak memory: the weight gradient the forward pass wrote (the size of the head) must become
    ``weight.grad`` itself; a copy by autograd would add a second head-sized buffer at backward."""
    h, w, b, t = make_inputs(BASE, torch.bfloat16, device, bias=bias)
    leaves = [leaf(x) for x in (h, w, b) if x is not None]
    loss = fused_linear_cross_entropy(*leaves[:2], t, leaves[2] if bias else None, chunk_tokens=CHUNK)
    handed = [g for g in loss.grad_fn.grads.tensors if g is not None]
    written = [(g.data_ptr(), g.dtype, g.shape, g.stride()) for g in handed]
    loss.backward()
    assert len(written) == len(leaves)
    for x, w_, name in zip(leaves, written, ("hidden", "weight", "bias")):
        got = (x.grad.data_ptr(), x.grad.dtype, x.grad.shape, x.grad.stride())
        assert got[0] == w_[0], f"{name}.grad is a copy of the forward pass's gradient: {got} vs {w_}"


def test_backward_fills_no_zero_gradient_for_the_returned_gradients(device):
    """The forward pass returns dW, dX (and dB) as outputs that take no gradient: autograd must not
    allocate and fill a zero "gradient" for each in backward (a second head-sized buffer at the
    backward's peak, measured as 1.44x liger-kernel's memory at the Llama-3-8B point)."""
    h, w, b, t = make_inputs(BASE, torch.bfloat16, device, bias=True)
    leaves = [leaf(x) for x in (h, w, b)]
    loss = fused_linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], chunk_tokens=CHUNK)
    smallest = min(x.numel() * x.element_size() for x in leaves)
    assert zero_fills_during(loss.backward, smallest) == []


def test_bad_input(device):
    h, w, b, t = make_inputs((8, 16, 50), torch.float32, device, bias=True)
    f = fused_linear_cross_entropy
    with pytest.raises(TypeError, match="target must be an int32 or int64 tensor"):
        f(h, w, t.float())
    with pytest.raises(ValueError, match=r"target must have shape \(8,\)"):
        f(h, w, t[:4])
    with pytest.raises(ValueError, match="weight must be"):
        f(h, w[:, :8], t)
    with pytest.raises(ValueError, match="weight must be"):
        f(h, w.reshape(-1), t)
    with pytest.raises(TypeError, match="weight must have hidden's dtype"):
        f(h, w.to(torch.bfloat16), t)
    with pytest.raises(TypeError, match="hidden must have a floating dtype"):
        f(h.to(torch.int64), w, t)
    with pytest.raises(ValueError, match="hidden must be"):
        f(h[0], w, t[0])
    with pytest.raises(ValueError, match="bias must have shape"):
        f(h, w, t, b[:10])
    with pytest.raises(TypeError, match="bias must have hidden's dtype"):
        f(h, w, t, b.double())
    with pytest.raises(ValueError, match="accum_dtype"):
        f(h, w, t, accum_dtype=torch.int32)
    with pytest.raises(ValueError, match="chunk_tokens"):
        f(h, w, t, chunk_tokens=0)
    with pytest.raises(ValueError, match="reduction"):
        f(h, w, t, reduction="batchmean")
    with pytest.raises(ValueError, match="weight is on meta"):
        f(h, torch.empty(50, 16, device="meta"), t)
    with pytest.raises(ValueError, match="weight must be"):
        f(h, w[:0], t)
    with pytest.raises(TypeError, match="hidden must be a torch.Tensor"):
        f(h.tolist(), w, t)
    with pytest.raises(TypeError, match="label_smoothing must be a number"):
        f(h, w, t, label_smoothing=None)
    with pytest.raises(TypeError, match="return_z_loss must be a bool"):
        f(h, w, t, return_z_loss=1)


def test_out_of_range_target_is_nan_not_a_bad_read(device):
    """A non-ignored target outside [0, vocab) is never used as an offset: the loss is NaN."""
    h, w, _, _ = make_inputs((8, 16, 50), torch.float32, device)
    t = torch.tensor([0, 1, 2, 3, 4, 5, 6, 50], device=device)
    per_token = fused_linear_cross_entropy(h, w, t, reduction="none")
    assert torch.isnan(per_token[-1]) and torch.isfinite(per_token[:-1]).all()
    assert torch.isnan(fused_linear_cross_entropy(h, w, t))


def test_compiled_after_a_checkpointed_layer_is_one_graph(device):
    """The reported GPU failure's setting (torch.compile + gradient checkpointing, ignored tokens):
    the op is one opaque node, so Dynamo never traces into its chunk loop (the old autograd
    Function synchronised and gathered, and Dynamo compiled its insides piecewise around those
    breaks). fullgraph=True would raise on any break; the result equals eager."""
    tokens, hidden, vocab = 12, 16, 50
    layer = torch.nn.Linear(hidden, hidden).to(device)
    h, w, _, t = make_inputs((tokens, hidden, vocab), torch.float32, device)

    def step(x, weight, target):
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return fused_linear_cross_entropy(y.view(3, 4, hidden), weight, target.view(3, 4), chunk_tokens=5)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (step, compiled):
        x, wk = leaf(h), leaf(w)
        loss = fn(x, wk, t)
        loss.backward()
        results.append((loss, x.grad, wk.grad))
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)


@pytest.mark.parametrize("reduction,bias", [("mean", True), ("none", False)])
def test_op_contract(device, reduction, bias):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation."""
    h, w, b, t = make_inputs((2 * 5, 8, 40), torch.float32, device, bias=bias)
    inputs = (h.view(2, 5, 8).requires_grad_(), w.requires_grad_(), t.view(2, 5))
    if bias:
        inputs += (b.requires_grad_(),)

    def fn(hidden, weight, target, bias=None):
        return fused_linear_cross_entropy(hidden, weight, target, bias, reduction=reduction,
                                          label_smoothing=0.1, chunk_tokens=4)

    backward = "fused_linear_cross_entropy_backward" if reduction == "none" else "scale_forward_gradient"
    assert_op_contract(fn, inputs, expect_ops={"fused_linear_cross_entropy_forward", backward})


# ----------------------------------------- class weights, token scaling, token metrics (issue 20)


def rounded_logits(h, w, b=None):
    """float64 leaves and the head's logits rounded to the input dtype, as the eager head gives them."""
    h64 = h.detach().to(torch.float64).requires_grad_(True)
    w64 = w.detach().to(torch.float64).requires_grad_(True)
    b64 = b.detach().to(torch.float64).requires_grad_(True) if b is not None else None
    logits = h64.reshape(-1, h.shape[-1]) @ w64.T
    if b64 is not None:
        logits = logits + b64
    return rounded(logits, h.dtype), (h64, w64, b64)


def check_extended(h, w, b, target, reduction="mean", chunk_tokens=CHUNK, ce_weight=None,
                   use_token_scaling=False, **options):
    """Loss and gradients with class weights and/or token scaling against :func:`loss_reference`."""
    dtype = h.dtype
    hk, wk = leaf(h), leaf(w)
    bk = leaf(b) if b is not None else None
    loss = fused_linear_cross_entropy(hk, wk, target, bk, reduction=reduction, chunk_tokens=chunk_tokens,
                                      ce_weight=ce_weight, use_token_scaling=use_token_scaling, **options)
    logits, (h64, w64, b64) = rounded_logits(h, w, b)
    ref = loss_reference(logits, target.reshape(-1), reduction, ce_weight, token_scaling=use_token_scaling,
                         **options)
    ref = ref.view(target.shape) if reduction == "none" else ref
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close(loss, ref, dtype, "loss")
    dy = randn(*ref.shape, device=h.device) if ref.dim() else torch.tensor(0.75, device=h.device)
    loss.backward(dy)
    ref.backward(dy.to(torch.float64))
    assert_close(hk.grad, h64.grad, dtype, "dhidden")
    assert_close(wk.grad, w64.grad, dtype, "dweight")
    if b is not None:
        assert_close(bk.grad, b64.grad, dtype, "dbias")


def confident_inputs(shape, dtype, device, bias=False):
    """Inputs whose logits are sharp enough that the target's probability (token scaling's factor)
    is far from 0 on some tokens, and about half the targets are the argmax (accuracy near 1/2)."""
    h, w, b, _ = make_inputs(shape, dtype, device, bias=bias)
    w = (w.float() * 3).to(dtype)
    logits, _ = rounded_logits(h, w, b)
    return h, w, b, targets_from(logits)


def targets_from(logits64):
    """About half the targets the argmax of ``logits64``, every fourth ignored."""
    target = torch.randint(0, logits64.shape[-1], (logits64.shape[0],), device=logits64.device)
    target[::2] = logits64[::2].argmax(dim=-1)
    target[::4] = IGNORE
    return target


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_class_weights(profile, device, dtype, reduction):
    h, w, b, t = make_inputs(BASE, dtype, device, bias=True)
    ce_weight = class_weights(BASE[2], device)
    check_extended(h, w, b, t, reduction, ce_weight=ce_weight)
    check_extended(h, w, b, t, reduction, ce_weight=ce_weight, **OPTIONS["all"])


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_token_scaling(profile, device, dtype, reduction):
    h, w, b, t = confident_inputs(BASE, dtype, device, bias=True)
    check_extended(h, w, b, t, reduction, use_token_scaling=True)
    check_extended(h, w, b, t, reduction, use_token_scaling=True, ce_weight=class_weights(BASE[2], device),
                   **OPTIONS["all"])


def test_token_scaling_is_not_the_plain_loss(device):
    """Guards the test above: scaled and plain losses differ by far more than the tolerance."""
    h, w, _, t = confident_inputs(BASE, torch.float32, device)
    plain = fused_linear_cross_entropy(h, w, t, chunk_tokens=CHUNK)
    scaled = fused_linear_cross_entropy(h, w, t, chunk_tokens=CHUNK, use_token_scaling=True)
    assert 0 < scaled < 0.9 * plain


def test_class_weights_and_token_scaling_column_tiled(device, onchip_bytes):
    forced = onchip_bytes(16384)
    assert op.plan(SHAPES[1], torch.bfloat16, forced)["cross_entropy"].col_tiles > 1
    h, w, b, t = confident_inputs(SHAPES[1], torch.bfloat16, device, bias=True)
    ce_weight = class_weights(SHAPES[1][2], device)
    for reduction in ("mean", "none"):
        check_extended(h, w, b, t, reduction, ce_weight=ce_weight, use_token_scaling=True, **OPTIONS["all"])


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_token_accuracy_and_predicted_tokens(profile, device, dtype, reduction):
    """The metrics come from the chunks' logits (never a full logits tensor) and match the argmax
    of the logits the eager head computes; the loss is the one without them."""
    h, w, b, t = confident_inputs(BASE, dtype, device, bias=True)
    hk = leaf(h)
    out = fused_linear_cross_entropy(hk, w, t, b, reduction=reduction, chunk_tokens=CHUNK, softcap=30.0,
                                     return_token_accuracy=True, return_predicted_tokens=True)
    logits = torch.addmm(b, h, w.T).double()  # the head's matmul in the input dtype
    predicted, accuracy = expected_metrics(30.0 * torch.tanh(logits / 30.0), t, reduction)
    assert torch.equal(out.predicted_tokens, predicted)
    torch.testing.assert_close(out.token_accuracy, accuracy, rtol=0, atol=1e-6)
    assert 0.2 < accuracy.mean() < 1.0
    plain = fused_linear_cross_entropy(h, w, t, b, reduction=reduction, chunk_tokens=CHUNK, softcap=30.0)
    torch.testing.assert_close(out.loss, plain)  # to the rounding of the metrics' wider tile on a GPU
    out.loss.sum().backward()
    assert torch.isfinite(hk.grad).all()


def test_options_every_token_ignored_and_empty(device):
    """Class weights and token scaling over no target: torch's NaN mean, 0 sum, zero gradients;
    predicted tokens -1, accuracy NaN as a fraction."""
    vocab = 50
    ce_weight = class_weights(vocab, device)
    for n in (6, 0):
        h, w = randn(n, 16, device=device), randn(vocab, 16, device=device)
        t = torch.full((n,), IGNORE, device=device)
        for reduction in ("mean", "sum", "none"):
            hk, wk, hr, wr = leaf(h), leaf(w), leaf(h), leaf(w)
            out = fused_linear_cross_entropy(hk, wk, t, reduction=reduction, ce_weight=ce_weight,
                                             use_token_scaling=True, return_token_accuracy=True,
                                             return_predicted_tokens=True, chunk_tokens=4)
            expected = torch.nn.functional.cross_entropy(hr @ wr.T, t, weight=ce_weight, reduction=reduction)
            torch.testing.assert_close(out.loss, expected, equal_nan=True)
            assert torch.equal(out.predicted_tokens, torch.full((n,), -1, device=device))
            assert out.token_accuracy.isnan().all() if reduction != "none" else not out.token_accuracy.any()
            out.loss.sum().backward()
            expected.sum().backward()
            assert torch.equal(hk.grad, hr.grad) and torch.equal(wk.grad, wr.grad)


def test_autocast_keeps_class_weights(device):
    """Under autocast the head runs in bf16; the class weights stay as given (fp32)."""
    h, w, _, t = make_inputs(BASE, torch.float32, device)
    ce_weight = class_weights(BASE[2], device) + 1e-3  # not representable in bf16
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(h, w, t, chunk_tokens=CHUNK, ce_weight=ce_weight)
    logits, _ = rounded_logits(h.to(torch.bfloat16), w.to(torch.bfloat16))
    assert_close(loss, loss_reference(logits, t, "mean", ce_weight), torch.bfloat16, "loss")


def test_bad_extended_options(device):
    h, w, _, t = make_inputs((8, 16, 50), torch.float32, device)
    f = fused_linear_cross_entropy
    with pytest.raises(ValueError, match=r"ce_weight must have shape \(50,\)"):
        f(h, w, t, ce_weight=torch.ones(16, device=device))
    with pytest.raises(TypeError, match="ce_weight must have a floating dtype"):
        f(h, w, t, ce_weight=torch.ones(50, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="ce_weight takes no gradient"):
        f(h, w, t, ce_weight=torch.ones(50, device=device, requires_grad=True))
    with pytest.raises(TypeError, match="use_token_scaling must be a bool"):
        f(h, w, t, use_token_scaling=1)
    with pytest.raises(TypeError, match="return_token_accuracy must be a bool"):
        f(h, w, t, return_token_accuracy=None)
    with pytest.raises(TypeError, match="return_predicted_tokens must be a bool"):
        f(h, w, t, return_predicted_tokens=0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_op_contract_with_extended_options(device, reduction):
    h, w, b, t = make_inputs((2 * 5, 8, 40), torch.float32, device, bias=True)
    inputs = (h.view(2, 5, 8).requires_grad_(), w.requires_grad_(), t.view(2, 5), b.requires_grad_(),
              class_weights(40, device))

    def fn(hidden, weight, target, bias, ce_weight):
        return fused_linear_cross_entropy(hidden, weight, target, bias, reduction=reduction,
                                          label_smoothing=0.1, lse_square_scale=1e-3, chunk_tokens=4,
                                          ce_weight=ce_weight, use_token_scaling=True, return_z_loss=True,
                                          return_token_accuracy=True, return_predicted_tokens=True)

    backward = "fused_linear_cross_entropy_backward" if reduction == "none" else "scale_forward_gradient"
    assert_op_contract(fn, inputs, expect_ops={"fused_linear_cross_entropy_forward", backward})


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp16_under_a_loss_scale(device, reduction):
    """fp16 under a GradScaler-style loss scale: the gradients carry the scale from the start (the
    deferred path), so they are as close to the exact ones as fp16 can hold. Computed at unit scale
    in the forward pass and rescaled afterwards, a mean over 2048 tokens left ``dhidden`` several
    times further off (its logits gradients ``p / tokens`` below fp16's normal range)."""
    tokens, hidden, vocab = 2048, 32, 256
    loss_scale = 65536.0 if reduction == "mean" else 32.0  # a sum's gradients are tokens x larger
    torch.manual_seed(0)
    h = randn(tokens, hidden, device=device).half()
    w = (randn(vocab, hidden, device=device) * 0.02).half()
    t = torch.randint(0, vocab, (tokens,), device=device)
    hk, wk = leaf(h), leaf(w)
    (fused_linear_cross_entropy(hk, wk, t, reduction=reduction) * loss_scale).backward()
    h64, w64 = leaf(h.double()), leaf(w.double())
    (torch.nn.functional.cross_entropy(h64 @ w64.T, t, reduction=reduction) * loss_scale).backward()
    assert_within_rounding(hk.grad, h64.grad, "dhidden")
    assert_within_rounding(wk.grad, w64.grad, "dweight")
