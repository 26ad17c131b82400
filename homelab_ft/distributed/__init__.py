"""Many processes, one model: everything that talks to `torch.distributed`.

    comm             the process group (`setup`, `teardown`), `DistEnv`, the few collectives the loop needs
    parallelize      `parallelize(model, env, rung=...)`: the mesh, FSDP2 per block and for the ends, or DDP
    sharded_loading  `build_sharded`: build on meta, shard, then fill each rank's slices from a `WeightSource`
    sharded_qlora    FSDP-QLoRA: 4-bit layers FSDP2 can shard, filled block by block (`FromSafetensors4bit`)
    sharded_experts  4-bit MoE experts in the meta-built base: filled per block, split along experts by FSDP2
    stages           a causal LM cut into pipeline stages: which blocks each holds, each stage's weights
    pipeline         this rank's stage run by torch.distributed.pipelining (`PipelineStage`, its schedules)

PyTorch's own engines only (FSDP2, DDP); no collective or sharding scheme is written here. Every
function is a no-op or plain call on one process, so the loop reads the same on one device and many.
"""
