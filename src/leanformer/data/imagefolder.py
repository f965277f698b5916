"""A local class-per-folder image tree: ``root/<split>/<class>/*.png|jpg`` (or ``root/<class>/...``).

Reading is torchvision's ``ImageFolder``; this module adds the split layout, the resize and
normalisation, and the ``info`` every leanformer dataset carries.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torchvision import datasets, transforms

from leanformer.data.registry import DatasetInfo, register_dataset
from leanformer.memory_budget import check_image_pixels

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
MEAN = (0.485, 0.456, 0.406)  # ImageNet statistics, as timm's DeiT expects
STD = (0.229, 0.224, 0.225)


def _is_image(path: str) -> bool:
    return Path(path).suffix.lower() in IMAGE_SUFFIXES


def load_rgb(path: str) -> Image.Image:
    """The image at ``path`` as RGB. Its size is read from the header and refused above the
    pixel limit before the pixels are decoded; an unreadable file is named."""
    try:
        with Image.open(path) as img:
            check_image_pixels(*img.size, f"image {path}")
            return img.convert("RGB")
    except Image.DecompressionBombError:  # PIL's own cap, far above ours, hit at the header
        raise ValueError(f"image {path} is larger than the pixel limit; resize it first") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"image {path} cannot be read: {exc}") from None


class ImageFolderDataset(datasets.ImageFolder):
    """Images resized to ``img_size`` (bicubic) and normalised; classes are the sorted
    sub-folder names. Items are ``(image [3, img_size, img_size], label tensor)``."""

    def __init__(self, folder: Path, img_size: int) -> None:
        if not any(p.is_dir() for p in folder.iterdir()):
            raise ValueError(f"no class folders in {folder} (expected {folder}/<class>/<image files>)")
        pipeline = transforms.Compose(
            [
                transforms.Resize((img_size, img_size), interpolation=transforms.InterpolationMode.BICUBIC),
                transforms.ToTensor(),
                transforms.Normalize(MEAN, STD),
            ]
        )
        # allow_empty: a class folder with no images yet is still a class (its index stays put).
        super().__init__(
            str(folder),
            transform=pipeline,
            target_transform=torch.tensor,
            loader=load_rgb,
            is_valid_file=_is_image,
            allow_empty=True,
        )
        if not self.samples:
            raise ValueError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) under {folder}")
        self.img_size = img_size
        self.info = DatasetInfo(num_classes=len(self.classes), in_chans=3, img_size=img_size)


@register_dataset("imagefolder")
def build_imagefolder(*, split: str, root: str | None = None, img_size: int = 224) -> ImageFolderDataset:
    """``root/train`` and ``root/test`` (or ``root/val``) when present, else ``root`` for both splits."""
    if root is None:
        raise ValueError("imagefolder needs root=... (--data-root): a folder of class sub-folders")
    base = Path(root)
    if not base.is_dir():
        raise ValueError(f"imagefolder root {base} is not a folder")
    candidates = [base / split] + ([base / "val"] if split == "test" else [])
    folder = next((c for c in candidates if c.is_dir()), base)
    return ImageFolderDataset(folder, img_size)
