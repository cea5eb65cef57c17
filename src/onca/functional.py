"""The public functional API: thin, documented entry points to the ops' autograd Functions."""

from __future__ import annotations

import torch

from onca.ops.attn_res import attn_res as _attn_res
from onca.ops.cross_entropy import cross_entropy as _cross_entropy
from onca.ops.embedding import embedding as _embedding
from onca.ops.fused_add_rms_norm import fused_add_rms_norm as _fused_add_rms_norm
from onca.ops.fused_linear_cross_entropy import fused_linear_cross_entropy as _flce
from onca.ops.fused_linear_jsd import fused_linear_jsd as _fused_linear_jsd
from onca.ops.geglu import geglu as _geglu
from onca.ops.geglu import geglu_linear as _geglu_linear
from onca.ops.jsd import jsd as _jsd
from onca.ops.kl_div import kl_div as _kl_div
from onca.ops.layer_norm import layer_norm as _layer_norm
from onca.ops.rms_norm import rms_norm as _rms_norm
from onca.ops.rope import rotary_pos_emb as _rotary_pos_emb
from onca.ops.swiglu import swiglu as _swiglu
from onca.ops.swiglu import swiglu_linear as _swiglu_linear

__all__ = [
    "rms_norm",
    "layer_norm",
    "fused_add_rms_norm",
    "swiglu",
    "geglu",
    "swiglu_linear",
    "geglu_linear",
    "rotary_pos_emb",
    "embedding",
    "attn_res",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "kl_div",
    "jsd",
    "fused_linear_jsd",
]



# -------------------------------------------------------------------------------- Normalisation


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    in_place: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2) + eps) * (offset + weight)``.

    ``casting_mode`` is ``"llama"`` (normalise in fp32, cast to ``x``'s dtype, then scale),
    ``"gemma"`` (all in fp32, then cast; use with ``offset=1.0`` for Gemma's ``1 + w``) or
    ``"none"`` (round to ``x``'s dtype at each step). The result has ``x``'s dtype and shape.
    ``in_place=True`` lets the backward pass write ``dx`` into the incoming gradient's storage.
    """
    return _rms_norm(x, weight, eps, offset, casting_mode, in_place)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    ``torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)`` with Onca's kernels:
    biased variance, fp32 statistics and affine transform, one rounding to ``x``'s dtype.
    ``weight`` and ``bias`` may be None; they may be fp32 with bf16/fp16 ``x``.
    """
    return _layer_norm(x, weight, bias, eps)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass: a decoder layer's residual add and
    the RMSNorm that follows it.

    ``x + residual`` is rounded to ``x``'s dtype as PyTorch's add rounds it; the RMSNorm takes
    ``eps``, ``offset`` and ``casting_mode`` as ``onca.functional.rms_norm`` does. ``x`` and
    ``residual`` receive the same gradient. ``in_place=True`` lets the backward pass write it into
    the storage of the incoming gradient of the normalised output.
    """
    return _fused_add_rms_norm(x, residual, weight, eps, offset, casting_mode, in_place)


# ------------------------------------------------------------------------ Gated MLP activations


def swiglu(a: torch.Tensor, b: torch.Tensor | None = None, in_place: bool = False) -> torch.Tensor:
    """SwiGLU ``silu(a) * b`` over ``(..., intermediate)``, rounded as the Hugging Face MLPs round.

    ``a`` and ``b`` (gate and up projections) may be strided row views, e.g. the halves of a fused
    ``gate_up`` output, and are not copied. ``b=None``: ``a`` is that fused ``[gate | up]`` tensor
    ``(..., 2 * intermediate)`` itself. The backward recomputes ``silu(a)``; ``in_place=True`` writes
    the gradients over ``a`` and ``b`` (no allocation; do not reuse ``a``/``b`` or backward twice).
    """
    return _swiglu(a, b, in_place)


def geglu(a: torch.Tensor, b: torch.Tensor | None = None, approximate: str = "tanh",
          in_place: bool = False) -> torch.Tensor:
    """GeGLU ``gelu(a) * b``; ``approximate="tanh"`` (Gemma's ``gelu_pytorch_tanh``) or ``"none"``
    (exact erf). Layouts, ``b=None`` and ``in_place`` as in :func:`swiglu`."""
    return _geglu(a, b, approximate, in_place)


def swiglu_linear(a: torch.Tensor, b: torch.Tensor | None, weight: torch.Tensor,
                  bias: torch.Tensor | None = None, in_place: bool = False) -> torch.Tensor:
    """The SwiGLU MLP tail ``linear(silu(a) * b, weight, bias)``, keeping only ``a`` and ``b`` for
    the backward (the product is recomputed there instead of stored). ``in_place=True`` writes the
    gradients over ``a``/``b``; a second backward through the same graph is then an error."""
    return _swiglu_linear(a, b, weight, bias, in_place)


def geglu_linear(a: torch.Tensor, b: torch.Tensor | None, weight: torch.Tensor,
                 bias: torch.Tensor | None = None, approximate: str = "tanh",
                 in_place: bool = False) -> torch.Tensor:
    """The GeGLU MLP tail ``linear(gelu(a) * b, weight, bias)``, as :func:`swiglu_linear`."""
    return _geglu_linear(a, b, weight, bias, approximate, in_place)


# ----------------------------------------------------- Position, embedding, attention residuals


def rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
    in_place_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of ``q`` and ``k`` in one launch: a drop-in for transformers'
    ``apply_rotary_pos_emb`` (Llama, Qwen, Mistral, ...; Phi-3 style partial rotary included).

    Returns ``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` on the first
    ``rotary_dim = cos.shape[-1]`` dims of each head, the rest passed through unchanged. ``q``/``k``
    are ``(batch, heads, seq, head_dim)`` (``unsqueeze_dim=1``) or ``(batch, seq, heads, head_dim)``
    (``unsqueeze_dim=2``), ``k`` with as many or fewer heads (GQA); ``cos``/``sin`` are
    ``(1 or batch, seq, rotary_dim)``. Strided views (e.g. transposed projections) are read in place.
    The results are new tensors in the inputs' layout and promoted dtype; ``cos``/``sin`` get no
    gradient. ``position_ids`` is ignored, as in transformers (an ``int`` there is taken as
    transformers 5's positional ``unsqueeze_dim``). ``in_place_backward=True`` writes ``dq``/``dk``
    over the incoming gradients (saves memory; only when nothing else reads those gradients).
    """
    return _rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim, in_place_backward)


def embedding(
    indices: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None = None,
    deterministic: bool = False,
    *,
    scale_grad_by_freq: bool = False,
    check_bounds: bool = True,
) -> torch.Tensor:
    """Embedding lookup ``weight[indices]``: ``(*indices.shape, embedding_dim)`` in the weight's dtype.

    ``indices``: int32 or int64, any shape. ``padding_idx``: that row gets no gradient (negative
    values count from the end). The weight gradient accumulates in fp32; ``deterministic=True``
    makes it bitwise reproducible (sorted segment reduction; bf16/fp16 weights always use it),
    otherwise fp32 weights use atomic adds. ``check_bounds`` (default on) raises an
    ``IndexError``/``ValueError`` for an index outside the table at the cost of one host-device
    synchronisation; without it, out-of-range indices give zero rows and no gradient.
    """
    return _embedding(indices, weight, padding_idx, deterministic, scale_grad_by_freq, check_bounds)


def attn_res(V: torch.Tensor, w_query: torch.Tensor, w_norm: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Attention residuals: softmax attention over the first dimension of ``V`` (``(N, ..., D)``,
    e.g. ``[N, B, T, D]``, the outputs of N earlier layers).

    ``K = rms_norm(V) * w_norm`` over D, ``score = <w_query, K>``, ``alpha = softmax(score)`` over N,
    and the result ``sum_n alpha[n] * V[n]`` has shape ``(..., D)`` and ``V``'s dtype. ``w_query``
    and ``w_norm`` have shape ``(D,)``; all arithmetic is in fp32. Differentiable in all three.
    """
    return _attn_res(V, w_query, w_norm, eps)


# --------------------------------------------------------------------------------------- Losses


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    in_place_backward: bool = False,
):
    """Cross entropy of ``logits`` ``(..., vocab)`` against class indices ``target`` ``(...)``.

    As ``torch.nn.functional.cross_entropy`` (``ignore_index``, ``label_smoothing``, ``reduction``
    ``"none"``/``"mean"``/``"sum"``, mean over the non-ignored tokens; no class weights), plus the
    z-loss ``lse_square_scale * logsumexp(logits)**2`` per token and Gemma 2's logit soft-capping
    ``softcap * tanh(logits / softcap)``. With every token ignored the mean is 0.0 (torch: NaN).
    ``return_z_loss=True`` returns ``(loss, z_loss)`` (the z-loss part, for logging).
    ``in_place_backward=True`` computes the gradient in the forward pass and writes it over the
    logits (no second logits-sized buffer; the logits are destroyed).
    """
    return _cross_entropy(logits, target, ignore_index, label_smoothing, reduction, lse_square_scale,
                          softcap, return_z_loss, in_place_backward)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    accum_dtype: torch.dtype | None = None,
    chunk_tokens: int | None = None,
):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materialising the logits.

    ``hidden`` ``(..., H)`` (e.g. a causal LM's final hidden states ``(B, S, H)``), ``weight``
    ``(V, H)`` (the LM head, possibly tied to the embedding), ``target`` ``(...)`` class indices.
    The options are :func:`cross_entropy`'s; ``accum_dtype=torch.float32`` accumulates the weight
    gradient in fp32 for bf16/fp16 weights; ``chunk_tokens`` overrides the planned tokens per chunk.
    The loss is fp32. With ``reduction="sum"`` divide by ``num_items_in_batch`` yourself (Hugging
    Face's gradient accumulation); ``reduction="none"`` returns per-token losses (its backward
    recomputes the logits chunk by chunk).
    """
    return _flce(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, lse_square_scale,
                 softcap, return_z_loss, accum_dtype, chunk_tokens)


def kl_div(input: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
           log_target: bool = False) -> torch.Tensor:
    """``torch.nn.functional.kl_div``: ``input`` is log-probabilities, ``target`` probabilities (or
    log-probabilities with ``log_target=True``), same shape ``(..., vocab)``. ``reduction`` is
    ``"none"``, ``"sum"``, ``"mean"`` (over all elements) or ``"batchmean"`` (over
    ``input.shape[0]``). Gradients for ``input`` and, when it requires one, ``target``."""
    return _kl_div(input, target, reduction, log_target)


def jsd(
    input: torch.Tensor,
    target: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
    reduction: str = "mean",
    from_logits: bool = False,
) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence (liger-kernel's ``LigerJSD``): student ``input`` and
    teacher ``target`` log-probabilities ``(..., vocab)``; ``beta`` in [0, 1] (0: KL(teacher ||
    student), 1: KL(student || teacher)); tokens whose ``labels`` equal ``ignore_index`` are left
    out; ``reduction="mean"`` averages over the tokens not ignored. ``temperature != 1`` (or
    ``from_logits=True``) compares ``softmax(input / T)`` with ``softmax(target / T)``, so logits may
    be passed. Gradient w.r.t. ``input`` only."""
    return _jsd(input, target, labels, beta, ignore_index, temperature, reduction, from_logits)


def fused_linear_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Distillation loss ``jsd(student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T)``
    at ``temperature``, computed over chunks of tokens so that neither model's logits exist in full
    (liger-kernel's ``LigerFusedLinearJSD``). Gradients for the student's hidden states and head
    (fp32 accumulation for bf16/fp16 heads); the teacher gets none."""
    return _fused_linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, beta,
                             ignore_index, temperature, reduction)
