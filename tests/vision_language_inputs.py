"""Training inputs for any Hugging Face vision-language model, made by rule from the tiny
model itself, where its processor would make them: an image in the first layout that the
model's `get_image_features` takes (a flat batch of images; one tile an image, with its
size; patches flattened, with their grid), and as many image placeholders before the text
as that image gives features. Token types, where the forward takes them, mark the
placeholders. A text-only sample has no image and no placeholder."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from tiny_configs import setting

TEXT = 8  # text tokens a sample


def placeholder(config) -> int | None:
    """The id that stands for one image feature in the text, if the model has one."""
    found = setting(config, "image_token_id")
    return found if found is not None else setting(config, "image_token_index")


def _special_ids(config, found: set[int] | None = None) -> set[int]:
    """Every special token id of the config and its towers: none appears in the text."""
    found = set() if found is None else found
    for key, value in config.to_dict().items():
        if key.endswith(("token_id", "token_index")):
            values = value if isinstance(value, list) else [value]
            found.update(v for v in values if isinstance(v, int))
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            _special_ids(sub, found)
    return found


def _layouts(model) -> list[Callable[[torch.Generator], dict[str, torch.Tensor]]]:
    """One image in each layout the rule knows, in order of trial: a flat batch; 1 to 5
    tiles (an any-resolution model's image, in its grid's tiles and a thumbnail); patches
    flattened, with their grid."""
    vision = getattr(model.config, "vision_config", None) or model.config
    takes = inspect.signature(model.get_image_features).parameters
    channels = setting(vision, "num_channels") or setting(vision, "in_channels") or 3
    size = setting(vision, "image_size") or 64
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    sizes = {"image_sizes": torch.tensor([[height, width]])} if "image_sizes" in takes else {}

    def batched(g):
        return {"pixel_values": torch.randn(1, channels, height, width, generator=g), **sizes}

    def tiled(tiles):
        def image(g):
            pixels = torch.randn(1, tiles, channels, height, width, generator=g)
            return {"pixel_values": pixels, **sizes}

        return image

    def patches(g):
        patch = setting(vision, "patch_size") or 14
        temporal = setting(vision, "temporal_patch_size") or 1
        side = 2 * (setting(vision, "spatial_merge_size") or 1)
        flat = torch.randn(side * side, channels * temporal * patch * patch, generator=g)
        return {"pixel_values": flat, "image_grid_thw": torch.tensor([[1, side, side]])}

    if "image_grid_thw" in takes:
        return [patches]
    return [batched, *map(tiled, range(1, 6))]


def _features(model, image: dict[str, torch.Tensor]) -> int:
    """How many placeholders one image stands for: its features, in the text's width."""
    with torch.no_grad():
        out = model.get_image_features(**image)
    features = getattr(out, "pooler_output", out)
    if features is None:
        features = out.last_hidden_state
    width = model.config.get_text_config().hidden_size
    tensors = [features] if isinstance(features, torch.Tensor) else list(features)
    return sum(t.numel() for t in tensors) // width


class VisionLanguageInputs:
    """Samples for one tiny model: `sample(g, image=True)` a dict of tensors with a batch
    dimension of 1, `collate(samples)` one rank's batch. Raises `ValueError` naming the
    reason where the rule cannot feed the model."""

    def __init__(self, model) -> None:
        self.token = placeholder(model.config)
        if self.token is None or not hasattr(model, "get_image_features"):
            raise ValueError("no image placeholder token or no get_image_features()")
        takes = inspect.signature(model.forward).parameters
        self.token_types = [k for k in ("token_type_ids", "mm_token_type_ids") if k in takes]
        vocab = model.config.get_text_config().vocab_size
        self.text_ids = torch.tensor(sorted(set(range(vocab)) - _special_ids(model.config)))
        why = "no layout"
        for layout in _layouts(model):
            try:
                self.per_image = _features(model, layout(torch.Generator().manual_seed(0)))
                self.layout = layout
                return
            except Exception as e:  # another layout, or none the rule knows
                why = f"{type(e).__name__}: {str(e)[:200]}"
        raise ValueError(f"takes no image layout the rule makes: {why}")

    def sample(self, g: torch.Generator, image: bool) -> dict[str, torch.Tensor]:
        text = self.text_ids[torch.randint(0, len(self.text_ids), (1, TEXT), generator=g)]
        pixels = self.layout(g) if image else {}
        ids = torch.cat([torch.full((1, self.per_image), self.token), text], 1) if image else text
        out = {"input_ids": ids, "labels": ids.masked_fill(ids == self.token, -100), **pixels}
        out.update({k: (ids == self.token).long() for k in self.token_types})
        return out

    def image_only_parameters(self, model) -> list[torch.nn.Parameter]:
        """The parameters a text-only sample leaves without a gradient and a sample with an
        image gives one (the vision tower, its projector), found by a backward of each;
        the model's gradients are cleared after."""
        reached = []
        for image in (False, True):
            batch = self.sample(torch.Generator().manual_seed(0), image)
            model(**batch).loss.backward()
            reached.append({id(p) for p in model.parameters() if p.grad is not None})
            model.zero_grad(set_to_none=True)
        return [p for p in model.parameters() if id(p) in reached[1] - reached[0]]

    @staticmethod
    def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One batch of samples of one length (all with an image, or none)."""
        return {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
