"""The bad-input catalogue: each case stops the CLI with exit 2, a message naming what is
wrong and where, and nothing at the output location. docs/troubleshooting.md lists the same."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from builders import load_checkpoint, save_checkpoint
from refusals import command_refused, merge_argv

from ram_dist.cli import main

# One Ray for the module: each refusal would otherwise start and stop an embedded Ray (about
# 3 s); that an embedded Ray is stopped after a refusal is test_shutdown's.
pytestmark = pytest.mark.usefixtures("ray_local")

SECRET_KEY, SECRET = "AKIA-FAKE-KEY-0001", "fake-secret-do-not-print"


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(6, generator=g).to(torch.bfloat16),
    }


def _changed(base: dict, seed: int, density: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in base.items():
        mask = torch.rand(v.shape, generator=g) < density
        out[k] = torch.where(mask, v.float() + 0.25, v.float()).to(v.dtype)
    return out


@pytest.fixture
def inputs(tmp_path) -> tuple[Path, list[Path]]:
    base = _state(0)
    save_checkpoint(base, tmp_path / "base", max_shard_bytes=64)
    tasks = []
    for i, density in enumerate((0.2, 0.5)):
        save_checkpoint(_changed(base, 10 + i, density), tmp_path / f"t{i}")
        tasks.append(tmp_path / f"t{i}")
    return tmp_path / "base", tasks


def _raw_file(path: Path, header: object, data: bytes = b"", length: int | None = None) -> None:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(body) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + body + data)


# 1. a missing input; an index naming a shard that does not exist
def test_missing_input_folder(inputs, tmp_path, capsys):
    base, tasks = inputs
    out = tmp_path / "out"
    command_refused(
        capsys, merge_argv(base, [tasks[0], tmp_path / "gone"], out), out, "task 2", "gone"
    )
    assert not out.exists()


def test_index_names_a_missing_shard(inputs, tmp_path, capsys):
    base, tasks = inputs
    index = json.loads((base / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[-1]
    (base / missing).unlink()
    out = tmp_path / "out"
    command_refused(
        capsys, merge_argv(base, tasks, out), out, "base model", f"shard {missing}", "not exist"
    )


# 2. path traversal in weight_map
@pytest.mark.parametrize("entry", ["../t0/model.safetensors", "/etc/passwd", "s3://x/y"])
def test_weight_map_outside_the_folder(inputs, tmp_path, capsys, entry):
    base, tasks = inputs
    index_path = base / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["a.weight"] = entry
    index_path.write_text(json.dumps(index))
    out = tmp_path / "out"
    command_refused(
        capsys, merge_argv(base, tasks, out), out, "base model", repr(entry), "not a plain file"
    )


def _break_task(tasks: list[Path], header: object, data: bytes = b"", length=None) -> Path:
    path = tasks[1] / "model.safetensors"
    _raw_file(path, header, data, length)
    return path


GOOD = {"a.weight": {"dtype": "BF16", "shape": [8, 4], "data_offsets": [0, 64]}}


# 3.-6. malformed headers and offsets
@pytest.mark.parametrize(
    ("header", "data", "length", "fragments"),
    [
        (b"{}", b"", 1000, ["runs past the end of the file"]),
        (b"{}", b"", 200 * 2**20, ["exceeds the", "cap"]),
        (b"{not json", b"", None, ["not valid JSON"]),
        (b"[1, 2]", b"", None, ["not an object"]),
        ({"a.weight": {"dtype": "BF16", "shape": "8x4", "data_offsets": [0, 64]}}, b"\0" * 64,
         None, ["'a.weight'", "shape"]),
        ({"a.weight": {"dtype": "BF16", "shape": [8, 4], "data_offsets": [0, 64]}}, b"\0" * 10,
         None, ["truncated"]),
        ({"a.weight": {"dtype": "BF16", "shape": [8, 4], "data_offsets": [0, 64]},
          "b.weight": {"dtype": "BF16", "shape": [6], "data_offsets": [60, 72]}}, b"\0" * 72,
         None, ["'b.weight' overlaps"]),
        ({"a.weight": {"dtype": "BF16", "shape": [8, 4], "data_offsets": [0, 60]}}, b"\0" * 60,
         None, ["'a.weight'", "needs 64"]),
        ({"a.weight": {"dtype": "BF16", "shape": [8, 4], "data_offsets": [8, 72]}}, b"\0" * 72,
         None, ["belong to no tensor", "forbids gaps"]),
        ({"a.weight": {"dtype": "Q4_K", "shape": [8, 4], "data_offsets": [0, 64]}}, b"\0" * 64,
         None, ["'a.weight'", "unknown dtype 'Q4_K'"]),
    ],
)  # fmt: skip
def test_malformed_safetensors(inputs, tmp_path, capsys, header, data, length, fragments):
    base, tasks = inputs
    path = _break_task(tasks, header, data, length)
    out = tmp_path / "out"
    command_refused(capsys, merge_argv(base, tasks, out), out, str(path), *fragments)
    assert not out.exists()


def test_tensor_in_two_shards(inputs, tmp_path, capsys):
    base, tasks = inputs
    state = load_checkpoint(tasks[0])
    save_checkpoint(state, tasks[0], max_shard_bytes=64)
    index_path = tasks[0] / "model.safetensors.index.json"
    files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    (tasks[0] / "model.safetensors").unlink(missing_ok=True)
    extra = {"a.weight": state["a.weight"], "b.weight": state["b.weight"]}
    save_checkpoint(extra, tmp_path / "dup")
    os.replace(tmp_path / "dup" / "model.safetensors", tasks[0] / files[-1])
    out = tmp_path / "out"
    command_refused(capsys, merge_argv(base, tasks, out), out, "task 1", "appears in both")


# 7. name and shape mismatches
def test_names_and_shapes_must_match(inputs, tmp_path, capsys):
    base, tasks = inputs
    out = tmp_path / "out"
    state = load_checkpoint(tasks[0])
    task_file = str(tasks[0] / "model.safetensors")
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    save_checkpoint({"a.weight": state["a.weight"]}, tasks[0])
    command_refused(
        capsys, merge_argv(base, tasks, out), out, f"task 1 ({tasks[0]}) has no tensor 'b.weight'",
        f"base model ({base}), file {base / index['b.weight']}",
    )  # fmt: skip
    save_checkpoint(state | {"c": torch.zeros(2)}, tasks[0])
    command_refused(capsys, merge_argv(base, tasks, out), out, f"file {task_file} holds tensor 'c'")
    save_checkpoint(state | {"b.weight": torch.zeros(3, 2, dtype=torch.bfloat16)}, tasks[0])
    command_refused(
        capsys, merge_argv(base, tasks, out), out, "tensor 'b.weight': shape [3, 2] in task 1",
        task_file, "differs from [6] in base model", str(base / index["b.weight"]),
    )  # fmt: skip


# 8. task count, duplicates, the base as a task
def test_task_list_mistakes(inputs, tmp_path, capsys):
    base, tasks = inputs
    out = tmp_path / "out"
    command_refused(
        capsys,
        merge_argv(base, tasks[:1], out),
        out,
        "ram_plus merges two or more task models with the base; got 1",
    )
    command_refused(
        capsys, merge_argv(base, [tasks[0], tasks[0]], out), out, "task 1 and task 2 are the same"
    )
    command_refused(
        capsys, merge_argv(base, [tasks[0], base], out), out, "task 2", "is the base model"
    )


# 9. pickle checkpoints are refused unopened
def test_pickle_checkpoints_are_never_opened(inputs, tmp_path, capsys):
    base, tasks = inputs
    out = tmp_path / "out"
    for name in ("pytorch_model.bin", "weights.pt", "model.pth"):
        # The file does not even exist: the refusal comes from its name, before any open.
        command_refused(
            capsys, merge_argv(base, [tasks[0], tmp_path / name], out), out, "pickle", "safetensors"
        )
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 not unpickled")
    command_refused(
        capsys, merge_argv(base, [tasks[0], folder], out), out, "pytorch_model.bin", "convert"
    )


# 10. NaN and Inf are counted in the reduce pass
def test_nonfinite_values_stop_the_job_unless_allowed(inputs, tmp_path, capsys):
    base, tasks = inputs
    state = load_checkpoint(tasks[1])
    state["a.weight"][0, :3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    save_checkpoint(state, tasks[1])
    out = tmp_path / "out"
    err = command_refused(
        capsys, merge_argv(base, tasks, out), out, "tensor 'a.weight': 3 NaN/Inf in task 2"
    )
    assert str(tasks[1] / "model.safetensors") in err and "--allow-nonfinite" in err
    assert not out.exists()
    # also without a statistics round, and on the eager path (torch.isfinite)
    for method in ("ram_plus", "task_arithmetic"):
        for kernels in ("auto", "eager"):
            argv = merge_argv(base, tasks, out, "--method", method, "--kernels", kernels)
            assert main([*argv, "--overwrite"]) == 2
            assert "tensor 'a.weight': 3 NaN/Inf in task 2" in capsys.readouterr().err
    assert main(merge_argv(base, tasks, out, "--allow-nonfinite")) == 0
    assert (out / "model.safetensors.index.json").exists()


# 11. outputs that would harm an input, that hold another model, or that cannot be written
def test_output_location_mistakes(inputs, tmp_path, capsys):
    base, tasks = inputs
    command_refused(
        capsys, merge_argv(base, tasks, tasks[0]), tasks[0] / "x", "is or lies inside task 1"
    )
    command_refused(
        capsys, merge_argv(base, tasks, base / "merged"), base / "merged", "lies inside base model"
    )
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"someone else's model")
    command_refused(
        capsys, merge_argv(base, tasks, other), tmp_path / "none", "already holds files"
    )
    assert (other / "model.safetensors").read_bytes() == b"someone else's model"
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    command_refused(
        capsys, merge_argv(base, tasks, blocker / "out"), blocker / "out", "cannot be written"
    )


def test_output_holding_another_finished_merge(inputs, tmp_path, capsys):
    base, tasks = inputs
    out = tmp_path / "out"
    assert main(merge_argv(base, tasks, out)) == 0
    capsys.readouterr()
    before = (out / "model.safetensors.index.json").read_bytes()
    err = command_refused(
        capsys, merge_argv(base, tasks, out, "--alpha", "1.5"), tmp_path / "none", "alpha"
    )
    assert "2.0 -> 1.5" in err
    assert (out / "model.safetensors.index.json").read_bytes() == before


# 12. parameters out of range
@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--eps", "0"], "epsilon (eps) must be > 0"),
        (["--eps=-1e-5"], "epsilon (eps) must be > 0"),
        (["--r", "-0.1"], "r must be >= 0"),
        (["--alpha", "-1"], "alpha must be >= 0"),
        (["--method", "ties", "--density", "0"], "density must be in (0, 1]"),
        (["--method", "dare_ties", "--density", "1.01"], "density must be in (0, 1]"),
        (["--out-dtype", "int8"], "not a floating dtype"),
        (["--method", "frankenmerge"], "merge method 'frankenmerge'; valid methods: arcee_fusion"),
        (["--weight", "1", "--weight", "2", "--weight", "3"], "--weight given 3 times for 2"),
        (["--method", "ram", "--density", "0.5"], "method ram has no per-model parameter"),
        (["--unit-mb", "0"], "--unit-mb must be positive"),
    ],
)
def test_parameters_out_of_range(inputs, tmp_path, capsys, flags, fragment):
    base, tasks = inputs
    out = tmp_path / "out"
    command_refused(capsys, merge_argv(base, tasks, out, *flags), out, fragment)
    assert not out.exists()


# 13. secrets stay out of logs, reports, manifests and errors
def test_storage_options_never_leave_the_process(inputs, tmp_path, capsys):
    base, tasks = inputs
    options = json.dumps({"s3": {"key": SECRET_KEY, "secret": SECRET}})
    out = tmp_path / "out"
    err = command_refused(
        capsys, merge_argv(base, [tasks[0]], out, "--storage-options", options), out, "two or more"
    )
    assert main(merge_argv(base, tasks, out, "--storage-options", options)) == 0
    captured = capsys.readouterr()
    written = "".join(p.read_text() for p in out.iterdir() if p.suffix in (".json", ".yml"))
    for text in (err, captured.out, captured.err, written):
        assert SECRET not in text and SECRET_KEY not in text
