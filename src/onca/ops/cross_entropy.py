"""Cross entropy over ``(tokens, vocab)`` logits with integer targets.

Per token ``i`` with target ``y`` (tokens whose target is ``ignore_index`` contribute nothing)::

    z       = softcap * tanh(logits / softcap)          (only when ``softcap`` is given; Gemma 2)
    lse     = log(sum_j exp(z_j))
    ce_i    = (1 - eps) * w_y * (lse - z_y) + eps / V * sum_j w_j * (lse - z_j)
    loss_i  = ce_i + lse_square_scale * lse**2

with ``eps = label_smoothing`` and the class weights ``w`` (all 1 without ``weight``); this is
``torch.nn.functional.cross_entropy`` plus the PaLM z-loss (``lse_square_scale``).
``reduction="mean"`` divides the cross-entropy part by the summed weights of the non-ignored
targets (their count without class weights: torch's weighted mean) and the z-loss part by the
count (the z-loss is never class-weighted, as in liger-kernel), both on the device: with every
token ignored (or no tokens at all) the mean is ``0 / 0 = NaN`` and the gradient is zero, as in
torch. ``return_z_loss=True`` also returns the z-loss term alone (reduced the same way, for
logging: it is already part of the loss and takes no gradient of its own). A target outside
``[0, vocab)`` that is not ``ignore_index`` is never read through: that token's loss and gradient
are NaN (checked in the kernel, with no host synchronisation), so the loss shows the bad label.

The same pass finds each token's argmax (the first maximal class of the soft-capped logits) when
the token accuracy or the predicted tokens are asked for: liger-kernel's metrics, with no
gradient. On a GPU such a launch takes a wider column tile than plain rows (see ``TILES``), so its
loss may differ from the plain call's in the last bits (another fp32 summation order); so may a
forward that writes the gradient (``overwrite_logits``) from one that does not, whose log-sum-exp
pass alone takes the GPU's streaming tile (see ``STREAMING_LSE_PASS``). Fused linear cross
entropy's token scaling multiplies ``loss_i`` and its gradient by
``softmax(z)_y``, a constant per token.

Gradient (per token, before the reduction's scales ``s`` of the cross-entropy part, ``s_z`` of
the z-loss part)::

    dloss/dz_j = softmax(z)_j * (s * ((1 - eps) * w_y + eps / V * sum_k w_k)
                                 + s_z * 2 * lse_square_scale * lse)
                 - s * eps / V * w_j - s * (1 - eps) * w_y * [j == y]

times ``1 - (z_j / softcap)**2`` through the soft cap.

The kernel is row-tiled over the vocabulary with an online log-sum-exp: where a row does not fit
the on-chip budget (the plan splits it into column tiles), one pass computes the running max and
sum of exponentials, the next writes the gradient; where it fits, one load serves both. The target
logit is gathered with one scalar load per row, and ignored tokens load nothing.

Two ways to get the gradient, chosen by ``overwrite_logits``:

- ``False`` (default, the caller's logits are never modified): the forward pass reads the logits
  once (loss and one fp32 ``lse`` per token) and saves the logits, the targets and ``lse``; the
  backward pass reads the logits once more and writes the gradient, already scaled by the
  incoming gradient, into a new tensor.
- ``True``: the forward pass computes the gradient (liger-kernel's trick) and, on the eager route,
  writes it over the logits themselves, so no second logits-sized buffer ever exists; nothing but
  that buffer is kept for backward, which rescales it in place by the incoming gradient (a kernel
  that reads the scale on the device and touches nothing when it is 1). The caller's logits hold
  the gradient afterwards (their autograd version is bumped, so a graph that saved them fails
  loudly instead of silently using gradients as logits). Use it for logits that are a temporary
  activation, as in a causal LM's loss; logits that are not row-contiguous are copied first and
  the copy is overwritten instead. When the logits do not require grad nothing is written. Traced
  (``torch.compile``), the gradient goes into a buffer of its own: compiled graphs mutate nothing.

The loss (and the z-loss) is fp32 whatever the logits' dtype, as Hugging Face's causal-LM loss
computes it (it upcasts the logits) and as fused linear cross entropy returns it: the per-token
losses are fp32 and so is their reduction, never rounded to 16 bits (a bf16 loss near 2 moves in
steps of 1/128, which would quantise the loss curve).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops import _small_calls as small_calls
from onca.ops._contract import custom_op, register_autograd, tracing
from onca.ops._launch import fast_launch, row_launch
from onca.ops._rows import as_rows, rows_cols, rows_in_place
from onca.ops._validate import (
    check_bool,
    check_float,
    check_index,
    check_number,
    check_same_device,
    check_tensor,
)
from onca.tiling import RowPlan, next_power_of_2, plan_rows

__all__ = ["cross_entropy", "CrossEntropyOutput", "REDUCTIONS", "plan", "cross_entropy_rows",
           "validate_options", "check_target", "check_class_weight", "target_stats", "reduce_losses",
           "N_VALID", "WEIGHT_TOTAL", "TARGET_WEIGHT_SUM", "SCALE", "Z_SCALE", "fake_predictions",
           "loss_outputs", "scale_forward_gradient", "ForwardGradients", "keep_forward_gradients",
           "take_forward_gradients"]

REDUCTIONS = ("none", "mean", "sum")

# Live tiles of the kernel's gradient pass: the logits tile as loaded and the gradient as stored
# (input dtype); the fp32 logits, their exponentials, the gradient and the soft-cap/target terms
# (fp32). Counting fewer lets the GPU plan put 32 elements per thread, which spills
# (tools/sm90_compile.py shows it). A row too wide for one tile is read twice (the log-sum-exp,
# then the gradient), the second read and the gradient's stores hinted evict-first (their lines are
# not used again) and the row walked forward: against no hints and a walk back from the row's last
# tile, on an H200: 8192 x 128256 1.943 -> 1.878 ms, 32768 x 128256 7.64 -> 7.43, 16384 x 151936
# 4.75 -> 4.63, 8192 x 262144 4.01 -> 3.95 (not taken there: a hint to keep the first read, only the
# stores hinted, 32768-column tiles, 16 warps).
#
# A launch that writes the gradient takes, for plain rows, the planner's two-pass tile (half the
# budget: 8192 columns in 16 warps; a log-sum-exp pass alone streams, see STREAMING_LSE_PASS); with the
# token metrics (the argmax) or class weights the tile takes the whole budget (16384 columns in 32
# warps, ``gpu_whole_two_pass``). Timed on an H100 (2026-11-28, bf16, forward with the gradient,
# every point of the benchmark, tools/kernel_variants.py), whole against half, ms: 8192 x 32000
# 0.620 -> 0.482 and Phi-3-mini's 32064 0.624 -> 0.440 with half; 151936 columns 2.584 -> 2.509,
# 262144 4.497 -> 4.411, Gemma 3's 262208 4.723 -> 4.577; half 2.5% slower at 128256 (2.027 ->
# 2.079, still 1.2x liger-kernel's 2.54); with the token metrics 2.286 against 3.027 and with class
# weights 2.082 against 2.234, whole faster. On an H200 half was faster at every plain shape timed
# (8192 x 128256 1.689 -> 1.526, 32768 x 128256 6.715 -> 6.066, 16384 x 151936 4.154 -> 3.619,
# 8192 x 262144 3.607 -> 3.155); the options there were not timed. Narrower tiles (8192 in 8 warps,
# 4096 in 4 or 8) were slower on the H100 but for class weights with label smoothing (2.520 ms in
# 4096 x 4 against the whole tile's 2.898), not taken.
TILES = dict(live_tiles=2, fp32_tiles=4)
OPTION_TILES = dict(TILES, gpu_whole_two_pass=True)
# With class weights and label smoothing the gradient pass also holds a tile of weights and the
# weighted smoothing term (fp32); counting fewer than 7 spills the fp32 logits' forward-with-gradient
# variant on sm_90 (tools/sm90_compile.py shows it).
WEIGHTED_SMOOTHING_TILES = dict(live_tiles=2, fp32_tiles=7, gpu_whole_two_pass=True)
# A launch that computes the log-sum-exp and writes no gradient only reads its rows: on a GPU it
# takes the planner's streaming tile (one warp, 2048 columns; see plan_rows' gpu_streaming).
# Measured on an H200 (bf16, the default route: the gradient in the backward), forward against the
# two-pass tile: 8192 x 128256 0.711 -> 0.549 ms, 8192 x 151936 0.837 -> 0.651, 8192 x 32000 0.213
# -> 0.163, 8192 x 262144 1.373 -> 1.097, 32768 x 128256 2.773 -> 2.494; forward + backward 1.08x
# to 1.51x faster.
STREAMING_LSE_PASS = True
# The rescaling kernel: the tile as loaded and as stored, and its fp32 product.
RESCALE_TILES = dict(live_tiles=2, fp32_tiles=1)


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _capped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """``softcap * tanh(x / softcap)`` (Gemma 2's logit soft-capping), written with ``exp`` and
    ``rsqrt`` so that every backend has it and no per-element division is needed (``1 / (1 + a)``
    as ``rsqrt(1 + a) ** 2``); ``exp(-2|u|)`` never overflows."""
    if HAS_SOFTCAP:
        u = x * (1.0 / softcap)
        a = tl.exp(-2.0 * tl.abs(u))
        r = tl.rsqrt(1.0 + a)
        t = (1.0 - a) * (r * r)
        x = softcap * tl.where(u < 0, -t, t)
    return x


@triton.jit
def _load_logits(ptrs, mask, softcap, HAS_SOFTCAP: tl.constexpr, EVICTION: tl.constexpr):
    """A tile of logits in fp32, soft-capped, ``-inf`` where masked (out of the row, ignored rows).
    ``EVICTION``: the cache hint of the load ("" none; "evict_first" for a tile's last read).
    Masked lanes are loaded as ``-inf`` rather than selected after the load (the cap would map
    ``-inf`` to ``-softcap``, so only capped tiles select): one select fewer per element, and a
    32768-column tile no longer spills on sm_90 (64 registers, no stack, from 64 + 56 bytes). H200,
    bf16, forward with gradient, kernel alone, outputs bitwise equal: 8192 x 128256 1.725 -> 1.689
    ms, 32768 x 128256 6.861 -> 6.715, 16384 x 151936 4.250 -> 4.154, 8192 x 262144 3.661 -> 3.607."""
    x = tl.load(ptrs, mask=mask, other=float("-inf"), eviction_policy=EVICTION).to(tl.float32)
    if HAS_SOFTCAP:
        x = tl.where(mask, _capped(x, softcap, HAS_SOFTCAP), float("-inf"))
    return x


@triton.jit
def _class_weights(weight_ptr, cols, mask, HAS_WEIGHT: tl.constexpr):
    """The fp32 class weights of a tile of columns (0 where masked); 1 without class weights."""
    w = tl.where(mask, 1.0, 0.0)
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return w


@triton.jit
def _gradient(p, x, cols, y, p_coef, off, y_coef, w, softcap, HAS_SOFTCAP: tl.constexpr,
              WEIGHTED_OFF: tl.constexpr):
    """dloss/dlogits of a tile (fp32) from its softmax ``p`` and per-row coefficients (each already
    multiplied by the row's scale, 0 on ignored rows, whose ``p`` is 0 too: the row comes out 0)::

        g_j = p_j * p_coef - off * w_j - y_coef * [j == y]

    ``w`` is the tile's class weights (read only with ``WEIGHTED_OFF``: label smoothing spreads
    the weighted uniform target over the classes). ``x`` holds the (soft-capped) logits, ``-inf``
    where masked (read for the soft cap's derivative only)."""
    if WEIGHTED_OFF:
        g = p * p_coef[:, None] - off[:, None] * w[None, :]
    else:
        g = p * p_coef[:, None] - off[:, None]
    g = tl.where(cols[None, :] == y[:, None], g - y_coef[:, None], g)
    if HAS_SOFTCAP:
        t = tl.where(x == float("-inf"), 0.0, x) * (1.0 / softcap)  # masked columns: no 0 * inf
        g = g * (1.0 - t * t)
    return g


@fast_launch
@triton.jit
def _cross_entropy_kernel(
    x_ptr, target_ptr, grad_ptr, loss_ptr, z_ptr, lse_ptr, pred_ptr, scale_ptr, z_scale_ptr,
    weight_ptr, weight_total_ptr,
    n_rows, n_cols, x_row_stride, grad_row_stride, scale_stride,
    ignore_index, label_smoothing, lse_square_scale, softcap,
    COMPUTE_LSE: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    WRITE_PRED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    WEIGHTED_OFF: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
    FOREIGN_TARGETS: tl.constexpr = False,
):
    """One kernel, three uses:

    - ``COMPUTE_LSE`` and not ``WRITE_GRAD``: loss, z-loss and lse per row (forward without gradient);
    - ``COMPUTE_LSE`` and ``WRITE_GRAD``: those and the gradient (forward with gradient);
    - ``WRITE_GRAD`` alone: the gradient from a saved ``lse`` (deferred backward).

    The loss written is the cross-entropy part (class-weighted); the z-loss is written apart, so
    that a weighted mean can divide each by its own count. ``WRITE_PRED`` also writes each row's
    argmax (the first maximal class; -1 on ignored rows), found in the same pass.

    The gradient of row ``r`` is scaled by ``scale_ptr[r * scale_stride]`` when ``HAS_SCALE`` (stride
    0 for a scalar such as ``1 / n`` of a mean, 1 per token), its z-loss part by ``z_scale_ptr[...]``
    (the same tensor unless the cross-entropy part is a weighted mean). ``WEIGHTED_OFF`` is
    ``HAS_WEIGHT and HAS_SMOOTHING`` (the gradient then reads the class weights of every column).
    ``TOKEN_SCALING`` multiplies
    each row's loss, z-loss and gradient by the row's probability of its target (a constant: no
    gradient flows through it). ``grad_ptr`` may be ``x_ptr``: each program reads a tile before it
    writes that tile, and no other program touches the row.

    A target outside ``[0, n_cols)`` that is not ``ignore_index`` is never used as an offset: its
    row's loss and gradient are NaN, so that a bad label shows in the loss without a host check.
    With ``FOREIGN_TARGETS`` (a vocabulary shard: the columns are one rank's slice of the
    vocabulary, the targets already shifted to it) such a target is another shard's class: the row
    still counts (its log-sum-exp and softmax term are computed, with a target weight of 1: no class
    weights) but has no target term here.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    smooth_eps = label_smoothing / n_cols
    # The summed class weights (n_cols without weights), for the smoothing term.
    weight_total = n_cols * 1.0
    if HAS_WEIGHT:
        weight_total = tl.load(weight_total_ptr).to(tl.float32)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        y = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)
        valid = row_mask & (y != ignore_index)
        outside = (y < 0) | (y >= n_cols)
        if FOREIGN_TARGETS:
            bad = valid & (y != y)  # nothing is bad: outside targets belong to another shard
        else:
            bad = valid & outside
        readable = valid & ~outside
        # Class indices fit int32 (the vocabulary does): compared per element in 32 bits.
        y = tl.where(readable, y, 0).to(tl.int32)
        rows64 = rows.to(tl.int64)
        x_rows = x_ptr + rows64[:, None] * x_row_stride
        w_y = tl.where(readable, 1.0, 0.0)
        if HAS_WEIGHT:
            w_y = tl.load(weight_ptr + y, mask=readable, other=0.0).to(tl.float32)
        if COMPUTE_LSE or TOKEN_SCALING:
            # The target's logit: one scalar load per row, before any gradient overwrites it.
            x_y = tl.load(x_ptr + rows64 * x_row_stride + y.to(tl.int64), mask=readable, other=0.0)
            x_y = _capped(x_y.to(tl.float32), softcap, HAS_SOFTCAP)

        # 1. The log-sum-exp (and the losses, the argmax), or the saved log-sum-exp.
        if COMPUTE_LSE:
            if COL_TILES == 1:
                # The whole row is one tile: this load also serves the gradient below.
                col_mask = col_offsets < n_cols
                mask = valid[:, None] & col_mask[None, :]
                x = _load_logits(x_rows + col_offsets[None, :], mask, softcap, HAS_SOFTCAP, "")
                m = tl.where(valid, tl.max(x, axis=1), 0.0)
                e = tl.exp(x - m[:, None])
                d = tl.where(valid, tl.sum(e, axis=1), 1.0)
                if HAS_SMOOTHING:
                    w = _class_weights(weight_ptr, col_offsets, col_mask, HAS_WEIGHT)
                    x_sum = tl.sum(tl.where(mask, x, 0.0) * w[None, :], axis=1)
                if WRITE_PRED:
                    best = tl.argmax(x, axis=1, tie_break_left=True)
            else:
                # Online log-sum-exp over the row's column tiles: running max and sum of exp.
                m = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
                d = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                x_sum = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                best = tl.zeros([BLOCK_ROWS], dtype=tl.int32)
                for tile in range(COL_TILES):
                    cols = tile * BLOCK_COLS + col_offsets
                    col_mask = cols < n_cols
                    mask = valid[:, None] & col_mask[None, :]
                    xt = _load_logits(x_rows + cols[None, :], mask, softcap, HAS_SOFTCAP, "")
                    tile_max = tl.max(xt, axis=1)
                    if WRITE_PRED:
                        # Strictly greater: an equal maximum in a later tile keeps the first index.
                        tile_best = tl.argmax(xt, axis=1, tie_break_left=True) + tile * BLOCK_COLS
                        best = tl.where(tile_max > m, tile_best, best)
                    m_new = tl.maximum(m, tile_max)
                    # Rows with nothing loaded yet (ignored rows) keep m = -inf; shift them by 0.
                    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                    d = d * tl.exp(m - shift) + tl.sum(tl.exp(xt - shift[:, None]), axis=1)
                    m = m_new
                    if HAS_SMOOTHING:
                        w = _class_weights(weight_ptr, cols, col_mask, HAS_WEIGHT)
                        x_sum += tl.sum(tl.where(mask, xt, 0.0) * w[None, :], axis=1)
                m = tl.where(valid, m, 0.0)
                d = tl.where(valid, d, 1.0)
            lse = tl.where(valid, m + tl.log(d), 0.0)
            # (1 - eps) * w_y * (lse - x_y) + eps / V * sum_j w_j * (lse - x_j), as torch weighs it.
            loss = (1.0 - label_smoothing) * w_y * (lse - x_y)
            if HAS_SMOOTHING:
                loss += smooth_eps * (weight_total * lse - x_sum)
            z = lse_square_scale * lse * lse
            if TOKEN_SCALING:
                factor = tl.exp(x_y - lse)
                loss *= factor
                z *= factor
            loss = tl.where(bad, float("nan"), tl.where(valid, loss, 0.0))
            tl.store(loss_ptr + rows, loss, mask=row_mask)
            tl.store(z_ptr + rows, tl.where(valid, z, 0.0), mask=row_mask)
            tl.store(lse_ptr + rows, lse, mask=row_mask)
            if WRITE_PRED:
                tl.store(pred_ptr + rows, tl.where(valid, best, -1).to(tl.int64), mask=row_mask)
        else:
            lse = tl.load(lse_ptr + rows, mask=valid, other=0.0)

        # 2. The gradient, scaled, written over the logits or into its own buffer.
        if WRITE_GRAD:
            if COMPUTE_LSE or TOKEN_SCALING:
                # The gradient may overwrite the logits: every thread's read of x_y comes first.
                tl.debug_barrier()
            scale = tl.where(valid, 1.0, 0.0)
            z_scale = scale
            if HAS_SCALE:
                s = tl.load(scale_ptr + rows * scale_stride, mask=valid, other=0.0)
                scale = scale * s.to(tl.float32)
                z_scale = scale
                if HAS_Z:
                    zs = tl.load(z_scale_ptr + rows * scale_stride, mask=valid, other=0.0)
                    z_scale = tl.where(valid, zs.to(tl.float32), 0.0)
            if TOKEN_SCALING:
                factor = tl.exp(x_y - lse)
                scale = scale * factor
                z_scale = z_scale * factor
            scale = tl.where(bad, float("nan"), scale)
            # Row coefficients first, so that each element costs one fma and one select.
            y_coef = scale * ((1.0 - label_smoothing) * w_y)
            p_coef = y_coef + scale * (smooth_eps * weight_total)
            if FOREIGN_TARGETS:
                # Another shard's target still weighs the softmax term (no class weights here).
                p_coef = tl.where(valid & outside, scale * (1.0 - label_smoothing), 0.0) + p_coef
            if HAS_Z:
                p_coef += z_scale * (2.0 * lse_square_scale) * lse
            off = scale * smooth_eps
            g_rows = grad_ptr + rows64[:, None] * grad_row_stride
            if COL_TILES == 1:
                col_mask = col_offsets < n_cols
                if COMPUTE_LSE:
                    p = e * (1.0 / d)[:, None]  # the exponentials are still here: no second exp
                else:
                    mask = valid[:, None] & col_mask[None, :]
                    x = _load_logits(x_rows + col_offsets[None, :], mask, softcap, HAS_SOFTCAP, "")
                    p = tl.exp(x - lse[:, None])
                w = _class_weights(weight_ptr, col_offsets, col_mask, WEIGHTED_OFF)
                g = _gradient(p, x, col_offsets, y, p_coef, off, y_coef, w, softcap, HAS_SOFTCAP,
                              WEIGHTED_OFF)
                tl.store(g_rows + col_offsets[None, :], g.to(grad_ptr.dtype.element_ty),
                         mask=row_mask[:, None] & col_mask[None, :])
            else:
                for tile in range(COL_TILES):
                    # The row's last read and its gradient, never read here again: both hinted to
                    # leave the L2 cache first, which keeps the rows still in their log-sum-exp
                    # pass (to be read a second time) in it (see TILES).
                    cols = tile * BLOCK_COLS + col_offsets
                    col_mask = cols < n_cols
                    mask = valid[:, None] & col_mask[None, :]
                    xt = _load_logits(x_rows + cols[None, :], mask, softcap, HAS_SOFTCAP, "evict_first")
                    w = _class_weights(weight_ptr, cols, col_mask, WEIGHTED_OFF)
                    g = _gradient(tl.exp(xt - lse[:, None]), xt, cols, y, p_coef, off, y_coef, w, softcap,
                                  HAS_SOFTCAP, WEIGHTED_OFF)
                    tl.store(g_rows + cols[None, :], g.to(grad_ptr.dtype.element_ty),
                             mask=row_mask[:, None] & col_mask[None, :], eviction_policy="evict_first")


@fast_launch
@triton.jit
def _rescale_kernel(
    x_ptr, out_ptr, g_ptr, applied_ptr, record_ptr,
    n_rows, n_cols, x_row_stride, out_row_stride, g_stride,
    HAS_APPLIED: tl.constexpr,
    SKIP_UNCHANGED: tl.constexpr,
    RECORD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """``out = x * g / applied`` per row (``g_ptr[r * g_stride]``: stride 0 for a scalar), in fp32.

    With ``SKIP_UNCHANGED`` (``out`` is ``x``) rows whose factor is exactly 1 are neither read nor
    written: a loss's incoming gradient is usually 1, and then this costs nothing. ``RECORD`` also
    writes each row's ``g`` in fp32 to ``record_ptr[r * g_stride]`` (every program the same value
    for a scalar): the factor a later rescale must divide out.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        factor = tl.load(g_ptr + rows * g_stride, mask=row_mask, other=1.0).to(tl.float32)
        if RECORD:
            tl.store(record_ptr + rows * g_stride, factor, mask=row_mask)
        if HAS_APPLIED:
            factor = factor / tl.load(applied_ptr + rows * g_stride, mask=row_mask, other=1.0)
        rows64 = rows.to(tl.int64)[:, None]
        if SKIP_UNCHANGED:
            row_mask = row_mask & (factor != 1.0)
            # A block with nothing to change skips its column loop: masked-off tiles still cost
            # their instructions (100 us of nothing over a 8192 x 128256 gradient on the H100).
            if tl.max(row_mask.to(tl.int32), axis=0) > 0:
                _scale_rows(x_ptr, out_ptr, rows64, row_mask, factor, n_cols, x_row_stride, out_row_stride,
                            col_offsets, BLOCK_COLS, COL_TILES)
        else:
            _scale_rows(x_ptr, out_ptr, rows64, row_mask, factor, n_cols, x_row_stride, out_row_stride,
                        col_offsets, BLOCK_COLS, COL_TILES)


@triton.jit
def _scale_rows(x_ptr, out_ptr, rows64, row_mask, factor, n_cols, x_row_stride, out_row_stride, col_offsets,
                BLOCK_COLS: tl.constexpr, COL_TILES: tl.constexpr):
    for tile in range(COL_TILES):
        cols = tile * BLOCK_COLS + col_offsets
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0)
        y = x.to(tl.float32) * factor[:, None]
        tl.store(out_ptr + rows64 * out_row_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The kernel's plans for logits of ``shape`` (``(..., vocab)``). The forward with the gradient
    and the deferred backward launch the same kernel with the same plan; a forward without the
    gradient (the log-sum-exp pass alone) takes the streaming tile (``lse_only``); the token
    metrics or class weights take ``options``' tile, class weights with label smoothing
    ``weighted_smoothing``'s (a tile of weights more); see :func:`_tiles`."""
    rows, cols = rows_cols(shape)
    p = plan_rows(rows, cols, dtype, profile=profile, **TILES)
    return {"forward": p, "backward": p,
            "lse_only": plan_rows(rows, cols, dtype, profile=profile, **TILES,
                                  gpu_streaming=STREAMING_LSE_PASS),
            "options": plan_rows(rows, cols, dtype, profile=profile, **OPTION_TILES),
            "weighted_smoothing": plan_rows(rows, cols, dtype, profile=profile, **WEIGHTED_SMOOTHING_TILES)}


def _tiles(weight: Tensor | None, label_smoothing: float, predicted: Tensor | None) -> dict:
    """The tile declaration of one launch, by the options it carries (measured: see TILES)."""
    if weight is not None and label_smoothing > 0:
        return WEIGHTED_SMOOTHING_TILES
    return OPTION_TILES if weight is not None or predicted is not None else TILES


def cross_entropy_rows(
    x: Tensor,
    target: Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    compute_lse: bool,
    lse: Tensor,
    loss: Tensor | None = None,
    z: Tensor | None = None,
    predicted: Tensor | None = None,
    grad: Tensor | None = None,
    scale: Tensor | None = None,
    z_scale: Tensor | None = None,
    weight: Tensor | None = None,
    weight_total: Tensor | None = None,
    token_scaling: bool = False,
    foreign_targets: bool = False,
) -> None:
    """Launch the kernel over the rows of ``x`` (``(rows, vocab)``, unit column stride, rows >= 1).

    With ``compute_lse`` it writes the fp32 ``loss`` (the cross-entropy part), ``z`` (the z-loss
    part) and ``lse`` of each row, and the int64 argmax into ``predicted`` when given; else it
    reads ``lse``. When ``grad`` is given (it may be ``x`` itself), the gradient is written into
    it, scaled per row by ``scale`` (a 0-d or ``(rows,)`` tensor on the device; None: 1), its
    z-loss part by ``z_scale`` (default ``scale``). ``weight``: the class weights, with
    ``weight_total`` their fp32 sum (0-d). ``softcap`` 0 is none. No validation here: the public
    functions validate. ``foreign_targets``: ``x`` is a shard of the vocabulary and a target outside
    ``[0, vocab)`` is another shard's class (no target term, no NaN; see the kernel).
    """
    rows, cols = x.shape
    weighted_smoothing = weight is not None and label_smoothing > 0
    write_grad = grad is not None
    tiles = _tiles(weight, label_smoothing, predicted)
    if STREAMING_LSE_PASS and compute_lse and not write_grad:
        tiles = dict(tiles, gpu_streaming=True)
    p = plan_rows(rows, cols, x.dtype, **tiles)
    scale_stride = 0 if scale is None or scale.dim() == 0 else scale.stride(0)
    if z_scale is None:
        z_scale = scale
    # Pointers an option leaves unused point at a tensor the kernel never reads through them.
    _cross_entropy_kernel[(p.grid,)](
        x, target, grad if write_grad else x, loss if compute_lse else lse, z if compute_lse else lse, lse,
        predicted if predicted is not None else target, scale if scale is not None else lse,
        z_scale if z_scale is not None else lse, weight if weight is not None else lse,
        weight_total if weight_total is not None else lse,
        rows, cols, x.stride(0), grad.stride(0) if write_grad else 0, scale_stride,
        ignore_index, label_smoothing, lse_square_scale, softcap if softcap else 1.0,
        COMPUTE_LSE=compute_lse, WRITE_GRAD=write_grad, WRITE_PRED=predicted is not None,
        HAS_SOFTCAP=softcap != 0.0, HAS_SMOOTHING=label_smoothing > 0, HAS_Z=lse_square_scale != 0,
        HAS_SCALE=scale is not None, HAS_WEIGHT=weight is not None, WEIGHTED_OFF=weighted_smoothing,
        TOKEN_SCALING=token_scaling, FOREIGN_TARGETS=foreign_targets,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )


# Where ``target_stats`` puts each value in its fp32 vector.
N_VALID, WEIGHT_TOTAL, TARGET_WEIGHT_SUM, SCALE, Z_SCALE = range(5)


@fast_launch
@triton.jit
def _target_stats_kernel(target_ptr, weight_ptr, grad_ptr, stats_ptr, n_rows, n_classes, ignore_index,
                         HAS_WEIGHT: tl.constexpr, HAS_GRAD: tl.constexpr, MEAN: tl.constexpr,
                         BLOCK: tl.constexpr):
    """One program: the count of non-ignored targets, the class weights' sum and the targets'
    summed weights (a target outside the classes counts class 0's; its loss is NaN anyway), and
    the gradient scales of the loss's cross-entropy and z-loss parts for the incoming gradient
    (1 without ``HAS_GRAD``): a mean divides the first by the summed target weights (torch's
    weighted mean; the count without weights) and the second by the count."""
    offsets = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], dtype=tl.float32)
    target_weights = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + offsets
        y = tl.load(target_ptr + rows, mask=rows < n_rows, other=ignore_index)
        valid = (rows < n_rows) & (y != ignore_index)
        count += valid.to(tl.float32)
        if HAS_WEIGHT:
            cls = tl.where(valid & (y >= 0) & (y < n_classes), y, 0)
            target_weights += tl.load(weight_ptr + cls, mask=valid, other=0.0).to(tl.float32)
    n_valid = tl.sum(count, axis=0)
    target_weight_sum = tl.sum(target_weights, axis=0)
    weight_total = n_classes * 1.0
    if HAS_WEIGHT:
        weights = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_classes, BLOCK):
            cls = start + offsets
            weights += tl.load(weight_ptr + cls, mask=cls < n_classes, other=0.0).to(tl.float32)
        weight_total = tl.sum(weights, axis=0)
    g = 1.0
    if HAS_GRAD:
        g = tl.load(grad_ptr).to(tl.float32)
    scale = g
    z_scale = g
    if MEAN:
        z_scale = g / n_valid
        scale = g / target_weight_sum if HAS_WEIGHT else z_scale
    tl.store(stats_ptr + 0, n_valid)
    tl.store(stats_ptr + 1, weight_total)
    tl.store(stats_ptr + 2, target_weight_sum)
    tl.store(stats_ptr + 3, scale)
    tl.store(stats_ptr + 4, z_scale)


@fast_launch
@triton.jit
def _reduce_loss_kernel(ce_ptr, z_ptr, stats_ptr, predicted_ptr, target_ptr, loss_ptr, z_loss_ptr,
                        accuracy_ptr, n_rows, ignore_index,
                        MEAN: tl.constexpr, HAS_WEIGHT: tl.constexpr, PREDICTIONS: tl.constexpr,
                        BLOCK: tl.constexpr):
    """One program, in a fixed order: the loss from its per-row cross-entropy and z-loss parts
    (a mean divides the first by the summed target weights, the second by the count: the z-loss
    is not class-weighted, as in liger-kernel), the z-loss alone, and the fraction of
    non-ignored tokens predicted right (liger-kernel's token accuracy, for mean and sum alike);
    a mean over no token is NaN, as torch's."""
    offsets = tl.arange(0, BLOCK)
    ce = tl.zeros([BLOCK], dtype=tl.float32)
    z = tl.zeros([BLOCK], dtype=tl.float32)
    correct = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + offsets
        mask = rows < n_rows
        ce += tl.load(ce_ptr + rows, mask=mask, other=0.0)
        z += tl.load(z_ptr + rows, mask=mask, other=0.0)
        if PREDICTIONS:
            y = tl.load(target_ptr + rows, mask=mask, other=ignore_index)
            pred = tl.load(predicted_ptr + rows, mask=mask, other=-1)
            correct += (mask & (y != ignore_index) & (pred == y)).to(tl.float32)
    ce_sum = tl.sum(ce, axis=0)
    z_sum = tl.sum(z, axis=0)
    n_valid = tl.load(stats_ptr + 0)
    loss = ce_sum + z_sum
    z_loss = z_sum
    if MEAN:
        z_loss = z_sum / n_valid
        if HAS_WEIGHT:
            loss = ce_sum / tl.load(stats_ptr + 2) + z_loss
        else:
            loss = loss / n_valid
    tl.store(loss_ptr, loss.to(loss_ptr.dtype.element_ty))
    tl.store(z_loss_ptr, z_loss.to(z_loss_ptr.dtype.element_ty))
    if PREDICTIONS:
        tl.store(accuracy_ptr, tl.sum(correct, axis=0) / n_valid)


def _block(n: int) -> int:
    """The vector width of the one-program reductions: the rows at once, up to 1024."""
    return max(16, min(1024, next_power_of_2(max(n, 1))))


def target_stats(target: Tensor, ignore_index: int, weight: Tensor | None, reduction: str,
                 grad_loss: Tensor | None = None) -> Tensor:
    """An fp32 vector on the device, indexed by ``N_VALID``, ``WEIGHT_TOTAL``,
    ``TARGET_WEIGHT_SUM``, ``SCALE``, ``Z_SCALE`` (see ``_target_stats_kernel``): one launch, no
    synchronisation. ``grad_loss``: the loss's 0-d incoming gradient (None: 1)."""
    stats = torch.empty(5, dtype=torch.float32, device=target.device)
    n_classes = weight.shape[0] if weight is not None else 0
    _target_stats_kernel[(1,)](
        target, weight if weight is not None else stats, grad_loss if grad_loss is not None else stats, stats,
        target.shape[0], n_classes, ignore_index,
        HAS_WEIGHT=weight is not None, HAS_GRAD=grad_loss is not None, MEAN=reduction == "mean",
        BLOCK=_block(max(target.shape[0], n_classes)),
    )
    return stats


def reduce_losses(ce_rows: Tensor, z_rows: Tensor, stats: Tensor, reduction: str, *,
                  weighted: bool, predicted: Tensor | None = None, target: Tensor | None = None,
                  ignore_index: int = -100) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(loss, z_loss, token_accuracy)`` (fp32) from the per-row fp32 parts, reduced by one
    launch (``reduction="none"``: per row). The accuracy is None without ``predicted``."""
    if reduction == "none":
        accuracy = None
        if predicted is not None:
            accuracy = ((predicted == target) & (target != ignore_index)).to(torch.float32)
        return ce_rows + z_rows, z_rows, accuracy
    loss, z_loss = (torch.empty((), dtype=torch.float32, device=ce_rows.device) for _ in range(2))
    accuracy = torch.empty((), dtype=torch.float32, device=ce_rows.device) if predicted is not None else None
    _reduce_loss_kernel[(1,)](
        ce_rows, z_rows, stats, predicted if predicted is not None else ce_rows,
        target if target is not None else ce_rows, loss, z_loss,
        accuracy if accuracy is not None else loss, ce_rows.shape[0], ignore_index,
        MEAN=reduction == "mean", HAS_WEIGHT=weighted, PREDICTIONS=predicted is not None,
        BLOCK=_block(ce_rows.shape[0]),
    )
    return loss, z_loss, accuracy


def _unit_scale(stats: Tensor, reduction: str, z: bool = False) -> Tensor | None:
    """The gradient scale for a unit incoming gradient (None where it is 1: no division)."""
    return stats[Z_SCALE if z else SCALE] if reduction == "mean" else None


def _no_rows(like: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The placeholder for an output an option did not ask for."""
    return like.new_empty(0, dtype=dtype)


@custom_op("cross_entropy_forward")
def cross_entropy_forward(logits: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int,
                          label_smoothing: float, lse_square_scale: float, softcap: float, reduction: str,
                          predictions: bool, gradient_in_forward: bool,
                          overwrite_logits: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, z_loss, lse, grad, token_accuracy, predicted)`` of the 2-D ``logits``: ``loss`` and
    ``z_loss`` reduced (fp32); ``lse`` fp32 per row. With ``gradient_in_forward`` the
    gradient for a unit incoming gradient is computed too: into ``grad``, or (``overwrite_logits``,
    eager route only) over the logits, ``grad`` then being empty. With ``predictions`` the argmax
    per row (int64, -1 where ignored) and the token accuracy reduced like the loss (fp32); empty
    otherwise."""
    rows, vocab = logits.shape
    keep_grad = gradient_in_forward and not overwrite_logits
    grad = logits.new_empty((rows, vocab) if keep_grad else (0,))
    ce_rows, z_rows, lse = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    predicted = torch.empty(rows if predictions else 0, dtype=torch.int64, device=logits.device)
    stats = target_stats(target, ignore_index, weight, reduction)
    if rows:
        if gradient_in_forward and overwrite_logits:
            # The logits are about to hold the gradient: a graph that saved them must fail loudly.
            torch.autograd.graph.increment_version(logits)
        into = (logits if overwrite_logits else grad) if gradient_in_forward else None
        cross_entropy_rows(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           lse_square_scale=lse_square_scale, softcap=softcap, compute_lse=True, lse=lse,
                           loss=ce_rows, z=z_rows, predicted=predicted if predictions else None, grad=into,
                           scale=_unit_scale(stats, reduction),
                           z_scale=_unit_scale(stats, reduction, z=True) if lse_square_scale else None,
                           weight=weight, weight_total=stats[WEIGHT_TOTAL] if weight is not None else None)
    loss, z_loss, accuracy = reduce_losses(ce_rows, z_rows, stats, reduction, weighted=weight is not None,
                                           predicted=predicted if predictions else None, target=target,
                                           ignore_index=ignore_index)
    return loss, z_loss, lse, grad, accuracy if predictions else _no_rows(logits), predicted


def fake_predictions(like: Tensor, rows: int, reduction: str, predictions: bool) -> tuple[Tensor, Tensor]:
    """The fake ``(token_accuracy, predicted)`` outputs of a forward op over ``rows`` rows."""
    if not predictions:
        return _no_rows(like), _no_rows(like, torch.int64)
    accuracy = like.new_empty((rows,) if reduction == "none" else (), dtype=torch.float32)
    return accuracy, like.new_empty(rows, dtype=torch.int64)


@cross_entropy_forward.register_fake
def _(logits, target, weight, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
      predictions, gradient_in_forward, overwrite_logits):
    rows, vocab = logits.shape
    loss_shape = (rows,) if reduction == "none" else ()
    keep_grad = gradient_in_forward and not overwrite_logits
    lse = logits.new_empty(rows, dtype=torch.float32)
    grad = logits.new_empty((rows, vocab) if keep_grad else (0,))
    f32 = dict(dtype=torch.float32)
    return (logits.new_empty(loss_shape, **f32), logits.new_empty(loss_shape, **f32), lse, grad,
            *fake_predictions(logits, rows, reduction, predictions))


@custom_op("cross_entropy_backward")
def cross_entropy_backward(grad_loss: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                           weight: Tensor | None, ignore_index: int, label_smoothing: float,
                           lse_square_scale: float, softcap: float, reduction: str) -> Tensor:
    """The logits' gradient from the saved logits and ``lse``, scaled by the loss's incoming gradient
    (and, for a mean, divided by the count of non-ignored targets or their summed class weights,
    on the device)."""
    rows, vocab = logits.shape
    grad = torch.empty((rows, vocab), dtype=logits.dtype, device=logits.device)
    if rows == 0:
        return grad
    if reduction == "none":
        # Per-row scales: the incoming gradient itself (stats only for the class weights' sum).
        scale = z_scale = grad_loss.reshape(-1)
        stats = target_stats(target, ignore_index, weight, reduction) if weight is not None else None
    else:
        stats = target_stats(target, ignore_index, weight, reduction, grad_loss)
        scale, z_scale = stats[SCALE], stats[Z_SCALE]
    cross_entropy_rows(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                       lse_square_scale=lse_square_scale, softcap=softcap, compute_lse=False, lse=lse,
                       grad=grad, scale=scale, z_scale=z_scale, weight=weight,
                       weight_total=stats[WEIGHT_TOTAL] if weight is not None else None)
    return grad


@cross_entropy_backward.register_fake
def _(grad_loss, logits, target, lse, weight, ignore_index, label_smoothing, lse_square_scale, softcap,
      reduction):
    return torch.empty_like(logits)


def _launch_rescale(grad: Tensor, out: Tensor, grad_output: Tensor, applied: Tensor | None,
                    skip_unchanged: bool, record: Tensor | None = None) -> None:
    """``out = grad * grad_output / applied`` by rows (``out`` may be ``grad`` itself; then
    ``skip_unchanged`` leaves the rows whose factor is 1 untouched); ``record`` (fp32, one value
    per element of ``grad_output``) receives ``grad_output``'s values. A 1-D ``grad`` is one row."""
    if grad.numel() == 0:
        return
    rows, cols, grad_stride = _rows_written(grad)
    out_stride = grad_stride if out is grad else _rows_written(out)[2]
    # An expanded gradient (stride 0) is made contiguous: read per row like ``applied``.
    g = grad_output if grad_output.is_contiguous() else grad_output.contiguous()
    grid, kwargs, _ = row_launch(_rescale_kernel, rows, cols, grad.dtype, RESCALE_TILES,
                                 {"HAS_APPLIED": applied is not None, "SKIP_UNCHANGED": skip_unchanged,
                                  "RECORD": record is not None})
    _rescale_kernel[grid](grad, out, g, applied if applied is not None else g,
                          record if record is not None else g, rows, cols, grad_stride, out_stride,
                          0 if grad_output.dim() == 0 else 1, **kwargs)


def _rows_written(t: Tensor) -> tuple[int, int, int]:
    """``(rows, cols, row_stride)`` of a gradient a kernel wrote row by row (a 1-D one is one row):
    read in place, never copied (a copy would be rescaled instead of the gradient)."""
    if t.dim() < 2:
        return 1, t.numel(), t.numel()
    same, rows, row_stride = rows_in_place(t)
    if same is not t:
        raise RuntimeError("internal error: a forward-pass gradient is not laid out in rows")
    return rows, t.shape[-1], row_stride


@custom_op("scale_forward_gradient")
def scale_forward_gradient(grad: Tensor, grad_output: Tensor, applied: Tensor | None) -> Tensor:
    """A gradient the forward pass computed for a unit incoming gradient, times the loss's incoming
    gradient ``grad_output`` (0-d, or one per row of ``grad``), divided by ``applied`` (the incoming
    gradient already folded in by an earlier backward; None: 1), into a new tensor. (The eager
    route's first backward rescales in place instead: :func:`rescale_in_place`.)"""
    out = torch.empty_like(grad)
    _launch_rescale(grad, out, grad_output, applied, skip_unchanged=False)
    return out


@scale_forward_gradient.register_fake
def _(grad, grad_output, applied):
    return torch.empty_like(grad)


def rescale_in_place(grad: Tensor, grad_output: Tensor, record: Tensor | None = None) -> None:
    """``grad *= grad_output`` (0-d, or one per row), skipping the rows whose factor is 1, and
    ``grad_output``'s values into ``record`` (fp32) when given: the eager route only, a plain
    launch and no registered op (a registered op would have to declare the mutation, and tracing
    never takes this path)."""
    _launch_rescale(grad, grad, grad_output, None, skip_unchanged=True, record=record)


# ---------------------------------------------------------------------------------------- autograd


class ForwardGradients:
    """Gradients computed in the forward pass on the eager route, handed to autograd by backward.

    The first backward rescales them in place by its incoming gradient (kept on the device: no
    host check of its value; nothing is touched where the factor is 1, the usual case) and hands
    them over. A second backward through the same graph (``retain_graph=True``, a benchmark timing
    backward) gets new tensors, rescaled from them by its incoming gradient over the first one
    (``applied``), so that what the first backward returned is never changed behind the caller's
    back; that works as long as nobody has modified them since (autograd may have made them a
    leaf's ``.grad`` and accumulated into it; their version counters tell, on the host), and is
    otherwise refused with an error rather than answered wrongly. After a first incoming gradient
    of exactly 0, a later one gives NaN (the gradients were zeroed).
    """

    def __init__(self, tensors):
        self.tensors = tuple(tensors)
        # The incoming gradient already folded in, flat fp32 (None: 1, nothing folded in yet; no
        # fill launch in the forward pass for the usual single backward).
        self.applied: Tensor | None = None
        self.versions: list | None = None

    def take(self, grad_output: Tensor) -> tuple:
        if self.versions is not None and any(
            t is not None and t._version != v for t, v in zip(self.tensors, self.versions)
        ):
            raise RuntimeError(
                "the gradients this op computed in the forward pass were modified after the first "
                "backward (e.g. accumulated into a .grad); backward through the same graph again is "
                "not supported"
            )
        if self.versions is not None:
            return tuple(scale_forward_gradient(t, grad_output, self.applied) if t is not None else None
                         for t in self.tensors)
        # A copy, not the caller's tensor (it may be changed before a second backward), written by
        # the rescaling launches themselves (each the same values): no copy kernel of its own. An
        # empty gradient launches nothing, and a later rescale of it reads nothing.
        self.applied = torch.empty(grad_output.numel(), dtype=torch.float32, device=grad_output.device)
        for t in self.tensors:
            if t is not None:
                rescale_in_place(t, grad_output, record=self.applied)
        self.versions = [t._version if t is not None else None for t in self.tensors]
        # Fresh views: autograd can make them a leaf's .grad without a copy (it copies a tensor
        # that something else still references), and they share the version counters checked above.
        return tuple(t.view_as(t) if t is not None else None for t in self.tensors)


def keep_forward_gradients(ctx, tensors, *traced_by) -> None:
    """Keep gradients a forward op computed for a unit incoming gradient (None where not computed):
    on the eager route in a :class:`ForwardGradients` (rescaled in place by the first backward),
    traced (any of ``traced_by`` is being traced) as saved tensors. :func:`take_forward_gradients`
    hands them to the backward."""
    ctx.forward_gradients_eager = not tracing(*traced_by)
    if ctx.forward_gradients_eager:
        ctx.grads = ForwardGradients(tensors)
    else:
        ctx.save_for_backward(*tensors)


def take_forward_gradients(ctx, grad_output: Tensor) -> tuple:
    """The gradients :func:`keep_forward_gradients` kept, times the loss's incoming gradient."""
    if ctx.forward_gradients_eager:
        return ctx.grads.take(grad_output)
    return tuple(scale_forward_gradient(t, grad_output, None) if t is not None else None
                 for t in ctx.saved_tensors)


def _setup_context(ctx, inputs, output):
    logits, target, weight, ignore_index, label_smoothing, lse_square_scale, softcap, reduction = inputs[:8]
    in_forward, overwrite = inputs[9:]
    loss, z_loss, lse, grad, accuracy, predicted = output
    ctx.mark_non_differentiable(z_loss, lse, grad, accuracy, predicted)
    ctx.options = (ignore_index, label_smoothing, lse_square_scale, softcap, reduction)
    ctx.gradient_in_forward = in_forward
    # Eager: the forward-pass gradient is rescaled in place; traced: into a new tensor.
    ctx.eager = not tracing(logits, loss)
    if not in_forward:
        ctx.save_for_backward(logits, target, lse, weight)
    elif ctx.eager:
        ctx.grads = ForwardGradients([logits if overwrite else grad])
    else:
        ctx.save_for_backward(grad)


def _backward(ctx, grad_loss, *_):
    if not ctx.gradient_in_forward:
        logits, target, lse, weight = ctx.saved_tensors
        grad = cross_entropy_backward(grad_loss, logits, target, lse, weight, *ctx.options)
    elif ctx.eager:
        grad, = ctx.grads.take(grad_loss)
    else:
        grad = scale_forward_gradient(ctx.saved_tensors[0], grad_loss, None)
    return (grad,) + (None,) * 10


register_autograd(cross_entropy_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


class CrossEntropyOutput(NamedTuple):
    """What the losses return when token accuracy or predicted tokens are asked for: liger-kernel's
    ``CrossEntropyOutput`` fields, as a named tuple; a field not asked for is None."""

    loss: Tensor
    z_loss: Tensor | None = None
    token_accuracy: Tensor | None = None
    predicted_tokens: Tensor | None = None


def loss_outputs(shape, reduction: str, loss: Tensor, z_loss: Tensor, accuracy: Tensor, predicted: Tensor, *,
                 return_z_loss: bool, return_token_accuracy: bool, return_predicted_tokens: bool):
    """What the public loss functions return: the loss; ``(loss, z_loss)`` for ``return_z_loss``
    alone (Onca's API before the metrics); a :class:`CrossEntropyOutput` when the token accuracy or
    the predicted tokens are asked for. Per-token outputs take the target's ``shape``."""
    if reduction == "none":
        loss, z_loss = loss.view(shape), z_loss.view(shape)
    if not (return_token_accuracy or return_predicted_tokens):
        return (loss, z_loss) if return_z_loss else loss
    if return_token_accuracy and reduction == "none":
        accuracy = accuracy.view(shape)
    return CrossEntropyOutput(loss, z_loss if return_z_loss else None,
                              accuracy if return_token_accuracy else None,
                              predicted.view(shape) if return_predicted_tokens else None)


def validate_options(ignore_index, label_smoothing, reduction, lse_square_scale, softcap) -> None:
    """The scalar options shared by cross entropy and fused linear cross entropy."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_number(label_smoothing, "label_smoothing", minimum=0.0)
    if label_smoothing > 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    check_number(lse_square_scale, "lse_square_scale", minimum=0.0)
    if lse_square_scale == float("inf"):
        raise ValueError(f"lse_square_scale must be a finite number >= 0, got {lse_square_scale!r}")
    if softcap is not None:
        check_number(softcap, "softcap")
        if not 0.0 < softcap < float("inf"):
            raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")


def check_class_weight(weight, name: str, vocab: int, ref: Tensor, ref_name: str) -> Tensor | None:
    """Per-class weights ``(vocab,)`` as the kernel reads them (unit stride), or None."""
    if weight is None:
        return None
    check_float(weight, name)
    if tuple(weight.shape) != (vocab,):
        raise ValueError(f"{name} must have shape ({vocab},) (one weight per class), "
                         f"got {tuple(weight.shape)}")
    check_same_device(weight, name, ref, ref_name)
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} takes no gradient (as in torch): pass {name}.detach() or a tensor that "
                         "does not require grad")
    return weight.contiguous()


def check_target(target, name: str, shape: tuple[int, ...], what: str) -> Tensor:
    """``target`` as a 1-D index tensor, after checking its dtype and shape."""
    check_tensor(target, name)
    if target.dtype.is_floating_point:
        raise TypeError(
            f"{name} must be an int32 or int64 tensor of class indices, got {target.dtype} "
            "(class-probability targets are not supported)"
        )
    check_index(target, name)
    if target.shape != shape:  # torch.Size against torch.Size or a tuple: no tuples built per call
        raise ValueError(f"{name} must have shape {tuple(shape)} ({what}), got {tuple(target.shape)}")
    # The kernels read the targets at unit stride: a strided run (``labels[::2]``, or rows that
    # reshape into one strided run, as ``wide[:, ::2]``) is copied, 8 bytes a token.
    return target.reshape(-1).contiguous()


def torch_computes(lse_square_scale, softcap, label_smoothing, weight, *returns: bool) -> bool:
    """Whether torch's ``cross_entropy`` computes a call with these options without a host
    synchronisation: no z-loss, no soft cap, nothing returned but the loss, and not label smoothing
    with class weights (torch's mean then sums the weights of a ``masked_select``, whose size the
    host reads: caught by CUDA's sync debug mode on PyTorch 2.11) (:mod:`onca.ops._small_calls`)."""
    return (lse_square_scale == 0.0 and softcap is None and not any(returns)
            and not (label_smoothing and weight is not None))


# ATen's reduction argument (torch.nn._reduction.get_enum).
_REDUCTION_ENUM = {"none": 0, "mean": 1, "sum": 2}


def torch_cross_entropy(logits: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int,
                        label_smoothing: float, reduction: str) -> Tensor:
    """A small call's fp32 loss by torch's ops, from the fp32 logits as Hugging Face's loss takes
    them: ``logits`` ``(tokens, vocab)``, ``target`` ``(tokens,)``. A target outside the vocabulary
    stops torch's CUDA kernel with a device-side assertion (Onca's kernel gives NaN there)."""
    weight = None if weight is None else weight.float()  # read in fp32 whatever its dtype, as the kernel
    # ATen's ops without torch.nn.functional's Python wrappers (the caller has checked every
    # argument, and the route takes plain tensors only): host time is what a small call costs.
    if label_smoothing or logits.dtype == torch.float32:
        # One ATen call (log-softmax and the loss); a 16-bit head is cast first.
        return torch._C._nn.cross_entropy_loss(logits.float(), target, weight, _REDUCTION_ENUM[reduction],
                                               ignore_index, label_smoothing)
    # A 16-bit head without smoothing: the same values with the cast inside the log-softmax (whose
    # backward returns the logits' dtype). For fp16 on CUDA that is one small kernel fewer each way
    # (ATen's half-to-float log-softmax); bf16 is cast first there too (ATen's fast path is fp16's).
    log_probs = torch.log_softmax(logits, -1, dtype=torch.float32)
    return torch._C._nn.nll_loss_nd(log_probs, target, weight, _REDUCTION_ENUM[reduction], ignore_index)


def _validate_inputs(logits, target) -> Tensor:
    """``target`` as a 1-D tensor, after checking both."""
    check_float(logits, "logits")
    if logits.dim() < 2 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be (tokens, vocab) or (..., vocab) with vocab >= 1, "
                         f"got shape {tuple(logits.shape)}")
    target1d = check_target(target, "target", logits.shape[:-1], "the logits' shape without the vocab")
    check_same_device(target, "target", logits, "logits")
    return target1d


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    overwrite_logits: bool = False,
    *,
    weight: Tensor | None = None,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
):
    """Cross entropy of ``logits`` ``(..., vocab)`` against class indices ``target`` ``(...)``.

    As ``torch.nn.functional.cross_entropy`` (``ignore_index``, ``label_smoothing``, ``reduction``
    ``"none"``/``"mean"``/``"sum"``, per-class ``weight`` ``(vocab,)``; the mean divides by the
    summed weights of the non-ignored targets, their count without weights, and is NaN when
    there are none), plus the z-loss ``lse_square_scale * logsumexp(logits)**2`` per token (never
    class-weighted: a mean divides it by the count, as liger-kernel) and Gemma 2's logit
    soft-capping ``softcap * tanh(logits / softcap)``. A non-ignored target outside ``[0, vocab)``
    makes its token's loss and gradient NaN (never an out-of-bounds read); a small call on CUDA
    (torch's op, :mod:`onca.ops._small_calls`) stops with torch's device-side assertion instead.
    The class weights are read in fp32 whatever their float dtype, and take no gradient. The loss
    and the z-loss are fp32 whatever the logits' dtype (torch's would be the logits'; Hugging
    Face's causal-LM loss upcasts the logits first and is fp32): see the module docstring.
    ``return_z_loss=True`` returns ``(loss, z_loss)`` (the z-loss part, for logging).
    ``return_token_accuracy`` / ``return_predicted_tokens`` (found in the same pass, no gradient)
    return a :class:`CrossEntropyOutput` ``(loss, z_loss, token_accuracy, predicted_tokens)``, as
    liger-kernel: the argmax of each token's (soft-capped) logits, the first on ties, -1 where
    ignored; the accuracy per token (1/0, 0 where ignored) for ``reduction="none"``, else the
    fraction of non-ignored tokens predicted right (NaN when there are none).
    ``overwrite_logits=True`` computes the gradient in the forward pass and writes it over the
    logits (no second logits-sized buffer; the logits are destroyed; eager only, compiled graphs
    manage their own buffers). See the module docstring.
    """
    validate_options(ignore_index, label_smoothing, reduction, lse_square_scale, softcap)
    # One test a call; each flag is checked by name only where one of them is not a bool.
    if not (type(return_z_loss) is bool and type(overwrite_logits) is bool
            and type(return_token_accuracy) is bool and type(return_predicted_tokens) is bool):
        check_bool(return_z_loss, "return_z_loss")
        check_bool(overwrite_logits, "overwrite_logits")
        check_bool(return_token_accuracy, "return_token_accuracy")
        check_bool(return_predicted_tokens, "return_predicted_tokens")
    target1d = _validate_inputs(logits, target)
    weight = check_class_weight(weight, "weight", logits.shape[-1], logits, "logits")
    return checked_cross_entropy(logits, target, target1d, weight, ignore_index, label_smoothing, reduction,
                                 lse_square_scale, softcap, return_z_loss, overwrite_logits,
                                 return_token_accuracy, return_predicted_tokens)


def checked_cross_entropy(logits, target, target1d, weight, ignore_index, label_smoothing, reduction,
                          lse_square_scale, softcap, return_z_loss, overwrite_logits, return_token_accuracy,
                          return_predicted_tokens):
    """:func:`cross_entropy` of arguments its checks have passed (``target1d``: ``target`` as
    :func:`check_target` returns it; ``weight`` as :func:`check_class_weight` does), for an op
    that has checked them already (vocabulary-parallel cross entropy on one rank): a small call's
    host time is what it costs."""
    # overwrite_logits only lets the op reuse the logits: torch's route allocates instead.
    returns = (return_z_loss, return_token_accuracy, return_predicted_tokens)
    torch_can = torch_computes(lse_square_scale, softcap, label_smoothing, weight, *returns)
    if torch_can and small_calls.small(logits.numel(), logits, target):
        # 2-D logits and 1-D targets as they are: a view is one more autograd node, each way.
        needs_rows = logits.dim() > 2
        rows, labels = (as_rows(logits), target1d) if needs_rows else (logits, target)
        loss = torch_cross_entropy(rows, labels, weight, ignore_index, label_smoothing, reduction)
        return loss.view(target.shape) if needs_rows and reduction == "none" else loss
    x2d = as_rows(logits)
    gradient_in_forward = overwrite_logits and logits.requires_grad and torch.is_grad_enabled()
    overwrite = gradient_in_forward and not tracing(logits, target)
    loss, z_loss, _, _, accuracy, predicted = cross_entropy_forward(
        x2d, target1d, weight, ignore_index, float(label_smoothing), float(lse_square_scale),
        float(softcap) if softcap is not None else 0.0, reduction,
        return_token_accuracy or return_predicted_tokens, gradient_in_forward, overwrite,
    )
    return loss_outputs(target.shape, reduction, loss, z_loss, accuracy, predicted,
                        return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                        return_predicted_tokens=return_predicted_tokens)
