# Source on the GPU host after the kit is installed (docs/getting-started.md, "An offline GPU host").
# The device's copy of the checkout has a stale .git: start a run with
# AUTOTUNE_SOURCE_COMMIT=<the local HEAD> so that benchmark reports name the right commit.
export PYTHONPATH=/root/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
