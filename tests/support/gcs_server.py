"""A Google Cloud Storage emulator (gcp-storage-emulator) over real HTTP on 127.0.0.1.

The emulator's JSON API handler and in-memory store run in a background thread of the test
process, behind a threading `http.server` on a free port. gcsfs finds it through
`STORAGE_EMULATOR_HOST`, which `running_gcs_server` sets (with the other variables below) for
its duration, so Ray workers started meanwhile inherit them. Like `s3_server`, the server logs
the bytes it serves per request: range-read tests count what left the server.

Two things gcsfs needs to talk to the emulator:

* `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`. gcsfs (2025.x and later) otherwise exports
  `ExtendedGcsFileSystem`, which asks each bucket's type over gRPC, a protocol the emulator
  does not speak, and waits 60 s before falling back to plain JSON-API behaviour. gcsfs reads
  the variable once, when `gcsfs` is first imported: a Ray worker started inside the context
  imports it afresh and gets the plain `GCSFileSystem`; this process may have imported gcsfs
  before (another test module, at collection), so the context also registers the plain class
  with fsspec for `gs://` and `gcs://` here, and restores the registry at the end.
* `token="anon"` in the options (see `storage_options`). Without a token gcsfs tries the
  application-default credentials, then the GCE metadata server, before going anonymous.

What the emulator (gcp-storage-emulator 2026.7) does not do and real GCS does, added here
around it (`_handler`), because ram-dist relies on it: the preconditions `ifGenerationMatch`
(0: the object must not exist) on uploads, deletes and compose (the destination's, and each
source's `objectPreconditions`), answered 412; compose's limit of 32 sources (400); a media
download at a `generation` that is no longer the live one (404, a bucket without
versioning). The emulator does keep generations, and checks a multipart upload's `crc32c`
and `md5Hash` against its body; it ignores `X-Goog-Hash` on uploads (ram-dist checks the
CRC32C the answer carries), and its composite objects carry an MD5, which GCS's do not.
Requests run one at a time against the emulator's store (it has no locks); a test's delays
and injected faults (`GcsServer.intercept`, `part_delay_s`) happen before that, so a slow
request does not hold up the others.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote

from gcp_storage_emulator.server import RequestHandler
from gcp_storage_emulator.storage import Storage as EmulatorStorage
from s3_server import env

#: The environment gcsfs needs (besides STORAGE_EMULATOR_HOST, which names the port).
GCS_ENV = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
PROTOCOLS = ("gs", "gcs")
#: Most sources one compose takes on GCS.
MAX_COMPOSE_SOURCES = 32
#: Where ram-dist's GCS sink uploads the parts of a shard.
PARTS_DIR = ".ram-dist-parts"


@dataclass(frozen=True)
class Served:
    method: str
    path: str
    range: str | None
    nbytes: int
    status: int = 200
    object: str | None = None
    """The object an upload named (its `name`), else None."""


class _Server(ThreadingHTTPServer):
    # A deep accept queue: a Ray worker's cat_ranges opens many connections at once, and a
    # full queue makes the kernel drop SYNs, which clients retry only after a second.
    request_queue_size = 128
    daemon_threads = True


@dataclass
class GcsServer:
    """A running emulator: `endpoint` is its URL, `log` what it served."""

    endpoint: str = ""
    log: list[Served] = field(default_factory=list)
    store: EmulatorStorage | None = None
    part_delay_s: float = 0.0
    """Seconds each upload of a part object (under `PARTS_DIR`) waits before it is served: a
    slow link, so a test can stop a job while parts are in flight."""
    intercept: Callable[[str, str, dict[str, list[str]]], int | None] | None = None
    """Called with each request's method, path and query before it is served: a test's hook
    at a known step of a job, or a fault: a returned HTTP status (503, 429) is answered
    instead, with GCS's JSON error body."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    store_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """Held while the emulator serves a request: its store has no locks of its own."""

    def generation(self, bucket: str, name: str) -> int:
        """The live generation of an object, 0 when there is none."""
        assert self.store is not None
        obj = self.store.objects.get(bucket, {}).get(name)
        return int(obj["generation"]) if obj else 0

    def delete(self, bucket: str, name: str) -> None:
        """Delete an object from inside a hook (the server's thread)."""
        assert self.store is not None
        with self.store_lock:
            self.store.delete_file(bucket, name)

    def names(self, bucket: str, prefix: str = "") -> list[str]:
        """The objects of `bucket` whose name starts with `prefix`, sorted."""
        assert self.store is not None
        with self.store_lock:
            return sorted(n for n in self.store.objects.get(bucket, {}) if n.startswith(prefix))

    def part_uploads(self) -> list[str]:
        """The object names of part uploads served (successful or not), in order."""
        with self._lock:
            return [
                s.object
                for s in self.log
                if s.method == "POST"
                and s.object
                and f"/{PARTS_DIR}/" in s.object
                and s.path.startswith("/upload/")
            ]

    def record(self, served: Served) -> None:
        with self._lock:
            self.log.append(served)

    def object_gets(self, bucket: str, prefix: str = "") -> list[Served]:
        """Media downloads (`alt=media`) of objects in `bucket` whose name starts with
        `prefix`; the path names the object, URL-quoted."""
        from urllib.parse import unquote

        def name(s: Served) -> str | None:
            for head in (f"/download/storage/v1/b/{bucket}/o/", f"/storage/v1/b/{bucket}/o/"):
                if s.path.startswith(head):
                    return unquote(s.path[len(head) :])
            return None

        with self._lock:
            return [
                s
                for s in self.log
                if s.method == "GET" and (n := name(s)) is not None and n.startswith(prefix)
            ]

    def clear(self) -> None:
        with self._lock:
            self.log.clear()


def _error(status: int, message: str) -> bytes:
    reason = {412: "conditionNotMet", 400: "invalid", 429: "rateLimitExceeded"}
    return json.dumps({"error": {"code": status, "message": message, "errors": [
        {"domain": "global", "reason": reason.get(status, "backendError"), "message": message}
    ]}}).encode()  # fmt: skip


def _upload_name(query: dict[str, list[str]], body: bytes) -> str | None:
    """The object an upload request names: its `name` query, else its multipart metadata's."""
    if "name" in query:
        return query["name"][0]
    start = body.find(b"{")
    if start < 0:
        return None
    try:
        meta, _ = json.JSONDecoder().raw_decode(
            body[start : start + 65536].decode("utf-8", "replace")
        )
    except ValueError:
        return None
    return meta.get("name")


def _handler(srv: GcsServer, store: EmulatorStorage) -> type[RequestHandler]:
    class Handler(RequestHandler):
        """The emulator's handler behind the checks real GCS makes (module docstring),
        recording what each response carried."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._nbytes = 0
            self._status = 200
            self._object: str | None = None
            super().__init__(store, *args, **kwargs)

        def send_response(self, code: int, message: str | None = None) -> None:
            self._status = code
            super().send_response(code, message)

        def send_header(self, keyword: str, value: str) -> None:
            if keyword.lower() == "content-length":
                self._nbytes = int(value)
            super().send_header(keyword, value)

        def end_headers(self) -> None:
            super().end_headers()
            path, _, query = self.path.partition("?")
            if self.command != "GET" or "alt=media" in query:
                srv.record(Served(self.command, path, self.headers.get("Range"), self._nbytes,
                                  self._status, self._object))  # fmt: skip

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _answer(self, status: int, message: str) -> None:
            body = _error(status, message)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _serve(self, method: str) -> None:
            path, _, raw_query = self.path.partition("?")
            query = parse_qs(raw_query)
            body = b""
            length = self.headers.get("Content-Length")
            if method in ("POST", "PUT") and length is not None:
                body = self.rfile.read(int(length))
                self.rfile = io.BytesIO(body)  # the emulator reads it again
            if path.startswith("/upload/") and method == "POST":
                self._object = _upload_name(query, body)
                if srv.part_delay_s and self._object and f"/{PARTS_DIR}/" in self._object:
                    time.sleep(srv.part_delay_s)
            fault = srv.intercept(method, path, query) if srv.intercept is not None else None
            if fault is not None:
                self._answer(fault, "injected by the test server")
                return
            with srv.store_lock:
                refused = self._refused(method, path, query, body)
                if refused is not None:
                    self._answer(*refused)
                    return
                getattr(RequestHandler, f"do_{method}")(self)

        def _refused(
            self, method: str, path: str, query: dict[str, list[str]], body: bytes
        ) -> tuple[int, str] | None:
            """What GCS would refuse here that the emulator does not (module docstring)."""
            api, upload = "/storage/v1/b/", "/upload/storage/v1/b/"
            match = query.get("ifGenerationMatch", [None])[0]
            if path.startswith(upload) and method == "POST":
                bucket = unquote(path[len(upload) :].split("/", 1)[0])
                return _condition(srv, bucket, self._object or "", match)
            if not path.startswith(api) or "/o/" not in path:
                return None
            bucket, _, name = path[len(api) :].partition("/o/")
            bucket, name = unquote(bucket), unquote(name)
            if method == "POST" and name.endswith("/compose"):
                name = name[: -len("/compose")]
                request = json.loads(body or b"{}")
                sources = request.get("sourceObjects", [])
                if len(sources) > MAX_COMPOSE_SOURCES:
                    return 400, (f"The number of source components provided ({len(sources)}) "
                                 f"exceeds the maximum ({MAX_COMPOSE_SOURCES})")  # fmt: skip
                for src in sources:
                    want = (src.get("objectPreconditions") or {}).get("ifGenerationMatch")
                    if (refused := _condition(srv, bucket, src["name"], want)) is not None:
                        return refused
                return _condition(srv, bucket, name, match)
            if method == "DELETE":
                return _condition(srv, bucket, name, match)
            generation = query.get("generation", [None])[0]
            if method == "GET" and query.get("alt") == ["media"] and generation is not None:
                if srv.generation(bucket, name) != int(generation):
                    return 404, "No such object (at that generation)"
            return None

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def do_PATCH(self) -> None:
            self._serve("PATCH")

    return Handler


def _condition(srv: GcsServer, bucket: str, name: str, want: Any) -> tuple[int, str] | None:
    """412 unless the object's live generation is `want` (0: absent; None: no condition)."""
    if want is None or srv.generation(bucket, name) == int(want):
        return None
    return 412, f"At least one of the pre-conditions you specified did not hold ({name})"


@contextmanager
def _plain_gcsfs_registered() -> Iterator[None]:
    """`gs://` and `gcs://` served by gcsfs's plain class in this process (see the module
    docstring); fsspec's cached instances are dropped on both sides of the context."""
    import fsspec
    import gcsfs.core

    saved = {p: fsspec.registry.get(p) for p in PROTOCOLS}
    for p in PROTOCOLS:
        fsspec.register_implementation(p, gcsfs.core.GCSFileSystem, clobber=True)
    gcsfs.core.GCSFileSystem.clear_instance_cache()
    try:
        yield
    finally:
        gcsfs.core.GCSFileSystem.clear_instance_cache()
        for p, cls in saved.items():
            # What fsspec would load for `p` (it resolves protocols lazily).
            fsspec.register_implementation(p, cls or gcsfs.GCSFileSystem, clobber=True)


@contextmanager
def running_gcs_server() -> Iterator[GcsServer]:
    """A started emulator with in-memory storage, and gcsfs's environment pointing at it
    (set before Ray starts workers, which inherit it)."""
    srv = GcsServer()
    store = EmulatorStorage(use_memory_fs=True)
    srv.store = store
    httpd = _Server(("127.0.0.1", 0), _handler(srv, store))
    srv.endpoint = f"http://127.0.0.1:{httpd.server_port}"
    thread = threading.Thread(target=httpd.serve_forever, name="gcs-emulator", daemon=True)
    thread.start()
    try:
        with env(STORAGE_EMULATOR_HOST=srv.endpoint, **GCS_ENV), _plain_gcsfs_registered():
            yield srv
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def storage_options() -> dict[str, Any]:
    """ram-dist's storage options for the emulator: anonymous, listings not cached (tests
    write and list). The endpoint comes from STORAGE_EMULATOR_HOST."""
    return {"gs": {"token": "anon", "project": "ram-dist-test", "use_listings_cache": False}}


def bucket_fs(options: dict[str, Any], bucket: str) -> Any:
    """A gcsfs client for the emulator (inside `running_gcs_server`), with `bucket` created."""
    import fsspec

    fs = fsspec.filesystem("gs", **options["gs"])
    fs.mkdir(bucket)
    return fs
