"""A bucket-to-bucket ``ram-dist merge`` on each object store's emulator, in one run: the map
pass's time on each, its ratio to S3's (moto), and the shard bytes the driver sent (0 where
the workers write).

Each store is one function registered with ``@store(NAME)``: a context manager that starts
its server in this process, uploads the inputs (``benchmarks/inputs.py``'s synthetic bf16
base and three agents, cached in ``--workdir``) and yields a ``Store``. The merges run as
subprocesses (``ram-dist merge ... --address local``), in an order rotated over the repeats.
Target (issue 35): the driver sends 0 bytes of shard data, and the map pass takes at most
1.2x the S3 path's time.

Example::

    python -m benchmarks.bench_clouds --params 0.1e9 --stores s3,gcs --workdir /tmp/bench-clouds

from the repository root.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.commands import cli_command
from benchmarks.inputs import Models, ensure_models, model_names
from benchmarks.running import cpu_count

BUCKET = "ram-dist-bench"


@dataclass
class Store:
    """A started server with the inputs under `in/`."""

    name: str
    url: Callable[[str], str]
    """`url("in/base")` -> the store's URL of that path in the bucket."""
    options: dict[str, Any]
    """`--storage-options` for the merge."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the merge's process (e.g. the emulator's address)."""
    read: Callable[[str], bytes] = lambda path: b""
    """Reads a path of the bucket (`out-0/merge_report.json`) with the store's client."""


STORES: dict[str, Callable[[Models, Path], Any]] = {}


def store(name: str) -> Callable[[Callable[..., Iterator[Store]]], Callable[..., Any]]:
    """Registers a store's context manager under `name` (`--stores`)."""

    def register(fn: Callable[..., Iterator[Store]]) -> Callable[..., Any]:
        STORES[name] = contextmanager(fn)
        return STORES[name]

    return register


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@store("s3")
def s3(models: Models, workdir: Path) -> Iterator[Store]:
    """moto's S3 server (threaded, in memory): the S3 path, workers upload multipart parts."""
    import s3fs
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    os.environ.update(env)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"s3": {"endpoint_url": f"http://{host}:{port}", "use_listings_cache": False}}
    try:
        fs = s3fs.S3FileSystem(**options["s3"])
        fs.mkdir(BUCKET)
        for name in model_names():
            fs.put(str(models.folder / name), f"{BUCKET}/in/{name}", recursive=True)
        yield Store(
            "s3", lambda p: f"s3://{BUCKET}/{p}", options, env,
            lambda p: fs.cat_file(f"{BUCKET}/{p}"),
        )  # fmt: skip
    finally:
        import requests

        requests.post(f"http://{host}:{port}/moto-api/reset", timeout=60)  # free its memory
        server.stop()


@store("gcs")
def gcs(models: Models, workdir: Path) -> Iterator[Store]:
    """gcp-storage-emulator (its own single-threaded server, objects in memory as moto's): the
    GCS path, workers upload part objects, the driver composes. In memory, because from a
    disk folder the emulator reads a whole object for every ranged read. Inputs are uploaded
    one request each (its resumable upload rewrites the whole object per chunk)."""
    import fsspec
    from fsspec.asyn import sync
    from gcp_storage_emulator.server import create_server

    from ram_dist.io import gcs as gcs_api

    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True)
    server.start()
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # fmt: skip
    os.environ.update(env)  # read by gcsfs in this process too
    options = {"gs": {"token": "anon", "project": "bench", "use_listings_cache": False}}
    try:
        fs = fsspec.filesystem("gs", skip_instance_cache=True, **options["gs"])
        fs.mkdir(BUCKET)
        for name in model_names():
            for f in sorted((models.folder / name).iterdir()):
                sync(fs.loop, gcs_api.upload, fs, BUCKET, f"in/{name}/{f.name}", f.read_bytes())
        yield Store(
            "gcs", lambda p: f"gs://{BUCKET}/{p}", options, env,
            lambda p: fs.cat_file(f"{BUCKET}/{p}"),
        )  # fmt: skip
    finally:
        server.stop()


@store("azure")
def azure(models: Models, workdir: Path) -> Iterator[Store]:
    """Azurite (the npm package `azurite`, a Node process, blobs in a disk folder under
    `workdir`): the Azure path, workers stage blocks, the driver commits each shard's block
    list. `azurite-blob` from PATH or from `.ci/node` (where `.ci/run` installs it)."""
    import shutil
    import urllib.error
    import urllib.request

    import adlfs

    program = shutil.which("azurite-blob") or str(
        Path(__file__).resolve().parents[1] / ".ci/node/node_modules/.bin/azurite-blob"
    )
    if not Path(program).exists():
        sys.exit("azurite-blob not found: npm install --prefix .ci/node azurite@3.37.0")
    data = workdir / "azurite-data"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    port = _free_port()
    proc = subprocess.Popen(
        [program, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(data),
         "--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    account = "devstoreaccount1"  # Azurite's development account and its published key
    key = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
    endpoint = f"http://127.0.0.1:{port}/{account}"
    env = {"AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=http;AccountName="
           f"{account};AccountKey={key};BlobEndpoint={endpoint};"}  # fmt: skip
    os.environ.update(env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}?comp=list", timeout=2)
                break
            except urllib.error.HTTPError:
                break  # it answers (unsigned: 403)
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit("azurite-blob did not start")
                time.sleep(0.1)
        options = {"az": {"use_listings_cache": False}}
        fs = adlfs.AzureBlobFileSystem(skip_instance_cache=True, **options["az"])
        fs.mkdir(BUCKET)
        for name in model_names():
            for f in sorted((models.folder / name).iterdir()):
                fs.put_file(str(f), f"{BUCKET}/in/{name}/{f.name}")
        yield Store(
            "azure", lambda p: f"az://{BUCKET}/{p}", options, env,
            lambda p: fs.cat_file(f"{BUCKET}/{p}"),
        )  # fmt: skip
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(data, ignore_errors=True)


def merge(st: Store, run: str, args: argparse.Namespace) -> dict[str, Any]:
    """One bucket-to-bucket merge into `out-RUN`; its report, read from the bucket."""
    cli, cli_env = cli_command()
    names = model_names()
    cmd = [*cli, "merge", "--base", st.url(f"in/{names[0]}"), "--out", st.url(f"out-{run}")]
    for name in names[1:]:
        cmd += ["--task", st.url(f"in/{name}")]
    cmd += ["--storage-options", json.dumps(st.options), "--address", "local"]
    if args.unit_mb is not None:
        cmd += ["--unit-mb", str(args.unit_mb)]
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    if args.cache_dir:
        cmd += ["--cache-dir", str(args.cache_dir)]
    start = time.perf_counter()
    done = subprocess.run(cmd, env={**cli_env, **st.env}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"ram-dist merge on {st.name} failed:\n{done.stderr[-4000:]}")
    report = json.loads(st.read(f"out-{run}/merge_report.json"))
    report["wall_s"] = wall
    return report


def row(name: str, report: dict[str, Any]) -> dict[str, Any]:
    m = report["passes"]["map"]
    return {
        "store": name,
        "wall_s": round(report["wall_s"], 2),
        "reduce_s": round(report["passes"]["reduce"]["wall_s"], 2),
        "map_s": round(m["wall_s"], 2),
        "output_path": m["output_path"],
        "bytes_written": m["bytes_written"],
        "bytes_written_by_workers": m["bytes_written_by_workers"],
        "bytes_written_by_driver": m["bytes_written_by_driver"],
        "parts": m["parts"],
        "map_bytes_fetched": m["bytes_fetched"],
        "map_cache_bytes_read": m.get("cache_bytes_read", 0),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=0.1e9, help="parameters per checkpoint")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ram-dist-bench-clouds"))
    p.add_argument("--shard-mb", type=int, default=2000, help="largest input shard (MB)")
    p.add_argument("--stores", default="s3,gcs", help=f"of {', '.join(STORES)}; s3 first")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--unit-mb", type=float, default=None, help="ram-dist's --unit-mb")
    p.add_argument("--workers", type=int, default=None, help="ram-dist's --workers")
    p.add_argument(
        "--cache-dir", type=Path, default=None,
        help="ram-dist's --cache-dir: a disk with room, so the map pass reads its inputs from "
        "the node's cache and the runs differ by their output path only",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    names = args.stores.split(",")
    if unknown := [n for n in names if n not in STORES]:
        p.error(f"unknown store(s) {unknown}; known: {sorted(STORES)}")

    models = ensure_models(args.workdir, args.params, args.shard_mb * 10**6, args.seed)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    rows: list[dict[str, Any]] = []
    for k in range(args.repeat):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            with STORES[name](models, args.workdir) as st:
                rows.append(row(name, merge(st, str(k), args)))
                print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for name in names:
        mine = [r for r in rows if r["store"] == name]
        summary[name] = {
            "map_s": statistics.median(r["map_s"] for r in mine),
            "bytes_written_by_driver": max(r["bytes_written_by_driver"] for r in mine),
        }
    if "s3" in summary:
        for name in names:
            summary[name]["map_vs_s3"] = round(summary[name]["map_s"] / summary["s3"]["map_s"], 3)
    print(f"\n{models.dims.params / 1e9:.3f} B parameters a checkpoint, {cpu_count()} CPUs")
    print(f"{'store':8} {'map s (median)':>15} {'vs s3':>7} {'driver shard bytes':>19}")
    for name, s in summary.items():
        print(f"{name:8} {s['map_s']:15.2f} {s.get('map_vs_s3', float('nan')):7.3f} "
              f"{s['bytes_written_by_driver']:19d}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"runs": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
