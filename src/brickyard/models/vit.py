"""Vision transformers: ``vit_tiny`` and ``vit_small`` (Dosovitskiy et al., 2021), at any image size
whose sides the patch size divides (28 px MNIST as well as 224 px photos).

The layout follows timm's ``VisionTransformer`` (``timm/models/vision_transformer.py``): a strided
convolution cuts the image into patches (``patch_embed``), a class token and learned position
embeddings are added, ``depth`` pre-norm blocks of multi-head self-attention and an MLP with GELU
follow (``blocks.N``), then a final LayerNorm and a linear head on the class token. Sizes as timm's
``vit_tiny_patch16_224`` (dim 192, 12 blocks, 3 heads) and ``vit_small_patch16_224`` (384, 12, 6).
Parameter names are brickyard's own (``nn.MultiheadAttention``'s), not timm's.
"""
from __future__ import annotations

import torch
from torch import nn

from brickyard.errors import ConfigError
from brickyard.models import register
from brickyard.models.droppath import branch, rates

AUTO_PATCHES = (16, 14, 8, 7, 4, 2)


def auto_patch(image_size: tuple[int, int]) -> int:
    """The largest patch in ``AUTO_PATCHES`` (at most timm's 16) that divides both sides into at least 7
    patches each: 4 for 28 and 32 px (7 x 7 and 8 x 8 tokens), 8 for 64 and 96 px, 16 for 224 px (14 x 14)."""
    for p in AUTO_PATCHES:
        if all(s % p == 0 and s // p >= 7 for s in image_size):
            return p
    raise ConfigError(f"model.patch_size: no patch size in {AUTO_PATCHES} divides the image size "
                      f"{image_size[0]}x{image_size[1]} into at least 7 x 7 patches; set model.patch_size.")


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0, drop_path: float = 0.0, index: int = 0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.drop_path1 = branch(drop_path, 2 * index + 1)  # timm's Block: one for each residual branch
        self.drop_path2 = branch(drop_path, 2 * index + 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.drop_path1(self.attn(h, h, h, need_weights=False)[0])
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class ViT(nn.Module):
    def __init__(self, num_classes: int, in_channels: int, image_size: tuple[int, int], patch_size: int = 0,
                 dim: int = 192, depth: int = 12, heads: int = 3, mlp_ratio: float = 4.0, drop_path: float = 0.0):
        super().__init__()
        patch = patch_size or auto_patch(image_size)
        if any(s % patch for s in image_size):
            raise ConfigError(f"model.patch_size: {patch} does not divide the image size {image_size[0]}x{image_size[1]}.")
        tokens = (image_size[0] // patch) * (image_size[1] // patch)
        self.patch_size = patch
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads, mlp_ratio, p, i) for i, p in enumerate(rates(drop_path, depth))])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _classify(self.norm, self.head, self.blocks(_tokens(self.patch_embed, self.cls_token, self.pos_embed, x)))

    def pipeline_pieces(self) -> list[tuple[str, nn.Module]]:
        """The model as a sequence of (name, module) whose composition is ``forward``: the tokens, each block, the
        classifier; each piece holds this model's own parameters (the pieces a pipeline's stages are cut from)."""
        return [("patch_embed", _Tokens(self)), *((f"blocks.{i}", b) for i, b in enumerate(self.blocks)),
                ("norm", _Classify(self))]


def _tokens(patch_embed, cls_token, pos_embed, x: torch.Tensor) -> torch.Tensor:
    x = patch_embed(x).flatten(2).transpose(1, 2)  # N x tokens x dim
    return torch.cat([cls_token.expand(x.shape[0], -1, -1), x], dim=1) + pos_embed  # x.shape[0]: a batch size export keeps symbolic


def _classify(norm, head, x: torch.Tensor) -> torch.Tensor:
    return head(norm(x)[:, 0])


class _Tokens(nn.Module):
    def __init__(self, vit: ViT):
        super().__init__()
        self.patch_embed, self.cls_token, self.pos_embed = vit.patch_embed, vit.cls_token, vit.pos_embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tokens(self.patch_embed, self.cls_token, self.pos_embed, x)


class _Classify(nn.Module):
    def __init__(self, vit: ViT):
        super().__init__()
        self.norm, self.head = vit.norm, vit.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _classify(self.norm, self.head, x)


@register("vit_tiny", "vision transformer, dim 192, 12 blocks, 3 heads (timm's vit_tiny); model.patch_size, auto by image size")
def vit_tiny(num_classes, in_channels, image_size, patch_size=0, drop_path=0.0):
    return ViT(num_classes, in_channels, image_size, patch_size, dim=192, depth=12, heads=3, drop_path=drop_path)


@register("vit_small", "vision transformer, dim 384, 12 blocks, 6 heads (timm's vit_small); model.patch_size, auto by image size")
def vit_small(num_classes, in_channels, image_size, patch_size=0, drop_path=0.0):
    return ViT(num_classes, in_channels, image_size, patch_size, dim=384, depth=12, heads=6, drop_path=drop_path)
