"""The ``forward`` methods Onca puts in place of Hugging Face's.

Each keeps the module's parameters and attributes (so state dicts, optimizers, tied weights and
gradient checkpointing are untouched) and computes the same function through Onca's kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onca import functional as OF
from onca.integrations.transformers.families import NORM_ARITHMETIC, Family
from onca.nn.mlp import GELU_ACTIVATIONS, gated_mlp_tail

IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------- norms


def make_rms_norm_forward(family: Family):
    casting, offset = NORM_ARITHMETIC[family.norm]

    def forward(self, hidden_states):
        eps = getattr(self, "variance_epsilon", None)
        if eps is None:
            eps = self.eps
        return OF.rms_norm(hidden_states, self.weight, eps, offset, casting)

    forward.__onca__ = "rms_norm"
    return forward


def layer_norm_forward(self, input):
    if len(self.normalized_shape) != 1:  # Onca normalises the last dimension only
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
    return OF.layer_norm(input, self.weight, self.bias, self.eps)


layer_norm_forward.__onca__ = "layer_norm"


# ----------------------------------------------------------------------------------------- MLPs


def swiglu_mlp_forward(self, x):
    return gated_mlp_tail(self.gate_proj(x), self.up_proj(x), self.down_proj, "silu", overwrite_inputs=True)


def phi3_mlp_forward(self, hidden_states):
    # gate_up_proj holds [gate; up]; the kernels read its halves in place, no copy.
    return gated_mlp_tail(self.gate_up_proj(hidden_states), None, self.down_proj, "silu",
                          overwrite_inputs=True)


def geglu_mlp_forward(self, x):
    act = getattr(self.config, "hidden_activation", None) or getattr(self.config, "hidden_act", None)
    activation = GELU_ACTIVATIONS.get(act, "gelu_tanh")
    return gated_mlp_tail(self.gate_proj(x), self.up_proj(x), self.down_proj, activation,
                          overwrite_inputs=True)


MLP_FORWARDS = {"swiglu": swiglu_mlp_forward, "phi3": phi3_mlp_forward, "geglu": geglu_mlp_forward}
for _fn in MLP_FORWARDS.values():
    _fn.__onca__ = "mlp"


def experts_apply_gate(self, gate_up):
    """The activation between the experts' two GEMMs, ``silu(gate) * up`` over ``[gate | up]``
    halves, for transformers' experts implementations that call ``_apply_gate`` (``grouped_mm``,
    ``batched_mm``): their routing and GEMMs stay, and compile without a graph break. ``gate_up``
    is the experts' own intermediate, dead after the backward: its storage takes the gradients."""
    return OF.swiglu(gate_up, overwrite_inputs=True)


experts_apply_gate.__onca__ = "mlp"


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

    forward.__onca__ = "mlp"
    return forward


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


rotary_pos_emb.__onca__ = rotary_pos_emb_cast_back.__onca__ = "rope"


def rope_for(family: Family):
    return rotary_pos_emb_cast_back if family.rope_casts_back else rotary_pos_emb


# ------------------------------------------------------------------------------ causal-LM loss


def make_causal_lm_forward(family: Family, original_forward):
    """A causal-LM ``forward`` that, when training with labels, computes the loss with fused linear
    cross entropy straight from the last hidden states: the logits are never materialised.

    Otherwise (no labels, evaluation, or ``skip_logits=False``) it is the original forward. The
    labels are handled as transformers does: shifted by one, ``-100`` ignored, and summed then
    divided by ``num_items_in_batch`` when the Trainer passes it (gradient accumulation).
    """

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, skip_logits=None,
                **kwargs):
        shift_labels = kwargs.pop("shift_labels", None)
        has_labels = labels is not None or shift_labels is not None
        if skip_logits is None:
            skip_logits = self.training and has_labels
        if not skip_logits or not has_labels:
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            return original_forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids, past_key_values=past_key_values,
                                    inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                    logits_to_keep=logits_to_keep, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        num_items_in_batch = kwargs.get("num_items_in_batch")
        model_kwargs = dict(kwargs)
        if family.experts:
            model_kwargs["output_router_logits"] = kwargs.get(
                "output_router_logits", getattr(self.config, "output_router_logits", False))
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             **model_kwargs)
        hidden = outputs.last_hidden_state
        loss = causal_lm_loss(self, family, hidden, labels, shift_labels, num_items_in_batch)
        aux_loss = None
        if family.experts and model_kwargs["output_router_logits"]:
            aux_loss = family.modeling().load_balancing_loss_func(
                outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        result = _output(family, outputs, loss, aux_loss)
        return result.to_tuple() if return_dict is False else result

    forward.__onca__ = "fused_linear_cross_entropy"
    forward.__wrapped__ = original_forward
    return forward


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
    if family.logits_scaling_attr:
        # Granite divides the logits; dividing the hidden states first is the same product.
        hidden = hidden / getattr(model.config, family.logits_scaling_attr)
    softcap = getattr(model.config, family.softcap_attr, None) if family.softcap_attr else None
    lm_head = model.get_output_embeddings()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = OF.fused_linear_cross_entropy(hidden, lm_head.weight, target, bias=lm_head.bias,
                                         ignore_index=IGNORE_INDEX, reduction=reduction, softcap=softcap)
    if num_items_in_batch is None:
        return torch.where((target != IGNORE_INDEX).any(), loss, torch.zeros_like(loss))
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _output(family: Family, outputs, loss, aux_loss):
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    common = dict(loss=loss, logits=None, past_key_values=getattr(outputs, "past_key_values", None),
                  hidden_states=getattr(outputs, "hidden_states", None),
                  attentions=getattr(outputs, "attentions", None))
    if family.experts:
        return MoeCausalLMOutputWithPast(aux_loss=aux_loss, router_logits=getattr(outputs, "router_logits", None),
                                         **common)
    return CausalLMOutputWithPast(**common)
