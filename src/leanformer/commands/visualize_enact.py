"""`leanformer visualize enact`: ENACT's entropy map, curvature signs and regions for one input.

The input is a photo (one of the two scikit-learn ships, ``china`` or ``flower``, or any
image file via ``--input``) run through a fixed, seeded conv stem of stride
``--stride``, or smooth noise (``--image noise``). The features go through an
:class:`EntropyClusteredAttention` (seeded, untrained unless ``--checkpoint`` names a
``detr_encoder`` checkpoint, whose first layer is then used) and the figure shows the
input, the entropy map ``-p log2 p``, the curvature signs and the region boundaries
(row-major runs of equal sign) over the input.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leanformer.layers.enact_attention import EntropyClusteredAttention
from leanformer.ops.entropy_map import check_sigma, curvature_signs
from leanformer.ops.regions import plan_from_signs

COMMAND = ("visualize", "enact")
HELP = "plot ENACT's entropy map, curvature signs and region boundaries for an image (PNG)"

_SAMPLES = {"china": "china.jpg", "flower": "flower.jpg"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--image", default="china", choices=[*_SAMPLES, "noise"], help="bundled input (default: china)"
    )
    parser.add_argument("--input", help="an image file instead of --image")
    parser.add_argument("--stride", type=int, default=16, help="conv stem stride, a power of 2 (default 16)")
    parser.add_argument(
        "--sigma", type=float, default=3.0, help="entropy smoothing sigma, 0 disables (default 3)"
    )
    parser.add_argument("--checkpoint", help="a trained detr_encoder checkpoint: use its first ENACT layer")
    parser.add_argument(
        "--out",
        help="PNG path (default: runs/enact_<image>_s<stride>_sigma<sigma>[_<checkpoint>].png, "
        "named after what it shows so that different runs do not overwrite each other)",
    )


def default_out(args: argparse.Namespace, name: str) -> Path:
    """The figure's path when no ``--out`` is given: one file per image and setting."""
    image = Path(name).stem if args.input else name
    if not args.input and args.image == "noise":
        image += f"_seed{args.seed}"
    parts = [f"enact_{image}", f"s{args.stride}", f"sigma{args.sigma:g}"]
    if args.checkpoint:
        parts.append(
            Path(args.checkpoint).resolve().parent.name
            if Path(args.checkpoint).is_file()
            else Path(args.checkpoint).name
        )
    return Path("runs") / ("_".join(parts) + ".png")


def load_image(args: argparse.Namespace) -> tuple[Tensor, str]:
    """RGB image ``[3, h, w]`` in [0, 1] and its name."""
    if args.input:
        from PIL import Image, UnidentifiedImageError

        path = Path(args.input)
        if not path.is_file():
            raise ValueError(f"--input {args.input!r} is not a file")
        try:
            with Image.open(path) as img:
                rgb = img.convert("RGB")
        except UnidentifiedImageError:
            raise ValueError(f"--input {args.input!r} is not an image file PIL can read") from None
        arr = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
        return arr.view(rgb.height, rgb.width, 3).permute(2, 0, 1).float() / 255.0, path.name
    if args.image == "noise":
        gen = torch.Generator().manual_seed(args.seed)
        coarse = torch.rand(1, 3, 12, 16, generator=gen)
        return F.interpolate(coarse, size=(384, 512), mode="bilinear", align_corners=False)[0], "noise"
    from sklearn.datasets import load_sample_image

    arr = load_sample_image(_SAMPLES[args.image])  # uint8 [h, w, 3], shipped inside scikit-learn
    return torch.tensor(arr).permute(2, 0, 1).float() / 255.0, args.image


def conv_stem(stride: int, out_dim: int, seed: int) -> nn.Module:
    """Seeded stride-``stride`` stem: 3x3 stride-2 conv + ReLU stages widening to ``out_dim``."""
    if stride < 2 or stride & (stride - 1):
        raise ValueError(f"--stride must be a power of 2 >= 2, got {stride}")
    torch.manual_seed(seed)
    stages = int(math.log2(stride))
    dims = [3] + [min(out_dim, 32 * 2**i) for i in range(stages - 1)] + [out_dim]
    layers: list[nn.Module] = []
    for i in range(stages):
        layers += [nn.Conv2d(dims[i], dims[i + 1], 3, stride=2, padding=1), nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # no ReLU at the end: keep signed features


def _attention(args: argparse.Namespace, d_model: int) -> EntropyClusteredAttention:
    if args.checkpoint:
        from leanformer.engine.checkpoint import load_model

        model = load_model(args.checkpoint)
        layers = getattr(model, "layers", [])
        attn = next((l.self_attn for l in layers if isinstance(l.self_attn, EntropyClusteredAttention)), None)
        if attn is None:
            raise ValueError(
                f"{args.checkpoint!r} holds no ENACT attention (train detr_encoder --attention enact)"
            )
        attn.sigma = args.sigma
        return attn
    torch.manual_seed(args.seed)
    return EntropyClusteredAttention(d_model, 8, sigma=args.sigma)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    check_sigma(args.sigma)
    stem = conv_stem(args.stride, 256, args.seed).eval()
    image, name = load_image(args)
    attn = _attention(args, 256).eval()
    if attn.d_model != 256:
        stem = conv_stem(args.stride, attn.d_model, args.seed).eval()
    mean = image.mean(dim=(1, 2), keepdim=True)
    std = image.std(dim=(1, 2), keepdim=True).clamp(min=1e-6)
    with torch.no_grad():
        feats = stem(((image - mean) / std)[None])  # [1, C, H, W]
        _, _, H, W = feats.shape
        x = feats.flatten(2).transpose(1, 2)  # [1, HW, C]
        entropy = attn.entropy(x, None)  # [1, HW]
        signs = curvature_signs(entropy.view(1, H, W), sigma=attn.sigma)
        plan = plan_from_signs(signs.view(1, H * W))
    regions = plan.region_id.view(H, W)
    title = f"{name}: {H}x{W} features"
    target = Path(args.out) if args.out else default_out(args, name)
    out = _plot(image, entropy.view(H, W), signs[0], regions, target, title=title)
    L = int(plan.counts[0])
    row = {
        "image": name,
        "feature_size": f"{H}x{W}",
        "sigma": attn.sigma,
        "regions": L,
        "positions": H * W,
        "cluster_ratio": round(L / (H * W), 4),
        "out": str(out),
    }
    if not args.json:
        print(
            f"{name}: {H}x{W} features, sigma {attn.sigma:g}: {L} regions for {H * W} positions "
            f"(L/HW = {L / (H * W):.3f}); wrote {out}"
        )
    return [row]


def _plot(image: Tensor, entropy: Tensor, signs: Tensor, regions: Tensor, out: Path, *, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from leanformer.apps.plots import save_figure

    H, W = regions.shape
    # Regions are row-major runs: each is a horizontal segment of one row (or wraps from
    # a row's end to the next row's start). Mark where a run starts inside a row.
    starts = torch.zeros(H, W, dtype=torch.bool)
    starts[:, 1:] = regions[:, 1:] != regions[:, :-1]
    img = image.permute(1, 2, 0).clamp(0, 1).numpy()
    extent = (0, image.shape[2], image.shape[1], 0)
    fig, axes = plt.subplots(1, 5, figsize=(20, 3.6))
    axes[0].imshow(img)
    axes[0].set_title("input")
    im = axes[1].imshow(entropy.numpy(), cmap="viridis")
    axes[1].set_title("entropy -p log2 p")
    fig.colorbar(im, ax=axes[1], fraction=0.035)
    axes[2].imshow(signs.float().numpy() * 2 - 1, cmap="coolwarm", vmin=-1, vmax=1)
    axes[2].set_title("curvature sign (+1 concave)")
    # Neighbouring regions get different colours: a fixed shuffle of the region ids.
    gen = torch.Generator().manual_seed(0)
    colours = torch.randperm(int(regions.max()) + 1, generator=gen)[regions]
    axes[3].imshow(colours.numpy(), cmap="tab20", interpolation="nearest")
    axes[3].set_title(f"regions ({int(regions.max()) + 1})")
    axes[4].imshow(img)
    overlay = torch.zeros(H, W, 4)
    overlay[starts] = torch.tensor([1.0, 0.1, 0.1, 0.9])
    axes[4].imshow(overlay.numpy(), extent=extent, interpolation="nearest")
    axes[4].set_title("region boundaries within rows")
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title)
    fig.tight_layout()
    written = save_figure(fig, out, dpi=110)
    plt.close(fig)
    return written
