"""Adapter tars are unpacked as plain files and folders only, on every Python 3.11 (Debian 12 ships 3.11.2,
whose tarfile has no "data" filter: the check is then done by hand)."""

from __future__ import annotations

import io
import tarfile

import pytest

from coderai.engine_worker.engines.hf_chat import extract_data


def _tar(path, *members: tarfile.TarInfo, data: bytes = b"weights") -> None:
    with tarfile.open(path, "w") as tar:
        for m in members:
            tar.addfile(m, io.BytesIO(data) if m.isfile() else None)


def _file(name: str, data: bytes = b"weights") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.size = len(data)
    return m


@pytest.fixture(params=["filter", "by hand"])
def python(request, monkeypatch):
    if request.param == "by hand":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python's tarfile has no data filter")
    return request.param


def test_plain_files_and_folders_are_unpacked(tmp_path, python):
    folder = tarfile.TarInfo("adapter")
    folder.type = tarfile.DIRTYPE
    _tar(tmp_path / "a.tar", folder, _file("adapter/adapter_model.safetensors"))
    with tarfile.open(tmp_path / "a.tar") as tar:
        extract_data(tar, tmp_path / "out")
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").read_bytes() == b"weights"


@pytest.mark.parametrize("bad", ["../escape.bin", "link"])
def test_a_member_outside_the_folder_or_a_link_is_refused(tmp_path, python, bad):
    if bad == "link":
        m = tarfile.TarInfo("adapter/link")
        m.type, m.linkname = tarfile.SYMTYPE, "/etc/passwd"
    else:
        m = _file(bad)
    _tar(tmp_path / "a.tar", m)
    with (
        tarfile.open(tmp_path / "a.tar") as tar,
        pytest.raises((ValueError, tarfile.FilterError) if hasattr(tarfile, "FilterError") else ValueError),
    ):
        extract_data(tar, tmp_path / "out")
    assert not (tmp_path / "escape.bin").exists()


def test_an_absolute_member_never_lands_outside(tmp_path, python):
    _tar(tmp_path / "a.tar", _file(str(tmp_path / "escape.bin")))
    with tarfile.open(tmp_path / "a.tar") as tar:
        try:  # the data filter strips the leading slash; the check by hand refuses it
            extract_data(tar, tmp_path / "out")
        except ValueError:
            pass
    assert not (tmp_path / "escape.bin").exists()
