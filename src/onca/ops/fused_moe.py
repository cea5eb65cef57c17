"""Fused mixture-of-experts MLP: token routing, grouped expert GEMMs with the gated activation
between them, the weighted combine, and the whole backward, without a host synchronisation.

Semantics are those of the Hugging Face expert blocks (``MixtralExperts``, ``Qwen3MoeExperts``,
``GptOssExperts``): for each token ``t`` and each of its ``K`` routed slots ``(e, w)``,

    out[t] = sum_k  w[t, k] * (act(x[t] @ W_gate_up[e]^T + b_gate_up[e]) @ W_down[e]^T + b_down[e])

with ``act`` either SwiGLU ``silu(gate) * up`` (Mixtral, Qwen3-MoE and every model whose experts
hold ``gate_up_proj (E, 2I, H)`` with ``[gate | up]`` halves and ``down_proj (E, H, I)``) or
GPT-OSS's clamped SwiGLU ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
``g = min(gate, limit)`` (``layout="gpt_oss"``: ``gate_up_proj (E, H, 2I)`` with interleaved gate
and up columns, ``down_proj (E, I, H)``, and both biases). An expert index outside ``[0, E)`` (the
``E`` that Hugging Face uses to mask non-local experts under expert parallelism) contributes
nothing.

How it runs (every step on the device; counts and offsets never reach the host):

1. Routing metadata: the ``T * K`` (token, slot) pairs are sorted by expert (a stable device sort),
   per-expert counts and offsets are prefix sums, and each expert's rows are cut into tiles of
   ``block_m`` rows. The grouped kernels launch an upper bound of ``cdiv(T * K, block_m) + E``
   row tiles; each program finds its (expert, row range) from the per-expert tile offsets, and
   programs past the last tile exit.
2. Up GEMM: one kernel gathers ``x`` rows by token, multiplies by its expert's gate and up rows (two
   accumulators), adds the bias, stores the pre-activation (kept for backward) and the activation.
3. Down GEMM: the activation by the expert's ``down_proj``, plus bias, into one row per pair.
4. Combine: each token's ``K`` rows, weighted by their routing weights, summed in fp32.

Backward (``dout``): the down-projection GEMM's transpose ``dA = dout[token] @ W_down[e]`` is
computed per pair with the activation's backward fused in its epilogue (the pre-activation is
reloaded, the activation recomputed): it writes ``d_pre = w * dA * act'``, the activation (the
down weight gradient's operand, freed after it) and partial sums of ``dA . act`` per row (the
routing weight's gradient, plus ``dout . b_down[e]``: the down projection's output is never stored
for the backward). ``dx`` rows come from ``d_pre @ W_gate_up``, combined per token as in the
forward. Weight gradients are grouped GEMMs reduced over each expert's rows inside one program per
output tile (no atomics: deterministic), with the bias gradients summed alongside. Saved between
forward and backward: ``x``, the weights and routing, the ``(T*K, 2I)`` pre-activation and the
int32 routing metadata; the backward's largest transient buffers are ``d_pre`` ``(T*K, 2I)`` and
then either the activation ``(T*K, I)`` or ``dx``'s rows ``(T*K, H)``.

Rounding follows the models: the projections' results are rounded to the input dtype (and again
after a bias is added), SwiGLU rounds ``silu(gate)`` and the product, the weighted sum of a token's
expert outputs is accumulated in fp32 and rounded once (the models round each expert's weighted
output and add them in the input dtype; the difference is within one rounding per expert).
Routing weights may be fp32 (Mixtral) or the input dtype (Qwen3-MoE); their gradient has their dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile, get_profile
from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch
from onca.ops._validate import check_bool, check_float, check_index, check_number, check_same_device, check_tensor
from onca.tiling import MatmulPlan, RowPlan, cdiv, next_power_of_2, plan_matmul, plan_rows

__all__ = ["ACTIVATIONS", "LAYOUTS", "ROUTINGS", "fused_moe", "plan", "route"]

ACTIVATIONS = {"silu": 0, "gpt_oss": 1}
LAYOUTS = {"mixtral": 0, "gpt_oss": 1}
ROUTINGS = ("softmax_topk", "topk_softmax")

# Grouped-GEMM epilogues (the MODE constexpr).
_UP, _DOWN, _DOWN_BACKWARD, _INPUT_GRAD = 0, 1, 2, 3
# Weight-gradient kernel: which operands it builds (the WGRAD constexpr).
_WGRAD_DOWN, _WGRAD_UP = 0, 1
# Live tiles of the combine kernel: y rows, the output tile; fp32 accumulator and upcast.
COMBINE_TILES = dict(live_tiles=2, fp32_tiles=2)
# Each grouped GEMM's largest tile on a GPU (``plan_matmul``'s GPU limits: the widest column tile,
# the fp32 accumulator elements of one program, the pipeline's stages); the planner shrinks them to
# the problem and the budget, for 2-byte operands (fp32 keeps the planner's defaults). Other
# profiles are bounded by their on-chip budget alone. Measured on an H200 (device time, forward +
# backward, bf16, 2026-12-01): 128 x 256 output tiles (two 128 x 128 accumulators for the gated up
# GEMM) with four stages against 128 x 128 (128 x 64) with three, 1.20x-1.25x at the Mixtral 8x7B,
# Qwen3-30B-A3B and GPT-OSS-20B expert shapes. The down GEMM's backward keeps 128 x 128: its
# epilogue holds four more fp32 tiles.
GPU_GEMM_TILES = {
    "up": dict(max_block_n=128, max_acc_elements=2 * 128 * 128, num_stages=4),
    "down": dict(max_block_n=256, max_acc_elements=128 * 256, num_stages=4),
    "down_backward": dict(max_block_n=128, max_acc_elements=128 * 128, num_stages=4),
    "input_grad": dict(max_block_n=256, max_acc_elements=128 * 256, num_stages=4),
    "weight_grad": dict(max_block_n=256, max_acc_elements=128 * 256, num_stages=4),
}


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _gated(g, u, alpha, limit, ACTIVATION: tl.constexpr, DTYPE: tl.constexpr, WITH_GRAD: tl.constexpr):
    """The activation ``a`` of the fp32 gate and up tiles, and with ``WITH_GRAD`` its derivatives
    ``(da/dg, da/du)``."""
    if ACTIVATION == 0:  # silu(g) * u, silu rounded as the model materialises it
        s = tl.sigmoid(g)
        h = g * s
        hr = h.to(DTYPE).to(tl.float32)
        a = hr * u
        dg = a
        du = a
        if WITH_GRAD:
            dg = u * (s + h * (1.0 - s))
            du = hr
    else:  # GPT-OSS: (clamp(u, -limit, limit) + 1) * gc * sigmoid(alpha * gc), gc = min(g, limit)
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = tl.sigmoid(alpha * gc)
        glu = gc * s
        a = (uc + 1.0) * glu
        dg = a
        du = a
        if WITH_GRAD:
            dg = tl.where(g <= limit, (uc + 1.0) * (s + alpha * glu * (1.0 - s)), 0.0)
            du = tl.where((u >= -limit) & (u <= limit), glu, 0.0)
    return a, dg, du


@triton.jit
def _dot(a, b, acc, DTYPE: tl.constexpr, DOT_FP32: tl.constexpr):
    """``acc + a @ b`` with operands in ``DTYPE`` (fp32 ones, multiplied in full fp32, if ``DOT_FP32``)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a.to(DTYPE), b.to(DTYPE), acc)


@triton.jit
def _expert_tile(pid_m, info_ptr, n_experts, BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr):
    """``(expert, first row, end row)`` of row tile ``pid_m``; ``expert == n_experts`` past the last
    tile. ``info`` holds each expert's end row, then each expert's end tile (prefix sums)."""
    es = tl.arange(0, E_BLOCK)
    tile_end = tl.load(info_ptr + n_experts + es, mask=es < n_experts, other=2147483647)
    e = tl.sum((tile_end <= pid_m).to(tl.int32), axis=0)
    prev = tl.maximum(e - 1, 0)
    has_prev = e > 0
    last = tl.minimum(e, n_experts - 1)
    tile_start = tl.where(has_prev, tl.load(info_ptr + n_experts + prev), 0)
    seg_start = tl.where(has_prev, tl.load(info_ptr + prev), 0)
    seg_end = tl.load(info_ptr + last)
    row0 = seg_start + (pid_m - tile_start) * BLOCK_M
    return e, row0, seg_end


@fast_launch
@triton.jit
def _moe_gemm_kernel(
    a_ptr, order_ptr, w_ptr, bias_ptr, info_ptr,
    out_ptr, act_ptr, pre_ptr, weights_ptr, partial_ptr,
    n_experts, n_cols, n_inner, top_k,
    a_row_stride, w_stride_e, w_stride_n, w_stride_k, bias_stride_e,
    out_row_stride, act_row_stride, pre_row_stride, partial_row_stride,
    gate_step, up_offset, alpha, limit,
    MODE: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_BLOCK: tl.constexpr,
):
    """One ``(row tile, column tile)`` of a grouped GEMM over expert-sorted rows:
    ``acc[r, n] = sum_k A[r, k] * W[e, n, k]`` (``W``'s ``(n, k)`` read through strides, so that
    either orientation of a weight works), ``A``'s rows gathered by token when ``GATHER``.

    MODE 0 (up): two accumulators, gate rows ``n * gate_step`` and up rows ``n * gate_step +
    up_offset`` of ``W``; stores the pre-activation (in ``W``'s own column order) and the activation.
    MODE 1 (down) and 3 (input gradient): one accumulator (+ bias in MODE 1) stored to ``out``.
    MODE 2 (down backward): ``dA`` (one accumulator, gate/up columns of the pre-activation reloaded)
    -> ``d_pre`` stored over ``out`` in the pre-activation's layout, and ``sum_n dA * act`` stored as
    this column tile's partial sum of the routing weight's gradient.
    """
    DTYPE: tl.constexpr = w_ptr.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, row0, seg_end = _expert_tile(pid_m, info_ptr, n_experts, BLOCK_M, E_BLOCK)
    if e < n_experts:
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < seg_end
        rows64 = rows.to(tl.int64)
        if GATHER:
            slots = tl.load(order_ptr + rows, mask=row_mask, other=0)
            a_rows = (slots // top_k).to(tl.int64)
        else:
            a_rows = rows64
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        ks = tl.arange(0, BLOCK_K)
        w_e = w_ptr + e.to(tl.int64) * w_stride_e
        if MODE == 0:
            w_rows_g = (cols * gate_step).to(tl.int64)
            w_rows_u = w_rows_g + up_offset
        else:
            w_rows_g = cols.to(tl.int64)
            w_rows_u = w_rows_g
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, n_inner, BLOCK_K):
            k = k0 + ks
            k_mask = k < n_inner
            a = tl.load(a_ptr + a_rows[:, None] * a_row_stride + k[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            wk = k.to(tl.int64)[:, None] * w_stride_k
            wmask = k_mask[:, None] & col_mask[None, :]
            w = tl.load(w_e + wk + w_rows_g[None, :] * w_stride_n, mask=wmask, other=0.0)
            acc = _dot(a, w, acc, DTYPE, DOT_FP32)
            if MODE == 0:
                w2 = tl.load(w_e + wk + w_rows_u[None, :] * w_stride_n, mask=wmask, other=0.0)
                acc_u = _dot(a, w2, acc_u, DTYPE, DOT_FP32)
        mask = row_mask[:, None] & col_mask[None, :]
        if MODE == 0:
            g = acc.to(DTYPE).to(tl.float32)
            u = acc_u.to(DTYPE).to(tl.float32)
            if HAS_BIAS:
                b_e = bias_ptr + e.to(tl.int64) * bias_stride_e
                bg = tl.load(b_e + w_rows_g, mask=col_mask, other=0.0).to(tl.float32)
                bu = tl.load(b_e + w_rows_u, mask=col_mask, other=0.0).to(tl.float32)
                g = (g + bg[None, :]).to(DTYPE).to(tl.float32)
                u = (u + bu[None, :]).to(DTYPE).to(tl.float32)
            pre_rows = pre_ptr + rows64[:, None] * pre_row_stride
            tl.store(pre_rows + w_rows_g[None, :], g.to(DTYPE), mask=mask)
            tl.store(pre_rows + w_rows_u[None, :], u.to(DTYPE), mask=mask)
            act, _, _ = _gated(g, u, alpha, limit, ACTIVATION, DTYPE, False)
            tl.store(act_ptr + rows64[:, None] * act_row_stride + cols[None, :], act.to(DTYPE), mask=mask)
        elif MODE == 2:
            pre_rows = pre_ptr + rows64[:, None] * pre_row_stride
            g_cols = (cols * gate_step).to(tl.int64)[None, :]
            u_cols = g_cols + up_offset
            g = tl.load(pre_rows + g_cols, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(pre_rows + u_cols, mask=mask, other=0.0).to(tl.float32)
            act, dg, du = _gated(g, u, alpha, limit, ACTIVATION, DTYPE, True)
            act = act.to(DTYPE)
            tl.store(act_ptr + rows64[:, None] * act_row_stride + cols[None, :], act, mask=mask)
            act = act.to(tl.float32)
            wt = tl.load(weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
            part = tl.sum(tl.where(mask, acc * act, 0.0), axis=1)
            tl.store(partial_ptr + rows64 * partial_row_stride + pid_n, part, mask=row_mask)
            da = acc * wt[:, None]
            out_rows = out_ptr + rows64[:, None] * out_row_stride
            tl.store(out_rows + g_cols, (da * dg).to(DTYPE), mask=mask)
            tl.store(out_rows + u_cols, (da * du).to(DTYPE), mask=mask)
        else:
            y = acc
            if MODE == 1:
                y = y.to(DTYPE).to(tl.float32)
                if HAS_BIAS:
                    b = tl.load(bias_ptr + e.to(tl.int64) * bias_stride_e + cols, mask=col_mask, other=0.0)
                    y = y + b.to(tl.float32)[None, :]
            tl.store(out_ptr + rows64[:, None] * out_row_stride + cols[None, :],
                     y.to(out_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _moe_weight_grad_kernel(
    l_ptr, r_ptr, order_ptr, weights_ptr, info_ptr, dw_ptr, db_ptr,
    n_experts, n_rows_out, n_cols_out, top_k,
    l_row_stride, r_row_stride, dw_stride_e, dw_stride_n, dw_stride_k, db_stride_e,
    WGRAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``(n, k)`` tile of expert ``e``'s weight gradient ``dW[e] = sum_r L[r]^T R[r]`` over the
    expert's rows, in one program (deterministic), and the bias gradient ``sum_r L[r]`` where the
    program holds the first ``k`` tile.

    WGRAD 0 (down): ``L[r] = w_r * dout[token_r]`` (gathered, rounded as the model's gradient of the
    expert's output), ``R[r] = act[r]``. WGRAD 1 (up): ``L[r] = d_pre[r]``, ``R[r] = x[token_r]``
    (gathered).
    """
    DTYPE: tl.constexpr = r_ptr.dtype.element_ty
    e = tl.program_id(1)
    n_tiles_n = tl.cdiv(n_rows_out, BLOCK_N)
    n_tiles_k = tl.cdiv(n_cols_out, BLOCK_K)
    seg_start = tl.where(e > 0, tl.load(info_ptr + tl.maximum(e - 1, 0)), 0)
    seg_end = tl.load(info_ptr + e)
    # The expert's tiles, over however many programs the grid gives it (all on a GPU; a few on a
    # persistent device, whose grid is bounded). The operand stored per sorted row (act, d_pre:
    # wide, read by this expert alone) is the slow index, so that the programs running together
    # share its slice and read it from memory once; the gathered token rows (dout, x: shared by
    # every expert, a few MB) are the fast one and stay in L2.
    for tile in tl.range(tl.program_id(0), n_tiles_n * n_tiles_k, tl.num_programs(0)):
        if WGRAD == 0:
            pid_k = tile // n_tiles_n
            pid_n = tile % n_tiles_n
        else:
            pid_n = tile // n_tiles_k
            pid_k = tile % n_tiles_k
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = ns < n_rows_out
        ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < n_cols_out
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        bias_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for m0 in range(seg_start, seg_end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_mask = rows < seg_end
            rows64 = rows.to(tl.int64)
            slots = tl.load(order_ptr + rows, mask=row_mask, other=0)
            tokens = (slots // top_k).to(tl.int64)
            lmask = row_mask[:, None] & n_mask[None, :]
            rmask = row_mask[:, None] & k_mask[None, :]
            if WGRAD == 0:
                wt = tl.load(weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
                dy = tl.load(l_ptr + tokens[:, None] * l_row_stride + ns[None, :], mask=lmask, other=0.0)
                lt32 = dy.to(tl.float32) * wt[:, None]
                lt = lt32.to(DTYPE)
                rt = tl.load(r_ptr + rows64[:, None] * r_row_stride + ks[None, :], mask=rmask, other=0.0)
            else:
                # Straight from memory to the dot (no register pass), fp32 only for the bias sum.
                lt = tl.load(l_ptr + rows64[:, None] * l_row_stride + ns[None, :], mask=lmask, other=0.0)
                lt32 = lt.to(tl.float32)
                rt = tl.load(r_ptr + tokens[:, None] * r_row_stride + ks[None, :], mask=rmask, other=0.0)
            acc = _dot(tl.trans(lt), rt, acc, DTYPE, DOT_FP32)
            if HAS_BIAS:
                bias_acc += tl.sum(lt32, axis=0)
        e64 = e.to(tl.int64)
        out = dw_ptr + e64 * dw_stride_e + ns.to(tl.int64)[:, None] * dw_stride_n + ks.to(tl.int64)[None, :] * dw_stride_k
        tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])
        if HAS_BIAS:
            tl.store(db_ptr + e64 * db_stride_e + ns, bias_acc, mask=tl.where(pid_k == 0, n_mask, False))


@fast_launch
@triton.jit
def _moe_combine_kernel(
    y_ptr, inv_ptr, weights_ptr, info_ptr, out_ptr,
    n_tokens, n_cols, n_experts, top_k, y_row_stride, out_row_stride,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """``out[t] = sum_k w[t, k] * y[inv[t * K + k]]`` in fp32 (``w = 1`` without weights); slots
    whose sorted row lies past the last expert's end (masked experts) contribute nothing."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_valid = tl.load(info_ptr + n_experts - 1)
    n_row_blocks = tl.cdiv(n_tokens, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        tokens = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        token_mask = tokens < n_tokens
        tokens64 = tokens.to(tl.int64)
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            col_mask = cols < n_cols
            acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            for k in range(top_k):
                slot = tokens64 * top_k + k
                r = tl.load(inv_ptr + slot, mask=token_mask, other=0)
                valid = token_mask & (r < n_valid)
                y = tl.load(y_ptr + r.to(tl.int64)[:, None] * y_row_stride + cols[None, :],
                            mask=valid[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
                if HAS_WEIGHTS:
                    w = tl.load(weights_ptr + slot, mask=valid, other=0.0).to(tl.float32)
                    y = y * w[:, None]
                acc += y
            tl.store(out_ptr + tokens64[:, None] * out_row_stride + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=token_mask[:, None] & col_mask[None, :])


# --------------------------------------------------------------------------------------- launchers


def _dims(x: Tensor, gate_up_proj: Tensor, layout: int) -> tuple[int, int, int]:
    """``(E, H, I)`` of the expert weights."""
    e = gate_up_proj.shape[0]
    h = x.shape[1]
    i = (gate_up_proj.shape[1] if layout == 0 else gate_up_proj.shape[2]) // 2
    return e, h, i


def _nk(w: Tensor, transposed: bool) -> tuple[int, int, int]:
    """``(stride_e, stride_n, stride_k)`` of ``w`` seen as ``(E, N, K)`` (out, in); ``transposed``:
    ``w`` is stored ``(E, K, N)``."""
    se, s1, s2 = w.stride()
    return (se, s2, s1) if transposed else (se, s1, s2)


def _gate_columns(layout: int, i: int) -> tuple[int, int]:
    """``(gate_step, up_offset)``: gate column ``n`` of the pre-activation is ``n * gate_step``, its
    up column ``n * gate_step + up_offset`` ([gate | up] halves, or GPT-OSS's interleaving)."""
    return (1, i) if layout == 0 else (2, 1)


def _dot_fp32(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` takes fp32 operands: for fp32 inputs (multiplied in full fp32, as torch's
    matmul does by default, not TF32), and under Triton's interpreter, whose ``tl.dot`` cannot
    multiply bf16/fp16 (an exact upcast there: the products and sums are the same)."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _gemm_plan(gemm: str, m: int, n: int, k: int, dtype: torch.dtype, profile: DeviceProfile | None = None,
               **options) -> MatmulPlan:
    """``plan_matmul`` for one of the op's grouped GEMMs (a key of ``GPU_GEMM_TILES``)."""
    profile = profile or get_profile()
    # fp32 operands keep the planner's defaults, as timed: the wide tiles' stages of fp32 operands
    # exceed the 227 KB of shared memory an H100/H200 program may hold (294912 bytes asked on an
    # H200), and the tiles the planner would shrink them to were never measured.
    wide = profile.kind == "cuda" and dtype.itemsize <= 2
    limits = GPU_GEMM_TILES[gemm] if wide else {}
    return plan_matmul(m, n, k, dtype, profile, **limits, **options)


def _row_plan(pairs: int, n_experts: int, h: int, i: int, dtype: torch.dtype,
              profile: DeviceProfile | None = None) -> MatmulPlan:
    """The up GEMM's plan, whose row tile every grouped GEMM of the op shares."""
    return _gemm_plan("up", max(1, pairs // max(1, n_experts)), i, h, dtype, profile, accumulators=2)


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None, *, num_experts: int = 8,
         top_k: int = 2, intermediate: int | None = None) -> dict[str, RowPlan | MatmulPlan]:
    """The plans for ``x`` of ``shape`` ``(..., hidden)`` routed to ``top_k`` of ``num_experts``
    experts of ``intermediate`` width (default: the hidden size)."""
    tokens = 1
    for s in shape[:-1]:
        tokens *= int(s)
    h = int(shape[-1])
    i = intermediate or h
    pairs = max(1, tokens * top_k)
    up = _row_plan(pairs, num_experts, h, i, dtype, profile)
    bm = up.block_m
    per_expert = max(1, pairs // num_experts)
    return {
        "up": up,
        "down": _gemm_plan("down", per_expert, h, i, dtype, profile, block_m=bm),
        "down_backward": _gemm_plan("down_backward", per_expert, i, h, dtype, profile, epilogue_tiles=4,
                                    block_m=bm),
        "input_grad": _gemm_plan("input_grad", per_expert, h, 2 * i, dtype, profile, block_m=bm),
        "down_weight_grad": _gemm_plan("weight_grad", h, i, per_expert, dtype, profile),
        "up_weight_grad": _gemm_plan("weight_grad", 2 * i, h, per_expert, dtype, profile),
        "combine": plan_rows(max(1, tokens), h, dtype, profile=profile, **COMBINE_TILES),
    }


def _routing_metadata(top_k_index: Tensor, n_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(order, inv, info)``, all int32 on the device: ``order[r]`` the (token * K + slot) pair of
    sorted row ``r`` (pairs sorted by expert, stable; masked pairs last), ``inv`` its inverse, and
    ``info`` each expert's end row then end tile (``(2, E)`` prefix sums)."""
    flat = top_k_index.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < n_experts)
    keys = torch.where(valid, flat, n_experts)
    order = torch.sort(keys, stable=True).indices
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, keys, torch.ones_like(keys))
    counts = counts[:n_experts]
    seg_end = torch.cumsum(counts, 0)
    tile_end = torch.cumsum((counts + block_m - 1) // block_m, 0)
    info = torch.stack((seg_end, tile_end)).to(torch.int32)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return order.to(torch.int32), inv.to(torch.int32), info


def _max_row_tiles(pairs: int, n_experts: int, block_m: int) -> int:
    return cdiv(pairs, block_m) + n_experts


def _gemm(mode: int, a: Tensor, order: Tensor, w: Tensor, w_nk, bias: Tensor | None, info: Tensor,
          out: Tensor, n_cols: int, n_inner: int, top_k: int, p: MatmulPlan, n_tiles_m: int, *,
          gather: bool, act: Tensor | None = None, pre: Tensor | None = None, weights: Tensor | None = None,
          partial: Tensor | None = None, gate_cols=(1, 0), activation: int = 0, alpha: float = 0.0,
          limit: float = 0.0) -> None:
    n_experts = w.shape[0]
    # Absent operands are never read (constexpr switches); ``out`` stands in for them.
    act_, pre_, wts, part, b = (out if t is None else t for t in (act, pre, weights, partial, bias))
    grid = (n_tiles_m, cdiv(n_cols, p.block_n))
    _moe_gemm_kernel[grid](
        a, order, w, b, info, out, act_, pre_, wts, part,
        n_experts, n_cols, n_inner, top_k,
        a.stride(0), *w_nk, b.stride(0) if bias is not None else 0,
        out.stride(0), act_.stride(0), pre_.stride(0), part.stride(0),
        gate_cols[0], gate_cols[1], alpha, limit,
        MODE=mode, GATHER=gather, HAS_BIAS=bias is not None, ACTIVATION=activation,
        DOT_FP32=_dot_fp32(w.dtype), BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
        E_BLOCK=next_power_of_2(n_experts), num_warps=p.num_warps, num_stages=p.num_stages,
    )


def _combine(y: Tensor, inv: Tensor, weights: Tensor | None, info: Tensor, n_tokens: int, top_k: int,
             dtype: torch.dtype) -> Tensor:
    h = y.shape[1]
    out = torch.empty((n_tokens, h), dtype=dtype, device=y.device)
    p = plan_rows(n_tokens, h, dtype, **COMBINE_TILES)
    _moe_combine_kernel[(p.grid,)](
        y, inv, y if weights is None else weights, info, out,
        n_tokens, h, info.shape[1], top_k, y.stride(0), out.stride(0),
        HAS_WEIGHTS=weights is not None, BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols,
        COL_TILES=p.col_tiles, num_warps=p.num_warps,
    )
    return out


def _weight_grad(mode: int, lhs: Tensor, rhs: Tensor, order: Tensor, weights: Tensor | None, info: Tensor,
                 dw: Tensor, dw_nk, db: Tensor | None, n_out: int, k_out: int, top_k: int) -> None:
    n_experts = dw.shape[0]
    pairs = order.numel()
    p = _gemm_plan("weight_grad", n_out, k_out, max(1, pairs // n_experts), rhs.dtype)
    tiles = cdiv(n_out, p.block_n) * cdiv(k_out, p.block_k)
    profile = get_profile()
    # A persistent device (Ascend: at most 65535 programs) gets about one program per compute
    # unit, each expert's programs looping over its tiles; a GPU one program per tile. The expert
    # is the slow grid axis: the programs running together work on one expert's rows.
    grid = (min(tiles, max(1, profile.compute_units // n_experts)) if profile.persistent else tiles, n_experts)
    wts = lhs if weights is None else weights
    bias = dw if db is None else db
    # The rows are the reduction here: the plan's (m, n, k) tile is (n_out, k_out, rows).
    _moe_weight_grad_kernel[grid](
        lhs, rhs, order, wts, info, dw, bias,
        n_experts, n_out, k_out, top_k,
        lhs.stride(0), rhs.stride(0), *dw_nk, bias.stride(0),
        WGRAD=mode, HAS_BIAS=db is not None,
        DOT_FP32=_dot_fp32(rhs.dtype), BLOCK_M=p.block_k, BLOCK_N=p.block_m, BLOCK_K=p.block_n,
        num_warps=p.num_warps, num_stages=p.num_stages,
    )


@custom_op("fused_moe_forward")
def fused_moe_forward(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, gate_up_proj_bias: Tensor | None,
                      down_proj_bias: Tensor | None, top_k_index: Tensor, top_k_weights: Tensor,
                      layout: int, activation: int, alpha: float, limit: float
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(out, pre, order, inv, info)`` for the 2-D ``x`` ``(T, H)`` and ``(T, K)`` routing: the
    output, the ``(T*K, 2I)`` pre-activation in expert-sorted row order, and the routing metadata
    (see ``_routing_metadata``); all but ``out`` are kept for the backward."""
    t, k = top_k_index.shape
    e, h, i = _dims(x, gate_up_proj, layout)
    pairs = t * k
    up = _row_plan(pairs, e, h, i, x.dtype)
    order, inv, info = _routing_metadata(top_k_index, e, up.block_m)
    pre = x.new_empty((pairs, 2 * i))
    if t == 0:
        return x.new_zeros((0, h)), pre, order, inv, info
    gate_cols = _gate_columns(layout, i)
    n_tiles_m = _max_row_tiles(pairs, e, up.block_m)
    act = x.new_empty((pairs, i))
    _gemm(_UP, x, order, gate_up_proj, _nk(gate_up_proj, layout == 1), gate_up_proj_bias, info, pre, i, h, k,
          up, n_tiles_m, gather=True, act=act, pre=pre, gate_cols=gate_cols, activation=activation,
          alpha=alpha, limit=limit)
    y = x.new_empty((pairs, h))
    down = _gemm_plan("down", max(1, pairs // e), h, i, x.dtype, block_m=up.block_m)
    _gemm(_DOWN, act, order, down_proj, _nk(down_proj, layout == 1), down_proj_bias, info, y, h, i, k,
          down, n_tiles_m, gather=False)
    del act
    out = _combine(y, inv, top_k_weights.reshape(-1), info, t, k, x.dtype)
    return out, pre, order, inv, info


@fused_moe_forward.register_fake
def _(x, gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias, top_k_index, top_k_weights, layout,
      activation, alpha, limit):
    t, k = top_k_index.shape
    e, h, i = _dims(x, gate_up_proj, layout)
    int32 = dict(dtype=torch.int32)
    return (x.new_empty((t, h)), x.new_empty((t * k, 2 * i)), x.new_empty(t * k, **int32),
            x.new_empty(t * k, **int32), x.new_empty((2, e), **int32))


@custom_op("fused_moe_backward")
def fused_moe_backward(dout: Tensor, x: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
                       gate_up_proj_bias: Tensor | None, down_proj_bias: Tensor | None, top_k_index: Tensor,
                       top_k_weights: Tensor, pre: Tensor, order: Tensor, inv: Tensor, info: Tensor,
                       layout: int, activation: int, alpha: float, limit: float
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, d_gate_up_proj, d_down_proj, d_gate_up_proj_bias, d_down_proj_bias, d_top_k_weights)``;
    a bias gradient is empty where there is no bias."""
    t, k = top_k_index.shape
    e, h, i = _dims(x, gate_up_proj, layout)
    pairs = t * k
    d_b1 = x.new_empty(0) if gate_up_proj_bias is None else torch.zeros_like(gate_up_proj_bias)
    d_b2 = x.new_empty(0) if down_proj_bias is None else torch.zeros_like(down_proj_bias)
    if t == 0:
        return (torch.zeros_like(x), torch.zeros_like(gate_up_proj), torch.zeros_like(down_proj), d_b1, d_b2,
                torch.zeros_like(top_k_weights))
    dout = dout.contiguous()
    transposed = layout == 1
    gate_cols = _gate_columns(layout, i)
    opts = dict(gate_cols=gate_cols, activation=activation, alpha=alpha, limit=limit)
    up = _row_plan(pairs, e, h, i, x.dtype)
    n_tiles_m = _max_row_tiles(pairs, e, up.block_m)
    per_expert = max(1, pairs // e)
    # The routing weight of each sorted row.
    weights_sorted = top_k_weights.reshape(-1)[order.to(torch.int64)]

    # dA = dout[token] @ W_down[e] (W_down seen as (I, H)), with the activation's backward fused; it
    # also stores the activation it recomputes, the down weight gradient's operand (recomputing it
    # there instead costs a sigmoid per element per hidden tile, more than that GEMM's own time).
    p = _gemm_plan("down_backward", per_expert, i, h, x.dtype, epilogue_tiles=4, block_m=up.block_m)
    n_col_tiles = cdiv(i, p.block_n)
    partial = torch.zeros((pairs, n_col_tiles), dtype=torch.float32, device=x.device)
    d_pre = torch.empty_like(pre)
    act = x.new_empty((pairs, i))
    _gemm(_DOWN_BACKWARD, dout, order, down_proj, _nk(down_proj, not transposed), None, info, d_pre, i, h, k, p,
          n_tiles_m, gather=True, act=act, pre=pre, weights=weights_sorted, partial=partial, **opts)
    dw_sorted = partial.sum(1)
    del partial
    if down_proj_bias is not None:
        # dout[token_r] . b_down[e_r]: one (T, E) product, then each row's entry.
        flat = top_k_index.reshape(-1).to(torch.int64)[order.to(torch.int64)]
        valid = (flat >= 0) & (flat < e)
        by_expert = dout.float() @ down_proj_bias.float().t()
        tokens = order.to(torch.int64) // k
        dw_sorted = dw_sorted + torch.where(valid, by_expert[tokens, flat.clamp(0, e - 1)], 0.0)
    d_weights = dw_sorted[inv.to(torch.int64)].view(t, k).to(top_k_weights.dtype)

    # dW_down[e] (H, I) = sum_r (w_r dout[token_r])^T act_r; db_down[e] = sum_r w_r dout[token_r].
    # Before the input gradient, so that act is freed before dx's rows are allocated.
    d_w2 = torch.empty_like(down_proj)
    db2 = None if down_proj_bias is None else torch.zeros(down_proj_bias.shape, dtype=torch.float32,
                                                          device=x.device)
    _weight_grad(_WGRAD_DOWN, dout, act, order, weights_sorted, info, d_w2, _nk(d_w2, transposed), db2, h, i, k)
    del act

    # dx rows = d_pre @ W_gate_up[e] (seen as (H, 2I)), then each token's K rows summed.
    p = _gemm_plan("input_grad", per_expert, h, 2 * i, x.dtype, block_m=up.block_m)
    dx_rows = x.new_empty((pairs, h))
    _gemm(_INPUT_GRAD, d_pre, order, gate_up_proj, _nk(gate_up_proj, not transposed), None, info, dx_rows, h,
          2 * i, k, p, n_tiles_m, gather=False)
    dx = _combine(dx_rows, inv, None, info, t, k, x.dtype)
    del dx_rows

    # dW_gate_up[e] (2I, H) = sum_r d_pre_r^T x[token_r]; db_gate_up[e] = sum_r d_pre_r.
    d_w1 = torch.empty_like(gate_up_proj)
    db1 = None if gate_up_proj_bias is None else torch.zeros(gate_up_proj_bias.shape, dtype=torch.float32,
                                                             device=x.device)
    _weight_grad(_WGRAD_UP, d_pre, x, order, None, info, d_w1, _nk(d_w1, transposed), db1, 2 * i, h, k)
    if db1 is not None:
        d_b1 = db1.to(gate_up_proj_bias.dtype)
    if db2 is not None:
        d_b2 = db2.to(down_proj_bias.dtype)
    return dx, d_w1, d_w2, d_b1, d_b2, d_weights


@fused_moe_backward.register_fake
def _(dout, x, gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias, top_k_index, top_k_weights, pre,
      order, inv, info, layout, activation, alpha, limit):
    bias_grad = lambda b: x.new_empty(0) if b is None else torch.empty_like(b)  # noqa: E731
    return (torch.empty_like(x), torch.empty_like(gate_up_proj), torch.empty_like(down_proj),
            bias_grad(gate_up_proj_bias), bias_grad(down_proj_bias), torch.empty_like(top_k_weights))


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    x, w1, w2, b1, b2, top_k_index, top_k_weights, layout, activation, alpha, limit = inputs
    _out, pre, order, inv, info = output
    ctx.mark_non_differentiable(pre, order, inv, info)
    ctx.save_for_backward(x, w1, w2, b1, b2, top_k_index, top_k_weights, pre, order, inv, info)
    ctx.options = (layout, activation, alpha, limit)


def _backward(ctx, dout, _dpre, _dorder, _dinv, _dinfo):
    x, w1, w2, b1, b2, top_k_index, top_k_weights, pre, order, inv, info = ctx.saved_tensors
    dx, dw1, dw2, db1, db2, dweights = fused_moe_backward(dout, x, w1, w2, b1, b2, top_k_index, top_k_weights,
                                                          pre, order, inv, info, *ctx.options)
    return (dx, dw1, dw2, None if b1 is None else db1, None if b2 is None else db2, None, dweights,
            None, None, None, None)


register_autograd(fused_moe_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def route(router_logits: Tensor, top_k: int, routing: str = "softmax_topk",
          norm_topk_prob: bool = True) -> tuple[Tensor, Tensor]:
    """``(top_k_index, top_k_weights)`` from ``router_logits (..., E)``, as the models' routers:
    ``"softmax_topk"`` (Mixtral, Qwen3-MoE): softmax over all experts in fp32, the ``top_k`` largest
    probabilities, renormalised to sum to one when ``norm_topk_prob``; ``"topk_softmax"``
    (GPT-OSS): the ``top_k`` largest logits, softmax over them in fp32. Plain torch ops on the
    device (differentiable with respect to the logits); the weights are fp32."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    if routing == "softmax_topk":
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, index = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        logits, index = torch.topk(router_logits, top_k, dim=-1)
        weights = torch.softmax(logits.float(), dim=-1)
    return index, weights


def _check_weight(w, name: str, x, dims: tuple[int, ...], what: str) -> None:
    check_float(w, name)
    check_same_device(w, name, x, "x")
    if w.dtype != x.dtype:
        raise TypeError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
    if tuple(w.shape) != dims:
        raise ValueError(f"{name} must have shape {dims} ({what}), got {tuple(w.shape)}")


def fused_moe(
    x: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    top_k_index: Tensor | None = None,
    top_k_weights: Tensor | None = None,
    *,
    router_logits: Tensor | None = None,
    top_k: int | None = None,
    routing: str = "softmax_topk",
    norm_topk_prob: bool = True,
    gate_up_proj_bias: Tensor | None = None,
    down_proj_bias: Tensor | None = None,
    layout: str = "mixtral",
    activation: str | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """The experts of a mixture-of-experts MLP, routed, computed and combined:
    ``out[t] = sum_k w[t,k] * down_e(act(gate_up_e(x[t])))`` over each token's ``K`` experts ``e``.

    ``x``: ``(..., H)``. Routing: either ``top_k_index`` (int, ``(..., K)``) with ``top_k_weights``
    (float, ``(..., K)``, differentiable), as the models' expert modules receive them, or
    ``router_logits`` (``(..., E)``, differentiable) with ``top_k``, routed by :func:`route`
    (``routing``, ``norm_topk_prob``). An index outside ``[0, E)`` is a masked slot (no
    contribution), as the models' ``E`` under expert parallelism.

    ``layout="mixtral"`` (Mixtral, Qwen3-MoE, liger-kernel's ``LigerFusedMoEFunction``):
    ``gate_up_proj (E, 2I, H)`` whose rows are ``[gate | up]``, ``down_proj (E, H, I)``, activation
    ``"silu"`` (SwiGLU). ``layout="gpt_oss"`` (``GptOssExperts``): ``gate_up_proj (E, H, 2I)`` with
    interleaved gate/up columns, ``down_proj (E, I, H)``, activation ``"gpt_oss"`` (the clamped
    SwiGLU with ``alpha`` and ``limit``). ``activation`` overrides the layout's default. Optional
    ``gate_up_proj_bias (E, 2I)`` and ``down_proj_bias (E, H)`` (GPT-OSS has both), in the layout's
    column order. Weights must have ``x``'s dtype. Returns ``(..., H)`` in ``x``'s dtype; every
    weight, bias, ``x`` and the routing weights (or logits) get gradients. Nothing synchronises
    with the host.
    """
    check_float(x, "x")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension (hidden), got shape {tuple(x.shape)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    activation = activation if activation is not None else ("silu" if layout == "mixtral" else "gpt_oss")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    check_number(alpha, "alpha")
    check_number(limit, "limit", minimum=0.0)
    check_tensor(gate_up_proj, "gate_up_proj")
    check_tensor(down_proj, "down_proj")
    if gate_up_proj.dim() != 3:
        raise ValueError(f"gate_up_proj must be 3-D (experts, ...), got shape {tuple(gate_up_proj.shape)}")
    h = x.shape[-1]
    n_experts = gate_up_proj.shape[0]
    two_i = gate_up_proj.shape[1] if layout == "mixtral" else gate_up_proj.shape[2]
    if n_experts == 0 or two_i == 0 or two_i % 2:
        raise ValueError(f"gate_up_proj must hold at least one expert and an even, non-zero gate+up width, "
                         f"got shape {tuple(gate_up_proj.shape)}")
    i = two_i // 2
    if layout == "mixtral":
        _check_weight(gate_up_proj, "gate_up_proj", x, (n_experts, 2 * i, h), "experts, 2 * intermediate, hidden")
        _check_weight(down_proj, "down_proj", x, (n_experts, h, i), "experts, hidden, intermediate")
    else:
        _check_weight(gate_up_proj, "gate_up_proj", x, (n_experts, h, 2 * i), "experts, hidden, 2 * intermediate")
        _check_weight(down_proj, "down_proj", x, (n_experts, i, h), "experts, intermediate, hidden")
    if gate_up_proj_bias is not None:
        _check_weight(gate_up_proj_bias, "gate_up_proj_bias", x, (n_experts, 2 * i), "experts, 2 * intermediate")
    if down_proj_bias is not None:
        _check_weight(down_proj_bias, "down_proj_bias", x, (n_experts, h), "experts, hidden")
    lead = tuple(x.shape[:-1])
    if router_logits is not None:
        if top_k_index is not None or top_k_weights is not None:
            raise ValueError("give either router_logits (with top_k) or top_k_index and top_k_weights, not both")
        check_float(router_logits, "router_logits")
        check_same_device(router_logits, "router_logits", x, "x")
        if tuple(router_logits.shape) != lead + (n_experts,):
            raise ValueError(f"router_logits must have shape {lead + (n_experts,)} (x's tokens, experts), "
                             f"got {tuple(router_logits.shape)}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be an int in [1, {n_experts}] with router_logits, got {top_k!r}")
        check_bool(norm_topk_prob, "norm_topk_prob")
        top_k_index, top_k_weights = route(router_logits, top_k, routing, norm_topk_prob)
    else:
        if top_k_index is None or top_k_weights is None:
            raise ValueError("fused_moe needs top_k_index and top_k_weights, or router_logits and top_k")
        check_index(top_k_index, "top_k_index")
        check_float(top_k_weights, "top_k_weights")
        check_same_device(top_k_index, "top_k_index", x, "x")
        check_same_device(top_k_weights, "top_k_weights", x, "x")
        if top_k_index.dim() == 0 or tuple(top_k_index.shape[:-1]) != lead or top_k_index.shape[-1] == 0:
            raise ValueError(f"top_k_index must have shape {lead + ('K',)} (x's tokens, K >= 1), "
                             f"got {tuple(top_k_index.shape)}")
        if top_k_weights.shape != top_k_index.shape:
            raise ValueError(f"top_k_weights must have top_k_index's shape {tuple(top_k_index.shape)}, "
                             f"got {tuple(top_k_weights.shape)}")
    k = top_k_index.shape[-1]
    x2 = x.reshape(-1, h).contiguous()
    out, *_ = fused_moe_forward(
        x2, gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias,
        top_k_index.reshape(-1, k).contiguous(), top_k_weights.reshape(-1, k).contiguous(),
        LAYOUTS[layout], ACTIVATIONS[activation], float(alpha), float(limit),
    )
    return out.view(x.shape)
