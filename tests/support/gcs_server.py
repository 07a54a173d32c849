"""A Google Cloud Storage emulator (gcp-storage-emulator) over real HTTP on 127.0.0.1.

The emulator's JSON API handler and in-memory store run in a background thread of the test
process, behind a plain `http.server` on a free port. gcsfs finds it through
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
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import HTTPServer
from typing import Any

from gcp_storage_emulator.server import RequestHandler
from gcp_storage_emulator.storage import Storage as EmulatorStorage
from s3_server import env

#: The environment gcsfs needs (besides STORAGE_EMULATOR_HOST, which names the port).
GCS_ENV = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
PROTOCOLS = ("gs", "gcs")


@dataclass(frozen=True)
class Served:
    method: str
    path: str
    range: str | None
    nbytes: int


class _Server(HTTPServer):
    # One request at a time (the emulator's store has no locks), but a deep accept queue: a
    # Ray worker's cat_ranges opens many connections at once, and a full queue makes the
    # kernel drop SYNs, which clients retry only after a second.
    request_queue_size = 128


@dataclass
class GcsServer:
    """A running emulator: `endpoint` is its URL, `log` what it served."""

    endpoint: str = ""
    log: list[Served] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

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


def _handler(srv: GcsServer, store: EmulatorStorage) -> type[RequestHandler]:
    class Handler(RequestHandler):
        """The emulator's handler, recording what each response carried."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._nbytes = 0
            super().__init__(store, *args, **kwargs)

        def send_header(self, keyword: str, value: str) -> None:
            if keyword.lower() == "content-length":
                self._nbytes = int(value)
            super().send_header(keyword, value)

        def end_headers(self) -> None:
            super().end_headers()
            path, _, query = self.path.partition("?")
            if self.command != "GET" or "alt=media" in query:
                srv.record(Served(self.command, path, self.headers.get("Range"), self._nbytes))

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


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
