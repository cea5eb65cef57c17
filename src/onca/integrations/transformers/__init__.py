"""Hugging Face transformers integration: one line to a faster, leaner model.

    import onca
    model = onca.apply(model)                       # a built model, in place
    onca.apply_to("qwen3")                          # every Qwen3 model built afterwards
    model = onca.AutoModelForCausalLM.from_pretrained(path)   # load and patch

Supported model types: ``onca.supported_model_types()`` (the table:
``onca.integrations.transformers.families.FAMILIES``).
"""

from onca.integrations.transformers.auto import AutoModelForCausalLM
from onca.integrations.transformers.families import FAMILIES, Family, family_of, supported_model_types
from onca.integrations.transformers.patch import KERNELS, apply, apply_to, unapply, unapply_to

__all__ = ["apply", "apply_to", "unapply", "unapply_to", "AutoModelForCausalLM", "FAMILIES", "Family",
           "family_of", "KERNELS", "supported_model_types"]
