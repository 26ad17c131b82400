"""Many processes, one model: everything that talks to `torch.distributed`.

    comm             the process group (`setup`, `teardown`), `DistEnv`, the few collectives the loop needs
    parallelize      `parallelize(model, env, rung=...)`: the mesh, FSDP2 per block and for the ends, or DDP
    sharded_loading  `build_sharded`: build on meta, shard, then fill each rank's slices from a `WeightSource`
    sharded_qlora    FSDP-QLoRA: the 4-bit base (model/quant.py's layers) filled block by block (`FromSafetensors4bit`)
    sharded_experts  the packed 4-bit experts filled expert by expert into this rank's shard
    stages, pipeline  pipeline parallelism: the stage cut and its checks; this rank's stage and torch's schedule
    rollout_link     grpo.rollout=node: a GRPO trainer's requests to its rollout rank, as broadcasts of tensors

PyTorch's own engines only (FSDP2, DDP); no collective or sharding scheme is written here. Every
function is a no-op or plain call on one process, so the loop reads the same on one device and many.
"""
