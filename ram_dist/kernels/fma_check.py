"""No fused multiply-add in the kernels' machine code: the spec's rounding is one rounding per
multiplication and one per addition, which an FMA (the product added unrounded) breaks, and
CPU, GPU and reference agree to the byte only if it holds. `fma_findings` lists what it finds
in every signature a dispatcher has; each kernel module's tests assert it is empty."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from typing import Any

from numba.core.dispatcher import Dispatcher

_FMA_ASM = re.compile(r"\bv?f(?:n?)m(?:add|sub)\w*", re.IGNORECASE)
_FMA_IR = re.compile(
    r"@llvm\.(?:fma|fmuladd)\b|\bf(?:add|sub|mul)\s+(?:[a-z]+\s+)*(?:contract|fast)\b"
)


def fma_findings(dispatcher: Dispatcher) -> list[str]:
    """Fused multiply-adds in the code of every signature a dispatcher has. A signature
    compiled in this process: FMA instructions in its assembly, and `llvm.fma`/
    `llvm.fmuladd` calls or `contract`/`fast` flags in its LLVM IR. One loaded from numba's
    disk cache (which keeps no IR): FMA instructions in the cached object code, the machine
    code that runs, with every function it calls (`cached_disassembly`); where that cannot be
    read, the signature is compiled afresh (uncached, same options) and checked as one
    compiled here. Compiling a kernel again costs seconds; reading its cache entry,
    milliseconds."""
    found: list[str] = []
    again = []
    for sig, compiled in dispatcher.overloads.items():
        if not compiled.library._disable_inspection:  # compiled here
            found += _compiled_findings(dispatcher, sig)
        elif ops := _mnemonics(cached_disassembly(dispatcher, sig) or ""):
            found += [op for op in ops if _FMA_ASM.fullmatch(op)]
        else:
            again.append(sig)
    if again:
        options = dict(dispatcher.targetoptions)
        fresh = type(dispatcher)(dispatcher.py_func, targetoptions=options)
        for sig in again:
            fresh.compile(sig)
            found += _compiled_findings(fresh, sig)
    return found


def _compiled_findings(dispatcher: Dispatcher, sig: Any) -> list[str]:
    found = [m.group(0) for m in _FMA_IR.finditer(dispatcher.inspect_llvm(sig))]
    return found + [m.group(0) for m in _FMA_ASM.finditer(dispatcher.inspect_asm(sig))]


def cached_disassembly(dispatcher: Dispatcher, sig: Any) -> str | None:
    """`objdump -d` of a signature's object code in numba's disk cache (the kernel and
    every function it calls, each under its symbol's `<name>:` line), or None: not cached,
    not object code, or no `objdump`."""
    cache, objdump = getattr(dispatcher, "_cache", None), shutil.which("objdump")
    if objdump is None or not hasattr(cache, "_index_key"):
        return None
    entry = cache._cache_file.load(cache._index_key(sig, dispatcher.targetctx.codegen()))
    library = entry[0] if isinstance(entry, tuple) and entry else None
    if not (isinstance(library, tuple) and len(library) == 3 and library[1] == "object"):
        return None
    with tempfile.NamedTemporaryFile(suffix=".o") as f:
        f.write(library[2][0])
        f.flush()
        done = subprocess.run(
            [objdump, "-d", "--no-show-raw-insn", f.name], capture_output=True, text=True
        )
    return done.stdout if done.returncode == 0 else None


def _mnemonics(listing: str) -> list[str]:
    """The instructions' mnemonics of an `objdump -d --no-show-raw-insn` listing, whose
    instruction lines read "  4005d0:<TAB>vfmadd231ps %ymm2,%ymm1,%ymm0"."""
    return [
        parts[1].split()[0]
        for parts in (line.split("\t") for line in listing.splitlines())
        if len(parts) > 1 and parts[1].strip()
    ]
