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
from onca.ops._validate import check_bool

KERNELS = ("rms_norm", "layer_norm", "mlp", "rope", "fused_linear_cross_entropy")

# Originals of the module-level functions and class methods Onca replaced: (owner, name) -> value.
_ORIGINALS: dict[tuple[object, str], object] = {}
# Instances patched by `apply`, so that `unapply` also undoes the module-level RoPE patch last.
_ROPE_USERS: dict[str, int] = {}


def _selection(kernels: dict) -> dict[str, bool]:
    """Every switch on unless switched off; each one a bool (a string such as ``"false"`` would be
    truthy and patch silently)."""
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise TypeError(f"unknown Onca kernel switch(es) {', '.join(unknown)}; "
                        f"switches: {', '.join(KERNELS)}")
    for name, value in kernels.items():
        check_bool(value, name)
    return {name: kernels.get(name, True) for name in KERNELS}


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


def _patch_instance(module, attr: str, function) -> None:
    current = module.__dict__.get(attr)
    if forwards.onca_kind(current or getattr(module, attr)) == forwards.onca_kind(function):
        return  # patched already: patching twice is harmless
    if current is not None and forwards.onca_kind(current) is None:
        # Someone else's function on the instance: `unapply` puts it back.
        module.__dict__.setdefault("_onca_replaced", {})[attr] = current
    setattr(module, attr, types.MethodType(function, module))


def apply(model, **kernels) -> torch.nn.Module:
    """Patch an already-built Hugging Face model in place with Onca's kernels; returns the model.

    Switch kernels off by keyword: ``rms_norm``, ``layer_norm``, ``mlp``, ``rope``,
    ``fused_linear_cross_entropy`` (all on by default; each a bool). An unsupported model type is a
    ``ValueError`` naming it; everything is checked before anything is patched, so an error leaves
    the model as it was. Patching twice is harmless; ``onca.unapply(model)`` restores it.
    """
    use = _selection(kernels)
    family = family_of(_model_type(model))
    modeling = family.modeling()
    patches, counts = _instance_patches(model, family, use)
    for module, attr, function in patches:
        _patch_instance(module, attr, function)
    if use["rope"]:
        _patch_global(modeling, "apply_rotary_pos_emb", forwards.rope_for(family))
        if not getattr(model, "_onca_rope", False):
            _ROPE_USERS[family.model_type] = _ROPE_USERS.get(family.model_type, 0) + 1
            model._onca_rope = True
        counts["rope"] = 1
    model._onca_kernels = {name: n for name, n in counts.items() if n}
    return model


def _instance_patches(model, family: Family, use: dict[str, bool]):
    """What ``apply`` would set, as ``(module, attribute, function)`` triples, and the count per
    kernel; raises, before anything is patched, where the model cannot take a selected kernel."""
    patches = []
    counts = {name: 0 for name in KERNELS}
    rms_forward = forwards.RMS_NORM_LAYERS[family.norm].forward
    for module in model.modules():
        name = type(module).__name__
        if use["rms_norm"] and name == family.norm_class:
            patches.append((module, "forward", rms_forward))
            counts["rms_norm"] += 1
        elif use["layer_norm"] and isinstance(module, torch.nn.LayerNorm):
            patches.append((module, "forward", forwards.layer_norm_forward))
            counts["layer_norm"] += 1
        elif use["mlp"] and name == family.mlp_class:
            patches.append((module, "forward", forwards.MLP_LAYERS[family.mlp].forward))
            counts["mlp"] += 1
        elif use["mlp"] and family.experts and name == family.experts_class:
            patches.append((module, "forward", forwards.make_experts_forward(_forward_of(module))))
            if hasattr(type(module), "_apply_gate"):
                patches.append((module, "_apply_gate", forwards.experts_apply_gate))
            counts["mlp"] += 1
    if use["fused_linear_cross_entropy"]:
        if type(model).__name__ != family.causal_lm_class:
            raise ValueError(
                f"fused_linear_cross_entropy patches {family.causal_lm_class}, got {type(model).__name__}; "
                "pass fused_linear_cross_entropy=False to patch a base model"
            )
        patches.append((model, "forward", forwards.make_causal_lm_forward(family, _current_forward(model))))
        counts["fused_linear_cross_entropy"] = 1
    if use["rms_norm"] and counts["rms_norm"] == 0:
        raise ValueError(f"onca.apply found no {family.norm_class} in this {family.model_type} model; "
                         "this transformers version may name it differently")
    if use["mlp"] and counts["mlp"] == 0:
        raise ValueError(f"onca.apply found no {family.mlp_class} in this {family.model_type} model; "
                         "this transformers version may name it differently")
    return patches, counts


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
    afterwards uses Onca's kernels. Switches as ``apply``'s; every class is found before any is
    patched. ``onca.unapply_to(model_type)`` restores the classes."""
    use = _selection(kernels)
    family = family_of(model_type)
    modeling = family.modeling()
    patches = []  # (owner, attribute, replacement)
    if use["rms_norm"]:
        patches.append((_class_of(modeling, family.norm_class), "forward",
                        forwards.RMS_NORM_LAYERS[family.norm].forward))
    mlp_forward = forwards.MLP_LAYERS[family.mlp].forward
    if use["mlp"] and family.experts:
        experts = _class_of(modeling, family.experts_class)
        original = _ORIGINALS.get((experts, "forward"), experts.forward)
        patches.append((experts, "forward", forwards.make_experts_forward(original)))
        if hasattr(experts, "_apply_gate"):
            patches.append((experts, "_apply_gate", forwards.experts_apply_gate))
        if hasattr(modeling, family.mlp_class):  # MoE models with dense layers too
            patches.append((_class_of(modeling, family.mlp_class), "forward", mlp_forward))
    elif use["mlp"]:
        patches.append((_class_of(modeling, family.mlp_class), "forward", mlp_forward))
    if use["fused_linear_cross_entropy"]:
        causal_lm = _class_of(modeling, family.causal_lm_class)
        original = _ORIGINALS.get((causal_lm, "forward"), causal_lm.forward)
        patches.append((causal_lm, "forward", forwards.make_causal_lm_forward(family, original)))
    if use["rope"]:
        patches.append((modeling, "apply_rotary_pos_emb", forwards.rope_for(family)))
    for owner, attr, replacement in patches:
        _patch_global(owner, attr, replacement)
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
