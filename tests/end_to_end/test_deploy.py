"""Deployment recipes (jobs/, k8s/): manifests validate offline, every entrypoint parses with the
CLI's own parser, the image recipe installs this package, and a real `ray job submit` merges.

The job-submission tests start their own Ray head (job server on 127.0.0.1, token auth, its
own temp dir) in a subprocess and stop exactly that head afterwards. The head runs a Python of
its own, as a cluster's image has one: a bare venv in its temp dir that sees this environment's
packages (a `.pth` file adds its site-packages), so that the pip plugin of the jobs' runtime
env clones that venv (a few files) rather than this whole environment (GBs), and installs
nothing: the cluster's Python satisfies every requirement.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import importlib.util
import io
import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from builders import build_model_set, load_checkpoint
from reference import reference_merge

from ram_dist.api import MergeReport
from ram_dist.cli import build_parser, config_from_args
from ram_dist.errors import RamDistError
from ram_dist.planning.config import MergeConfig, load_yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
JOBS = REPO / "jobs"
K8S = REPO / "k8s"
CRD_DIR = REPO.parent / "shared" / "k8s-crds"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
#: Kubernetes versions the built-in kinds must validate against: the oldest we document
#: (CronJob timeZone is GA from 1.27) and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.29", "latest")
#: KubeRay's limit (MaxRayClusterNameLength 53 minus the 6 characters of the cluster suffix).
MAX_RAYJOB_NAME = 47
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: Characters that a shell would act on: KubeRay pastes `entrypoint` into `bash -c` unquoted.
SHELL_ACTIVE = set("'\"$`\\;&|<>(){}*?!#~")
CLI_MODULE = ["python", "-m", "ram_dist.cli"]


# --------------------------------------------------------------------------------------------
# Capabilities of the ram-dist under test (storage options came with S3 support)


def _merge_accepts(*args: str) -> bool:
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args(["merge", "config.yaml", *args])
        except SystemExit:
            return False
    return True


HAS_STORAGE = _merge_accepts("--storage-options", "{}")
needs_storage = pytest.mark.skipif(
    not HAS_STORAGE,
    reason="ram-dist merge has no --storage-options / YAML storage_options yet (S3 support)",
)


# --------------------------------------------------------------------------------------------
# Reading the recipes


#: libyaml's loader when PyYAML has it: the KubeRay CRDs are 3 MB of YAML.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.load_all(path.read_text(), Loader=SAFE_LOADER) if d]


def _manifests() -> list[tuple[str, dict]]:
    """(label, object) for every object in k8s/*.yaml and every manifest a ConfigMap carries
    (the legacy CronJob's RayJob template)."""
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        for i, doc in enumerate(_docs(path)):
            label = f"{path.name}#{i}:{doc.get('kind')}"
            found.append((label, doc))
            if doc.get("kind") == "ConfigMap":
                for key, text in (doc.get("data") or {}).items():
                    inner = yaml.safe_load(text) if key.endswith((".yaml", ".yml")) else None
                    if isinstance(inner, dict) and "apiVersion" in inner and "kind" in inner:
                        found.append((f"{label}/{key}:{inner['kind']}", inner))
    return found


MANIFESTS = _manifests()


def _of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in MANIFESTS if doc["kind"] == kind]


def _one(kind: str, name: str | None = None) -> dict:
    docs = [d for d in _of_kind(kind) if name is None or d["metadata"].get("name") == name]
    assert len(docs) == 1, f"expected one {kind} {name or ''}, found {len(docs)}"
    return docs[0]


def _rayjob_specs() -> list[tuple[str, dict]]:
    """Every RayJob spec: RayJobs (also the legacy template) and RayCronJob job templates."""
    specs = [(label, doc["spec"]) for label, doc in MANIFESTS if doc["kind"] == "RayJob"]
    specs += [
        (label, doc["spec"]["jobTemplate"])
        for label, doc in MANIFESTS
        if doc["kind"] == "RayCronJob"
    ]
    return specs


def _entrypoints() -> list[tuple[str, str]]:
    """(where, command) for every entrypoint in the manifests, and every `ray job submit` (the
    part after `--`) or ram-dist command in the deploy docs and comments."""
    found = [(f"k8s:{label}", spec["entrypoint"]) for label, spec in _rayjob_specs()]
    for name, command in _doc_commands():
        words = shlex.split(command, comments=True)
        if words[:3] == ["ray", "job", "submit"] and "--" in words:
            found.append((f"{name}:submit", shlex.join(words[words.index("--") + 1 :])))
        elif words[:3] == CLI_MODULE or words[:1] == ["ram-dist"]:
            found.append((f"{name}:cli", command))
    return found


PROGRAMS = ("ray ", "python ", "ram-dist ", "kubectl ", "docker ", "aws ", "export ")


def _shell_commands(text: str, markdown: bool = True) -> list[str]:
    """Commands in a Markdown file's ```bash blocks, or in a YAML file's comments (lines that
    start with a known program); backslash continuations joined."""
    if markdown:
        lines, in_block = [], False
        for line in text.splitlines():
            if line.startswith("```"):
                in_block = line.strip() == "```bash"
            elif in_block:
                lines.append(line.strip())
    else:
        # Comment lines; a command is indented past the prose (`#   kubectl apply ...`).
        lines = [
            comment if comment.startswith("  ") else "#" + comment
            for line in text.splitlines()
            if line.lstrip().startswith("#")
            for comment in [line.lstrip()[1:]]
        ]
    commands, current = [], None
    for line in lines:
        line = line.strip() if current is not None or not line.startswith("#") else ""
        if current is None:
            if not line or not (markdown or line.startswith(PROGRAMS)):
                continue
            current = ""
        current += line
        if current.endswith("\\"):
            current = current[:-1].rstrip() + " "
            continue
        commands.append(current)
        current = None
    return commands


def _doc_commands() -> list[tuple[str, str]]:
    """(file, command) for the commands of k8s/README.md and of the comments in jobs/, k8s/."""
    found = [("README.md", c) for c in _shell_commands((K8S / "README.md").read_text())]
    for path in sorted([*JOBS.glob("*.yaml"), *K8S.glob("*.yaml"), K8S / "Dockerfile"]):
        found += [(path.name, c) for c in _shell_commands(path.read_text(), markdown=False)]
    return found


def _nightly_module():
    spec = importlib.util.spec_from_file_location("ram_dist_nightly", JOBS / "nightly.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nightly = _nightly_module()


# --------------------------------------------------------------------------------------------
# Custom resources against KubeRay's CRDs


def _crd_schemas() -> dict[tuple[str, str], dict]:
    """{(apiVersion, kind): strict openAPIV3Schema of version v1} from ../shared/k8s-crds."""
    schemas = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for crd in _docs(path):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                if version["name"] == "v1":
                    key = (f"{spec['group']}/v1", spec["names"]["kind"])
                    schemas[key] = _strict(version["schema"]["openAPIV3Schema"])
    return schemas


def _strict(schema: Any) -> Any:
    """An openAPIV3Schema as JSON Schema, with unknown fields rejected as `kubectl apply
    --validate=strict` rejects them (the API server would otherwise drop them silently)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [_strict(s) for s in out[key]]
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


@pytest.fixture(scope="module")
def crd_schemas() -> dict[tuple[str, str], dict]:
    if not CRD_DIR.is_dir():
        why = f"KubeRay CRDs not found at {CRD_DIR} (the shared/ folder beside the repo)"
        if os.environ.get("CI", "").lower() in ("true", "1"):  # CI has it: a loud failure
            pytest.fail(why)
        pytest.skip(why)
    return _crd_schemas()


def _crd_errors(doc: dict, schemas: dict) -> list[str]:
    import jsonschema

    key = (doc["apiVersion"], doc["kind"])
    assert key in schemas, f"no CRD for {key} in {CRD_DIR}"
    validator = jsonschema.Draft202012Validator(schemas[key])
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(doc)
    ]


CUSTOM = [(label, doc) for label, doc in MANIFESTS if doc["apiVersion"].startswith("ray.io/")]
BUILTIN = [(label, doc) for label, doc in MANIFESTS if not doc["apiVersion"].startswith("ray.io/")]


def test_the_recipes_hold_every_piece():
    kinds = {doc["kind"] for _, doc in MANIFESTS}
    assert {"RayJob", "RayCronJob", "CronJob", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    assert {"ConfigMap", "Secret"} <= kinds
    assert all(doc["apiVersion"] == "ray.io/v1" for _, doc in CUSTOM)


@pytest.mark.parametrize("label,doc", CUSTOM, ids=[label for label, _ in CUSTOM])
def test_custom_resource_matches_kuberay_crd(label, doc, crd_schemas):
    pytest.importorskip("jsonschema")
    assert _crd_errors(doc, crd_schemas) == []


def test_crd_validation_rejects_a_misspelled_field(crd_schemas):
    pytest.importorskip("jsonschema")
    doc = copy.deepcopy(_one("RayJob", "ram-dist-merge"))
    doc["spec"]["shutdownAfterJobFinish"] = doc["spec"].pop("shutdownAfterJobFinishes")
    doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "four"
    errors = _crd_errors(doc, crd_schemas)
    assert any("shutdownAfterJobFinish" in e for e in errors), errors
    assert any("replicas" in e for e in errors), errors


# --------------------------------------------------------------------------------------------
# Built-in kinds against Kubernetes' schemas (kubernetes-validate ships them: offline)


def _k8s_validate(doc: dict, version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(doc, kv.latest_version() if version == "latest" else version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("label,doc", BUILTIN, ids=[label for label, _ in BUILTIN])
def test_builtin_kind_matches_kubernetes_schema(label, doc, version):
    _k8s_validate(doc, version)


def test_kubernetes_validation_rejects_a_misspelled_field():
    kv = pytest.importorskip("kubernetes_validate")
    doc = copy.deepcopy(_one("CronJob"))
    doc["spec"]["concurrencyPolicyy"] = doc["spec"].pop("concurrencyPolicy")
    with pytest.raises(kv.ValidationError):
        _k8s_validate(doc, "latest")


# --------------------------------------------------------------------------------------------
# What KubeRay's webhook/controller checks beyond the schema, and what ties the pieces together


@pytest.mark.parametrize("label,spec", _rayjob_specs(), ids=[lb for lb, _ in _rayjob_specs()])
def test_rayjob_spec_passes_kuberay_rules_and_fits_the_pieces(label, spec):
    # KubeRay's ValidateRayJobSpec (v1.7): these fail the RayJob at admission or reconcile.
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] >= 0
    assert spec["activeDeadlineSeconds"] > 0
    assert spec["backoffLimit"] >= 0
    assert spec.get("submissionMode", "K8sJobMode") == "K8sJobMode"
    cluster = spec["rayClusterSpec"]
    assert _version_tuple(cluster["rayVersion"]) >= (2, 52), "authOptions token needs Ray 2.52"
    assert cluster["authOptions"] == {"mode": "token"}
    assert cluster["rayVersion"] == _dockerfile()["args"]["RAY_VERSION"]

    head = cluster["headGroupSpec"]
    head_pod = head["template"]["spec"]
    (head_container,) = head_pod["containers"]
    workers = cluster["workerGroupSpecs"]
    assert len(workers) == 1
    worker = workers[0]
    (worker_container,) = worker["template"]["spec"]["containers"]
    for group in (head, worker):
        params = group["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values())
        # Resources are declared once: in rayStartParams or in the group's `resources`.
        if {"num-cpus", "num-gpus", "memory", "resources"} & set(params):
            assert not group.get("resources")
        assert "labels" not in params  # KubeRay wants the group's `labels` field instead
    assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]

    # GPU workers; the head runs the driver only.
    assert worker_container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in head_container["resources"].get("limits", {})
    assert head["rayStartParams"].get("num-cpus") == "0"
    for container in (head_container, worker_container):
        resources = container["resources"]
        assert resources["requests"]["cpu"] and resources["requests"]["memory"]
        assert _image_tag(container["image"]) == ("ram-dist", VERSION)
        # Bucket credentials from the Secret, by reference.
        assert {"secretRef": {"name": _one("Secret")["metadata"]["name"]}} in container["envFrom"]

    # The merge config: the ConfigMap, mounted where the entrypoint reads it.
    config_path = _config_path(spec["entrypoint"])
    volume_of = {v["name"]: v for v in head_pod["volumes"]}
    mounts = [m for m in head_container["volumeMounts"] if config_path.startswith(m["mountPath"])]
    assert len(mounts) == 1, f"{config_path} is not on a mounted volume"
    config_map = volume_of[mounts[0]["name"]]["configMap"]["name"]
    key = config_path[len(mounts[0]["mountPath"]) :].lstrip("/")
    assert key in _one("ConfigMap", config_map)["data"]


def test_every_kuberay_name_fits():
    for kind in ("RayJob", "RayCronJob"):
        for doc in _of_kind(kind):
            name = doc["metadata"].get("name") or doc["metadata"]["generateName"] + "xxxxx"
            assert DNS1035.match(name) and len(name) <= MAX_RAYJOB_NAME, name


def test_schedules_are_nightly_cron_expressions():
    for doc in _of_kind("RayCronJob") + _of_kind("CronJob"):
        fields = doc["spec"]["schedule"].split()
        assert len(fields) == 5 and fields[2:] == ["*", "*", "*"], doc["spec"]["schedule"]
        assert doc["spec"]["timeZone"] == "Etc/UTC"  # the clock of nightly.py's run id


def test_copies_of_the_nightly_job_agree():
    """The cluster spec is written out three times (RayJob, RayCronJob, legacy template)."""
    rayjob = _one("RayJob", "ram-dist-merge")["spec"]
    cron = _one("RayCronJob")["spec"]["jobTemplate"]
    (legacy,) = [d["spec"] for d in _of_kind("RayJob") if "generateName" in d["metadata"]]
    assert cron["rayClusterSpec"] == rayjob["rayClusterSpec"] == legacy["rayClusterSpec"]
    assert cron == legacy


def test_legacy_cronjob_creates_the_template_with_only_that_right():
    cronjob = _one("CronJob")
    pod = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][:3] == ["kubectl", "create", "-f"]
    template_path = container["command"][3]
    mount = next(m for m in container["volumeMounts"] if template_path.startswith(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = _one("ConfigMap", volume["configMap"]["name"])
    assert Path(template_path).name in config_map["data"]

    account = pod["serviceAccountName"]
    assert _one("ServiceAccount", account)
    binding = _one("RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = _one("Role", binding["roleRef"]["name"])
    assert role["rules"] == [
        {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["create"]}
    ]


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _image_tag(image: str) -> tuple[str, str]:
    repository, _, tag = image.rpartition(":")
    return repository.rsplit("/", 1)[-1], tag


# --------------------------------------------------------------------------------------------
# Entrypoints against the CLI's own parser


def _config_path(entrypoint: str) -> str:
    return _parse_entrypoint(entrypoint)[1].config


def _parse_entrypoint(entrypoint: str) -> tuple[list[str], Any]:
    """(merge argv, argparse namespace) of an entrypoint, through the parser of what it runs:
    ram-dist's CLI (`python -m ram_dist.cli`, `ram-dist`) or jobs/nightly.py."""
    words = shlex.split(entrypoint)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            if words[:3] == CLI_MODULE:
                argv = words[3:]
            elif words[:1] == ["ram-dist"]:
                argv = words[1:]
            elif words[:1] == ["python"] and words[1:2] and words[1].endswith("jobs/nightly.py"):
                ours, rest = nightly.split_args(words[2:])
                run_id = nightly.run_id_of(ours.run_id)
                argv = nightly.merge_argv(rest, f"{ours.out_root.rstrip('/')}/{run_id}")
            else:
                raise AssertionError(f"unknown entrypoint program: {entrypoint!r}")
            args = build_parser().parse_args(argv)
        except SystemExit:
            raise AssertionError(f"rejected: {entrypoint!r}: {err.getvalue()}") from None
    return argv, args


def _needs(entrypoint: str) -> list:
    return [needs_storage] if "--storage-options" in entrypoint else []


ENTRYPOINTS = [pytest.param(cmd, id=where, marks=_needs(cmd)) for where, cmd in _entrypoints()]


def test_entrypoints_were_found():
    where = [w for w, _ in _entrypoints()]
    assert sum(w.startswith("k8s:") for w in where) == 3
    assert sum(w == "README.md:submit" for w in where) == 2
    assert "runtime_env.yaml:submit" in where and "merge-s3.yaml:cli" in where


@pytest.mark.parametrize("entrypoint", ENTRYPOINTS)
def test_entrypoint_parses_with_the_cli_parser(entrypoint):
    argv, args = _parse_entrypoint(entrypoint)
    assert args.command == "merge"
    assert args.config and (args.out or args.out_positional), argv
    config = args.config
    assert config.startswith("/etc/ram-dist/") or (REPO / config).is_file(), config


@pytest.mark.parametrize("label,spec", _rayjob_specs(), ids=[lb for lb, _ in _rayjob_specs()])
def test_manifest_entrypoint_survives_kuberay_shell(label, spec):
    """KubeRay runs `ray job submit ... -- <entrypoint>` in bash, unquoted: nothing in it may
    mean something to the shell, or the job would run another command line."""
    assert not SHELL_ACTIVE & set(spec["entrypoint"]), spec["entrypoint"]
    assert "\n" not in spec["entrypoint"]


@needs_storage
@pytest.mark.parametrize("label,spec", _rayjob_specs(), ids=[lb for lb, _ in _rayjob_specs()])
def test_manifest_entrypoint_and_configmap_make_a_valid_job(label, spec, tmp_path):
    """The entrypoint with the mounted config builds the job ram-dist would run."""
    argv, args = _parse_entrypoint(spec["entrypoint"])
    config_map = _one("ConfigMap", "ram-dist-merge-config")
    local = tmp_path / "merge.yaml"
    local.write_text(config_map["data"][Path(args.config).name])
    args.config = str(local)
    job = config_from_args(args)
    assert job.out.startswith("s3://") and job.base.startswith("s3://")
    assert len(job.tasks) == 3 and all(t.startswith("s3://") for t in job.tasks)
    assert job.unit_budget_bytes == 256 * 2**20


@needs_storage
@pytest.mark.parametrize("path", ["jobs/merge-s3.yaml", "k8s/configmap.yaml"])
def test_example_configs_load(path, tmp_path):
    if path.endswith("configmap.yaml"):
        local = tmp_path / "merge.yaml"
        local.write_text(_one("ConfigMap", "ram-dist-merge-config")["data"]["merge.yaml"])
        path = str(local)
    kwargs = load_yaml(str(REPO / path))
    assert kwargs["base"].startswith("s3://") and len(kwargs["tasks"]) == 3
    assert set(kwargs["storage_options"]) == {"s3"}


def test_configmap_config_is_the_example_config():
    example = yaml.safe_load((JOBS / "merge-s3.yaml").read_text())
    mounted = yaml.safe_load(_one("ConfigMap", "ram-dist-merge-config")["data"]["merge.yaml"])
    assert mounted == example
    assert example["merge_method"] == "ram_plus" and example["out_dtype"] == "bfloat16"
    assert set(example["parameters"]) == {"r", "alpha", "epsilon"}
    assert [m["model"] for m in example["models"]] and example["base_model"].startswith("s3://")


# --------------------------------------------------------------------------------------------
# The runtime env and the image recipe install this package


def _runtime_env() -> dict:
    return yaml.safe_load((JOBS / "runtime_env.yaml").read_text())


def _requirement_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[@]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_runtime_env_installs_the_package_dependencies():
    env = _runtime_env()
    wanted = [r for r in PYPROJECT["project"]["dependencies"] if _requirement_name(r) != "ray"]
    assert sorted(env["pip"]["packages"]) == sorted(wanted), "keep in step with pyproject.toml"
    # The package itself comes from --working-dir (or the image), never from a local path.
    assert "working_dir" not in env and "py_modules" not in env
    assert not any("file:" in p or p.startswith(("-e", ".", "/")) for p in env["pip"]["packages"])
    kept = [e for e in env["excludes"] if e.strip("/") in {"ram_dist", "jobs", "pyproject.toml"}]
    assert kept == [], "the upload must keep ram_dist/ and jobs/"


def _dockerfile() -> dict:
    """ARG defaults, the FROM image (ARGs expanded), COPY sources/destinations, RUN lines,
    LABELs, and every (instruction, arguments) in order, from k8s/Dockerfile (continuation
    lines joined)."""
    text = (K8S / "Dockerfile").read_text()
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            logical.append(current.strip())
            current = ""
    out: dict[str, Any] = {"args": {}, "from": None, "copies": [], "runs": [], "labels": {}}
    out["steps"] = []
    for line in logical:
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        out["steps"].append((instruction, rest))
        if instruction == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            out["args"].setdefault(name, default)
        elif instruction == "FROM":
            out["from"] = re.sub(r"\$\{(\w+)\}", lambda m: out["args"][m[1]], rest.split()[0])
        elif instruction == "COPY":
            words = [w for w in shlex.split(rest) if not w.startswith("--")]
            out["copies"].append((words[:-1], words[-1]))
        elif instruction == "RUN":
            out["runs"].append(rest)
        elif instruction == "LABEL":
            out["labels"].update(dict(w.split("=", 1) for w in shlex.split(rest)))
    return out


def test_image_recipe_installs_this_package_at_the_version_the_manifests_call():
    docker = _dockerfile()
    base = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py3(\d+)-(gpu|cu\d+)", docker["from"])
    assert base, f"not a Ray GPU base image: {docker['from']}"
    ray_version, python_minor = base[1], int(base[2])
    # The base image's Ray and Python satisfy the package's requirements.
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    assert f"3.{python_minor}" in SpecifierSet(PYPROJECT["project"]["requires-python"])
    (ray_req,) = [
        Requirement(r)
        for r in PYPROJECT["project"]["dependencies"]
        if _requirement_name(r) == "ray"
    ]
    assert ray_version in ray_req.specifier
    # It copies this checkout's package (pyproject.toml, its readme, the package, jobs/) ...
    copied = {src.rstrip("/"): dest for srcs, dest in docker["copies"] for src in srcs}
    package_dir = copied["pyproject.toml"].rstrip("/")
    assert copied[PYPROJECT["project"]["readme"]].rstrip("/") == package_dir
    assert copied["ram_dist"] == f"{package_dir}/ram_dist"
    assert copied["jobs"] == f"{package_dir}/jobs"
    # ... and pip-installs that directory, not a release from an index.
    install = next(r for r in docker["runs"] if "pip install" in r)
    assert package_dir in shlex.split(install), install
    assert "ram-dist==" not in install and "ram_dist==" not in install
    assert docker["labels"]["org.opencontainers.image.version"] == VERSION
    assert docker["labels"]["org.opencontainers.image.title"] == PYPROJECT["project"]["name"]
    # The context carries what the COPY lines need (k8s/Dockerfile.dockerignore).
    ignore = (K8S / "Dockerfile.dockerignore").read_text().split()
    for needed in copied:
        assert f"!{needed}" in ignore or f"!{needed}/" in ignore, needed

    # Every image a manifest runs is this package at this version, on this Ray.
    for label, spec in _rayjob_specs():
        cluster = spec["rayClusterSpec"]
        assert cluster["rayVersion"] == ray_version, label
        # The entrypoint runs a program the image provides.
        words = shlex.split(spec["entrypoint"])
        if words[:3] == CLI_MODULE:
            main = REPO / "ram_dist" / "cli" / "__main__.py"
            assert 'if __name__ == "__main__":' in main.read_text()
        elif words[:1] == ["ram-dist"]:
            assert PYPROJECT["project"]["scripts"]["ram-dist"] == "ram_dist.cli:run"
        else:
            script = Path(words[1])
            assert script.parent == Path(copied["jobs"]), (label, script)
            assert (JOBS / script.name).is_file()
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    assert "ram_dist*" in include


def test_image_warms_the_kernels_it_installed():
    """After the install, the image compiles the fused kernels into numba's cache beside the
    installed package (not a cache directory of its own), as the user its pods run as."""
    from ram_dist.kernels import warm

    steps = _dockerfile()["steps"]
    commands = [
        (i, shlex.split(part))
        for i, (instruction, rest) in enumerate(steps)
        if instruction == "RUN"
        for part in rest.split("&&")
    ]
    install = next(i for i, words in commands if words[:2] == ["pip", "install"])
    (step, words), *others = [
        (i, w) for i, w in commands if w[:3] == ["python", "-m", warm.__name__]
    ]
    assert not others and step > install, "warm the kernels once, after installing them"
    # Every kernel (one signature each, whatever the dtypes and task count), into numba's
    # default place.
    args = warm.build_parser().parse_args(words[3:])
    assert args.cache_dir is None
    assert not any("NUMBA_CACHE_DIR" in rest for _, rest in steps)
    # Written as the user that owns site-packages and that the pods run as (the last USER).
    users = [
        (i, rest.strip()) for i, (instruction, rest) in enumerate(steps) if instruction == "USER"
    ]
    assert [user for i, user in users if i < step][-1] == users[-1][1] == "ray"


def test_docs_build_and_run_the_version_the_manifests_call():
    commands = _shell_commands((K8S / "README.md").read_text())
    builds = [shlex.split(c) for c in commands if c.startswith("docker build")]
    assert builds, "k8s/README.md lost its docker build command"
    for words in builds:
        assert words[words.index("-f") + 1] == "k8s/Dockerfile" and words[-1] == "."
        assert _image_tag(words[words.index("-t") + 1]) == ("ram-dist", VERSION)
    for _, command in _doc_commands():
        words = shlex.split(command, comments=True)
        if words[:2] == ["kubectl", "apply"]:
            files = [words[i + 1] for i, w in enumerate(words) if w == "-f"]
            assert files and all((REPO / f).is_file() for f in files), command
        if words[:3] == ["ray", "job", "submit"]:
            assert words[words.index("--working-dir") + 1] == "."
            assert words[words.index("--runtime-env") + 1] == "jobs/runtime_env.yaml"


# --------------------------------------------------------------------------------------------
# jobs/nightly.py decisions, without Ray (the merge is replaced by a stand-in)


@pytest.fixture
def nightly_job(tmp_path, monkeypatch):
    """A config whose merge is a stand-in for `ram_dist.api.run_merge` that writes a complete
    output and records the job it was given."""
    config = tmp_path / "merge.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "merge_method": "ram_plus",
                "base_model": str(tmp_path / "base"),
                "models": [{"model": str(tmp_path / "t1")}, {"model": str(tmp_path / "t2")}],
            }
        )
    )
    calls: list[MergeConfig] = []

    def fake_merge(config):
        calls.append(config)
        out = Path(config.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "merge_report.json").write_text("{}")
        report = {
            "method": config.method,
            "passes": {"reduce": {"wall_s": 0.5}, "map": {"wall_s": 0.25, "bytes_written": 7}},
            "output": {"url": config.out, "shards_reused": [], "shards_written": ["x"]},
        }
        return MergeReport.of(report, config)

    monkeypatch.setattr(nightly, "run_merge", fake_merge)
    monkeypatch.delenv(nightly.RUN_ID_ENV, raising=False)
    root = tmp_path / "merged"
    return config, root, calls


def _latest(root: Path) -> str:
    return (root / "latest").read_text()


def test_nightly_merges_into_the_run_folder_then_moves_latest(nightly_job, capsys):
    config, root, calls = nightly_job
    assert nightly.main([str(config), "--out-root", str(root), "--run-id", "2026-01-30"]) == 0
    [job] = calls  # the config's job, into the run's folder
    assert job.tasks == (str(config.parent / "t1"), str(config.parent / "t2"))
    assert (job.method, job.out, job.overwrite) == ("ram_plus", f"{root}/2026-01-30", False)
    printed = capsys.readouterr().out
    assert f"merged model written to {root}/2026-01-30 (reduce 0.50 s, map 0.25 s" in printed
    assert _latest(root) == f"{root}/2026-01-30\n"
    # The default run id is today's UTC date.
    assert nightly.run_id_of(None) == dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    # Storage options go to the merge as given, but never into the log (they may hold keys).
    secret = '{"s3": {"secret": "do-not-log"}}'
    argv = [str(config), "--out-root", str(root), "--run-id", "2026-01-31"]
    assert nightly.main([*argv, "--storage-options", secret, "--unit-mb", "2"]) == 0
    assert calls[-1].storage_options == {"s3": {"secret": "do-not-log"}}
    assert calls[-1].unit_budget_bytes == 2 * 2**20
    assert "do-not-log" not in capsys.readouterr().out


def test_nightly_reruns_on_the_same_prefix_so_ram_dist_resumes(nightly_job, capsys):
    """A complete or partial output is handed to `ram-dist merge` as it is (it resumes, or
    does nothing): never --overwrite, which would discard finished shards."""
    config, root, calls = nightly_job
    done = root / "2026-01-30"
    done.mkdir(parents=True)
    (done / "model.safetensors").write_bytes(b"w")
    (done / "merge_report.json").write_text("{}")
    assert nightly.main([str(config), "--out-root", str(root), "--run-id", "2026-01-30"]) == 0
    assert "already complete" in capsys.readouterr().out
    assert _latest(root) == f"{done}\n"

    partial = root / "2026-01-31"
    partial.mkdir()
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"w")
    assert nightly.main([str(config), "--out-root", str(root), "--run-id", "2026-01-31"]) == 0
    assert [c.out for c in calls] == [str(done), str(partial)]
    assert not any(c.overwrite for c in calls)
    assert _latest(root) == f"{partial}\n"


def test_nightly_leaves_latest_after_a_failure_and_never_moves_it_back(
    nightly_job, monkeypatch, capsys
):
    config, root, calls = nightly_job
    root.mkdir()
    (root / "latest").write_text(f"{root}/2026-02-01\n")
    assert nightly.main([str(config), "--out-root", str(root), "--run-id", "2026-01-31"]) == 0
    assert len(calls) == 1 and _latest(root) == f"{root}/2026-02-01\n"  # a backfill

    def refused(config):
        raise RamDistError(f"output {config.out} holds a merge of other inputs")

    monkeypatch.setattr(nightly, "run_merge", refused)
    assert nightly.main([str(config), "--out-root", str(root), "--run-id", "2026-02-02"]) == 2
    printed = capsys.readouterr()
    assert f"nightly.py: error: output {root}/2026-02-02 holds a merge of" in printed.err
    assert "merge failed; latest not moved" in printed.out
    assert _latest(root) == f"{root}/2026-02-01\n"

    def interrupted(config):
        raise KeyboardInterrupt  # Ctrl-C, or SIGTERM as nightly.py maps it

    monkeypatch.setattr(nightly, "run_merge", interrupted)
    assert nightly.main([str(config), "--out-root", str(root), "--run-id", "2026-02-03"]) == 130
    assert _latest(root) == f"{root}/2026-02-01\n"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--run-id", "../up"], "run id"),
        (["--run-id", "latest"], "run id"),
        (["--out", "/elsewhere"], "chooses the output"),
    ],
)
def test_nightly_refuses_bad_arguments(nightly_job, capsys, extra, message):
    config, root, calls = nightly_job
    assert nightly.main([str(config), "--out-root", str(root), *extra]) == 2
    assert message in capsys.readouterr().err and calls == []


# --------------------------------------------------------------------------------------------
# A real job submission to a local Ray head


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_job_server() -> bool:
    """`ray job submit` needs ray[default] (dashboard, and virtualenv for runtime-env pip)."""
    return all(importlib.util.find_spec(m) for m in ("aiohttp_cors", "opencensus", "virtualenv"))


class RayHead:
    """A Ray head started here (`ray start --head --block`) and stopped by its process group."""

    #: `ray start` gives the raylet 30 s to register; on a loaded machine it may not, and
    #: exits: start again, at most this many times in all.
    STARTS = 3

    def __init__(
        self, start: Callable[[], tuple[subprocess.Popen, str]], temp_dir: str, token: str
    ):
        self._start, self.temp_dir, self.token = start, temp_dir, token
        self.proc, self.address = start()
        self.starts = 1
        self.ready = False
        self._preparing: threading.Thread | None = None
        self._prepare_error: BaseException | None = None

    def prepare(self) -> None:
        """Start readying, in a thread, what the jobs below run in: once the job server
        answers, a job that imports ram-dist with their runtime env (`_job_runtime_env`:
        jobs/runtime_env.yaml with this checkout as working dir). Ray builds that env on the
        node (it unpacks the upload and builds the `pip` virtualenv, here a clone of the
        head's bare venv in which pip finds every requirement met) and keeps it for the later
        jobs that use it, as for any user's second submission; meanwhile the tests go on."""
        # Ray's job client imported here rather than first in the thread: an import there
        # changes sys.modules (and Ray's import, os.environ) while the tests' setup may
        # iterate them ("dictionary changed size during iteration").
        import ray.job_submission  # noqa: F401

        self._preparing = threading.Thread(target=self._prepare, daemon=True)
        self._preparing.start()

    def _prepare(self) -> None:
        try:
            self.wait_ready()
            entrypoint = "python -c 'import ram_dist.cli'"
            deadline = time.monotonic() + 60
            while True:
                try:
                    job_id = self.client().submit_job(
                        entrypoint=entrypoint, runtime_env=_job_runtime_env()
                    )
                    break
                except RuntimeError as e:  # the head's agent is not registered yet
                    if "No available agent" not in str(e) or time.monotonic() > deadline:
                        raise
                    time.sleep(1)
            _wait(self, job_id, timeout_s=900)
        except BaseException as e:  # noqa: BLE001 - raised again by `prepared`
            self._prepare_error = e

    def prepared(self) -> None:
        """Until `prepare`'s job has run (when it was started); its failure, raised."""
        if self._preparing is not None:
            self._preparing.join()
        if self._prepare_error is not None:
            raise self._prepare_error

    def wait_ready(self, timeout_s: float = 120) -> None:
        """Until the head has started and its job server answers (the head starts while the
        tests before the jobs run)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if self.proc.poll() is not None:
                if "timed out during startup" in self.log_tail() and self.starts < self.STARTS:
                    _stop(self.proc, self.temp_dir)
                    self.proc, self.address = self._start()
                    self.starts += 1
                    deadline = time.monotonic() + timeout_s
                    continue
                raise RuntimeError(
                    f"ray start exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                self.client().get_version()
                self.ready = "Ray runtime started" in self.log_tail(None)
                if not self.ready:
                    time.sleep(0.5)
            except Exception as e:  # not listening yet
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"no job server after {timeout_s} s:\n{self.log_tail()}"
                    ) from e
                time.sleep(0.5)

    def client(self):
        from ray.job_submission import JobSubmissionClient

        # Explicit bearer header: no change to this process's environment or ~/.ray.
        return JobSubmissionClient(self.address, headers={"Authorization": f"Bearer {self.token}"})

    def cli_env(self) -> dict[str, str]:
        """How a user authenticates `ray job submit`: RAY_AUTH_MODE plus RAY_AUTH_TOKEN."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        return env | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def log_tail(self, chars: int | None = 3000) -> str:
        log = Path(self.temp_dir) / "head.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        return text if chars is None else text[-chars:]


@contextlib.contextmanager
def _ray_head() -> Iterator[RayHead]:
    # A short dir: Ray's unix sockets live under it (107-byte path limit).
    temp_dir = tempfile.mkdtemp(prefix="rd-head-", dir="/tmp")
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0"}
    python = _cluster_python(Path(temp_dir) / "python")
    log = open(Path(temp_dir) / "head.log", "wb")  # noqa: SIM115 - closed in finally

    def start() -> tuple[subprocess.Popen, str]:
        dashboard_port = _free_port()
        cmd = [
            python, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            "--node-ip-address=127.0.0.1", f"--port={_free_port()}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--dashboard-agent-grpc-port={_free_port()}",
            f"--ray-client-server-port={_free_port()}",
            f"--runtime-env-agent-port={_free_port()}",
            f"--metrics-export-port={_free_port()}",
            f"--node-manager-port={_free_port()}",
            f"--object-manager-port={_free_port()}",
            "--num-cpus=2", "--num-gpus=0", f"--object-store-memory={256 * 2**20}",
            "--disable-usage-stats", f"--temp-dir={temp_dir}",
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd, env=env, cwd=temp_dir, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        return proc, f"http://127.0.0.1:{dashboard_port}"

    head = RayHead(start, temp_dir, token)
    try:
        yield head
    finally:
        _stop(head.proc, temp_dir)
        log.close()
        # Ray's session files and the jobs' uploads and virtualenv are under it: delete them
        # in the background rather than hold the test run for it.
        subprocess.Popen(
            ["rm", "-rf", "--one-file-system", temp_dir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )


def _cluster_python(where: Path) -> str:
    """The head's Python: a venv without packages of its own (`python -m venv --without-pip`)
    whose site-packages holds one `.pth` file that adds this environment's site-packages, with
    their own `.pth` files (`site.addsitedir`). Ray's pip plugin derives a job's virtualenv from
    the head's Python: it copies a venv whole (`_clonevirtualenv`), here a few files."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120
    )
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    layout = {"base": str(where), "platbase": str(where)}
    site_packages = Path(sysconfig.get_path("purelib", vars=layout))
    lines = [f"import site; site.addsitedir({path!r})" for path in sorted(ours)]
    (site_packages / "ram_dist_test_parent.pth").write_text("\n".join(lines) + "\n")
    python = str(where / "bin" / "python")
    probe = (
        "import sys, importlib.util as u; print(sys.prefix, all(u.find_spec(m) for m in "
        "('ray', 'torch', 'virtualenv', 'pip')))"
    )
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == [str(where), "True"], done.stderr
    return python


def _stop(proc: subprocess.Popen, temp_dir: str) -> None:
    """Stop this head and everything it started: SIGTERM, then SIGKILL, to the process group
    of our `ray start` (its own session), then SIGKILL to any process still running from our
    temp dir (job drivers and workers in the job's virtualenv there). Nothing else is touched:
    `ray stop` would stop every Ray on the machine."""
    for sig, grace in ((signal.SIGTERM, 2), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    for pid in _pids_using(temp_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _pids_using(temp_dir: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if temp_dir.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    if not _has_job_server():
        pytest.skip("the Ray job server needs ray[default] (aiohttp_cors, opencensus, virtualenv)")
    with _ray_head() as head:
        head.prepare()
        yield head


@pytest.fixture(scope="module", autouse=True)
def _start_ray_head_first(request):
    """When a selected test of this module submits a job, start the Ray head (and the
    jobs' runtime env, `RayHead.prepare`) before the module's first test rather than at that
    test, so that they overlap the offline tests."""
    selected = [i for i in request.session.items if i.module is request.module]
    if _has_job_server() and any("ray_head" in i.fixturenames for i in selected):
        request.getfixturevalue("ray_head")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama base and three agents, and the spec reference of their RAM+ merge."""
    root = tmp_path_factory.mktemp("deploy-models")
    base_dir, task_dirs, base, tasks = build_model_set(root, base_shard="100KB")
    merged, _ = reference_merge(base, tasks, "ram_plus")
    return base_dir, task_dirs, merged


def _job_runtime_env(extra_env: dict[str, str] | None = None) -> dict:
    """jobs/runtime_env.yaml with the checkout as working dir, as `ray job submit
    --working-dir . --runtime-env jobs/runtime_env.yaml` sends it."""
    env = _runtime_env() | {"working_dir": str(REPO)}
    if extra_env:
        env["env_vars"] = dict(env.get("env_vars", {})) | extra_env
    return env


def _wait(head: RayHead, job_id: str, timeout_s: float = 240) -> str:
    from ray.job_submission import JobStatus

    client = head.client()
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            break
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            raise AssertionError(f"job {job_id} still {status} after {timeout_s} s")
        time.sleep(0.5)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, f"job {job_id} ended {status}:\n{logs[-4000:]}"
    return logs


def _assert_bytes_equal(out: Path, expected: dict[str, torch.Tensor]) -> None:
    got = load_checkpoint(out)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        a, b = got[name].contiguous(), tensor.contiguous()
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.flatten().view(torch.uint8).equal(b.flatten().view(torch.uint8)), name


def _weights(folder: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(folder.iterdir())
        if p.name.endswith((".safetensors", ".index.json"))
    }


@pytest.fixture(scope="module")
def cli_job_output(ray_head, models, tmp_path_factory) -> Path:
    """The documented command, run as a user runs it: `ray job submit --working-dir .
    --runtime-env jobs/runtime_env.yaml -- python -m ram_dist.cli merge ...` from the repo."""
    base_dir, task_dirs, _ = models
    out = tmp_path_factory.mktemp("deploy-cli") / "merged"
    job_id = f"ram-dist-cli-{secrets.token_hex(4)}"
    entrypoint = [*CLI_MODULE, "merge", "--base", str(base_dir), "--out", str(out)]
    for task in task_dirs:
        entrypoint += ["--task", str(task)]
    ray_head.prepared()
    submit = [
        sys.executable, "-m", "ray.scripts.scripts", "job", "submit",
        "--address", ray_head.address, "--working-dir", ".",
        "--runtime-env", "jobs/runtime_env.yaml", "--submission-id", job_id, "--no-wait",
        "--", *entrypoint,
    ]  # fmt: skip
    done = subprocess.run(
        submit, cwd=REPO, env=ray_head.cli_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    _wait(ray_head, job_id)
    return out


def test_submitted_merge_equals_the_reference(cli_job_output, models):
    base_dir, task_dirs, merged = models
    _assert_bytes_equal(cli_job_output, merged)
    report = json.loads((cli_job_output / "merge_report.json").read_text())
    assert report["method"] == "ram_plus" and report["base"] == str(base_dir)
    assert report["tasks_given"] == [str(t) for t in task_dirs]
    assert report["output"]["url"] == str(cli_job_output)
    # The upload is unpacked on the node with new file times: no kernel was in numba's cache
    # for it, and the node's workers compiled each one signature once between them (one
    # compiled while the others waited and loaded it), not once per worker.
    compiled = _kernels_compiled(report)
    assert compiled and set(compiled.values()) == {1}, report["passes"]


def test_runtime_env_pip_installs_nothing_the_cluster_python_has(ray_head):
    """jobs/runtime_env.yaml's claim: what the cluster's Python already satisfies is not
    downloaded again (a no-op on the ram-dist image). The head's Python has every package:
    Ray's pip plugin found each requirement met and installed nothing."""
    ray_head.prepared()
    logs = sorted(Path(ray_head.temp_dir).glob("session_latest/logs/runtime_env_setup*.log"))
    text = "".join(p.read_text(errors="replace") for p in logs)
    assert "Installing python requirements" in text, [p.name for p in logs]
    for requirement in _runtime_env()["pip"]["packages"]:
        assert f"Requirement already satisfied: {requirement} " in text, requirement
    assert "Collecting " not in text and "Successfully installed" not in text


def _kernels_compiled(report: dict) -> Counter[str]:
    """The kernel signatures a merge's passes compiled, per kernel, summed over the passes."""
    total: Counter[str] = Counter()
    for stats in report["passes"].values():
        total.update(stats["kernels_compiled"])
    return total


def test_submitted_nightly_merges_publishes_latest_and_skips_a_rerun(
    ray_head, models, cli_job_output, tmp_path
):
    """jobs/nightly.py with jobs/merge-s3.yaml's settings, as a Ray job that runs it twice (a
    retry on the same day): the first run merges and then writes `latest`, the second finds the
    output complete (ram-dist's resume makes it a no-op) and leaves `latest` as it is. With
    ram-dist's storage options it reads and writes S3 (a local S3 server on 127.0.0.1, the
    credentials in the job's environment as the k8s Secret puts them); without, local folders."""
    base_dir, task_dirs, _ = models
    config = yaml.safe_load((JOBS / "merge-s3.yaml").read_text())
    with contextlib.ExitStack() as stack:
        if HAS_STORAGE:
            bucket, env_vars = stack.enter_context(_s3_bucket(base_dir, task_dirs))
            config["base_model"] = "s3://my-models/base"
            config["models"] = [{"model": f"s3://my-models/agents/t{i}"} for i in range(3)]
            config["storage_options"]["s3"]["endpoint_url"] = bucket.endpoint
            root = "s3://my-models/merged"
        else:
            bucket, env_vars = None, {}
            config.pop("storage_options")
            config["base_model"] = str(base_dir)
            config["models"] = [{"model": str(t)} for t in task_dirs]
            root = str(tmp_path / "merged")
        config_file = tmp_path / "merge.yaml"
        config_file.write_text(yaml.safe_dump(config))
        run = shlex.join(
            ["python", "jobs/nightly.py", str(config_file), "--out-root", root]
            + ["--run-id", "2026-01-31", "--unit-mb", "0.05"]
        )
        job_id = ray_head.client().submit_job(
            entrypoint=f"{run} && {run}", runtime_env=_job_runtime_env(env_vars)
        )
        logs = _wait(ray_head, job_id)
        assert logs.count("[nightly] ram-dist merge") == 2, logs
        assert logs.count("is already complete") == 1, logs  # the second run

        out = f"{root}/2026-01-31"
        if bucket is not None:
            bucket.fs.invalidate_cache()
            latest = bucket.fs.cat_file(f"{root}/latest").decode()
            local = tmp_path / "downloaded"
            bucket.fs.get(out, str(local), recursive=True)
        else:
            latest = Path(root, "latest").read_text()
            local = Path(out)
    assert latest == f"{out}\n"
    # The same upload on the same node: its workers loaded every kernel that the first job
    # compiled there.
    report = json.loads((local / "merge_report.json").read_text())
    assert _kernels_compiled(report) == {}
    expected, _ = _expected_for(config, models)
    _assert_bytes_equal(local, expected)
    # Another unit budget, the same bytes as the documented command's output.
    assert _weights(local) == _weights(cli_job_output)


class _Bucket:
    def __init__(self, fs, endpoint: str):
        self.fs, self.endpoint = fs, endpoint


@contextlib.contextmanager
def _s3_bucket(base_dir: Path, task_dirs: list[Path]) -> Iterator[tuple[_Bucket, dict]]:
    """A local S3 server (moto) holding s3://my-models/{base,agents/t0..t2}, and the
    environment that gives a job its credentials."""
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=endpoint)
        fs.mkdir("my-models")
        fs.put(str(base_dir), "my-models/base", recursive=True)
        for i, task in enumerate(task_dirs):
            fs.put(str(task), f"my-models/agents/t{i}", recursive=True)
        env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        yield _Bucket(fs, endpoint), env
    finally:
        server.stop()


def _expected_for(config: dict, models) -> tuple[dict[str, torch.Tensor], dict]:
    """The spec reference for a merge config's method, parameters and out_dtype."""
    base_dir, task_dirs, _ = models
    params = config.get("parameters", {})
    out_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    return reference_merge(
        load_checkpoint(base_dir),
        [load_checkpoint(t) for t in task_dirs],
        config["merge_method"],
        r=params.get("r", 0.1),
        alpha=params.get("alpha", 2.0),
        eps=float(params.get("epsilon", 1e-5)),
        out_dtype=out_dtype.get(config.get("out_dtype")),
    )
