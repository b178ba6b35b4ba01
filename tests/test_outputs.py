"""zenflow.outputs (issue 19): a path the user named is written without replacing what zfctl
did not write. A file is replaced atomically; a link keeps being a link; a FIFO or character
device is written into, never renamed over (the old write_json_atomic put a regular file in
the place of /dev/full, run as root); a directory, socket or block device is refused; every
failure names the user's path, never the hidden temporary file."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from zenflow.errors import StorageError
from zenflow.outputs import (
    check_writable,
    open_append,
    output_target,
    write_file,
    write_json_atomic,
    write_text,
)

DOC = {"zero_optimization": {"stage": 2}}


def _kind(path) -> int:
    return stat.S_IFMT(os.lstat(path).st_mode)


def test_a_link_to_a_file_stays_a_link(tmp_path):
    """The old code renamed over the link: the link was gone and the file it named kept
    its old content."""
    real = tmp_path / "configs" / "real.json"
    real.parent.mkdir()
    real.write_text("{}")
    link = tmp_path / "ds.json"
    link.symlink_to(real)
    write_json_atomic(link, DOC)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert json.loads(real.read_text()) == DOC
    dangling = tmp_path / "new.json"
    dangling.symlink_to(tmp_path / "configs" / "made.json")
    write_text(dangling, "hello")
    assert dangling.is_symlink() and (real.parent / "made.json").read_text() == "hello"


def test_a_fifo_is_written_into(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = {}

    def read():
        with open(fifo, encoding="utf-8") as f:
            got["text"] = f.read()

    reader = threading.Thread(target=read, daemon=True)  # the old code never opened it
    reader.start()
    write_json_atomic(fifo, DOC)
    reader.join(timeout=300)  # a guard only: a reader still waiting this long hung
    assert not reader.is_alive(), "the FIFO's reader hung: nothing was written into it"
    assert json.loads(got["text"]) == DOC
    assert _kind(fifo) == stat.S_IFIFO  # still the FIFO, not a file put in its place
    assert output_target(fifo).direct


def test_dev_null_is_written_into_and_stays_a_device():
    write_json_atomic("/dev/null", DOC)
    assert _kind("/dev/null") == stat.S_IFCHR
    with open_append("/dev/null", encoding="utf-8") as f:
        f.write("x\n")
    assert _kind("/dev/null") == stat.S_IFCHR


def test_dev_full_is_a_storage_error_naming_it():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with pytest.raises(StorageError) as exc:
        write_json_atomic("/dev/full", DOC, "--output: cannot write")
    assert str(exc.value).startswith("--output: cannot write /dev/full: No space left on device")
    assert "character device" in str(exc.value)
    assert _kind("/dev/full") == stat.S_IFCHR


def test_a_socket_is_refused_and_kept(tmp_path):
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        for write in (lambda: write_json_atomic(path, DOC), lambda: open_append(path)):
            with pytest.raises(StorageError, match=f"{path}: it is a socket"):
                write()
        with pytest.raises(StorageError, match="a socket"):
            check_writable(path, "--output: cannot write")
        assert _kind(path) == stat.S_IFSOCK


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(StorageError) as exc:
        write_text(tmp_path, "x", "--plot: cannot write")
    assert f"--plot: cannot write {tmp_path}: it is a directory" in str(exc.value)
    assert list(tmp_path.iterdir()) == []


def test_a_block_device_is_refused(tmp_path):
    dev = tmp_path / "disk"
    try:
        os.mknod(dev, 0o600 | stat.S_IFBLK, os.makedev(7, 250))  # an unused loop minor
    except OSError as exc:
        pytest.skip(f"cannot make a block device node here ({exc.strerror})")
    with pytest.raises(StorageError, match="it is a block device"):
        write_json_atomic(dev, DOC)
    assert _kind(dev) == stat.S_IFBLK


def test_failures_name_the_path_not_the_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "hw.json"

    def refuse(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", src)

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(StorageError) as exc:
        write_json_atomic(path, DOC, "--output: cannot write")
    msg = str(exc.value)
    assert msg.startswith(f"--output: cannot write {path}: Permission denied")
    assert ".tmp" not in msg
    assert list(tmp_path.iterdir()) == []


def test_write_file_binary_and_text_fill(tmp_path):
    path = tmp_path / "a.png"
    write_file(path, lambda f: f.write(b"\x89PNG"), binary=True)
    assert path.read_bytes() == b"\x89PNG"


def test_check_writable_looks_at_the_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StorageError) as exc:
        check_writable(blocker / "hw.json", "--output: cannot write")
    assert str(exc.value).startswith(f"--output: cannot write {blocker / 'hw.json'}: Not a dir")
    with pytest.raises(StorageError, match="Not a directory"):
        check_writable(blocker / "deeper" / "hw.json")
    target = check_writable(tmp_path / "new" / "folder" / "hw.json")  # made when written
    assert not target.exists and not target.direct


def test_check_writable_read_only_folder(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("running as root: chmod does not stop root's writes")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(StorageError, match=f"cannot write {ro / 'hw.json'}: Permission"):
            check_writable(ro / "hw.json")
    finally:
        ro.chmod(0o755)


def test_special_links_are_written_through(tmp_path, monkeypatch):
    """/dev/stdout redirected to a file is a link to that file: written into (as `>`
    would), never replaced by renaming onto the link."""
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        link = Path(f"/proc/self/fd/{f.fileno()}")
        target = output_target(link)
        assert target.direct and target.exists
        write_text(link, "through")
    assert out.read_text() == "through"
