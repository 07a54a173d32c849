"""What README.md and docs/ say of the code, checked against it: the tables made from the
code (`ram_dist.cli.flag_table`) are what the code makes now, every path of the repository and
`ram_dist.module` named exists, every `--flag` named is one of ram-dist's (or of the other
tool the line runs), and the figures the pages quote from the code (the lease's periods, the
dtypes the kernels read) are the code's."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from ram_dist import kernels
from ram_dist.cli import build_parser, flag_table
from ram_dist.io.backends import BACKENDS, backend
from ram_dist.io.lease.output import RENEW_EVERY_S, STALE_AFTER_S
from ram_dist.methods import METHODS
from ram_dist.methods.parameters import cli_parameters

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

#: Paths a page names that are not meant to exist: docs/extending.md's example method, the
#: file a reader of "Adding a method" creates, and where CI installs Azurite.
NOT_IN_THE_CODE = {"ram_dist/methods/mean.py", ".ci/node"}
#: Flags of other tools that pages show: pip, pytest-xdist, `ray job submit`, ruff, gcloud,
#: the paper authors' script (docs/exactness.md), and docs/extending.md's example setting.
OTHER_TOOLS_FLAGS = {
    "--index-url", "--dist", "--address", "--working-dir", "--runtime-env", "--check",
    "--lifecycle-file", "--rescale_factor", "--retries",
}  # fmt: skip

PATH = re.compile(r"(?<![\w/.-])(?:ram_dist|tests|benchmarks|jobs|k8s|examples|\.ci)/[\w/.-]*\w/?")
MODULE = re.compile(r"\bram_dist(?:\.\w+)+")
FLAG = re.compile(r"(?<![\w-])--(?:\[no-\])?[a-z][\w-]*")


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize(
    "table", flag_table.TABLES, ids=lambda t: f"{t[0].name}:{t[1].split(':')[0][5:]}"
)
def test_each_generated_table_is_what_the_code_makes(table):
    path, begin, end, make = table
    text = path.read_text()
    assert flag_table.rewrite(text, begin, end, make) == text, (
        f"{path.relative_to(ROOT)}'s table after {begin!r} differs from the code: "
        "run `python -m ram_dist.cli.flag_table`"
    )


def test_the_parameter_table_has_every_method_s_every_parameter_with_its_default():
    rows = flag_table.render_parameters()
    for name, method in METHODS.items():
        for p in method.parameters:
            if not p.effect:
                continue
            flag = p.cli_flag or ""  # one row per name, flag and scope
            cells = {"none (YAML only)", f"`{flag}`", f"`--[no-]{flag.removeprefix('--')}`"}
            row = next(
                r for r in rows.splitlines() if r.startswith(f"| `{p.name}` |")
                and ("per task" if p.per_task else "once") in r.split(" | ")[2]
                and r.split(" | ")[1] in cells
            )  # fmt: skip
            uses = row.split(" | ")[3]
            shown = flag_table._shown(p.default)
            assert re.search(rf"`{name}`(, `\w+`)*: {re.escape(shown)}(?![\w.])", uses), (name, p)


def test_the_kernel_table_says_what_the_engine_asks_of_each_method():
    """A map pass is "fused kernels" where the method gives `fused_merge` and its `fuses`
    takes a tensor at the defaults: della's, breadcrumbs' and DARE's are (DARE's round too,
    its draws in the kernel), and passthrough's (a copy of the model's bytes, which reaches
    it decoded: `tests/engine/test_fp8_in_kernels.py` sees which decode FP8 inputs)."""
    cells = {name: flag_table.kernel_cells(m) for name, m in METHODS.items()}
    assert cells["della"][1] == cells["breadcrumbs"][1] == "fused kernels"
    assert cells["ram_plus"][:2] == ("at most 1, on fused kernels", "fused kernels")
    assert cells["dare_ties"][:3] == ("at most 1, on fused kernels", "fused kernels", "as stored")
    assert cells["passthrough"][1:3] == ("fused kernels", "decoded")
    assert cells["ties"][0] == "at most 4, on fused kernels"
    assert cells["consensus_ta"][1] == cells["consensus_ties"][1] == "fused kernels"
    assert cells["task_arithmetic"][0] == "the input check only"
    assert cells["linear"][0] == "the input check only"
    assert cells["arcee_fusion"][0] == "at most 2, on fused kernels"
    assert {cells[m][1] for m in ("model_stock", "sce", "arcee_fusion")} == {"fused kernels"}
    text = (DOCS / "methods.md").read_text()
    stored = re.search(r"read the stored dtypes \(([^)]*)\)", text)
    assert stored is not None
    named = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
    listed = {named[d.strip()] for d in stored.group(1).split(",") if d.strip() in named}
    assert listed == set(kernels.READS)


def test_the_lease_table_names_every_protocol_of_the_backends():
    rows = flag_table.lease_rows()
    listed = [p for protocols, _, _ in rows for p in protocols]
    assert set(BACKENDS) <= set(listed)
    for protocols, lease, _ in rows:
        assert all(backend(p).lease == lease for p in protocols)


def test_the_output_page_names_every_store_and_the_lease_s_periods():
    text = " ".join((DOCS / "output.md").read_text().split())
    intro = text.split("## ")[0]
    for protocol in ("s3", "gs", "az", "abfs", "hf"):
        assert f"`{protocol}://`" in intro, protocol
    renew = re.search(r"renewed every (\d+) s", text)
    stale = re.search(r"not been renewed for (\d+) s", text)
    margin = re.search(r"within (\d+) s of each other \((\d+) s less the (\d+) s", text)
    assert renew and stale and margin
    assert float(renew.group(1)) == RENEW_EVERY_S
    assert float(stale.group(1)) == float(margin.group(2)) == STALE_AFTER_S
    assert float(margin.group(3)) == RENEW_EVERY_S
    assert float(margin.group(1)) == STALE_AFTER_S - RENEW_EVERY_S


def _module_has(module_path: Path, name: str) -> bool:
    """Whether a module file defines or imports `name` at its top level."""
    source = module_path.read_text()
    pattern = rf"^(def|class|async def) {name}\b|^{name}\s*[:=]|^\s*{name},?$|import .*\b{name}\b"
    return re.search(pattern, source, re.M) is not None


def _module_exists(dotted: str) -> bool:
    """`ram_dist.a.b` as a package or module, or `ram_dist.a.NAME` an attribute of module
    `a` (imported: the API's calls are made at import)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        if base.is_dir() or base.with_suffix(".py").exists():
            rest = parts[n:]
            if len(rest) > 1:
                return False
            return not rest or hasattr(importlib.import_module(".".join(parts[:n])), rest[0])
    return False


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_path_and_module_a_page_names_exists(page: Path):
    text = page.read_text()
    missing = [
        p for p in set(PATH.findall(text))
        if p not in NOT_IN_THE_CODE and not (ROOT / p.rstrip("/.")).exists()
    ]  # fmt: skip
    missing += [m for m in set(MODULE.findall(text)) if not _module_exists(m)]
    assert not missing, f"{_page_id(page)} names what the code does not have: {sorted(missing)}"


def _known_flags() -> set[str]:
    """Every flag of every ram-dist command, the methods' `--no-` forms, and the flags of
    the benchmarks and of ram-dist's own modules run with `python -m`."""
    known: set[str] = set()
    parser = build_parser()
    for sub in parser._subparsers._group_actions[0].choices.values():  # type: ignore[union-attr]
        known |= {f for a in sub._actions for f in a.option_strings}
    for p, _ in cli_parameters():
        known |= {p.cli_flag, "--no-" + p.cli_flag.removeprefix("--")}
    for source in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("ram_dist/**/*.py")]:
        known |= set(re.findall(r"add_argument\(\s*\"(--[a-z][\w-]*)\"", source.read_text()))
    return known


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_flag_a_page_names_exists(page: Path):
    known = _known_flags() | OTHER_TOOLS_FLAGS
    named = {f.replace("[no-]", "") for f in FLAG.findall(page.read_text())}
    unknown = sorted(f for f in named if f not in known)
    assert not unknown, f"{_page_id(page)} names flags no command has: {unknown}"


def _said(page: str) -> str:
    """A docs page with its line breaks and indentation as single spaces."""
    return " ".join((DOCS / page).read_text().split())


def _mib(n: int) -> str:
    return f"{n // 2**20} MiB"


def test_the_sizes_and_periods_the_pages_state_are_the_code_s():
    """Each sentence quotes the constant the code holds: a change to one fails here until
    the page says the new value."""
    from ram_dist import settings
    from ram_dist.engine import blocks, map_step, passes
    from ram_dist.engine.shard_book import ShardBook
    from ram_dist.io import gcs, header_reads, json_files, range_cache, s3, storage
    from ram_dist.io.sinks.gcs import PART_SUFFIX as GCS_PART_SUFFIX
    from ram_dist.io.sinks.gcs import PARTS_DIR as GCS_PARTS_DIR
    from ram_dist.io.sinks.gcs import GcsSink
    from ram_dist.planning import sizing, units

    every_s = inspect.signature(ShardBook.__init__).parameters["every_s"].default
    words = {5: "five", 8: "8", 3: "three"}
    expected = {
        "architecture.md": [
            f"at most {units.MAX_PIECES:,} pieces a unit",
            f"A compute block holds at most {sizing.COMPUTE_BLOCK // 2**20}M elements",
            f"(at most {blocks.SMALL_BYTES // 2**10} KiB from each input) are read together, "
            f"up to {blocks.GROUP_BLOCKS:,} of them and {_mib(blocks.GROUP_BYTES)} at a time",
            f"at least {_mib(map_step.HAND_OFF_BYTES)} at a time",
            f"until it has read at least {_mib(passes.TASK_BYTES)}, or at least "
            f"1/{passes.TASKS_PER_SLOT} of the pass's bytes over its tasks in flight",
            f"{settings.UNITS_PER_SLOT} units per core over the largest input, at most "
            f"1/{round(1 / settings.MEMORY_SHARE)} of a core's memory, "
            f"{settings.MIN_UNIT_BUDGET // 2**20} to {_mib(settings.MAX_UNIT_BUDGET)}",
        ],
        "storage.md": [
            f"the first {header_reads.FIRST_READ_BYTES // 2**10} KiB",
            f"`hf://` headers are read by {header_reads.READ_THREADS} threads",
            f"requests of at most {_mib(storage.REQUEST_BYTES)}",
            f"one request of at most {_mib(storage.REQUEST_BYTES)}",
            f"with {s3.RETRIES['total_max_attempts']} attempts in all",
            f"up to {words[storage.ATTEMPTS]} attempts with exponential backoff",
            f"keeps {round(range_cache.RESERVE_FRACTION * 100)}% of its size (and at least "
            f"{range_cache.RESERVE_MIN_BYTES // 2**30} GiB) free",
            f"Parts are at least {GcsSink.min_part_bytes // 2**10} KiB (GCS composes any "
            f"size; S3 needs {_mib(s3.MIN_PART_BYTES)})",
            f"One compose takes at most {gcs.MAX_COMPOSE_SOURCES} objects, so past "
            f"{gcs.MAX_COMPOSE_SOURCES} parts it composes groups of {gcs.MAX_COMPOSE_SOURCES}",
            f"`PREFIX/{GCS_PARTS_DIR}/SHARD/UPLOAD/NNNNN{GCS_PART_SUFFIX}`",
        ],
        "resume.md": [
            f"at most every {every_s:g} s as parts finish",
            f"A manifest over {_mib(json_files.MAX_MANIFEST_BYTES)}, or a stored "
            f"`merge_report.json` over {_mib(json_files.MAX_REPORT_BYTES)}, is refused",
        ],
    }
    for page, sentences in expected.items():
        text = _said(page)
        for sentence in sentences:
            assert sentence in text, (page, sentence)


def _same(said: str, value: object) -> bool:
    """Whether a default as a page writes it (`true`, `1e-5`, `1`) is `value`."""
    if isinstance(value, bool):
        return said == ("true" if value else "false")
    if isinstance(value, (int, float)):
        try:
            return float(said) == float(value)
        except ValueError:
            return False
    return said == str(value)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_each_default_a_page_states_is_a_declared_one(page: Path):
    """ "`name` (`--flag`, ..., default X" is a default some method declares for `name`;
    "`--flag` ... `X` (the default)" is the setting's."""
    from ram_dist import settings

    text = " ".join(page.read_text().split())
    declared: dict[str, list[object]] = {}
    for method in METHODS.values():
        for p in method.parameters:
            declared.setdefault(p.name, []).append(p.default)
    wrong = []
    for m in re.finditer(
        r"`([\w-]+)` \((?:[^()]|\([^()]*\))*?\bdefault (?:is )?`?([\w.+-]+)`?", text
    ):
        name, said = m.groups()
        if name in declared and not any(_same(said, d) for d in declared[name]):
            wrong.append((name, said, declared[name]))
    flags = {s.meta.flag: s for s in settings.SETTINGS if s.meta.flag}
    for m in re.finditer(r"`(--[\w-]+)(?: (\w+))?`[^.`]*?(?:`(\w+)` )?\(the default\)", text):
        flag, value = m.group(1), m.group(2) or m.group(3)
        if flag in flags and value is not None and not _same(value, flags[flag].default):
            wrong.append((flag, value, flags[flag].default))
    assert not wrong, f"{_page_id(page)} states defaults the code does not declare: {wrong}"


def test_the_methods_page_lists_every_method_with_its_reference():
    """docs/methods.md's table of methods: every method of the registry once, its paper's
    first author and year as the method's `reference` names them."""
    text = (DOCS / "methods.md").read_text()
    rows = re.findall(r"^\| `(\w+)`(?: \(default\))? \| [^|]* \|([^|]*)\|$", text, re.M)
    assert sorted(name for name, _ in rows) == sorted(METHODS)
    for name, paper in rows:
        paper = paper.strip()
        if not paper:
            continue
        reference = METHODS[name].reference
        assert paper.split()[0] in reference, (name, paper, reference)
        assert set(re.findall(r"\b(?:19|20)\d\d\b", paper)) <= set(re.findall(r"\d{4}", reference))
    headings = re.findall(
        r"^### `(\w+)`(?: and `(\w+)`)?", (DOCS / "mergekit-methods.md").read_text(), re.M
    )
    covered = {n for pair in headings for n in pair if n}
    assert {"slerp", "della", "della_linear", "breadcrumbs", "breadcrumbs_ties"} <= covered


def test_the_api_page_s_report_attributes_exist():
    from ram_dist.report import api_reports

    text = (DOCS / "api.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| ([^|]*) \|$", text, re.M)
    assert {call for call, _, _ in rows} == {"merge", "probe", "plan", "verify"}
    for _, cls, attributes in rows:
        report = getattr(api_reports, cls)
        fields = set(getattr(report, "__dataclass_fields__", {})) | set(dir(report))
        for name in re.findall(r"`(\w+)`", attributes):
            assert name in fields, (cls, name)


def test_the_readme_s_requirements_are_pyproject_s():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    text = " ".join((ROOT / "README.md").read_text().split())
    python = re.search(r"Python (\d+\.\d+) or newer", text)
    torch = re.search(r"PyTorch (\d+\.\d+) or newer", text)
    assert python and torch
    assert project["requires-python"] == f">={python.group(1)}"
    assert f"torch>={torch.group(1)}" in project["dependencies"]
    extras = set(re.findall(r"'\.\[(\w+)\]'", text))
    assert extras and extras <= set(project["optional-dependencies"])


def _report_keys() -> set[str]:
    """Every property the report's JSON Schema names, and every string literal of the
    package's source (the keys the code writes beyond the schema's)."""
    import json

    schema = json.loads((ROOT / "ram_dist" / "report_schema.json").read_text())
    names: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "properties" and isinstance(value, dict):
                    names.update(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(schema)
    for source in (ROOT / "ram_dist").rglob("*.py"):
        names |= set(re.findall(r"[\"'](\w+)[\"']", source.read_text()))
    return names


def test_the_report_keys_the_pages_name_are_written():
    """observability.md's section on merge_report.json and output.md name report keys
    (`passes.map.output_path`, `timeline`'s phases, `precision`'s keys): each is in the
    report's schema or written by the code."""
    keys = _report_keys()
    text = (DOCS / "observability.md").read_text()
    section = text[
        text.index("## `merge_report.json`") : text.index(
            "\n## ", text.index("## `merge_report.json`") + 5
        )
    ]
    named = re.findall(r"`([a-z]\w*_\w+|[a-z]\w*(?:\.(?:<pass>|\w+))+)`", section)
    named += re.findall(r"`(passes\.[\w.]+)`", (DOCS / "output.md").read_text())
    assert len(named) > 20
    missing = [
        n for n in named if not n.endswith(".json")
        and any(p not in keys for p in n.split(".") if p != "<pass>")
    ]  # fmt: skip
    assert not missing, missing


def _param(method: str, name: str):  # noqa: ANN202
    return next(p for p in METHODS[method].parameters if p.name == name)


def _refused(method: str, name: str, value: object) -> bool:
    from ram_dist.errors import RamDistError

    try:
        _param(method, name).validate(value, "where")
    except RamDistError:
        return True
    return False


def test_the_methods_page_s_prose_defaults_and_checks_are_the_code_s():
    text = _said("methods.md")
    alpha = re.search(r"Its `alpha` defaults to ([\d.]+), mergekit's default", text)
    scope_alpha = re.search(
        r"`scope: tensor` gives the same per-tensor rule to `ram_plus` \(with `alpha` ([\d.]+)\)",
        text,
    )
    density = re.search(r"`ties` keeps every element at its default `density` of ([\d.]+)", text)
    normalize = re.search(r"the weights \(`normalize`, default (true|false)\)", text)
    assert alpha and scope_alpha and density and normalize
    assert float(alpha.group(1)) == _param("ramplus_tl", "alpha").default
    assert float(scope_alpha.group(1)) == _param("ram_plus", "alpha").default
    assert float(density.group(1)) == _param("ties", "density").default
    assert _same(normalize.group(1), _param("linear", "normalize").default)
    # "The checks: ..." as the declarations make them.
    assert "The checks: `epsilon > 0` (RAM), `r >= 0`, `alpha >= 0`, `density` in (0, 1]" in text
    assert _refused("ram", "epsilon", 0.0) and not _refused("ram", "epsilon", 1e-9)
    assert _refused("ram", "r", -0.1) and not _refused("ram", "r", 0.0)
    assert _refused("ram", "alpha", -0.1) and not _refused("ram", "alpha", 0.0)
    assert _refused("ties", "density", 0.0) and not _refused("ties", "density", 1.0)
    assert _refused("ties", "density", 1.01)
    assert "`gamma` in [0, 1]" in text
    assert not _refused("breadcrumbs", "gamma", 0.0) and not _refused("breadcrumbs", "gamma", 1.0)
    assert _refused("breadcrumbs", "gamma", 1.01) and _refused("breadcrumbs", "gamma", -0.01)
    assert "`select_topk` in (0, 1]" in text
    assert _refused("sce", "select_topk", 0.0) and not _refused("sce", "select_topk", 1.0)
    assert _refused("sce", "select_topk", 1.01)
    assert "`max_iter`, `tol` and `eps` >= 0" in text
    for method, name, value in (("karcher", "max_iter", -1), ("karcher", "tol", -1e-9),
                                ("multislerp", "eps", -1e-9)):  # fmt: skip
        assert _refused(method, name, value), name
    assert "DELLA's `density - epsilon > 0` and `density + epsilon < 1`" in text
    from ram_dist.errors import RamDistError

    della = METHODS["della"]
    with pytest.raises(RamDistError):
        della.check({"density": [0.1], "epsilon": [0.1]}, "where")
    with pytest.raises(RamDistError):
        della.check({"density": [0.9], "epsilon": [0.1]}, "where")
    della.check({"density": [0.5], "epsilon": [0.1]}, "where")


def test_the_cli_page_counts_the_commands_and_ties_rounds():
    numbers = {"four": 4, "five": 5, "six": 6}
    text = _said("cli.md")
    commands = re.search(r"`ram-dist` has (\w+) commands", text)
    assert commands is not None
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert numbers[commands.group(1)] == len(subcommands)
    rounds = re.search(r"TIES needs up to (\w+) reduce rounds", text)
    assert rounds is not None and numbers[rounds.group(1)] == METHODS["ties"].rounds


def _constant(module: str, name: str) -> int:
    """An integer constant of a module, read from its source (the engine's modules import
    Ray)."""
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    found = re.search(rf"^{name}(?:: int)? = (\d+)$", source, re.M)
    assert found is not None, (module, name)
    return int(found.group(1))


def test_the_retries_resume_md_states_are_the_engine_s():
    text = _said("resume.md")
    units = _constant("ram_dist.engine.passes", "SYSTEM_RETRIES")
    restarts = _constant("ram_dist.engine.gpu", "RESTARTS")
    assert f"Ray runs the unit again, up to {units} times" in text
    assert f"is restarted by Ray (up to {restarts} times)" in text


def test_which_kernels_read_quantized_inputs_as_stored_is_what_the_readme_says():
    """Only RAM's kernels write FP8; every method with kernels reads quantized inputs as
    stored, as the README says (passthrough's `fused_merge` is a copy of the model's bytes,
    no kernel: a quantized model reaches it decoded)."""
    from ram_dist.methods import ram

    text = " ".join((ROOT / "README.md").read_text().split())
    assert "Only the RAM family's kernels write FP8 output in one sweep" in text
    writes = {name for name, m in METHODS.items() if getattr(m, "writes_fp8", False)}
    assert writes == {m.name for m in ram.METHODS}
    assert "other quantized inputs as stored too (every method with kernels does)" in text
    with_kernels = {
        name for name, m in METHODS.items()
        if flag_table._offers(m, "fused_statistics") or flag_table._offers(m, "fused_merge")
    } - {"passthrough"}  # fmt: skip
    stored = {name for name, m in METHODS.items() if getattr(m, "reads_stored", False)}
    assert with_kernels and stored == with_kernels


def test_the_trainer_names_inputs_md_lists_are_the_checks():
    from ram_dist.planning import tensor_names

    text = _said("inputs.md")
    heads = re.search(r"a value or reward head \(([^)]*)\)", text)
    assert heads is not None
    assert set(re.findall(r"`(\w+)`", heads.group(1))) == tensor_names.VALUE_HEAD_PARTS
    for wrapper in tensor_names.WRAPPERS:
        assert f"`{wrapper}.`" in text, wrapper
    assert f"`{tensor_names.DROP_EXTRA}`" in text


def test_the_output_page_s_paths_are_the_backends_sinks():
    """output.md's table of who writes the merged bytes: a store named in a "direct" row has
    a sink of its own (its workers write), one in the "through-driver" row has the driver's,
    every store with a sink of its own is named; and the S3 part sizes it states are the
    planner's."""
    from ram_dist.io import s3
    from ram_dist.io.backend import Backend

    text = (DOCS / "output.md").read_text()
    table = text[text.index("| output | path | how |") :].split("\n\n")[0]
    rows = [r.split(" | ")[:2] for r in table.splitlines()[2:]]
    driver = Backend.__dataclass_fields__["sink"].default
    named: set[str] = set()
    for cell, path in rows:
        for protocol in re.findall(r"`(\w+)://`", cell):
            named.add(protocol)
            assert (backend(protocol).sink == driver) == (path == "through-driver"), cell
    local = {"file", "local"}  # "a local folder": the file sink, on one node or shared
    assert {p for p, b in BACKENDS.items() if b.sink != driver} - local <= named
    assert any("a local folder" in cell and path == "direct" for cell, path in rows)
    said = _said("output.md")
    parts = re.search(r"Parts are planned at least (\d+) MiB long .*? at most ([\d,]+) per", said)
    assert parts is not None
    assert int(parts.group(1)) * 2**20 == s3.MIN_PART_BYTES
    assert int(parts.group(2).replace(",", "")) == s3.MAX_PARTS


def test_the_method_recipe_names_every_member_of_the_protocol():
    """docs/extending.md's "Adding a method" names each member of `MergeMethod` (a new
    member is a line of the page) and the bases that hold the protocol's defaults."""
    from ram_dist.methods import protocol

    page = (DOCS / "extending.md").read_text()
    section = page.split("## Adding a method")[1].split("\n## ")[0]
    named = set(re.findall(r"`(\w+)", section))
    members = set(protocol.MergeMethod.__annotations__)
    members |= {n for n in dir(protocol.MergeMethod) if not n.startswith("_")}
    assert {"merge_chunk", "fuses", "initial_state", "writes_fp8"} <= members
    assert members <= named, sorted(members - named)
    assert {"Defaults", "Eager", "NoStatistics"} <= named
    for name, method in METHODS.items():
        assert isinstance(method, protocol.Defaults), name


def test_the_demo_s_densities_are_the_generator_s():
    from ram_dist.synthetic.weights import AGENT_DENSITIES

    text = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(r"three agents that changed about (\d+)%, (\d+)% and (\d+)%", text)
    assert said is not None
    assert tuple(int(p) / 100 for p in said.groups()) == AGENT_DENSITIES


def test_the_log_events_observability_md_lists_are_the_ones_emitted():
    """The table of `--log-format json` events names every kind the code emits (each a
    `Progress.event(KIND, ...)` call), and no other."""
    emitted = {
        kind
        for source in (ROOT / "ram_dist").rglob("*.py")
        for kind in re.findall(r"\.event\(\s*\"(\w+)\"", source.read_text())
    }
    text = (DOCS / "observability.md").read_text()
    table = text[text.index("| event | when |") :].split("\n\n")[0]
    listed = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert {"job_start", "progress", "done", "warning"} <= emitted
    assert listed == emitted


def test_the_yaml_keys_cli_md_lists_are_the_reader_s():
    """docs/cli.md's table of a config's keys is the reader's top-level keys, and the keys it
    says are refused as not supported are the reader's."""
    from ram_dist.mergekit_config import reading

    text = (DOCS / "cli.md").read_text()
    table = text[text.index("| key | what it sets |") :].split("\n\n")[0]
    assert set(re.findall(r"^\| `(\w+)` \|", table, re.M)) == set(reading.TOP_KEYS)
    refused = _said("cli.md").split("These mergekit keys are refused as not supported:")[1]
    refused = refused.split("Values that vary")[0]
    named = set(re.findall(r"`(\w+)`", refused)) - {"base"}
    assert named == set(reading._UNSUPPORTED_KEYS) | {"tokenizer_source"}


def test_the_adapters_inputs_md_refuses_are_the_planner_s():
    """inputs.md's table of refused adapters names each adapter config key that makes an
    adapter something a plain LoRA merge is not (`planning.adapters.VARIANTS`), and reads
    the keys of `adapter_config.json` the planner reads."""
    from ram_dist.planning import adapters

    text = _said("inputs.md")
    refused = text.split("### Adapters that are refused")[1].split("For example")[0]
    for key, words in adapters.VARIANTS.items():
        assert words.split(" (")[0] in refused, key
    read = text.split("What is read from `adapter_config.json`")[1].split("An embedding")[0]
    source = (ROOT / "ram_dist" / "planning" / "adapters.py").read_text()
    for key in re.findall(r"raw\.get\(\"(\w+)\"", source):
        if key not in {"peft_type", "target_modules"}:  # the kind, and what the card names
            assert f"`{key}`" in read, key
