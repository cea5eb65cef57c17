"""GRPO loss over given logits: the per-token policy loss of GRPO and its variants (DAPO, Dr. GRPO,
BNPO, CISPO, SAPO, LUSPO), with the KL penalty to a reference policy, as liger-kernel's
``triton_grpo_loss`` / TRL's ``GRPOTrainer`` compute it (token-level importance sampling).

For sequence ``b`` and completion position ``l`` (logits ``(B, L + 1, V)``: position ``l``
predicts ``completion_ids[b, l]``; the last position is unused), with temperature ``T``::

    logp  = log_softmax(logits[b, l] / T)[completion_ids[b, l]]
    r     = exp(logp - old_logp)                 (old_logp = logp, detached, when not given)
    A     = advantages[b]

and the per-token loss, by ``loss_type``:

- PPO clipping (``grpo``, ``dapo``, ``bnpo``, ``dr_grpo``, ``luspo``):
  ``-min(min(r, delta) * A, clamp(r, 1 - eps_low, 1 + eps_high) * A)`` (``delta``: INTELLECT-2's
  two-sided clip, off when None); clipped where ``r < 1 - eps_low`` and ``A < 0`` or
  ``r > 1 + eps_high`` and ``A > 0``;
- ``cispo``: ``-min(r, eps_high).detach() * A * logp`` (clipped where ``r > eps_high``, ``A > 0``);
- ``sapo``: ``-sigmoid(tau * (r - 1)) * 4 / tau * A`` with ``tau`` = ``sapo_temperature_pos`` for
  ``A > 0``, else ``sapo_temperature_neg`` (never clipped);

times ``vllm_is_ratio`` (per token or per sequence) when given, plus ``beta * kl`` with
``kl = exp(ref_logp - logp) - (ref_logp - logp) - 1`` (times ``r`` when
``use_bias_correction_kl``). Masked tokens (``completion_mask == 0``) have loss, kl and clip 0.
``reduce=True`` reduces as the loss type says (``grpo``/``sapo``: mean over sequences of the
per-sequence masked mean; ``bnpo``: masked mean; ``dr_grpo``: sum over ``B * max_completion_length``;
``dapo``/``cispo``: sum over ``num_items_in_batch / world_size``, or the mask's sum (summed over
processes); ``luspo``: mean of the loss times each sequence's token count).

Kernels: the forward reads each row of logits once (an online log-sum-exp over column tiles) and
writes per token the loss, kl, clip flag, the log-sum-exp and ``dloss/dlogp``; the backward reads
the row once more and writes ``dlogits = (onehot - softmax(logits / T)) * dlogp * dloss / T``.
The reductions are plain PyTorch over ``(B, L)`` values (differentiable through the per-token
loss; no host synchronisation). Saved for backward: the logits (a reference), the ids, the
per-token log-sum-exp and ``dloss/dlogp`` (fp32, ``B x L``). ``overwrite_logits=True`` (eager
only) writes the gradient over the logits, as liger-kernel's ``inplace`` does. Gradients flow to
the logits only (old/ref log-probs and advantages are constants; kl and the clip flags are
metrics, not differentiable).

The gradient is the exact derivative of the forward, as autograd gives it through TRL's
expression; with ``delta`` that differs from liger-kernel's kernel where ``r > delta`` and
``A < 0`` with ``r`` inside the clip range (the clipped term ``clamp(r) * A`` is then the smaller
and carries ``-r * A``; liger-kernel drops it).

Not here (liger-kernel has them): sequence-level importance sampling and the ``vespo`` loss type.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops._contract import custom_op, register_autograd, tracing
from onca.ops._launch import fast_launch
from onca.ops._validate import check_bool, check_float, check_index, check_number, check_same_device, check_tensor
from onca.tiling import RowPlan, plan_rows

__all__ = ["grpo_loss", "plan", "LOSS_TYPES"]

# The per-token formula of each loss type (the kernels' LOSS_TYPE): 0 PPO clip, 1 CISPO, 2 SAPO.
LOSS_TYPES = {"grpo": 0, "dapo": 0, "bnpo": 0, "dr_grpo": 0, "luspo": 0, "cispo": 1, "sapo": 2}

# Live tiles per element of a (rows x cols) tile: the logits as loaded (forward), and the
# gradient as stored (backward); fp32: the scaled logits, their exponentials, the gradient.
TILES = dict(live_tiles=2, fp32_tiles=3)
# The forward only reads its rows (an online log-sum-exp) and stores five values per token: on a
# GPU, one-warp programs of 2048-column tiles (the planner's gpu_streaming), 1.3x faster than the
# two-pass tile at every vocabulary timed (H200, bf16, 8192 rows: 0.543 against 0.732 ms at
# 128256 columns, 0.648 against 0.859 at 151936). The backward, which writes its rows, was
# fastest in the two-pass tile (1.059 ms there; 2048 columns in 4 warps 1.064, in 2 warps 1.188;
# evict-first hints on its read and store 3% slower).
FORWARD_TILES = dict(TILES, gpu_streaming=True)


@fast_launch
@triton.jit
def _grpo_forward_kernel(
    x_ptr, ids_ptr, adv_ptr, old_ptr, ref_ptr, mask_ptr, ratio_ptr,
    loss_ptr, kl_ptr, clip_ptr, lse_ptr, coef_ptr,
    n_rows, n_cols, seq_len, x_sb, x_sl, ratio_sb, ratio_sl,
    inv_t, beta, eps_low, eps_high, delta, sapo_pos, sapo_neg,
    LOSS_TYPE: tl.constexpr, HAS_OLD: tl.constexpr, HAS_KL: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_RATIO: tl.constexpr, HAS_DELTA: tl.constexpr, BIAS_KL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, COL_TILES: tl.constexpr,
):
    """Per token (row ``r`` = sequence ``r // seq_len``, position ``r % seq_len``): the loss, kl, clip
    flag, log-sum-exp of ``logits / T`` and ``dloss/dlogp`` (all fp32; 0 on masked tokens)."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        bi = rows64 // seq_len
        li = rows64 - bi * seq_len
        valid = row_mask
        if HAS_MASK:
            valid = valid & (tl.load(mask_ptr + rows64, mask=row_mask, other=0.0) != 0.0)
        y = tl.load(ids_ptr + rows64, mask=valid, other=0).to(tl.int64)
        x_rows = x_ptr + bi * x_sb + li * x_sl
        m = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
        d = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            mask = valid[:, None] & (cols < n_cols)[None, :]
            xt = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(xt, axis=1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            d = d * tl.exp(m - shift) + tl.sum(tl.exp(xt - shift[:, None]), axis=1)
            m = m_new
        lse = tl.where(valid, m + tl.log(tl.where(valid, d, 1.0)), 0.0)
        x_y = tl.load(x_rows + y, mask=valid, other=0.0).to(tl.float32) * inv_t
        logp = x_y - lse
        if HAS_OLD:
            old = tl.load(old_ptr + rows64, mask=valid, other=0.0).to(tl.float32)
        else:
            old = logp
        r = tl.exp(logp - old)
        adv = tl.load(adv_ptr + bi, mask=valid, other=0.0).to(tl.float32)
        if LOSS_TYPE == 0:
            r2 = tl.minimum(tl.maximum(r, 1.0 - eps_low), 1.0 + eps_high)
            clipped = ((r < 1.0 - eps_low) & (adv < 0.0)) | ((r > 1.0 + eps_high) & (adv > 0.0))
            r1 = r
            pass1 = r == r  # d r1 / d r is 1 (True) ...
            if HAS_DELTA:
                r1 = tl.minimum(r, delta)
                pass1 = r <= delta  # ... or 0 where the two-sided clip holds r1 at delta
            pass2 = (r >= 1.0 - eps_low) & (r <= 1.0 + eps_high)
            l1 = r1 * adv
            l2 = r2 * adv
            # -min(l1, l2): the gradient flows through the smaller; a tie splits it evenly, as
            # torch.minimum does (without delta that is the whole gradient: r2 = r1 = r there).
            w1 = tl.where(l1 < l2, 1.0, tl.where(l1 == l2, 0.5, 0.0))
            w2 = tl.where(l2 < l1, 1.0, tl.where(l1 == l2, 0.5, 0.0))
            loss = -tl.minimum(l1, l2)
            coef = -r * adv * (w1 * tl.where(pass1, 1.0, 0.0) + w2 * tl.where(pass2, 1.0, 0.0))
        elif LOSS_TYPE == 1:
            r2 = tl.minimum(r, eps_high)
            loss = -r2 * adv * logp
            coef = -r2 * adv
            clipped = (r > eps_high) & (adv > 0.0)
        else:
            tau = tl.where(adv > 0.0, sapo_pos, sapo_neg)
            s = tl.sigmoid(tau * (r - 1.0))
            loss = -s * 4.0 / tau * adv
            coef = -adv * 4.0 * s * (1.0 - s) * r
            clipped = r < 0.0  # never (r = exp(...) >= 0): SAPO does not clip
        if HAS_RATIO:
            ratio = tl.load(ratio_ptr + bi * ratio_sb + li * ratio_sl, mask=valid, other=0.0).to(tl.float32)
            loss = loss * ratio
            coef = coef * ratio
        kl = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        if HAS_KL:
            ref = tl.load(ref_ptr + rows64, mask=valid, other=0.0).to(tl.float32)
            e = tl.exp(ref - logp)
            kl = e - (ref - logp) - 1.0
            if BIAS_KL:
                coef += beta * r * (logp - ref)
                kl = kl * r
            else:
                coef += beta * (1.0 - e)
            loss += beta * kl
        tl.store(loss_ptr + rows64, tl.where(valid, loss, 0.0), mask=row_mask)
        tl.store(kl_ptr + rows64, tl.where(valid, kl, 0.0), mask=row_mask)
        tl.store(clip_ptr + rows64, tl.where(valid & clipped, 1.0, 0.0), mask=row_mask)
        tl.store(lse_ptr + rows64, lse, mask=row_mask)
        tl.store(coef_ptr + rows64, tl.where(valid, coef, 0.0), mask=row_mask)


@fast_launch
@triton.jit
def _grpo_backward_kernel(
    x_ptr, g_ptr, ids_ptr, lse_ptr, coef_ptr, dloss_ptr,
    n_rows, n_cols, seq_len, x_sb, x_sl, g_sb, g_sl, d_sb, d_sl, inv_t,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, COL_TILES: tl.constexpr,
):
    """``dlogits = (onehot(y) - softmax(x / T)) * coef * dloss / T`` per token; ``g_ptr`` may be
    ``x_ptr`` (each tile is loaded before it is stored, and no other program touches the row)."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        bi = rows64 // seq_len
        li = rows64 - bi * seq_len
        y = tl.load(ids_ptr + rows64, mask=row_mask, other=0).to(tl.int64)
        lse = tl.load(lse_ptr + rows64, mask=row_mask, other=0.0)
        coef = tl.load(coef_ptr + rows64, mask=row_mask, other=0.0)
        dloss = tl.load(dloss_ptr + bi * d_sb + li * d_sl, mask=row_mask, other=0.0).to(tl.float32)
        scale = coef * dloss * inv_t
        x_rows = x_ptr + bi * x_sb + li * x_sl
        g_rows = g_ptr + bi * g_sb + li * g_sl
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            xt = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32) * inv_t
            p = tl.exp(xt - lse[:, None])
            g = (tl.where(cols[None, :] == y[:, None], 1.0, 0.0) - p) * scale[:, None]
            g = tl.where(scale[:, None] == 0.0, 0.0, g)  # masked tokens: exactly 0
            tl.store(g_rows[:, None] + cols[None, :], g.to(g_ptr.dtype.element_ty), mask=mask)


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The plans for ``shape = (tokens, vocab)`` (tokens = batch x completion length)."""
    tokens, vocab = (int(s) for s in shape)
    return {"forward": plan_rows(tokens, vocab, dtype, profile=profile, **FORWARD_TILES),
            "backward": plan_rows(tokens, vocab, dtype, profile=profile, **TILES)}


# ------------------------------------------------------------------------------------- custom ops


def _ratio_strides(ratio: Tensor | None) -> tuple[int, int]:
    if ratio is None:
        return 0, 0
    return ratio.stride(0), (ratio.stride(1) if ratio.shape[1] > 1 else 0)


@custom_op("grpo_loss_forward")
def grpo_loss_forward(logits: Tensor, completion_ids: Tensor, advantages: Tensor, old_logp: Tensor | None,
                      ref_logp: Tensor | None, completion_mask: Tensor | None, vllm_is_ratio: Tensor | None,
                      temperature: float, beta: float, eps_low: float, eps_high: float, delta: float,
                      has_delta: bool, loss_type: int, sapo_temperature_pos: float, sapo_temperature_neg: float,
                      use_bias_correction_kl: bool, overwrite_logits: bool
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, kl, is_clipped, lse, dlogp)``, each fp32 ``(B, L)``, for ``(B, L + 1, V)`` logits with a
    unit last-dim stride and contiguous ``(B, L)`` ids/old/ref/mask (``vllm_is_ratio`` ``(B, 1 or L)``)."""
    b, l1, v = logits.shape
    seq = l1 - 1
    outs = [torch.empty((b, seq), dtype=torch.float32, device=logits.device) for _ in range(5)]
    if b * seq == 0:
        return tuple(outs)
    p = plan_rows(b * seq, v, logits.dtype, **FORWARD_TILES)
    _grpo_forward_kernel[(p.grid,)](
        logits, completion_ids, advantages,
        old_logp if old_logp is not None else logits, ref_logp if ref_logp is not None else logits,
        completion_mask if completion_mask is not None else logits,
        vllm_is_ratio if vllm_is_ratio is not None else logits,
        *outs,
        b * seq, v, seq, logits.stride(0), logits.stride(1), *_ratio_strides(vllm_is_ratio),
        1.0 / temperature, beta, eps_low, eps_high, delta, sapo_temperature_pos, sapo_temperature_neg,
        LOSS_TYPE=loss_type, HAS_OLD=old_logp is not None, HAS_KL=ref_logp is not None and beta != 0.0,
        HAS_MASK=completion_mask is not None, HAS_RATIO=vllm_is_ratio is not None, HAS_DELTA=has_delta,
        BIAS_KL=use_bias_correction_kl,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles, num_warps=p.num_warps,
    )
    return tuple(outs)


@grpo_loss_forward.register_fake
def _(logits, completion_ids, advantages, old_logp, ref_logp, completion_mask, vllm_is_ratio, temperature,
      beta, eps_low, eps_high, delta, has_delta, loss_type, sapo_temperature_pos, sapo_temperature_neg,
      use_bias_correction_kl, overwrite_logits):
    b, l1, _ = logits.shape
    return tuple(logits.new_empty((b, l1 - 1), dtype=torch.float32) for _ in range(5))


@custom_op("grpo_loss_backward")
def grpo_loss_backward(dloss: Tensor, logits: Tensor, completion_ids: Tensor, lse: Tensor, dlogp: Tensor,
                       temperature: float, overwrite_logits: bool) -> Tensor:
    """The logits' gradient ``(B, L + 1, V)`` (the unused last position: 0). With
    ``overwrite_logits`` (eager route only) it is written over ``logits``."""
    grad = logits if overwrite_logits else torch.empty_like(logits)
    b, l1, v = logits.shape
    seq = l1 - 1
    grad[:, seq:].zero_()
    if b * seq == 0:
        return grad
    p = plan_rows(b * seq, v, logits.dtype, **TILES)
    _grpo_backward_kernel[(p.grid,)](
        logits, grad, completion_ids, lse, dlogp, dloss,
        b * seq, v, seq, logits.stride(0), logits.stride(1), grad.stride(0), grad.stride(1),
        dloss.stride(0), dloss.stride(1), 1.0 / temperature,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles, num_warps=p.num_warps,
    )
    return grad


@grpo_loss_backward.register_fake
def _(dloss, logits, completion_ids, lse, dlogp, temperature, overwrite_logits):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    logits, completion_ids = inputs[:2]
    temperature, overwrite = inputs[7], inputs[-1]
    loss, kl, clipped, lse, dlogp = output
    ctx.mark_non_differentiable(kl, clipped, lse, dlogp)
    ctx.save_for_backward(logits, completion_ids, lse, dlogp)
    ctx.temperature, ctx.overwrite = temperature, overwrite


def _backward(ctx, dloss, *_):
    logits, completion_ids, lse, dlogp = ctx.saved_tensors
    if dloss is None:
        return (None,) * 18
    overwrite = ctx.overwrite and not tracing(dloss, logits)
    grad = grpo_loss_backward(dloss, logits, completion_ids, lse, dlogp, ctx.temperature, overwrite)
    return (grad,) + (None,) * 17


register_autograd(grpo_loss_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _dapo_normalizer(mask: Tensor, num_items_in_batch) -> Tensor:
    """``num_items_in_batch / world_size``, or the mask's sum over every process; at least 1."""
    world = _world_size()
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, Tensor):
            n = num_items_in_batch.to(device=mask.device, dtype=torch.float32)
        else:
            n = torch.tensor(float(num_items_in_batch), device=mask.device, dtype=torch.float32)
        return (n / world).clamp(min=1.0)
    n = mask.sum()
    if world > 1:
        n = n.clone()
        torch.distributed.all_reduce(n)
    return (n / world).clamp(min=1.0)


def _reduce(loss: Tensor, mask: Tensor, loss_type: str, max_completion_length, num_items_in_batch) -> Tensor:
    b, seq = loss.shape
    if loss_type in ("grpo", "sapo"):
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (loss * mask).sum() / (b * (max_completion_length if max_completion_length is not None else seq))
    if loss_type in ("dapo", "cispo"):
        return (loss * mask).sum() / _dapo_normalizer(mask, num_items_in_batch)
    return (loss * mask.sum(-1, keepdim=True)).mean()  # luspo


def _per_token(t, name: str, b: int, seq: int, ref: Tensor) -> Tensor | None:
    if t is None:
        return None
    check_float(t, name)
    check_same_device(t, name, ref, "logits")
    if tuple(t.shape) != (b, seq):
        raise ValueError(f"{name} must have shape (batch, completion length) = {(b, seq)}, got {tuple(t.shape)}")
    return t.contiguous()


def grpo_loss(
    logits: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    completion_ids: Tensor,
    advantages: Tensor,
    completion_mask: Tensor | None = None,
    temperature: float = 0.9,
    beta: float = 0.04,
    eps_low: float = 0.2,
    eps_high: float = 0.4,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    reduce: bool = False,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vllm_is_ratio: Tensor | None = None,
    delta: float | None = None,
    use_bias_correction_kl: bool = False,
    num_items_in_batch=None,
    overwrite_logits: bool = False,
):
    """The GRPO loss over given logits: a drop-in for liger-kernel's ``triton_grpo_loss`` (same
    arguments and defaults, token-level importance sampling; see the module docstring for the
    formulas).

    ``logits`` ``(B, L + 1, V)`` (fp32/bf16/fp16; position ``l`` predicts ``completion_ids[:, l]``),
    ``old_logp``/``ref_logp`` ``(B, L)`` or None (``ref_logp`` is needed when ``beta != 0``),
    ``completion_ids`` ``(B, L)`` integer, ``advantages`` ``(B,)``, ``completion_mask`` ``(B, L)``
    (bool, int or float; nonzero = counted) or None. ``loss_type`` is one of ``grpo``, ``dapo``,
    ``bnpo``, ``dr_grpo``, ``luspo``, ``cispo``, ``sapo``; ``eps_high`` is CISPO's raw upper bound
    for ``cispo``. ``vllm_is_ratio`` ``(B, L)``, ``(B, 1)`` or ``(B,)`` multiplies the policy loss.

    Returns, with ``reduce=False``, ``(per_token_loss, per_token_kl, is_clipped)`` (fp32 ``(B, L)``,
    masked tokens 0, ``per_token_kl`` None when ``beta == 0``); with ``reduce=True``,
    ``(loss, metrics)`` where ``metrics`` is ``[kl_mean, clip_ratio]`` (``[clip_ratio]`` when
    ``beta == 0``), masked means. Gradients flow to ``logits`` only. ``overwrite_logits=True``
    writes the logits' gradient over ``logits`` (eager only; the logits must not be used after).
    """
    check_float(logits, "logits")
    if logits.dim() != 3 or logits.shape[1] < 1:
        raise ValueError(f"logits must be 3-D (batch, completion length + 1, vocab), got shape {tuple(logits.shape)}")
    b, l1, v = logits.shape
    seq = l1 - 1
    check_index(completion_ids, "completion_ids")
    check_same_device(completion_ids, "completion_ids", logits, "logits")
    if completion_ids.dim() != 2 or completion_ids.shape[0] != b or completion_ids.shape[1] < seq:
        raise ValueError(f"completion_ids must have shape (batch={b}, completion length={seq}), "
                         f"got {tuple(completion_ids.shape)}")
    completion_ids = completion_ids[:, completion_ids.shape[1] - seq:].contiguous()
    check_float(advantages, "advantages")
    check_same_device(advantages, "advantages", logits, "logits")
    if advantages.reshape(-1).shape[0] != b or advantages.dim() > 2:
        raise ValueError(f"advantages must have shape (batch={b},) or ({b}, 1), got {tuple(advantages.shape)}")
    advantages = advantages.reshape(b).contiguous()
    old_logp = _per_token(old_logp, "old_logp", b, seq, logits)
    ref_logp = _per_token(ref_logp, "ref_logp", b, seq, logits)
    if completion_mask is not None:
        check_tensor(completion_mask, "completion_mask")
        check_same_device(completion_mask, "completion_mask", logits, "logits")
        if tuple(completion_mask.shape) != (b, seq):
            raise ValueError(f"completion_mask must have shape (batch, completion length) = {(b, seq)}, "
                             f"got {tuple(completion_mask.shape)}")
        completion_mask = completion_mask.to(torch.float32).contiguous()
    if vllm_is_ratio is not None:
        check_float(vllm_is_ratio, "vllm_is_ratio")
        check_same_device(vllm_is_ratio, "vllm_is_ratio", logits, "logits")
        if vllm_is_ratio.dim() == 1:
            vllm_is_ratio = vllm_is_ratio[:, None]
        if vllm_is_ratio.dim() != 2 or vllm_is_ratio.shape[0] != b or vllm_is_ratio.shape[1] not in (1, seq):
            raise ValueError(f"vllm_is_ratio must have shape ({b}, {seq}), ({b}, 1) or ({b},), "
                             f"got {tuple(vllm_is_ratio.shape)}")
        vllm_is_ratio = vllm_is_ratio.contiguous()
    for value, name in ((beta, "beta"), (eps_low, "eps_low"), (eps_high, "eps_high"),
                        (sapo_temperature_pos, "sapo_temperature_pos"), (sapo_temperature_neg, "sapo_temperature_neg")):
        check_number(value, name)
    check_number(temperature, "temperature")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    if loss_type == "sapo" and not (sapo_temperature_pos > 0 and sapo_temperature_neg > 0):
        raise ValueError("sapo_temperature_pos and sapo_temperature_neg must be positive, got "
                         f"{sapo_temperature_pos!r}, {sapo_temperature_neg!r}")
    if delta is not None:
        check_number(delta, "delta")
        if LOSS_TYPES[loss_type] != 0:
            raise ValueError(f"delta (two-sided clipping) applies to the PPO-clip loss types, not {loss_type!r}")
    if beta != 0.0 and ref_logp is None:
        raise ValueError("ref_logp is required when beta != 0 (the KL penalty to the reference policy)")
    if max_completion_length is not None:
        check_number(max_completion_length, "max_completion_length", minimum=1)
    for value, name in ((reduce, "reduce"), (use_bias_correction_kl, "use_bias_correction_kl"),
                        (overwrite_logits, "overwrite_logits")):
        check_bool(value, name)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    loss, kl, clipped, _, _ = grpo_loss_forward(
        logits, completion_ids, advantages, old_logp, ref_logp, completion_mask, vllm_is_ratio,
        float(temperature), float(beta), float(eps_low), float(eps_high), float(delta or 0.0), delta is not None,
        LOSS_TYPES[loss_type], float(sapo_temperature_pos), float(sapo_temperature_neg), use_bias_correction_kl,
        overwrite_logits,
    )
    has_kl = beta != 0.0
    if not reduce:
        return loss, (kl if has_kl else None), clipped
    mask = completion_mask if completion_mask is not None else torch.ones_like(loss)
    count = mask.sum().clamp(min=1.0)
    metrics = ([(kl * mask).sum() / count] if has_kl else []) + [(clipped * mask).sum() / count]
    return _reduce(loss, mask, loss_type, max_completion_length, num_items_in_batch), metrics
