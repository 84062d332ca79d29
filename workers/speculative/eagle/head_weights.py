"""An EAGLE head's checkpoint tensors under the names of ``EagleHead``'s parameters, from
``.safetensors`` or a PyTorch ``.bin`` (loaded with ``weights_only``: no code runs)."""

from collections.abc import Iterator
from pathlib import Path

import torch


def checkpoint_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise ValueError(f"no EAGLE head weights (*.safetensors or *.bin) in {folder}")
    return files


def read_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(folder):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    yield name, handle.get_tensor(name)
        else:
            yield from torch.load(path, map_location="cpu", weights_only=True).items()


def checkpoint_names(folder: Path) -> set[str]:
    """The checkpoint's own tensor names (safetensors reads no data for them)."""
    names: set[str] = set()
    for path in checkpoint_files(folder):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                names.update(handle.keys())
        else:
            names.update(torch.load(path, map_location="cpu", weights_only=True))
    return names


def canonical_name(name: str) -> str:
    """One name per tensor across the layouts: ``midlayer.`` (yuhuili EAGLE-3) is layer 0,
    a ``model.`` prefix is dropped, speculators' ``fusion_fc`` is ``fc``."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    if name.startswith("fusion_fc."):
        name = "fc." + name[len("fusion_fc."):]
    return name


def head_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in read_tensors(folder):
        yield canonical_name(name), tensor
