"""Bytes a bucket-to-bucket ``ram-dist merge`` fetches from S3, with and without the input cache.

Starts moto's S3 server on 127.0.0.1 (in this process, over real HTTP) behind a WSGI wrapper
that counts the body bytes of every response, uploads a synthetic bf16 base and three agents
(``benchmarks/inputs.py``, the generator of ``bench_merge``, cached in ``--workdir``), then
runs ``ram-dist merge`` from the bucket into the bucket once per ``--input-cache`` mode and
prints, per mode, the bytes the server sent for the inputs' safetensors files divided by
their size. Target: about 1.0 with the cache (each byte once: pass 1 keeps what it fetched on
the node's disk), about 2.0 without (the reduce and the map pass each fetch every tensor
byte).

Example::

    python -m benchmarks.bench_s3_cache --params 0.02e9 --workdir /tmp/bench-s3

from the repository root.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.commands import cli_command
from benchmarks.inputs import ensure_models, model_names, safetensors_files

BUCKET = "ram-dist-bench"


class CountingServer:
    """moto's S3 server in a thread; counts the body bytes of GETs per object path."""

    def __init__(self) -> None:
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        counter = self
        self.served: dict[str, int] = {}
        self._lock = threading.Lock()

        class Server(ThreadedMotoServer):
            def _server_entry(self) -> None:
                app = DomainDispatcherApplication(create_backend_app)

                def counting(environ: dict[str, Any], start_response: Any) -> list[bytes]:
                    body = list(app(environ, start_response))
                    if environ["REQUEST_METHOD"] == "GET":
                        counter.add(environ.get("PATH_INFO", ""), sum(len(c) for c in body))
                    return body

                self._server = make_server(
                    self._ip_address, self._port, counting, True, request_handler=MotoRequestHandler
                )
                self._server_ready_event.set()
                self._server.serve_forever()

        self._server = Server(ip_address="127.0.0.1", port=_free_port(), verbose=False)

    def add(self, path: str, nbytes: int) -> None:
        with self._lock:
            self.served[path] = self.served.get(path, 0) + nbytes

    def start(self) -> str:
        self._server.start()
        host, port = self._server.get_host_and_port()
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self._server.stop()

    def fetched(self, prefix: str, suffix: str = ".safetensors") -> int:
        """Bytes sent for objects under `/BUCKET/prefix` ending in `suffix`."""
        with self._lock:
            return sum(
                n
                for p, n in self.served.items()
                if p.startswith(f"/{BUCKET}/{prefix}") and p.endswith(suffix)
            )

    def clear(self) -> None:
        with self._lock:
            self.served.clear()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def upload(models_dir: Path, options: dict[str, Any]) -> int:
    """Put every checkpoint in the bucket; returns the bytes of their safetensors files."""
    import s3fs

    fs = s3fs.S3FileSystem(**options["s3"])
    fs.mkdir(BUCKET)
    total = 0
    for name in model_names():
        fs.put(str(models_dir / name), f"{BUCKET}/in/{name}", recursive=True)
        total += sum(p.stat().st_size for p in safetensors_files(models_dir / name))
    return total


def merge(run: str, mode: str, args: argparse.Namespace, options: dict, env: dict) -> dict:
    """One bucket-to-bucket merge into `out-RUN`; returns its report (read from the bucket)."""
    import s3fs

    cli, cli_env = cli_command()
    names = model_names()
    out = f"s3://{BUCKET}/out-{run}"
    cmd = [*cli, "merge", "--base", f"s3://{BUCKET}/in/{names[0]}", "--out", out]
    for name in names[1:]:
        cmd += ["--task", f"s3://{BUCKET}/in/{name}"]
    cmd += ["--input-cache", mode, "--storage-options", json.dumps(options)]
    if args.unit_mb is not None:
        cmd += ["--unit-mb", str(args.unit_mb)]
    cmd += ["--address", "local", *args.merge_arg]
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    start = time.perf_counter()
    done = subprocess.run(cmd, env={**cli_env, **env}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"ram-dist merge --input-cache {mode} failed:\n{done.stderr[-4000:]}")
    fs = s3fs.S3FileSystem(**options["s3"])
    report = json.loads(fs.cat_file(f"{BUCKET}/out-{run}/merge_report.json"))
    report["wall_s"] = wall
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=0.02e9, help="parameters per checkpoint")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ram-dist-bench-s3"))
    p.add_argument("--shard-mb", type=int, default=2000, help="largest input shard (MB)")
    p.add_argument(
        "--unit-mb", type=float, default=None, help="ram-dist's --unit-mb (default: its own)"
    )
    p.add_argument("--workers", type=int, default=None, help="ram-dist's --workers")
    p.add_argument(
        "--modes", default="auto,off", help="--input-cache modes to run, in order (may repeat)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge-arg", action="append", default=[], help="appended to every merge")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)

    models = ensure_models(args.workdir, args.params, args.shard_mb * 10**6, args.seed)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    os.environ.update(env)
    server = CountingServer()
    endpoint = server.start()
    options = {"s3": {"endpoint_url": endpoint, "use_listings_cache": False}}
    try:
        input_bytes = upload(models.folder, options)
        rows = []
        for k, mode in enumerate(args.modes.split(",")):  # a mode may repeat
            server.clear()
            report = merge(f"{k}-{mode}", mode, args, options, env)
            fetched = server.fetched("in/")
            rows.append(_row(mode, report, fetched, input_bytes))
    finally:
        server.stop()
    _print(rows, input_bytes)
    if args.json:
        args.json.write_text(json.dumps({"input_bytes": input_bytes, "runs": rows}, indent=2))
    return 0


def _row(mode: str, report: dict, fetched: int, input_bytes: int) -> dict[str, Any]:
    passes = report["passes"]
    return {
        "mode": mode,
        "cache_used": report.get("input_cache", {}).get("used"),
        "fetched_bytes": fetched,
        "ratio": fetched / input_bytes,
        "wall_s": round(report["wall_s"], 2),
        "reduce_wall_s": passes["reduce"]["wall_s"],
        "map_wall_s": passes["map"]["wall_s"],
        "cache_bytes_written": passes["reduce"].get("cache_bytes_written"),
        "cache_bytes_read": sum(passes[k].get("cache_bytes_read", 0) for k in ("reduce", "map")),
    }


def _print(rows: list[dict[str, Any]], input_bytes: int) -> None:
    print(f"\ninput safetensors bytes (base + agents): {input_bytes}")
    head = ["--input-cache", "cache used", "bytes fetched", "fetched / input", "wall s",
            "reduce s", "map s", "kept in cache", "read from cache"]  # fmt: skip
    cells = [head] + [
        [r["mode"], str(r["cache_used"]), str(r["fetched_bytes"]), f"{r['ratio']:.4f}",
         f"{r['wall_s']:.2f}", f"{r['reduce_wall_s']:.2f}", f"{r['map_wall_s']:.2f}",
         str(r["cache_bytes_written"]), str(r["cache_bytes_read"])]
        for r in rows
    ]  # fmt: skip
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


if __name__ == "__main__":
    sys.exit(main())
