"""The lease on Azure Blob (adlfs): conditional Put Blob and Delete Blob (`If-None-Match: *`
to create, `If-Match` an ETag to replace or delete), so the store itself makes the claim
exclusive. Azure's own blob leases are not used: they last at most 60 seconds unless renewed
by the same client, and a lease record must survive its holder to be judged stale."""

from __future__ import annotations

from typing import Any

from fsspec.asyn import sync

from ram_dist.io.lease.store import MAX_LEASE_BYTES, LeaseStore, Seen, parse


class AzureStore(LeaseStore):
    """Conditional requests through adlfs's own client (`fs.service_client`)."""

    def __init__(self, fs: Any, path: str) -> None:
        super().__init__(fs, path)
        self.container, self.blob, _ = fs.split_path(path)

    def _run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        client = self.fs.service_client.get_blob_client(container=self.container, blob=self.blob)
        try:
            return sync(self.fs.loop, getattr(client, method), *args, **kwargs)
        finally:
            self.fs.invalidate_cache(self.path)

    def create(self, data: bytes) -> Any | None:
        from azure.core.exceptions import ResourceExistsError

        try:
            return self._run("upload_blob", data, overwrite=False)["etag"]
        except ResourceExistsError:
            return None

    def read(self) -> Seen | None:
        from azure.core.exceptions import ResourceNotFoundError

        async def get() -> tuple[bytes, str, float]:
            client = self.fs.service_client.get_blob_client(
                container=self.container, blob=self.blob
            )
            stream = await client.download_blob(offset=0, length=MAX_LEASE_BYTES + 1)
            data = await stream.readall()
            return data, stream.properties.etag, stream.properties.last_modified.timestamp()

        try:
            data, etag, modified = sync(self.fs.loop, get)
        except ResourceNotFoundError:
            return None
        finally:
            self.fs.invalidate_cache(self.path)
        return Seen(parse(data), modified, etag)

    def replace(self, data: bytes, version: Any) -> Any | None:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError

        try:
            return self._run(
                "upload_blob", data, overwrite=True, etag=version,
                match_condition=MatchConditions.IfNotModified,
            )["etag"]  # fmt: skip
        except (ResourceModifiedError, ResourceNotFoundError):
            pass
        # A retried request whose first try landed fails its condition: was it ours?
        seen = self.read()
        if seen is not None and seen.holder is not None and parse(data) == seen.holder:
            return seen.version
        return None

    def take_over(self, data: bytes, version: Any) -> Any | None:
        return self.replace(data, version)  # one conditional Put Blob

    def remove(self, version: Any) -> bool:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError

        try:
            self._run("delete_blob", etag=version, match_condition=MatchConditions.IfNotModified)
            return True
        except (ResourceModifiedError, ResourceNotFoundError):
            return False
