"""Patching Hugging Face models: ``apply`` (a built model, in place), ``apply_to`` (a model class,
before construction), and their inverses.

A patch replaces ``forward`` — on the module instance for ``apply``, on the class for ``apply_to``
— and RoPE's module-level ``apply_rotary_pos_emb`` in the family's modelling module (the attention
layers look it up there at call time, so that patch is process-wide for the family until undone).
Parameters, buffers and the module tree are untouched: state dicts, optimizers, tied weights and
gradient checkpointing behave as before.
"""

from __future__ import annotations

import importlib
import types

import torch

from onca.integrations.transformers import causal_mask, forwards
from onca.integrations.transformers.families import FAMILIES, Family, family_of, supported_model_types

KERNELS = ("rms_norm", "layer_norm", "mlp", "rope", "qk_norm_rope", "causal_mask",
           "fused_linear_cross_entropy")

# Originals of the module-level functions and class methods Onca replaced: (owner, name) -> value.
_ORIGINALS: dict[tuple[object, str], object] = {}
# Models patched by `apply` per (modelling module, function) Onca replaced there (RoPE's function,
# `create_causal_mask`), so that `unapply` undoes a module-level patch with the last one.
_GLOBAL_USERS: dict[tuple[str, str], int] = {}


# Under torch.compile these kernels hand their layers back to the model's own code by default
# ("eager"): inductor fuses a norm or a gated MLP with its neighbours, where Onca's op is an opaque
# call with Python host time around it. Measured on an H100 (Qwen3-0.6B, 4 x 2048, bf16,
# checkpointing, `python -m tools.step_kernels --compile`): Onca's RoPE and fused linear cross
# entropy with inductor's norms and MLP step in 140.1 ms, Onca's kernels everywhere in 147.7 ms,
# Hugging Face in 150.6 ms. RoPE and the loss stay Onca's under compile: inductor computes the rotary
# embedding inside the q/k norms' reduction kernels (13 ms per step there), and the fused loss halves
# the peak memory.
EAGER_BY_DEFAULT = frozenset({"rms_norm", "mlp"})


def _selection(kernels: dict) -> dict[str, bool | str]:
    """Each switch's setting: True (Onca's kernel, eager and compiled), ``"eager"`` (Onca's kernel
    except while torch.compile traces: there the model's own code), or False. Unset switches are
    on, as ``"eager"`` for ``EAGER_BY_DEFAULT``. Anything else is refused (a string such as
    ``"false"`` would be truthy and patch silently)."""
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise TypeError(f"unknown Onca kernel switch(es) {', '.join(unknown)}; "
                        f"switches: {', '.join(KERNELS)}")
    for name, value in kernels.items():
        if not (isinstance(value, bool) or (isinstance(value, str) and value == "eager")):
            raise TypeError(f'{name} must be True, False or "eager", got {type(value).__name__} {value!r}')
    return {name: kernels.get(name, "eager" if name in EAGER_BY_DEFAULT else True) for name in KERNELS}


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

    Switch kernels off by keyword: ``rms_norm``, ``layer_norm``, ``mlp``, ``rope``, ``qk_norm_rope``
    (attention layers that normalise each head of q and k before RoPE, as Qwen3's and Gemma 3's:
    the norms and the rotation as one op, in place of ``rms_norm`` and ``rope`` there),
    ``causal_mask`` (a decoder call with no attention mask, positions or cache attends through
    SDPA's ``is_causal`` rather than a mask transformers builds while torch.compile traces; see
    ``causal_mask.py``), ``fused_linear_cross_entropy`` (all on by default), each True, False or
    ``"eager"``: Onca's kernel except under torch.compile, where the layer runs the model's own code
    for inductor to fuse. ``rms_norm`` and ``mlp`` default to ``"eager"`` (measured faster under
    inductor; see ``EAGER_BY_DEFAULT``), the others to True. An unsupported model type is a
    ``ValueError`` naming it and the supported ones (``onca.supported_model_types()``); everything
    is checked before anything is patched, so an error leaves the model as it was. Patching twice
    is harmless (a second call leaves what the first patched as it is: to change a setting,
    ``onca.unapply`` first); ``onca.unapply(model)`` restores it. ``model._onca_kernels`` counts
    what was replaced, per kernel.
    """
    use = _selection(kernels)
    family = family_of(_model_type(model))
    members = families_in(family, model.config)
    patches, counts = _instance_patches(model, family, members, use)
    ropes = _rope_patches([m for m in members if not _rope_fused(m, use)]) if use["rope"] else []
    masks = _mask_patches(patches)
    for module, attr, function in patches:
        _patch_instance(module, attr, function)
    for modeling, name, function in ropes + masks:
        _patch_global(modeling, name, function)
    if (ropes or masks) and not getattr(model, "_onca_globals", ()):
        model._onca_globals = tuple((modeling.__name__, name) for modeling, name, _ in ropes + masks)
        for key in model._onca_globals:
            _GLOBAL_USERS[key] = _GLOBAL_USERS.get(key, 0) + 1
    counts["rope"] = len(ropes)
    model._onca_kernels = {name: n for name, n in counts.items() if n}
    return model


def families_in(family: Family, config) -> list[Family]:
    """``family`` and the families of its ``parts`` (a multimodal model's language model and vision
    tower, by their sub-configs' model types), recursively. An unsupported language model is an
    error; a vision tower Onca has no entry for keeps its own layers (its LayerNorms aside)."""
    members = [family]
    for part in family.parts:
        sub = getattr(config, part, None)
        model_type = getattr(sub, "model_type", None)
        if model_type is None:
            continue
        sub_family = FAMILIES.get(model_type)
        if sub_family is None or not sub_family.available():
            if part == "text_config":
                raise ValueError(
                    f"Onca does not support {family.model_type}'s language model type {model_type!r}; "
                    f"supported model types: {', '.join(supported_model_types())}")
            continue
        members += [m for m in families_in(sub_family, sub) if m not in members]
    return members


def _rope_fused(member: Family, use: dict) -> bool:
    """Whether ``member``'s attention always runs Onca's q/k norm + RoPE op (compiled too): its
    RoPE function and its q/k norms' forwards are then never called, and not patched."""
    return member.qk_norm and use["qk_norm_rope"] is True


def _rope_patches(members: list[Family]) -> list[tuple[object, str, object]]:
    patches = []
    for member in members:
        if member.rope is None:
            continue
        modeling = member.modeling()
        if not hasattr(modeling, member.rope_function):
            raise ValueError(f"onca.apply: transformers has no {member.rope_function} in {modeling.__name__}; "
                             "pass rope=False")
        if all(existing is not modeling for existing, _, _ in patches):
            patches.append((modeling, member.rope_function, forwards.rope_for(member)))
    return patches


def _mask_patches(patches: list[tuple]) -> list[tuple[object, str, object]]:
    """``create_causal_mask``'s patch in the modelling module of each decoder in ``patches``."""
    modelings = {(owner if isinstance(owner, type) else type(owner)).__module__
                 for owner, _, function in patches if forwards.onca_kind(function) == "causal_mask"}
    return [(modeling, causal_mask.MASK_FUNCTION,
             causal_mask.make_mask_function(getattr(modeling, causal_mask.MASK_FUNCTION)))
            for modeling in map(importlib.import_module, sorted(modelings))]


def _tables(members: list[Family]) -> tuple[dict, dict, dict, dict]:
    """Class name -> norm arithmetic, class name -> MLP kind, experts class -> layout, and q/k-norm
    attention class -> its family, over ``members``."""
    norms, mlps, experts, attentions = {}, {}, {}, {}
    for member in members:
        norms.update(member.norm_classes)
        mlps.update(member.mlp_classes)
        if member.experts:
            experts[member.experts_class] = member.experts_layout
        if member.qk_norm:
            attentions[member.attention_class] = member
    return norms, mlps, experts, attentions


def _experts_patches(owner, layout: str) -> list[tuple[str, object]]:
    """``(attribute, function)`` pairs that put Onca's activation into an experts module (or class)."""
    if layout == "bmm":
        return [("forward", forwards.bmm_experts_forward)]
    original = _ORIGINALS.get((owner, "forward"), owner.forward) if isinstance(owner, type) else _forward_of(owner)
    patches = [("forward", forwards.make_experts_forward(original))]
    if hasattr(owner if isinstance(owner, type) else type(owner), "_apply_gate"):
        patches.append(("_apply_gate", forwards.experts_apply_gate))
    return patches


def _norm_kernel(arithmetic: str) -> str:
    return "layer_norm" if arithmetic == "layernorm1p" else "rms_norm"


def _instance_patches(model, family: Family, members: list[Family], use: dict[str, bool]):
    """What ``apply`` would set, as ``(module, attribute, function)`` triples, and the count per
    kernel; raises, before anything is patched, where the model cannot take a selected kernel."""
    patches = []
    counts = {name: 0 for name in KERNELS}
    norms, mlps, experts, attentions = _tables(members)
    fused_norms = set()  # the q/k norms of attentions whose fused forward never calls them
    modelings = {member.modeling().__name__ for member in members}
    for module in model.modules():
        name = type(module).__name__
        arithmetic = norms.get(name)
        if (use["causal_mask"] and type(module).__module__ in modelings
                and causal_mask.builds_causal_mask(_forward_of(module))):
            patches.append(_setting(use["causal_mask"], module, "forward",
                                    causal_mask.make_decoder_forward(_forward_of(module))))
            counts["causal_mask"] += 1
        elif use["qk_norm_rope"] and name in attentions and forwards.qk_norm_fusable(module):
            patches.append(_setting(use["qk_norm_rope"], module, "forward", _attention_forward(
                attentions[name], _forward_of(module))))
            counts["qk_norm_rope"] += 1
            if _rope_fused(attentions[name], use):
                fused_norms.update((id(module.q_norm), id(module.k_norm)))
        elif id(module) in fused_norms:
            continue
        elif arithmetic is not None:
            kernel = _norm_kernel(arithmetic)
            if use[kernel]:
                patches.append(_setting(use[kernel], module, "forward", forwards.NORM_LAYERS[arithmetic].forward))
                counts[kernel] += 1
        elif use["layer_norm"] and _plain_layer_norm(module):
            patches.append(_setting(use["layer_norm"], module, "forward", forwards.layer_norm_forward))
            counts["layer_norm"] += 1
        elif use["mlp"] and name in mlps:
            patches.append(_setting(use["mlp"], module, "forward", forwards.MLP_LAYERS[mlps[name]].forward))
            counts["mlp"] += 1
        elif use["mlp"] and name in experts:
            patches += [_setting(use["mlp"], module, attr, function)
                        for attr, function in _experts_patches(module, experts[name])]
            counts["mlp"] += 1
    causal_lm = family.causal_lm_class
    if use["fused_linear_cross_entropy"] and causal_lm is not None:
        if type(model).__name__ != causal_lm:
            raise ValueError(
                f"fused_linear_cross_entropy patches {causal_lm}, got {type(model).__name__}; "
                "pass fused_linear_cross_entropy=False to patch a base model"
            )
        patches.append((model, "forward", forwards.make_causal_lm_forward(
            family, _current_forward(model), _forward_of(model))))
        counts["fused_linear_cross_entropy"] = 1
    if use["qk_norm_rope"] and attentions and counts["qk_norm_rope"] == 0:
        raise ValueError(f"onca.apply found no {' or '.join(sorted(attentions))} with q/k RMSNorms in this "
                         f"{family.model_type} model; pass qk_norm_rope=False")
    rms_classes = sorted(n for n, a in norms.items() if _norm_kernel(a) == "rms_norm")
    if use["rms_norm"] and rms_classes and counts["rms_norm"] == 0:
        raise ValueError(f"onca.apply found no {' or '.join(rms_classes)} in this {family.model_type} model; "
                         "this transformers version may name it differently")
    if use["mlp"] and (mlps or experts) and counts["mlp"] == 0:
        raise ValueError(f"onca.apply found no {' or '.join(sorted({*mlps, *experts}))} in this "
                         f"{family.model_type} model; this transformers version may name it differently")
    return patches, counts


def _attention_forward(family: Family, original):
    """Onca's q/k norm + RoPE attention forward over ``original``, with the family's eager attention
    for ``attn_implementation="eager"``."""
    return forwards.make_qk_norm_attention_forward(original, family.modeling().eager_attention_forward)


def _setting(setting: bool | str, owner, attr: str, function) -> tuple:
    """The patch ``(owner, attr, function)`` of a module or class as its switch's ``setting`` asks:
    for ``"eager"``, ``function`` outside torch.compile and, while Dynamo traces, the class's own
    ``attr`` (the one Onca did not put there)."""
    if setting != "eager":
        return owner, attr, function
    cls = owner if isinstance(owner, type) else type(owner)
    return owner, attr, forwards.eager_only(function, _original(cls, attr))


def _original(cls, attr: str):
    """``cls.attr`` as it was before Onca patched the class (as it is, if Onca did not)."""
    return _ORIGINALS.get((cls, attr), getattr(cls, attr))


def _plain_layer_norm(module) -> bool:
    """A ``torch.nn.LayerNorm`` computing what the class computes (a subclass with a forward of its
    own, such as Nemotron's LayerNorm1P, is not one)."""
    return isinstance(module, torch.nn.LayerNorm) and _forward_of(module) is torch.nn.LayerNorm.forward


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
    for module_name, function in model.__dict__.pop("_onca_globals", ()):
        _GLOBAL_USERS[module_name, function] = _GLOBAL_USERS.get((module_name, function), 0) - 1
        modeling = importlib.import_module(module_name)
        if _GLOBAL_USERS[module_name, function] <= 0 and not _class_patched(modeling):
            _restore_global(modeling, function)
    model.__dict__.pop("_onca_kernels", None)
    return model


def apply_to(model_type: str, **kernels) -> Family:
    """Patch a family's classes before any model is built: every model of ``model_type`` constructed
    afterwards uses Onca's kernels. Switches as ``apply``'s; every class is found before any is
    patched. ``onca.unapply_to(model_type)`` restores the classes. A family built from others'
    parts (LLaVA's language model is whichever its config names) needs ``onca.apply`` on the model."""
    use = _selection(kernels)
    family = family_of(model_type)
    if family.parts:
        raise ValueError(f"onca.apply_to cannot patch {model_type} before a model exists: its language model "
                         "is named by its config; use onca.apply(model)")
    modeling = family.modeling()
    patches = []  # (owner, attribute, replacement)
    for class_name, arithmetic in family.norm_classes.items():
        kernel = _norm_kernel(arithmetic)
        if use[kernel]:
            patches.append(_setting(use[kernel], _class_of(modeling, class_name), "forward",
                                    forwards.NORM_LAYERS[arithmetic].forward))
    if use["mlp"] and family.experts:
        experts = _class_of(modeling, family.experts_class)
        patches += [_setting(use["mlp"], experts, attr, function)
                    for attr, function in _experts_patches(experts, family.experts_layout)]
    if use["mlp"]:
        for class_name, kind in family.mlp_classes.items():
            if family.experts and not hasattr(modeling, class_name):
                continue  # MoE models without dense layers
            patches.append(_setting(use["mlp"], _class_of(modeling, class_name), "forward",
                                    forwards.MLP_LAYERS[kind].forward))
    if use["fused_linear_cross_entropy"] and family.causal_lm_class is not None:
        causal_lm = _class_of(modeling, family.causal_lm_class)
        original = _ORIGINALS.get((causal_lm, "forward"), causal_lm.forward)
        patches.append((causal_lm, "forward", forwards.make_causal_lm_forward(family, original, original)))
    if use["qk_norm_rope"] and family.qk_norm:
        attention = _class_of(modeling, family.attention_class)
        original = _ORIGINALS.get((attention, "forward"), attention.forward)
        patches.append(_setting(use["qk_norm_rope"], attention, "forward",
                                _attention_forward(family, original)))
    if use["rope"] and not _rope_fused(family, use):
        patches += _rope_patches([family])
    if use["causal_mask"]:
        decoders = [(cls, "forward", causal_mask.make_decoder_forward(_original(cls, "forward")))
                    for cls in _decoder_classes(modeling)]
        patches += [_setting(use["causal_mask"], *patch) for patch in decoders]
        patches += _mask_patches(decoders)
    for owner, attr, replacement in patches:
        _patch_global(owner, attr, replacement)
    return family


def _family_classes(family: Family) -> list[str]:
    return [*family.norm_classes, *family.mlp_classes, family.experts_class,
            *([family.causal_lm_class] if family.causal_lm_class else []),
            *([family.attention_class] if family.qk_norm else []),
            *(cls.__name__ for cls in _decoder_classes(family.modeling()))]


def _decoder_classes(modeling) -> list[type]:
    """The module classes defined in ``modeling`` whose forward builds a causal mask there."""
    return [cls for cls in vars(modeling).values()
            if isinstance(cls, type) and issubclass(cls, torch.nn.Module)
            and cls.__module__ == modeling.__name__
            and causal_mask.builds_causal_mask(_original(cls, "forward"))]


def unapply_to(model_type: str) -> None:
    """Restore the classes and functions ``apply_to(model_type)`` replaced."""
    family = family_of(model_type)
    modeling = family.modeling()
    for class_name in _family_classes(family):
        cls = getattr(modeling, class_name, None)
        if cls is not None:
            _restore_global(cls, "forward")
            _restore_global(cls, "_apply_gate")
    if family.rope is not None and not _GLOBAL_USERS.get((modeling.__name__, family.rope_function)):
        _restore_global(modeling, family.rope_function)
    if not _GLOBAL_USERS.get((modeling.__name__, causal_mask.MASK_FUNCTION)):
        _restore_global(modeling, causal_mask.MASK_FUNCTION)


def _class_of(modeling, class_name: str):
    cls = getattr(modeling, class_name, None)
    if cls is None:
        raise ValueError(f"onca.apply_to: transformers has no {class_name} in {modeling.__name__}")
    return cls


def _class_patched(modeling) -> bool:
    """Whether ``apply_to`` patched a class of ``modeling`` (its RoPE patch must then stay)."""
    return any(owner is not None and getattr(owner, "__module__", None) == modeling.__name__ and name == "forward"
               for owner, name in _ORIGINALS)


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
