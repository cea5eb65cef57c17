"""Causal attention without a materialised mask, where the call itself proves the mask causal.

transformers' decoder forward builds its causal mask with its modelling module's
``create_causal_mask``. In eager mode, for SDPA attention and an unpadded batch, that function
returns None and the attention runs SDPA's ``is_causal`` path; to decide it, it reads the positions
on the host (a synchronisation) to rule out packed sequences. While torch.compile traces it cannot
read them, so it always builds the ``(batch, 1, q, kv)`` mask: SDPA then takes a kernel that
computes every key block (no causal skipping) and transformers copies k and v out to the query
heads (``repeat_kv``), since SDPA's grouped-query path takes no mask.

A call of the decoder with no attention mask, no positions, no cache and no cache positions needs no
reading: transformers then makes the positions ``0 .. seq-1`` in every row (nothing packed),
nothing is padded, and queries and keys are the same tokens, so the mask is exactly SDPA's
``is_causal``. Onca's decoder forward marks such a call; while it runs, the module's
``create_causal_mask`` returns None for a plain causal mask of an SDPA model, eager or compiled.
Anything else (a mask, positions, a cache, another attention implementation, a mask function or
block overlay added to the causal one, a caller that refuses the skip, a bidirectional config, or a
decoder called with positional arguments beyond the input ids) goes to transformers' own function
as before. Decoders that build their masks elsewhere (a helper building a mapping, a model taking
its positions from a multimodal parent) are left as they are.
"""

from __future__ import annotations

import inspect
import threading

from onca.integrations.transformers.forwards import mark_onca

MASK_FUNCTION = "create_causal_mask"

# A call that passes any of these (not None) is not provably causal.
_CALL_ARGUMENTS = ("attention_mask", "position_ids", "past_key_values", "cache", "cache_position")
# Deviations from the plain causal mask a model may ask ``create_causal_mask`` for.
_MASK_ADDITIONS = ("or_mask_function", "and_mask_function", "block_sequence_ids")

# Whether the innermost running Onca decoder forward was called provably causally. Per thread, so
# that models run side by side in threads (``nn.DataParallel``'s replicas) cannot see another's.
_call = threading.local()


def builds_causal_mask(forward) -> bool:
    """Whether ``forward`` (under its decorators) calls its module's ``create_causal_mask``."""
    code = getattr(inspect.unwrap(forward), "__code__", None)
    return code is not None and MASK_FUNCTION in code.co_names


def _provably_causal(module, args, kwargs) -> bool:
    config = getattr(module, "config", None)
    return (len(args) <= 1 and getattr(config, "_attn_implementation", None) == "sdpa"
            and all(kwargs.get(name) is None for name in _CALL_ARGUMENTS))


def make_decoder_forward(original_forward):
    """A decoder ``forward`` that runs ``original_forward`` with the call marked provably causal or
    not (see the module docstring); the mark of an enclosing decoder is restored afterwards."""

    def forward(self, *args, **kwargs):
        outer = getattr(_call, "causal", False)
        _call.causal = _provably_causal(self, args, kwargs)
        try:
            return original_forward(self, *args, **kwargs)
        finally:
            _call.causal = outer

    forward.__wrapped__ = original_forward
    return mark_onca(forward, "causal_mask")


def make_mask_function(original):
    """``create_causal_mask`` that returns None (SDPA's ``is_causal``) inside a provably causal
    call, and is ``original`` everywhere else."""

    def create_causal_mask(*args, **kwargs):
        config = kwargs.get("config")
        if (getattr(_call, "causal", False) and not args
                and all(kwargs.get(name) is None for name in _MASK_ADDITIONS)
                and kwargs.get("allow_is_causal_skip", True)
                and getattr(config, "_attn_implementation", None) == "sdpa"
                and not getattr(config, "use_bidirectional_attention", False)):
            return None
        return original(*args, **kwargs)

    create_causal_mask.__wrapped__ = original
    return mark_onca(create_causal_mask, "causal_mask")
