"""Object storage through fsspec: a local directory by default, ``s3://`` through s3fs.

S3 settings come from the recipe's ``storage.options`` (``endpoint_url``, ``region``,
``key``, ``secret``, ``token``, or any s3fs argument) and otherwise from the usual AWS
variables (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_REGION`` /
``AWS_DEFAULT_REGION``; credentials through botocore's own chain).

Writes are atomic: a reader sees a whole object or none. Locally a file is written under
a hidden temporary name and renamed; on S3 an upload only becomes visible when it
completes, and a failed one is aborted.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import fsspec
from fsspec import AbstractFileSystem

_CHUNK = 8 << 20


def resolve_options(uri: str, options: dict | None = None) -> dict:
    """fsspec options for ``uri``: the recipe's, plus S3 endpoint and region from the
    environment when the recipe leaves them out. The result is plain data, so a driver
    can resolve it once and hand it to workers whose environment differs."""
    opts = dict(options or {})
    if _protocol(uri) not in ("s3", "s3a"):
        return opts
    client = dict(opts.pop("client_kwargs", {}) or {})
    env = os.environ
    endpoint = opts.pop("endpoint_url", None) or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    region = (opts.pop("region", None) or client.get("region_name")
              or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"))
    if endpoint:
        opts["endpoint_url"] = endpoint
    if region:
        client["region_name"] = region
    if client:
        opts["client_kwargs"] = client
    return opts


def filesystem(uri: str, options: dict | None = None) -> tuple[AbstractFileSystem, str]:
    """(filesystem, path inside it) for a local path or URL."""
    if _protocol(uri) == "file":
        uri = os.path.abspath(os.path.expanduser(uri))  # workers may run in another cwd
    fs, path = fsspec.core.url_to_fs(uri, **resolve_options(uri, options))
    return fs, path.rstrip("/")


def absolute_uri(uri: str) -> str:
    """``uri`` with a local path made absolute (URLs unchanged)."""
    return os.path.abspath(os.path.expanduser(uri)) if _protocol(uri) == "file" else uri.rstrip("/")


def join(*parts: str) -> str:
    return posixpath.join(*parts)


def is_local(fs: AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


class HashingWriter:
    """A write-only file object that hashes (sha256) and counts what passes through, as a
    whole and in segments cut by :meth:`cut` (a shard's row groups: a reader can check one
    range of the object without reading the rest)."""

    def __init__(self, raw):
        self.raw = raw
        self.sha = hashlib.sha256()
        self.nbytes = 0
        self.closed = False
        self._segment = hashlib.sha256()
        self._segment_start = 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self._segment.update(view)
        self.raw.write(view)
        self.nbytes += view.nbytes
        return view.nbytes

    def cut(self) -> dict:
        """``{offset, length, sha256}`` of the bytes written since the last cut (or the start)."""
        segment = {"offset": self._segment_start, "length": self.nbytes - self._segment_start,
                   "sha256": self._segment.hexdigest()}
        self._segment, self._segment_start = hashlib.sha256(), self.nbytes
        return segment

    def tell(self) -> int:
        return self.nbytes

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    def close(self) -> None:
        # pyarrow closes its sink when a ParquetWriter closes; committing is open_atomic's job
        self.closed = True

    @property
    def hexdigest(self) -> str:
        return self.sha.hexdigest()


@contextmanager
def open_atomic(fs: AbstractFileSystem, path: str) -> Iterator[HashingWriter]:
    """Write ``path`` so that it appears whole or not at all; yields a :class:`HashingWriter`
    whose ``hexdigest`` and ``nbytes`` describe the committed bytes."""
    if is_local(fs):
        head, tail = posixpath.split(path)
        fs.makedirs(head, exist_ok=True)
        tmp = posixpath.join(head, f".tmp-{uuid.uuid4().hex[:8]}-{tail}")
        raw = open(tmp, "wb")
        try:
            writer = HashingWriter(raw)
            yield writer
            raw.flush()
            os.fsync(raw.fileno())
            raw.close()
            os.replace(tmp, path)  # atomic on one filesystem
        except BaseException:
            raw.close()
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
    else:
        raw = fs.open(path, "wb")
        try:
            writer = HashingWriter(raw)
            yield writer
        except BaseException:
            raw.discard()  # abort the multipart upload: nothing becomes visible
            raw.closed = True  # so that garbage collection does not complete it after all
            raise
        raw.close()  # completes the upload


def write_bytes(fs: AbstractFileSystem, path: str, data: bytes) -> str:
    """Atomically write ``data``; returns its sha256."""
    with open_atomic(fs, path) as out:
        out.write(data)
    return out.hexdigest


def write_json(fs: AbstractFileSystem, path: str, obj) -> None:
    write_bytes(fs, path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def read_json(fs: AbstractFileSystem, path: str):
    with fs.open(path, "rb") as f:
        return json.loads(f.read())


def read_json_many(fs: AbstractFileSystem, paths: list[str]) -> list:
    """Several small JSON objects, fetched concurrently where the filesystem can."""
    if not paths:
        return []
    blobs = fs.cat(paths, on_error="raise") if len(paths) > 1 else {paths[0]: fs.cat_file(paths[0])}
    return [json.loads(blobs[_key(fs, p, blobs)]) for p in paths]


def _key(fs: AbstractFileSystem, path: str, blobs: dict) -> str:
    # fsspec returns keys in its own spelling (with or without a protocol prefix)
    if path in blobs:
        return path
    stripped = fs._strip_protocol(path)
    return next(k for k in blobs if fs._strip_protocol(k) == stripped)


def exists(fs: AbstractFileSystem, path: str) -> bool:
    fs.invalidate_cache(path)  # listings may be cached; decisions here must see the store as it is
    return fs.exists(path)


def list_files(fs: AbstractFileSystem, directory: str, suffix: str = "") -> list[str]:
    """Files directly under ``directory`` ending with ``suffix`` (sorted; [] if none)."""
    fs.invalidate_cache(directory)
    try:
        names = fs.ls(directory, detail=False)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.endswith(suffix) and not posixpath.basename(n).startswith("."))


def sha256_file(fs: AbstractFileSystem, path: str) -> tuple[str, int]:
    """(sha256 hex, size) of a stored object, read in chunks."""
    sha, n = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            n += len(chunk)
    return sha.hexdigest(), n


def read_range(fs: AbstractFileSystem, path: str, offset: int, length: int) -> bytes:
    """``length`` bytes of a stored object from ``offset``: one ranged read (an HTTP range
    request on S3), nothing cached around it."""
    data = fs.cat_file(path, start=offset, end=offset + length)
    if len(data) != length:
        raise IOError(f"{path}: read {len(data)} bytes at offset {offset}, expected {length} (truncated object?)")
    return data


def download(fs: AbstractFileSystem, path: str, local_path: str) -> tuple[str, int]:
    """Stream a stored object to a local file; returns its (sha256 hex, size)."""
    sha, n = hashlib.sha256(), 0
    with fs.open(path, "rb") as src, open(local_path, "wb") as dst:
        while chunk := src.read(_CHUNK):
            sha.update(chunk)
            dst.write(chunk)
            n += len(chunk)
    return sha.hexdigest(), n


def _protocol(uri: str) -> str:
    head, sep, _ = uri.partition("://")
    return head.lower() if sep else "file"
