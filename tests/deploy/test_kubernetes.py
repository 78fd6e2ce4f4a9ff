"""deploy/kubernetes: every manifest valid against the Kubernetes schemas (vendored by the
kubernetes-validate package, strict: unknown fields fail), every kustomization listing its folder,
and the pods' settings consistent with orca-jax itself: the args parse with the real `orca-jax serve`
command line, probes that never kill a compiling pod, a grace period longer than the drain, an API
key from a Secret, GPUs matching the layout, and a multi-host Job whose pods find process 0."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml

from .conftest import DEPLOY, serve_config

KUBERNETES = DEPLOY / "kubernetes"
LAYOUTS = ("single-host", "multi-host")
# The oldest Kubernetes the manifests target: the label batch.kubernetes.io/job-completion-index
# (multi-host Service selector) appeared in 1.28.
KUBERNETES_VERSION = "1.30.0"


def documents(layout: str) -> list[dict]:
    kustomization = yaml.safe_load((KUBERNETES / layout / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"]
            for doc in yaml.safe_load_all((KUBERNETES / layout / name).read_text()) if doc]


def find(layout: str, kind: str) -> list[dict]:
    return [doc for doc in documents(layout) if doc["kind"] == kind]


def pod_spec(layout: str) -> dict:
    (workload,) = find(layout, "Deployment") + find(layout, "Job")
    return workload["spec"]["template"]["spec"]


def expand(args: list[str], values: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg) for arg in args]


def flag(args: list[str], name: str) -> str:
    (value,) = [arg.split("=", 1)[1] for arg in args if arg.startswith(f"{name}=")]
    return value


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kustomization_lists_every_manifest(layout):
    kustomization = yaml.safe_load((KUBERNETES / layout / "kustomization.yaml").read_text())
    files = {path.name for path in (KUBERNETES / layout).glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_manifests_match_the_kubernetes_schemas(layout):
    for doc in documents(layout):
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{layout} {doc['kind']} {doc['metadata']['name']}: {error.message} at "
                        f"{'.'.join(map(str, error.path))}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pods_are_safe_to_run_and_stop(layout):
    spec = pod_spec(layout)
    (container,) = spec["containers"]
    assert "command" not in container, "args only: the image's entrypoint seeds the kernel and execs orca-jax"
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] != 0
    # The API key comes from a Secret, never from the args.
    (key,) = [env for env in container["env"] if env["name"] == "ORCA_JAX_API_KEY"]
    assert "secretKeyRef" in key["valueFrom"]
    assert not any(arg.startswith("--api-key") for arg in container["args"])
    # SIGKILL comes only after preStop + the whole drain.
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
    shutdown_timeout = float(flag(container["args"], "--shutdown-timeout"))
    assert spec["terminationGracePeriodSeconds"] > float(pre_stop[-1]) + shutdown_timeout
    # Traffic only when /health is 200 (ready, not draining); nothing that kills a pod asks /health,
    # which is 503 for as long as the engine compiles.
    readiness = container["readinessProbe"]
    assert readiness.get("httpGet", {}).get("path") == "/health" or "/health" in readiness["exec"]["command"]
    for probe in ("livenessProbe", "startupProbe"):
        if probe in container:
            assert container[probe]["httpGet"]["path"] != "/health", probe
    for mount in container["volumeMounts"]:
        if mount["mountPath"] == "/var/cache/orca-jax":  # the images' $ORCA_JAX_COMPILATION_CACHE
            break
    else:
        pytest.fail("no volume on the compilation cache")


def test_single_host_args_are_real_serve_flags(monkeypatch):
    (container,) = pod_spec("single-host")["containers"]
    args, config, dist = serve_config(container["args"], monkeypatch)
    assert dist is None
    assert args.host == "0.0.0.0" and args.port == container["ports"][0]["containerPort"] == 8000
    assert config.scheduler.policy == "chunked"
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size


def test_multi_host_pods_get_their_process_from_the_index(monkeypatch):
    (job,) = find("multi-host", "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    (container,) = spec["template"]["spec"]["containers"]
    (process_env,) = [env for env in container["env"] if env["name"] == "JAX_PROCESS_ID"]
    assert process_env["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    workers = [svc for svc in find("multi-host", "Service") if svc["spec"].get("clusterIP") == "None"]
    (headless,) = workers
    assert spec["template"]["spec"]["subdomain"] == headless["metadata"]["name"]
    assert headless["spec"]["publishNotReadyAddresses"]  # process 0 is found before it is ready
    for index in range(spec["completions"]):
        args, config, dist = serve_config(expand(container["args"], {"JAX_PROCESS_ID": str(index)}), monkeypatch)
        assert dist.process_id == index and dist.num_processes == spec["completions"]
        # Process 0 is pod <job>-0 under the headless Service; the steps go through the coordinator's
        # port (jax.distributed's key-value store), no port of our own.
        host, port = dist.coordinator_address.rsplit(":", 1)
        assert host == f"{job['metadata']['name']}-0.{headless['metadata']['name']}"
        assert {p["port"] for p in headless["spec"]["ports"]} == {int(port)}
        # tp inside a host, pp across hosts: each pod's GPUs are one stage's tp devices.
        assert config.parallel.pipeline_parallel_size == dist.num_processes
        assert container["resources"]["limits"]["nvidia.com/gpu"] == config.parallel.tensor_parallel_size
    # The API Service sends traffic to process 0 only: the followers serve no HTTP.
    (api,) = [svc for svc in find("multi-host", "Service") if svc["spec"].get("clusterIP") != "None"]
    assert api["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"


def test_multi_host_ports_beyond_the_api_admit_only_the_jobs_own_pods(monkeypatch):
    """jax's coordination service and the cross-process transfer servers have no authentication (and a
    transfer server aborts its process on a malformed message): a NetworkPolicy over the Job's pods
    admits other sources on the HTTP port only, and the Job's own pods on every port (the transfer
    servers listen on ports chosen at start-up)."""
    (job,) = find("multi-host", "Job")
    own = {"batch.kubernetes.io/job-name": job["metadata"]["name"]}  # the Job controller labels its pods so
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args, _, dist = serve_config(expand(container["args"], {"JAX_PROCESS_ID": "0"}), monkeypatch)
    coordinator_port = int(dist.coordinator_address.rsplit(":", 1)[1])
    (api,) = [svc for svc in find("multi-host", "Service") if svc["spec"].get("clusterIP") != "None"]
    api_ports = {port["targetPort"] for port in api["spec"]["ports"]}
    assert api_ports == {args.port}

    (policy,) = find("multi-host", "NetworkPolicy")
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": own}
    assert "Ingress" in spec["policyTypes"]
    open_ports, own_pods_admitted = set(), False
    for rule in spec["ingress"]:
        if "from" in rule:
            # Only the Job's pods: no namespace selector, no IP block, no other pods.
            assert rule["from"] == [{"podSelector": {"matchLabels": own}}], rule
            own_pods_admitted |= "ports" not in rule
        else:
            assert rule.get("ports"), "a rule admitting every source on every port"
            open_ports |= {port["port"] for port in rule["ports"]}
    assert open_ports == api_ports, "only the API port is open to other sources"
    assert coordinator_port not in open_ports
    assert own_pods_admitted, "the Job's pods must reach each other on every port (coordinator, transfers)"
