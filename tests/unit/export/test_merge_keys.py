"""The file-by-file merge (export/merge.py) on bases in their released layout (keys_models.py).

Before, the merge matched an adapted module to the base key `<module>.weight`, so a Qwen 3.5
image-text base (`model.language_model.*`) and Nemotron-H (`backbone.*`) stopped at "the base has
no weight for adapted modules". Now the key comes from transformers' own mapping: the merged
folder keeps the base's layout (vision tower included) and reloads with from_pretrained with the
logits of base + adapter.
"""

from __future__ import annotations

import pytest
import torch
from keys_models import save_original, saved_keys

from homelab_ft.export import merge

FAMILIES = ("qwen3_5", "qwen3_5_moe", "nemotron_h")




@pytest.mark.parametrize("family", FAMILIES)
def test_merge_reloads_with_base_plus_adapter_logits(tmp_path, family):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_dir = save_original(tmp_path / "base", family)
    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    # PEFT refuses LoRA on a Mamba mixer's out_proj (tuners_utils._check_lora_target_modules_mamba)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=["out_proj"],
                        init_lora_weights=False)
    peft_model = get_peft_model(base, config).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    adapted = merge.adapted_modules(tmp_path / "adapter")
    keys = merge.base_keys(base_dir)
    renamed = [m for m in adapted if keys.sources(f"{m}.weight") != (f"{m}.weight",)]
    assert renamed, "the adapted weights sit under their own names in the base: the test proves nothing"

    assert merge.unsupported_reason(tmp_path / "adapter", base_dir) is None
    stats = merge.merge_files(tmp_path / "adapter", base_dir, tmp_path / "out", dtype=torch.float32)
    assert stats["merged"] == len(adapted)
    assert saved_keys(tmp_path / "out") == saved_keys(base_dir)  # the base's own layout, vision tower included
    assert merge.check_written(tmp_path / "adapter", base_dir, tmp_path / "out", dtype=torch.float32) == 0.0

    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
        with peft_model.disable_adapter():
            moved = float((expected - peft_model(input_ids=ids).logits).abs().max())
    assert float((got - expected).abs().max()) <= 1e-5
    assert moved > 1e-3  # the adapter changes the logits, so equality above is the merge's doing


def test_lora_on_expert_parameters_takes_the_in_memory_merge(tmp_path):
    """PEFT's target_parameters adapt a stacked 3-D expert parameter, which the base stores per
    expert: not a one-to-one tensor, so the streaming merge hands it to PEFT's merge."""
    import json

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"r": 4, "lora_alpha": 8, "target_parameters": ["mlp.experts.gate_up_proj"]}))
    assert "target_parameters" in merge.unsupported_reason(tmp_path / "adapter", tmp_path)
