"""A process group with NCCL's device restriction, on a machine without GPUs (test helper).

NCCL serves CUDA tensors only: a collective on a CPU tensor fails with "No backend type associated
with device type cpu". gloo registered for the device type "cuda" alone (`init_process_group(
"cuda:gloo")`) has exactly that device map, so on this CPU machine every CPU tensor handed to the
default group is refused with NCCL's own error, while a group that serves the CPU (one made with
`new_group(backend="gloo")`) still works. The multi-process tests start their group this way, so
code that hands host tensors to the default group fails here as it would under NCCL.

What it cannot show: the device-side collectives of FSDP2 and DeepSpeed carry the model's own
tensors, which on a GPU are CUDA tensors (fine under NCCL) and here are CPU tensors; those runs use
plain gloo (`plain=True`), and bench/gpu_checks.sh runs them under real NCCL.
"""

import torch.distributed as dist

NCCL_LIKE = "cuda:gloo"


def init_group(plain: bool = False) -> None:
    dist.init_process_group("gloo" if plain else NCCL_LIKE)
    if not plain:
        assert dist.get_backend_config() == NCCL_LIKE, dist.get_backend_config()
