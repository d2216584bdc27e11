"""Files the user names (run and sweep folders, grids, probe and corpus files): checked before
any work starts, read with errors that say which file, what is wrong and what to do.

    check_out_dir(path, "--out")      a folder commpipe may create and write into, or an error
    check_out_file(path, "--out")     a file commpipe may (re)write, or an error
    read_text(path, "grid")           UTF-8 text, or an error naming the file and the bad byte
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


class StorageError(ValueError):
    """A file or folder commpipe must read or write cannot be used; the message names it, why,
    and what to change. A ValueError, so the command line prints it as one line."""


def os_reason(exc: OSError) -> str:
    """'No space left on device (ENOSPC)' from an OSError."""
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


def check_out_dir(path, flag: str) -> Path:
    """`path` as a folder that exists (created here if missing) and takes new files: the check
    writes and removes a small file, which also finds read-only mounts (os.access does not,
    and root passes every permission check)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise StorageError(f"{flag} {p} is a file, not a folder; give a folder path")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(p) else ""
        raise StorageError(f"{flag} {p}: cannot create the folder{where}: {os_reason(e)}; "
                           "give a folder you can write to") from None
    probe = p / f".commpipe-write-check-{os.getpid()}"
    try:
        probe.write_bytes(b"")
    except OSError as e:
        raise StorageError(f"{flag} {p}: cannot write into the folder: {os_reason(e)}; give a "
                           "folder you can write to") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    return p


def check_out_file(path, flag: str) -> Path:
    """`path` as a file commpipe will write: not a folder, in a folder that exists and takes
    new files (checked before a long measurement, not after it)."""
    p = Path(path)
    if p.is_dir():
        raise StorageError(f"{flag} {p} is a folder; give a file path, e.g. {p / 'out.json'}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise StorageError(f"{flag} {p}: folder {parent} does not exist; create it or give "
                           "another path")
    if p.exists():
        try:
            with open(p, "r+b"):
                pass
        except OSError as e:
            raise StorageError(f"{flag} {p}: cannot write the file: {os_reason(e)}") from None
    else:
        check_out_dir(parent, f"{flag} {p}: folder")
    return p


def read_text(path, what: str) -> str:
    """The UTF-8 text of `path`; `what` names the file in errors ("grid", "probe")."""
    p = Path(path)
    if p.is_dir():
        raise StorageError(f"{what} file {p} is a folder; give the file itself")
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} file {p} does not exist") from None
    except OSError as e:
        raise StorageError(f"{what} file {p}: cannot read it: {os_reason(e)}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StorageError(f"{what} file {p} is not UTF-8 text: {not_utf8(data, e)}; save it as "
                           "UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def not_utf8(data: bytes, e: UnicodeDecodeError) -> str:
    """Where a UTF-8 decode failed: 'byte 0xff at line 3, column 7'."""
    line = data.count(b"\n", 0, e.start) + 1
    column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
    return f"byte 0x{data[e.start]:02x} at line {line}, column {column}"


def first_bad_utf8(path) -> str:
    """Where `path` first stops being UTF-8 ('byte 0xff at line 3, column 7'), read in chunks so
    a large corpus file is never held whole."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    line, column_start, offset = 1, 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                bad = e.start - len(e.object) + len(chunk) if len(e.object) > len(chunk) else e.start
                bad = max(bad, 0)
                line += chunk.count(b"\n", 0, bad)
                nl = chunk.rfind(b"\n", 0, bad)
                column = bad - nl if nl >= 0 else offset + bad - column_start + 1
                return f"byte 0x{chunk[bad]:02x} at line {line}, column {column}"
            line += chunk.count(b"\n")
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                column_start = offset + nl + 1
            offset += len(chunk)
    return "an invalid byte"
