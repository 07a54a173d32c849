"""The model card (`README.md`) of a merged model, in the Hugging Face style.

A pure function of the merge report, the inputs' identities (the manifest's format) and the
ram-dist version: it reads no file and opens no connection. It never writes storage options
or credentials: only whitelisted fields of the report and the identities are rendered, and
every location passes through `redact_location` (user:password@ in a URL's authority, and
query strings such as pre-signed URL signatures, are dropped).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ram_dist.dtypes import dtype_name
from ram_dist.errors import RamDistError
from ram_dist.io.names import MERGEKIT_CONFIG_NAME, REPORT_NAME, TOKENIZER_FILES
from ram_dist.methods import MergeMethod, get_method
from ram_dist.methods import parameters as method_parameters
from ram_dist.methods.parameters import handed

__all__ = [
    "method_facts",
    "format_parameters",
    "format_rho",
    "hub_repo_id",
    "md_cell",
    "md_code",
    "model_card",
    "ram_task_table",
    "redact_location",
]

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<authority>[^/?#]*)(?P<rest>.*)$")
_SECRET_KEY = re.compile(r"storage_options|secret|token|password|credential", re.IGNORECASE)


def redact_location(location: str) -> str:
    """`location` without credentials: `s3://KEY:SECRET@bucket/x?X-Amz-Signature=..` becomes
    `s3://bucket/x`. Local paths and `org/name@revision` ids are returned unchanged."""
    match = _URL.match(location)
    if not match:
        return location
    authority = match["authority"].rpartition("@")[2]
    rest = re.split(r"[?#]", match["rest"], maxsplit=1)[0]
    return f"{match['scheme']}{authority}{rest}"


def hub_repo_id(location: str) -> str:
    """The Hub repo id of `hf://org/name@rev` or `org/name@rev` (`org/name`); any other
    location, redacted, as it is."""
    loc = redact_location(location)
    if loc.startswith("hf://"):
        loc = loc[len("hf://") :]
        if loc.startswith("models/"):
            loc = loc[len("models/") :]
        return loc.partition("@")[0]
    if re.fullmatch(r"[\w.-]+/[\w.-]+@[^/]+", loc):
        return loc.partition("@")[0]
    return loc


def format_parameters(
    parameters: Mapping[str, Any], method: str | None = None
) -> list[tuple[str, str]]:
    """(name, value) pairs for people. The report gives the parameters once when every tensor
    has the same ones, else per tensor; then each parameter shows its one value, or the
    number of distinct values it takes across tensors. With a known `method`, exactly the
    parameters that have an effect in it are shown (`methods.parameters`); else any name
    that could be a secret is left out."""
    declared = None
    if method in method_parameters.PARAMETERS:
        declared = {p.name for p in handed(method_parameters.PARAMETERS[method]) if p.effect}

    def shown(name: Any) -> bool:
        if declared is not None:
            return name in declared
        return not _SECRET_KEY.search(str(name))

    if parameters and all(isinstance(v, Mapping) for v in parameters.values()):
        names: list[str] = []
        for per_tensor in parameters.values():
            names += [k for k in per_tensor if k not in names and shown(k)]
        out = []
        for name in names:
            values = {_value(p.get(name)) for p in parameters.values()}
            if len(values) == 1:
                out.append((name, values.pop()))
            else:
                out.append(
                    (
                        name,
                        f"varies by tensor ({len(values)} values over "
                        f"{len(parameters)} tensors; see {MERGEKIT_CONFIG_NAME})",
                    )
                )
        return out
    return [(k, _value(v)) for k, v in parameters.items() if shown(k)]


def model_card(
    report: Mapping[str, Any], *, base: str, inputs: Sequence[Mapping[str, Any]], version: str
) -> str:
    """A Hugging Face style README.md for the merged model.

    `report` is the merge report (merge_report.json); `base` what goes in the metadata's
    `base_model` (an `hf://` or `org/name@rev` location is given as its repo id); `inputs`
    the manifest's identities, `[{"role", "location", "files": {name: {"size",
    "header_sha256", "version"}}}]`; `version` the ram-dist version that merged.
    """
    import yaml

    method = str(report.get("method", ""))
    facts = method_facts(method)
    label = facts.label if facts is not None else method
    base_id = hub_repo_id(base)
    meta = {"base_model": base_id, "tags": ["merge", "ram-dist"], "library_name": "transformers"}
    lines = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(), "---", ""]
    tasks_given = [redact_location(str(t)) for t in report.get("tasks_given", [])]
    lines += [
        "# Merged model",
        "",
        f"A merge of {len(tasks_given)} task models fine-tuned from `{base_id}`, made with "
        f"ram-dist {version} using **{label}** (`{method}`).",
        "",
        "## Merge method",
        "",
        _method_text(method),
        "",
        "## Parameters",
        "",
        "| parameter | value | meaning |",
        "|---|---|---|",
    ]
    meaning = {p.name: p.help for p in method_parameters.PARAMETERS.get(method, ())}
    lines += [
        f"| {md_cell(k)} | {md_cell(v)} | {md_cell(meaning.get(k, ''))} |"
        for k, v in format_parameters(report.get("parameters") or {}, method)
    ]
    out_dtype = report.get("out_dtype")
    dtype_text = md_cell(dtype_name(out_dtype) if out_dtype else "each base tensor's dtype")
    lines.append(f"| out_dtype | {dtype_text} | dtype of the merged tensors |")
    notes = [str(n) for n in report.get("notes") or []]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {md_cell(n)}" for n in notes]

    lines += _format_section(report)
    lines += ["", "## Inputs", "", "In task order (the order is part of the result).", ""]
    lines += ["| role | location | file | size (bytes) | header sha256 | store version |"]
    lines += ["|---|---|---|---:|---|---|"]
    for entry in inputs:
        role = md_cell(entry.get("role", ""))
        location = md_code(redact_location(str(entry.get("location", ""))))
        files = entry.get("files") or {}
        if not files:
            lines.append(f"| {role} | {location} |  |  |  |  |")
        for name, ident in sorted(files.items()):
            ident = ident or {}
            cells = [
                role,
                location,
                md_cell(name),
                md_cell(ident.get("size", "")),
                md_code(ident.get("header_sha256") or ""),
                md_cell(ident.get("version") or ""),
            ]
            lines.append("| " + " | ".join(cells) + " |")

    if facts is not None and facts.reports_overlap and report.get("tasks"):
        lines += ["", "## Task vector statistics", ""]
        lines += ram_task_table(report)

    lines += ["", "## How to load", "", "```python"]
    lines += _load_snippet(report)
    lines += ["```", ""]
    lines += [
        f"The exact configuration is in `{MERGEKIT_CONFIG_NAME}` (running it again with ram-dist "
        "gives the same bytes); the statistics are in `merge_report.json`, and the identity of "
        "every input file in `ram_dist_manifest.json`.",
        "",
    ]
    return "\n".join(lines)


def _named_list(said: str, names: list[str]) -> list[str]:
    """A paragraph: `said`, then the first 20 tensor names (the report holds them all)."""
    more = " and more (see merge_report.json)." if len(names) > 20 else "."
    return ["", said + ", ".join(md_code(n) for n in names[:20]) + more]


def _format_section(report: Mapping[str, Any]) -> list[str]:
    """How the inputs and the merged model store their weights, the integer tensors copied
    from the base though a task changed them, and the tasks' tensors left out."""
    formats = report.get("formats")
    lines: list[str] = []
    if formats:
        lines += ["", "## Storage format", "", "| model | format |", "|---|---|"]
        lines += [f"| {md_cell(i['role'])} | {md_cell(i['format'])} |" for i in formats["inputs"]]
        lines.append(f"| **merged model** | {md_cell(formats['output'])} |")
        against = formats.get("measured_against") or []
        if against:
            lines += ["", "Each task's update is measured against the base at the task's own "
                      "precision (what a trainer that loaded the base in that dtype started "
                      "from):", ""]  # fmt: skip
            lines += [f"- {md_cell(sentence)}" for sentence in against]
    warnings = (report.get("precision") or {}).get("warnings") or []
    if warnings:
        lines += ["", "**Precision check:**", ""] + [f"- {md_cell(w)}" for w in warnings]
    copied = (report.get("integers_from_base") or {}).get("copied_though_changed") or []
    if copied:
        lines += _named_list(
            f"**Not merged:** {len(copied)} integer or bool tensor(s) that a task changed were "
            "copied from the base, as asked (`--integers-from-base`): ",
            copied,
        )
    dropped = (report.get("extra_tensors") or {}).get("dropped") or {}
    for task, names in dropped.items():
        lines += _named_list(
            f"**Left out:** {len(names)} tensor(s) that {md_cell(task)} holds and the base does "
            "not, as asked (`--drop-extra-tensors`): ",
            names,
        )
    return lines


def method_facts(method: str) -> MergeMethod | None:
    """The method a report names, for what it says of itself (None: not one ram-dist has)."""
    try:
        return get_method(method)
    except RamDistError:
        return None


def method_lines(report: Mapping[str, Any]) -> list[str]:
    """What the report's method says of its own keys (`MergeMethod.report_lines`)."""
    facts = method_facts(str(report.get("method", "")))
    return facts.report_lines(report) if facts is not None else []


def _method_text(method: str) -> str:
    facts = method_facts(method)
    if facts is None or not facts.description:
        return f"`{method}`."
    cited = f" Reference: {facts.reference}." if facts.reference else ""
    return facts.description + cited


def ram_task_table(report: Mapping[str, Any]) -> list[str]:
    tasks = report["tasks"]
    applied = report.get("lambda_applied")
    variants = list(tasks[0].get("lambda") or {})
    head = ["task", "model", "changed", "density", "unique", "shared", "rho"]
    head += [f"lambda {m}" for m in variants]
    if applied is not None:
        head.append("lambda applied")
    align = ["---:", ":---"] + ["---:"] * (len(head) - 2)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for i, t in enumerate(tasks):
        model = t.get("model") or (report.get("tasks_given") or [""] * len(tasks))[i]
        cells = [
            str(i + 1),
            md_code(redact_location(str(model))),
            str(t["changed"]),
            f"{100 * t['density']:.2f}%",
            str(t["unique"]),
            str(t["shared"]),
            format_rho(t["rho"]),
        ]
        cells += [f"{t['lambda'][m]:.6g}" for m in variants]
        if applied is not None:
            cells.append(f"{applied[i]:.6g}")
        lines.append("| " + " | ".join(cells) + " |")
    if applied is None and "lambda_per_tensor" in report:
        lines += ["", f"`lambda_t` was computed per tensor; see `{REPORT_NAME}`."]
    el = report.get("elements") or {}
    if el.get("participating") is not None:
        lines += [
            "",
            f"Density is the share of the {el['participating']} floating-point elements a task "
            f"changed; {el.get('unchanged')} elements were changed by no task.",
        ]
    return lines


def format_rho(value: Any) -> str:
    return value if isinstance(value, str) else f"{value:.4f}"


def _load_snippet(report: Mapping[str, Any]) -> list[str]:
    output = report.get("output") or {}
    url = str(output.get("url") or ".")
    where = hub_repo_id(url)
    lines = []
    if re.match(r"^(s3|gs|gcs|az|abfs)://", where):
        lines.append(f"# copy {where} to a local folder first, then load that folder")
        where = "./merged-model"
    tokenizer = any(f in TOKENIZER_FILES for f in output.get("files_copied") or [])
    if str((report.get("formats") or {}).get("output", "")).startswith("fine-grained FP8"):
        lines += [
            "# FP8 blocks, as the base: transformers loads them with its fine-grained FP8",
            "# support (a GPU that has FP8); `ram-dist merge --out-dtype bfloat16` writes a",
            "# checkpoint any machine loads",
        ]
    lines += [
        "from transformers import AutoModelForCausalLM" + (", AutoTokenizer" if tokenizer else ""),
        "",
        f'model = AutoModelForCausalLM.from_pretrained({json.dumps(where)}, dtype="auto")',
    ]
    if tokenizer:
        lines.append(f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(where)})")
    return lines


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)


def md_cell(value: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def md_code(value: str) -> str:
    """`value` as inline code in a table cell (backticks and pipes cannot break out)."""
    if not value:
        return ""
    fence = "``" if "`" in value else "`"
    pad = " " if "`" in value else ""
    escaped = value.replace("|", "\\|")
    return f"{fence}{pad}{escaped}{pad}{fence}"
