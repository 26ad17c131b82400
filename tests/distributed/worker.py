"""Runs a list of jobs in one process group (torchrun's variables) or one plain process, writes results as JSON.

Starting processes costs seconds on 2 cores, so one launch runs many trainer runs and checks. The
tests start it as `procs.Workers(SPEC, OUT, nprocs=N)` (forked from a preloaded forkserver, with
torchrun's variables for N > 1); `python worker.py SPEC.json OUT.json` or `torchrun
--nproc-per-node=N worker.py SPEC.json OUT.json` run it by hand. SPEC: {"base_dir": ..., "jobs": [...]}, each job
one of
  {"kind": "train", "name": ..., "recipe": {...}, "copy_run": {"src": ..., "keep_step": 3}?,
   "compile_backend": "aot_eager"?}
  {"kind": "memory", "name": ..., "model_dir": ..., "strategy": ...}
  {"kind": "export", "name": ..., "recipe": {...}, "checkpoint": ..., "out": ...}
  {"kind": "lora_hf_load", "name": ..., "model_dir": ...}
  {"kind": "token_counts", "name": ..., "recipe": {...}, "world_size": 2}
  {"kind": "qlora_shards", "name": ..., "recipe": {...}}   (sharded 4-bit base: bytes, load peak, forward)
  {"kind": "export_run", "name": ..., "run_dir": ..., "out": ...}
  {"kind": "ends", "name": ..., "model_dir": ...}   (which FSDP2 unit holds the embeddings and LM head)
  {"kind": "ddp_reduce", "name": ...}   (the dtype DDP all-reduces fp32 gradients in, per reduce_dtype)
  {"kind": "keys", "name": ..., "recipe": {...}}   (shards filled from a released layout vs from_pretrained)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from homelab_ft.distributed import comm, parallelize
from homelab_ft.plan.planner import recipe_shape
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rung import Rung, rung_for
from homelab_ft.store import runlock
from homelab_ft.train import preflight, trainer
from homelab_ft.train.build import build_model


def _copy_run(src: Path, dst: Path, *, keep_step: int) -> None:
    """A run directory as it would be after a crash right after the checkpoint of `keep_step`."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").iterdir():
        if ckpt.name.startswith("step_") and int(ckpt.name.split("_")[1]) > keep_step:
            shutil.rmtree(ckpt)


def _lora_fsdp(env) -> Rung:
    return Rung("lora", "full_shard", False, procs_per_node=env.world_size)


def run_train(job: dict, env, base_dir: Path) -> dict:
    if "copy_run" in job:
        if env.is_main:
            spec = job["copy_run"]
            _copy_run(Path(spec["src"]), Path(job["recipe"]["output"]["dir"]), keep_step=spec["keep_step"])
        if env.distributed:
            torch.distributed.barrier()
    recipe = recipe_from_dict(job["recipe"], source=job["name"])
    rung = rung_for(recipe)
    if "compile_backend" in job:  # aot_eager: dynamo and AOTAutograd without inductor's minutes of g++
        from homelab_ft.model import compiling

        compiling.BACKEND = job["compile_backend"]
    if job.get("reset_adapters"):  # a one-process LoRA reference with the adapters a pipeline draws
        _reset_lora_adapters(recipe.train.seed)
    if job.get("replay_rollouts"):  # GRPO's completions a function of the prompt, however it is batched
        _replay_rollouts()
    grads: list[dict] = []
    if "capture_grads" in job:
        _capture_grads(grads)
    try:
        # the facts the CLI hands down with its plan: the planner's reading of the model (cached shape)
        inputs = preflight.check_inputs(recipe, rung=rung, facts=recipe_shape(recipe)[0].facts, device_type=env.device.type)
        result = trainer._train(recipe, env=env, rung=rung, plan=None, inputs=inputs, base_dir=base_dir)
    finally:
        trainer.train_step = _TRAIN_STEP
        _restore_rollouts()
        runlock.release(recipe.run_dir)  # as trainer.train does; a copy of this run must not look held
    if "capture_grads" in job:
        torch.save(grads, f"{job['capture_grads']}.rank{env.rank}.pt")
    return {"losses": result.losses, "eval_loss": None if result.eval_loss is None else float(result.eval_loss),
            "eval_reward": result.eval_reward}


_TRAIN_STEP = trainer.train_step


def _replay_rollouts() -> None:
    """GRPO's engine with sampling replaced by a fixed function of each prompt and generation index
    (its tokens and where it ends), so that one process and two ranks train on the same completions
    whatever rows they are batched with; the layout, rewards, advantages and loss stay the real ones."""
    from homelab_ft.train import rollout

    def sample(self, model, rows, *, seed, greedy=False, num_generations=None):
        g = self.settings.num_generations if num_generations is None else num_generations
        prompts = [list(r["prompt_ids"]) for r in rows for _ in range(g)]
        ids, mask = rollout.left_padded(prompts, pad_token_id=self.tokenizer.pad_token_id, device=self.device)
        ends = rollout.end_token_ids(self.tokenizer, model)
        width = self.settings.max_completion_length
        tails = []
        for i, p in enumerate(prompts):
            key = sum(p) * 7 + (0 if greedy else i % g) * 13
            length = 1 + key % width  # a completion of `length` tokens, the last an end token unless it fills the width
            tokens = [10 + (key + 31 * t) % 280 for t in range(length)]
            if length < width:
                tokens[-1] = ends[0]
            tails.append(tokens + [self.tokenizer.pad_token_id] * (width - length))
        out = torch.cat([ids, torch.tensor(tails, device=self.device)], dim=1)
        return self.rollout(out, prompt_ids=ids, prompt_mask=mask, ends=ends, rows=rows, g=g)

    rollout.Colocated.sample = sample


def _restore_rollouts() -> None:
    from homelab_ft.train import rollout

    rollout.Colocated.sample = _SAMPLE


def _sample_method():
    from homelab_ft.train import rollout

    return rollout.Colocated.sample


_SAMPLE = _sample_method()


def _capture_grads(grads: list[dict]) -> None:
    """Record every trainable gradient of each step (after clipping, before the optimizer step)."""

    def step(s, micro_batches):
        optimizer_step = s.optimizer.step

        def recording(*args, **kwargs):
            grads.append({n: p.grad.detach().clone() for n, p in s.model.named_parameters()
                          if p.grad is not None})
            return optimizer_step(*args, **kwargs)

        s.optimizer.step = recording
        try:
            return _TRAIN_STEP(s, micro_batches)
        finally:
            s.optimizer.step = optimizer_step

    trainer.train_step = step


def _reset_lora_adapters(seed: int) -> None:
    from homelab_ft.model import loading

    attach = loading.attach_lora

    def attach_and_reset(model, lora_cfg, **kwargs):
        model = attach(model, lora_cfg, **kwargs)
        loading.reset_adapters(model, seed=seed)
        return model

    loading.attach_lora = attach_and_reset


def run_memory(job: dict, env) -> dict:
    """Per-rank bytes of parameters, gradients and optimizer state, against the unsharded totals."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from homelab_ft.recipe.config import TrainConfig
    from homelab_ft.train import optim

    def local(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model = parallelize.parallelize(model, env, rung=Rung("full", job["strategy"], False, procs_per_node=env.world_size))
    optimizer = optim.build_optimizer(model, TrainConfig(lr=1e-3))
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(env.rank))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = sum(local(p.grad) for p in model.parameters() if p.grad is not None)
    optimizer.step()
    states = sum(local(v) for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
    params = sum(local(p) for p in model.parameters())
    return {"params": params / total, "grads": grads / total, "optim": states / (2 * total)}


def run_ends(job: dict, env) -> dict:
    """One chunked-loss forward and backward of a full_shard model, recording when the embeddings
    and the LM head are gathered: their own units (untied) or the root's (tied), all-gathers and
    post-backwards per unit (counted on FSDP2's param groups: torch 2.13 internals, so a torch
    that renames them fails here loudly), and the head's state while backward runs the blocks."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from homelab_ft.train.loss import batch_loss_sum

    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    model = parallelize.parallelize(model, env, rung=Rung("full", "full_shard", False, procs_per_node=env.world_size))
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    events: list[tuple[str, str]] = []
    unshard, post_backward = FSDPParamGroup.unshard, FSDPParamGroup.post_backward

    def counted_unshard(group, async_op=False):
        before = group.is_unsharded or group._all_gather_result is not None
        unshard(group, async_op)
        if not before and (group.is_unsharded or group._all_gather_result is not None):
            events.append(("all_gather", group._module_fqn))

    def counted_post_backward(group, *args):
        events.append(("post_backward", group._module_fqn))
        return post_backward(group, *args)

    def gathered(module) -> bool:
        return not isinstance(module.weight, DTensor)

    def in_block_backward(module, grad_output):
        events.append(("block_backward", f"head gathered={gathered(head)}"))

    model.model.layers[-1].register_full_backward_pre_hook(in_block_backward)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(env.rank))
    labels = ids.clone()
    labels[:, :4] = -100
    FSDPParamGroup.unshard, FSDPParamGroup.post_backward = counted_unshard, counted_post_backward
    try:
        summed = batch_loss_sum(model, {"input_ids": ids, "labels": labels}, device=env.device, chunk_tokens=8)
        after_forward = {"embed": gathered(embed), "head": gathered(head)}
        events.append(("backward", ""))
        summed.backward()
    finally:
        FSDPParamGroup.unshard, FSDPParamGroup.post_backward = unshard, post_backward
    return {
        "embed_unit": isinstance(embed, FSDPModule), "head_unit": isinstance(head, FSDPModule),
        "gathered_after_forward": after_forward,
        "gathered_after_backward": {"embed": gathered(embed), "head": gathered(head)},
        "grads": {"embed": embed.weight.grad is not None, "head": head.weight.grad is not None},
        "events": events,
    }


def run_ddp_reduce(env) -> dict:
    """One fp32 gradient per rank, 1 + (rank + 1) / 4096, all-reduced by `parallelize`'s DDP with each
    reduce_dtype: fp32 averages it exactly (1 + 1.5 / 4096); bf16 (8 significant bits) would round
    each half to 0.5 first, an average of exactly 1.0."""
    out = {}
    for name in ("float32", "bfloat16"):
        layer = torch.nn.Linear(1, 1, bias=False)
        wrapped = parallelize.parallelize(layer, env, rung=Rung("lora", "no_shard", False, procs_per_node=env.world_size),
                                          reduce_dtype=getattr(torch, name))
        wrapped(torch.full((1, 1), 1 + (env.rank + 1) / 4096)).sum().backward()
        out[name] = float(layer.weight.grad)
    return out


def run_export(job: dict, env, base_dir: Path) -> dict:
    """Load a sharded checkpoint into a fresh sharded model, then compare its logits with the
    consolidated HF export loaded by from_pretrained."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from homelab_ft.export.consolidate import consolidate_to_hf
    from homelab_ft.model import loading
    from homelab_ft.store.model_state import trainable_state

    recipe = recipe_from_dict(job["recipe"], source=job["name"])
    model_dir = loading.resolve_model_dir(recipe.model.path)
    model = build_model(recipe, model_dir=model_dir, facts=recipe_shape(recipe)[0].facts, rung=rung_for(recipe), env=env)
    with torch.no_grad():  # in place, into this rank's shards, as checkpoint.load does
        dcp.load({"model": trainable_state(model)}, checkpoint_id=Path(job["checkpoint"]) / "state")
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(7))
    model.eval()
    with torch.no_grad():
        sharded = model(input_ids=ids).logits
    result = {}
    if env.is_main:
        out = Path(job["out"])
        read_back = consolidate_to_hf(Path(job["checkpoint"]), model_dir, out)
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            plain = reloaded(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            untrained = base(input_ids=ids).logits
        result = {
            "max_abs_diff": float((plain - sharded).abs().max()),
            "diff_from_base": float((untrained - sharded).abs().max()),
            "read_back": read_back,
            "head_tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "head_written": "lm_head.weight" in _safetensors_keys(out),
        }
    return result


def _safetensors_keys(model_dir: Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            keys.update(f.keys())
    return keys


def run_token_counts(job: dict, base_dir: Path) -> dict:
    """Trained tokens per rank and step that a run on `world_size` ranks sees (no training)."""
    from homelab_ft.data import collate, prepare_data
    from homelab_ft.data.sampling import MicroBatchSampler
    from homelab_ft.model import loading
    from homelab_ft.train import steps

    recipe = recipe_from_dict(job["recipe"], source=job["name"])
    cfg = recipe.train
    model_dir = loading.resolve_model_dir(recipe.model.path)
    tokenizer = loading.load_tokenizer(recipe.model, model_dir)
    data = prepare_data(recipe.data, tokenizer, seed=cfg.seed, base_dir=base_dir)
    counts = []
    for rank in range(job["world_size"]):
        sampler = MicroBatchSampler(len(data.train), micro_batch_size=cfg.micro_batch_size, seed=cfg.seed, rank=rank,
                                    world_size=job["world_size"], shuffle=recipe.data.shuffle)
        per_step = []
        for _ in range(cfg.max_steps):
            mbs = [collate([data.train[i] for i in sampler.next_indices()], pad_token_id=tokenizer.pad_token_id)
                   for _ in range(cfg.grad_accum_steps)]
            per_step.append(sum(steps.trained_tokens(mb["labels"]) for mb in mbs))
        counts.append(per_step)
    return {"per_rank": counts}


def run_lora_hf_load(job: dict, env) -> dict:
    """LoRA on a base read per rank from safetensors: adapters from PEFT's init, sliced per rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from homelab_ft.distributed import sharded_loading
    from homelab_ft.model import loading
    from homelab_ft.recipe.config import LoraConfig

    def build():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(job["model_dir"]), dtype=torch.float32)
        return loading.attach_lora(model, LoraConfig(r=4, dropout=0.0))

    def load_full():
        model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
        return loading.attach_lora(model, LoraConfig(r=4, dropout=0.0))

    model = sharded_loading.build_sharded(env, build=build, source=sharded_loading.FromSafetensors(Path(job["model_dir"])),
                                          rung=_lora_fsdp(env))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    base = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    with torch.no_grad():
        ref = base(input_ids=ids).logits
    rank0 = sharded_loading.build_sharded(env, build=build, source=sharded_loading.FromRank0(load_full), rung=_lora_fsdp(env))
    with torch.no_grad():
        rank0_logits = rank0(input_ids=ids).logits
    inner = model.get_base_model()
    a = [v for k, v in full.items() if ".lora_A." in k]
    b = [v for k, v in full.items() if ".lora_B." in k]
    return {
        "logit_diff": float((logits - ref).abs().max()),  # B = 0: the adapted model starts as the base
        "rank0_logit_diff": float((rank0_logits - ref).abs().max()),
        "head_tied": inner.lm_head.weight is inner.model.embed_tokens.weight,
        "b_zero": all(bool((t == 0).all()) for t in b),
        "a_rows_distinct": all(len({tuple(r) for r in t.tolist()}) == t.shape[0] for t in a),
        "a_nonzero": all(float(t.abs().max()) > 0 for t in a),
    }


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_qlora_shards(job: dict, env) -> dict:
    """The sharded 4-bit base: per-rank packed bytes against the total, the loading peak (process
    RSS, measured) against shards + one block, and the forward against the unsharded 4-bit model
    loaded the one-GPU way (`from_pretrained(quantization_config=...)`, uint8 storage).

    Run it first in a fresh process: the peak is read from ru_maxrss, which is only this job's
    peak when the process never held more before (checked: `baseline_valid`).
    """
    import gc

    import bitsandbytes  # noqa: F401  (imports before the baseline: they are not loading memory)
    import peft  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM  # noqa: F401

    from homelab_ft.distributed import sharded_qlora  # noqa: F401  (imported before the baseline too)
    from homelab_ft.model import quant

    recipe = recipe_from_dict(job["recipe"], source=job["name"])
    model_dir = Path(recipe.model.path)
    rung = rung_for(recipe)
    facts = recipe_shape(recipe)[0].facts
    gc.collect()
    rss_before, maxrss_before = _rss_bytes(), _maxrss_bytes()
    model = build_model(recipe, model_dir=model_dir, facts=facts, rung=rung, env=env)
    gc.collect()
    maxrss_after = _maxrss_bytes()
    cls = quant.linear4bit_class()
    local = total = 0
    for module in model.modules():
        if isinstance(module, cls):
            w = module.weight
            local += w.to_local().numel() * w.element_size()
            total += w.numel() * w.element_size()
    all_local = sum(p.to_local().numel() * p.element_size() if isinstance(p, DTensor) else p.numel() * p.element_size()
                    for p in model.parameters())
    states = sum(quant.state_nbytes(m.quant_state) for m in model.modules() if isinstance(m, cls))
    from safetensors import safe_open

    block_bytes = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as fh:
        for key in fh.keys():
            if key.startswith("model.layers.0."):
                t = fh.get_slice(key)
                block_bytes += torch.Size(t.get_shape()).numel() * 4  # fp32 on disk (tiny.make_llama)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        sharded = model(input_ids=ids).logits
    result = {
        "storage_ratio": local / total,
        "local_model_bytes": all_local,
        "quant_state_bytes": states,
        "block_bytes": block_bytes,
        "load_peak_bytes": maxrss_after - rss_before,
        "baseline_valid": maxrss_before - rss_before < 16 * 2**20,
    }
    del model
    if env.is_main:
        with torch.no_grad():
            plain = _one_gpu_qlora(recipe, model_dir)(input_ids=ids).logits
        result["forward_max_abs_diff"] = float((plain - sharded).abs().max())
    return result


def _one_gpu_qlora(recipe, model_dir: Path):
    """The 4-bit model loaded the one-GPU way (`from_pretrained(quantization_config=...)`, uint8
    storage) with the recipe's adapters drawn as training draws them: what a sharded QLoRA equals."""
    from homelab_ft.model import loading, quant

    ref = loading.load_model(recipe.model, model_dir, dtype=torch.float32, device=torch.device("cpu"),
                             quantization_config=quant.bnb_config(recipe.quant, device="cpu"))
    quant.after_load(ref)
    ref = loading.attach_lora(ref, recipe.lora)
    loading.reset_adapters(ref, seed=recipe.train.seed)
    return ref


def run_keys(job: dict, env) -> dict:
    """The recipe's model built the way training does (`build_model`: meta-init, FSDP2, then each
    rank fills its shards from the safetensors in their released layout): for `full`, the gathered
    state dict and the logits against what `from_pretrained` loads from the same folder; for QLoRA,
    the logits against the one-GPU 4-bit model (test_checkpoint_keys_fsdp.py)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    recipe = recipe_from_dict(job["recipe"], source=job["name"])
    model_dir = Path(recipe.model.path)
    model = build_model(recipe, model_dir=model_dir, facts=recipe_shape(recipe)[0].facts, rung=rung_for(recipe), env=env)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    result = {}
    if recipe.method == "full":
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if env.is_main:
            ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            expected = ref.state_dict()
            result["missing"] = sorted(set(expected) - set(full))[:5]
            result["unexpected"] = sorted(set(full) - set(expected))[:5]
            result["unequal"] = sorted(n for n in full if n in expected and not torch.equal(full[n], expected[n]))[:5]
            result["num_tensors"] = len(full)
            with torch.no_grad():
                result["logit_diff"] = float((ref(input_ids=ids).logits - logits).abs().max())
    elif env.is_main:
        with torch.no_grad():
            result["logit_diff"] = float((_one_gpu_qlora(recipe, model_dir)(input_ids=ids).logits - logits).abs().max())
    return result


def run_export_run(job: dict) -> dict:
    """`homelab-ft export` of a run: the merged model loads with from_pretrained, and differs from the base."""
    from transformers import AutoModelForCausalLM

    from homelab_ft.export.run import export_run

    res = export_run(Path(job["run_dir"]), Path(job["out"]))
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(7))
    merged = AutoModelForCausalLM.from_pretrained(job["out"], dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
    with torch.no_grad():
        moved = float((merged(input_ids=ids).logits - base(input_ids=ids).logits).abs().max())
    return {"max_abs_diff": res.max_abs_diff, "diff_from_base": moved}


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    base_dir = Path(spec["base_dir"])
    env = comm.setup(device_pref="cpu", timeout_s=120)
    results = {"world_size": env.world_size, "num_nodes": env.num_nodes}
    for job in spec["jobs"]:
        if job["kind"] == "train":
            results[job["name"]] = run_train(job, env, base_dir)
        elif job["kind"] == "memory":
            results[job["name"]] = run_memory(job, env)
        elif job["kind"] == "lora_hf_load":
            results[job["name"]] = run_lora_hf_load(job, env)
        elif job["kind"] == "token_counts":
            results[job["name"]] = run_token_counts(job, base_dir)
        elif job["kind"] == "qlora_shards":
            results[job["name"]] = run_qlora_shards(job, env)
        elif job["kind"] == "ddp_reduce":
            results[job["name"]] = run_ddp_reduce(env)
        elif job["kind"] == "ends":
            results[job["name"]] = run_ends(job, env)
        elif job["kind"] == "keys":
            results[job["name"]] = run_keys(job, env)
        elif job["kind"] == "export_run":
            results[job["name"]] = run_export_run(job)
        elif job["kind"] == "export":
            results[job["name"]] = run_export(job, env, base_dir)
        else:
            raise ValueError(job["kind"])
    if env.is_main:
        Path(out_path).write_text(json.dumps(results, indent=1))
    comm.teardown(env)
    return 0


if __name__ == "__main__":
    comm.exit_now(main(*sys.argv[1:3]))
