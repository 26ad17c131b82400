"""What one option costs: pure arithmetic over a model's shape, a rung, the request and the cluster.

    params       the parameters: base weights (quantized or not), adapters, optimizer state
    activations  one micro-batch: the activations kept for backward, the loss's logits, the recompute
    memory       one option's peak bytes per device (`estimate`), from params and activations
    host_ram     host RAM per node: the processes, what they offload, what loading holds
    network      seconds per step: compute, collectives over the links, offload copies, overlap
    images       an image-text model's vision tower per micro-batch: its bytes and seconds
    rollout      GRPO's generation: its KV cache and peak, decode and no-grad forward seconds per step
    pipeline     a pipelined option: per-stage memory, p2p bytes and time, the bubble, the stage split
    diskspace    one checkpoint's bytes on disk, and the warning when the disk is short

No torch, no devices; diskspace's free-space check is the one read of the machine.
"""
