"""The deployment examples in deploy/: they parse, agree with each other and with the server,
and their scripts act on `autotune retune`'s exit status as documented.

The scripts run for real (bash) with `autotune` and `kubectl` replaced by small fakes on PATH:
what is tested is the scripts' own logic (which status restarts what), not kubectl.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
INSTALL_PREFIX = "/opt/vllm-autotune"  # where the examples expect the checkout
BASH = shutil.which("bash") or "/bin/bash"


def documents(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((K8S / name).read_text()))


def by_kind(name: str) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in documents(name)}


def cronjob_script() -> str:
    cronjob = by_kind("retune-cronjob.yaml")["CronJob"]
    [container] = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["bash", "-c"]
    return container["args"][0]


def cronjob_env() -> dict[str, str]:
    cronjob = by_kind("retune-cronjob.yaml")["CronJob"]
    [container] = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    return {item["name"]: item["value"] for item in container["env"]}


def test_manifests_parse_and_have_the_expected_kinds() -> None:
    assert [d["kind"] for d in documents("configmap.yaml")] == ["ConfigMap"]
    assert [d["kind"] for d in documents("server.yaml")] == [
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
    ]
    assert [d["kind"] for d in documents("retune-cronjob.yaml")] == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "CronJob",
    ]


def test_the_configmap_holds_a_config_the_server_accepts(tmp_path: Path) -> None:
    configmap = by_kind("configmap.yaml")["ConfigMap"]
    path = tmp_path / "best.yaml"
    path.write_text(configmap["data"]["best.yaml"])
    config = ServerConfig.load(path)  # ConfigError if the example drifted from the format
    assert config.serving.recorder is not None
    deployment = by_kind("server.yaml")["Deployment"]
    [server] = deployment["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"]: m for m in server["volumeMounts"]}
    assert mounts["data"]["mountPath"] == config.serving.recorder.directory
    assert config.port == server["ports"][0]["containerPort"]


def test_the_deployment_runs_the_server_on_the_configmap() -> None:
    configmap = by_kind("configmap.yaml")["ConfigMap"]
    deployment = by_kind("server.yaml")["Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    [server] = spec["containers"]
    assert server["command"][:5] == [
        "python",
        "-m",
        "server",
        "--config",
        "/etc/autotune/best.yaml",
    ]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in server["volumeMounts"]}
    assert volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"]
    assert mounts["config"]["mountPath"] == "/etc/autotune"
    # A rolling restart never drops below the current capacity.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"


def test_the_cronjob_targets_the_resources_that_exist() -> None:
    env = cronjob_env()
    assert env["CONFIGMAP"] == by_kind("configmap.yaml")["ConfigMap"]["metadata"]["name"]
    assert env["DEPLOYMENT"] == by_kind("server.yaml")["Deployment"]["metadata"]["name"]
    cronjob = by_kind("retune-cronjob.yaml")["CronJob"]
    pod = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert env["DEPLOYED"] == f"{mounts['config']}/best.yaml"
    assert env["TRAFFIC_ROOT"].startswith(mounts["data"])
    assert cronjob["spec"]["concurrencyPolicy"] == "Forbid"  # never two re-tunes at once
    rules = {
        r["resources"][0]: set(r["verbs"]) for r in by_kind("retune-cronjob.yaml")["Role"]["rules"]
    }
    assert {"get", "create", "patch"} <= rules["configmaps"]  # kubectl apply
    assert {"get", "patch", "watch"} <= rules["deployments"]  # rollout restart + status


def test_scripts_pass_bash_syntax_check(tmp_path: Path) -> None:
    script = tmp_path / "cronjob.sh"
    script.write_text(cronjob_script())
    for path in (script, DEPLOY / "retune-host.sh"):
        done = subprocess.run([BASH, "-n", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_systemd_units_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    # The units name the install prefix; point it at this checkout so ExecStart paths exist.
    for unit in (DEPLOY / "systemd").iterdir():
        text = unit.read_text().replace(INSTALL_PREFIX, str(ROOT))
        (tmp_path / unit.name).write_text(text)
    units = sorted(str(p) for p in tmp_path.iterdir())
    done = subprocess.run([analyze, "verify", *units], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr
    timer = (DEPLOY / "systemd" / "autotune-retune.timer").read_text()
    assert "Unit=autotune-retune.service" in timer and "Persistent=true" in timer


def test_cron_line_runs_the_host_script() -> None:
    lines = [
        line
        for line in (DEPLOY / "cron" / "autotune-retune").read_text().splitlines()
        if line.strip() and not line.startswith("#") and "=" not in line.split()[0]
    ]
    [line] = lines
    fields = line.split()
    minute, hour, day, month, weekday, user, command = fields[:7]
    assert 0 <= int(minute) < 60 and 0 <= int(hour) < 24
    assert (day, month, weekday) == ("*", "*", "*") and user == "autotune"
    assert command == f"{INSTALL_PREFIX}/deploy/retune-host.sh"
    assert os.access(DEPLOY / "retune-host.sh", os.X_OK)


# -- the exit-status contract, with fakes for autotune and kubectl ---------------------------

FAKE_AUTOTUNE = """#!/usr/bin/env bash
echo "autotune $*" >> "$CALLS"
if [ "$FAKE_STATUS" = 10 ]; then
  out=$(echo "$@" | sed -n 's/.*--output-dir \\([^ ]*\\).*/\\1/p')
  echo "new config" > "$out/best.yaml"
fi
exit "$FAKE_STATUS"
"""

FAKE_KUBECTL = """#!/usr/bin/env bash
if [ "$1" = apply ]; then
  echo "kubectl apply $(grep -c 'new config' || true)" >> "$CALLS"  # 1: the new config
  exit 0
fi
echo "kubectl $*" >> "$CALLS"
if [ "$1" = create ]; then
  file=$(echo "$@" | sed -n 's/.*--from-file=best.yaml=\\([^ ]*\\).*/\\1/p')
  cat "$file"
  exit 0
fi
if [ "$1 $2" = "rollout status" ]; then exit "${FAKE_ROLLOUT:-0}"; fi
exit 0
"""


def fake_bin(tmp_path: Path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in (("autotune", FAKE_AUTOTUNE), ("kubectl", FAKE_KUBECTL)):
        path = folder / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


def run_cronjob(tmp_path: Path, status: int, rollout: int = 0) -> tuple[int, list[str]]:
    deployed = tmp_path / "etc" / "best.yaml"
    deployed.parent.mkdir()
    deployed.write_text("old config\n")
    (tmp_path / "data" / "traffic" / "autotune-server-abc").mkdir(parents=True)
    (tmp_path / "data" / "traffic" / "autotune-server-abc" / "traffic-1.jsonl").write_text("x\n")
    calls = tmp_path / "calls.log"
    calls.touch()
    env = {
        **cronjob_env(),
        "PATH": f"{fake_bin(tmp_path)}:{os.environ['PATH']}",
        "DEPLOYED": str(deployed),
        "VERSIONS": str(tmp_path / "data" / "configs"),
        "TRAFFIC_ROOT": str(tmp_path / "data" / "traffic"),
        "CALLS": str(calls),
        "FAKE_STATUS": str(status),
        "FAKE_ROLLOUT": str(rollout),
    }
    done = subprocess.run([BASH, "-c", cronjob_script()], env=env, capture_output=True, text=True)
    return done.returncode, calls.read_text().splitlines()


@pytest.mark.parametrize("status", [0, 11])
def test_cronjob_does_nothing_more_without_a_new_config(tmp_path: Path, status: int) -> None:
    code, calls = run_cronjob(tmp_path, status)
    assert code == 0
    assert [c.split()[0] for c in calls] == ["autotune"]  # no kubectl at all
    assert "--current " + str(tmp_path / "data" / "traffic" / "autotune-server-abc") in calls[0]
    assert "--trials 12 --time-budget 3h" in calls[0]


def test_cronjob_publishes_and_restarts_after_a_new_config(tmp_path: Path) -> None:
    code, calls = run_cronjob(tmp_path, 10)
    assert code == 0
    assert calls[1].startswith("kubectl create configmap autotune-config")
    assert calls[2] == "kubectl apply 1"  # the new best.yaml went into the ConfigMap
    assert calls[3:] == [
        "kubectl rollout restart deployment/autotune-server",
        "kubectl rollout status deployment/autotune-server --timeout=30m",
    ]


def test_cronjob_puts_the_old_config_back_when_the_rollout_fails(tmp_path: Path) -> None:
    code, calls = run_cronjob(tmp_path, 10, rollout=1)
    assert code == 1
    assert calls[-3:] == [
        f"kubectl create configmap autotune-config --from-file=best.yaml={tmp_path}/etc/best.yaml "
        "--dry-run=client -o yaml",
        "kubectl apply 0",  # the old config
        "kubectl rollout restart deployment/autotune-server",
    ]


@pytest.mark.parametrize("status", [1, 2])
def test_cronjob_fails_when_retune_fails(tmp_path: Path, status: int) -> None:
    code, calls = run_cronjob(tmp_path, status)
    assert code == status
    assert [c.split()[0] for c in calls] == ["autotune"]


@pytest.mark.parametrize(
    ("status", "exit_code", "restarted"),
    [(0, 0, False), (11, 0, False), (10, 0, True), (2, 2, False), (1, 1, False)],
)
def test_host_script_restarts_only_after_a_new_config(
    tmp_path: Path, status: int, exit_code: int, restarted: bool
) -> None:
    calls = tmp_path / "calls.log"
    calls.touch()
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "AUTOTUNE": str(fake_bin(tmp_path) / "autotune"),
        "CONFIG_DIR": str(config_dir),
        "TRAFFIC_DIR": str(tmp_path / "traffic"),
        "RESTART": f"touch {tmp_path / 'restarted'}",
        "CALLS": str(calls),
        "FAKE_STATUS": str(status),
    }
    done = subprocess.run([str(DEPLOY / "retune-host.sh")], env=env, capture_output=True, text=True)
    assert done.returncode == exit_code, done.stderr
    assert (tmp_path / "restarted").exists() == restarted
    [call] = calls.read_text().splitlines()
    assert f"--config {config_dir}/best.yaml --output-dir {config_dir}" in call
