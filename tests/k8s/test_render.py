"""tandem-k8s render: every object it writes reads back unchanged through the published models.

Core objects (the claim, each Job template and pod template) go through the ``kubernetes``
client's models by its own ``ApiClient`` deserializer; the JobSet, TrainingRuntime and TrainJob
through ``kubeflow-trainer-api``'s models (generated from the Trainer's OpenAPI spec, JobSet's
v1alpha2 types included). Both sets are pydantic models that reject a wrong type and silently
drop an unknown field, so `strict` also asserts that the rendered object is contained in what
the model serialises back: a misspelt key or a coerced value fails (tested below).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes")
pytest.importorskip("kubeflow_trainer_api")
yaml = pytest.importorskip("yaml")

from kubeflow_trainer_api import models as kf  # noqa: E402
from kubernetes.client import ApiClient  # noqa: E402

from tandem.k8s.cli import main, render_documents, to_yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
API = ApiClient()
SCALE_CONFIGS = ["grpo", "grpo_32b_8gpu", "grpo_32b_16gpu", "grpo_32b_lora", "grpo_moe"]
# Parameters of each config's architecture, from the published HF configs (Qwen3-8B: 8.19 B;
# Qwen3-32B: 32.76 B; Qwen3-30B-A3B: 30.53 B), the reference for the derived grace period
PARAMS = {"grpo": 8_190_735_360, "grpo_32b": 32_762_123_264, "grpo_moe": 30_532_122_624}


def contained(rendered: Any, back: Any, where: str = "") -> None:
    """Every key and value of ``rendered`` is in ``back`` (which may add defaults)."""
    if isinstance(rendered, dict):
        assert isinstance(back, dict), f"{where}: {back!r}"
        for k, v in rendered.items():
            assert k in back, f"{where}/{k}: not a field of the model (dropped on the way back)"
            contained(v, back[k], f"{where}/{k}")
    elif isinstance(rendered, list):
        assert isinstance(back, list) and len(back) == len(rendered), where
        for i, (a, b) in enumerate(zip(rendered, back)):
            contained(a, b, f"{where}[{i}]")
    else:
        assert type(rendered) is type(back) and rendered == back, (
            f"{where}: {rendered!r} -> {back!r}"
        )


def core(obj: dict[str, Any], klass: str) -> None:
    """Deserialize with the kubernetes client's ApiClient, serialize back, compare."""
    model = API._ApiClient__deserialize(copy.deepcopy(obj), klass)  # the client's own path
    contained(obj, API.sanitize_for_serialization(model))


def custom(obj: dict[str, Any], model: Any) -> None:
    contained(obj, model.from_dict(copy.deepcopy(obj)).to_dict())


def check_jobset_spec(spec: dict[str, Any]) -> None:
    for rj in spec["replicatedJobs"]:
        core(rj["template"], "V1JobTemplateSpec")
        core(rj["template"]["spec"]["template"], "V1PodTemplateSpec")


def check(docs: list[dict[str, Any]]) -> None:
    """Each rendered object against its published model."""
    kinds = [d["kind"] for d in docs]
    assert kinds[0] == "PersistentVolumeClaim"
    core(docs[0], "V1PersistentVolumeClaim")
    assert docs[0]["spec"]["accessModes"] == ["ReadWriteMany"]
    for d in docs[1:]:
        if d["kind"] == "JobSet":
            custom(d, kf.JobsetV1alpha2JobSet)
            check_jobset_spec(d["spec"])
        elif d["kind"] == "TrainingRuntime":
            custom(d, kf.TrainerV1alpha1TrainingRuntime)
            check_jobset_spec(d["spec"]["template"]["spec"])
        else:
            assert d["kind"] == "TrainJob", kinds
            custom(d, kf.TrainerV1alpha1TrainJob)


def node_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec = docs[1]["spec"]
    spec = spec["template"]["spec"] if docs[1]["kind"] == "TrainingRuntime" else spec
    (node,) = [rj for rj in spec["replicatedJobs"] if rj["name"] == "node"]
    return node["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("name", SCALE_CONFIGS)
def test_scale_configs_render_valid_manifests(name: str) -> None:
    params = PARAMS["grpo_32b" if name.startswith("grpo_32b") else name]
    for nodes in (1, 2, 4):
        for kind in ("jobset", "trainjob"):
            extra = ["--k8s.envd_pods=2"] if nodes == 2 else []
            docs, plan = render_documents(
                f"configs/{name}.toml", nodes, kind, "reg/tandem:1", extra
            )
            check(docs)
            pod = node_pod(docs)
            (c,) = pod["containers"]
            assert c["image"] == "reg/tandem:1" and c["command"] == ["torchrun"]
            assert c["resources"]["limits"] == {"nvidia.com/gpu": "8"}  # plan.devices_per_node
            assert pod["tolerations"] == [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ]
            # grace: 300 s step + fp32 weights and two AdamW moments over the nodes at 1 GB/s + 30;
            # with LoRA the moments are the adapters' alone (under 1% of the base here)
            grace = pod["terminationGracePeriodSeconds"]
            if name.endswith("lora"):
                assert math.ceil(330 + 4 * params / nodes / 1e9) <= grace
                assert grace <= math.ceil(330 + 4.12 * params / nodes / 1e9)
            else:
                assert grace == math.ceil(300 + 12 * params / nodes / 1e9 + 30)
            args = c["args"]
            assert f"--config=configs/{name}.toml" in args and "train.py" in args
            assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in args
            dump = f"--job.dump_folder=/shared/outputs/{plan.name}"
            assert dump in args
            if kind == "jobset":
                js = docs[1]["spec"]
                assert js["network"]["subdomain"] == plan.name
                assert f"--nnodes={nodes}" in args
                # the leader is the first pod's host name: <jobset>-<job>-<job index>-<pod index>
                leader = f"{plan.name}-node-0-0.{plan.name}:29500"
                assert f"--rdzv-endpoint={leader}" in args
                assert js["failurePolicy"] == {
                    "maxRestarts": 3,
                    "restartStrategy": "InPlaceRestart",
                }
            else:
                assert docs[2]["spec"]["trainer"]["numNodes"] == nodes
                assert docs[1]["spec"]["mlPolicy"]["numNodes"] == nodes
            if nodes == 2:
                workers = [a for a in args if a.startswith("--reward.workers=")]
                assert workers == [
                    f"--reward.workers={plan.name}-envd-0-0.{plan.name}:7000,"
                    f"{plan.name}-envd-0-1.{plan.name}:7000"
                ]


def test_a_wrong_field_name_or_type_fails() -> None:
    docs, _ = render_documents("configs/grpo.toml", 2, "jobset", None, ["--k8s.envd_pods=1"])
    check(docs)
    breakages = [
        lambda d: d[1]["spec"]["failurePolicy"].update(maxRestart=3),  # misspelt JobSet field
        lambda d: d[1]["spec"]["failurePolicy"].update(maxRestarts="3"),  # wrong type
        lambda d: node_pod(d)["containers"][0].update(volumeMount=[]),  # misspelt pod field
        lambda d: node_pod(d).update(terminationGracePeriodSeconds="60"),  # wrong type
        lambda d: node_pod(d)["containers"][0].update(resources={"limit": {}}),
        lambda d: d[0]["spec"].update(accessMode=["ReadWriteMany"]),  # the claim
        lambda d: d[1]["spec"]["replicatedJobs"][0]["template"]["spec"].update(paralelism=2),
    ]
    for i, breaks in enumerate(breakages):
        bad = copy.deepcopy(docs)
        breaks(bad)
        with pytest.raises((AssertionError, ValueError)):
            check(bad)
            pytest.fail(f"breakage {i} passed")  # not reached when check raises
    trainjob, _ = render_documents("configs/grpo.toml", 1, "trainjob")
    check(trainjob)
    bad = copy.deepcopy(trainjob)
    bad[2]["spec"]["trainer"]["numNode"] = 1
    with pytest.raises(AssertionError):
        check(bad)


def test_cli_yaml_reads_back_and_bad_input_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "job.yaml"
    config = tmp_path / "moe.toml"
    text = (ROOT / "configs" / "grpo_moe.toml").read_text()
    config.write_text(text + '\n[k8s]\nnode_selector = {pool = "h100"}\n')
    cmd = ["render", "--config", str(config)]
    assert main([*cmd, "--nodes", "2", "--out", str(out), "--k8s.cpus_per_node=64"]) == 0
    text = out.read_text()
    assert text.startswith(f"# Rendered by: tandem-k8s render --config {config}")
    docs = list(yaml.safe_load_all(text))
    want, _ = render_documents("configs/grpo_moe.toml", 2, "jobset")
    want_pod = node_pod(want)
    assert node_pod(docs)["nodeSelector"] == {"pool": "h100"} and "nodeSelector" not in want_pod
    assert node_pod(docs)["containers"][0]["resources"]["requests"]["cpu"] == "64"
    assert docs[0] == want[0]
    assert docs[1]["spec"]["failurePolicy"] == want[1]["spec"]["failurePolicy"]
    check(docs)
    capsys.readouterr()
    for bad, message in (
        (["--nodes", "0"], "error: --nodes: must be >= 1, got 0"),
        (["--nodes", "1", "--k8s.tolerations=a:Never"], "error: k8s.tolerations: 'a:Never'"),
        (["--nodes", "1", "--k8s.nme=x"], "error: unknown key 'k8s.nme'; did you mean 'k8s.name'?"),
    ):
        assert main([*cmd, *bad]) == 2, bad
        r = capsys.readouterr()
        assert r.out == "" and r.err.startswith(message), (bad, r.err)
        assert len(r.err.strip().splitlines()) == 1, r.err


def test_yaml_emitter_quotes_every_string() -> None:
    obj = {"a": ["yes", "1", {"b": "on", "c": [1, True]}], "d": {}, "e": [], "n/x.y": "null"}
    assert yaml.safe_load("\n".join(to_yaml(obj))) == obj
