"""The ``[k8s]`` section: what ``tandem-k8s render`` puts in the manifests it writes (a JobSet or
a Kubeflow Trainer v2 TrainJob; tandem/k8s/render.py). Training never reads it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from tandem.rl.core.configlib import require

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_TAINT = re.compile(
    r"^([A-Za-z0-9./_-]+)(=([A-Za-z0-9._-]*))?(:(NoSchedule|PreferNoSchedule|NoExecute))?$"
)


def parse_toleration(text: str) -> dict[str, str]:
    """``key[=value][:Effect]`` (kubectl's taint syntax) -> a pod toleration: ``Equal`` with a
    value, ``Exists`` without; no effect tolerates every effect. ValueError on anything else."""
    m = _TAINT.match(text)
    if not m:
        raise ValueError(f"{text!r} is not key[=value][:NoSchedule|PreferNoSchedule|NoExecute]")
    key, _, value, _, effect = m.groups()
    out = {"key": key, "operator": "Equal" if value is not None else "Exists"}
    if value is not None:
        out["value"] = value
    if effect:
        out["effect"] = effect
    return out


@dataclass
class K8sConfig:
    """Kubernetes manifests of ``tandem-k8s render`` (docs/kubernetes.md); training ignores it."""

    name: str | None = None  # the JobSet / TrainJob name (a DNS label); none = job.name
    namespace: str = "default"  # where the objects go
    image: str = "tandem:latest"  # an image with this repository at /workspace (docker/Dockerfile)
    gpus_per_node: int = 0  # GPUs each training pod asks for, one torchrun process each; 0 =
    # plan.devices_per_node, else 8
    gpu_resource: str = "nvidia.com/gpu"  # the extended resource name of a GPU
    cpus_per_node: int = 32  # CPU request of each training pod
    memory_gb_per_node: int = 0  # memory request of each training pod; 0 = none
    node_selector: dict[str, str] = field(default_factory=dict)  # training pods' nodeSelector,
    # e.g. {"nvidia.com/gpu.product" = "NVIDIA-H100-80GB-HBM3"}
    tolerations: list[str] = field(default_factory=lambda: ["nvidia.com/gpu:NoSchedule"])  # the
    # training pods tolerate these taints, each key[=value][:Effect]
    volume_claim: str = "tandem-shared"  # the ReadWriteMany PersistentVolumeClaim every pod
    # mounts (rendered too): checkpoints, metrics and the torchrun logs
    volume_gb: int = 1000  # its size
    storage_class: str | None = None  # its storageClassName; none = the cluster's default
    mount: str = "/shared"  # where it is mounted; the dump folder is <mount>/outputs/<name>
    rdzv_port: int = 29500  # the leader pod's c10d rendezvous port
    max_restarts: int = 3  # JobSet failurePolicy.maxRestarts, the Job's backoffLimit and
    # torchrun's --max-restarts
    restart_strategy: Literal["InPlaceRestart", "Recreate"] = "InPlaceRestart"  # JobSet's
    # failurePolicy.restartStrategy: InPlaceRestart restarts the containers in their pods (a JobSet
    # release with that strategy), Recreate makes new pods
    grace_s: int = 0  # terminationGracePeriodSeconds: SIGTERM to SIGKILL; 0 = derived: k8s.step_s +
    # the planner's checkpoint write time at k8s.write_gbps + 30 s
    step_s: float = 300.0  # longest step of the run (SIGTERM stops at the end of the step in
    # flight); for the derived grace
    write_gbps: float = 1.0  # GB/s one node writes to the shared volume; for the derived grace
    envd_pods: int = 0  # CPU-only pods running tandem-envd (env.workers and reward.workers point
    # at them); 0 = the workers stay in the training pods
    envd_cpus: int = 16  # CPU request of each envd pod
    envd_port: int = 7000  # the port tandem-envd listens on
    envd_node_selector: dict[str, str] = field(default_factory=dict)  # envd pods' nodeSelector
    token_secret: str = "tandem-envd"  # the Secret (key "token") with envd's shared token

    def validate(self) -> None:
        if self.name is not None:
            require(
                bool(_DNS_LABEL.match(self.name)) and len(self.name) <= 40,
                f"k8s.name: {self.name!r} must be a DNS label of at most 40 characters "
                "(a-z, 0-9, '-'), so the pods' host names fit in 63",
            )
        for key in ("gpus_per_node", "memory_gb_per_node", "envd_pods", "max_restarts", "grace_s"):
            value = getattr(self, key)
            require(value >= 0, f"k8s.{key}: must be >= 0, got {value}")
        for key in ("cpus_per_node", "volume_gb", "envd_cpus"):
            value = getattr(self, key)
            require(value >= 1, f"k8s.{key}: must be >= 1, got {value}")
        for key in ("rdzv_port", "envd_port"):
            value = getattr(self, key)
            require(1 <= value <= 65535, f"k8s.{key}: must be a port in [1, 65535], got {value}")
        require(self.step_s > 0, f"k8s.step_s: must be > 0, got {self.step_s}")
        require(self.write_gbps > 0, f"k8s.write_gbps: must be > 0, got {self.write_gbps}")
        require(
            self.mount.startswith("/"), f"k8s.mount: must be an absolute path, got {self.mount!r}"
        )
        for text in self.tolerations:
            try:
                parse_toleration(text)
            except ValueError as e:
                require(False, f"k8s.tolerations: {e}")
