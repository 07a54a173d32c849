"""Run `ram_dist.cli` (its arguments after this script's name) recording every at-fork hook
pair registered by a thread other than the main one, and print each as one line starting
`PAIRED AT-FORK HOOK OFF THE MAIN THREAD` (none expected): while the main thread forks (as
`ray.init` does), a pair registered in between has its release run without its acquire."""

from __future__ import annotations

import os
import sys
import threading
import traceback

MARK = "PAIRED AT-FORK HOOK OFF THE MAIN THREAD"
_register = os.register_at_fork


def _recording(**hooks) -> None:
    paired = "before" in hooks or "after_in_parent" in hooks
    if paired and threading.current_thread() is not threading.main_thread():
        frames = traceback.extract_stack()[:-1]
        stack = [f"{f.filename}:{f.lineno}" for f in frames if "<frozen" not in f.filename]
        print(f"{MARK}: {threading.current_thread().name}: {stack[-6:]}", file=sys.stderr)
    _register(**hooks)


if __name__ == "__main__":
    os.register_at_fork = _recording
    from ram_dist.cli import main

    sys.exit(main(sys.argv[1:]))
