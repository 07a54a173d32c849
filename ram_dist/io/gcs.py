"""Facts about Google Cloud Storage that ram-dist relies on, and the few JSON API requests it
sends itself through gcsfs's own client (`GCSFileSystem._call`: its session, credentials and
retries of 429, 5xx, timeouts and broken connections): an upload with the CRC32C the store
checks, a compose and a delete with their preconditions (`ifGenerationMatch`), an object's
metadata and a listing. gcsfs's own `pipe`/`merge`/`rm` send no preconditions.

gcsfs raises `FileExistsError` for 412 Precondition Failed and `FileNotFoundError` for 404,
and otherwise an `HttpError` whose HTTP status says what went wrong (no error codes of its
own to read). Imports nothing of ram-dist but `backend`.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterable
from typing import Any

from ram_dist.io.backend import Backend

#: Most source objects one compose request takes.
MAX_COMPOSE_SOURCES = 32
#: Deletes in flight at once when clearing part objects.
DELETES_IN_FLIGHT = 16

BACKEND = Backend(
    protocols=("gs",),
    aliases=("gcs",),
    lease="ram_dist.io.lease.gcs:GcsStore",
    sink="ram_dist.io.sinks.gcs:GcsSink",
    client_errors=("gcsfs.retry:HttpError",),
)


def crc32c(data: bytes) -> str:
    """The CRC32C of `data` as GCS writes it: base64 of the big-endian value.
    `google_crc32c` (its C version) comes with gcsfs, through google-cloud-storage."""
    import google_crc32c

    return base64.b64encode(google_crc32c.Checksum(data).digest()).decode()


async def upload(
    fs: Any, bucket: str, key: str, data: bytes, *, if_generation_match: int | None = None
) -> dict[str, Any]:
    """One single-request (media) upload of `data` to `key`; returns the object's metadata.
    The CRC32C goes in `X-Goog-Hash`, which GCS checks against the body; the answer's is
    checked here too (a store that ignores the header, like the emulator, still computes
    it), so bytes that changed on the way never pass as written."""
    crc = crc32c(data)
    answer = await fs._call(
        "POST",
        f"{fs._location}/upload/storage/v1/b/{bucket}/o",
        uploadType="media",
        name=key,
        ifGenerationMatch=if_generation_match,
        headers={"Content-Type": "application/octet-stream", "X-Goog-Hash": f"crc32c={crc}"},
        data=data,
        json_out=True,
    )
    if answer.get("crc32c") != crc or int(answer.get("size", -1)) != len(data):
        raise OSError(
            f"gs://{bucket}/{key}: the store holds {answer.get('size')} bytes with CRC32C "
            f"{answer.get('crc32c')}; {len(data)} bytes with {crc} were sent"
        )
    return answer


async def compose(
    fs: Any,
    bucket: str,
    key: str,
    sources: list[tuple[str, int]],
    *,
    if_generation_match: int | None = None,
    metadata: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Compose `sources` (name, generation), in order, into `key`: each source only at that
    generation, the destination only at `if_generation_match` (0: absent) when given."""
    if not 0 < len(sources) <= MAX_COMPOSE_SOURCES:
        raise ValueError(f"a compose takes 1 to {MAX_COMPOSE_SOURCES} sources, not {len(sources)}")
    destination: dict[str, Any] = {"name": key, "bucket": bucket,
                                   "contentType": "application/octet-stream"}  # fmt: skip
    if metadata:
        destination["metadata"] = metadata
    return await fs._call(
        "POST",
        "b/{}/o/{}/compose",
        bucket,
        key,
        ifGenerationMatch=if_generation_match,
        json={
            "kind": "storage#composeRequest",
            "sourceObjects": [
                {"name": name, "objectPreconditions": {"ifGenerationMatch": str(generation)}}
                for name, generation in sources
            ],
            "destination": destination,
        },
        json_out=True,
    )


async def stat(fs: Any, bucket: str, key: str) -> dict[str, Any] | None:
    """An object's metadata, or None when there is none."""
    try:
        return await fs._call("GET", "b/{}/o/{}", bucket, key, json_out=True)
    except FileNotFoundError:
        return None


async def read(fs: Any, bucket: str, key: str, generation: int) -> bytes | None:
    """The bytes of `key` at `generation`, or None when that generation is gone."""
    try:
        _, data = await fs._call(
            "GET", "b/{}/o/{}", bucket, key, alt="media", generation=str(generation)
        )
    except FileNotFoundError:
        return None
    return bytes(data)


async def delete(fs: Any, bucket: str, key: str, *, if_generation_match: int | None = None) -> bool:
    """Delete `key` (only at that generation when given); False when it was not there."""
    try:
        await fs._call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=if_generation_match)
    except FileNotFoundError:
        return False
    return True


async def delete_all(fs: Any, bucket: str, keys: Iterable[str]) -> None:
    """Delete these objects, a few at a time; one already gone is no error."""
    gate = asyncio.Semaphore(DELETES_IN_FLIGHT)

    async def one(key: str) -> None:
        async with gate:
            await delete(fs, bucket, key)

    await asyncio.gather(*(one(k) for k in keys))


async def listing(fs: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    """Every object whose name starts with `prefix` (its metadata), all pages."""
    items: list[dict[str, Any]] = []
    token = None
    while True:
        page = await fs._call(
            "GET", "b/{}/o", bucket, prefix=prefix, pageToken=token, json_out=True
        )
        items += page.get("items", [])
        token = page.get("nextPageToken")
        if not token:
            return items
