"""The model for a rung: three builders, each one sequence in torchtitan's `parallelize` order.

    load_whole   from_pretrained -> adapters -> activation checkpointing            (one process, DDP)
    build_from_meta  meta -> adapters -> checkpointing -> shard (FSDP2) -> fill     (FSDP2; 4-bit MoE)
    build_stage  meta -> adapters -> cut to this rank's stage -> fill -> schedule   (pipeline)

One process and DDP load the base the ordinary way (`from_pretrained`, 4-bit through bitsandbytes
for QLoRA) and every rank holds all of it. FSDP builds the architecture on meta, shards it, and only
then fills this rank's shards from a typed source: rank 0's ordinary load for LoRA (bit-identical
to one process), per-rank safetensors reads for a full fine-tune, per-block quantisation for QLoRA.
A QLoRA base with fused MoE experts takes the meta build and the per-block 4-bit fill on one
process and DDP too, unsharded (distributed/sharded_experts.py says why: bitsandbytes' load would
hold the experts whole in the compute dtype). Every QLoRA rung takes its adapters from the seed
alone (`loading.initial_adapters`), so 1 process, DDP and FSDP start from the same ones.

What the builders ask of the model (fused experts? vocabulary?) comes from the plan's `ModelFacts`
(homelab_ft/model_facts.py), not from config.json again; config.json is read here once, by a
builder that builds the architecture from it (`_meta_architecture`). Adapters are attached in one
place (`_with_adapters`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from homelab_ft.distributed import parallelize, pipeline, sharded_loading
from homelab_ft.errors import UserError
from homelab_ft.model import loading, quant
from homelab_ft.model.blocks import enable_activation_checkpointing
from homelab_ft.model_facts import ModelFacts
from homelab_ft.recipe.config import Recipe
from homelab_ft.rules import refusals, vision
from homelab_ft.rung import Rung, RungError
from homelab_ft.train import host_embedding


@dataclass(frozen=True)
class Dtypes:
    """The three dtypes of a rung, decided once from the recipe and the device."""

    compute: torch.dtype
    """Weights and activations on the device: model.dtype, or quant.compute_dtype for QLoRA (the
    dtype the 4-bit matmuls dequantize to, and the storage dtype of the sharded 4-bit bytes)."""
    param: torch.dtype
    """What FSDP2 gathers and computes in (sharding.param_dtype, auto = compute). For QLoRA it must be
    compute: the packed bytes are stored as that dtype and a cast would destroy them
    (sharded_qlora.check_recipe refuses anything else)."""
    reduce: torch.dtype
    """What gradients are reduced in across ranks (sharding.reduce_dtype)."""


def dtypes_for(recipe: Recipe, *, rung: Rung, device: torch.device) -> Dtypes:
    """The rung's compute, gathered-parameter and gradient-reduction dtypes."""
    if rung.quantized_enabled:
        compute = quant.compute_dtype(recipe.quant, device=device)
    else:
        compute = loading.resolve_dtype(recipe.model.dtype, device)
    sharding = recipe.sharding
    param = compute if sharding.param_dtype == "auto" else getattr(torch, sharding.param_dtype)
    return Dtypes(compute=compute, param=param, reduce=getattr(torch, sharding.reduce_dtype))


def build_for(recipe: Recipe, *, model_dir: Path, facts: ModelFacts, rung: Rung, env,
              pad_token_id: int) -> tuple[nn.Module, object]:
    """The model to train and, when the rung is pipelined, the Pipeline that runs this rank's stage (else None)."""
    if rung.pipeline_enabled:
        if why := refusals.trained_router(rung, train_router=recipe.lora.train_router):
            raise RungError(why)
        return build_stage(recipe, model_dir=model_dir, facts=facts, rung=rung, env=env, pad_token_id=pad_token_id)
    return build_model(recipe, model_dir=model_dir, facts=facts, rung=rung, env=env), None


def build_model(recipe: Recipe, *, model_dir: Path, facts: ModelFacts, rung: Rung, env) -> nn.Module:
    """The model to train for a rung that does not pipeline: sharded when the rung shards, else
    whole on every rank (replicated by DDP when there are several)."""
    dtypes = dtypes_for(recipe, rung=rung, device=env.device)
    if rung.fsdp_enabled or (rung.quantized_enabled and facts.has_fused_experts):
        model = build_from_meta(recipe, model_dir=model_dir, rung=rung, env=env, dtypes=dtypes)
    else:
        model = load_whole(recipe, model_dir=model_dir, rung=rung, device=env.device, dtype=dtypes.compute)
    if rung.adapters_enabled:  # its hook is prepended, so it runs before checkpointing's input hook
        host_embedding.apply(model, recipe, rung=rung, device=env.device)  # train.embedding_offload
    else:  # a full fine-tune of a model loaded with a vision tower trains its language model (rules/vision.py)
        vision.freeze(model, targets=() if recipe.lora.target_modules == "all-linear" else recipe.lora.targets)
    if env.distributed and not rung.fsdp_enabled:
        # Replicas (DDP) over the trainable parameters: only adapter (or full) gradients are reduced.
        model = parallelize.parallelize(model, env, rung=rung, param_dtype=dtypes.param, reduce_dtype=dtypes.reduce)
    return model


def load_whole(recipe: Recipe, *, model_dir: Path, rung: Rung, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The whole model on `device`: `from_pretrained` (QLoRA's 4-bit base frozen and guarded,
    quant.py says why), its adapters (a QLoRA rung's drawn as the sharded 4-bit build draws them),
    activation checkpointing."""
    model = _with_adapters(_load_base(recipe, model_dir=model_dir, rung=rung, device=device, dtype=dtype),
                           recipe, rung=rung, dtype=dtype)
    if rung.quantized_enabled:
        loading.reset_adapters(model, seed=recipe.train.seed)  # the sharded 4-bit build's adapters
    if rung.activation_checkpointing:
        enable_activation_checkpointing(model)
    return model


def build_from_meta(recipe: Recipe, *, model_dir: Path, rung: Rung, env, dtypes: Dtypes) -> nn.Module:
    """Meta then fill (sharded_loading.build_sharded): the architecture on meta with its 4-bit
    layers and adapters, activation checkpointing, FSDP2 when the rung shards, this rank's memory
    allocated, then filled from `_weight_source`: its shards, or where nothing shards (a 4-bit base
    with fused MoE experts) the whole model."""
    if rung.quantized_enabled:
        _check_4bit_build(recipe, rung=rung, env=env, compute_dtype=dtypes.compute)
    config = _config(recipe, model_dir=model_dir)
    # uint8 where nothing shards: the storage of bitsandbytes' own one-GPU layers
    storage = None if rung.fsdp_enabled else torch.uint8
    model = sharded_loading.build_sharded(
        env,
        build=lambda: _meta_architecture(recipe, config=config, rung=rung, dtype=dtypes.compute, storage_dtype=storage),
        source=_weight_source(recipe, model_dir=model_dir, rung=rung, env=env, dtype=dtypes.compute),
        rung=rung,
        param_dtype=dtypes.param,
        reduce_dtype=dtypes.reduce,
        activation_checkpointing=rung.activation_checkpointing,
    )
    if rung.quantized_enabled and not rung.fsdp_enabled:
        quant.upcast_fp16(model)  # as prepare_for_training does; a sharded fp16 base is refused (check_recipe)
    return model


def build_stage(recipe: Recipe, *, model_dir: Path, facts: ModelFacts, rung: Rung, env, pad_token_id: int):
    """This rank's pipeline stage (distributed/pipeline.py): (its model, the Pipeline that runs it).
    The last stage ends in the chunked loss of every rung (loss.py), so the loss is the same sum."""
    dtypes = dtypes_for(recipe, rung=rung, device=env.device)
    if rung.quantized_enabled:  # each stage's base in 4 bits, quantised as the sharded 4-bit base is
        quant.require_bitsandbytes(device=env.device)
        refuse_pipelined_experts(facts, rung=rung)
    config = _config(recipe, model_dir=model_dir)
    return pipeline.build_pipeline(
        env, rung=rung, model_dir=model_dir, num_blocks=facts.num_blocks,
        build=lambda: _meta_architecture(recipe, config=config, rung=rung, dtype=dtypes.compute),
        loss_fn=_stage_loss(recipe, config=config, facts=facts), num_micro_batches=recipe.train.grad_accum_steps,
        pad_token_id=pad_token_id, width=recipe.data.max_length, adapter_seed=recipe.train.seed,
        activation_checkpointing=rung.activation_checkpointing)


def refuse_pipelined_experts(facts: ModelFacts, *, rung: Rung) -> None:
    """Pipeline stages quantize their blocks with the dense 4-bit fill only (pipeline.py); 4-bit
    experts in a stage are not built yet (refusals.four_bit_experts, which the ladder and preflight
    ask too)."""
    if why := refusals.four_bit_experts(rung, moe_experts=facts.has_fused_experts):
        raise RungError(why)


# --------------------------------------------------------------------------------------------
# the steps the builders share


def _config(recipe: Recipe, *, model_dir: Path):
    """config.json as transformers reads it, for a builder that builds the architecture from it."""
    from homelab_ft.model import family

    config = family.config_of(model_dir, trust_remote_code=recipe.model.trust_remote_code)
    config.use_cache = False
    return config


def _load_base(recipe: Recipe, *, model_dir: Path, rung: Rung, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`from_pretrained` onto the device; QLoRA's 4-bit base frozen and guarded (quant.py says why)."""
    if not rung.quantized_enabled:
        return loading.load_model(recipe.model, model_dir, dtype=dtype, device=device, images=rung.images)
    skip = quant.skipped(_config(recipe, model_dir=model_dir), images=rung.images)  # the tower stays 16-bit
    model = loading.load_model(recipe.model, model_dir, dtype=dtype, device=device, images=rung.images,
                               quantization_config=quant.bnb_config(recipe.quant, device=device, skip=skip))
    quant.refuse_8bit_experts(model, recipe.quant)
    quant.quantize_experts(model, recipe.quant)  # remote-code experts (no meta skeleton to find them first)
    quant.after_load(model)
    return quant.prepare_for_training(model)


def _meta_architecture(recipe: Recipe, *, config, rung: Rung, dtype: torch.dtype,
                       storage_dtype: torch.dtype | None = None) -> nn.Module:
    """The architecture of `config` (4-bit layers for QLoRA) with its adapters, no weights; built
    under `sharded_loading.meta_parameters` by the caller."""
    from homelab_ft.model import family

    attn = family.attention(recipe.model.attn_implementation, config=config, images=rung.images)
    model = vision.auto_class(config, images=rung.images).from_config(
        config, dtype=dtype, attn_implementation=attn, trust_remote_code=recipe.model.trust_remote_code)
    if rung.quantized_enabled:
        quant.to_4bit_layers(model, recipe.quant, compute_dtype=dtype, shard_size=rung.shard_size,
                             storage_dtype=storage_dtype, images=rung.images)
    model = _with_adapters(model, recipe, rung=rung, dtype=dtype)
    if rung.quantized_enabled:
        quant.plain_weights(model)
    return model


def _with_adapters(model: nn.Module, recipe: Recipe, *, rung: Rung, dtype: torch.dtype) -> nn.Module:
    """The one place adapters are attached (loading.attach_lora), on a loaded or a meta-built base."""
    if not rung.adapters_enabled:
        return model
    return loading.attach_lora(model, recipe.lora, compute_dtype=dtype)


def _check_4bit_build(recipe: Recipe, *, rung: Rung, env, compute_dtype: torch.dtype) -> None:
    """What the meta-built 4-bit base refuses: no bitsandbytes; a sharded recipe check_recipe refuses;
    8-bit fused experts (moe_experts packs them in 4 bits only)."""
    from homelab_ft.distributed import sharded_qlora

    quant.require_bitsandbytes(device=env.device)
    if rung.fsdp_enabled:
        sharded_qlora.check_recipe(recipe, compute_dtype=compute_dtype)
    elif recipe.quant.bits != 4:
        raise UserError("quant.bits=8: MoE experts are quantized in 4 bits only; set quant.bits=4 or method: lora")


def _stage_loss(recipe: Recipe, *, config, facts: ModelFacts):
    """The last stage's loss: loss.chunked_loss_sum of the final hidden states through the head,
    chunked as train.loss_chunk_tokens says (0, the full logits: one chunk of every position)."""
    from homelab_ft.rules.loss_chunks import chunk_rows
    from homelab_ft.train.loss import LogitTransform, chunked_loss_sum

    transform = LogitTransform.from_config(config)
    rows = chunk_rows(recipe.train.loss_chunk_tokens, vocab_size=facts.vocab_size)

    def loss(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module) -> torch.Tensor:
        return chunked_loss_sum(hidden, labels, head=head, chunk_tokens=rows or hidden.shape[0] * hidden.shape[1],
                                transform=transform, compiled=recipe.train.compile)

    return loss


def _weight_source(recipe: Recipe, *, model_dir: Path, rung: Rung, env, dtype: torch.dtype) -> sharded_loading.WeightSource:
    """Where the meta build's weights come from (sharded_loading.py and sharded_qlora.py say why each)."""
    if rung.quantized_enabled:
        from homelab_ft.distributed import sharded_qlora

        return sharded_qlora.FromSafetensors4bit(model_dir=model_dir, adapter_seed=recipe.train.seed,
                                                 compute_device=env.device)
    if not rung.adapters_enabled:
        return sharded_loading.FromSafetensors(model_dir=model_dir)
    # rank 0's one-process load, broadcast into the shards (QLoRA took the branch above)
    return sharded_loading.FromRank0(load_full=lambda: _with_adapters(
        _load_base(recipe, model_dir=model_dir, rung=rung, device=torch.device("cpu"), dtype=dtype),
        recipe, rung=rung, dtype=dtype))
