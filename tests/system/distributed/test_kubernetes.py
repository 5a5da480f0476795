"""configs/kubernetes/: valid against the Kubernetes schema, and in step with the Dockerfile and
replay-server's flags."""

from __future__ import annotations

import inspect
import os
import re
import socket
import subprocess
import sys
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="needs PyYAML (installed with kubernetes-validate)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs kubernetes-validate (the dev extra)"
)

from conftest import CONFIGS, REPO
from replay_service.backends.reverb.connection import pick_free_port
from replay_service.backends.reverb.server import serve_config
from replay_service.config.files import load_config

KUBERNETES = os.path.join(CONFIGS, "kubernetes")
K8S_VERSION = "1.30"


def _documents() -> list[dict[str, Any]]:
    documents = []
    for name in sorted(os.listdir(KUBERNETES)):
        if name.endswith(".yaml"):
            with open(os.path.join(KUBERNETES, name)) as f:
                documents.extend(d for d in yaml.safe_load_all(f) if d)
    return documents


def _by_kind(kind: str) -> dict[str, Any]:
    (document,) = [d for d in _documents() if d["kind"] == kind]
    return document


def _serve_flags() -> set[str]:
    """The flags replay-server defines (read from its source: importing it beside the demo's
    flags would define some twice)."""
    with open(os.path.join(REPO, "replay_service", "cli", "serve.py")) as f:
        return set(re.findall(r'flags\.DEFINE_\w+\(\s*"(\w+)"', f.read()))


def _flag_values(args: list[str]) -> dict[str, str]:
    values = {}
    for arg in args:
        name, _, value = arg[2:].partition("=")
        values[name] = value
    return values


@pytest.fixture()
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_manifests_validate_offline_against_the_schema(no_network):
    documents = _documents()
    assert {d["kind"] for d in documents} == {"StatefulSet", "Service", "NetworkPolicy"}
    for document in documents:
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)
    broken = _by_kind("StatefulSet")
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    misspelt = _by_kind("Service")
    misspelt["spec"]["clusterIp"] = "None"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, K8S_VERSION, strict=True)


def test_statefulset_matches_replay_server_and_the_dockerfile():
    statefulset = _by_kind("StatefulSet")
    service = _by_kind("Service")
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = _flag_values(container["args"])
    defined = _serve_flags()
    assert {"port", "checkpoint_dir", "metrics_port"} <= defined
    for name in args:
        assert name in defined, f"replay-server has no flag --{name}"
    config = args["config"]
    assert config.startswith("/app/configs/")
    load_config(os.path.join(CONFIGS, os.path.basename(config)))  # the file exists and loads

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"reverb": int(args["port"]), "metrics": int(args["metrics_port"])}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert service["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["replay-server", "status"]
        assert f"--address=localhost:{args['port']}" in command

    (mount,) = container["volumeMounts"]
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert mount["name"] == claim["metadata"]["name"]
    assert args["checkpoint_dir"].startswith(mount["mountPath"] + "/")
    assert "restore_if_exists" in args

    checkpoint_timeout = inspect.signature(serve_config).parameters["checkpoint_timeout"].default
    assert pod["terminationGracePeriodSeconds"] > checkpoint_timeout

    with open(os.path.join(REPO, "Dockerfile")) as f:
        dockerfile = f.read()
    assert re.search(r'^ENTRYPOINT \["replay-server"\]$', dockerfile, re.M)
    exposed = set(re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split())
    assert {str(p) for p in ports.values()} <= exposed
    assert f'VOLUME ["{mount["mountPath"]}"]' in dockerfile
    assert f"useradd --create-home --uid {pod['securityContext']['runAsUser']} " in dockerfile
    assert 'pip install ".[metrics]"' in dockerfile  # --metrics_port needs prometheus-client
    assert "WORKDIR /app" in dockerfile and "COPY configs configs" in dockerfile


def test_metrics_are_reachable_only_through_the_network_policy():
    policy = _by_kind("NetworkPolicy")
    statefulset = _by_kind("StatefulSet")
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    allowed = {rule["ports"][0]["port"]: rule["from"][0] for rule in policy["spec"]["ingress"]}
    assert set(allowed) == {8000, 9100}
    assert "namespaceSelector" in allowed[9100]


def test_probe_command_fails_without_a_server_and_passes_with_one(start_server):
    probe = [sys.executable, "-m", "replay_service.cli.serve", "status", "--timeout=2"]
    run = {"capture_output": True, "text": True, "timeout": 60, "cwd": REPO}
    env = dict(os.environ, PYTHONPATH=REPO)
    # The server starts while the first probe runs (each spends seconds importing TensorFlow).
    server, address = start_server("--checkpoint_interval_s=0", wait=False)
    nobody = f"localhost:{pick_free_port()}"
    while nobody == address:  # not the port the starting server is about to take
        nobody = f"localhost:{pick_free_port()}"
    down = subprocess.run([*probe, f"--address={nobody}"], env=env, **run)
    assert down.returncode != 0
    assert "no Reverb server answered" in down.stderr
    server.wait_listening()
    up = subprocess.run([*probe, f"--address={address}"], env=env, **run)
    assert up.returncode == 0, up.stderr[-2000:]
