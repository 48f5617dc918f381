"""Kubernetes manifests for one config: a JobSet, or a Kubeflow Trainer v2 TrainJob with its
TrainingRuntime, each beside the ReadWriteMany claim of the dump folder.

Both run the same pods. The ``node`` replicated job holds one pod per node, each one torchrun
agent (exec form, so torchrun is PID 1 and takes the kubelet's SIGTERM; it forwards it to the
workers, which agree on a step, checkpoint and exit 75: tandem/rl/fault/signals.py). The agents
meet in a c10d rendezvous on the first pod, reached by its host name through the JobSet's
headless service (``<name>-node-0-0.<name>``; under a TrainJob the Trainer's
``PET_MASTER_ADDR``). ``terminationGracePeriodSeconds`` covers the step in flight and one
checkpoint (tandem/rl/plan/checkpoint_time.py); torchrun's ``--shutdown-timeout`` ends 15 s
before it. With ``k8s.envd_pods`` an ``envd`` replicated job of CPU-only pods runs
``tandem-envd`` and the trainers' ``env.workers`` / ``reward.workers`` point at them; the set
succeeds when the ``node`` job does. Every object is a plain dict; tests/k8s/ checks each
against the published models (the ``kubernetes`` client, ``kubeflow-trainer-api``).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from typing import Any

from tandem.rl.config.k8s_schema import K8sConfig, parse_toleration
from tandem.rl.core.configlib import ConfigError

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
WORKSPACE = "/workspace"  # where the image holds this repository (docker/Dockerfile)
GRACE_MARGIN_S = 30  # start-up of the save, the commit, the exit
SHUTDOWN_BEFORE_S = 15  # torchrun stops its workers this long before the kubelet's SIGKILL
STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
Obj = dict[str, Any]


@dataclass(frozen=True)
class Plan:
    """What the manifests are made of, resolved from the config and the command line."""

    k8s: K8sConfig
    name: str
    nodes: int
    gpus: int  # per training pod
    nproc: int  # torchrun processes per pod
    config_path: str  # relative to the repository root in the image
    overrides: tuple[str, ...]
    grace_s: int
    model_label: str  # what the grace was derived from, for the header
    has_env: bool = False  # env.name is set: env.workers too

    @property
    def dump(self) -> str:
        return f"{self.k8s.mount}/outputs/{self.name}"

    @property
    def leader(self) -> str:
        return f"{self.name}-node-0-0.{self.name}"

    def envd_addresses(self) -> list[str]:
        k = self.k8s
        return [f"{self.name}-envd-0-{i}.{self.name}:{k.envd_port}" for i in range(k.envd_pods)]


def dns_name(text: str) -> str:
    """``text`` as a DNS label of at most 40 characters ('-' for anything else)."""
    out = "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")[:40].strip("-")
    if not out:
        raise ConfigError(f"job.name: {text!r} has no letter or digit to name the objects by")
    return out


def grace_seconds(cfg: Any, nodes: int) -> tuple[int, str]:
    """k8s.grace_s, else k8s.step_s + the planner's checkpoint time + a margin; and why."""
    k = cfg.k8s
    if k.grace_s:
        return k.grace_s, "k8s.grace_s"
    from tandem.rl.plan.checkpoint_time import checkpoint_bytes

    try:
        size = checkpoint_bytes(cfg)
    except ConfigError as e:
        raise ConfigError(
            f"{e} (or set k8s.grace_s: the grace period is derived from it)"
        ) from None
    write_s = size / nodes / (k.write_gbps * 1e9)
    grace = math.ceil(k.step_s + write_s + GRACE_MARGIN_S)
    why = (
        f"k8s.step_s {k.step_s:g} s + a {size / 1e9:.0f} GB checkpoint over {nodes} node(s) at "
        f"k8s.write_gbps {k.write_gbps:g} ({write_s:.0f} s) + {GRACE_MARGIN_S} s"
    )
    return grace, why


def make_plan(cfg: Any, config_path: str, nodes: int, overrides: tuple[str, ...] = ()) -> Plan:
    """Resolve names, sizes and the grace period of ``cfg`` on ``nodes`` nodes."""
    if nodes < 1:
        raise ConfigError(f"--nodes: must be >= 1, got {nodes}")
    k = cfg.k8s
    gpus = k.gpus_per_node or cfg.plan.devices_per_node or 8
    grace, why = grace_seconds(cfg, nodes)
    return Plan(
        k8s=k,
        name=k.name or dns_name(cfg.job.name),
        nodes=nodes,
        gpus=gpus,
        nproc=gpus,
        config_path=config_path,
        overrides=tuple(overrides),
        grace_s=grace,
        model_label=why,
        has_env=cfg.env.name is not None,
    )


# ---- pods ---------------------------------------------------------------------------------------
def _volumes(p: Plan) -> tuple[list[Obj], list[Obj]]:
    volumes = [
        {"name": "shared", "persistentVolumeClaim": {"claimName": p.k8s.volume_claim}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts = [
        {"name": "shared", "mountPath": p.k8s.mount},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    return volumes, mounts


def _token_env(p: Plan) -> list[Obj]:
    if not p.k8s.envd_pods:
        return []
    ref = {"secretKeyRef": {"name": p.k8s.token_secret, "key": "token"}}
    return [{"name": "TANDEM_ENVD_TOKEN", "valueFrom": ref}]


def train_args(p: Plan, rendezvous: list[str]) -> list[str]:
    """torchrun's arguments after the rendezvous flags, then train.py's."""
    k = p.k8s
    shutdown = max(1, p.grace_s - SHUTDOWN_BEFORE_S)
    workers = []
    if k.envd_pods:
        addresses = ",".join(p.envd_addresses())
        workers = [f"--reward.workers={addresses}"]
        if p.has_env:
            workers.insert(0, f"--env.workers={addresses}")
    return [
        *rendezvous,
        f"--max-restarts={k.max_restarts}",
        f"--signals-to-handle={STOP_SIGNALS}",
        f"--shutdown-timeout={shutdown}",
        f"--log-dir={p.dump}/torchrun",
        "train.py",
        f"--config={p.config_path}",
        f"--job.dump_folder={p.dump}",
        *workers,
        *p.overrides,
    ]


def trainer_pod(p: Plan, container: str, args: list[str], env: list[Obj]) -> Obj:
    """The pod template of one training node."""
    k = p.k8s
    volumes, mounts = _volumes(p)
    requests = {"cpu": str(k.cpus_per_node)}
    if k.memory_gb_per_node:
        requests["memory"] = f"{k.memory_gb_per_node}Gi"
    limits = {k.gpu_resource: str(p.gpus)} if p.gpus else {}
    threads = max(1, k.cpus_per_node // max(1, p.nproc))
    spec: Obj = {
        "restartPolicy": "OnFailure",  # a failed agent restarts in its pod and rejoins
        "terminationGracePeriodSeconds": p.grace_s,
        "containers": [
            {
                "name": container,
                "image": k.image,
                "workingDir": WORKSPACE,
                "command": ["torchrun"],
                "args": args,
                "env": [
                    {"name": "PYTHONFAULTHANDLER", "value": "1"},
                    {"name": "OMP_NUM_THREADS", "value": str(threads)},
                    *env,
                    *_token_env(p),
                ],
                "resources": {"requests": {**requests, **limits}, "limits": limits}
                if limits
                else {"requests": requests},
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    if k.node_selector:
        spec["nodeSelector"] = dict(k.node_selector)
    if k.tolerations:
        spec["tolerations"] = [parse_toleration(t) for t in k.tolerations]
    return {"metadata": {"labels": {"app.kubernetes.io/name": "tandem"}}, "spec": spec}


def envd_pod(p: Plan) -> Obj:
    """The pod template of one CPU-only tandem-envd worker."""
    k = p.k8s
    spec: Obj = {
        "restartPolicy": "OnFailure",
        "containers": [
            {
                "name": "envd",
                "image": k.image,
                "workingDir": WORKSPACE,
                "command": ["python", "-m", "tandem.rl.workers.envd"],
                "args": [
                    "--host=0.0.0.0",
                    f"--port={k.envd_port}",
                    f"--workers={k.envd_cpus}",
                ],
                "env": _token_env(p),
                "ports": [{"containerPort": k.envd_port, "name": "envd"}],
                "resources": {"requests": {"cpu": str(k.envd_cpus)}},
            }
        ],
    }
    if k.envd_node_selector:
        spec["nodeSelector"] = dict(k.envd_node_selector)
    return {"metadata": {"labels": {"app.kubernetes.io/name": "tandem-envd"}}, "spec": spec}


def _job(pod: Obj, pods: int, backoff: int) -> Obj:
    return {
        "spec": {
            "parallelism": pods,
            "completions": pods,
            "completionMode": "Indexed",
            "backoffLimit": backoff,
            "template": pod,
        }
    }


def claim(p: Plan) -> Obj:
    """The ReadWriteMany PersistentVolumeClaim of the dump folder."""
    k = p.k8s
    spec: Obj = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": f"{k.volume_gb}Gi"}},
    }
    if k.storage_class is not None:
        spec["storageClassName"] = k.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": k.volume_claim, "namespace": k.namespace},
        "spec": spec,
    }


# ---- the two job kinds ---------------------------------------------------------------------------
def jobset_spec(p: Plan, node_pod: Obj) -> Obj:
    """A JobSet spec: ``node`` (and ``envd``) replicated jobs, the failure and success policy."""
    k = p.k8s
    jobs = [{"name": "node", "replicas": 1, "template": _job(node_pod, p.nodes, k.max_restarts)}]
    if k.envd_pods:
        jobs.append(
            {"name": "envd", "replicas": 1, "template": _job(envd_pod(p), k.envd_pods, 100)}
        )
    return {
        "network": {"enableDNSHostnames": True, "subdomain": p.name},
        "failurePolicy": {"maxRestarts": k.max_restarts, "restartStrategy": k.restart_strategy},
        "successPolicy": {"operator": "All", "targetReplicatedJobs": ["node"]},
        "replicatedJobs": jobs,
    }


def jobset(p: Plan) -> list[Obj]:
    """The claim and a JobSet running ``p``."""
    rendezvous = [
        f"--nnodes={p.nodes}",
        f"--nproc-per-node={p.nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={p.leader}:{p.k8s.rdzv_port}",
        f"--rdzv-id={p.name}",
    ]
    pod = trainer_pod(p, "node", train_args(p, rendezvous), [])
    return [
        claim(p),
        {
            "apiVersion": JOBSET_API,
            "kind": "JobSet",
            "metadata": {"name": p.name, "namespace": p.k8s.namespace},
            "spec": jobset_spec(p, pod),
        },
    ]


def trainjob(p: Plan) -> list[Obj]:
    """The claim, a TrainingRuntime holding the pods, and the TrainJob that runs it: the
    Trainer's torch policy sets ``PET_NNODES``, ``PET_NPROC_PER_NODE`` (torchrun reads them)
    and ``PET_MASTER_ADDR`` / ``PET_MASTER_PORT`` (the rendezvous, expanded by the kubelet)."""
    rendezvous = [
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
        f"--rdzv-id={p.name}",
    ]
    pod = trainer_pod(p, "node", train_args(p, rendezvous), [])
    meta = {"name": p.name, "namespace": p.k8s.namespace}
    runtime = {
        "apiVersion": TRAINER_API,
        "kind": "TrainingRuntime",
        "metadata": meta,
        "spec": {
            "mlPolicy": {"numNodes": p.nodes, "torch": {}},
            "template": {"spec": jobset_spec(p, pod)},
        },
    }
    job = {
        "apiVersion": TRAINER_API,
        "kind": "TrainJob",
        "metadata": meta,
        "spec": {
            "runtimeRef": {
                "apiGroup": "trainer.kubeflow.org",
                "kind": "TrainingRuntime",
                "name": p.name,
            },
            "trainer": {"numNodes": p.nodes, "numProcPerNode": p.nproc},
        },
    }
    return [claim(p), runtime, job]


def header(p: Plan, kind: str, argv: list[str]) -> str:
    """The comment on top of the rendered file: how it was made, what it assumes."""
    lines = [
        f"Rendered by: tandem-k8s {shlex.join(argv)}",
        f"{kind}: {p.nodes} node(s) x {p.gpus} GPU(s), image {p.k8s.image}, dump {p.dump}",
        f"terminationGracePeriodSeconds {p.grace_s}: {p.model_label}",
    ]
    if p.k8s.envd_pods:
        lines.append(
            f"{p.k8s.envd_pods} tandem-envd pod(s); first: kubectl create secret generic "
            f"{p.k8s.token_secret} --from-literal=token=$(openssl rand -hex 32)"
        )
    return "".join(f"# {line}\n" for line in lines)
