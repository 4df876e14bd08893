"""A tiny configuration of any Hugging Face architecture, made by rule from its defaults:
the width, depth, heads, experts, vocabulary and image size each named by the usual
attribute names, made small, and the per-stage lists of vision and speech models with
them; dropout and router noise off, so that two runs of one model are the same. LayerDrop
is off unless asked for (its draws come from the seeded generator: two runs drop alike)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

# Small values for the attributes a config commonly names (and their aliases). Only the
# ones a config has are set.
SMALL: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "dim": 64,
    "embedding_size": 64,
    "embed_dim": 64,
    "word_embed_proj_dim": 64,
    "intermediate_size": 128,
    "intermediate_size_mlp": 128,  # Llama 4's dense layers beside its experts
    "ffn_dim": 128,
    "n_inner": 128,
    "d_ff": 128,
    "ffn_hidden_size": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "n_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "n_kv_heads": 2,
    "num_kv_heads": 2,
    "multi_query_group_num": 2,
    "head_dim": 16,
    "d_kv": 16,
    "kv_channels": 16,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "n_ctx": 64,
    "max_seq_len": 64,
    "seq_length": 64,
    "sliding_window": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "top_k": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 16,
    "rotary_dim": 8,
    "state_size": 8,
    "ssm_state_size": 8,
    "mamba_d_state": 8,
    "conv_kernel": 4,
    "time_step_rank": 8,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "index_head_dim": 16,
    "index_n_heads": 4,
    "index_topk": 8,
    "num_experts_per_token": 2,
    "embedding_dim": 64,
    "num_blocks": 2,
    "decoder_vocab_size": 128,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "mamba_headdim": 16,
    "adapter_rank": 8,
    "num_labels": 2,
    "image_size": 64,
    "out_hidden_size": 64,  # a vision tower's output: the text model's width
    "text_hidden_size": 64,
    "projection_hidden_size": 64,  # Kimi's projector: its vision tower's width
    "max_source_positions": 32,
    "max_length": 64,
    "num_query_tokens": 4,  # BLIP-2's and InstructBLIP's Q-Former queries (32 before)
    "latent_query_num": 4,  # Kosmos-2's image tokens
    "mm_tokens_per_image": 4,  # Gemma 3's image: 2x2 pooled features
}
# Per-stage lists of the vision and speech families (a convolutional network's stages,
# a hierarchical transformer's): one block a stage, each width about an eighth, a
# multiple of 8 (which keeps the ratios between stages, and their divisibility), one
# attention head a stage.
STAGE_DEPTHS = ("depths", "depth", "num_block_repeats")
STAGE_WIDTHS = (
    "hidden_sizes",
    "embed_dim",
    "embed_dims",
    "conv_dim",
    "tdnn_dim",
    "neck_hidden_sizes",
)
STAGE_HEADS = ("num_heads", "num_attention_heads")
# A backbone's output stages, named after the old depth: the config makes them again.
BACKBONE_OUTPUTS = ("stage_names", "out_features", "out_indices")
# Stochastic in training: made deterministic, so that a run equals its reference.
QUIET: dict[str, Any] = {
    "router_jitter_noise": 0.0,
    "router_z_loss_coef": 0.0,
    "output_router_logits": False,
    "use_cache": False,
}


def _is_dropout(name: str, value: Any) -> bool:
    return isinstance(value, float) and (
        "dropout" in name or name.endswith(("pdrop", "drop_rate", "layerdrop"))  # LayerDrop too
    )


def _overrides(config, extra: dict[str, Any], layerdrop: float) -> dict[str, Any]:
    names = set(inspect.signature(type(config).__init__).parameters) | set(vars(config))
    names |= set(getattr(config, "attribute_map", {}))
    now, alias = config.to_dict(), getattr(config, "attribute_map", {})
    # A per-stage list keeps its form (`_stages` makes it small), never a scalar.
    out = {
        k: v
        for k, v in SMALL.items()
        if k in names and not isinstance(now.get(alias.get(k, k)), (list, tuple))
    }
    if "qk_rope_head_dim" in out and "head_dim" in out:  # multi-head latent attention
        out["head_dim"] = out["qk_rope_head_dim"]  # its rotary part
    out.update({k: v for k, v in QUIET.items() if k in names})
    out.update({k: 0.0 for k, v in vars(config).items() if _is_dropout(k, v)})
    out.update({k: layerdrop for k in out if k.endswith("layerdrop")})
    out.update({k: v for k, v in extra.items() if k in names})
    return out


def _layers(values: dict[str, Any]) -> int | None:
    for name in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
        if isinstance(values.get(name), int):
            return values[name]
    return None


def _per_layer(values: dict[str, Any], before: int | None, after: int | None) -> None:
    """Lists with one entry per layer (layer types, per-layer heads or limits) keep the
    first `after` entries; a dict keyed by layer index keeps those layers'."""
    if not before or not after or before <= after:
        return
    for key, value in list(values.items()):
        if isinstance(value, list) and len(value) == before:
            values[key] = value[:after]
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            values[key] = {k: v for k, v in value.items() if int(k) < after}
        elif (
            isinstance(value, list)
            and value
            and all(isinstance(i, int) for i in value)
            and key.endswith(("_layers", "_indices", "layer_ids"))
            and max(value) >= after
        ):
            values[key] = [i for i in value if i < after] or [0]


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(i) is int for i in value)


def _stages(values: dict[str, Any]) -> None:
    """The per-stage lists made small (`STAGE_DEPTHS`, `STAGE_WIDTHS`, `STAGE_HEADS`); a
    list of per-block lists keeps each stage's first entry; an image size pair, small."""
    old_depths = None
    for key in STAGE_DEPTHS:
        if _int_list(values.get(key)):
            old_depths = values[key]
            values[key] = [1] * len(old_depths)
    for key in STAGE_WIDTHS:
        if _int_list(values.get(key)):
            values[key] = [max(8, v // 64 * 8) for v in values[key]]
    for key in STAGE_HEADS:
        if _int_list(values.get(key)):
            values[key] = [1] * len(values[key])
    for key, value in list(values.items()):
        if (
            old_depths
            and isinstance(value, list)
            and len(value) == len(old_depths)
            and all(isinstance(v, list) and len(v) == d for v, d in zip(value, old_depths))
        ):
            values[key] = [v[:1] for v in value]
    if _int_list(values.get("image_size")) and len(values["image_size"]) == 2:
        values["image_size"] = [SMALL["image_size"]] * 2
    if old_depths or any(isinstance(values.get(k), list) for k in BACKBONE_OUTPUTS[1:]):
        for key in BACKBONE_OUTPUTS:
            values.pop(key, None)


def _token_ids(values: dict[str, Any]) -> None:
    """Special token ids inside the small vocabulary (a composite model's is its text
    tower's): padding, start and end at 0, 1 and 2, each other one (an image's or a
    video's placeholder) at an id of its own from the top down, so that two that were
    distinct stay so, and two that were one (an id and its alias) stay one. An image
    placeholder the config leaves to the processor (BLIP-2's) gets one too."""
    vocab = values.get("vocab_size")
    if not isinstance(vocab, int):
        vocab = (values.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int):
        return
    small = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    moved: dict[int, int] = {}

    def inside(key: str, value: int) -> int:
        if value < vocab:
            return value
        if key in small:
            return small[key]
        return moved.setdefault(value, vocab - 1 - len(moved))

    for key in ("image_token_id", "image_token_index"):  # left to the processor: one here
        if key in values and values[key] is None and "vision_config" in values:
            values[key] = moved.setdefault(-1, vocab - 1 - len(moved))
    for key, value in list(values.items()):
        if not key.endswith(("token_id", "token_index")):
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            values[key] = inside(key, value)
        elif isinstance(value, list):
            values[key] = [inside(key, v) for v in value if isinstance(v, int)] or [
                small.get(key, 3)
            ]


@functools.cache
def _model_code_reads(config_module: str, key: str) -> bool:
    """Whether the modeling module beside a config's module reads `key` from a dict
    (`.get("key"` or `["key"]`: a key the model reads with a default of its own, which
    the config never states); a mention in a comment does not count. Read once a module
    (every rank shrinks every config of the model)."""
    import importlib
    import re

    module = config_module.replace(".configuration_", ".modeling_")
    try:
        source = inspect.getsource(importlib.import_module(module))
    except (ImportError, OSError, TypeError):
        return False
    return re.search(rf"""(\.get\(|\[)\s*["']{re.escape(key)}["']""", source) is not None


def _takes_rotary_sections(config, values: dict[str, Any]) -> bool:
    """Whether the model reads multimodal rotary sections from a config that states
    none: its validation lets the key through (`ignore_keys_at_rope_validation`), or, for
    a text tower (a vision tower's rotary is its own, not in sections), its code reads it."""
    if "mrope_section" in (getattr(type(config), "ignore_keys_at_rope_validation", ()) or ()):
        return True
    return "vocab_size" in values and _model_code_reads(type(config).__module__, "mrope_section")


def _rotary_sections(config, values: dict[str, Any]) -> None:
    """Multimodal rotary sections (Qwen-VL's time, height and width) sized to half the
    small head's rotary part (all of it, or the part that turns): an old one in its
    proportions; where a config that takes them (`ignore_keys_at_rope_validation` names
    them) has none, the model's own default would be the large head's, so the rule sets
    three near-equal ones, as where only the model's code reads the key from the config's
    rotary dict (PaddleOCR-VL)."""
    rope, head = values.get("rope_parameters"), values.get("head_dim")
    if not isinstance(head, int) and isinstance(values.get("hidden_size"), int):
        head = values["hidden_size"] // (values.get("num_attention_heads") or 1)
    if not isinstance(rope, dict) or not head:
        return
    if "mrope_section" not in rope and not _takes_rotary_sections(config, values):
        return
    partial = rope.get("partial_rotary_factor") or values.get("partial_rotary_factor") or 1.0
    half = int(head * partial) // 2
    old = rope.get("mrope_section") if _int_list(rope.get("mrope_section")) else [1, 1, 1]
    new = [max(1, s * half // sum(old)) for s in old]
    new[0] += half - sum(new)
    values["rope_parameters"] = {**rope, "mrope_section": new}


def _vision_choices(values: dict[str, Any]) -> None:
    """What a composite model takes from its small vision tower: the hidden layers it reads
    (LLaVA's `vision_feature_layer`, VipLLaVA's list) among the tower's few, and the
    any-resolution grid (LLaVA-NeXT's `image_grid_pinpoints`, in tiles of the old image
    size) in tiles of the small one; the queries per image of a projector keyed by the
    image's patch count (Aria's `projector_patch_to_query_dict`) for the small image's."""
    vision = values.get("vision_config") or {}
    depth, size = vision.get("num_hidden_layers"), vision.get("image_size")
    for key in ("vision_feature_layer", "vision_feature_layers"):
        chosen = values.get(key)
        if isinstance(depth, int) and _int_list(chosen):
            values[key] = [i for i in chosen if -depth - 1 <= i <= depth] or [-1]
    patch, queries = vision.get("patch_size"), values.get("projector_patch_to_query_dict")
    if isinstance(size, int) and isinstance(patch, int) and isinstance(queries, dict):
        values.pop("max_value_projector_patch_to_query_dict", None)  # the config's, anew
        values["projector_patch_to_query_dict"] = {
            (size // patch) ** 2: SMALL["mm_tokens_per_image"]
        }
    grid = values.get("image_grid_pinpoints")
    if isinstance(size, int) and isinstance(grid, list) and grid and all(map(_int_list, grid)):
        tile = min(min(pair) for pair in grid)
        values["image_grid_pinpoints"] = [[v // tile * size for v in pair] for pair in grid]


def _derived_widths(values: dict[str, Any]) -> None:
    """Widths a vision tower's config states but its model derives, made again from the
    small ones: the output of a tower that concatenates its final and chosen intermediate
    layers (Mllama's `vision_output_dim`); a tower whose pixel shuffle widens each feature
    by the ratio's inverse square before its projector (Llama 4's `intermediate_size`, its
    projector's widths, and the output they make; the defaults do not agree among
    themselves)."""
    width = values.get("hidden_size")
    if not isinstance(width, int) or "vision_output_dim" not in values:
        return
    chosen = values.get("intermediate_layers_indices")
    if _int_list(chosen):
        values["vision_output_dim"] = width * (1 + len(chosen))
    ratio = values.get("pixel_shuffle_ratio")
    if isinstance(ratio, float) and "projector_output_dim" in values:
        values["intermediate_size"] = round(width / ratio**2)
        values["projector_input_dim"] = values["projector_output_dim"] = width
        values["vision_output_dim"] = width


def shrink(config, layerdrop: float = 0.0, **extra: Any):
    """The config, each of its sub-configs (a text or vision tower) made small in turn;
    every LayerDrop probability it has set to `layerdrop`; `extra` overrides the
    attributes it names, where the config has them."""
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            setattr(config, key, shrink(sub, layerdrop, **extra))
    values = config.to_dict()
    before = _layers(values)
    values.update(_overrides(config, extra, layerdrop))
    values = {k: v for k, v in values.items() if k not in ("transformers_version", "model_type")}
    _per_layer(values, before, _layers(values))
    _stages(values)
    _token_ids(values)
    _rotary_sections(config, values)
    _vision_choices(values)
    _derived_widths(values)
    return type(config)(**values)


def setting(config, name: str):
    """`name` of the config, or of the first of its sub-configs (a tower) that has it."""
    if getattr(config, name, None) is not None:
        return getattr(config, name)
    for key in getattr(config, "sub_configs", {}) or {}:
        found = setting(getattr(config, key, None), name)
        if found is not None:
            return found
    return None


def _is_gate(leaf: str) -> bool:
    """A parameter named as a branch's gate: `gate`, `*_gate` (Mllama's), `alpha_*`
    (IDEFICS's); not a projection or bias of a gated unit (`gate_up_proj_bias`,
    `input_gate_bias`), which start at zero for other reasons."""
    return leaf == "gate" or leaf.endswith("_gate") or leaf.startswith("alpha_")


def _open_gates(model) -> None:
    """Gates that start shut (all zero: Mllama's tanh gates on its cross-attention layers
    and tile embeddings, IDEFICS's `alpha_*`) drawn open, as training would leave them:
    shut, a branch's output is multiplied by zero, so its inputs (an image) would change
    neither the loss nor any gradient but the gate's. By name, in every tiny model (text
    ones too: Mllama's text tower has them)."""
    import torch

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not _is_gate(name.rsplit(".", 1)[-1]) or param.is_meta:  # (meta: loaded later)
                continue
            if not param.any():  # shut
                param.uniform_(0.25, 0.75, generator=g)


def tiny_model(model_type: str, auto_class, max_params: int = 20_000_000, layerdrop: float = 0.0):
    """The architecture `model_type` built tiny by a transformers auto class
    (`AutoModelForCausalLM`), with seed 0, in fp32, its shut gates open (`_open_gates`),
    its LayerDrop (if any) at `layerdrop`; raises with the reason where it cannot be built so."""
    import torch
    import transformers

    causal = auto_class is transformers.AutoModelForCausalLM
    # The causal-LM head of an encoder family (BERT's, Reformer's) runs as a decoder.
    config = shrink(
        transformers.AutoConfig.for_model(model_type),
        layerdrop,
        **({"is_decoder": True} if causal else {}),
    )
    torch.manual_seed(0)
    if not config.architectures:  # where a family maps to several classes, the first
        names = auto_class._model_mapping._model_mapping.get(model_type)
        if isinstance(names, (list, tuple)):
            config.architectures = [names[0]]
    model = auto_class.from_config(config).float()
    _open_gates(model)
    count = sum(p.numel() for p in model.parameters())
    if count > max_params:
        raise ValueError(f"{count:,} parameters once shrunk, over {max_params:,}")
    return model
