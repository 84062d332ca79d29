"""Builds a model from a HuggingFace folder (config.json + *.safetensors) on one rank.

Tensors are read lazily, one at a time, and each parameter's weight_loader copies only this
rank's shard, so a rank never holds more than its shard plus one full checkpoint tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from workers.layers.parallel import TensorParallelGroup
from workers.models.registry import model_class_for

if TYPE_CHECKING:  # transformers is imported where a config is read, not to run a shard
    from transformers import PretrainedConfig

INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: Path) -> list[Path]:
    """The shards the index names, in order; without an index, every *.safetensors file."""
    index = folder / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_config(folder: Path) -> PretrainedConfig:
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


def fused_kernels_by_default(device: str | torch.device, backend) -> bool:
    """The fused Triton elementwise kernels go with the Triton attention backend on CUDA, so
    ``attention_backend="reference"`` runs the model in plain PyTorch throughout."""
    if torch.device(device).type != "cuda" or getattr(backend, "name", None) != "triton":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def load_model(
    folder: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    tp: TensorParallelGroup,
    backend,
    fused: bool | None = None,
    config: PretrainedConfig | None = None,
) -> tuple[torch.nn.Module, PretrainedConfig]:
    """Returns (model in eval mode with this rank's shards loaded, config).

    fused: Triton kernels for RMSNorm, rotary and SiLU; None picks fused_kernels_by_default.
    config: the folder's config, already read (workers/model_config.py); None reads it."""
    if fused is None:
        fused = fused_kernels_by_default(device, backend)
    folder = Path(folder)
    if config is None:
        config = load_config(folder)
    model_class = model_class_for(config)
    files = weight_files(folder)  # fail before building a large model for nothing
    # built straight on the device; parameters are uninitialized until load_weights fills them
    with torch.device(device):
        model = model_class(config, tp, backend, fused=fused)
    model.to(dtype=dtype)  # keeps the Parameter objects, so weight_loader attributes survive
    model.load_weights(iterate_weights(files))
    return model.eval(), config
