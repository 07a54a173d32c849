"""The reports (probe, merge, plan) as text a person can read."""

from __future__ import annotations

from typing import Any

from ram_dist.report.model_card import method_lines
from ram_dist.report.rounding import precision_lines


def format_report(report: dict[str, Any]) -> str:
    """Per-task statistics, lambda under each RAM variant, and the overlap histogram (RAM
    family); for the baselines, which gather no such statistics, what their method reports."""
    if "tasks" not in report:
        return _baseline_summary(report)
    tasks = report["tasks"]
    methods = list(tasks[0]["lambda"]) if tasks else []
    head = ["task", "changed", "density", "unique", "shared", "rho"] + [
        f"lambda[{m}]" for m in methods
    ]
    rows = [head]
    for i, t in enumerate(tasks, 1):
        rho = t["rho"] if isinstance(t["rho"], str) else f"{t['rho']:.4f}"
        rows.append(
            [str(i), str(t["changed"]), f"{100 * t['density']:.2f}%", str(t["unique"])]
            + [str(t["shared"]), rho]
            + [f"{t['lambda'][m]:.6g}" for m in methods]
        )
    lines = _table(rows)
    lines.append("")
    n = len(tasks)
    hist = [["task"] + [f"k={k}" for k in range(1, n + 1)]]
    hist += [[str(i)] + [str(v) for v in t["histogram"]] for i, t in enumerate(tasks, 1)]
    lines.append("overlap histogram H[t][k]: elements task t changed that k tasks changed")
    lines += _table(hist)
    el = report["elements"]
    lines.append("")
    lines.append(
        f"participating elements: {el['participating']}; changed by no task: {el['unchanged']}"
    )
    for i, t in enumerate(tasks, 1):
        lines.append(f"task {i}: {t['model']}")
    lines += format_lines(report)
    if report.get("regime"):
        lines += ["", f"where your agents stand: {report['regime']['sentence']}"]
    lines += agreement_lines(report)
    return "\n".join(lines)


def agreement_lines(report: dict[str, Any]) -> list[str]:
    """The probe's sign agreement and update sizes per task and pair, and the sweep it
    suggests (`methods.agreement`, `report.suggest`)."""
    agreement, sweep = report.get("agreement"), report.get("suggested_sweep")
    lines: list[str] = []

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.4g}"

    if agreement:
        rows = [["task", "sign agreement (shared)", "mean |tau| unique", "mean |tau| shared"]]
        rows += [
            [str(i), pct(t["sign_agreement"]), num(t["mean_abs_unique"]), num(t["mean_abs_shared"])]
            for i, t in enumerate(agreement["tasks"], 1)
        ]
        lines += ["", *_table(rows)]
        pairs = [["pair", "both changed", "same sign", "sign agreement"]]
        pairs += [
            [f"{p['tasks'][0] + 1}-{p['tasks'][1] + 1}", str(p["both_changed"])]
            + [str(p["same_sign"]), pct(p["sign_agreement"])]
            for p in agreement["pairs"]
        ]
        lines += ["", *_table(pairs)]
    if sweep:
        lines += ["", f"to try: {sweep['command']}", f"  why: {sweep['why']}"]
    return lines


def format_lines(report: dict[str, Any]) -> list[str]:
    """Each input's storage format and the output's, the tasks measured against the base at
    another precision and the precision check's warnings; the integer tensors copied from the
    base though a task changed them (`--integers-from-base`)."""
    formats = report.get("formats")
    lines = []
    if formats:
        lines.append("formats:")
        lines += [f"  {i['role']}: {i['format']}" for i in formats["inputs"]]
        lines.append(f"  output: {formats['output']}")
    lines += precision_lines(report)
    copied = (report.get("integers_from_base") or {}).get("copied_though_changed") or []
    if copied:
        more = f" (and {len(copied) - 3} more)" if len(copied) > 3 else ""
        lines.append(
            f"copied from the base though a task changed them (--integers-from-base): "
            f"{', '.join(copied[:3])}{more}"
        )
    for task, names in ((report.get("extra_tensors") or {}).get("dropped") or {}).items():
        more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
        lines.append(
            f"left out, held by {task} but not the base (--drop-extra-tensors): "
            f"{', '.join(names[:3])}{more}"
        )
    return lines


def format_merge(report: dict[str, Any], out: str) -> str:
    """What `ram-dist merge` prints at the end: the statistics, then where the model was
    written and how long each pass took; or that `out` already held this merge."""
    if report.get("already_complete"):
        return f"{out}: already holds this merge, complete; nothing to do"
    lines = [format_report(report)]
    passes, output = report["passes"], report["output"]
    if output.get("lease", {}).get("took_over"):
        lines.append(f"\n{out}: {output['lease']['took_over']}")
    device = report.get("device")
    if device:  # before the last line, which says where the model is
        lines.append(f"\ndevice: {device['device']} ({device['reason']})")
        ran = [
            f"{name} {p['units_on_cpu']} unit(s) on CPUs, {p['units_on_gpu']} on GPUs"
            for name, p in passes.items()
            if "units_on_cpu" in p
        ]
        if ran:
            lines.append("; ".join(ran))
        lines += [
            f"{name} time: {timeline_line(p['timeline'])}"
            for name, p in passes.items()
            if (p.get("timeline") or {}).get("total", {}).get("workers")
        ]
    reused = f", {len(output['shards_reused'])} shard(s) reused" if output["shards_reused"] else ""
    reduce = "skipped" if passes["reduce"].get("skipped") else f"{passes['reduce']['wall_s']:.2f} s"
    lines.append(
        f"\nmerged model written to {out} (reduce {reduce}, "
        f"map {passes['map']['wall_s']:.2f} s, {passes['map']['bytes_written']} bytes written"
        f"{reused}; output path: {passes['map'].get('output_path', 'none')})"
    )
    return "\n".join(lines)


def timeline_line(timeline: dict[str, Any]) -> str:
    """A pass's timeline in one line: the workers' time as shares of what they had (the
    pass's wall time, times the workers), then the read and write threads' seconds."""
    total = timeline["total"]
    capacity = timeline["wall_s"] * total["workers"]

    def share(*keys: str) -> str:
        return f"{100 * sum(total[k] for k in keys) / capacity:.0f}%" if capacity > 0 else "-"

    return (
        f"{total['workers']} worker(s) computing {share('compute_s')}, waiting for reads "
        f"{share('read_wait_s')}, for writes {share('write_wait_s')}, other in tasks "
        f"{share('other_s')}, between tasks {share('idle_s')}, before the first or after "
        f"the last {share('before_first_s', 'after_last_s')}; threads: reading "
        f"{total['read_s']:.2f} s, hashing {total['hash_s']:.2f} s, writing "
        f"{total['write_s']:.2f} s"
    )


def _baseline_summary(report: dict[str, Any]) -> str:
    lines = [f"method: {report['method']}"]
    lines += method_lines(report)
    for i, model in enumerate(report.get("tasks_given", []), 1):
        lines.append(f"task {i}: {model}")
    lines += format_lines(report)
    return "\n".join(lines)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_plan(plan: dict[str, Any]) -> str:
    """`ram-dist plan`: what a merge would read, run and write (nothing has been written)."""
    t, b = plan["tensors"], plan["bytes_per_pass"]
    lines = [f"method: {plan['method']}", f"parameters: {plan['parameters']}", "inputs:"]
    for item in plan["inputs"]:
        size = sum(f["size"] for f in item["files"].values())
        lines.append(f"  {item['role']}: {item['location']} ({len(item['files'])} files, "
                     f"{_size(size)})")  # fmt: skip
    lines += format_lines(plan)
    lines += [
        f"tensors: {t['merged']} merged ({t['elements_merged']} elements), {t['copied']} copied",
        f"work units: {plan['work_units']}"
        f" (unit budget {_size(plan['unit_budget_bytes'])} per input)",
        f"reduce: {b['reduce_rounds']} round(s), up to {_size(b['reduce_round'])} read each"
        + (f" ({b['reduce_rounds_note']})" if b["reduce_rounds_note"] else ""),
        f"map: {_size(b['map'])} read",
        f"memory per worker: about {_size(plan['memory_per_worker_bytes'])} of data (read "
        "blocks, the unit's merged bytes, eager temporaries), plus the process itself (torch, "
        "numba, Ray: about 0.25 GiB on CPU)",
        _cache_line(plan.get("input_cache")),
    ]
    device = plan.get("device")
    if device is not None:
        lines.append(f"device: {device['device'] or 'not known yet'} ({device['reason']})")
    sweep = plan.get("sweep")
    if sweep is not None:  # the reads above are the whole sweep's, once for every variant
        lines.append(f"sweep: {len(sweep['variants'])} variant(s), all made from the reads above")
        lines += [f"  {v['name']}: {v['out']}" for v in sweep["variants"]]
    out = plan["output"]
    if out is None:
        lines.append("output: none given")
    else:
        lines.append(f"output: {out['url']} ({out['state']}, {len(out['shards'])} shard(s))")
        lines.append(f"output path: {out['path']} ({out['path_reason']})")
    lines.append("nothing was written")
    return "\n".join(lines)


def _cache_line(cache: dict[str, Any] | None) -> str:
    """Whether later passes would read pass 1's bytes from node-local disk."""
    if not cache or not cache["used"]:
        return f"input cache: {cache['note'] if cache else 'off'}"
    free = cache.get("free_bytes_here")
    room = f"; {_size(free)} free here" if free is not None else ""
    return (
        f"input cache: {cache['note']}; keeps up to {_size(cache['bytes_kept_at_most'])} "
        f"in {cache['folder']} on the nodes{room}"
    )


def format_sweep(report: dict[str, Any]) -> str:
    """What `ram-dist merge` prints at the end of a sweep: each variant's folder, then what
    each pass read and how long it took, once for all of them."""
    lines = [f"{v['name']}: {v['out']}" for v in report["variants"]]
    lines += [
        f"{name}: {_size(p['bytes_read'])} read in {p['wall_s']:.1f} s"
        for name, p in report["passes"].items()
    ]
    lines.append(f"{len(report['variants'])} variant(s) written under {report['output']['url']}")
    return "\n".join(lines)
