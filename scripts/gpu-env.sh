# The GPU machine's environment, sourced by every script that runs there (from the repository
# root): CUDA's tools on PATH, and NVLink multicast off for NCCL, torch's symmetric memory and
# NVSHMEM, which these machines must never use (DESIGN.md section 2.8).
export PATH="$PATH:/usr/local/cuda/bin"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
