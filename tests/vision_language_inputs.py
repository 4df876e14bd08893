"""Training inputs for any Hugging Face vision-language model, made by rule from the tiny
model itself, where its processor would make them: an image in the first layout that the
model takes (a flat batch of images; tiles of an image, with its size; patches, with
their grid or their grid's shape, or in a row; a grid's tiles, with the grid's ratio),
and, where the text says where the image's features go, as many image placeholders
before the text as `get_image_features` gives features. Token types, where the forward
takes them, mark the placeholders. A model with no placeholder (BLIP-2, GIT, an image
encoder-decoder) takes the image beside the text; one whose text attends to the image
(Mllama, IDEFICS) also takes which token sees which image; one told where the features
go by a mask (Kosmos-2) takes the mask of its placeholders. A text-only sample has no
image and no placeholder."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from tiny_configs import setting

TEXT = 8  # text tokens a sample
FIRST_PLAIN_ID = 3  # the tiny configs put padding, start and end at 0, 1 and 2


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


def image_encoder(model) -> Callable | None:
    """The model's `get_image_features`, or its base model's (DeepSeek-VL's, Fuyu's),
    where only the base has one."""
    for owner in (model, getattr(model, "model", None)):
        found = getattr(owner, "get_image_features", None)
        if callable(found):
            return found
    return None


def _layouts(model) -> list[Callable[[torch.Generator], dict[str, torch.Tensor]]]:
    """One image in each layout the model may take, in order of trial. A model that
    takes a patch grid (`image_grid_thw`) tries patches, each flattened, then not; one
    that takes a grid's ratio (`aspect_ratio_ids`) tries the grid's tiles with it; any
    other tries a flat batch, 1 to 5 tiles (an any-resolution model's image, in its
    grid's tiles and a thumbnail), patches with their grid's shape and mask (SigLIP 2's,
    where it takes `spatial_shapes`), and patches in a row (Fuyu's). Each with an
    instruction where a Q-Former reads one (InstructBLIP's)."""
    vision = getattr(model.config, "vision_config", None) or model.config
    images_by = image_encoder(model) or model.forward
    takes = inspect.signature(images_by).parameters
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

    def patches(flat: bool):
        patch = setting(vision, "patch_size") or 14
        temporal = setting(vision, "temporal_patch_size") or 1
        merged = (
            setting(vision, "spatial_merge_size")
            or (setting(vision, "merge_kernel_size") or [1])[0]
        )
        side = 2 * merged
        shape = (channels * temporal * patch * patch,) if flat else (channels, patch, patch)

        def image(g):
            pixels = torch.randn(side * side, *shape, generator=g)
            return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, side, side]])}

        return image

    def tiles_with_their_ratio(g):  # Mllama: the tiles of the first supported grid
        rows, columns = setting(vision, "supported_aspect_ratios")[0]
        most = setting(vision, "max_num_tiles")
        used = torch.zeros(1, 1, most, dtype=torch.long)
        used[..., : rows * columns] = 1
        return {
            "pixel_values": torch.randn(1, 1, most, channels, height, width, generator=g),
            "aspect_ratio_ids": torch.tensor([[1]]),  # the first supported (0 pads)
            "aspect_ratio_mask": used,
        }

    def patches_with_their_shape(g):  # SigLIP 2's: an image's patches, its grid, a mask
        patch = setting(vision, "patch_size") or 16
        side = 2 * (setting(model.config, "downsample_factor") or 1)
        pixels = torch.randn(1, side * side, channels * patch * patch, generator=g)
        return {
            "pixel_values": pixels,
            "spatial_shapes": torch.tensor([[side, side]]),
            "pixel_attention_mask": torch.ones(1, side * side, dtype=torch.bool),
        }

    def patches_in_rows(g):  # Fuyu's: an image's patches, each flattened, as a sequence
        patch = setting(vision, "patch_size") or 16
        return {"pixel_values": torch.randn(1, 4, channels * patch * patch, generator=g)}

    def patches_with_their_places(g):  # Pix2Struct's: each patch after its row, column
        width = setting(vision, "patch_embed_hidden_size")
        rows, columns = torch.meshgrid(torch.arange(1, 3.0), torch.arange(1, 3.0), indexing="ij")
        places = torch.stack([rows.flatten(), columns.flatten()], -1)[None]
        patches = torch.randn(1, 4, width, generator=g)
        return {"flattened_patches": torch.cat([places, patches], -1)}

    if "flattened_patches" in takes:
        layouts = [patches_with_their_places]
    elif "image_grid_thw" in takes:  # each patch flattened (Qwen-VL's), or not (Kimi's)
        layouts = [patches(flat=True), patches(flat=False)]
    elif "aspect_ratio_ids" in takes:
        layouts = [tiles_with_their_ratio]
    else:
        shaped = [patches_with_their_shape] if "spatial_shapes" in takes else []
        layouts = [batched, *map(tiled, range(1, 6)), *shaped, patches_in_rows]
    if "qformer_input_ids" in takes:  # InstructBLIP's Q-Former reads an instruction too
        return [_with_instruction(layout, model.config) for layout in layouts]
    return layouts


def _with_instruction(layout, config):
    """The layout with an instruction for the Q-Former: a few of its vocabulary's ids."""
    vocab = setting(config.qformer_config, "vocab_size")

    def image(g):
        instruction = torch.randint(FIRST_PLAIN_ID, vocab, (1, 4), generator=g)
        return {
            **layout(g),
            "qformer_input_ids": instruction,
            "qformer_attention_mask": torch.ones_like(instruction),
        }

    return image


def _feature_tensors(model, image: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The features `get_image_features` gives one image, in the text's width: a tensor,
    a list of them, or an output whose `pooler_output` (else `last_hidden_state`) is."""
    out = image_encoder(model)(**image)
    features = getattr(out, "pooler_output", out)
    if features is None:
        features = out.last_hidden_state
    return [features] if isinstance(features, torch.Tensor) else list(features)


def _features(model, image: dict[str, torch.Tensor]) -> int:
    """How many placeholders one image stands for: its features, in the text's width."""
    with torch.no_grad():
        tensors = _feature_tensors(model, image)
    width = model.config.get_text_config().hidden_size
    return sum(t.numel() for t in tensors) // width


class VisionLanguageInputs:
    """Samples for one tiny model: `sample(g, image=True)` a dict of tensors with a batch
    dimension of 1, `collate(samples)` one rank's batch. Raises `ValueError` naming the
    reason where the rule cannot feed the model."""

    def __init__(self, model) -> None:
        self.token = placeholder(model.config)
        takes = inspect.signature(model.forward).parameters
        self.takes_text = "input_ids" in takes  # an image encoder-decoder takes labels only
        self.token_types = [k for k in ("token_type_ids", "mm_token_type_ids") if k in takes]
        # A model whose text attends to the image (Mllama's, IDEFICS's cross-attention
        # layers) takes which text token sees which image: here every token, every image.
        self.cross_masks = [
            k for k in ("cross_attention_mask", "image_attention_mask") if k in takes
        ]
        vocab = getattr(model.config.get_text_config(), "vocab_size", None)
        if not isinstance(vocab, int):  # an action model (PI0): no text to train
            raise ValueError("no text vocabulary (vocab_size)")
        self.text_ids = torch.tensor(sorted(set(range(vocab)) - _special_ids(model.config)))
        # A model told where the image's features go by a mask (Kosmos-2's) has no
        # placeholder id: one of the text's ids stands for them, taken out of the text.
        self.takes_position_mask = "image_embeds_position_mask" in takes
        if self.takes_position_mask and self.token is None:
            self.token, self.text_ids = int(self.text_ids[-1]), self.text_ids[:-1]
        self.per_image = 0
        why = ""  # the first layout's failure: the plainest one's
        for layout in _layouts(model):
            self.layout = layout
            try:
                if self.placed_by_text(model):
                    self.per_image = _features(model, layout(torch.Generator().manual_seed(0)))
                else:  # the model places the image itself: a forward reads it, or not
                    self._reads_the_image(model)
                return
            except Exception as e:  # another layout, or none the rule knows
                why = why or f"{type(e).__name__}: {str(e)[:200]}"
        raise ValueError(f"takes no image layout the rule makes (the first: {why})")

    def _reads_the_image(self, model) -> None:
        """Two samples alike but for their image give two losses (a forward that takes
        `pixel_values` into `**kwargs` and drops it would train on the text alone)."""
        losses = []
        for seed in (0, 1):  # only the pixels differ (not a Q-Former's instruction)
            sample = self.sample(torch.Generator().manual_seed(0), image=True)
            image = self.layout(torch.Generator().manual_seed(seed))
            sample.update({k: v for k, v in image.items() if v.is_floating_point()})
            with torch.no_grad():
                losses.append(model(**sample).loss)
        if torch.equal(*losses):
            raise ValueError("the forward does not read the image the rule gives it")

    def placed_by_text(self, model) -> bool:
        """Whether the text says where each image feature goes (placeholders), or the
        model places the image itself (BLIP-2's queries, GIT's prefix, an encoder's
        input)."""
        return self.token is not None and image_encoder(model) is not None

    def sample(self, g: torch.Generator, image: bool) -> dict[str, torch.Tensor]:
        text = self.text_ids[torch.randint(0, len(self.text_ids), (1, TEXT), generator=g)]
        pixels = self.layout(g) if image else {}
        ids = text
        if image and self.per_image:
            ids = torch.cat([torch.full((1, self.per_image), self.token), text], 1)
        labels = ids if self.token is None else ids.masked_fill(ids == self.token, -100)
        out = {"input_ids": ids} if self.takes_text else {}
        out.update({"labels": labels, **pixels})
        out.update({k: (ids == self.token).long() for k in self.token_types if self.token})
        if image and self.takes_position_mask:
            out["image_embeds_position_mask"] = (ids == self.token).long()
        if image and self.cross_masks:
            # Each text token sees each image: (1, text, images[, tiles]), the middle
            # dims of Mllama's pixel_values (images, tiles) or IDEFICS's (images).
            images = pixels["pixel_values"].shape[1:-3]
            seen = torch.ones(1, ids.shape[1], *images, dtype=torch.long)
            if "aspect_ratio_mask" in pixels:  # not a grid's padding tiles
                seen = seen * pixels["aspect_ratio_mask"][:, None]
            out.update({k: seen for k in self.cross_masks})
        return out

    def image_only_parameters(self, model) -> list[torch.nn.Parameter]:
        """The parameters only an image reaches (the vision tower, its projector): where
        the text places the image's features, those a backward of `get_image_features`
        reaches; else those a sample with an image reaches and a text-only one does not.
        The model's gradients are cleared after. Raises `ValueError` where neither tells."""
        if self.placed_by_text(model):
            image = self.layout(torch.Generator().manual_seed(0))
            sum(t.sum() for t in _feature_tensors(model, image)).backward()
            found = [p for p in model.parameters() if p.grad is not None]
        else:
            reached = []
            for image in (False, True):
                batch = self.sample(torch.Generator().manual_seed(0), image)
                try:
                    model(**batch).loss.backward()
                except Exception as e:  # a model that takes no text-only batch
                    raise ValueError(f"no text-only forward: {type(e).__name__}: {e}") from e
                reached.append({id(p) for p in model.parameters() if p.grad is not None})
                model.zero_grad(set_to_none=True)
            found = [p for p in model.parameters() if id(p) in reached[1] - reached[0]]
        model.zero_grad(set_to_none=True)
        if not found:
            raise ValueError("no parameter that only an image reaches")
        return found

    @staticmethod
    def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One batch of samples of one length (all with an image, or none)."""
        return {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
