"""What the driver tells a person or a log collector while a job runs.

`text` (the default): a tqdm bar per pass with bytes read, rate and time left on a terminal,
nothing when stderr is not one. `json`: one JSON object per line on stderr for each event
(job start, pass start, progress at most every `INTERVAL_S`, pass end, shard written, done),
for cron jobs and log collectors. Nothing here ever includes storage options.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

INTERVAL_S = 1.0


class Progress:
    """Runs on the driver; one instance per job."""

    def __init__(self, log_format: str = "text", stream: TextIO | None = None) -> None:
        if log_format not in ("text", "json"):
            raise ValueError(f"log format must be text or json, got {log_format!r}")
        self.json = log_format == "json"
        self.stream = stream or sys.stderr
        self._bar: tqdm | None = None
        self._pass = ""
        self._total = self._done = 0
        self._start = self._last = 0.0

    def event(self, kind: str, /, **fields: Any) -> None:
        """One JSON line in json mode; silent in text mode."""
        if self.json:
            record = {"time": round(time.time(), 3), "event": kind, **fields}
            self.stream.write(json.dumps(record, default=str) + "\n")
            self.stream.flush()

    def start_pass(self, name: str, total_bytes: int, units: int) -> None:
        self._pass, self._total, self._done = name, total_bytes, 0
        self._start = self._last = time.monotonic()
        self.event("pass_start", name=name, bytes_total=total_bytes, units=units)
        if not self.json:
            self._bar = tqdm(
                total=total_bytes,
                desc=name,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self.stream,
                disable=not self.stream.isatty(),
            )

    def advance(self, nbytes: int) -> None:
        self._done += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
        now = time.monotonic()
        if self.json and (now - self._last >= INTERVAL_S or self._done >= self._total):
            self._last = now
            rate = self._done / max(now - self._start, 1e-9)
            left = (self._total - self._done) / rate if rate > 0 else None
            self.event(
                "progress",
                name=self._pass,
                bytes_done=self._done,
                bytes_total=self._total,
                rate_bytes_s=round(rate),
                eta_s=None if left is None else round(left, 1),
            )

    def end_pass(self, **fields: Any) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self.event("pass_end", name=self._pass, bytes_done=self._done, **fields)
