"""Each job setting is declared once (`ram_dist.settings`): the flags and their help, the
API's keywords, the YAML keys, docs/cli.md's flag table and the job's identity all follow it."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

import pytest
from builders import build_model_set

import ram_dist
from ram_dist import settings
from ram_dist.cli import build_parser, config_from_args, flag_table
from ram_dist.errors import RamDistError
from ram_dist.mergekit_config import TOP_KEYS
from ram_dist.methods.parameters import cli_parameters
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.job import prepare

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
CLI_DOC = ROOT / "docs" / "cli.md"
EXTENDING = ROOT / "docs" / "extending.md"


def _table_rows() -> dict[str, tuple[list[str], str]]:
    """The generated flag table: per row, its flags and its default cell."""
    rows = {}
    for line in flag_table.render().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) != 4 or not cells[0].startswith("`--"):
            continue
        flags = [f.replace("[no-]", "") for f in re.findall(r"--[\w\[\]-]+", cells[0])]
        rows[cells[0]] = (flags, cells[2])
    return rows


def test_the_example_setting_is_one_field_that_makes_a_flag():
    """The field docs/extending.md's "Adding a setting" shows, added to `HowToRun`, is a
    setting with its flag."""
    example = re.search(
        r"<!-- example-setting -->\n```python\n(.*?)```", EXTENDING.read_text(), re.S
    )
    assert example is not None, "docs/extending.md lost its example setting"
    source = "class WithRetries(HowToRun):\n" + textwrap.indent(example.group(1), "    ")
    namespace = {"HowToRun": settings.HowToRun, "setting": settings.setting}
    exec(source, namespace)  # noqa: S102  (the documentation's own code)
    model = dataclasses.dataclass(frozen=True, kw_only=True)(namespace["WithRetries"])
    retries = settings._declared(model)[-1]
    assert (retries.name, retries.meta.flag, retries.default) == ("retries", "--retries", None)
    assert retries.help_text() == "times a failed unit is run again (default: Ray's default)"


def test_the_flag_table_lists_every_flag_with_its_declared_default():
    rows = _table_rows().values()
    listed = [f for flags, _ in rows for f in flags]
    declared = {s.meta.flag for s in settings.SETTINGS if s.meta.flag}
    parameters = {p.cli_flag for p, _ in cli_parameters()}
    assert sorted(listed) == sorted(declared | parameters)
    defaults = {flags[0]: default for flags, default in rows}
    for s in settings.SETTINGS:
        if s.meta.flag:
            assert defaults[s.meta.flag] == s.shown_default, s.name


def test_docs_cli_holds_the_flag_table_the_declarations_make():
    text = CLI_DOC.read_text()
    assert flag_table.rewrite(text) == text, (
        "docs/cli.md's flag table differs from the declarations: "
        "run `python -m ram_dist.cli.flag_table` to regenerate it"
    )


def test_the_readme_holds_the_table_of_methods_the_registry_makes():
    """Every method, with its one-line summary, in README.md and in `--method`'s help."""
    text = flag_table.README.read_text()
    assert (
        flag_table.rewrite(
            text, flag_table.METHODS_BEGIN, flag_table.METHODS_END, flag_table.render_methods
        )
        == text
    ), "README.md's table of methods differs: run `python -m ram_dist.cli.flag_table`"
    from ram_dist.methods import METHODS

    method_help = settings.BY_NAME["method"].meta.help()
    for name, method in METHODS.items():
        assert method.summary and "\n" not in method.summary, name
        assert f"{name}: {method.summary.replace('`', '')}" in method_help


def test_docs_cli_names_every_flag_of_every_command():
    """The flags the table does not list (a command's own: `--dry-run`, `--json`, ...) are
    described in docs/cli.md's sections on the commands."""
    text = CLI_DOC.read_text()
    named = set(re.findall(r"--[a-z][\w-]*", text))
    for name in re.findall(r"--\[no-\]([\w-]+)", text):
        named |= {f"--{name}", f"--no-{name}"}
    parser = build_parser()
    for command, sub in parser._subparsers._group_actions[0].choices.items():  # type: ignore[union-attr]
        assert f"\n### {command}\n" in text, command
        flags = {f for a in sub._actions for f in a.option_strings} - {"-h", "--help"}
        assert flags <= named, (command, sorted(flags - named))


@pytest.mark.parametrize("command", settings.COMMANDS)
def test_each_command_has_a_flag_per_setting_with_the_declared_help(command):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    actions = {a.dest: a for a in sub._actions}
    for s in settings.flagged(command):
        action = actions[s.name]
        assert action.option_strings == [s.meta.flag] and action.default is None
        assert action.help == s.help_text() and action.help.split("\n")[0].endswith(
            f"(default: {s.shown_default.replace('`', '')})"
        )
        assert tuple(action.choices or ()) == s.meta.choices
    untaken = {s.name for s in settings.SETTINGS if s.meta.flag} - {
        s.name for s in settings.flagged(command)
    }
    assert untaken.isdisjoint(actions)


def test_the_config_is_both_models_and_the_yaml_keys_are_settings():
    names = [f.name for f in dataclasses.fields(MergeConfig)]
    assert names == [s.name for s in settings.SETTINGS] + ["notes"]
    assert set(settings.YAML_KEYS) <= set(TOP_KEYS)
    assert all(settings.YAML_KEYS[k] in settings.BY_NAME for k in settings.YAML_KEYS)


@pytest.mark.parametrize("name", [s.name for s in settings.SETTINGS if s.meta.choices])
def test_a_value_outside_a_settings_choices_is_refused_by_name(name):
    words = name.replace("_", " ")
    with pytest.raises(RamDistError, match=f"^{words} must be .* or .*, got 'nope'$"):
        MergeConfig(base="b", tasks=("t1", "t2"), **{name: "nope"})


def test_flags_and_keywords_make_the_same_job(tmp_path):
    argv = ["plan", "--base", "b", "--task", "t1", "--task", "t2", "--unit-mb", "2",
            "--kernels", "eager", "--cache-dir", str(tmp_path), "--integers-from-base",
            "--out", "o", "--output-shared", "--storage-options", '{"s3": {}}']  # fmt: skip
    from_cli = config_from_args(build_parser().parse_args(argv))
    from_api = ram_dist.job_config(
        base="b", tasks=["t1", "t2"], unit_budget_bytes=2 * 2**20, kernels="eager",
        cache_dir=tmp_path, integers_from_base=True, out="o", output_shared=True,
        storage_options={"s3": {}},
    )  # fmt: skip
    assert from_cli == from_api
    assert from_cli.storage_options == {"s3": {}}


def test_the_identity_records_what_to_merge_and_nothing_of_how_to_run(tmp_path):
    """Every what-to-merge setting lands in `Job.identity` under its declared key; changing
    every how-to-run setting leaves the identity as it was."""
    base, tasks, _, _ = build_model_set(tmp_path)
    config = MergeConfig(base=str(base), tasks=tuple(map(str, tasks)), out=str(tmp_path / "o"))
    identity = prepare(config).identity()
    assert set(identity) == settings.IDENTITY_KEYS
    how = dict(
        out=str(tmp_path / "elsewhere"), overwrite=True, output_shared=True, workers=3,
        unit_budget_bytes=1000, device="cpu", address="ray://x:1", kernels="eager",
        input_cache="off", cache_dir=str(tmp_path), log_format="json", allow_nonfinite=True,
        integers_from_base=True, drop_extra_tensors=True, storage_options={"s3": {"anon": True}},
    )  # fmt: skip
    assert set(how) == {s.name for s in settings.HOW}
    assert prepare(dataclasses.replace(config, **how)).identity() == identity
    changed = prepare(dataclasses.replace(config, out_dtype="float32")).identity()
    assert changed["out_dtype"] != identity["out_dtype"]


_PLAN = ["plan", "--base", "b", "--task", "t1", "--task", "t2"]


@pytest.mark.parametrize(
    ("flags", "method_flag"),
    [
        (["--method", "della", "--eps", "0.1"], "--della-epsilon"),
        (["--method", "ram", "--della-epsilon", "0.1"], "--eps"),
        (["--method", "nearswap", "--t", "0.1"], "--nearswap-t"),
        (["--method", "consensus_ties", "--lambda", "2"], "--consensus-lambda"),
    ],
)
def test_a_flag_the_method_means_otherwise_exits_2_naming_the_methods_flag(
    flags, method_flag, capsys
):
    """A flag has one meaning: given to a method whose parameter of that name means another
    thing, it is refused with the method's own flag, never read as it (docs/cli.md)."""
    from ram_dist.cli import main

    tasks = ["--task", "t1"] if "nearswap" in flags else _PLAN[3:]  # nearswap takes one
    assert main([*_PLAN[:3], *tasks, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ram-dist: error: {flags[2]} sets "), err
    assert f"; {flags[1]}'s " in err and err.endswith(f") is {method_flag}\n"), err


def test_the_method_a_config_file_names_decides_which_flag_is_its_own(tmp_path, capsys):
    from ram_dist.cli import main

    config = tmp_path / "della.yaml"
    config.write_text('{"merge_method": "della", "base_model": "b", "models": '
                      '[{"model": "t1"}, {"model": "t2"}]}')  # fmt: skip
    assert main(["plan", str(config), "--eps", "0.1"]) == 2
    assert "della's epsilon" in capsys.readouterr().err
    parse = build_parser().parse_args
    job = config_from_args(parse(["plan", str(config), "--della-epsilon", "0.1"]))
    assert job.task_parameters == ({"epsilon": 0.1}, {"epsilon": 0.1})
    job = config_from_args(parse([*_PLAN, "--method", "ram", "--eps", "1e-4"]))
    assert job.parameters == {"epsilon": 1e-4}


def test_the_method_flag_says_one_method_a_line():
    """`--help` lists the methods one a line after the flag's first line; docs/cli.md's flag
    table shows that first line, and the table of methods below it."""
    from ram_dist.methods import METHODS

    merge = build_parser()._subparsers._group_actions[0].choices["merge"]  # type: ignore[union-attr]
    text = merge.format_help()
    for name, method in METHODS.items():
        first = " ".join(f"{name}: {method.summary.replace('`', '')}".split()[:3])
        assert any(line.strip().startswith(first) for line in text.splitlines()), name
    row = next(line for line in flag_table.render().splitlines() if "`--method" in line)
    assert len(row) < 200, row
    assert flag_table.render_methods() in CLI_DOC.read_text()
