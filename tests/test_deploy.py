"""deploy/kubernetes.yaml names only flags, ports, probes and routes that Spool and vllm-router
really have: its commands are parsed by their own argument parsers."""

from pathlib import Path

import pytest
import yaml

from app.cli import parse
from app.serve import validate_flags
from app.server.app import create_app
from app.server.state import ServerState

DOCS = list(yaml.safe_load_all((Path(__file__).resolve().parent.parent / "deploy" / "kubernetes.yaml").read_text()))


def find(kind: str, name: str) -> dict:
    return next(d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name)


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def port_named(spec: dict, name: str) -> int:
    return next(p["containerPort"] for p in spec["ports"] if p["name"] == name)


def test_the_replicas_run_spool_with_its_real_flags_probes_and_routes():
    replica = find("Deployment", "spool-replica")
    spool = container(replica)
    assert spool["command"] == ["spool", "serve"]
    _, args, _ = parse(["serve", *spool["args"]], environ={e["name"]: e["value"] for e in spool["env"]})
    validate_flags(args)  # an unknown flag or bad value exits or raises
    assert args.port == port_named(spool, "http") and args.host == "0.0.0.0"
    assert replica["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.shutdown_timeout
    routes = {rule.rule for rule in create_app(ServerState(model_name="m")).url_map.iter_rules()}
    for probe in ("readinessProbe", "livenessProbe"):
        get = spool[probe]["httpGet"]
        assert get["path"] in routes and get["port"] == "http"
    labels = replica["spec"]["template"]["metadata"]["labels"]
    assert replica["spec"]["selector"]["matchLabels"] == labels
    resources = spool["resources"]  # a CPU limit is a quota, which sizes Spool's thread pools
    assert resources["limits"]["cpu"] == resources["requests"]["cpu"]


def test_the_router_finds_the_replicas_and_the_service_reaches_it():
    from vllm_router.launch_router import parse_router_args

    replica = find("Deployment", "spool-replica")
    router = container(find("Deployment", "spool-router"))
    assert router["command"] == ["vllm-router"]
    args = parse_router_args(router["args"])
    assert args.service_discovery and args.port == port_named(router, "http")
    assert args.service_discovery_port == port_named(container(replica), "http")
    assert args.selector == replica["spec"]["template"]["metadata"]["labels"]
    assert args.health_check_endpoint == "/health"
    service = find("Service", "spool")
    assert service["spec"]["selector"] == find("Deployment", "spool-router")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    role = find("Role", "spool-router")
    assert {"get", "list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["pods"]


@pytest.mark.parametrize("bad", [["--kv-cache-gb", "1"], ["--port", "http"]])
def test_a_wrong_flag_would_be_caught(bad):
    with pytest.raises(SystemExit):
        parse(["serve", *bad], environ={})
