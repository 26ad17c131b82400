"""Every family of tests/families.py that homelab-ft writes as GGUF (issue 38): a tiny random model
of each written as f32 and read back, through gguf-py (the project's reader) and through
transformers' GGUF loader where it reads the architecture, both loaded into the model's own config,
equal the merged model's logits (identical, but for the two named in NOT_BIT_EXACT); written as q8_0
it is within the check's bound. For the families issue 38 added, the default export (`homelab-ft
export RUN --format gguf`, q8_0) of a LoRA run completes with its quality line. ~4 s a family;
`bench/gguf_families.py` prints the same as a table."""

from __future__ import annotations

import json

import build_recipe
import pytest
from families import ALL_EXPERTS, AS_RELEASED, save_tiny

from homelab_ft.cli.main import main
from homelab_ft.export.gguf import check as gguf_check
from homelab_ft.export.gguf import export as gguf_export

WRITTEN = {
    "smollm3": "smollm3",
    "olmo2": "olmo2",
    "olmo3": "olmo2",
    "gemma": "gemma",
    "gemma3_text": "gemma3",
    "granite": "granite",
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "glm4_moe": "glm4moe",
    "deepseek_v3": "deepseek2",
    "gpt_oss": "gpt-oss",
    "qwen3_5_text": "qwen35",
    "qwen3_5_moe_text": "qwen35moe",
    "qwen3_next": "qwen3next",
    "gemma4_text": "gemma4",
    "granitemoehybrid": "granitehybrid",
    "falcon_h1": "falcon-h1",
    "nemotron_h": "nemotron_h_moe",
    "llama4_text": "llama4",
}
"""model_type -> the architecture llama.cpp runs it as (convert_hf_to_gguf.py registers Olmo 3 as
olmo2, Mixtral as llama, DeepSeek-V3 as deepseek2). The original seven are tests/unit/export/gguf/test_gguf_export.py's."""

READ_BY_TRANSFORMERS = {"gemma3_text", "qwen2_moe", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text"}
"""The written families whose GGUF transformers 5.25 reads and maps onto the model: its legacy
loader (Gemma 3, Qwen2/3-MoE) or its newer one (Qwen 3.5, which undoes the tiled value heads with
its own code). The others: an architecture it does not know, Mixtral's names, gpt-oss's YaRN keys
its legacy loader fails on."""

NOT_BIT_EXACT = {"qwen2_moe": 1e-7, "qwen3_5_text": 1e-6, "qwen3_5_moe_text": 1e-6, "qwen3_next": 1e-6}
"""f32 logits of Qwen2-MoE read back by transformers' GGUF loader differ by 3e-8 from the merged
model's though every tensor it returns is bit-exact (gguf_check._check_tensors and gguf_readback
prove it): not our file. The delta-net models' A = -exp(A_log) comes back through log within a
float32 ulp. Every other family's f32 logits are identical."""

ADDED = ("gpt_oss", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "gemma4_text", "granitemoehybrid", "falcon_h1",
         "nemotron_h", "llama4_text")
"""Families issue 38 added: the default export of a run of each goes through the CLI."""


@pytest.mark.parametrize("model_type", sorted(WRITTEN))
def test_family_reads_back_and_runs_as_the_merged_model(tmp_path, model_type):
    from gguf import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES, GGUFReader

    model_dir = save_tiny(tmp_path / model_type, model_type, **AS_RELEASED.get(model_type, {}))
    path = tmp_path / "f32.gguf"
    gguf_export.write_gguf(model_dir, path, gguf_type="f32", name="tiny")
    reader = GGUFReader(path)
    arch_name = reader.fields["general.architecture"].contents()
    assert arch_name == WRITTEN[model_type]
    arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name)
    layers = reader.fields[f"{arch_name}.block_count"].contents()
    allowed = {f"{TENSOR_NAMES[kind].format(bid=i)}{suffix}" for kind in MODEL_TENSORS[arch] for i in range(layers)
               for suffix in ("", ".weight", ".bias")}
    names = {t.name for t in reader.tensors}
    assert names and names <= allowed, sorted(names - allowed)  # every tensor has its place in llama.cpp's layout
    bound = NOT_BIT_EXACT.get(model_type, 0.0)
    assert gguf_check.verify_gguf(path, model_dir, gguf_type="f32").max_abs_diff <= bound
    diffs = gguf_check.reader_diffs(path, model_dir, gguf_type="f32")
    assert diffs["gguf-py"] <= bound
    assert (diffs["transformers"] is not None) == (model_type in READ_BY_TRANSFORMERS)
    assert diffs["transformers"] is None or diffs["transformers"] <= bound
    q8_dir = save_tiny(tmp_path / "q8", model_type, as_trained=True, **AS_RELEASED.get(model_type, {}),
                       **ALL_EXPERTS.get(model_type, {}))
    q8 = tmp_path / "q8_0.gguf"
    gguf_export.write_gguf(q8_dir, q8, gguf_type="q8_0", name="tiny")
    check = gguf_check.verify_gguf(q8, q8_dir, gguf_type="q8_0")
    assert 0.0 < check.max_abs_diff <= check.bound


@pytest.mark.parametrize("model_type", ADDED)
def test_the_default_export_of_a_run_completes_with_its_quality_line(tmp_path, capsys, model_type):
    model_dir = save_tiny(tmp_path / model_type, model_type, as_trained=True, **AS_RELEASED.get(model_type, {}),
                          **ALL_EXPERTS.get(model_type, {}))
    run = build_recipe.lora_run(tmp_path, model_dir)
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out), "--format", "gguf"]) == 0
    meta = json.loads((out / "homelab_ft_export.json").read_text())["gguf"]
    assert meta["type"] == "q8_0" and 0 < meta["max_abs_diff"] <= meta["bound"]
    captured = capsys.readouterr()
    assert meta["quality"]["line"] in captured.out and meta["quality"]["agreement"] > 0.9
    running = (out / "RUNNING.md").read_text()
    rounding = "llama.cpp rounds YaRN's correction range" in running  # gpt-oss's truncate = false
    assert rounding == (model_type == "gpt_oss") == ("llama.cpp rounds YaRN's correction range" in captured.err)


ADAPTED = {
    "qwen3_5_text": ("in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "v_proj"),
    "granitemoehybrid": ("input_linear", "output_linear", "q_proj", "k_proj"),
    "gpt_oss": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "gemma4_text": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "falcon_h1": ("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"),
}
"""LoRA targets per family: Qwen 3.5's reordered value heads (rows of in_proj_qkv / in_proj_z,
columns of out_proj) and Granite 4 hybrid's fused gate/up (the shared MLP's input_linear, cut in
row halves) beside plain attention weights, and Falcon-H1's weights with their muP multipliers
folded in (FALCON_MULTIPLIERS). (Granite's experts are parameters PEFT does not wrap: `input_linear`
matches the shared MLP's Linear only.)"""

FALCON_MULTIPLIERS = {"mlp_multipliers": [0.5, 1.7], "attention_in_multiplier": 0.9, "key_multiplier": 0.3,
                      "attention_out_multiplier": 1.3}


@pytest.mark.parametrize("model_type", sorted(ADAPTED))
def test_adapter_gguf_plus_the_base_gguf_is_the_merged_gguf(tmp_path, model_type):
    """llama.cpp's LoRA sum done in numpy: base GGUF + alpha / r * B @ A from the adapter GGUF
    equals the GGUF of the merged model, tensor by tensor, with the weights llama.cpp holds in
    another layout cut the same way in both files (gguf_adapter follows gguf_reshape's rules)."""
    import numpy as np
    from gguf import GGUFReader

    model_dir = save_tiny(tmp_path / model_type, model_type,
                          **(FALCON_MULTIPLIERS if model_type == "falcon_h1" else {}))
    run = build_recipe.lora_run(tmp_path, model_dir, targets=ADAPTED[model_type])
    assert main(["export", str(run), "--out", str(tmp_path / "adapter"), "--adapter-only", "--format", "gguf"]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "merged"), "--format", "gguf", "--gguf-type", "f32"]) == 0
    gguf_export.write_gguf(model_dir, tmp_path / "base.gguf", gguf_type="f32", name="base")

    def tensors(path):
        return {t.name: np.array(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in GGUFReader(path).tensors}

    reader = GGUFReader(tmp_path / "adapter" / "adapter.gguf")
    alpha, lora = reader.fields["adapter.lora.alpha"].contents(), tensors(tmp_path / "adapter" / "adapter.gguf")
    base, want = tensors(tmp_path / "base.gguf"), tensors(tmp_path / "merged" / "model-f32.gguf")
    adapted = {name.removesuffix(".lora_a") for name in lora if name.endswith(".lora_a")}
    assert adapted <= set(want) and len(adapted) > len(ADAPTED[model_type])
    for name in want:
        got = base[name] + (alpha / 4 * lora[f"{name}.lora_b"] @ lora[f"{name}.lora_a"] if name in adapted else 0)
        np.testing.assert_allclose(got, want[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(("target", "says"), [
    ("kv_b_proj", "model.layers.0.self_attn.kv_b_proj cannot be written as a llama.cpp LoRA GGUF: llama.cpp holds"),
    ("q_a_proj", "model.layers.0.self_attn.q_a_proj cannot be written as a llama.cpp LoRA GGUF: llama.cpp's deepseek2 "
                 "graph multiplies blk.0.attn_q_a.weight without its adapters"),
])
def test_an_adapter_llama_cpp_cannot_apply_is_refused_in_one_line(tmp_path, capsys, target, says):
    """DeepSeek-V3's kv_b_proj is attn_k_b (transposed per head) and attn_v_b in the base GGUF: no
    LoRA pair holds that; its q_a_proj is multiplied by models/deepseek2.cpp with plain ggml_mul_mat,
    which applies no adapter (measured: 1.2 of the largest logit off the merged model in llama.cpp
    b11739). Either way the adapter GGUF is refused and the merged export is the way."""
    model_dir = save_tiny(tmp_path / "ds", "deepseek_v3")
    run = build_recipe.lora_run(tmp_path, model_dir, targets=(target,))
    assert main(["export", str(run), "--out", str(tmp_path / "adapter"), "--adapter-only", "--format", "gguf"]) == 2
    err = capsys.readouterr().err
    assert f"LoRA on {says}" in err
    assert "export the merged model" in err
