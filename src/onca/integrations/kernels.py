"""Onca as a kernel mapping for the ``kernels`` package (transformers' "Hub kernels" route).

transformers marks replaceable layers (``@use_kernel_forward_from_hub("RMSNorm")`` and friends);
``kernels.kernelize(model, mode=...)`` swaps each marked layer's ``forward`` for the ``forward`` of
the class its mapping names. This module's mapping names Onca's layers, loaded locally (no
network), for ``cuda``, ``npu`` and ``cpu`` (Triton's interpreter) in every mode::

    import onca.integrations.kernels
    from kernels import Mode, kernelize

    onca.integrations.kernels.register()
    kernelize(model, mode=Mode.TRAINING, device="cuda")

The layers are the ones ``onca.apply`` sets (``onca.integrations.transformers.forwards``), so the
two routes run the same code, with the same defaults: in the ``Mode.TORCH_COMPILE`` modes the norms
and the gated MLP are left out of the mapping (``onca.apply``'s ``"eager"`` default), and
``kernelize`` keeps those layers' own forward for inductor to fuse (the kernels package never falls
back from a compile mode to a mode without it). ``mapping(eager_only=())`` maps them there too. The
mapping covers layers only: the fused linear cross entropy of the causal-LM loss stays with
``onca.apply``.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from dataclasses import dataclass

from torch import nn

from onca.integrations.transformers import forwards
from onca.integrations.transformers.patch import EAGER_BY_DEFAULT, KERNELS

__all__ = ["DEVICES", "LAYERS", "OncaRepository", "mapping", "mark_transformers_layers", "register",
           "unmark_transformers_layers"]

# The kernels package's layer names Onca serves, and the Onca layer for each.
LAYERS: dict[str, type[nn.Module]] = {
    "RMSNorm": forwards.RMSNormLayer,
    "RMSNormZeroCentered": forwards.RMSNormLayer,
    "SwiGLUMLP": forwards.SwiGLUMLPLayer,
    "GeGLUMLP": forwards.GeGLUMLPLayer,
    "rotary_pos_emb": forwards.RotaryPosEmbLayer,
}
DEVICES = ("cuda", "npu", "cpu")
# ``onca.apply``'s switch for each layer name.
SWITCHES: dict[str, str] = {"RMSNorm": "rms_norm", "RMSNormZeroCentered": "rms_norm", "SwiGLUMLP": "mlp",
                            "GeGLUMLP": "mlp", "rotary_pos_emb": "rope"}


@dataclass(frozen=True)
class OncaRepository:
    """A repository in the kernels package's sense (``load()`` returns the layer class) that
    holds an Onca layer: nothing to download."""

    layer: type[nn.Module]

    def load(self) -> type[nn.Module]:
        return self.layer

    def __str__(self) -> str:
        return f"onca ({self.layer.__name__})"


def mapping(eager_only=EAGER_BY_DEFAULT) -> dict:
    """The kernel mapping ``{layer name: {device: {mode: repository}}}`` for
    ``kernels.register_kernel_mapping`` or ``kernels.use_kernel_mapping``: every layer in
    ``LAYERS`` on every device in ``DEVICES``, for training and inference, and under
    ``Mode.TORCH_COMPILE`` too unless its ``onca.apply`` switch is in ``eager_only`` (by default the
    norms and the MLP, as ``onca.apply``'s ``"eager"`` default: there the model's own code)."""
    from kernels import Mode

    unknown = sorted(set(eager_only) - set(KERNELS))
    if unknown:
        raise ValueError(f"eager_only names unknown switch(es) {', '.join(unknown)}; switches: {', '.join(KERNELS)}")
    eager = (Mode.TRAINING, Mode.INFERENCE)
    compiled = (Mode.TRAINING | Mode.TORCH_COMPILE, Mode.INFERENCE | Mode.TORCH_COMPILE)

    def modes(name):
        return eager if SWITCHES[name] in eager_only else eager + compiled

    return {name: {device: {mode: OncaRepository(layer) for mode in modes(name)} for device in DEVICES}
            for name, layer in LAYERS.items()}


def register(eager_only=EAGER_BY_DEFAULT) -> None:
    """Register Onca's mapping (:func:`mapping`) with the kernels package, so that ``kernelize``
    uses Onca on every marked layer it serves. Where transformers' kernels integration is active,
    Onca's entries also replace the default ones for the same layers and devices, because
    ``use_kernels=True`` re-registers transformers' default mapping before each ``kernelize``."""
    import kernels

    onca_mapping = mapping(eager_only)
    kernels.register_kernel_mapping(onca_mapping)
    _overlay_transformers_defaults(onca_mapping)


def _overlay_transformers_defaults(onca_mapping: dict) -> None:
    try:
        from transformers.integrations import hub_kernels
    except ImportError:
        return
    defaults = getattr(hub_kernels, "get_kernel_mapping_transformers", None)
    if defaults is None:  # transformers' kernels integration is off (no kernels version it accepts)
        return
    default_mapping = defaults()
    for name, devices in onca_mapping.items():
        default_mapping.setdefault(name, {}).update(devices)


# ------------------------------------------------------------------ transformers' layer markers

_MARKED = re.compile(
    r'@use_kernel_(?:forward|func)_from_hub\("(\w+)"\)\s+(?:@[^\n]*\s+)*(?:class|def)\s+(\w+)')
_FUNC_USERS = re.compile(r"@use_kernelized_func\(([\w, ]+)\)\s+(?:@[^\n]*\s+)*class\s+(\w+)")


# What `mark_transformers_layers` changed, for `unmark_transformers_layers`: the classes it marked,
# and (modelling module, function name) -> the function it replaced.
_MARKED_CLASSES: list[type] = []
_REPLACED_FUNCS: dict[tuple[object, str], object] = {}


@functools.cache
def _markers(module_name: str) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """The marked classes and functions of a modelling module (name -> layer name), and the
    classes that call marked functions (class -> function names), read from its source."""
    module = sys.modules.get(module_name)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        source = ""
    marked = {name: layer for layer, name in _MARKED.findall(source)}
    users = {cls: tuple(f.strip() for f in funcs.split(",")) for funcs, cls in _FUNC_USERS.findall(source)}
    return marked, users


def mark_transformers_layers(model: nn.Module) -> int:
    """Mark ``model``'s layers the way transformers' decorators would, where they did not; returns
    how many classes and functions it marked.

    transformers marks its layers only when it accepts the installed kernels version (5.23 wants
    0.18.2 or newer, below 0.19; 5.25 0.19.1, below 0.20); otherwise its decorators do nothing and
    ``kernelize`` finds no layer. Where transformers did mark them (each calling layer then holds
    its own function modules in ``_kernel_funcs``), they are left as they are. This reads the decorators from each modelling module's source and applies the kernels
    package's own: classes get their layer name, marked functions become the kernels package's
    function modules (module-wide, as transformers would do at import) and are attached to the
    instances that call them."""
    from kernels import replace_kernel_forward_from_hub, use_kernel_forward_from_hub

    count = 0
    for module in model.modules():
        cls = type(module)
        marked, users = _markers(cls.__module__)
        if cls.__name__ in marked and not hasattr(cls, "kernel_layer_name"):
            replace_kernel_forward_from_hub(cls, marked[cls.__name__])
            _MARKED_CLASSES.append(cls)
            count += 1
        if "_kernel_funcs" in module.__dict__:
            continue  # transformers (or an earlier call) already gave this layer its function modules
        modeling = sys.modules[cls.__module__]
        for func_name in users.get(cls.__name__, ()):
            func = getattr(modeling, func_name, None)
            if inspect.isfunction(func) and func_name in marked:
                _REPLACED_FUNCS[(modeling, func_name)] = func
                func = use_kernel_forward_from_hub(marked[func_name])(func)
                setattr(modeling, func_name, func)
                count += 1
            if isinstance(func, nn.Module):
                module.__dict__.setdefault("_kernel_funcs", {})[func_name] = func
    return count


def unmark_transformers_layers() -> None:
    """Undo every ``mark_transformers_layers``: the classes lose their layer names and the modelling
    modules get their functions back (instances built meanwhile keep their ``_kernel_funcs``)."""
    while _MARKED_CLASSES:
        cls = _MARKED_CLASSES.pop()
        for attr in ("kernel_layer_name", "kernel_condition"):
            if attr in vars(cls):
                delattr(cls, attr)
    for (modeling, func_name), func in _REPLACED_FUNCS.items():
        setattr(modeling, func_name, func)
    _REPLACED_FUNCS.clear()
