"""Tiny multimodal models and their inputs: a small language model, a small vision tower, and a
random image given as the processor would give it (``pixel_values`` of the right shape, the image
placeholder tokens in ``input_ids``), without any processor or download. For tests and CPU demos."""

from __future__ import annotations

import torch

IMAGE = 250  # the image placeholder token of every tiny model (vocabulary 256)
_SPECIAL = dict(image_start=251, image_end=252, video=253, vision_start=251, vision_end=252)

_QWEN_TOP = dict(image_token_id=IMAGE, video_token_id=253, vision_start_token_id=251, vision_end_token_id=252)
_GLM_TOP = dict(image_token_id=IMAGE, video_token_id=253, image_start_token_id=251, image_end_token_id=252,
                video_start_token_id=254, video_end_token_id=255)
_QWEN3_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                     temporal_patch_size=2, num_position_embeddings=16)

# Per family: the language model's model type (None: the family's own text config), the vision
# config, top-level config keys, and how an image reaches the model ("square": pixel_values
# (B, 3, S, S), "patches": Qwen-VL's flattened patches with image_grid_thw, "tiles": SmolVLM's
# (B, images, 3, S, S), None: text only).
SPECS: dict[str, dict] = {
    "llava": dict(text="llama", image="square", tokens=16, size=32,
                  vision=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
                  top=dict(image_token_index=IMAGE, vision_feature_layer=-1, image_seq_length=16)),
    "paligemma": dict(text="gemma", image="square", tokens=16, size=32,
                      vision=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
                      top=dict(image_token_index=IMAGE)),
    "gemma3": dict(text=None, image="square", tokens=4, size=32,
                   vision=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
                   top=dict(image_token_index=IMAGE, boi_token_index=251, eoi_token_index=252, mm_tokens_per_image=4)),
    "internvl": dict(text="qwen2", image="square", tokens=4, size=32,
                     vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=[32, 32], patch_size=[8, 8], use_qk_norm=True, norm_type="rms_norm"),
                     top=dict(image_token_id=IMAGE, image_seq_length=4)),
    "smolvlm": dict(text="llama", image="tiles", tokens=4, size=32,
                    vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8),
                    top=dict(image_token_id=IMAGE, scale_factor=2)),
    "qwen2_vl": dict(text=None, image="patches", tokens=4, patch=4,
                     vision=dict(depth=1, embed_dim=32, hidden_size=None, num_heads=2, patch_size=4,
                                 spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2),
                     top=_QWEN_TOP, text_extra=dict(rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                                         mrope_section=[2, 3, 3]))),
    "qwen2_5_vl": dict(text=None, image="patches", tokens=4, patch=4,
                       vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                                   spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                                   fullatt_block_indexes=[0], out_hidden_size=None),
                       top=_QWEN_TOP, text_extra=dict(rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                                           mrope_section=[2, 3, 3]))),
    "qwen3_vl": dict(text=None, image="patches", tokens=4, patch=4,
                     vision=dict(_QWEN3_VISION, deepstack_visual_indexes=[0], out_hidden_size=None), top=_QWEN_TOP),
    "qwen3_vl_moe": dict(text=None, image="patches", tokens=4, patch=4,
                         vision=dict(_QWEN3_VISION, deepstack_visual_indexes=[0], out_hidden_size=None),
                         top=_QWEN_TOP),
    "qwen3_5": dict(text=None, image="patches", tokens=4, patch=4,
                    vision=dict(_QWEN3_VISION, out_hidden_size=None), top=_QWEN_TOP),
    "qwen3_5_moe": dict(text=None, image="patches", tokens=4, patch=4,
                        vision=dict(_QWEN3_VISION, out_hidden_size=None), top=_QWEN_TOP),
    "glm4v": dict(text=None, image="patches", tokens=4, patch=4,
                  vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, image_size=16,
                              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=None),
                  top=_GLM_TOP, text_extra=dict(rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                                     mrope_section=[2, 3, 3]))),
    "glm4v_moe": dict(text=None, image="patches", tokens=4, patch=4,
                      vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                                  image_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=None),
                      top=_GLM_TOP, text_extra=dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                    n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                                    topk_group=1, output_router_logits=True,
                                                    rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                                         partial_rotary_factor=0.5,
                                                                         mrope_section=[2, 1, 1]))),
    # Text only through the multimodal model: their image paths need tiling/aspect-ratio inputs
    # (Mllama, Llama 4) or an audio/vision stack (Gemma 4) beyond a tiny test's reach.
    "mllama": dict(text=None, image=None, vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_global_layers=1, attention_heads=2, image_size=16,
                                                      patch_size=8, intermediate_layers_indices=[0],
                                                      vision_output_dim=64),
                   top=dict(image_token_index=IMAGE), text_extra=dict(cross_attention_layers=[1])),
    "gemma4": dict(text=None, image=None, vision=None, top=dict(image_token_id=IMAGE, boi_token_id=251,
                                                              eoi_token_id=252, video_token_id=253)),
    "llama4": dict(text=None, image=None, vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=2, image_size=16, patch_size=8,
                                                      vision_output_dim=32, projector_input_dim=32,
                                                      projector_output_dim=32),
                   top=dict(image_token_index=IMAGE, boi_token_index=251, eoi_token_index=252)),
}


def tiny_config(model_type: str, *, hidden_size: int, layers: int, vocab_size: int, heads: int, kv_heads: int):
    """A tiny config of the multimodal ``model_type`` (see ``SPECS``)."""
    import transformers

    from onca.integrations.transformers import presets

    spec = SPECS[model_type]
    if model_type == "pixtral":
        return transformers.AutoConfig.for_model("pixtral", **_pixtral(hidden_size, heads))
    text_type = spec["text"] or transformers.AutoConfig.for_model(model_type).get_text_config().model_type
    text = presets._text_kwargs(text_type, hidden_size, layers, vocab_size, heads, kv_heads, 512)
    text.update(spec.get("text_extra", {}))
    if spec["text"] is not None:
        text["model_type"] = spec["text"]
    kwargs = dict(text_config=text, **spec["top"])
    if spec["vision"] is not None:
        vision = {k: (hidden_size if v is None else v) for k, v in spec["vision"].items()}
        kwargs["vision_config"] = vision
    if model_type == "paligemma":
        kwargs["projection_dim"] = hidden_size
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def _pixtral(hidden_size: int, heads: int) -> dict:
    return dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                num_attention_heads=heads, head_dim=hidden_size // heads, image_size=32, patch_size=8)


SPECS["pixtral"] = dict(text=None, image="pixtral", vision=None, top={})


def inputs(model_type: str, config, batch: int, seq: int, generator: torch.Generator) -> dict:
    """Inputs for a training step of the tiny ``model_type``: ``input_ids`` (each sequence with one
    image's placeholder tokens after a short prefix, where the family takes images) and the image
    tensors, random, of the shapes the family's processor would give."""
    spec = SPECS.get(model_type)
    if spec is not None and spec["image"] == "pixtral":
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=generator)}
    vocab = config.get_text_config().vocab_size
    ids = torch.randint(3, min(vocab, IMAGE), (batch, seq), generator=generator)
    if spec is None or spec["image"] is None:
        return {"input_ids": ids}
    n = spec["tokens"]
    ids[:, 2:2 + n] = IMAGE
    out = {"input_ids": ids}
    if spec["image"] == "square":
        out["pixel_values"] = torch.randn(batch, 3, spec["size"], spec["size"], generator=generator)
        if model_type in ("gemma3", "paligemma"):
            out["token_type_ids"] = (ids == IMAGE).long()
    elif spec["image"] == "tiles":
        out["pixel_values"] = torch.randn(batch, 1, 3, spec["size"], spec["size"], generator=generator)
    else:  # Qwen-VL / GLM-4V patches: one image of (1, 4, 4) patches per sequence, merged 2x2 -> 4 tokens
        vision = config.vision_config
        p, t = spec["patch"], vision.temporal_patch_size
        grid = torch.tensor([[1, 4, 4]] * batch)
        out["pixel_values"] = torch.randn(batch * 16, 3 * t * p * p, generator=generator)
        out["image_grid_thw"] = grid
        ids[:, 1] = _SPECIAL["vision_start"]
        ids[:, 2 + n] = _SPECIAL["vision_end"]
        if "mm_token_type_ids" in _forward_parameters(model_type):  # newer transformers: M-RoPE needs it
            out["mm_token_type_ids"] = (ids == IMAGE).long()
    return out


def _forward_parameters(model_type: str) -> set[str]:
    import inspect

    from onca.integrations.transformers.families import family_of

    family = family_of(model_type)
    return set(inspect.signature(getattr(family.modeling(), family.causal_lm_class).forward).parameters)
