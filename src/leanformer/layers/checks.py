"""Constructor argument checks shared by layers and models, so a bad option fails with
a message naming it instead of a division by zero or a shape error deep inside torch."""

from __future__ import annotations


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive(**values: object) -> None:
    """Every named value must be an integer >= 1; the error names the first that is not."""
    for name, value in values.items():
        if not _is_int(value) or value < 1:  # type: ignore[operator]
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def head_dim(dim: int, num_heads: int, *, dim_name: str = "dim") -> int:
    """Width of one attention head: ``dim // num_heads``, after checking both."""
    check_positive(**{dim_name: dim, "num_heads": num_heads})
    if dim % num_heads:
        raise ValueError(f"{dim_name} ({dim}) must be divisible by num_heads ({num_heads})")
    return dim // num_heads


def check_patch_grid(img_size: tuple[int, int], patch_size: int) -> None:
    """``patch_size`` must be an integer >= 1 that divides both sides of ``img_size``."""
    check_positive(patch_size=patch_size)
    if img_size[0] % patch_size or img_size[1] % patch_size:
        raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
