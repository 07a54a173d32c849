"""`ram-dist verify`: a finished output's shards are checked against its manifest, part by
part; a corrupted part and a missing shard are named, with exit status 1."""

from __future__ import annotations

import json

import pytest
from builders import build_model_set

from ram_dist.cli import main


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    base_dir, task_dirs, _, _ = build_model_set(root, base_shard="100KB", task_shard=70_000)
    return {"base": base_dir, "tasks": task_dirs}


def _args(models: dict, out: str, *extra: str) -> list[str]:
    args = ["merge", "--base", str(models["base"]), "--out", out, *extra]
    for t in models["tasks"]:
        args += ["--task", str(t)]
    return args


def test_verify_names_corrupted_and_missing_shards(models, tmp_path, capsys, ray_local):
    out = tmp_path / "out"
    assert main(_args(models, str(out), "--unit-mb", "1")) == 0
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0
    assert "3 shard(s) match the manifest" in capsys.readouterr().out
    names = json.loads((out / "ram_dist_manifest.json").read_text())["shard_names"]
    data = bytearray((out / names[1]).read_bytes())
    data[-3] ^= 0xFF
    (out / names[1]).write_bytes(bytes(data))
    (out / names[2]).unlink()
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr().err
    # The last part of shard 2 (its digest defined from its parts) is named, not the others.
    parts = json.loads((out / "ram_dist_manifest.json").read_text())["shards"][names[1]]["parts"]
    last = f"part {len(parts)} (bytes {parts[-1]['start']} to {parts[-1]['stop']}) has sha256"
    assert f"shard {names[1]}: {last}" in err and "the manifest says" in err
    assert f"shard {names[1]}: part 1 " not in err or len(parts) == 1
    assert f"shard {names[2]}: missing" in err
    assert names[0] not in err
