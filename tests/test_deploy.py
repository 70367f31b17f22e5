"""deploy/'s Kubernetes manifests, checked without a cluster: every object against the Kubernetes
API's own schemas (kubernetes-validate, strict: no unknown field), a LeaderWorkerSet's pod
templates as the PodTemplateSpecs they are (its own kind is a custom resource), every
`tprt serve` command line parsed by tprt's own parser, and the names that tie the objects
together (selectors, secrets, claims, probe ports) resolved."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from serve.cli import add_parsers

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
KUBERNETES = "1.33.0"
LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE = {"size", "leaderTemplate", "workerTemplate", "restartPolicy", "subGroupPolicy"}


def _objects() -> list[tuple[str, dict[str, Any]]]:
    found = [(f"{p.name}#{i}", doc) for p in sorted(DEPLOY.glob("*.yaml"))
             for i, doc in enumerate(yaml.safe_load_all(p.read_text())) if doc]
    assert found, DEPLOY
    return found


OBJECTS = _objects()


def _pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {})
    if obj["kind"] == "LeaderWorkerSet":
        lws = spec["leaderWorkerTemplate"]
        return [lws[k] for k in ("leaderTemplate", "workerTemplate") if k in lws]
    return [spec["template"]] if "template" in spec else []


@pytest.mark.parametrize("where, obj", OBJECTS, ids=[w for w, _ in OBJECTS])
def test_each_object_is_valid_against_the_kubernetes_api(where: str, obj: dict[str, Any]) -> None:
    if obj["kind"] == "LeaderWorkerSet":
        assert set(obj["spec"]) <= LWS_SPEC and set(obj["spec"]["leaderWorkerTemplate"]) <= LWS_TEMPLATE, where
        for template in _pod_templates(obj):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                          "template": template}, KUBERNETES, strict=True)
    else:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_a_broken_manifest_is_caught() -> None:
    """The check can fail: a misspelt field of a Deployment's container is refused."""
    deployment = next(o for _, o in OBJECTS if o["kind"] == "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def _serve_args(container: dict[str, Any]) -> list[str] | None:
    """The `tprt serve` arguments of a container (run directly or through torchrun), with
    Kubernetes' $(VAR) references standing for values."""
    line = [*container.get("command", []), *container.get("args", [])]
    if "serve" not in line:
        return None
    return [a.replace("$(", "").replace(")", "") for a in line[line.index("serve") + 1:]]


def test_every_serve_command_line_parses_and_its_probes_reach_its_http_port() -> None:
    parser = argparse.ArgumentParser(prog="tprt")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    seen = probed = 0
    for where, obj in OBJECTS:
        for template in _pod_templates(obj):
            for container in template["spec"]["containers"]:
                args = _serve_args(container)
                if args is None:
                    continue
                seen += 1
                parsed = parser.parse_args(["serve", *args])
                assert parsed.store == "TPRT_STORE" and parsed.http_port is not None, where
                ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):  # not on a group's workers:
                    if probe in container:                                          # rank 0 hosts the APIs
                        probed += 1
                        assert ports.get("http") == parsed.http_port, where
                        assert container[probe]["httpGet"]["port"] == "http", (where, probe)
                        assert container[probe]["httpGet"]["path"] in ("/health", "/ready"), (where, probe)
    assert (seen, probed) == (3, 4)  # the Deployment's replicas (3 probes), the LeaderWorkerSet's leader (1) and worker


def test_the_objects_refer_to_each_other_by_names_that_exist() -> None:
    named = {(o["kind"], o["metadata"]["name"]) for _, o in OBJECTS}
    labels = [t.get("metadata", {}).get("labels", {}) for _, o in OBJECTS for t in _pod_templates(o)]
    for where, obj in OBJECTS:
        if obj["kind"] == "Service":
            selector = obj["spec"]["selector"].items()
            assert any(selector <= pod.items() for pod in labels), where
        for template in _pod_templates(obj):
            spec = template["spec"]
            for volume in spec.get("volumes", []):
                if "persistentVolumeClaim" in volume:
                    assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in named, where
            for container in spec["containers"]:
                for env in container.get("env", []):
                    ref = env.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        assert ("Secret", ref["name"]) in named, where
            if "serviceAccountName" in spec:
                assert ("ServiceAccount", spec["serviceAccountName"]) in named, where


def test_each_image_the_manifests_name_is_built_by_a_dockerfile_here() -> None:
    """Every image but the public ones has a Dockerfile under deploy/images/ that tags it, copies
    only what exists, installs extras pyproject.toml defines, and pins what the tests run."""
    import re
    import tomllib

    root = DEPLOY.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    named = {c["image"] for _, obj in OBJECTS for t in _pod_templates(obj) for c in t["spec"]["containers"]}
    built = {}
    for dockerfile in sorted((DEPLOY / "images").glob("*.Dockerfile")):
        text = dockerfile.read_text()
        tag = re.search(r"docker build -f deploy/images/\S+ -t (\S+) ", text)
        assert tag, dockerfile
        built[tag.group(1)] = text
        for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
            for part in src.split():
                assert (root / part).exists(), (dockerfile.name, part)
        for extras in re.findall(r'"\.\[([\w,]+)\]"', text):
            assert set(extras.split(",")) <= set(project["optional-dependencies"]), (dockerfile.name, extras)
        for pin in re.findall(r"pip install [^\n]*?([\w-]+==[\d.]+)", text):
            assert pin in project["optional-dependencies"]["test"], (dockerfile.name, pin)  # what tests run
    assert named - {"postgres:16"} == set(built), (named, set(built))
