"""Downloads (``.part`` then rename) and archive checks (integrity, sha256, members)."""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import re
import sys
import tarfile
import urllib.error
import urllib.request
from typing import Dict, Optional, Sequence

from . import RecipeError, atomic_write_text

_CHUNK = 1 << 20


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def read_checksums(path: Optional[str]) -> Dict[str, str]:
    """``sha256sum``-format file (``HEX  name`` per line) -> {basename: hex}."""
    if not path:
        return {}
    sums = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2 or not re.fullmatch(r"[0-9a-fA-F]{64}", parts[0]):
                raise RecipeError(
                    f"CHECKSUMS file {path}, line {number}: expected '<sha256 hex>  <file name>'"
                )
            sums[os.path.basename(parts[1].lstrip("*"))] = parts[0].lower()
    return sums


def check_archive(path: str, expected_sha256: Optional[str] = None,
                  name: Optional[str] = None) -> str:
    """Read a downloaded archive to its end and return its sha256.

    gzip (``.tgz``/``.gz``): decompressed to the end, which checks the end-of-stream marker,
    CRC and length. tar (``.tgz``/``.tar.gz``/``.tar``): every member is read through and its
    length compared with its header; at least one member is required. Other file types are
    only hashed. A wrong ``expected_sha256`` is an error naming both digests.
    """
    name = os.path.basename(name or path)  # the final name decides the format (not ".part")
    try:
        if name.endswith((".tgz", ".gz")):
            # the gzip module checks the end-of-stream marker, CRC and length; tarfile's
            # stream reader alone accepts a gzip stream cut short
            with gzip.open(path, "rb") as handle:
                while handle.read(_CHUNK):
                    pass
        if name.endswith((".tgz", ".tar.gz", ".tar")):
            members = 0
            with tarfile.open(path, mode="r|*") as archive:
                for member in archive:
                    members += 1
                    if member.isfile():
                        extracted = archive.extractfile(member)
                        size = 0
                        for block in iter(lambda: extracted.read(_CHUNK), b""):
                            size += len(block)
                        if size != member.size:
                            raise RecipeError(
                                f"archive {path} is incomplete: {member.name} has {size} of "
                                f"{member.size} bytes", code=4)
            if members == 0:
                raise RecipeError(f"archive {path} is empty", code=4)
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile) as error:
        raise RecipeError(f"archive {path} is damaged or incomplete ({error})", code=4) from None
    digest = sha256_of(path)
    if expected_sha256 and digest != expected_sha256.lower():
        raise RecipeError(
            f"archive {path} has sha256 {digest}, expected {expected_sha256} (from CHECKSUMS); "
            "delete it to download it again, or fix the CHECKSUMS entry",
            code=4,
        )
    return digest


def fetch(url: str, dest: str, expected_sha256: Optional[str] = None, timeout: float = 60) -> str:
    """Download ``url`` to ``dest`` unless a checked copy is there; return its sha256.

    A checked copy has a ``dest.sha256`` marker written after :func:`check_archive` passed
    (so an interrupted download or check is redone). The download goes to ``dest.part``
    and is renamed only once complete. Network failures raise ``RecipeError`` (exit 3) with
    the URL and how to work around it.
    """
    marker = dest + ".sha256"
    if os.path.exists(dest) and os.path.exists(marker):
        with open(marker, encoding="utf-8") as handle:
            recorded = handle.read().strip()
        if not expected_sha256 or recorded == expected_sha256.lower():
            print(f"fetch: {dest} already downloaded and checked (sha256 {recorded})")
            return recorded
    if os.path.exists(dest):
        print(f"fetch: checking existing {dest}")
        try:
            digest = check_archive(dest, expected_sha256)
        except RecipeError as error:
            print(f"fetch: {error}; downloading it again", file=sys.stderr)
            os.remove(dest)
        else:
            atomic_write_text(marker, digest + "\n")
            return digest
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    part = dest + ".part"
    print(f"fetch: downloading {url} -> {dest}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(part, "wb") as out:
            total = response.headers.get("Content-Length")
            copied = 0
            for block in iter(lambda: response.read(_CHUNK), b""):
                out.write(block)
                copied += len(block)
            if total is not None and copied != int(total):
                raise RecipeError(
                    f"download of {url} stopped after {copied} of {total} bytes", code=3
                )
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as error:
        if os.path.exists(part):
            os.remove(part)
        reason = getattr(error, "reason", error)
        raise RecipeError(
            f"could not download {url}: {reason}.\n"
            "  No network here? Copy the file by other means to "
            f"{dest} (it is checked before use), or point the recipe's base-URL variable "
            "(WMT14_BASE_URL / IWSLT14_URL) at a mirror.",
            code=3,
        ) from None
    try:
        digest = check_archive(part, expected_sha256, name=dest)
    except RecipeError:
        os.remove(part)
        raise
    os.replace(part, dest)
    atomic_write_text(marker, digest + "\n")
    if not expected_sha256:
        print(f"fetch: {os.path.basename(dest)} sha256 {digest} (no CHECKSUMS entry; "
              "add it to pin this download)")
    return digest


def extract(archive: str, dest: str, expect: Sequence[str]) -> None:
    """Unpack ``archive`` into ``dest`` and check that every path in ``expect`` exists.

    Members are unpacked with tarfile's ``data`` filter where available (no absolute
    paths, no links out of ``dest``).
    """
    os.makedirs(dest, exist_ok=True)
    try:
        with tarfile.open(archive, mode="r:*") as handle:
            if hasattr(tarfile, "data_filter"):
                handle.extractall(dest, filter="data")
            else:  # pragma: no cover  (Python < 3.11.4)
                handle.extractall(dest)
    except (tarfile.TarError, OSError) as error:
        raise RecipeError(f"cannot unpack {archive}: {error}", code=4) from None
    missing = [p for p in expect if not os.path.exists(os.path.join(dest, p))]
    if missing:
        raise RecipeError(
            f"{archive} does not contain the expected file(s) {', '.join(missing)}: is it the "
            "right archive (check the base URL)?",
            code=4,
        )


