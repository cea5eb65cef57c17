"""``onca.AutoModelForCausalLM``: transformers' loader, returning an Onca-patched model."""

from __future__ import annotations

from onca.integrations.transformers.patch import KERNELS, apply


def _split(kwargs: dict) -> tuple[dict, dict]:
    """Onca's kernel switches (``rope=False``, ...) apart from transformers' own arguments."""
    kernels = {k: kwargs.pop(k) for k in list(kwargs) if k in KERNELS}
    return kernels, kwargs


class AutoModelForCausalLM:
    """Like ``transformers.AutoModelForCausalLM``, with Onca's kernels applied to the result.

    Accepts every argument transformers does, plus Onca's kernel switches. The model is an ordinary
    transformers model (``Trainer``, TRL's ``SFTTrainer``, ``save_pretrained`` work unchanged).
    """

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        import transformers

        kernels, kwargs = _split(kwargs)
        model = transformers.AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        return apply(model, **kernels)

    @classmethod
    def from_config(cls, config, **kwargs):
        import transformers

        kernels, kwargs = _split(kwargs)
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        return apply(model, **kernels)
