"""A full disk recognised in each form it takes; the ENOSPC of an OSError produced for real by writing to
/dev/full (which fails every write with ENOSPC, no root needed)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from safetensors import SafetensorError

from factory.core.resume import ResumeError
from factory.infra.disk import DiskFull, full_disk_dir, is_disk_full

FULL = Path("/dev/full")


@pytest.mark.skipif(not FULL.is_char_device(), reason="no /dev/full on this system")
def test_an_enospc_write_is_a_full_disk_and_names_its_directory():
    with pytest.raises(OSError) as e, open(FULL, "wb") as f:
        f.write(b"x" * 65536)
        f.flush()
    assert e.value.errno == errno.ENOSPC and is_disk_full(e.value)
    assert full_disk_dir(e.value, default="/elsewhere") == Path("/elsewhere")  # a write error names no file


def test_safetensors_reports_a_full_disk_without_an_errno_and_it_is_still_recognised(tmp_path):
    # safetensors writes through a temp file renamed over the target, so /dev/full cannot show its error (and
    # would be replaced by a file): the error is built with the text safetensors 0.8 gives an ENOSPC write.
    e = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                        'left on device" })')
    assert not isinstance(e, OSError) and is_disk_full(e)
    assert full_disk_dir(e, default=tmp_path) == tmp_path


def test_a_full_disk_deep_in_a_chain_keeps_the_directory_that_filled():
    try:
        try:
            raise DiskFull("/runs/r1/resume", OSError(errno.ENOSPC, "No space left on device"))
        except DiskFull as inner:
            raise ResumeError("writing a resume point failed") from inner
    except ResumeError as outer:
        assert full_disk_dir(outer) == Path("/runs/r1/resume") and str(outer.__cause__) == "disk full: /runs/r1/resume"


def test_other_errors_are_not_a_full_disk():
    assert not is_disk_full(FileNotFoundError(errno.ENOENT, "No such file or directory", "/x"))
    assert not is_disk_full(ValueError("bad row"))
    assert full_disk_dir(PermissionError(errno.EACCES, "Permission denied")) is None
