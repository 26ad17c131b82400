"""The model itself, knowing nothing of ranks: find, load, quantize, adapt, compile.

    loading    where the weights are (`resolve_model_dir`; GGUF converted once), tokenizer, model, LoRA (PEFT)
    files      what a model folder must hold, from file headers: weights, safetensors entries, tokenizer files
    quant      bitsandbytes: the 4/8-bit config, the CPU guard, k-bit preparation, the meta-built base's
               4-bit layers FSDP2 can shard (`to_4bit_layers`), 8-bit optimizers
    moe_experts  fused MoE experts: packed 4-bit stacks, their checks and names, adapters on every expert
    blocks     the transformer blocks (from `_no_split_modules`) and activation checkpointing on them
    compiling  `train.compile`: torch.compile per block in place, and its preflight check
    checkpoint_keys  a model's tensors in a safetensors folder through transformers' key conversion
    family     what a family can do (attention, checkpointing, FSDP blocks), from its transformers class
    targets    what `all-linear` LoRA wraps: PEFT's set less routers and kernel-read Mamba projections
    moe_experts  MoE layers for QLoRA and LoRA: 4-bit fused experts and adapters on every expert
    processor  an image-text checkpoint's processor, offline (its video side left out without torchvision)
    routers    `lora.train_router`: an MoE model's routers trained in full (moe_routers.py finds them)

No per-family tables: what differs between architectures is read from transformers.
"""
