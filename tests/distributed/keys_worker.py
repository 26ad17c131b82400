"""2-process jobs for test_checkpoint_keys_fsdp.py: `python keys_worker.py SPEC.json OUT.json`.

SPEC: {"jobs": [{"name": ..., "recipe": {...}}, ...]}. Each job builds the recipe's model the way
training does (`train.build.build_model`: meta-init, FSDP2, then each rank fills its shards from
the safetensors), gathers the full state dict and, on rank 0, compares it (and the logits) with
what `from_pretrained` loads from the same folder; for QLoRA, the logits with the one-GPU 4-bit model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from homelab_ft.config import recipe_from_dict
from homelab_ft.distributed import comm
from homelab_ft.plan.planner import recipe_shape
from homelab_ft.rung import rung_for
from homelab_ft.train.build import build_model


def run_job(job: dict, env) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    from homelab_ft.model import loading, quant

    recipe = recipe_from_dict(job["recipe"], source=job["name"])
    model_dir = Path(recipe.model.path)
    rung = rung_for(recipe)
    model = build_model(recipe, model_dir=model_dir, facts=recipe_shape(recipe)[0].facts, rung=rung, env=env)
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
        ref = loading.load_model(recipe.model, model_dir, dtype=torch.float32, device=torch.device("cpu"),
                                 quantization_config=quant.bnb_config(recipe.quant, device="cpu"))
        quant.after_load(ref)
        ref = loading.attach_lora(ref, recipe.lora)
        loading.reset_adapters(ref, seed=recipe.train.seed)
        with torch.no_grad():
            result["logit_diff"] = float((ref(input_ids=ids).logits - logits).abs().max())
    return result


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    env = comm.setup(device_pref="cpu", timeout_s=120)
    results = {job["name"]: run_job(job, env) for job in spec["jobs"]}
    if env.is_main:
        Path(out_path).write_text(json.dumps(results, indent=1))
    comm.teardown(env)
    return 0


if __name__ == "__main__":
    comm.exit_now(main(*sys.argv[1:3]))
