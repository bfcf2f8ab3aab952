"""Writing files: checked before any work starts, written whole or not at all.

- ``check_out_dir``: a command's ``--out`` folder is checked before the command measures or
  traces anything: not an existing file, no symbolic link to nothing on the way, names the
  file system takes, inside a folder this user can write, so a long run never ends on an
  error about where its results were to go.
- ``write_atomic``: every file memplan writes goes to a temporary file in the same folder,
  flushed to disk, then renamed over the target (``os.replace``, atomic on POSIX and Windows),
  so a crash, a full disk or Ctrl-C leaves the old file or the new one, never half of one.
- ``staged_dir``: a command that writes several files (``memplan profile --out``) writes them
  into a hidden staging folder and moves them into place only when all are written; on any
  failure or Ctrl-C the staging folder is removed and ``--out`` is as it was (a new folder is
  not created at all). A staging folder a killed run left (SIGKILL, a node gone down) is
  removed by the next run into the same folder, never a live run's (``remove_stale_staging``).
- Nothing is written through a link planted where a file goes: ``os.replace`` replaces a
  link rather than following it, and ``open_append`` (a file appended to across a run,
  ``MemoryMonitor``'s) refuses one.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError

_STAGING = ".memplan-staging-"
# A staging folder whose owner cannot be asked (another machine's, on a shared file system,
# or one an older memplan made without naming its owner) is stale once nothing in it has
# changed for this long: two days, longer than any profile or calibration writes its files.
STALE_STAGING_S = 2 * 24 * 3600


class WriteError(MemplanError):
    """A file could not be written (``path``: which; ``reason``: the OS's words)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"cannot write {path}: {reason}; it is as it was")
        self.path = path
        self.reason = reason


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _plain_mode(path: str | os.PathLike[str], folder: bool = False) -> None:
    """The permissions an ordinary open() or mkdir() would have given (``tempfile`` makes its
    files 0600 and folders 0700, private to the user)."""
    os.chmod(path, (0o777 if folder else 0o666) & ~_umask())


def _existing_ancestor(path: Path, what: str = "--out") -> Path:
    """The nearest of ``path`` and its parents that exists. A symbolic link to nothing on the
    way (dangling, or a loop: ``exists()`` answers False for both) is refused here, before
    any work, rather than when the results are moved into place."""
    for parent in (path, *path.parents):
        if os.path.lexists(parent):
            if not parent.exists():
                raise MemplanError(f"{what}: {parent} is a symbolic link to nothing (to "
                                   f"{os.readlink(parent)}: missing, or a loop); remove it or "
                                   "give another folder")
            return parent
    return Path(".")


def _name_max(base: Path) -> int:
    try:
        return os.pathconf(base, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows): the common limit
        return 255


def check_file_name(path: Path, what: str) -> None:
    """One line naming ``what`` for a file name longer than its folder's file system takes
    (checked before work, where the write would fail only at the end)."""
    longest = _name_max(_existing_ancestor(path.parent, what))
    if len(os.fsencode(path.name)) > longest:
        raise MemplanError(f"{what}: {path}: a file name of {len(os.fsencode(path.name))} bytes "
                           f"is too long (this file system takes {longest})")


def check_out_file(path: str | os.PathLike[str], what: str, suffixes: tuple[str, ...],
                   kinds: str) -> Path:
    """``path`` as a file to write, checked before any work: a name ending in one of
    ``suffixes`` (``kinds`` says them, e.g. ".png or .svg"), not a folder, in a folder that
    exists or can be made and that this user can write, a name the file system takes."""
    p = Path(path).expanduser()
    if p.suffix.lower() not in suffixes:
        raise MemplanError(f"{what}: {p}: the name must end in {kinds}")
    check_out_dir(p.parent, what)
    check_file_name(p, what)
    if p.is_dir():
        raise MemplanError(f"{what}: {p} is a folder; give a file name ending in {kinds}")
    return p


def check_out_dir(path: str | os.PathLike[str], what: str = "--out") -> Path:
    """``path`` as a folder to write results into: an existing folder, or one that can be
    created. One line naming ``what`` and the problem otherwise (an existing file, a file in
    the way, a symbolic link to nothing, a name longer than the file system takes, a folder
    this user cannot write)."""
    p = Path(path).expanduser()
    try:
        return _check_out_dir(p, what)
    except OSError as err:  # e.g. ENAMETOOLONG from stat: said with the option's name
        raise MemplanError(f"{what}: {p}: {err.strerror or err}") from None


def _check_out_dir(p: Path, what: str) -> Path:
    if p.exists() and not p.is_dir():
        raise MemplanError(f"{what}: {p} is an existing file, not a folder; give a folder "
                           "(it is created if missing)")
    base = _existing_ancestor(p, what)
    if not base.is_dir():
        raise MemplanError(f"{what}: {p} cannot be created: {base} is a file, not a folder")
    longest = _name_max(base)
    for part in p.relative_to(base).parts if p.is_absolute() == base.is_absolute() else ():
        if len(os.fsencode(part)) > longest:
            raise MemplanError(f"{what}: {p} cannot be created: a folder name of "
                               f"{len(os.fsencode(part))} bytes is too long (this file "
                               f"system takes {longest})")
    if not os.access(base, os.W_OK | os.X_OK):
        raise MemplanError(f"{what}: cannot write in {base} (permission denied); give a folder "
                           "you can write")
    return p


def refuse_link(path: Path, what: str) -> None:
    """One line for an output that is a symbolic link (dangling or not): in a shared folder
    another user may have planted it to make this job write to a file of their choosing."""
    if path.is_symlink():
        raise MemplanError(f"{what}: {path} is a symbolic link (to {os.readlink(path)}); "
                           "memplan writes no file through a link: remove it or give another "
                           "folder")


def open_append(path: Path, what: str) -> Any:
    """``path`` opened to append to (created if missing), never through a link: the last
    component is opened with O_NOFOLLOW (a symbolic link planted there fails instead of being
    followed) and O_NONBLOCK (a FIFO planted there fails instead of waiting for a reader),
    and what opened must be a regular file with no other name (a hard link to another
    user's file is refused). An unbuffered binary file; one line (``MemplanError``) naming
    ``what`` and the path otherwise."""
    refuse_link(path, what)  # where O_NOFOLLOW does not exist (Windows), and for the message
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:  # a link planted between the check and the open
            refuse_link(path, what)
        if err.errno == errno.ENXIO:  # a FIFO with no reader
            raise MemplanError(f"{what}: {path} is not a regular file") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        kind = "a hard link to another file" if stat.S_ISREG(info.st_mode) else "not a file"
        raise MemplanError(f"{what}: {path} is {kind}; memplan appends only to a file of its "
                           "own: remove it or give another folder")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "ab", buffering=0)


def check_inside(out: Path, inner: Path, what: str = "--out") -> None:
    """Each folder from ``out`` down to ``inner`` that exists already is a folder of its own,
    not a symbolic link: a link planted inside ``out`` (in a shared folder) would take the
    results elsewhere. One line naming ``what`` and the link otherwise."""
    path = out
    for part in inner.relative_to(out).parts:
        path = path / part
        if path.is_symlink():
            raise MemplanError(f"{what}: {path} is a symbolic link (to {os.readlink(path)}); "
                               f"results are written only inside {out}: remove it")
        if path.exists() and not path.is_dir():
            raise MemplanError(f"{what}: {path} is a file, not a folder")


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` to ``path`` whole: a temporary file beside it, flushed to disk, then
    renamed over it. On any failure the temporary file is removed and ``path`` is as it was;
    an ``OSError`` (a full disk) becomes one line naming the file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the temporary name is cut so that it fits where the final name (up to 255 bytes) fits
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:64]}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        _plain_mode(tmp)
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise WriteError(path, err.strerror or str(err)) from err
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _publish(staging: Path, out: Path) -> None:
    """Move every file of ``staging`` into ``out`` (each an atomic rename), or ``staging``
    itself when ``out`` does not exist yet."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staging, out)
        return
    for item in sorted(staging.iterdir()):
        os.replace(item, out / item.name)
    staging.rmdir()


def _host() -> str:
    return "".join(c for c in socket.gethostname() if c.isalnum() or c in "-.")[:64] or "host"


def _staging_prefix(name: str) -> str:
    """``.memplan-staging-<pid>@<host>@<name>``: the run that owns a staging folder, so a later
    run can tell one left by a killed run from a live one's (``remove_stale_staging``); the
    name is cut so the folder's name stays within the file system's 255 bytes."""
    return f"{_STAGING}{os.getpid()}@{_host()}@{name[:64]}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError, OSError):
        return True  # another user's, or a pid this system cannot even ask about: kept
    return True


def _stale(entry: Path, host: str, now: float) -> bool:
    """Whether a staging folder was left by a run that is over: its owner is a process of
    this machine that no longer exists, or (a folder of another machine, or of an older
    memplan that did not name its owner) nothing in it changed for ``STALE_STAGING_S``."""
    pid, _, rest = entry.name[len(_STAGING):].partition("@")
    if pid.isascii() and pid.isdigit() and rest.partition("@")[0] == host:
        return not _alive(int(pid))
    latest = max([entry.lstat().st_mtime, *(p.lstat().st_mtime for p in entry.iterdir())])
    return now - latest > STALE_STAGING_S


def remove_stale_staging(base: Path) -> list[Path]:
    """Remove the staging folders in ``base`` that runs killed before they could clean up
    (SIGKILL, a node that went down) left behind, and return them: only this user's, and only
    stale ones (``_stale``); a concurrent live run's folder is never touched."""
    host, removed = _host(), []
    try:
        entries = [e for e in base.iterdir() if e.name.startswith(_STAGING)]
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        try:
            info = entry.lstat()
            if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
                    or not _stale(entry, host, now)):
                continue
            shutil.rmtree(entry)
            removed.append(entry)
        except OSError:  # gone meanwhile, or not ours to remove: left as it is
            continue
    return removed


@contextmanager
def staged_dir(out: str | os.PathLike[str], what: str = "--out") -> Iterator[Path]:
    """A staging folder to write ``out``'s files into; they move into ``out`` when the block
    ends without error. On an error or Ctrl-C nothing of the run is left: the staging folder
    is removed, and ``out`` keeps what it held before (or is not created)."""
    out = check_out_dir(out, what)
    base = out if out.exists() else _existing_ancestor(out.parent, what)
    remove_stale_staging(base)
    try:
        staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(out.name if base != out else ""),
                                        dir=base))
        _plain_mode(staging, folder=True)
    except OSError as err:
        raise MemplanError(f"{what}: cannot write in {base}: {err.strerror or err}") from err
    try:
        try:
            yield staging
        except WriteError as err:  # name the file where it was to go, not the staging copy
            raise MemplanError(f"{what}: cannot write {out / err.path.name}: {err.reason}; "
                               f"nothing of this run was kept") from err
        except OSError as err:
            if err.filename is None or not str(err.filename).startswith(str(staging)):
                raise
            name = Path(err.filename).name
            raise MemplanError(f"{what}: cannot write {out / name}: {err.strerror or err}; "
                               "nothing of this run was kept") from err
        try:
            _publish(staging, out)
        except OSError as err:
            raise MemplanError(f"{what}: cannot move the results into {out}: "
                               f"{err.strerror or err}") from err
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


__all__ = ["WriteError", "check_file_name", "check_inside", "check_out_dir", "open_append",
           "refuse_link", "remove_stale_staging", "staged_dir", "write_atomic"]
