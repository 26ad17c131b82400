"""Host RAM on node 0 of one option: the processes, what they offload, and what loading holds.

Split from memory.py (which prices the device) so each stays readable; memory.estimate calls these.
"""

from __future__ import annotations

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.price.params import one_process_loading_bytes, sharded_qlora_loading_bytes
from homelab_ft.plan.shape.shapes import ModelShape
from homelab_ft.rung import Rung

# Host RAM a CUDA training process keeps besides tensors (CUDA runtime, kernels, python heap).
CUDA_HOST_PROCESS_BYTES = 2 * 1024**3


def loading_bytes(shape: ModelShape, rung: Rung, request: PlanRequest, cluster: Cluster, *, base_bytes: int,
                   sharded: bool) -> int:
    """Host RAM of a sharded load on node 0: LoRA/full take rank 0's whole copy; QLoRA fills its
    shards tensor by tensor, on every local rank. Unsharded loads: `one_process_load_host_bytes`."""
    if not sharded:
        return 0
    if rung.quantized_enabled:
        return cluster.gpus_per_node * sharded_qlora_loading_bytes(shape, request, cluster)
    return base_bytes


def host_bytes(*, device_total: int, offloaded: int, loading: int, cluster: Cluster) -> int:
    """Host RAM on node 0. On a CPU 'device' this is every process's memory. On GPUs: the process
    overhead, offloaded shards of every local rank, and, for sharded runs, one full copy of the
    weights that rank 0 loads before broadcasting (sharded_loading's rank-0 load), or for a sharded
    4-bit base one tensor per local rank (`loading`; single-device loads stream safetensors from
    the page cache straight to the GPU)."""
    per_node = cluster.gpus_per_node
    if cluster.device == "cpu":
        return device_total * per_node
    return per_node * (CUDA_HOST_PROCESS_BYTES + offloaded) + loading


def one_process_load_host_bytes(shape: ModelShape, *, held_on_cpu: int, rung: Rung, request: PlanRequest,
                                 cluster: Cluster) -> int:
    """Host RAM on node 0 while unsharded processes load: each process (on a CPU 'device' its
    overhead and weights, `held_on_cpu`) and its load's temporaries (params.one_process_loading_bytes), freed before training
    adds its own (activation offload, a host embedding table): the host peak is the larger."""
    held = held_on_cpu if cluster.device == "cpu" else CUDA_HOST_PROCESS_BYTES
    return cluster.gpus_per_node * (held + one_process_loading_bytes(shape, rung, request, cluster))
