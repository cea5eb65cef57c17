"""Small calls take torch's route (``onca.ops._small_calls``): for each op that has one, the route
runs no Onca op, counts itself, and gives what Onca's kernels give (values, dtypes, shapes and
gradients, to rounding); options torch's op does not compute, mixed dtypes, calls above the limit
and traced calls keep Onca's op.

The route is for CUDA; here it is allowed on the test device so that the CPU checks it too (its
results are torch's on any device). Every other test runs with the route off (``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import onca
from onca.ops import _small_calls as small_calls
from onca.ops._contract import Op
from onca.ops.cross_entropy import cross_entropy
from onca.ops.dyt import dyt
from onca.ops.embedding import embedding
from onca.ops._chunked_head import chunked_logprobs
from onca.ops.fused_linear_cpo import fused_linear_cpo
from onca.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from onca.ops.fused_linear_distill import fused_linear_distill
from onca.ops.fused_linear_dpo import fused_linear_dpo
from onca.ops.fused_linear_grpo import fused_linear_grpo
from onca.ops.fused_linear_kto import fused_linear_kto
from onca.ops.fused_linear_logprobs import fused_linear_logprobs
from onca.ops.fused_linear_orpo import fused_linear_orpo
from onca.ops.fused_linear_scaled_cross_entropy import fused_linear_scaled_cross_entropy
from onca.ops.fused_linear_simpo import fused_linear_simpo
from onca.ops.geglu import geglu
from onca.ops.group_norm import group_norm
from onca.ops.kl_div import kl_div
from onca.ops.layer_norm import layer_norm
from onca.ops.multi_token_attention import SMALL_CALL_WEIGHT, multi_token_attention
from onca.ops.neighborhood_attention import neighborhood_attention
from onca.ops.relu_squared import relu_squared
from onca.ops.softmax import softmax
from onca.ops.swiglu import swiglu
from onca.ops.tiled_mlp import tiled_mlp
from onca.ops.tvd import tvd
from tests.helpers import assert_close

F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture
def route(monkeypatch, device):
    """Torch's route on, at its default limit, on the test device."""
    monkeypatch.setattr(small_calls, "DEVICE_TYPES", (device,))
    previous = small_calls.set_limit(small_calls.DEFAULT_LIMIT)
    yield
    small_calls.set_limit(previous)


@pytest.fixture
def onca_ops(monkeypatch):
    """The names of the Onca ops called, in order."""
    calls = []
    call = Op.__call__

    def counted(self, *args):
        calls.append(self.name)
        return call(self, *args)

    monkeypatch.setattr(Op, "__call__", counted)
    return calls


def _tensor(shape, dtype, device, grad=True, scale=1.0, positive=False):
    t = torch.randn(shape, dtype=F32) * scale
    if positive:
        t = t.abs() + 0.5
    return t.to(device=device, dtype=dtype).requires_grad_(grad and dtype.is_floating_point)


def _probs(shape, dtype, device, grad=True):
    """Rows of probabilities (softmax of random logits) in ``dtype``."""
    p = torch.softmax(torch.randn(shape, dtype=F32) * 2, -1).to(device=device, dtype=dtype)
    return p.requires_grad_(grad)


def _labels(shape, vocab, device, ignored=2):
    target = torch.randint(0, vocab, shape)
    target.view(-1)[:ignored] = -100
    return target.to(device)


@contextlib.contextmanager
def _no_host_sync(device):
    """On CUDA, any host synchronisation inside is an error (torch's route keeps the op contract)."""
    if device != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _float_inputs(inputs):
    return [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]


def _run(call, inputs):
    """The output and the gradients of every input that takes one (for a fixed random incoming
    gradient), on fresh leaves so the two routes start equal."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
              for t in inputs]
    out = call(*leaves)
    torch.manual_seed(1)
    grad = torch.randn(out.shape, dtype=F32, device=out.device).to(out.dtype)  # no copy from the host
    out.backward(grad)
    return out, [t.grad for t in _float_inputs(leaves)]


# name -> (inputs(device), call): each a call whose options torch's op computes.
def _cases():
    vocab = 40
    return {
        "layer_norm": (lambda d: [_tensor((3, 5, 48), F32, d), _tensor(48, F32, d, positive=True),
                                  _tensor(48, F32, d)], lambda x, w, b: layer_norm(x, w, b, 1e-5)),
        "layer_norm_bf16_no_bias": (lambda d: [_tensor((6, 64), BF16, d), _tensor(64, BF16, d, positive=True)],
                                    lambda x, w: layer_norm(x, w)),
        "softmax_middle_dim": (lambda d: [_tensor((4, 6, 10), F32, d, scale=3.0)], lambda x: softmax(x, 1)),
        "relu_squared": (lambda d: [_tensor((7, 33), BF16, d)], relu_squared),
        "swiglu": (lambda d: [_tensor((5, 64), BF16, d), _tensor((5, 64), BF16, d)], swiglu),
        "swiglu_fused_halves": (lambda d: [_tensor((2, 3, 96), F32, d)], lambda a: swiglu(a)),
        "swiglu_overwrite_inputs": (lambda d: [_tensor((5, 64), F32, d), _tensor((5, 64), F32, d)],
                                    lambda a, b: swiglu(a, b, overwrite_inputs=True)),
        "geglu_tanh": (lambda d: [_tensor((5, 64), F32, d), _tensor((5, 64), F32, d)], geglu),
        "geglu_erf": (lambda d: [_tensor((5, 64), F32, d), _tensor((5, 64), F32, d)],
                      lambda a, b: geglu(a, b, approximate="none")),
        "dyt_scalar_alpha": (lambda d: [_tensor((4, 32), F32, d), _tensor((), F32, d, positive=True),
                                        _tensor(32, F32, d), _tensor(32, F32, d)], dyt),
        "dyt_channel_alpha_no_bias": (lambda d: [_tensor((4, 32), F32, d), _tensor(32, F32, d, positive=True),
                                                 _tensor(32, F32, d)], dyt),
        "group_norm": (lambda d: [_tensor((2, 8, 5), F32, d), _tensor(8, F32, d), _tensor(8, F32, d)],
                       lambda x, w, b: group_norm(x, 4, w, b, 1e-5)),
        # One element a group: torch.nn.functional's wrapper refuses it (a size check written for
        # batch norm); ATen and Onca's kernels compute y = bias, and the route calls ATen. eps 0.5:
        # CUDA's ATen computes x * rstd * w + (b - mean * rstd * w), whose rounding grows with rstd
        # (5e-5 at eps 1e-5 on an H200, where Onca's kernel gives exactly b).
        "group_norm_one_element_groups": (
            lambda d: [_tensor((1, 6), F32, d), _tensor(6, F32, d), _tensor(6, F32, d)],
            lambda x, w, b: group_norm(x, 6, w, b, 0.5)),
        "kl_div_batchmean": (lambda d: [torch.log_softmax(torch.randn(6, vocab), -1).to(d).requires_grad_(),
                                        torch.softmax(torch.randn(6, vocab), -1).to(d)],
                             lambda i, t: kl_div(i, t, "batchmean")),
        "kl_div_none_log_target": (lambda d: [torch.log_softmax(torch.randn(2, 3, vocab), -1).to(d).requires_grad_(),
                                              torch.log_softmax(torch.randn(2, 3, vocab), -1).to(d)],
                                   lambda i, t: kl_div(i, t, "none", log_target=True)),
        "embedding_padding": (lambda d: [torch.randint(0, 20, (3, 7)).to(d), _tensor((20, 16), F32, d)],
                              lambda i, w: embedding(i, w, padding_idx=-1)),
        "cross_entropy": (lambda d: [_tensor((9, vocab), F32, d, scale=2.0), _labels((9,), vocab, d)],
                          cross_entropy),
        "cross_entropy_bf16_none": (lambda d: [_tensor((2, 5, vocab), BF16, d, scale=2.0),
                                               _labels((2, 5), vocab, d)],
                                    lambda x, t: cross_entropy(x, t, reduction="none")),
        "cross_entropy_smoothed": (
            lambda d: [_tensor((9, vocab), F32, d, scale=2.0), _labels((9,), vocab, d)],
            lambda x, t: cross_entropy(x, t, label_smoothing=0.1)),
        "cross_entropy_weighted_sum": (
            lambda d: [_tensor((9, vocab), F32, d, scale=2.0), _labels((9,), vocab, d),
                       _tensor(vocab, F32, d, grad=False, positive=True)],
            lambda x, t, w: cross_entropy(x, t, weight=w, reduction="sum")),
        "cross_entropy_bf16_class_weights": (
            lambda d: [_tensor((9, vocab), BF16, d, scale=2.0), _labels((9,), vocab, d),
                       _tensor(vocab, BF16, d, grad=False, positive=True)],
            lambda x, t, w: cross_entropy(x, t, weight=w)),
        "cross_entropy_overwrite_logits": (
            lambda d: [_tensor((9, vocab), F32, d, scale=2.0), _labels((9,), vocab, d)],
            lambda x, t: cross_entropy(x, t, overwrite_logits=True)),
        "tvd_batchmean_ignored_tokens": (
            lambda d: [_probs((3, 4, vocab), F32, d), _probs((3, 4, vocab), F32, d, grad=False),
                       _labels((3, 4), vocab, d)],
            lambda p, q, y: tvd(p, q, y, reduction="batchmean")),
        "tvd_mean_both_gradients_bf16": (
            lambda d: [_probs((6, vocab), BF16, d), _probs((6, vocab), BF16, d), _labels((6,), vocab, d)],
            lambda p, q, y: tvd(p, q, y)),
        "tvd_sum_ties": (  # the first two rows equal: the gradient is 0 there on both routes
            lambda d: [_probs((4, vocab), F32, d), _probs((2, vocab), F32, d, grad=False)],
            lambda p, q: tvd(p, torch.cat((p[:2].detach(), q)), reduction="sum")),
        "tvd_none": (lambda d: [_probs((2, 3, vocab), F32, d), _probs((2, 3, vocab), F32, d, grad=False)],
                     lambda p, q: tvd(p, q, reduction="none")),
        "tvd_mean_every_token_ignored": (  # 0 and no gradient on both routes
            lambda d: [_probs((5, vocab), F32, d), _probs((5, vocab), F32, d, grad=False),
                       torch.full((5,), -100, device=d)],
            lambda p, q, y: tvd(p, q, y)),
        "tvd_mean_no_labels": (lambda d: [_probs((5, vocab), F32, d), _probs((5, vocab), F32, d, grad=False)],
                               lambda p, q: tvd(p, q)),
        "multi_token_attention": (
            lambda d: [_tensor((2, 4, 9, 9), F32, d, scale=2.0), _tensor((4, 4, 3, 3), F32, d, scale=0.3),
                       _tensor(4, F32, d)],
            lambda s, w, b: multi_token_attention(s, w, b, padding=1)),
        "multi_token_attention_bf16_strided_groups": (
            lambda d: [_tensor((1, 4, 11, 11), BF16, d, scale=2.0), _tensor((6, 2, 3, 2), BF16, d, scale=0.3)],
            lambda s, w: multi_token_attention(s, w, stride=(2, 1), padding=(2, 1), dilation=(1, 2), groups=2)),
        "neighborhood_attention": (
            lambda d: [_tensor((2, 3, 13, 16), F32, d), _tensor((2, 3, 13, 16), F32, d),
                       _tensor((2, 3, 13, 16), F32, d)],
            neighborhood_attention),
        "neighborhood_attention_bf16_dilated_scaled_strided": (
            lambda d: [_tensor((1, 9, 2, 32), BF16, d).transpose(1, 2) for _ in range(3)],
            lambda q, k, v: neighborhood_attention(q, k, v, kernel_size=4, dilation=2, scale=0.3)),
        "tiled_mlp": (
            lambda d: [_tensor((2, 5, 32), F32, d), _tensor((48, 32), F32, d, scale=0.2),
                       _tensor((48, 32), F32, d, scale=0.2), _tensor((24, 48), F32, d, scale=0.2)],
            tiled_mlp),
        "tiled_mlp_geglu_three_shards": (
            lambda d: [_tensor((7, 32), F32, d), _tensor((40, 32), F32, d, scale=0.3),
                       _tensor((40, 32), F32, d, scale=0.3), _tensor((32, 40), F32, d, scale=0.3)],
            lambda x, g, u, w: tiled_mlp(x, g, u, w, "geglu", num_shards=3)),
        "tiled_mlp_bf16": (
            lambda d: [_tensor((3, 4, 32), BF16, d), _tensor((40, 32), BF16, d, scale=0.2),
                       _tensor((40, 32), BF16, d, scale=0.2), _tensor((32, 40), BF16, d, scale=0.2)],
            tiled_mlp),
        "tiled_mlp_exact_gelu": (
            lambda d: [_tensor((6, 16), F32, d), _tensor((24, 16), F32, d, scale=0.3),
                       _tensor((24, 16), F32, d, scale=0.3), _tensor((16, 24), F32, d, scale=0.3)],
            lambda x, g, u, w: tiled_mlp(x, g, u, w, "gelu")),
        "fused_linear_cross_entropy": (
            lambda d: [_tensor((2, 4, 32), F32, d), _tensor((vocab, 32), F32, d, scale=0.2),
                       _labels((2, 4), vocab, d)],
            lambda h, w, t: fused_linear_cross_entropy(h, w, t)),
        "fused_linear_cross_entropy_bias_sum": (
            lambda d: [_tensor((8, 32), F32, d), _tensor((vocab, 32), F32, d, scale=0.2),
                       _labels((8,), vocab, d), _tensor(vocab, F32, d)],
            lambda h, w, t, b: fused_linear_cross_entropy(h, w, t, b, reduction="sum", label_smoothing=0.05)),
        "fused_linear_cross_entropy_none_weighted": (
            lambda d: [_tensor((8, 32), BF16, d), _tensor((vocab, 32), BF16, d, scale=0.2),
                       _labels((8,), vocab, d), _tensor(vocab, BF16, d, grad=False, positive=True)],
            lambda h, w, t, cw: fused_linear_cross_entropy(h, w, t, reduction="none", ce_weight=cw)),
    }


CASES = _cases()


def _assert_routes_agree(name, case, device, onca_ops, routed_calls=1):
    """The call of ``case`` takes torch's route (no Onca op; ``routed_calls`` counted, or at least
    one where None) without a host synchronisation, and gives what Onca's ops give with the route
    off: values, dtypes, shapes and every gradient."""
    make, call = case
    inputs = make(device)
    taken = small_calls.taken
    with _no_host_sync(device):
        out, grads = _run(call, inputs)
    assert onca_ops == [], f"{name}: the small call ran Onca ops {onca_ops}"
    assert small_calls.taken - taken == routed_calls if routed_calls else small_calls.taken > taken

    small_calls.set_limit(0)
    expected, expected_grads = _run(call, inputs)
    assert onca_ops, f"{name}: with the route off no Onca op ran"
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert_close(out, expected, out.dtype)
    assert len(grads) == len(expected_grads) > 0
    for grad, want in zip(grads, expected_grads):
        assert grad.dtype == want.dtype and grad.shape == want.shape
        assert_close(grad, want, grad.dtype)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_small_call_is_torchs_and_agrees_with_the_kernels(name, device, route, onca_ops):
    _assert_routes_agree(name, CASES[name], device, onca_ops)


# The heads of the post-training losses (onca.ops._chunked_head.torch_logprobs): name -> (inputs,
# call). Sequences (2B, T) of a small head; a whole sequence ignored in one of them (the token
# counts and the lengths' clamps on both routes).
def _head_inputs(d, dtype=F32, sequences=4, seq=6, hidden=16, vocab=24):
    labels = _labels((sequences, seq), vocab, d)
    labels[-1] = -100
    head = _tensor((vocab, hidden), dtype, d, scale=0.5)
    return [_tensor((sequences, seq, hidden), dtype, d), head, labels]


def _ref_inputs(d, dtype=F32):
    return _head_inputs(d, dtype) + [_tensor((4, 6, 16), dtype, d, grad=False),
                                     _tensor((24, 16), dtype, d, grad=False, scale=0.5)]


def _stacked(out):
    """fused_linear_logprobs' outputs as one tensor: log-probabilities, entropies, then the detached
    statistics asked for (their values compared; the top-1 flags as 0/1)."""
    return torch.stack([t.to(out.log_probs.dtype) for t in out if t is not None])


def _teacher_inputs(d, dtype=F32):
    """A student head's inputs, then a teacher's of another width (no gradients) over its tokens."""
    return _head_inputs(d, dtype) + [_tensor((4, 6, 12), dtype, d, grad=False),
                                     _tensor((24, 12), dtype, d, grad=False, scale=0.5)]


def _distill(divergence, **kw):
    """A distillation call of ``divergence``: the loss, then its soft and hard parts (detached)."""
    def call(h, w, y, th, tw, b=None):
        loss, aux = fused_linear_distill(h, w, th, tw, y, student_bias=b, divergence=divergence,
                                         return_aux=True, **kw)
        return torch.stack((loss, aux["soft_loss"], aux["hard_loss"]))
    return call


HEAD_CASES = {
    "distill_forward_kl_hard_temperature_bias": (
        lambda d: _teacher_inputs(d) + [_tensor(24, F32, d)],
        _distill("forward_kl", temperature=1.7, weight_hard_loss=0.4, weight_soft_loss=0.6)),
    # The kernels' logits are fp32 products of the bf16 operands; torch's route rounds them to bf16,
    # as a model's own head does: the losses agree to bf16's rounding.
    "distill_reverse_kl_bf16": (
        lambda d: _teacher_inputs(d, BF16), lambda *a: _distill("reverse_kl", temperature=0.8)(*a).to(BF16)),
    "distill_jsd": (_teacher_inputs, _distill("jsd", beta=0.3, weight_hard_loss=0.5)),
    "distill_jsd_beta_0_and_1": (
        _teacher_inputs,
        lambda *a: torch.cat((_distill("jsd", beta=0.0)(*a), _distill("jsd", beta=1.0)(*a)))),
    "distill_every_token_ignored": (  # 0 and no gradient on both routes, where a mean would be NaN
        lambda d: [t.fill_(-100) if t.dtype == torch.long else t for t in _teacher_inputs(d)],
        _distill("forward_kl", weight_hard_loss=0.5)),
    "distill_cosine_no_labels": (
        _teacher_inputs, lambda h, w, y, th, tw: _distill("cosine")(h, w, None, th, tw)),
    "chunked_logprobs_temperature_bias": (
        lambda d: _head_inputs(d) + [_tensor(24, F32, d)],
        lambda h, w, y, b: torch.stack(chunked_logprobs(h, w, y, b, temperature=0.7, entropy=True))),
    "logprobs_softcap_scale_bf16": (
        lambda d: _head_inputs(d, BF16),
        lambda h, w, y: _stacked(fused_linear_logprobs(h, w, y, temperature=1.3, softcap=4.0,
                                                       logit_scale=0.5))),
    "logprobs_logit_scale_every_statistic": (
        lambda d: _head_inputs(d),
        lambda h, w, y: _stacked(fused_linear_logprobs(
            h, w, y, logit_scale=2.0, outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")))),
    "logprobs_softcap_statistics_no_entropy": (
        lambda d: _head_inputs(d),
        lambda h, w, y: _stacked(fused_linear_logprobs(h, w, y, softcap=3.0,
                                                       outputs=("mean_logits", "is_top1")))),
    # TRL's compact layout: (tokens, H) and 1-D labels, here int32 (torch's route casts them).
    "logprobs_compact_int32_labels": (
        lambda d: [t.flatten(0, 1).detach().requires_grad_(t.requires_grad) if t.dim() == 3 else
                   t.flatten().int() if t.dtype == torch.long else t for t in _head_inputs(d)],
        lambda h, w, y: _stacked(fused_linear_logprobs(h, w, y, outputs=()))),
    "scaled_cross_entropy_entropy": (
        lambda d: _head_inputs(d),
        lambda h, w, y: torch.stack(fused_linear_scaled_cross_entropy(h, w, y, 0.8, return_entropy=True))),
    "dpo_sigmoid": (_ref_inputs, lambda h, w, y, rh, rw: fused_linear_dpo(h, w, y, rh, rw, beta=0.2)),
    "dpo_ipo_bf16": (lambda d: _ref_inputs(d, BF16),
                     lambda h, w, y, rh, rw: fused_linear_dpo(h, w, y, rh, rw, loss_type="ipo",
                                                              nll_weight=0.5)),
    "dpo_robust_smoothed": (_ref_inputs, lambda h, w, y, rh, rw: fused_linear_dpo(
        h, w, y, rh, rw, loss_type="robust", label_smoothing=0.1)),
    "cpo_smoothed": (_head_inputs, lambda h, w, y: fused_linear_cpo(h, w, y, label_smoothing=0.1)),
    "cpo_ipo": (_head_inputs, lambda h, w, y: fused_linear_cpo(h, w, y, loss_type="ipo")),
    "simpo": (_head_inputs, lambda h, w, y: fused_linear_simpo(h, w, y)),
    "kto_kl_number_weighted": (
        lambda d: _ref_inputs(d) + [torch.tensor([True, False, True, False], device=d)],
        lambda h, w, y, rh, rw, good: fused_linear_kto(h, w, y, good, rh, rw, kl=0.3, desirable_weight=1.5)),
    "kto_kl_zero": (
        lambda d: _ref_inputs(d) + [torch.tensor([True, False, False, True], device=d)],
        lambda h, w, y, rh, rw, good: fused_linear_kto(h, w, y, good, rh, rw, kl=0.0)),
    "grpo_temperature": (
        lambda d: _head_inputs(d) + [_tensor(4, F32, d, grad=False)],
        lambda h, w, y, adv: fused_linear_grpo(h, w, y, adv, temperature=0.9)),
}


@pytest.mark.parametrize("name", sorted(HEAD_CASES))
def test_a_small_head_is_torchs_and_agrees_with_the_chunk_driver(name, device, route, onca_ops):
    # Counted once per head: the policy's, and the reference model's where there is one.
    _assert_routes_agree(name, HEAD_CASES[name], device, onca_ops, routed_calls=None)


def test_orpo_keeps_its_pair_aligned_op_at_small_sizes(device, route, onca_ops):
    fused_linear_orpo(*_head_inputs(device)).backward()
    assert onca_ops == ["paired_loss_forward"]
    onca_ops.clear()
    fused_linear_dpo(*_ref_inputs(device)).backward()  # another paired loss takes torch's route
    assert onca_ops == []


def test_a_small_heads_top1_flags_are_the_kernels(device, route):
    h, w, y = _head_inputs(device)
    with torch.no_grad():
        best = (h @ w.T).argmax(-1)
    y = torch.where(torch.arange(y.shape[1], device=device) % 2 == 0, best, y)  # every other label the top-1
    y[-1] = -100
    routed = fused_linear_logprobs(h, w, y, outputs=("is_top1",)).is_top1
    small_calls.set_limit(0)
    kernels = fused_linear_logprobs(h, w, y, outputs=("is_top1",)).is_top1
    assert routed.dtype == torch.bool and torch.equal(routed, kernels)
    assert 9 <= int(routed.sum()) < 24


def test_a_small_heads_top1_flags_are_false_where_a_class_is_the_ignore_index(device, route):
    """An ignore_index inside the vocabulary: a position whose label is it (and its top-1) is not
    scored, so its flag is False on both routes (torch's route skips the mask for -100 only)."""
    h, w, _ = _head_inputs(device)
    with torch.no_grad():
        best = (h @ w.T).argmax(-1)
    ignored = int(best[0, 0])
    y = best.clone()  # every label the top-1; those equal to `ignored` not scored
    routed = fused_linear_logprobs(h, w, y, outputs=("is_top1",), ignore_index=ignored).is_top1
    small_calls.set_limit(0)
    kernels = fused_linear_logprobs(h, w, y, outputs=("is_top1",), ignore_index=ignored).is_top1
    assert torch.equal(routed, kernels) and torch.equal(routed, best != ignored)


def test_a_head_above_the_limit_keeps_oncas_op(device, route, onca_ops):
    h, w, y = _head_inputs(device)  # 24 tokens x 24 columns of logits
    small_calls.set_limit(24 * 24)
    chunked_logprobs(h, w, y)
    assert onca_ops == []
    small_calls.set_limit(24 * 24 - 1)
    chunked_logprobs(h, w, y)
    assert onca_ops == ["chunked_logprob_forward"]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_is_fp32_on_both_routes(device, route, onca_ops, reduction):
    """bf16 logits: the loss is fp32 on torch's route as from the kernels (never rounded to bf16),
    with the kernels' values; its gradient has the logits' dtype."""
    logits = _tensor((2, 5, 24), BF16, device)
    target = _labels((2, 5), 24, device)
    losses, grads = [], []
    for limit in (small_calls.DEFAULT_LIMIT, 0):  # torch's route, then the kernels
        small_calls.set_limit(limit)
        x = logits.detach().clone().requires_grad_(True)
        loss = cross_entropy(x, target, reduction=reduction)
        loss.sum().backward()
        losses.append(loss)
        grads.append(x.grad)
    assert onca_ops == ["cross_entropy_forward", "cross_entropy_backward"]  # the kernels' call only
    for loss in losses:
        assert loss.dtype == torch.float32 and loss.shape == ((2, 5) if reduction == "none" else ())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    assert grads[0].dtype == grads[1].dtype == BF16
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-2, atol=2e-3)


def test_overwrite_inputs_on_torchs_route_leaves_the_inputs(device, route):
    a, b = _tensor((5, 64), F32, device), _tensor((5, 64), F32, device)
    a0, b0 = a.detach().clone(), b.detach().clone()
    swiglu(a, b, overwrite_inputs=True).sum().backward()
    assert torch.equal(a.detach(), a0) and torch.equal(b.detach(), b0)


# Calls torch's op does not compute as Onca's does: they stay Onca's at any size.
KEPT = {
    "layer_norm_mixed_dtypes": lambda d: layer_norm(_tensor((4, 32), BF16, d), _tensor(32, F32, d)),
    "dyt_mixed_dtypes": lambda d: dyt(_tensor((4, 32), BF16, d), _tensor((), F32, d), _tensor(32, F32, d)),
    "group_norm_mixed_dtypes": lambda d: group_norm(_tensor((2, 8, 5), BF16, d), 4, _tensor(8, F32, d)),
    "swiglu_gate_multiplier": lambda d: swiglu(_tensor((5, 64), F32, d), _tensor((5, 64), F32, d),
                                               gate_multiplier=2.0),
    "kl_div_target_gradient": lambda d: kl_div(torch.log_softmax(torch.randn(4, 8), -1).to(d),
                                               torch.softmax(torch.randn(4, 8), -1).to(d).requires_grad_()),
    "embedding_deterministic": lambda d: embedding(torch.randint(0, 5, (6,)).to(d), _tensor((5, 8), F32, d),
                                                   deterministic=True),
    "embedding_scale_grad_by_freq": lambda d: embedding(torch.randint(0, 5, (12,)).to(d),
                                                        _tensor((5, 16), F32, d), scale_grad_by_freq=True),
    "embedding_many_indices": lambda d: embedding(torch.randint(0, 5, (3073,)).to(d),
                                                  _tensor((5, 4), F32, d)),
    "embedding_check_bounds": lambda d: embedding(torch.randint(0, 5, (6,)).to(d), _tensor((5, 8), F32, d),
                                                  check_bounds=True),
    "multi_token_attention_sparsemax": lambda d: multi_token_attention(
        _tensor((1, 2, 6, 6), F32, d), _tensor((2, 2, 3, 3), F32, d), padding=1, sparse=True),
    "cross_entropy_softcap": lambda d: cross_entropy(_tensor((4, 16), F32, d), _labels((4,), 16, d, 0),
                                                     softcap=30.0),
    "cross_entropy_z_loss": lambda d: cross_entropy(_tensor((4, 16), F32, d), _labels((4,), 16, d, 0),
                                                    lse_square_scale=1e-4),
    # torch's label smoothing with class weights reads a count on the host (its mean's masked_select)
    "cross_entropy_smoothed_weighted": lambda d: cross_entropy(
        _tensor((4, 16), F32, d), _labels((4,), 16, d, 0), label_smoothing=0.1,
        weight=_tensor(16, F32, d, grad=False)),
    "fused_linear_cross_entropy_smoothed_weighted": lambda d: fused_linear_cross_entropy(
        _tensor((4, 8), F32, d), _tensor((16, 8), F32, d), _labels((4,), 16, d, 0), label_smoothing=0.1,
        ce_weight=_tensor(16, F32, d, grad=False, positive=True)),
    "cross_entropy_accuracy": lambda d: cross_entropy(_tensor((4, 16), F32, d), _labels((4,), 16, d, 0),
                                                      return_token_accuracy=True).loss,
    "fused_linear_cross_entropy_token_scaling": lambda d: fused_linear_cross_entropy(
        _tensor((4, 8), F32, d), _tensor((16, 8), F32, d), _labels((4,), 16, d, 0), use_token_scaling=True),
}


@pytest.mark.parametrize("name", sorted(KEPT))
def test_options_torch_does_not_compute_keep_oncas_op(name, device, route, onca_ops):
    taken = small_calls.taken
    KEPT[name](device)
    assert onca_ops, f"{name} took torch's route"
    assert small_calls.taken == taken


def test_a_call_above_the_limit_keeps_oncas_op(device, route, onca_ops):
    x = _tensor((4, 32), F32, device)
    small_calls.set_limit(4 * 32)
    layer_norm(x)
    assert onca_ops == []
    small_calls.set_limit(4 * 32 - 1)
    layer_norm(x)
    assert onca_ops == ["layer_norm_forward"]


def test_multi_token_attention_counts_its_output_when_larger(device, route, onca_ops):
    # 2 channels in, 8 out: the output (288 elements) is the largest tensor, not the scores (72),
    # each element counted SMALL_CALL_WEIGHT times.
    scores, weight = _tensor((1, 2, 6, 6), F32, device), _tensor((8, 2, 3, 3), F32, device)
    small_calls.set_limit(8 * 36 * SMALL_CALL_WEIGHT)
    multi_token_attention(scores, weight, padding=1)
    assert onca_ops == []
    small_calls.set_limit(8 * 36 * SMALL_CALL_WEIGHT - 1)
    multi_token_attention(scores, weight, padding=1)
    assert onca_ops == ["multi_token_attention_forward"]


def test_embedding_counts_its_table_when_it_takes_a_gradient(device, route, onca_ops):
    # 3 tokens of 8 columns (24 output elements) from a 50-row table (400): with a weight gradient
    # the table-sized fill is the call's work; without one, the output is the largest tensor.
    idx = torch.randint(0, 50, (3,)).to(device)
    table = _tensor((50, 8), F32, device)
    small_calls.set_limit(399)
    embedding(idx, table)
    assert onca_ops == ["embedding_forward"]
    onca_ops.clear()
    embedding(idx, table.detach())
    assert onca_ops == []
    with torch.no_grad():  # no backward, no fill
        embedding(idx, table)
    assert onca_ops == []
    small_calls.set_limit(400)
    embedding(idx, table)
    assert onca_ops == []


@pytest.mark.parametrize("name", ["layer_norm", "softmax_middle_dim", "cross_entropy", "kl_div_batchmean"])
def test_a_call_under_autocast_keeps_oncas_op(name, device, route, onca_ops):
    # autocast runs these torch ops in fp32 and returns fp32; Onca's keep the input's dtype.
    make, call = CASES[name]
    inputs = make(device)
    with torch.autocast(device_type=device, dtype=BF16):
        out = call(*inputs)
    assert onca_ops and out.dtype == inputs[0].dtype


def test_a_traced_call_keeps_oncas_op(device, route):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm

    x = _tensor((4, 32), F32, device, grad=False)
    torch.compile(lambda t: layer_norm(t), backend=backend, fullgraph=True)(x)
    assert "onca.layer_norm_forward" in graphs[0] and "aten" not in graphs[0]
    h, w, y = (t.detach() for t in _head_inputs(device))
    torch.compile(lambda *args: chunked_logprobs(*args)[0], backend=backend, fullgraph=True)(h, w, y)
    assert "onca.chunked_logprob_forward" in graphs[1] and "log_softmax" not in graphs[1]


def test_the_route_is_for_cuda_by_default():
    assert small_calls.DEVICE_TYPES == ("cuda",)
    previous = small_calls.set_limit(small_calls.DEFAULT_LIMIT)
    try:
        assert not small_calls.small(1, torch.empty(1))
        assert small_calls.small(1, torch.empty(1, device="meta")) is False
    finally:
        small_calls.set_limit(previous)


def test_the_limit_is_set_by_name_and_checked(monkeypatch):
    previous = onca.set_small_call_limit(123)
    try:
        assert onca.small_call_limit() == 123
        assert onca.set_small_call_limit(0) == 123
        for bad in (-1, 1.5, True, "8"):
            with pytest.raises(ValueError, match="elements must be an int >= 0"):
                onca.set_small_call_limit(bad)
    finally:
        onca.set_small_call_limit(previous)
    monkeypatch.setenv("ONCA_SMALL_CALL_LIMIT", "lots")
    with pytest.raises(ValueError, match="ONCA_SMALL_CALL_LIMIT must be a whole number"):
        small_calls._limit_from_environment()
    monkeypatch.setenv("ONCA_SMALL_CALL_LIMIT", "-3")
    with pytest.raises(ValueError, match="ONCA_SMALL_CALL_LIMIT must be 0"):
        small_calls._limit_from_environment()
    monkeypatch.setenv("ONCA_SMALL_CALL_LIMIT", "4096")
    assert small_calls._limit_from_environment() == 4096
    monkeypatch.delenv("ONCA_SMALL_CALL_LIMIT")
    assert small_calls._limit_from_environment() == small_calls.DEFAULT_LIMIT


def test_distillation_under_autocast_takes_torchs_route_on_its_cast_inputs(device, route, onca_ops):
    """Distillation casts its inputs to the autocast dtype before anything else (as fused linear
    cross entropy does), so a small call takes torch's route under autocast too, and agrees with
    the kernels on the same cast inputs."""
    inputs = _teacher_inputs(device)
    call = _distill("forward_kl", weight_hard_loss=0.3)
    with torch.autocast(device, dtype=BF16):
        routed, grads = _run(call, inputs)
    assert onca_ops == []
    small_calls.set_limit(0)
    with torch.autocast(device, dtype=BF16):
        kernels, want = _run(call, inputs)
    assert onca_ops and routed.dtype == kernels.dtype == F32
    assert_close(routed.to(BF16), kernels.to(BF16), BF16)
    for grad, expected in zip(grads, want):
        assert grad.dtype == expected.dtype == F32
        assert_close(grad, expected, BF16)
