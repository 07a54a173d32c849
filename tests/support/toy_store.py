"""A kind of store made as docs/extending.md's "Adding a storage backend" says, for
`tests/io/test_store_recipe.py`: a real fsspec filesystem (fsspec's in-memory one, under the
protocol `toy`, with a store of its own) whose client raises errors with codes of its own,
as s3fs and adlfs do, and the module's `BACKEND` entry. Nothing of ram-dist knows of it."""

from __future__ import annotations

from typing import Any, ClassVar

from fsspec.implementations.memory import MemoryFileSystem

from ram_dist.io.backend import Backend, StoreErrors

#: The toy store's error codes, by what they mean here.
CODES = {
    "missing": frozenset({"NoSuchShelf", "NoSuchItem"}),
    "denied": frozenset({"Forbidden"}),
    "credentials": frozenset({"BadBadge", "StaleBadge"}),
    "throttled": frozenset({"Busy"}),
    "server": frozenset({"Broken"}),
}


class ToyError(Exception):
    """The toy client's error (no `OSError`): the store's code, its HTTP status, its words."""

    def __init__(self, code: str, status: int, message: str = "") -> None:
        super().__init__(message or code)
        self.toy_code, self.toy_status, self.toy_message = code, status, message


class ToyFileSystem(MemoryFileSystem):
    """Files in this process, under shelves (its buckets): a path on a shelf that does not
    exist fails as its client says so, and a read fails with `Busy` while `busy` counts."""

    protocol = ("toy", "toys")
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    shelves: ClassVar[set[str]] = set()
    busy: ClassVar[int] = 0
    """Reads still to refuse as throttled."""

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return super()._strip_protocol(str(path).removeprefix("toys://").removeprefix("toy://"))

    def _shelf(self, path: str) -> None:
        shelf = self._strip_protocol(path).strip("/").split("/")[0]
        if shelf not in self.shelves:
            raise FileNotFoundError(path) from ToyError("NoSuchShelf", 404, f"no shelf {shelf}")

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self._shelf(path)
        return super().ls(path, detail=detail, **kwargs)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):
        self._shelf(path)
        if ToyFileSystem.busy > 0:
            ToyFileSystem.busy -= 1
            raise ToyError("Busy", 503, "slow down")
        return super().cat_file(path, start, end, **kw)


def fs_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The toy client's options: one it always takes unless told otherwise."""
    return {"patience": 3, **kwargs}


def error_code(e: BaseException) -> tuple[str | None, int | None] | None:
    return (e.toy_code, e.toy_status) if isinstance(e, ToyError) else None


def error_message(e: BaseException) -> str:
    return e.toy_message if isinstance(e, ToyError) else ""


BACKEND = Backend(
    protocols=("toy",),
    aliases=("toys",),
    fs_options=fs_options,
    client_errors=("toy_store:ToyError",),
    errors=StoreErrors(
        error_code,
        error_message,
        kinds=CODES,
        root="shelf",
        root_missing=frozenset({"NoSuchShelf"}),
        expired=frozenset({"StaleBadge"}),
        credentials="toy: a badge",
    ),
    retried_here=True,
    in_process=True,
)
