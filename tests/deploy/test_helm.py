"""deploy/helm/gyre: rendered by Helm's own engine (the helm-python-sdk package binds Helm's
Go SDK; no helm binary), linted, and every manifest validated against the Kubernetes
schemas (kubernetes-validate). Then what the schemas cannot see: commands are real `gyre
serve` services, GYRE_* names are read by the code, probes, selectors, secrets and the NATS
configuration fit together."""

from __future__ import annotations

import base64
import subprocess

import pytest
import yaml

from tests.deploy import _catalog as cat

helm = cat.need("helm_python", "helm-python-sdk")
kubernetes_validate = cat.need("kubernetes_validate", "kubernetes-validate")

NAMESPACE = "rl"
VALUE_SETS = {
    "default": None,
    "gpu": cat.CHART / "ci" / "gpu-values.yaml",
    "external": cat.CHART / "ci" / "external-values.yaml",
}
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())  # the chart's kubeVersion floor, and now
WORKLOADS = ("Deployment", "StatefulSet")


def values_of(name: str) -> dict:
    path = VALUE_SETS[name]
    return yaml.safe_load(path.read_text()) if path else {}


def render(values: dict | None) -> list[dict]:
    chart = helm.Chart.load(str(cat.CHART))
    files = chart.render(values or None, name="gyre", namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def rendered(request) -> tuple[str, dict, list[dict]]:
    return request.param, values_of(request.param), render(values_of(request.param))


def containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"] if doc["kind"] in WORKLOADS else []


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_chart_lints_clean():
    report = helm.lint(str(cat.CHART), strict=True)
    assert not report["errors"], report
    assert not [m for m in report["messages"] if m["severity"] >= 2], report["messages"]


def test_manifests_validate_against_kubernetes_schemas(rendered):
    name, _, docs = rendered
    problems = []
    for version in KUBE_VERSIONS:
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{version} {doc['kind']}/{doc['metadata']['name']}: {exc.caught.message}")
    assert not problems, "\n".join(problems)


def test_every_gyre_container_runs_a_known_service_with_probes_on_its_port(rendered):
    _, _, docs = rendered
    problems, seen = [], set()
    for doc in docs:
        for c in containers(doc):
            name = cat.serve_name(c.get("args") or c.get("command"))
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind, {}).get("httpGet")
                if not probe or probe["port"] not in ports:
                    problems.append(f"{doc['metadata']['name']}/{c['name']}: {kind} not on a declared port")
            if name is None:
                continue
            seen.add(name)
            if why := cat.check_service_name(name):
                problems.append(f"{doc['metadata']['name']}/{c['name']}: {why}")
            port = int(cat.option(c["args"], "--port"))
            probe_port = ports.get(c["readinessProbe"]["httpGet"]["port"])
            if probe_port != port or c["readinessProbe"]["httpGet"]["path"] != "/health":
                problems.append(f"{doc['metadata']['name']}/{c['name']}: probes must ask /health on --port {port}")
    assert not problems, "\n".join(problems)
    assert {"projector", "proxy", "scheduler", "trajectory", "evaluator", "runner", "cell"} <= seen


def test_environment_names_are_read_by_the_code(rendered):
    _, _, docs = rendered
    used = {e["name"] for d in docs for c in containers(d) for e in c.get("env", [])}
    assert not cat.unknown_env(used), f"GYRE_* names nothing reads: {cat.unknown_env(used)}"


def test_secret_references_resolve(rendered):
    name, values, docs = rendered
    secrets = {n: set(d.get("data", {})) for n, d in by_kind(docs, "Secret").items()}
    external = {values.get("secrets", {}).get("existingSecret"), values.get("postgresql", {}).get("existingSecret"),
                values.get("nats", {}).get("credsSecret")} - {None, ""}
    problems = []
    for doc in docs:
        for c in containers(doc):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if not ref or ref["name"] in external or ref.get("optional"):
                    continue
                if ref["key"] not in secrets.get(ref["name"], ()):
                    problems.append(f"{doc['metadata']['name']}/{c['name']} {e['name']}: {ref['name']}/{ref['key']}")
    assert not problems, "\n".join(problems)
    if values.get("secrets", {}).get("create", True) and not values.get("secrets", {}).get("existingSecret"):
        data = by_kind(docs, "Secret")["gyre-secrets"]["data"]
        assert len(base64.b64decode(data["admin-token"])) >= 32, "a generated admin token"


def test_selectors_match_their_pods(rendered):
    _, _, docs = rendered
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] in WORKLOADS]

    def matches(selector: dict) -> bool:
        return any(selector.items() <= labels.items() for labels in pod_labels)

    for doc in docs:
        if doc["kind"] in WORKLOADS:
            assert doc["spec"]["selector"]["matchLabels"].items() <= doc["spec"]["template"]["metadata"][
                "labels"].items()
        if doc["kind"] == "Service":
            assert matches(doc["spec"]["selector"]), doc["metadata"]["name"]
        if doc["kind"] == "PodDisruptionBudget":
            assert matches(doc["spec"]["selector"]["matchLabels"]), doc["metadata"]["name"]
        if doc["kind"] == "NetworkPolicy":
            assert matches(doc["spec"]["podSelector"]["matchLabels"]), doc["metadata"]["name"]


def test_every_workload_has_a_disruption_budget_and_network_policy(rendered):
    _, _, docs = rendered
    components = {d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                  for d in docs if d["kind"] in WORKLOADS}
    budgets = {d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
               for d in by_kind(docs, "PodDisruptionBudget").values()}
    assert components == budgets
    policies = by_kind(docs, "NetworkPolicy")
    assert "gyre-internal" in policies and "gyre-proxy" in policies
    internal = policies["gyre-internal"]["spec"]
    assert internal["policyTypes"] == ["Ingress"]
    assert internal["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "gyre"


def test_pods_run_as_non_root_with_a_read_only_root(rendered):
    _, _, docs = rendered
    for doc in docs:
        if doc["kind"] not in WORKLOADS:
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, c["name"]
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]
            if cat.serve_name(c.get("args")):
                assert sc.get("readOnlyRootFilesystem") is True, c["name"]


def test_bundled_nats_is_a_jetstream_cluster_the_server_accepts(tmp_path):
    for name in ("default", "gpu"):
        values = values_of(name)
        docs = render(values)
        nats = by_kind(docs, "StatefulSet")["gyre-nats"]
        assert nats["spec"]["replicas"] == 3
        assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
        conf = by_kind(docs, "ConfigMap")["gyre-nats"]["data"]["nats.conf"]
        assert "jetstream" in conf and conf.count("nats-route://") == 3
        assert ("authorization" in conf) == bool(values.get("nats", {}).get("auth", {}).get("enabled"))
        local = tmp_path / f"{name}.conf"
        local.write_text(conf.replace("/data/jetstream", str(tmp_path / "js")).replace("/var/run/nats", str(tmp_path)))
        env = {"POD_NAME": "gyre-nats-0", "NATS_PASSWORD": "secret123", "PATH": "/usr/bin:/bin"}
        from tests.deploy.test_compose import nats_server

        run = subprocess.run([nats_server(), "-t", "-c", str(local)], capture_output=True, text=True, env=env,
                             timeout=30)
        assert run.returncode == 0, run.stderr + run.stdout
        for doc in docs:
            for c in containers(doc):
                env_values = {e["name"]: e.get("value") for e in c.get("env", [])}
                if "GYRE_NATS_URL" in env_values:
                    assert env_values["GYRE_STREAM_REPLICAS"] == "3"
                    assert "gyre-nats.rl.svc.cluster.local:4222" in env_values["GYRE_NATS_URL"]


def test_external_nats_and_secrets():
    values = values_of("external")
    docs = render(values)
    assert "gyre-nats" not in by_kind(docs, "StatefulSet")
    assert "gyre-secrets" not in by_kind(docs, "Secret")
    proxy = by_kind(docs, "Deployment")["gyre-proxy"]
    c = containers(proxy)[0]
    env = {e["name"]: e for e in c["env"]}
    assert env["GYRE_NATS_URL"]["value"] == values["nats"]["url"]
    assert env["GYRE_NATS_CREDS"]["value"] == "/etc/gyre/nats/nats.creds"
    assert {"name": "nats-creds", "mountPath": "/etc/gyre/nats", "readOnly": True} in c["volumeMounts"]
    assert env["GYRE_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "gyre-postgres", "key": "url"}
    assert env["GYRE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "gyre-secrets-managed"


def test_gpu_cells_get_gpus_sglang_and_megatron_sizes():
    values = values_of("gpu")
    docs = render(values)
    sets = by_kind(docs, "StatefulSet")
    core, satellites = sets["gyre-cell-core"], sets["gyre-cell"]
    assert core["spec"]["replicas"] + satellites["spec"]["replicas"] == values["cells"]["count"]
    for doc, is_core in ((core, True), (satellites, False)):
        engine, agent = containers(doc)
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert engine["image"].startswith("lmsysorg/sglang:")
        args = engine["args"]
        assert args[args.index("--tp-size") + 1] == "8" and "--enable-memory-saver" in args
        assert args[-4:] == values["cells"]["sglang"]["args"]
        env = {e["name"]: e.get("value") for e in agent["env"]}
        assert (env.get("GYRE_CELL_CORE") == "1") is is_core
        assert env["GYRE_TRAINER_BACKEND"] == "megatron"  # the satellites compute what the core's worker does
        assert env["GYRE_TRAINER_TENSOR_MODEL_PARALLEL_SIZE"] == "1"  # one process: TP > 1 cannot start
        assert env["GYRE_CELL_ENGINE_URL"].endswith(".gyre-cell.rl.svc.cluster.local:30000")
        assert agent["image"].endswith("-cuda")
        pod = doc["spec"]["template"]["spec"]
        assert pod["tolerations"] and pod["nodeSelector"]


def test_the_evaluator_and_runner_mount_the_task_set_where_they_look_for_it():
    for name in ("default", "gpu"):
        deployments = by_kind(render(values_of(name)), "Deployment")
        for service, variable in (("evaluator", "GYRE_EVALUATOR_TASKS_DIR"), ("runner", "GYRE_TASKS_DIR")):
            pod = deployments[f"gyre-{service}"]
            env = {**cat.image_env(), **{e["name"]: e.get("value") for e in containers(pod)[0]["env"]}}
            mounts = {m["mountPath"]: m["name"] for m in containers(pod)[0]["volumeMounts"]}
            volume = next(v for v in pod["spec"]["template"]["spec"]["volumes"] if v["name"] == mounts[env[variable]])
            assert ("persistentVolumeClaim" in volume) == (name == "gpu")


def test_sglang_flags_are_the_ones_gyres_launcher_uses():
    """The chart starts SGLang itself; its flags must be ones services/engine/sglang_server.py
    passes for the same cell config (so both speak to the same SGLang release)."""
    from services.engine.sglang_server import SGLangConfig, build_command

    values = values_of("gpu")
    engine = containers(by_kind(render(values), "StatefulSet")["gyre-cell"])[0]
    chart_args = engine["args"][: len(engine["args"]) - len(values["cells"]["sglang"]["args"])]
    launcher = build_command(SGLangConfig(model_path="m", tp_size=8, mem_fraction_static=0.8, admin_api_key="k"))
    chart_flags = {a for a in chart_args if a.startswith("--")}
    assert chart_flags <= {a for a in launcher if a.startswith("--")}, chart_flags
    assert engine["command"][-2:] == launcher[1:3]  # -m sglang.launch_server


def test_default_cells_are_embedded_engines_on_cpu():
    docs = render(None)
    for name in ("gyre-cell-core", "gyre-cell"):
        engine, agent = containers(by_kind(docs, "StatefulSet")[name])
        assert engine["args"][:3] == ["gyre", "serve", "engine"]
        assert "nvidia.com/gpu" not in engine["resources"].get("limits", {})
        assert agent["args"][:3] == ["gyre", "serve", "cell"]


@pytest.mark.parametrize("bad, message", [
    ({"cells": {"engine": "vllm"}}, "engine"),
    ({"cells": {"count": 0}}, "count"),
    ({"cells": {"engine": "sglang"}}, "gpusPerCell"),
    ({"nats": {"streamReplicas": 5}}, "streamReplicas"),
    ({"nats": {"bundled": False}}, "nats.url"),
    ({"postgresql": {"url": ""}}, "postgresql"),
    ({"runId": "has space"}, "runId"),
    ({"runId": "has.dot"}, "runId"),
    ({"runId": "r" * 129}, "runId"),  # libs/common/settings.py takes 1 to 128 of [A-Za-z0-9_:-]
    ({"servces": {}}, "servces"),
    ({"secrets": {"create": False}}, "existingSecret"),
])
def test_bad_values_are_refused(bad, message):
    with pytest.raises(helm.HelmError) as caught:
        render(bad)
    assert message in str(caught.value)


def _trainer_env(docs: list[dict]) -> dict[str, str | None]:
    trainer = by_kind(docs, "Deployment")["gyre-trainer"]
    return {e["name"]: e.get("value") for e in containers(trainer)[0]["env"]}


def test_the_core_trainer_runs_by_default_wired_as_gyre_up_wires_it(rendered):
    """The core cell's agent only loads weights (its seat defaults to `weights`): without the
    trainer no update is ever applied. Its settings are those gyre/up.py gives it."""
    name, values, docs = rendered
    env = _trainer_env(docs)
    cells = {**values_of("default").get("cells", {}), **values.get("cells", {})}
    model = cells.get("model", "tiny-qwen")
    count = cells.get("count", 2)
    assert env["GYRE_TRAINER_ROLE"] == "core"
    assert env["GYRE_TRAINER_CELL"] == "gyre-cell-core-0"  # the core cell's GYRE_CELL_NAME (its pod)
    assert env["GYRE_MODEL"] == model
    assert int(env["GYRE_TRAINER_GROUPS_PER_STEP"]) >= 1  # without it the core never closes a step
    targets = dict(item.split("=", 1) for item in env["GYRE_TRAINER_PUBLISH_TO"].split(","))
    assert sorted(targets) == sorted(["gyre-cell-core-0"] + [f"gyre-cell-{i}" for i in range(count - 1)])
    for cell, url in targets.items():
        assert url == f"http://{cell}.gyre-cell.rl.svc.cluster.local:30000"
    trajectory = by_kind(docs, "Deployment")["gyre-trajectory"]
    assert {e["name"]: e.get("value") for e in containers(trajectory)[0]["env"]}["GYRE_MODEL"] == model
    proxy = by_kind(docs, "Deployment")["gyre-proxy"]  # renders prompts with the policy's tokenizer
    assert {e["name"]: e.get("value") for e in containers(proxy)[0]["env"]}["GYRE_MODEL"] == model
    if name == "gpu":
        assert env["GYRE_TRAINER_BACKEND"] == "megatron"
        assert env["GYRE_TRAINER_TENSOR_MODEL_PARALLEL_SIZE"] == "1"
        pod = by_kind(docs, "Deployment")["gyre-trainer"]["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"].endswith("-cuda")  # megatron-core is in the cuda build
        assert pod["tolerations"] and pod["nodeSelector"]
        state = next(v for v in pod["volumes"] if v["name"] == "state")
        assert state["persistentVolumeClaim"]["claimName"] == "gyre-trainer-state"
        assert "gyre-trainer-state" in by_kind(docs, "PersistentVolumeClaim")
        mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert "/models" in mounts  # cells.model is a folder on the models claim


def test_trainer_state_is_an_empty_dir_unless_persistence_is_on():
    pod = by_kind(render(None), "Deployment")["gyre-trainer"]["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "state") == {"name": "state", "emptyDir": {}}
    docs = render({"services": {"trainer": {"persistence": {"enabled": True, "existingClaim": "ckpt"}}}})
    pod = by_kind(docs, "Deployment")["gyre-trainer"]["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "state")["persistentVolumeClaim"]["claimName"] == "ckpt"
    assert not by_kind(docs, "PersistentVolumeClaim")


def test_values_may_override_what_the_chart_sets_on_the_trainer():
    env = _trainer_env(render({"services": {"trainer": {"env": {"GYRE_TRAINER_PUBLISH_MODE": "disk",
                                                                 "GYRE_MODEL": "/models/other"}}}}))
    assert env["GYRE_TRAINER_PUBLISH_MODE"] == "disk" and env["GYRE_MODEL"] == "/models/other"
    docs = render({"services": {"trainer": {"env": {"GYRE_MODEL": "/models/other"}}}})
    trainer = by_kind(docs, "Deployment")["gyre-trainer"]
    names = [e["name"] for e in containers(trainer)[0]["env"]]
    assert len(names) == len(set(names)), "an overridden variable is set once"


def test_embedded_engines_share_the_cell_agents_shared_memory():
    """The cell agent loads the newest weights into its engine through /dev/shm (tensor mode)."""
    for name in ("gyre-cell-core", "gyre-cell"):
        engine, agent = containers(by_kind(render(None), "StatefulSet")[name])
        for c in (engine, agent):
            assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"], c["name"]


def _env_of(docs: list[dict], deployment: str) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in containers(by_kind(docs, "Deployment")[deployment])[0]["env"]}


def test_the_scheduler_counts_a_steps_groups_as_the_trainer_does(rendered):
    """gyre up gives the scheduler the trainer's groups per step (GYRE_SCHEDULER_GROUPS_PER_STEP):
    without it the core may be pulled in for an update before all of a step's groups started."""
    _, _, docs = rendered
    groups = _trainer_env(docs)["GYRE_TRAINER_GROUPS_PER_STEP"]
    assert _env_of(docs, "gyre-scheduler")["GYRE_SCHEDULER_GROUPS_PER_STEP"] == groups
    docs = render({"services": {"scheduler": {"env": {"GYRE_SCHEDULER_GROUPS_PER_STEP": "5"}}}})
    names = [e["name"] for e in containers(by_kind(docs, "Deployment")["gyre-scheduler"])[0]["env"]]
    assert names.count("GYRE_SCHEDULER_GROUPS_PER_STEP") == 1
    assert _env_of(docs, "gyre-scheduler")["GYRE_SCHEDULER_GROUPS_PER_STEP"] == "5"


def test_a_run_id_the_code_accepts_is_accepted():
    from libs.common.settings import GyreSettings

    for run in ("qwen3:nl2repo-2", "r" * 128):
        GyreSettings(run_id=run)
        assert _env_of(render({"runId": run}), "gyre-evaluator")["GYRE_RUN_ID"] == run
