"""JSON files read from an input or an output, each refused before it is read when the store
says it is larger than its kind's cap, as a safetensors header is (`MAX_HEADER_BYTES`): a
corrupt or hostile file never makes the driver read and parse gigabytes.
"""

from __future__ import annotations

import json
from typing import Any

from ram_dist.errors import RamDistError
from ram_dist.io.failures import is_storage_failure, reported, storage_error
from ram_dist.io.safetensors_header import MAX_HEADER_BYTES
from ram_dist.io.storage import Storage

#: `model.safetensors.index.json` names each tensor once with its file, in fewer bytes than
#: the shard headers that hold the same tensors (each capped at `MAX_HEADER_BYTES`).
MAX_INDEX_BYTES = MAX_HEADER_BYTES
#: A model's `config.json`: a few KiB, a few MiB with large label maps.
MAX_CONFIG_BYTES = 16 * 2**20
#: `ram_dist_manifest.json`: about 300 bytes per input file and 200 per output part, so a
#: million parts (a terabyte in 1 MiB parts) fit.
MAX_MANIFEST_BYTES = 512 * 2**20
#: `merge_report.json`: per-task and per-layer statistics, a few KiB to a few MiB.
MAX_REPORT_BYTES = 64 * 2**20


def read_json(
    url: str,
    storage: Storage,
    cap: int,
    what: str,
    role: str,
    size: int | None = None,
) -> Any:
    """Parse the JSON file at `url` (`what` it is, e.g. "index", and whose: `role` "input" or
    "output"), once its size is known to be within `cap`.

    `size`: the file's size from a listing, for a file that does not change while the job
    runs (an input); exactly that many bytes are read. Without it, the store is asked afresh
    (a listing cached meanwhile may be stale), and the read takes whatever the file holds
    now, up to `cap`: a file rewritten in between is read whole, never torn.
    `FileNotFoundError` when there is no file; `RamDistError` when it is over the cap or not
    JSON; `StorageError` when the store fails."""
    fs, path = storage.fs(url)
    end = size
    if size is None:
        size, end = checked_size(url, storage, cap, what, role), cap + 1
    elif size > cap:
        raise _over(url, size, cap, what, role)
    with reported(url, "read", role):
        data = fs.cat_file(path, start=0, end=end) if size > 0 else b""
    if len(data) > cap:
        raise _over(url, len(data), cap, what, role)
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise RamDistError(f"{role} {url}: {what} is not valid JSON ({e})") from None
    except RecursionError:
        raise RamDistError(f"{role} {url}: {what} JSON is nested too deeply") from None


def checked_size(url: str, storage: Storage, cap: int, what: str, role: str) -> int:
    """The size of the file at `url` as the store says it now, once known to be within
    `cap` (`read_json` explains the arguments and errors)."""
    fs, path = storage.fs(url)
    try:
        fs.invalidate_cache(path)
        size = int(fs.info(path)["size"])
    except FileNotFoundError:
        raise
    except Exception as e:
        if is_storage_failure(e):
            raise storage_error(e, url, "read", role) from e
        raise
    if size > cap:
        raise _over(url, size, cap, what, role)
    return size


def _over(url: str, size: int, cap: int, what: str, role: str) -> RamDistError:
    return RamDistError(
        f"{role} {url}: {size} bytes, over the {cap}-byte cap for this {what}; the file is "
        "corrupt or not what its name says"
    )
