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


HEADS: MappingProxyType[str, ShippedHead] = MappingProxyType({})

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
