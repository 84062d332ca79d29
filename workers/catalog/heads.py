"""Draft heads that ship inside tandem: an EAGLE-3 head for a catalog model that has none
published, made by `tandem draft-head train` on a GPU and kept in the package beside this file.

`{"method": "eagle3", "model": "smollm2-135m-instruct-eagle3"}` names one. Each file is
hash-pinned like the catalog's wheels: a head whose bytes differ from what was measured (a
partial checkout, a file edited by hand) is refused rather than drafting silently worse.
"""

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from workers.catalog.wheels import ChecksumError, file_sha256

HEADS_DIR = Path(__file__).parent / "heads"


@dataclass(frozen=True)
class ShippedHead:
    name: str
    files: tuple[tuple[str, str], ...]  # (file name in its folder, sha256)

    @property
    def folder(self) -> Path:
        return HEADS_DIR / self.name


# SmolLM2-135M-Instruct's head: trained on an H100 in four ten-minute device calls, each on
# 6,000-8,000 new questions the model wrote and answered (tools/gpu/run_gpu_real.sh, `--init`
# the call before's head); 1.74 tokens a verify at k 3 on held-out questions (CPU, float32)
_SMOLLM2_HEAD = ShippedHead("smollm2-135m-instruct-eagle3", (
    ("config.json", "69c339eb2644d447d4bb0d2fcf3402e47b6a490642164d35b0b06936e2858072"),
    ("model.safetensors", "7bf1129ba4f5a26e7ab0553c584bb0b07b7191e68bbb38feee4a8b119054f8db"),
))
HEADS: MappingProxyType[str, ShippedHead] = MappingProxyType({_SMOLLM2_HEAD.name: _SMOLLM2_HEAD})

_checked: set[Path] = set()  # folders whose files hashed right in this process


def shipped_head(name: str) -> Path:
    """The folder of shipped head ``name``, its files checked against their pins (once a
    process)."""
    if name not in HEADS:
        raise ValueError(f"unknown draft head {name!r} (shipped: {', '.join(HEADS) or 'none'})")
    head = HEADS[name]
    if head.folder in _checked:
        return head.folder
    for file_name, pinned in head.files:
        path = head.folder / file_name
        if not path.is_file():
            raise ChecksumError(f"draft head {name!r}: {path} is missing (an incomplete install?)")
        if (actual := file_sha256(path)) != pinned:
            raise ChecksumError(f"draft head {name!r}: {path} hashes to {actual}, pinned "
                                f"{pinned}")
    _checked.add(head.folder)
    return head.folder
