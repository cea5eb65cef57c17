"""Patching Hugging Face models: ``apply`` (a built model, in place), ``apply_to`` (a model class,
before construction), and their inverses.

A patch replaces ``forward`` — on the module instance for ``apply``, on the class for ``apply_to``
— and RoPE's module-level ``apply_rotary_pos_emb`` in the family's modelling module (the attention
layers look it up there at call time, so that patch is process-wide for the family until undone).
Parameters, buffers and the module tree are untouched: state dicts, optimizers, tied weights and
gradient checkpointing behave as before.
"""

from __future__ import annotations

import types

import torch

from onca.integrations.transformers import forwards
from onca.integrations.transformers.families import Family, family_of

KERNELS = ("rms_norm", "layer_norm", "mlp", "rope", "fused_linear_cross_entropy")

# Originals of the module-level functions and class methods Onca replaced: (owner, name) -> value.
_ORIGINALS: dict[tuple[object, str], object] = {}
# Instances patched by `apply`, so that `unapply` also undoes the module-level RoPE patch last.
_ROPE_USERS: dict[str, int] = {}


def _selection(kernels: dict) -> dict[str, bool]:
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise TypeError(f"unknown Onca kernel switch(es) {', '.join(unknown)}; switches: {', '.join(KERNELS)}")
    return {name: bool(kernels.get(name, True)) for name in KERNELS}


def _model_type(model) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise TypeError(f"onca.apply needs a Hugging Face model with a config.model_type, got {type(model).__name__}")
    return model_type


def _forward_of(module) -> object:
    """The forward Onca would patch over: the class's own, unless Onca patched the class."""
    return _ORIGINALS.get((type(module), "forward"), type(module).forward)


def _current_forward(module):
    """The forward the instance has now, as a function of ``self``: one set on the instance (a
    wrapper such as TRL's fused LM head) if there is one, else the class's (see ``_forward_of``)."""
    instance_forward = module.__dict__.get("forward")
    if instance_forward is None:
        return _forward_of(module)
    return lambda self, *args, **kwargs: instance_forward(*args, **kwargs)


def _patch_instance(module, forward) -> None:
    current = module.__dict__.get("forward")
    if forwards.onca_kind(current or module.forward) == forwards.onca_kind(forward):
        return  # patched already: patching twice is harmless
    if current is not None and forwards.onca_kind(current) is None:
        # Someone else's forward on the instance: `unapply` puts it back.
        module.__dict__.setdefault("_onca_replaced", {})["forward"] = current
    module.forward = types.MethodType(forward, module)


def apply(model, **kernels) -> torch.nn.Module:
    """Patch an already-built Hugging Face model in place with Onca's kernels; returns the model.

    Switch kernels off by keyword: ``rms_norm``, ``layer_norm``, ``mlp``, ``rope``,
    ``fused_linear_cross_entropy`` (all on by default). An unsupported model type is a
    ``ValueError`` naming it; patching twice is harmless; ``onca.unapply(model)`` restores it.
    """
    use = _selection(kernels)
    family = family_of(_model_type(model))
    modeling = family.modeling()
    counts = {name: 0 for name in KERNELS}
    rms_forward = forwards.RMS_NORM_LAYERS[family.norm].forward
    for module in model.modules():
        name = type(module).__name__
        if use["rms_norm"] and name == family.norm_class:
            _patch_instance(module, rms_forward)
            counts["rms_norm"] += 1
        elif use["layer_norm"] and isinstance(module, torch.nn.LayerNorm):
            _patch_instance(module, forwards.layer_norm_forward)
            counts["layer_norm"] += 1
        elif use["mlp"] and name == family.mlp_class:
            _patch_instance(module, forwards.MLP_LAYERS[family.mlp].forward)
            counts["mlp"] += 1
        elif use["mlp"] and family.experts and name == family.experts_class:
            _patch_instance(module, forwards.make_experts_forward(_forward_of(module)))
            if hasattr(type(module), "_apply_gate"):
                module._apply_gate = types.MethodType(forwards.experts_apply_gate, module)
            counts["mlp"] += 1
    if use["fused_linear_cross_entropy"]:
        if type(model).__name__ != family.causal_lm_class:
            raise ValueError(
                f"fused_linear_cross_entropy patches {family.causal_lm_class}, got {type(model).__name__}; "
                "pass fused_linear_cross_entropy=False to patch a base model"
            )
        _patch_instance(model, forwards.make_causal_lm_forward(family, _current_forward(model)))
        counts["fused_linear_cross_entropy"] = 1
    if use["rope"]:
        _patch_global(modeling, "apply_rotary_pos_emb", forwards.rope_for(family))
        if not getattr(model, "_onca_rope", False):
            _ROPE_USERS[family.model_type] = _ROPE_USERS.get(family.model_type, 0) + 1
            model._onca_rope = True
        counts["rope"] = 1
    if use["rms_norm"] and counts["rms_norm"] == 0:
        raise ValueError(f"onca.apply found no {family.norm_class} in this {family.model_type} model; "
                         "this transformers version may name it differently")
    if use["mlp"] and counts["mlp"] == 0:
        raise ValueError(f"onca.apply found no {family.mlp_class} in this {family.model_type} model; "
                         "this transformers version may name it differently")
    model._onca_kernels = {name: n for name, n in counts.items() if n}
    return model


def unapply(model) -> torch.nn.Module:
    """Undo ``apply``: every instance forward Onca set is removed, the instance forward it wrapped
    (if any) put back, and RoPE's module-level patch undone once no other patched model of the
    family uses it. A forward that wraps Onca's (TRL's, added after ``apply``) stays: removing it
    would remove the wrapper's behaviour too."""
    for module in model.modules():
        replaced = module.__dict__.pop("_onca_replaced", {})
        for attr in ("forward", "_apply_gate"):
            if forwards.onca_kind(module.__dict__.get(attr)):
                delattr(module, attr)
                if attr in replaced:
                    setattr(module, attr, replaced[attr])
    if getattr(model, "_onca_rope", False):
        family = family_of(_model_type(model))
        _ROPE_USERS[family.model_type] -= 1
        if _ROPE_USERS[family.model_type] <= 0 and not _class_patched(family):
            _restore_global(family.modeling(), "apply_rotary_pos_emb")
        del model._onca_rope
    model.__dict__.pop("_onca_kernels", None)
    return model


def apply_to(model_type: str, **kernels) -> Family:
    """Patch a family's classes before any model is built: every model of ``model_type`` constructed
    afterwards uses Onca's kernels. ``onca.unapply_to(model_type)`` restores the classes."""
    use = _selection(kernels)
    family = family_of(model_type)
    modeling = family.modeling()
    targets = []
    if use["rms_norm"]:
        targets.append((family.norm_class, forwards.RMS_NORM_LAYERS[family.norm].forward))
    if use["mlp"] and family.experts:
        experts = _class_of(modeling, family.experts_class)
        targets.append((family.experts_class, forwards.make_experts_forward(_ORIGINALS.get(
            (experts, "forward"), experts.forward))))
        if hasattr(experts, "_apply_gate"):
            _patch_global(experts, "_apply_gate", forwards.experts_apply_gate)
        if hasattr(modeling, family.mlp_class):
            targets.append((family.mlp_class, forwards.MLP_LAYERS[family.mlp].forward))
    elif use["mlp"]:
        targets.append((family.mlp_class, forwards.MLP_LAYERS[family.mlp].forward))
    for class_name, forward in targets:
        _patch_global(_class_of(modeling, class_name), "forward", forward)
    if use["fused_linear_cross_entropy"]:
        cls = getattr(modeling, family.causal_lm_class)
        original = _ORIGINALS.get((cls, "forward"), cls.forward)
        _patch_global(cls, "forward", forwards.make_causal_lm_forward(family, original))
    if use["rope"]:
        _patch_global(modeling, "apply_rotary_pos_emb", forwards.rope_for(family))
    return family


def unapply_to(model_type: str) -> None:
    """Restore the classes and functions ``apply_to(model_type)`` replaced."""
    family = family_of(model_type)
    modeling = family.modeling()
    for class_name in (family.norm_class, family.mlp_class, family.experts_class, family.causal_lm_class):
        cls = getattr(modeling, class_name, None)
        if cls is not None:
            _restore_global(cls, "forward")
            _restore_global(cls, "_apply_gate")
    if not _ROPE_USERS.get(family.model_type):
        _restore_global(modeling, "apply_rotary_pos_emb")


def _class_of(modeling, class_name: str):
    cls = getattr(modeling, class_name, None)
    if cls is None:
        raise ValueError(f"onca.apply_to: transformers has no {class_name} in {modeling.__name__}")
    return cls


def _class_patched(family: Family) -> bool:
    modeling = family.modeling()
    return any((getattr(modeling, n, None), "forward") in _ORIGINALS
               for n in (family.norm_class, family.mlp_class, family.experts_class, family.causal_lm_class))


def _patch_global(owner, name: str, value) -> None:
    current = getattr(owner, name)
    if forwards.onca_kind(current) == forwards.onca_kind(value):
        return
    _ORIGINALS.setdefault((owner, name), current)
    setattr(owner, name, value)


def _restore_global(owner, name: str) -> None:
    original = _ORIGINALS.pop((owner, name), None)
    if original is not None:
        setattr(owner, name, original)
