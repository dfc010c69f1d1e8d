"""The chart's Ingress / Gateway API HTTPRoute for the fleet's relay Service (with TLS), the
dashboard's namespace/fleet/shard/pod variables, and the configurable runbook base URL.

Ingress is checked by kubernetes-validate (strict) and, like Gateway and HTTPRoute, by a
server-side dry-run on a real API server. The Gateway API CRDs are not part of Kubernetes and
cannot be fetched here: tests/fixtures/gateway-api-subset-crds.yaml is a hand-written subset
typed for the fields the chart renders, so unknown or misplaced fields are refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.chart import CHART, HELM, K8S_VERSION, needs_helm, render
from tests.support.k8s_cluster import KubeCluster
from tests.support.observability import DASHBOARDS, dashboard_queries
from tests.support.operator_harness import wait_for

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gateway-api-subset-crds.yaml"

EXPOSED = [
    "ingress.enabled=true",
    "ingress.className=nginx",
    "ingress.fleets[0].name=main",
    "ingress.fleets[0].hosts[0]=relay.example.com",
    "ingress.fleets[0].tlsSecretName=relay-tls",
    "ingress.fleets[1].name=blue",
    "ingress.fleets[1].hosts[0]=blue.example.com",
    "ingress.annotations.example\\.com/owner=messaging",
    "gateway.enabled=true",
    "gateway.create=true",
    "gateway.gatewayClassName=example",
    "gateway.tls.certificateRefs[0].name=relay-tls",
    "gateway.fleets[0].name=main",
    "gateway.fleets[0].hostnames[0]=relay.example.com",
]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@needs_helm
def test_ingress_routes_everything_to_the_fleet_service_with_tls_and_ws_timeouts() -> None:
    docs = render(*EXPOSED, include_crds=False)
    ingresses = {d["metadata"]["name"]: d for d in by_kind(docs, "Ingress")}
    assert set(ingresses) == {"relayfleet-main", "relayfleet-blue"}
    main = ingresses["relayfleet-main"]
    kubernetes_validate.validate(main, K8S_VERSION, strict=True)
    spec = main["spec"]
    assert spec["ingressClassName"] == "nginx"
    assert spec["tls"] == [{"hosts": ["relay.example.com"], "secretName": "relay-tls"}]
    (rule,) = spec["rules"]
    (path,) = rule["http"]["paths"]
    # One prefix rule: /v1/queues/<id>/live and /v1/didcomm/ws ride on it (no per-path split).
    assert (path["path"], path["pathType"]) == ("/", "Prefix")
    assert path["backend"]["service"] == {"name": "relayfleet-main", "port": {"name": "http"}}
    ann = main["metadata"]["annotations"]
    # Longer than a 60 s long-poll and an idle WebSocket; a 5 MiB payload fits.
    assert int(ann["nginx.ingress.kubernetes.io/proxy-read-timeout"]) > 60
    assert int(ann["nginx.ingress.kubernetes.io/proxy-send-timeout"]) > 60
    assert ann["nginx.ingress.kubernetes.io/proxy-body-size"] == "8m"
    assert ann["example.com/owner"] == "messaging"
    assert "tls" not in ingresses["relayfleet-blue"]["spec"]


@needs_helm
def test_httproute_and_gateway_terminate_tls_and_never_time_out_websockets() -> None:
    docs = render(*EXPOSED, include_crds=False)
    (gateway,) = by_kind(docs, "Gateway")
    (listener,) = gateway["spec"]["listeners"]
    assert listener["protocol"] == "HTTPS"
    assert listener["tls"] == {"mode": "Terminate", "certificateRefs": [{"name": "relay-tls"}]}
    (route,) = by_kind(docs, "HTTPRoute")
    assert route["spec"]["parentRefs"] == [{"name": gateway["metadata"]["name"], "sectionName": "https"}]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": "relayfleet-main", "port": 80}]
    assert rule["timeouts"] == {"request": "0s"}
    # Attached to an existing Gateway instead:
    docs = render(
        "gateway.enabled=true",
        "gateway.parentRefs[0].name=public",
        "gateway.parentRefs[0].namespace=gateway-system",
        "gateway.fleets[0].name=main",
        include_crds=False,
    )
    assert not by_kind(docs, "Gateway")
    (route,) = by_kind(docs, "HTTPRoute")
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateway-system"}]


@needs_helm
@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["ingress.nginx.timeoutSeconds=30"], "timeoutSeconds"),
        (["ingress.fleets[0].name=Main", "ingress.fleets[0].hosts[0]=x.example"], "name"),
        (["gateway.enabled=true", "gateway.fleets[0].name=main"], "gateway.parentRefs is required"),
        (["gateway.enabled=true", "gateway.create=true", "gateway.fleets[0].name=m"], "gatewayClassName"),
        (["gateway.requestTimeout=forever"], "requestTimeout"),
    ],
)
def test_bad_exposure_values_are_refused(sets: list[str], message: str) -> None:
    assert HELM is not None
    args = [HELM, "template", "relayfleet", str(CHART)]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


@pytest.mark.k8s
@needs_helm
def test_exposure_passes_server_side_dry_run(kube_apiserver: KubeCluster, apiserver_ns: str) -> None:
    kube_apiserver.kubectl("apply", "--server-side", "-f", str(FIXTURE))
    kube_apiserver.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/gateways.gateway.networking.k8s.io",
        "crd/httproutes.gateway.networking.k8s.io",
        "--timeout=60s",
    )
    docs = [
        d for d in render(*EXPOSED, include_crds=False) if d["kind"] in ("Ingress", "Gateway", "HTTPRoute")
    ]
    assert len(docs) == 4
    for d in docs:  # rendered for namespace "relay"; dry-run them in the test's own
        d["metadata"].pop("namespace", None)
    text = yaml.safe_dump_all(docs)

    def dry_run() -> subprocess.CompletedProcess[str] | None:
        proc = kube_apiserver.kubectl(
            "-n",
            apiserver_ns,
            "apply",
            "--dry-run=server",
            "--validate=strict",
            "-f",
            "-",
            input=text,
            check=False,
        )
        return None if "no matches for kind" in proc.stderr else proc  # types not served yet

    proc = wait_for("Gateway API types served", dry_run)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("(server dry run)") == 4
    # The fixture is strict enough to fail: a misplaced field and a bad timeout are refused.
    route = next(d for d in docs if d["kind"] == "HTTPRoute")
    route["spec"]["rules"][0]["timeout"] = "0s"
    route["spec"]["rules"][0]["timeouts"]["request"] = "never"
    bad = kube_apiserver.kubectl(
        "-n", apiserver_ns, "apply", "--dry-run=server", "--validate=strict", "-f", "-",
        input=yaml.safe_dump(route), check=False,
    )  # fmt: skip
    assert bad.returncode != 0
    assert "timeout" in bad.stderr


# --- dashboard variables and runbook URLs --------------------------------------------------------

RELAY_SERIES_VARS = ("$namespace", "$fleet", "$pod", "$shard")


def test_dashboard_has_the_four_variables_and_every_query_uses_them() -> None:
    for path in DASHBOARDS:
        doc = json.loads(path.read_text())
        variables = {v["name"]: v for v in doc["templating"]["list"]}
        for name in ("namespace", "fleet", "shard", "pod"):
            v = variables[name]
            assert v["type"] == "query"
            assert v["includeAll"] is True
            assert v["allValue"] == ".*"
            assert v["datasource"]["uid"] == "${datasource}"
    checked = 0
    for _, title, expr in dashboard_queries():
        if "relayfleet_spark_job" in expr:
            continue  # pushed by the jobs: no namespace/pod/shard labels exist on those series
        if "relayfleet_operator_" in expr:
            if any(m in expr for m in ("slots_moved", "bytes_moved", "operator_shard_map_epoch")):
                assert "$fleet" in expr, title
            continue
        missing = [v for v in RELAY_SERIES_VARS if v not in expr]
        assert not missing, f"{title}: {expr} lacks {missing}"
        checked += 1
    assert checked >= 25


@needs_helm
def test_runbook_urls_follow_the_configured_base() -> None:
    def rules(*sets: str) -> list[dict[str, Any]]:
        docs = render("metrics.prometheusRule.enabled=true", *sets, include_crds=False)
        (rule,) = by_kind(docs, "PrometheusRule")
        return [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]

    base = "https://wiki.example.com/ops/relayfleet"
    alerts = rules(f"metrics.prometheusRule.runbookBaseURL={base}")
    assert alerts
    for a in alerts:
        assert a["annotations"]["runbook_url"] == f"{base}#{a['alert'].lower()}"
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    for a in rules():
        assert a["annotations"]["runbook_url"].startswith(
            f"https://github.com/relayfleet/relayfleet/blob/v{chart['appVersion']}/docs/runbook.md#"
        )


@needs_helm
def test_relay_servicemonitor_labels_fleet_and_shard() -> None:
    docs = render("metrics.serviceMonitor.enabled=true", include_crds=False)
    relays = next(d for d in by_kind(docs, "ServiceMonitor") if d["metadata"]["name"].endswith("-relays"))
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in relays["spec"]["endpoints"][0]["relabelings"]}
    assert relabel["fleet"] == ["__meta_kubernetes_pod_label_relayfleet_dev_fleet"]
    assert relabel["relay_shard"] == ["__meta_kubernetes_pod_label_relayfleet_dev_shard"]
