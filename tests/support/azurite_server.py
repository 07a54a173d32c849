"""Azurite's blob service (the npm package `azurite`) on 127.0.0.1, behind a small HTTP proxy
in the test process that logs what it serves and can answer with faults.

Azurite has no fault injection, so the proxy stands where `CountingMotoServer` wraps moto: it
counts the bytes each response carries (range-read tests count what left the server), can
delay Put Block requests (a slow link, so a test can stop a job while blocks are in flight)
and can answer a request with an Azure error instead of passing it on (`intercept`).

`azurite-blob` is looked up on PATH, then in `.ci/node` (where `.ci/run` installs it). A test
that needs it fails under `CI=true` when it is missing, and is skipped elsewhere.
"""

from __future__ import annotations

import ctypes
import http.client
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from s3_server import env, free_port

#: Azurite's development account and its well-known key (public, in Azure's docs).
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
ROOT = Path(__file__).resolve().parents[2]


def azurite_program() -> str | None:
    """The `azurite-blob` program: on PATH, or where `.ci/run` installs it."""
    found = shutil.which("azurite-blob")
    if found:
        return found
    local = ROOT / ".ci" / "node" / "node_modules" / ".bin" / "azurite-blob"
    return str(local) if local.exists() else None


def need_azurite() -> str:
    """The program, or the test fails (CI) or is skipped (elsewhere) saying how to get it."""
    program = azurite_program()
    if program is None:
        why = ("azurite-blob not found: `npm install --prefix .ci/node azurite@3.37.0` "
               "(.ci/run does it)")  # fmt: skip
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    return program


@dataclass(frozen=True)
class Served:
    method: str
    path: str
    query: str
    range: str | None
    nbytes: int
    status: int


class AzuriteServer:
    """`azurite-blob` in a subprocess, reached through a proxy on another port."""

    def __init__(self, program: str, location: str) -> None:
        self.program = program
        self.location = location
        self.port = free_port()
        self.log: list[Served] = []
        self._lock = threading.Lock()
        self.block_delay_s = 0.0
        """Seconds each Put Block waits before it is passed on."""
        self.intercept: Callable[[str, str, str], tuple[int, str] | None] | None = None
        """Called with each request's method, path and query: a returned `(HTTP status, Azure
        error code)` is answered instead of passing the request on (e.g. `(503,
        "ServerBusy")`); also a test's hook at a known step of a job."""
        self._proc: subprocess.Popen | None = None
        self._proxy: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self._proxy is not None
        return f"http://127.0.0.1:{self._proxy.server_address[1]}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
                f"BlobEndpoint={self.endpoint};")  # fmt: skip

    def start(self) -> None:
        args = [self.program, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
                "--location", self.location, "--skipApiVersionCheck", "--loose", "--silent",
                "--disableTelemetry"]  # fmt: skip
        self._proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", f"/{ACCOUNT}?comp=list")
                conn.getresponse().read()
                conn.close()
                break
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                    self.stop()
                    raise RuntimeError(f"azurite-blob did not start: {err}") from None
                time.sleep(0.1)
        self._proxy = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._proxy.daemon_threads = True
        threading.Thread(target=self._proxy.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._proxy is not None:
            self._proxy.shutdown()
            self._proxy.server_close()
            self._proxy = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc = None

    def note(self, served: Served) -> None:
        with self._lock:
            self.log.append(served)

    def served(self) -> list[Served]:
        with self._lock:
            return list(self.log)

    def blob_gets(self, prefix: str = "") -> list[Served]:
        """GETs of blobs (not listings) in `/ACCOUNT/prefix...`."""
        return [
            s for s in self.served()
            if s.method == "GET" and s.path.startswith(f"/{ACCOUNT}/{prefix}")
            and "comp=" not in s.query and s.status < 300
        ]  # fmt: skip

    def put_blocks(self, suffix: str = "") -> list[Served]:
        """Put Block requests answered 201 for blobs whose path ends with `suffix`."""
        return [
            s for s in self.served()
            if s.method == "PUT" and "comp=block&" in s.query + "&" and s.path.endswith(suffix)
            and s.status == 201
        ]  # fmt: skip

    def clear(self) -> None:
        with self._lock:
            self.log.clear()


def _die_with_parent() -> None:
    """In the child: Linux sends it SIGTERM when the test process dies, however it dies."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: `stop` still ends it


#: Headers a proxy does not pass on (hop by hop, or recomputed here).
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
        "proxy-connection", "content-length"}  # fmt: skip


def _handler(server: AzuriteServer) -> type[BaseHTTPRequestHandler]:
    local = threading.local()

    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _pass_on(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            path, _, query = self.path.partition("?")
            if server.block_delay_s and self.command == "PUT" and "comp=block" in query:
                if "comp=blocklist" not in query:
                    time.sleep(server.block_delay_s)
            fault = server.intercept(self.command, path, query) if server.intercept else None
            if fault is not None:
                status, code = fault
                data = (f'<?xml version="1.0" encoding="utf-8"?><Error><Code>{code}</Code>'
                        f"<Message>{HTTPStatus(status).phrase} (injected by the test proxy)"
                        "</Message></Error>").encode()  # fmt: skip
                headers = [("Content-Type", "application/xml"), ("x-ms-error-code", code)]
            else:
                conn = getattr(local, "conn", None)
                if conn is None:
                    conn = local.conn = http.client.HTTPConnection("127.0.0.1", server.port)
                fwd = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                fwd["Content-Length"] = str(len(body))
                try:
                    conn.request(self.command, self.path, body=body, headers=fwd)
                    resp = conn.getresponse()
                except (OSError, http.client.HTTPException):
                    conn.close()
                    local.conn = conn = http.client.HTTPConnection("127.0.0.1", server.port)
                    conn.request(self.command, self.path, body=body, headers=fwd)
                    resp = conn.getresponse()
                data = resp.read()
                status = resp.status
                headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
                if self.command == "HEAD":
                    headers.append(("Content-Length", resp.getheader("Content-Length", "0")))
            range_ = self.headers.get("x-ms-range") or self.headers.get("Range")
            server.note(Served(self.command, path, query, range_, len(data), status))
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_OPTIONS = _pass_on

    return Proxy


@contextmanager
def running_azurite() -> Iterator[AzuriteServer]:
    """A started Azurite (skipped or failed without `azurite-blob`), its connection string in
    `AZURE_STORAGE_CONNECTION_STRING` (Ray workers started meanwhile inherit it)."""
    import adlfs

    program = need_azurite()
    with tempfile.TemporaryDirectory(prefix="azurite-") as location:
        srv = AzuriteServer(program, location)
        srv.start()
        # fsspec keeps one client per set of options: one an earlier module built holds the
        # connection string of its own server, now stopped.
        adlfs.AzureBlobFileSystem.clear_instance_cache()
        try:
            with env(AZURE_STORAGE_CONNECTION_STRING=srv.connection_string):
                yield srv
        finally:
            adlfs.AzureBlobFileSystem.clear_instance_cache()
            srv.stop()


def storage_options() -> dict[str, Any]:
    """ram-dist's storage options: none, the connection string comes from the environment
    (listings not cached: tests write and list)."""
    return {"az": {"use_listings_cache": False}, "abfs": {"use_listings_cache": False}}


def container_fs(container: str) -> Any:
    """An adlfs client of the server (from the environment), with `container` created."""
    import adlfs

    fs = adlfs.AzureBlobFileSystem(use_listings_cache=False, skip_instance_cache=True)
    if not fs.exists(container):
        fs.mkdir(container)
    return fs
