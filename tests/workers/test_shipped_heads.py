"""Draft heads shipped in the package: found by name, refused when their bytes differ."""

import hashlib
from types import MappingProxyType

import pytest

import workers.catalog.heads as heads
import workers.catalog.store as store
from workers.catalog import ChecksumError


def a_head(tmp_path, monkeypatch, text: bytes = b"weights"):
    monkeypatch.setattr(heads, "HEADS_DIR", tmp_path)
    monkeypatch.setattr(heads, "_checked", set())
    folder = tmp_path / "tiny-eagle3"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(text)
    pin = hashlib.sha256(b"weights").hexdigest()
    head = heads.ShippedHead("tiny-eagle3", (("model.safetensors", pin),))
    monkeypatch.setattr(heads, "HEADS", MappingProxyType({head.name: head}))
    return folder, pin


def test_a_shipped_head_is_found_by_name_with_its_files_checked(tmp_path, monkeypatch):
    folder, _ = a_head(tmp_path, monkeypatch)
    assert heads.shipped_head("tiny-eagle3") == folder
    assert store.resolve_model("tiny-eagle3") == folder


def test_a_head_whose_bytes_differ_is_refused(tmp_path, monkeypatch):
    folder, pin = a_head(tmp_path, monkeypatch, text=b"edited")
    actual = hashlib.sha256(b"edited").hexdigest()
    with pytest.raises(ChecksumError) as error:
        heads.shipped_head("tiny-eagle3")
    assert str(error.value) == (f"draft head 'tiny-eagle3': {folder / 'model.safetensors'} "
                                f"hashes to {actual}, pinned {pin}")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ChecksumError, match="model.safetensors is missing"):
        heads.shipped_head("tiny-eagle3")


def test_an_unknown_head_name_says_which_ship(tmp_path, monkeypatch):
    a_head(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=r"^unknown draft head 'nope' \(shipped: tiny-eagle3\)$"):
        heads.shipped_head("nope")
