"""Agreements between the planner and the runtime: each module is one rule that plan/ prices and
model/, train/ or distributed/ run, written once so the two cannot drift. Torch-free at import
(a rule that needs torch imports it inside the function that does).

    decoder_blocks     which modules are the decoder blocks (transformers' `_no_split_modules`)
    lora_targets       what `all-linear` wraps: PEFT's set less routers and kernel-read projections
    quant_rule         QLoRA's unquantizable share: the threshold and what counts towards it
    moe_marks          which modules transformers marks as fused MoE experts, and their projections
    moe_routers        an MoE model's routers: what `lora.train_router` trains, and its refusals
    loss_chunks        tokens per chunk of the chunked loss (`train.loss_chunk_tokens: auto`)
    embedding_offload  whether the frozen input embedding table lives in host RAM
    vision             which loaded models carry a vision tower, its modules: frozen, left out of all-linear, priced
    image_area         the size an image is resized to within data.image_max_pixels / image_min_pixels
    adapter_sync       the dtype a rollout node's adapters cross the link in (and are held in there)
    refusals           one function per trainer refusal: the ladder never offers, preflight refuses, with one reason

Nothing is re-exported here: import each name from its module.
"""
