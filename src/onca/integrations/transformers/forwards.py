"""The ``forward`` methods Onca puts in place of Hugging Face's.

Each keeps the module's parameters and attributes (so state dicts, optimizers, tied weights and
gradient checkpointing are untouched) and computes the same function through Onca's kernels.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from onca import functional as OF
from onca.integrations.transformers.families import Family
from onca.nn.mlp import GELU_ACTIVATIONS, gated_mlp_tail

IGNORE_INDEX = -100

# Every function Onca puts in place, by identity. A wrapper made with ``functools.wraps`` (TRL's
# fused LM head) copies the ``__onca__`` attribute of what it wraps: the attribute alone must not
# make it pass for Onca's, or ``apply`` would skip it and ``unapply`` would delete it.
_ONCA_FUNCTIONS: weakref.WeakSet = weakref.WeakSet()


def mark_onca(function, kind: str):
    """Mark ``function`` as Onca's ``kind`` of forward (``"rms_norm"``, ``"mlp"``, ...)."""
    function.__onca__ = kind
    _ONCA_FUNCTIONS.add(function)
    return function


def onca_kind(function) -> str | None:
    """The kind of Onca forward ``function`` (or a method bound to it) is; None if not Onca's."""
    function = getattr(function, "__func__", function)
    try:
        return function.__onca__ if function in _ONCA_FUNCTIONS else None
    except TypeError:  # not weak-referenceable: not one of Onca's
        return None


@functools.cache
def eager_only(function, original):
    """A forward (or method) that runs Onca's ``function`` except while torch.compile traces,
    where it runs the class's ``original`` for inductor to fuse with the layers around it. Marked
    as ``function``'s kind, so that patching and unpatching treat it as Onca's. One per pair:
    every module of a class shares it."""

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return original(self, *args, **kwargs)
        return function(self, *args, **kwargs)

    forward.__name__ = forward.__qualname__ = getattr(function, "__name__", "forward")
    forward.__doc__ = function.__doc__
    return mark_onca(forward, onca_kind(function))


# ---------------------------------------------------------------------------------------- norms


class LlamaRMSNormLayer(nn.Module):
    """Llama's RMSNorm (normalise in fp32, cast to the input's dtype, then scale by ``weight``).

    This and the other ``*Layer`` classes are stateless layers in the sense of the ``kernels``
    package (no ``__init__``, no members but ``forward`` and its two flags): ``onca.apply`` sets
    their ``forward`` on a module, and ``onca.integrations.kernels`` hands the class to
    ``kernelize``, so both routes run the same code. They read the module's ``weight`` and its
    ``variance_epsilon`` (or ``eps``)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states):
        return OF.rms_norm(hidden_states, self.weight, _norm_eps(self), 0.0, "llama")


class Olmo2RMSNormLayer(nn.Module):
    """OLMo-2's RMSNorm: scaled by ``weight`` in fp32, then cast to the input's dtype."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states):
        return OF.rms_norm(hidden_states, self.weight, _norm_eps(self), 0.0, "gemma")


class ZeroCenteredRMSNormLayer(nn.Module):
    """Gemma's (and Qwen3.5's) zero-centred RMSNorm: scaled by ``1 + weight`` in fp32, then cast."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states):
        return OF.rms_norm(hidden_states, self.weight, _norm_eps(self), 1.0, "gemma")


class RMSNormLayer(nn.Module):
    """Any RMSNorm transformers marks ``"RMSNorm"`` or ``"RMSNormZeroCentered"``: one layer name
    covers several arithmetics, so the arithmetic is read from the module class's own ``forward``
    (once per class); a class whose arithmetic Onca does not recognise keeps its own forward."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states):
        layer = RMS_NORM_LAYERS.get(rms_norm_arithmetic(type(self)))
        if layer is None:
            return type(self).forward(self, hidden_states)
        return layer.forward(self, hidden_states)


class OptionalWeightRMSNormLayer(nn.Module):
    """Gemma 4's RMSNorm (OLMo-2's arithmetic; no weight when ``with_scale`` is false) and weightless
    RMSNorms such as Llama 4's ``L2Norm``: normalised in fp32, scaled by ``weight`` if any, cast."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states):
        weight = getattr(self, "weight", None) if getattr(self, "with_scale", True) else None
        return OF.rms_norm(hidden_states, weight, _norm_eps(self), 0.0, "gemma")


class LayerNorm1PLayer(nn.Module):
    """Nemotron's LayerNorm1P: LayerNorm over the last dimension scaled by ``1 + weight``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, input):
        weight = None if self.weight is None else self.weight + 1.0
        return OF.layer_norm(input, weight, self.bias, self.eps)


RMS_NORM_LAYERS = {"llama": LlamaRMSNormLayer, "olmo2": Olmo2RMSNormLayer, "gemma": ZeroCenteredRMSNormLayer}
for _layer in (*RMS_NORM_LAYERS.values(), RMSNormLayer, OptionalWeightRMSNormLayer):
    mark_onca(_layer.forward, "rms_norm")
mark_onca(LayerNorm1PLayer.forward, "layer_norm")
# Every norm arithmetic a family entry names (families.NORM_ARITHMETICS) -> its layer.
NORM_LAYERS = {**RMS_NORM_LAYERS, "gemma4": OptionalWeightRMSNormLayer, "layernorm1p": LayerNorm1PLayer}

# How a transformers RMSNorm's forward source applies its weight -> the matching Onca arithmetic.
_RMS_NORM_SCALINGS = (
    ("return self.weight * hidden_states.to(input_dtype)", "llama"),
    ("return (self.weight * hidden_states).to(input_dtype)", "olmo2"),
    ("return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)", "olmo2"),
    ("output = output * (1.0 + self.weight.float())", "gemma"),
)


@torch.compiler.assume_constant_result
def rms_norm_arithmetic(cls) -> str:
    """``"llama"``, ``"olmo2"`` or ``"gemma"``: which arithmetic ``cls``'s forward uses, or ``""``
    if it is none of them. Read once per class (Dynamo takes the result as a constant)."""
    if cls not in _RMS_NORM_ARITHMETIC:
        source = _normalized_source(cls)
        known = "pow(2).mean(-1, keepdim=True)" in source and "torch.rsqrt(" in source
        _RMS_NORM_ARITHMETIC[cls] = next((name for line, name in _RMS_NORM_SCALINGS
                                          if known and line in source), "")
    return _RMS_NORM_ARITHMETIC[cls]


_RMS_NORM_ARITHMETIC: dict[type, str] = {}


def _normalized_source(obj) -> str:
    """``obj``'s source as Python prints it back (no comments, docstrings kept, one spelling of
    parentheses and spacing), so that a pattern matches however the source was laid out."""
    return ast.unparse(ast.parse(textwrap.dedent(inspect.getsource(obj))))


def _norm_eps(module) -> float:
    eps = getattr(module, "variance_epsilon", None)
    return module.eps if eps is None else eps


def layer_norm_forward(self, input):
    if len(self.normalized_shape) != 1:  # Onca normalises the last dimension only
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
    return OF.layer_norm(input, self.weight, self.bias, self.eps)


mark_onca(layer_norm_forward, "layer_norm")


# ----------------------------------------------------------------------------------------- MLPs


class SwiGLUMLPLayer(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` (Llama, Qwen, Mistral): the kernels
    package's ``SwiGLUMLP``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x):
        return gated_mlp_tail(self.gate_proj(x), self.up_proj(x), self.down_proj, "silu",
                              overwrite_inputs=True)


class Phi3MLPLayer(nn.Module):
    """Phi-3's MLP: ``gate_up_proj`` holds ``[gate; up]``; the kernels read its halves in place."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states):
        return gated_mlp_tail(self.gate_up_proj(hidden_states), None, self.down_proj, "silu",
                              overwrite_inputs=True)


class GeGLUMLPLayer(nn.Module):
    """``down_proj(gelu(gate_proj(x)) * up_proj(x))`` with the GELU form of ``config``'s
    activation (Gemma): the kernels package's ``GeGLUMLP``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x):
        act = getattr(self.config, "hidden_activation", None) or getattr(self.config, "hidden_act", None)
        activation = GELU_ACTIVATIONS.get(act, "gelu_tanh")
        return gated_mlp_tail(self.gate_proj(x), self.up_proj(x), self.down_proj, activation,
                              overwrite_inputs=True)


class FalconH1MLPLayer(nn.Module):
    """Falcon-H1's MLP: ``down_proj(silu(gate_proj(x) * gate_multiplier) * up_proj(x)) * down_multiplier``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x):
        return gated_mlp_tail(self.gate_proj(x), self.up_proj(x), self.down_proj, "silu", overwrite_inputs=True,
                              gate_multiplier=self.gate_multiplier, down_multiplier=self.down_multiplier)


# transformers' activation modules (``ACT2FN``) -> the gated kernels' activation.
_GATED_ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUActivation": "gelu", "GELUTanh": "gelu_tanh",
                      "PytorchGELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh",
                      "FastGELUActivation": "gelu_tanh"}


class GatedMLPLayer(nn.Module):
    """``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with whichever of SiLU, GELU or GELU-tanh
    the module's ``act_fn`` is (vision towers configure it: Pixtral's is GELU); any other
    activation keeps the module's own forward."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x):
        activation = _GATED_ACTIVATIONS.get(type(self.act_fn).__name__)
        if activation is None:
            return type(self).forward(self, x)
        return gated_mlp_tail(self.gate_proj(x), self.up_proj(x), self.down_proj, activation,
                              overwrite_inputs=True)


MLP_LAYERS = {"swiglu": SwiGLUMLPLayer, "gated": GatedMLPLayer, "phi3": Phi3MLPLayer, "geglu": GeGLUMLPLayer, "falcon_h1": FalconH1MLPLayer}
for _layer in MLP_LAYERS.values():
    mark_onca(_layer.forward, "mlp")


def experts_apply_gate(self, gate_up):
    """The activation between the experts' two GEMMs, ``silu(gate) * up`` over ``[gate | up]``
    halves, for transformers' experts implementations that call ``_apply_gate`` (``grouped_mm``,
    ``batched_mm``): their routing and GEMMs stay, and compile without a graph break. ``gate_up``
    is the experts' own intermediate, dead after the backward: its storage takes the gradients."""
    return OF.swiglu(gate_up, overwrite_inputs=True)


mark_onca(experts_apply_gate, "mlp")


def make_experts_forward(original_forward):
    """Mixtral / Qwen3-MoE experts (3-D ``gate_up_proj`` and ``down_proj``). With a GEMM-based
    experts implementation, transformers' own forward (which calls the patched ``_apply_gate``);
    with the ``eager`` one (or a transformers without ``_apply_gate``), its per-expert loop with the
    fused activation in place of ``act_fn(gate) * up``."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        implementation = getattr(getattr(self, "config", None), "_experts_implementation", None)
        if implementation not in (None, "eager") and hasattr(type(self), "_apply_gate"):
            return original_forward(self, hidden_states, top_k_index, top_k_weights)
        return _experts_loop(self, hidden_states, top_k_index, top_k_weights)

    return mark_onca(forward, "mlp")


def bmm_experts_forward(self, hidden_states):
    """Llama 4's experts: tokens grouped per expert, ``bmm`` with ``(E, H, 2I)`` ``gate_up_proj`` and
    ``(E, I, H)`` ``down_proj``, the fused SwiGLU between them."""
    hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
    gate_up = torch.bmm(hidden_states, self.gate_up_proj)
    return torch.bmm(OF.swiglu(gate_up, overwrite_inputs=True), self.down_proj).view(-1, self.hidden_size)


mark_onca(bmm_experts_forward, "mlp")


def _experts_loop(self, hidden_states, top_k_index, top_k_weights):
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        gate_up = F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx])
        out = F.linear(OF.swiglu(gate_up, overwrite_inputs=True), self.down_proj[expert_idx])
        out = out * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


# ----------------------------------------------------------------------------------------- RoPE


def rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return OF.rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim)


def rotary_pos_emb_cast_back(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    q_embed, k_embed = OF.rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


def llama4_rotary_emb(xq, xk, freqs_cis):
    """Llama 4's ``apply_rotary_emb``: adjacent pairs times a complex table, in q/k's dtypes."""
    return OF.llama4_rope(xq, xk, freqs_cis)


mark_onca(rotary_pos_emb, "rope")
mark_onca(rotary_pos_emb_cast_back, "rope")
mark_onca(llama4_rotary_emb, "rope")


# ------------------------------------------------------------------------- q/k norm + RoPE attention

# A q/k norm's arithmetic -> the fused op's (offset, casting_mode).
_QK_NORM_OPTIONS = {"llama": (0.0, "llama"), "olmo2": (0.0, "gemma"), "gemma": (1.0, "gemma")}
# The names transformers versions give the attention's KV cache argument.
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")


def qk_norm_fusable(module) -> bool:
    """Whether an attention module normalises each head of q and k with an RMSNorm Onca knows
    before rotating them (Qwen3's and Gemma 3's attention): what the fused forward replaces."""
    norms = [getattr(module, name, None) for name in ("q_norm", "k_norm")]
    if any(n is None or getattr(n, "weight", None) is None for n in norms):
        return False
    q_norm, k_norm = norms  # one op for both: one arithmetic and one epsilon
    # An attention logit soft-cap (Gemma 2's; None in Gemma 3's configs) is the model's own forward's.
    return (rms_norm_arithmetic(type(q_norm)) in _QK_NORM_OPTIONS and type(k_norm) is type(q_norm)
            and _norm_eps(q_norm) == _norm_eps(k_norm)
            and getattr(module, "attn_logit_softcapping", None) is None
            and all(hasattr(module, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim",
                                                       "scaling", "config")))


def make_qk_norm_attention_forward(original_forward, eager_attention):
    """The attention forward of a family that normalises each head of q and k before RoPE, with the
    norms and the rotation of both as one Onca op (``rms_norm_rope``): the normalised heads are
    neither written nor read back between them, in either direction. The rest is transformers'
    forward: the KV cache's update, the attention implementation the config names, the output
    projection. Tables that are not one full-width ``(1 or batch, seq, head_dim)`` pair (partial
    rotary), or extra positional arguments, run transformers' own ``original_forward``."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
        cos, sin = position_embeddings if position_embeddings is not None else (None, None)
        if args or cos is None or cos.dim() != 3 or cos.shape[-1] != self.head_dim:
            return original_forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        caches = [kwargs.pop(name) for name in _CACHE_ARGUMENTS if name in kwargs]
        cache = next((c for c in caches if c is not None), None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query, key = _normed_rotated(self.q_norm, self.k_norm, self.q_proj(hidden_states).view(hidden_shape),
                                     self.k_proj(hidden_states).view(hidden_shape), cos, sin)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if cache is not None:
            key, value = _update_cache(cache, key, value, self.layer_idx, cos, sin, kwargs)
        attention = _attention_interface(self.config._attn_implementation, eager_attention)
        output, weights = attention(
            self, query, key, value, attention_mask,
            dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
            sliding_window=getattr(self, "sliding_window", None), **kwargs,
        )
        return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights

    return mark_onca(forward, "qk_norm_rope")


def _update_cache(cache, key, value, layer_idx, cos, sin, kwargs):
    """``cache.update`` as the installed transformers' attention calls it: with a ``cache_kwargs``
    dict where the cache's ``update`` takes one (older transformers), else with the attention's
    keyword arguments."""
    if _cache_takes_dict(type(cache)):
        return cache.update(key, value, layer_idx, {"sin": sin, "cos": cos,
                                                    "cache_position": kwargs.get("cache_position")})
    return cache.update(key, value, layer_idx, kwargs=kwargs)


@torch.compiler.assume_constant_result
def _cache_takes_dict(cache_class) -> bool:
    return "cache_kwargs" in inspect.signature(cache_class.update).parameters


def _normed_rotated(q_norm, k_norm, query, key, cos, sin):
    """``query`` and ``key`` (``(batch, seq, heads, head_dim)``) normalised by ``q_norm`` and
    ``k_norm`` and rotated, as attention takes them: ``(batch, heads, seq, head_dim)``. Their
    gradients are the attention's own intermediates: the backward writes over them."""
    offset, casting = _QK_NORM_OPTIONS[rms_norm_arithmetic(type(q_norm))]
    query, key = OF.rms_norm_rope(query, key, q_norm.weight, k_norm.weight, cos, sin, _norm_eps(q_norm),
                                  offset, casting, overwrite_grad_output=True)
    return query.transpose(1, 2), key.transpose(1, 2)


def _attention_interface(implementation, eager_attention):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    get_interface = getattr(ALL_ATTENTION_FUNCTIONS, "get_interface", None)
    if get_interface is not None:
        return get_interface(implementation, eager_attention)
    return eager_attention if implementation in (None, "eager") else ALL_ATTENTION_FUNCTIONS[implementation]


def rope_for(family: Family):
    """The function Onca puts in place of ``family.rope_function`` for ``family.rope``."""
    return {"promoted": rotary_pos_emb, "cast_back": rotary_pos_emb_cast_back,
            "llama4": llama4_rotary_emb}[family.rope]


class RotaryPosEmbLayer(nn.Module):
    """transformers' ``apply_rotary_pos_emb`` as the kernels package wraps it (a module per
    function, marked ``"rotary_pos_emb"``). Its variants share the layer name: the one that
    returns the promoted dtype and the ones that cast back to ``q``'s dtype run Onca's kernel; any
    other (GPT-OSS's half-width ``cos``/``sin``) keeps the original function."""

    can_torch_compile = True
    has_backward = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        rope = _ROPE_VARIANTS.get(rope_variant(type(self)))
        if rope is None:
            return type(self).forward(self, q, k, cos, sin, unsqueeze_dim)
        return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


mark_onca(RotaryPosEmbLayer.forward, "rope")
_ROPE_VARIANTS = {"promoted": rotary_pos_emb, "cast_back": rotary_pos_emb_cast_back}
_ROTATE_HALF = "q_embed = q * cos + rotate_half(q) * sin"
_ROPE_VARIANT: dict[type, str] = {}


@torch.compiler.assume_constant_result
def rope_variant(func_module_class) -> str:
    """``"promoted"``, ``"cast_back"`` or ``""`` (not Onca's): the variant of the function that
    the kernels package wrapped in ``func_module_class``, read once from its source and from its
    module's ``rotate_half`` (NanoChat's flips the signs)."""
    if func_module_class not in _ROPE_VARIANT:
        func = inspect.getclosurevars(func_module_class.forward).nonlocals.get("func")
        variant = ""
        if inspect.isfunction(func) and _standard_rotate_half(func.__globals__.get("rotate_half")):
            source = _normalized_source(func)
            if _ROTATE_HALF in source or _ROTATE_HALF.replace("q", "q.float()") in source:
                variant = "cast_back" if "q_embed.to(" in source else "promoted"
        _ROPE_VARIANT[func_module_class] = variant
    return _ROPE_VARIANT[func_module_class]


_STANDARD_ROTATE_HALF = ("x1 = x[..., :x.shape[-1] // 2]\nx2 = x[..., x.shape[-1] // 2:]\n"
                         "return torch.cat((-x2, x1), dim=-1)")


def _standard_rotate_half(rotate_half) -> bool:
    if not inspect.isfunction(rotate_half):
        return False
    body = ast.parse(textwrap.dedent(inspect.getsource(rotate_half))).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return "\n".join(ast.unparse(statement) for statement in body) == _STANDARD_ROTATE_HALF


# ------------------------------------------------------------------------------ causal-LM loss


def make_causal_lm_forward(family: Family, original_forward, class_forward=None):
    """A causal-LM ``forward`` that, when training with labels, computes the loss with fused linear
    cross entropy straight from the last hidden states: the logits are never materialised.

    Otherwise (no labels, evaluation, ``skip_logits=False``, or a keyword argument that neither
    transformers' kwargs nor ``class_forward`` (the model class's own forward, default
    ``original_forward``) take, such as TRL's ``fused_lm_head``) it calls
    ``original_forward(self, ...)`` with the arguments it was given: whatever forward was there
    before, wrappers included. Every other argument (a multimodal model's ``pixel_values``,
    ``image_grid_thw``, ...) goes to the base model ``self.model`` as the original forward passes it.
    The labels are handled as transformers does: shifted by one, ``-100`` ignored, and summed then
    divided by ``num_items_in_batch`` when the Trainer passes it (gradient accumulation). Families
    with a router add its load-balancing loss as transformers does.
    """
    accepted = _transformers_kwargs() | _parameters(class_forward or original_forward)
    output_class = _output_class(family)
    output_fields = tuple(f.name for f in dataclasses.fields(output_class))
    # Resolved here too: a module lookup inside the forward would break torch.compile's graph.
    load_balancing_loss = getattr(family.modeling(), "load_balancing_loss_func", None) if family.aux_loss else None
    router_switch = _router_loss_switch(class_forward or original_forward)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, skip_logits=None,
                **kwargs):
        has_labels = labels is not None or kwargs.get("shift_labels") is not None
        if skip_logits is None:
            skip_logits = self.training and has_labels
        if not skip_logits or not has_labels or not accepted.issuperset(kwargs):
            given = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                         use_cache=use_cache, logits_to_keep=logits_to_keep or None)
            # Only what the caller passed: a wrapper further down may not take every argument.
            return original_forward(self, **{k: v for k, v in given.items() if v is not None}, **kwargs)
        shift_labels = kwargs.pop("shift_labels", None)
        return_dict = kwargs.pop("return_dict", None)
        num_items_in_batch = kwargs.get("num_items_in_batch")
        text_config = self.config.get_text_config()
        model_kwargs = dict(kwargs)
        if family.aux_loss:
            model_kwargs["output_router_logits"] = router_switch(self.config, text_config,
                                                                 kwargs.get("output_router_logits"))
        if past_key_values is not None:  # only when given: transformers 5.2x renames it (``cache``)
            model_kwargs["past_key_values"] = past_key_values
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, **model_kwargs)
        hidden = outputs.last_hidden_state
        loss = causal_lm_loss(self, family, hidden, labels, shift_labels, num_items_in_batch)
        aux_loss = None
        if family.aux_loss and model_kwargs["output_router_logits"]:
            experts = getattr(text_config, "num_experts", None) or text_config.num_local_experts
            aux_loss = load_balancing_loss(
                outputs.router_logits, experts, text_config.num_experts_per_tok, attention_mask)
            loss = loss + text_config.router_aux_loss_coef * aux_loss.to(loss.device)
        result = _output(output_class, output_fields, outputs, loss, aux_loss)
        return result.to_tuple() if return_dict is False else result

    forward.__wrapped__ = original_forward
    return mark_onca(forward, "fused_linear_cross_entropy")


def _router_loss_switch(forward):
    """Whether a call adds the router's load-balancing loss, decided as ``forward`` (the model
    class's own) decides it: transformers' versions differ. Most take ``output_router_logits`` from
    the call, else from the text config; some (Qwen3-VL-MoE and GLM-4V-MoE in 5.17) only from the
    call; some (Qwen3.5-MoE in 5.17) from the call, else from the top-level config. Read once from
    the forward's source, so that the loss is the original's under every version."""
    try:
        source = "".join(inspect.getsource(inspect.unwrap(forward)).split())
    except (OSError, TypeError):
        source = ""
    if "kwargs.get('output_router_logits'" in source or 'kwargs.get("output_router_logits"' in source:
        unset = lambda config, text_config: False  # noqa: E731
    elif "elseself.config.output_router_logits" in source:
        unset = lambda config, text_config: getattr(config, "output_router_logits", False)  # noqa: E731
    else:
        unset = lambda config, text_config: getattr(text_config, "output_router_logits", False)  # noqa: E731
    return lambda config, text_config, requested: unset(config, text_config) if requested is None else requested


def _parameters(function) -> frozenset[str]:
    """The named parameters of ``function`` (through ``functools.wraps`` wrappers)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in parameters
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self")


@functools.cache
def _transformers_kwargs() -> frozenset[str]:
    """The keyword arguments a transformers causal-LM forward takes besides its named ones: the
    ones Onca's loss path knows how to pass on to the base model."""
    from transformers.utils.generic import TransformersKwargs

    return frozenset({*TransformersKwargs.__annotations__, "shift_labels", "return_dict", "cache_position",
                      "output_attentions", "output_hidden_states", "token_type_ids"})


def causal_lm_loss(model, family: Family, hidden, labels, shift_labels, num_items_in_batch):
    """Mean (or, with ``num_items_in_batch``, summed and divided) next-token cross entropy of the
    language-model head over ``hidden``, without the logits.

    A micro-batch whose labels are all ignored (a prompt-only sequence under SFT masking) gives a
    loss of 0 with zero gradients, where torch's mean would be NaN: a NaN loss poisons the
    Trainer's running loss and any loss-scaled step. The test is on the device (no host sync)."""
    if shift_labels is None:
        # Pad the end instead of slicing the hidden states: no copy of the activations.
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    target = shift_labels.reshape(-1).to(hidden.device)
    config = model.config.get_text_config()
    if family.logits_scaling_attr:
        # Granite divides the logits; dividing the hidden states first is the same product.
        hidden = hidden / getattr(config, family.logits_scaling_attr)
    if family.logits_multiplier_attr:
        # Falcon-H1 multiplies them: likewise.
        hidden = hidden * getattr(config, family.logits_multiplier_attr)
    softcap = getattr(config, family.softcap_attr, None) if family.softcap_attr else None
    lm_head = model.get_output_embeddings()
    reduction = "sum" if num_items_in_batch is not None else "mean"

    def head_loss(hidden, target):
        # The head's weight is read here, inside the FSDP owner's forward hooks when there is one.
        return OF.fused_linear_cross_entropy(hidden, lm_head.weight, target, bias=lm_head.bias,
                                             ignore_index=IGNORE_INDEX, reduction=reduction, softcap=softcap)

    owner = fsdp_owner(model, lm_head)
    loss = head_loss(hidden, target) if owner is None else _fsdp_call(owner, head_loss, hidden, target)
    if num_items_in_batch is None:
        return torch.where((target != IGNORE_INDEX).any(), loss, torch.zeros_like(loss))
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def fsdp_owner(model, lm_head):
    """The FSDP2 module (``fully_shard``) whose hooks must gather the head's weight before Onca reads
    it, or None.

    Onca computes the loss from ``lm_head.weight`` without calling ``lm_head``, so ``lm_head``'s
    own forward hooks never run. Under FSDP2 that matters when the weight belongs to a group other
    than the root's (whose forward this is, so its parameters are gathered): a head sharded on its
    own (``fully_shard(model.lm_head)``), or a head tied to an input embedding sharded on its own
    group (already resharded after the embedding's forward). The weight would then be the sharded
    DTensor; the loss is instead run as a forward method of that group's module
    (``register_fsdp_forward_method``), which gathers the weight, reshards it after, and
    reduce-scatters its gradient as for any forward."""
    if torch.compiler.is_compiling():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    if not isinstance(model, FSDPModule) and not any(isinstance(m, FSDPModule) for m in model.modules()):
        return None
    holders = [lm_head]
    embeddings = model.get_input_embeddings()
    if embeddings is not None and getattr(embeddings, "weight", None) is lm_head.weight:
        holders.append(embeddings)  # tied: the parameter is managed where fully_shard first saw it
    names = {id(m): name for name, m in model.named_modules()}
    groups = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    for holder in holders:
        path = names.get(id(holder))
        if path is None:
            continue
        # The innermost FSDP module containing the holder manages its parameters.
        inner = max(((n, m) for n, m in groups if n == "" or path == n or path.startswith(n + ".")),
                    key=lambda nm: len(nm[0]), default=None)
        if inner is not None and inner[1] is not model and _manages(inner[1], lm_head.weight):
            return inner[1]
    return None


def _manages(module, weight) -> bool:
    """Whether ``weight`` is one of the parameters FSDP2 shards in ``module``'s group."""
    state = module._get_fsdp_state()
    group = getattr(state, "_fsdp_param_group", None)
    if group is None:
        return False
    return any(p.sharded_param is weight or getattr(p, "_unsharded_param", None) is weight
               for p in group.fsdp_params)


def _fsdp_call(owner, fn, *args):
    """``fn(*args)`` as a forward of the FSDP2 module ``owner``: its parameters gathered around the
    call, its gradients reduce-scattered after the backward that reaches ``args``."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if not getattr(owner, "_onca_fsdp_call", None):
        owner._onca_fsdp_run = types.MethodType(lambda self, fn, *a: fn(*a), owner)
        register_fsdp_forward_method(owner, "_onca_fsdp_run")
        owner._onca_fsdp_call = True
    return owner._onca_fsdp_run(fn, *args)


def _output_class(family: Family):
    """The output class the original forward returns: the family's own multimodal one
    (``LlavaCausalLMOutputWithPast``, ...) where it has one, else transformers' causal-LM (or MoE
    causal-LM) output. Looked up when the forward is made: an import inside the forward would
    break torch.compile's graph."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    cls = getattr(family.modeling(), f"{family.prefix}CausalLMOutputWithPast", None)
    if cls is None:
        cls = MoeCausalLMOutputWithPast if family.aux_loss else CausalLMOutputWithPast
    return cls


def _output(cls, fields, outputs, loss, aux_loss):
    """``cls`` (whose dataclass ``fields`` are given: ``dataclasses.fields`` is not traceable)
    without logits: Onca's loss and auxiliary loss, every other field the base model's."""
    ours = dict(loss=loss, logits=None, aux_loss=aux_loss)
    return cls(**{name: ours[name] if name in ours else getattr(outputs, name, None) for name in fields})
