"""FsTransport and the checkpoint-style store: parts written through fsspec, read by range.

Layout under a configured root (local path, `file://`, `memory://`, `gs://` via gcsfs):
`<root>/<session>/v<version>/r<rank>/<content>/part.bin` (and `delta.bin`, the encoded
bytes of the part's delta, when it has one), then `_SUCCESS` last. `<content>` names what
the part holds (`content_id`): a publish the coordinator refuses (the version exists with
other bytes) writes beside the accepted part, never over it. Readers need no route to
the trainer, only to the store. A manifest names a part by its path relative to the root,
`<session>/v<version>/r<rank>/<content>` (`part_path`; the coordinator refuses any other,
except `<session>/v<version>/r<rank>`, the path of trainers that write no content id), and each
reader resolves it under its own configured root: no scheme, no other bucket, no '..'
can come in through a manifest.
"""

from __future__ import annotations

import errno
import posixpath
import re
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec
import xxhash
from fsspec.asyn import AsyncFileSystem

from weightsync.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    TransportUnavailable,
    WeightsyncError,
)
from weightsync.manifest import Endpoint
from weightsync.transports.base import ChunkPayload, FetchRequest, Transport
from weightsync.validation import check_session_name

PART_FILE = "part.bin"
DELTA_FILE = "delta.bin"
MARKER = "_SUCCESS"
_VERSION_DIR = re.compile(r"^v(\d+)$")
_CONTENT = re.compile(r"[0-9a-f]{16}")


def _scheme(uri: str) -> str:
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    return "file" if scheme == "local" else scheme


def _store_path(uri: str) -> str:
    """fsspec's path for uri, normalised (local paths made absolute). Through the class, not
    an instance: making a gcsfs or s3fs instance without the store's options looks for
    credentials (gcsfs asks the GCE metadata server) on every part a rollout opens."""
    protocol = fsspec.core.split_protocol(uri)[0] or "file"
    path = fsspec.get_filesystem_class(protocol)._strip_protocol(uri)
    if _scheme(uri) == "file":
        path = posixpath.abspath(path)
    return posixpath.normpath(path)


def content_id(description: bytes) -> str:
    """The `<content>` directory of a part: a digest of its description (chunk and delta
    digests), so the same bytes land in the same place and other bytes never do."""
    return xxhash.xxh3_64_hexdigest(description)


def part_path(session: str, version: int, rank: int, content: str) -> str:
    """A part's directory relative to the store root: the fs_uri its manifest carries."""
    return f"{_rank_path(session, version, rank)}/{content}"


def _rank_path(session: str, version: int, rank: int) -> str:
    return f"{session}/v{version}/r{rank}"


def check_part_uri(uri: str, session: str, version: int, rank: int, field: str = "endpoint.fs_uri") -> None:
    """Refuses any fs_uri but one of the part's own relative paths (checked at publish)."""
    prefix = _rank_path(session, version, rank)
    if uri != prefix and not (uri.startswith(prefix + "/") and _CONTENT.fullmatch(uri[len(prefix) + 1 :])):
        shown = uri if len(uri) <= 200 else uri[:200] + "…"
        raise InvalidArgument(
            f"{shown!r} must be the part's path relative to the store root, {prefix + '/<16 hex digits>'!r}",
            field=field,
        )


def check_fs_root(root: str, field: str = "fs_root") -> str:
    """Refuses a root whose scheme fsspec does not know, or whose package is not installed
    (`gs://` without the `gcs` extra), at start: a rollout served for hours and failed every
    round on it. Makes no connection."""
    if not root:
        raise InvalidArgument("must not be empty", field=field)
    try:
        fsspec.get_filesystem_class(fsspec.core.split_protocol(root)[0] or "file")
    except (ImportError, ValueError) as e:
        raise InvalidArgument(f"{root!r}: {e}", field=field) from None
    return root


# Object stores: fsspec caches directory listings per filesystem object, and a listing taken
# before the trainer wrote a marker would hide that marker from this process for good.
_NO_LISTINGS_CACHE = {"use_listings_cache": False}
_LOCAL = ("file", "memory")
_S3 = ("s3", "s3a")
_LOCAL_WRITE_BYTES = 64 << 20
# Ranged reads in flight per fetch call on an object store (each lane of a pull makes its own).
RANGES_IN_FLIGHT = 8


class FsStore:
    """One configured root and its storage options (fsspec keyword arguments: endpoint,
    credentials; see `fs_options`); every path it touches is checked to stay inside the root."""

    def __init__(self, root: str, options: Mapping[str, Any] | None = None) -> None:
        check_fs_root(root)
        self.protocol = _scheme(root)
        extra = {} if self.protocol in _LOCAL else _NO_LISTINGS_CACHE
        try:
            self.fs, _ = fsspec.core.url_to_fs(root, **dict(options or {}), **extra)
        except (TypeError, ValueError) as e:  # an option the filesystem does not take
            raise InvalidArgument(f"{root!r}: {e}", field="fs_option") from None
        self.root = _store_path(root)
        self.root_uri = root

    def resolve(self, relative: str, field: str = "endpoint.fs_uri") -> str:
        """The store path of a part path relative to the root (see `part_path`)."""
        if not relative or "://" in relative or relative.startswith("/") or ".." in relative.split("/"):
            raise InvalidArgument(f"{relative!r} is not a path relative to the store root", field=field)
        return self.confine(self.uri_of(posixpath.join(self.root, relative)), field)

    def confine(self, uri: str, field: str = "endpoint.fs_uri") -> str:
        """The store path of `uri`, if it lies under the root (same scheme, no '..')."""
        if _scheme(uri) != self.protocol:
            raise InvalidArgument(f"{uri!r} is not under the configured root {self.root_uri!r} (scheme)", field=field)
        if ".." in uri.split("/"):
            raise InvalidArgument(f"{uri!r} contains '..'", field=field)
        norm = _store_path(uri)
        if norm != self.root and not norm.startswith(self.root.rstrip("/") + "/"):
            raise InvalidArgument(f"{uri!r} is not under the configured root {self.root_uri!r}", field=field)
        return norm

    def _rank_dir(self, session: str, version: int, rank: int) -> str:
        return posixpath.join(self.root, _rank_path(session, version, rank))

    def uri_of(self, path: str) -> str:
        return path if self.protocol == "file" else f"{self.protocol}://{path.lstrip('/')}"

    def write_part(
        self, session: str, version: int, rank: int, data: Any, delta: Any = None, *, content: str
    ) -> tuple[str, bool]:
        """Writes part.bin (and delta.bin: the delta's encoded bytes), then the marker last,
        under the `content` directory (`content_id`); returns the part's path relative to
        the root and whether this call wrote it. A part already there (its marker written)
        holds these bytes: it is left as it is, not rewritten under a reader. A write that
        fails takes what it wrote with it (a store that fills up mid-part would otherwise
        keep a partial copy of the model for good)."""
        relative = part_path(session, version, rank, content)
        d = posixpath.join(self.root, relative)
        try:
            if self.fs.exists(posixpath.join(d, MARKER)):
                return relative, False
            self.fs.makedirs(d, exist_ok=True)
            self._write(posixpath.join(d, PART_FILE), data)
            if delta is not None:
                self._write(posixpath.join(d, DELTA_FILE), delta)
            self.fs.pipe_file(posixpath.join(d, MARKER), b"")
        except OSError as e:  # no marker was written: readers never see the partial part
            try:
                self._remove_upwards(d, session)
            except OSError:
                pass  # the store's trouble again; the part stays unmarked, never read
            raise store_error(e, f"cannot write {self.uri_of(d)}", writing=True) from e
        return relative, True

    def pending_uploads(self, d: str) -> list[tuple[str, str]]:
        """(path, upload id) of the multipart uploads begun under directory `d` and never
        completed nor aborted (a writer killed mid-part): S3 keeps, and bills, their parts
        until they are aborted, and lists them to no reader. Other stores have none a client
        can list (GCS drops an unfinished resumable upload after a week)."""
        if self.protocol not in _S3:
            return []
        bucket, _, key = d.strip("/").partition("/")
        out: list[tuple[str, str]] = []
        page_from: dict[str, str] = {}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{key}/", **page_from)
            out += [(f"{bucket}/{u['Key']}", u["UploadId"]) for u in page.get("Uploads") or ()]
            if not page.get("IsTruncated"):
                return out
            page_from = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def _abort_uploads(self, d: str) -> int:
        pending = self.pending_uploads(d)
        for path, upload in pending:
            bucket, _, key = path.partition("/")
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
        return len(pending)

    def _write(self, path: str, data: Any) -> None:
        """Writes `data` a block at a time: an object store's file buffers what it is given
        whole before it uploads (a copy of the model's part), and uploads each block it
        fills as one part of a multipart (S3) or resumable (GCS) upload."""
        view = memoryview(data).cast("B")
        with self.fs.open(path, "wb") as f:
            step = getattr(f, "blocksize", 0) or _LOCAL_WRITE_BYTES
            for start in range(0, len(view), step):
                f.write(view[start : start + step])

    def _remove_upwards(self, d: str, session: str) -> None:
        """Removes directory `d` (and uploads left unfinished in it), then each parent left
        empty, up to (not including) the session's directory."""
        stop = posixpath.join(self.root, session)
        self._abort_uploads(d)
        if self.fs.exists(d):
            self.fs.rm(d, recursive=True)
        d = posixpath.dirname(d)
        while d != stop and d.startswith(stop + "/") and self.fs.exists(d) and not self.fs.ls(d, detail=False):
            self.fs.rm(d, recursive=True)
            d = posixpath.dirname(d)

    def remove_part(self, session: str, version: int, rank: int) -> None:
        """Garbage-collects one rank's part, every content of it (and the version
        directory once it is empty)."""
        self._remove_upwards(self._rank_dir(session, version, rank), session)

    def remove_content(self, session: str, version: int, rank: int, content: str) -> None:
        """Removes one content directory of a rank's part (a copy the coordinator refused),
        and the directories above it it leaves empty."""
        self._remove_upwards(posixpath.join(self.root, part_path(session, version, rank, content)), session)

    def remove_session(self, session: str) -> bool:
        """Removes a (deleted) session's directory, every version of it; False when the
        store holds none."""
        d = posixpath.join(self.root, check_session_name(session))
        if not self.fs.exists(d):
            return False
        self.fs.rm(d, recursive=True)
        return True

    def remove_version(self, session: str, version: int) -> None:
        """Garbage-collects every rank's part of a version (a restart may have fewer ranks),
        uploads left unfinished under it included.

        Raises:
            FileNotFoundError: the store holds nothing of the version.
        """
        d = posixpath.dirname(self._rank_dir(session, version, 0))
        aborted = self._abort_uploads(d)
        try:
            self.fs.rm(d, recursive=True)
        except FileNotFoundError:
            if not aborted:
                raise

    def versions(self, session: str) -> list[int]:
        """The versions of `session` the store holds anything of (on S3, an unfinished
        upload too)."""
        d = posixpath.join(self.root, session)
        names = [path[len(d) + 1 :].split("/", 1)[0] for path, _ in self.pending_uploads(d)]
        if self.fs.exists(d):
            names += [posixpath.basename(entry.rstrip("/")) for entry in self.fs.ls(d, detail=False)]
        return sorted({int(m.group(1)) for name in names if (m := _VERSION_DIR.fullmatch(name))})


# A write refused for these stays refused until an operator acts: the root is a file, on a
# read-only mount, or not this user's to write.
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST)


def store_error(error: OSError, what: str, *, writing: bool = False) -> WeightsyncError:
    """The store failing under a call, as an error naming `fs_root`: a full store is
    RESOURCE_EXHAUSTED, a write the store refuses for good (`_NOT_WRITABLE`) is
    FAILED_PRECONDITION, anything else (a part collected while read, an I/O or network
    error of the store) UNAVAILABLE, which callers retry, not an exception that ends them."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"{what}: {error}", field="fs_root")
    if writing and error.errno in _NOT_WRITABLE:
        return FailedPrecondition(f"{what}: {error} (the store root is not writable here)", field="fs_root")
    return TransportUnavailable(f"{what}: {error}", field="fs_root")


class FsTransport(Transport):
    """Reads chunk ranges of part.bin; refuses parts whose marker is not there yet."""

    name = "fs"
    cross_host = True

    def __init__(self, root: str = "", options: Mapping[str, Any] | None = None) -> None:
        self._store = FsStore(root, options) if root else None
        self._dir = ""

    def open(self, endpoint: Endpoint) -> None:
        if self._store is None:
            raise InvalidArgument("the fs transport needs the store root it may read (fs_root)", field="fs_root")
        self._dir = self._store.resolve(endpoint.fs_uri)
        try:
            marked = self._store.fs.exists(posixpath.join(self._dir, MARKER))
        except OSError as e:
            raise store_error(e, f"cannot read {endpoint.fs_uri}") from e
        if not marked:
            raise TransportUnavailable(self._missing(endpoint.fs_uri), field="fs_root")

    def _missing(self, fs_uri: str) -> str:
        """Why a READY part's marker is not seen. The trainer writes the marker before it
        publishes, so a part directory or a root missing here means this process's root
        is not the trainer's store (another path, a volume not shared with this host)."""
        assert self._store is not None
        root = self._store.root_uri
        try:
            if not self._store.fs.exists(self._store.root):
                return f"the store root {root!r} does not exist here: is it the trainer's store, mounted on this host?"
            if not self._store.fs.exists(self._dir):
                return (
                    f"{fs_uri} is not under {root!r} here, though it was written before its version was "
                    "published: is fs_root the store the trainer writes, shared with this host?"
                )
        except OSError as e:
            return f"cannot read {fs_uri} under {root!r}: {e}"
        return f"{fs_uri} under {root!r} has no {MARKER} marker"

    def fetch(self, request: FetchRequest) -> Iterator[ChunkPayload]:
        if self._store is None or not self._dir:
            raise TransportUnavailable("not open; call open() first")
        if len(request.spans) != len(request.indices):
            raise InvalidArgument("the fs transport needs (offset, length) for every index", field="spans")
        part = posixpath.join(self._dir, PART_FILE)
        delta = posixpath.join(self._dir, DELTA_FILE)
        paths = [delta if request.chunk_count and i >= request.chunk_count else part for i in request.indices]
        if len(paths) > 1 and isinstance(self._store.fs, AsyncFileSystem):
            # An object store answers each ranged GET after a round trip: the request's
            # chunks are read concurrently (the puller bounds a request to its window).
            try:
                datas = self._store.fs.cat_ranges(
                    paths,
                    [offset for offset, _ in request.spans],
                    [offset + length for offset, length in request.spans],
                    batch_size=RANGES_IN_FLIGHT,
                    on_error="raise",
                )
            except OSError as e:
                raise store_error(e, f"cannot read {part}") from e
            for index, (offset, _), data in zip(request.indices, request.spans, datas):
                yield ChunkPayload(index, offset, memoryview(data))
            return
        for index, path, (offset, length) in zip(request.indices, paths, request.spans):
            try:
                data = self._store.fs.cat_file(path, start=offset, end=offset + length)
            except OSError as e:
                raise store_error(e, f"cannot read {path}") from e
            yield ChunkPayload(index, offset, memoryview(data))

    def close(self) -> None:
        self._dir = ""
