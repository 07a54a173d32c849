"""moto's S3 server over real HTTP on 127.0.0.1, logging the bytes it serves per request.

The log is the server's side of the story: range-read tests count what left the server, not
what the client believes it asked for.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import s3fs
from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import make_server

from ram_dist.io.header_reads import FIRST_READ_BYTES

#: Output files that name the input and output locations, so differ between a local and an
#: S3 run of the same merge.
LOCATION_DEPENDENT = (
    "merge_report.json",
    "ram_dist_manifest.json",
    "mergekit_config.yml",
    "README.md",
)

#: The credentials moto's servers take, in the environment of the test process while a
#: server runs and of the workers of any Ray the tests start (`shared_ray`).
TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@dataclass(frozen=True)
class Served:
    method: str
    path: str
    query: str
    range: str | None
    nbytes: int
    checksum: str | None = None
    """The request's `x-amz-checksum-sha256` (base64), which S3 checks against the body."""
    started: float | None = None
    """`time.monotonic()` when the server took the request (before any delay)."""
    finished: float | None = None
    """`time.monotonic()` when its response body was ready."""


class CountingMotoServer(ThreadedMotoServer):
    """ThreadedMotoServer whose WSGI app records each response's body size."""

    def __init__(self) -> None:
        super().__init__(ip_address="127.0.0.1", port=free_port(), verbose=False)
        self.log: list[Served] = []
        self._lock = threading.Lock()
        self.part_delay_s = 0.0
        """Seconds each UploadPart request waits before the server handles it: a slow link,
        so a test can stop a job while parts are in flight."""
        self.get_delay_s = 0.0
        """Seconds each GET of an object (not a listing) waits before the server handles it:
        a slow store, so a test can tell requests sent together from one after another."""
        self.intercept: Callable[[dict[str, Any]], tuple[int, str] | None] | None = None
        """Called with each request's WSGI environ before moto handles it, in the server's
        thread: a test's hook at a known step of a job (delete an input once the job has
        taken its lease), or a fault: a returned `(HTTP status, S3 error code)` is answered
        instead, with the XML error body S3 sends (e.g. `(503, "SlowDown")`)."""

    @property
    def endpoint(self) -> str:
        host, port = self.get_host_and_port()
        return f"http://{host}:{port}"

    def _server_entry(self) -> None:
        app = DomainDispatcherApplication(create_backend_app)

        def counting(environ: dict[str, Any], start_response: Any) -> list[bytes]:
            started = time.monotonic()
            if self.part_delay_s and _is_upload_part(environ):
                time.sleep(self.part_delay_s)
            if self.get_delay_s and _is_object_get(environ):
                time.sleep(self.get_delay_s)
            fault = self.intercept(environ) if self.intercept is not None else None
            if fault is not None:
                body = [_error_body(*fault)]
                start_response(
                    f"{fault[0]} {HTTPStatus(fault[0]).phrase}",
                    [("Content-Type", "application/xml"), ("Content-Length", str(len(body[0])))],
                )
            else:
                body = list(app(environ, start_response))
            with self._lock:
                self.log.append(
                    Served(
                        environ["REQUEST_METHOD"],
                        environ.get("PATH_INFO", ""),
                        environ.get("QUERY_STRING", ""),
                        environ.get("HTTP_RANGE"),
                        sum(len(c) for c in body),
                        environ.get("HTTP_X_AMZ_CHECKSUM_SHA256"),
                        started,
                        time.monotonic(),
                    )
                )
            return body

        self._server = make_server(
            self._ip_address, self._port, counting, True, request_handler=MotoRequestHandler
        )
        self._server_ready_event.set()
        self._server.serve_forever()

    def object_gets(self, prefix: str = "") -> list[Served]:
        """GETs of objects (not listings) whose path starts with `/prefix`."""
        with self._lock:
            return [
                s
                for s in self.log
                if s.method == "GET"
                and s.path.startswith("/" + prefix)
                and s.path.count("/") >= 2
                and "list-type" not in s.query
                and "uploads" not in s.query
            ]

    def uploaded_parts(self, key: str = "") -> list[tuple[str, int]]:
        """(object path, part number) of each UploadPart request, in the order served."""
        return [(s.path, number) for s, number in self.part_requests(key)]

    def part_requests(self, key: str = "") -> list[tuple[Served, int]]:
        """Each UploadPart request served, with its part number."""
        with self._lock:
            served = list(self.log)
        out = []
        for s in served:
            query = dict(q.split("=", 1) for q in s.query.split("&") if "=" in q)
            if s.method == "PUT" and "partNumber" in query and s.path.endswith(key):
                out.append((s, int(query["partNumber"])))
        return out

    def clear(self) -> None:
        with self._lock:
            self.log.clear()


def _error_body(status: int, code: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{HTTPStatus(status).phrase} (injected by the "
        "test server)</Message><RequestId>test</RequestId></Error>"
    ).encode()


def _is_upload_part(environ: dict[str, Any]) -> bool:
    return environ["REQUEST_METHOD"] == "PUT" and "partNumber=" in environ.get("QUERY_STRING", "")


def _is_object_get(environ: dict[str, Any]) -> bool:
    query = environ.get("QUERY_STRING", "")
    return (
        environ["REQUEST_METHOD"] == "GET"
        and environ.get("PATH_INFO", "").count("/") >= 2
        and "list-type" not in query
        and "uploads" not in query
    )


def header_read_bytes(path: str | os.PathLike) -> int:
    """Bytes the driver's header read fetches from a remote copy of the local safetensors file
    `path`: its first read (the length, the header, and the tensor bytes that follow up to
    `FIRST_READ_BYTES`), and the rest of a header longer than that."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return max(min(size, FIRST_READ_BYTES), 8 + n)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def env(**values: str) -> Iterator[None]:
    """Set environment variables for a while (Ray workers started meanwhile inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def running_server() -> Iterator[CountingMotoServer]:
    """A started server, with the test credentials in this process's environment meanwhile."""
    with env(**TEST_CREDENTIALS):
        srv = CountingMotoServer()
        srv.start()
        try:
            yield srv
        finally:
            srv.stop()


def storage_options(srv: CountingMotoServer) -> dict[str, Any]:
    """ram-dist's storage options for this server (listings not cached: tests write and list)."""
    return {"s3": {"endpoint_url": srv.endpoint, "use_listings_cache": False}}


def bucket_fs(options: dict[str, Any], bucket: str) -> s3fs.S3FileSystem:
    """An s3fs client for the server, with `bucket` created."""
    fs = s3fs.S3FileSystem(**options["s3"])
    fs.mkdir(bucket)
    return fs
