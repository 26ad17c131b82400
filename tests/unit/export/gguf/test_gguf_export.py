"""GGUF export: tiny random models of each family written as GGUF, reloaded through transformers'
GGUF loader (the same dequantize path LM Studio-style tools and llama.cpp's reference use) and
compared with the model they came from; the CLI's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import build_recipe
import numpy as np
import pytest
import torch

from homelab_ft.cli.main import main
from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import check as gguf_check
from homelab_ft.export.gguf import export as gguf_export
from homelab_ft.export.local_runtimes import unknown_llama_cpp_flags

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, vocab_size=320)


def _config(family: str):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    return {
        "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False),
        "llama-tied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
        "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
        "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False),
        "qwen2-tied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
        # head_dim 32 != 64 / 4: llama.cpp then needs attention.key_length
        "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
        "phi3": lambda: Phi3Config(**COMMON, tie_word_embeddings=False),
        "gemma2": lambda: Gemma2Config(**COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=64),
        "gemma3": lambda: Gemma3TextConfig(**COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=64),
        "gemma": lambda: GemmaConfig(**COMMON, head_dim=16),
    }[family]()


def make_model(out_dir: Path, family: str, *, seed: int = 0) -> Path:
    """A tiny random model of `family` with the ChatML BPE tokenizer of tests/tiny.py."""
    from tiny import make_tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = make_tokenizer(out_dir)
    config = _config(family)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = make_model(tmp_path_factory.mktemp(family), family)
        return cache[family]

    return get


def write(model_dir: Path, out: Path, gguf_type: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / gguf_export.gguf_file_name(gguf_type)
    gguf_export.write_gguf(model_dir, path, gguf_type=gguf_type, name="tiny")
    return path


def tensors(path: Path) -> dict:
    from gguf import GGUFReader

    return {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in GGUFReader(path).tensors}


FAMILIES = ["llama", "llama-tied", "mistral", "qwen2", "qwen2-tied", "qwen3", "phi3", "gemma2", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_reloads_with_identical_logits_and_q8_0_within_bound(models, tmp_path, family):
    model_dir = models(family)
    f32 = gguf_check.verify_gguf(write(model_dir, tmp_path, "f32"), model_dir, gguf_type="f32")
    assert f32.max_abs_diff == 0.0
    q8 = gguf_check.verify_gguf(write(model_dir, tmp_path, "q8_0"), model_dir, gguf_type="q8_0")
    assert 0.0 < q8.max_abs_diff <= q8.bound


@pytest.mark.parametrize("gguf_type", ["f16", "bf16", "q4_0", "q5_1"])
def test_other_types_stay_within_their_bound(models, tmp_path, gguf_type):
    """4-bit types have no logit bound (one that cannot fail): gguf_quality measures them."""
    model_dir = models("llama")
    check = gguf_check.verify_gguf(write(model_dir, tmp_path, gguf_type), model_dir, gguf_type=gguf_type)
    if gguf_type in ("q4_0", "q5_1"):
        assert check.bound is None and check.max_abs_diff > 0.0 and "no logit bound" in check.describe()
    else:
        assert 0.0 < check.max_abs_diff <= check.bound


def test_llama3_rope_scaling_becomes_rope_freqs(tmp_path):
    """Llama 3.1+ rope scaling: llama.cpp divides each pair's frequency by `rope_freqs`, which must
    be transformers' unscaled / scaled inverse frequencies."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = make_model(tmp_path / "m", "llama")
    config = json.loads((model_dir / "config.json").read_text())
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config.pop("rope_scaling", None)
    (model_dir / "config.json").write_text(json.dumps(config | {"rope_parameters": rope}))
    path = write(model_dir, tmp_path / "out", "f32")
    freqs = next(t for t in GGUFReader(path).tensors if t.name == "rope_freqs.weight")
    scaled = AutoModelForCausalLM.from_pretrained(model_dir).model.rotary_emb.inv_freq
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert AutoConfig.from_pretrained(model_dir).rope_parameters["rope_type"] == "llama3"
    np.testing.assert_allclose(np.array(freqs.data), (plain / scaled).numpy(), rtol=1e-5)
    assert np.array(freqs.data).max() == 8.0 and np.array(freqs.data).min() == 1.0
    assert gguf_check.verify_gguf(path, model_dir, gguf_type="f32").max_abs_diff == 0.0


def test_tensor_types_and_tied_embedding_written_once(models, tmp_path):
    untied = tensors(write(models("llama"), tmp_path / "untied", "q4_0"))
    tied = tensors(write(models("llama-tied"), tmp_path / "tied", "q8_0"))
    assert "output.weight" in untied and "output.weight" not in tied
    assert untied["blk.0.attn_q.weight"] == ("Q4_0", (64, 64))  # gguf lists dims innermost first
    assert untied["token_embd.weight"][0] == untied["output.weight"][0] == "Q8_0"  # kept at 8 bits
    assert untied["blk.0.attn_norm.weight"] == ("F32", (64,))
    assert tied["blk.1.ffn_down.weight"] == ("Q8_0", (128, 64))
    assert len(untied) == len(tied) + 1 == 2 * 9 + 3


def test_a_wrong_layout_is_caught(models, tmp_path, monkeypatch):
    """Without llama.cpp's q/k row permutation, or without Gemma's norm offset, transformers reads
    back other weights (and the logits move by whole units): the check refuses them even at f32."""
    from dataclasses import replace

    monkeypatch.setitem(gguf_arch.LAYOUTS, "llama", replace(gguf_arch.LAYOUTS["llama"], permute_qk=False))
    monkeypatch.setattr(gguf_arch, "_offset_norms", lambda model_dir, arch_name: frozenset())
    for family in ("llama", "gemma2"):
        path = write(models(family), tmp_path / family, "f32")
        with pytest.raises(RuntimeError, match="reads back different"):
            gguf_check.verify_gguf(path, models(family), gguf_type="f32")


def test_tokenizer_metadata_gives_the_same_ids_and_chat_template(models, tmp_path):
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    model_dir = models("qwen2")
    path = write(model_dir, tmp_path, "f16")
    reference = AutoTokenizer.from_pretrained(model_dir)
    fields = GGUFReader(path).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.pre"].contents() == "qwen2"  # transformers imposes Qwen2's split regex
    assert fields["tokenizer.chat_template"].contents() == reference.chat_template
    assert fields["tokenizer.ggml.eos_token_id"].contents() == reference.convert_tokens_to_ids("<|im_end|>")
    types = fields["tokenizer.ggml.token_type"].contents()
    assert len(types) == 320 and types[reference.convert_tokens_to_ids("<|im_start|>")] == 3  # CONTROL
    loaded = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    chat = [{"role": "user", "content": "the capital of france is paris? 17 * 3 = 51"}]
    text = reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert loaded(text)["input_ids"] == reference(text)["input_ids"]


def test_llama_cpps_phi3_tokenizer_rule_follows_the_tokenizer_not_the_export_folders_name(models, tmp_path):
    """llama.cpp tokenizes as Phi-3 (whitespace after special tokens stripped; </s>, <unk>, <s> and
    <|endoftext|> looked up, a load failure without one) when general.name says phi3, and
    general.name is the --out folder's: an export to `phi3-ft` of the tests' tokenizer is named out
    of that rule, a tokenizer whose chat tokens strip as Phi-3's is named into it."""
    from gguf import GGUFReader
    from tokenizers import AddedToken

    from homelab_ft.export.gguf.vocab import general_name

    model_dir = models("qwen2")
    gguf_export.write_gguf(model_dir, tmp_path / "named.gguf", gguf_type="f32", name="Phi3-ft")
    assert GGUFReader(tmp_path / "named.gguf").fields["general.name"].contents() == "Phi 3-ft"
    assert general_name(model_dir, "my-phi-3") == "my-phi 3" and general_name(model_dir, "qwen-ft") == "qwen-ft"
    from transformers import AutoTokenizer

    phi = AutoTokenizer.from_pretrained(model_dir)
    phi.add_special_tokens({"additional_special_tokens": [AddedToken("<|user|>", rstrip=True, special=True)]})
    phi.add_tokens([AddedToken(t, special=True) for t in ("</s>", "<unk>", "<s>")], special_tokens=True)
    phi.save_pretrained(tmp_path / "phi")
    assert general_name(tmp_path / "phi", "ft") == "ft"  # <|im_start|> and <|im_end|> keep their whitespace
    spec = json.loads((tmp_path / "phi" / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        token["rstrip"] = token["content"] not in ("</s>", "<unk>", "<s>", "<|endoftext|>")
    (tmp_path / "phi" / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "phi" / "tokenizer_config.json").unlink()  # its added_tokens_decoder would override the file's
    assert general_name(tmp_path / "phi", "ft") == "ft (phi-3 tokenizer)" and general_name(tmp_path / "phi", "phi3") == "phi3"


def test_files_beside_the_gguf_that_name_another_end_of_sequence_token_fail_the_check(models, tmp_path):
    """A safetensors,gguf export is checked against the tokenizer files written beside the GGUF:
    one whose replies stop at another token than the GGUF's is refused, not written."""
    import shutil

    model_dir = shutil.copytree(models("llama"), tmp_path / "m")
    path = write(model_dir, tmp_path / "out", "f32")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "<|endoftext|>"}))
    with pytest.raises(RuntimeError, match="end-of-sequence token is '<.im_end.>', the tokenizer's '<.endoftext.>'"):
        gguf_check.verify_gguf(path, model_dir, gguf_type="f32")


def make_sentencepiece_llama(out_dir: Path) -> Path:
    """A Llama-2-style model: a SentencePiece BPE (byte fallback, ChatML control symbols)
    trained on tests/tiny.py's corpus, saved as tokenizer.model + tokenizer.json."""
    import io
    import shutil

    import sentencepiece as spm
    from tiny import CHATML_TEMPLATE, CORPUS
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS * 4), model_writer=model, vocab_size=384,
                                   model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   control_symbols=["<|im_start|>", "<|im_end|>"], character_coverage=1.0,
                                   minloglevel=2)
    source = out_dir / "spm"
    source.mkdir(parents=True)
    (source / "tokenizer.model").write_bytes(model.getvalue())
    (source / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>"}))
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = CHATML_TEMPLATE
    model_dir = out_dir / "model"
    tokenizer.save_pretrained(model_dir)
    shutil.copy(source / "tokenizer.model", model_dir)
    config = LlamaConfig(**(COMMON | {"vocab_size": 384}), bos_token_id=1, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    return model_dir


@pytest.mark.parametrize("source", ["tokenizer.model", "tokenizer.json"])
def test_sentencepiece_tokenizer(tmp_path, source):
    """SentencePiece from tokenizer.json (gguf.LlamaHfVocab) or, without it, from tokenizer.model
    (gguf.SentencePieceVocab); add_bos written as the tokenizer behaves."""
    from gguf import GGUFReader

    model_dir = make_sentencepiece_llama(tmp_path)
    (model_dir / ("tokenizer.json" if source == "tokenizer.model" else "tokenizer.model")).unlink()
    path = write(model_dir, tmp_path / "out", "f32")
    fields = GGUFReader(path).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.add_bos_token"].contents() is False
    assert len(fields["tokenizer.ggml.scores"].contents()) == 384
    assert gguf_check.verify_gguf(path, model_dir, gguf_type="f32").max_abs_diff == 0.0


def test_k_quant_and_unknown_types():
    assert gguf_export.check_gguf_type(None) == ("q8_0", None)
    assert gguf_export.check_gguf_type("Q4_K_M") == ("f16", "q4_k_m")
    assert gguf_export.quantize_command(Path("out/model-f16.gguf"), "q4_k_m") == (
        "llama-quantize out/model-f16.gguf out/model-q4_k_m.gguf Q4_K_M")
    with pytest.raises(Exception, match="q3_0.*f32, f16, bf16, q8_0, q4_0, q5_1"):
        gguf_export.check_gguf_type("q3_0")


# ------------------------------------------------------------------------------------------- CLI


def test_export_gguf_only_and_both(models, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    run = build_recipe.lora_run(tmp_path, models("llama"), system_prompt="Answer briefly.")
    only = tmp_path / "gguf"
    assert main(["export", str(run), "--out", str(only), "--format", "gguf"]) == 0
    assert sorted(p.name for p in only.iterdir()) == ["Modelfile", "RUNNING.md", "homelab_ft_export.json", "model-q8_0.gguf"]
    meta = json.loads((only / "homelab_ft_export.json").read_text())
    assert meta["gguf"]["type"] == "q8_0" and 0 < meta["gguf"]["max_abs_diff"] <= meta["gguf"]["bound"]
    modelfile = (only / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model-q8_0.gguf\n")
    assert 'PARAMETER stop "<|im_end|>"' in modelfile and 'SYSTEM """Answer briefly."""' in modelfile
    running = (only / "RUNNING.md").read_text()
    assert f"llama-cli -m {only.name}/model-q8_0.gguf --jinja -sys 'Answer briefly.'" in running
    assert "ollama create" in running and "lms import" in running and unknown_llama_cpp_flags(running) == []
    printed = capsys.readouterr().out
    assert "GGUF check" in printed
    # the recipe's train.jsonl is not there, so no eval rows: measured on the held-out prompts
    quality = meta["gguf"]["quality"]
    assert quality["rows_from"] == "held-out prompts" and quality["line"] in printed
    assert quality["line"].startswith("gguf q8_0 vs merged: greedy next-token agreement ")
    # the same export again: nothing to do
    assert main(["export", str(run), "--out", str(only), "--format", "gguf"]) == 0
    assert "nothing to do" in capsys.readouterr().out

    both = tmp_path / "both"
    assert main(["export", str(run), "--out", str(both), "--format", "safetensors,gguf", "--gguf-type", "f32"]) == 0
    assert (both / "model.safetensors").is_file() and (both / "model-f32.gguf").is_file()
    assert json.loads((both / "homelab_ft_export.json").read_text())["gguf"]["max_abs_diff"] == 0.0
    assert "quality" not in json.loads((both / "homelab_ft_export.json").read_text())["gguf"]  # f32: nothing lost
    merged = AutoModelForCausalLM.from_pretrained(both)
    base = AutoModelForCausalLM.from_pretrained(models("llama"))
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight)
    assert not list(tmp_path.glob(".*tmp-*"))


def test_generate_reads_the_gguf_of_a_safetensors_and_gguf_export(models, tmp_path, capsys, monkeypatch):
    """Issue 39 point 1: `export RUN --out X --format safetensors,gguf && generate X/model-q8_0.gguf
    --prompt Hi` ended in "chat_template is not set": the GGUF's conversion read the tokenizer.json
    beside it. The files beside the GGUF say what the GGUF says (verify_gguf: template, eos)."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("HOMELAB_FT_CACHE", str(tmp_path / "cache"))
    run = build_recipe.lora_run(tmp_path, models("llama"))
    out = tmp_path / "X"
    assert main(["export", str(run), "--out", str(out), "--format", "safetensors,gguf"]) == 0
    capsys.readouterr()
    assert main(["generate", str(out / "model-q8_0.gguf"), "--prompt", "Hi", "--max-new-tokens", "3"]) == 0
    beside = AutoTokenizer.from_pretrained(out)
    converted = AutoTokenizer.from_pretrained(next(p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()))
    assert converted.chat_template == beside.chat_template and converted.eos_token == beside.eos_token == "<|im_end|>"


def test_k_quant_writes_f16_and_prints_the_llama_quantize_command(models, tmp_path, capsys):
    run = build_recipe.lora_run(tmp_path, models("qwen2-tied"))
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out), "--format", "gguf", "--gguf-type", "q4_k_m"]) == 0
    assert (out / "model-f16.gguf").is_file()
    printed = capsys.readouterr().out
    assert f"llama-quantize {out}/model-f16.gguf {out}/model-q4_k_m.gguf Q4_K_M" in printed
    assert "llama-quantize" in (out / "RUNNING.md").read_text()
    modelfile = (out / "Modelfile").read_text()
    # no system prompt in this recipe: the template's default system turn, which the model was trained with
    assert 'SYSTEM """You are a helpful AI assistant."""' in modelfile
    # the Modelfile loads what the printed command writes (issue 24 item 9: it said FROM ./model-f16.gguf),
    # and says to run that command first, in the export folder
    assert "FROM ./model-q4_k_m.gguf" in modelfile and "model-f16.gguf" not in modelfile.split("FROM")[1]
    assert modelfile.startswith("# Run first, in this folder: llama-quantize model-f16.gguf model-q4_k_m.gguf Q4_K_M\n")


def refused(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_refusals_write_nothing(models, tmp_path, capsys):
    run = build_recipe.lora_run(tmp_path, models("llama"))
    out = tmp_path / "out"
    capsys.readouterr()
    assert "'q3_0' is not a GGUF type" in refused(capsys, "export", run, "--out", out, "--format", "gguf", "--gguf-type", "q3_0")
    assert "--format 'onnx'" in refused(capsys, "export", run, "--out", out, "--format", "onnx")
    assert "needs --format gguf" in refused(capsys, "export", run, "--out", out, "--gguf-type", "f16")
    assert "does not apply to --adapter-only" in refused(capsys, "export", run, "--out", out, "--format", "gguf",
                                                         "--adapter-only", "--gguf-type", "f16")
    assert not out.exists()

    assert main(["export", str(run), "--out", str(out)]) == 0  # safetensors
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    assert "holds something else" in refused(capsys, "export", run, "--out", out, "--format", "gguf")
    assert sorted(p.name for p in out.iterdir()) == before


def test_a_family_without_gguf_gets_its_safetensors_export_and_one_line(tmp_path, capsys):
    """Phi-MoE: llama.cpp runs it as `phimoe`, on Phi-3's graph, which computes another model. Asked for
    a GGUF, export still writes (and checks) the safetensors export, then says so in one line, exit 2."""
    from families import save_tiny
    from transformers import AutoModelForCausalLM

    run = build_recipe.lora_run(tmp_path, save_tiny(tmp_path / "phimoe", "phimoe"))
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(out), "--format", "gguf"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]  # beside transformers' loading progress bars
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "model_type 'phimoe' cannot be written as GGUF" in errors[0] and f"the safetensors export is in {out}" in errors[0]
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.gguf"))
    AutoModelForCausalLM.from_pretrained(out)
    capsys.readouterr()
    # asked again: the export is there (nothing to do), and the same line
    assert "cannot be written as GGUF" in refused(capsys, "export", run, "--out", out, "--format", "gguf")


def test_export_of_a_family_transformers_cannot_read_back(tmp_path, capsys):
    """SmolLM3 (llama.cpp's `smollm3`, which transformers' GGUF loader does not read): the export
    is checked and measured from gguf-py's reading of the file."""
    from families import save_tiny

    run = build_recipe.lora_run(tmp_path, save_tiny(tmp_path / "smollm3", "smollm3"))
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out), "--format", "gguf"]) == 0
    meta = json.loads((out / "homelab_ft_export.json").read_text())
    assert 0 < meta["gguf"]["max_abs_diff"] <= meta["gguf"]["bound"]
    assert meta["gguf"]["quality"]["rows_from"] == "held-out prompts" and meta["gguf"]["quality"]["agreement"] > 0.9
    assert not gguf_check.transformers_reads(out / "model-q8_0.gguf")


def test_default_export_of_qwen3_moe_completes_with_its_quality_line(tmp_path, capsys):
    """Issue 38's reproduction: the default q8_0 export of a Qwen3-MoE (hidden 64, 4 layers, 4
    experts of 32) crashed in its quality step (ignore_mismatched_sizes) and wrote nothing."""
    from families import save_tiny

    run = build_recipe.lora_run(tmp_path, save_tiny(tmp_path / "qwen3_moe", "qwen3_moe", norm_topk_prob=True))
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out), "--format", "gguf"]) == 0
    quality = json.loads((out / "homelab_ft_export.json").read_text())["gguf"]["quality"]
    assert quality["agreement"] > 0.9 and quality["line"] in capsys.readouterr().out


def test_a_quality_report_that_cannot_run_keeps_the_checked_export(models, tmp_path, capsys, monkeypatch):
    """The GGUF has passed verify_gguf: a failing report is one line, never the export's end."""
    from homelab_ft.export.gguf import quality as gguf_quality

    def broken(*args, **kwargs):
        raise RuntimeError("no memory left for the second model\nsecond line")

    monkeypatch.setattr(gguf_quality, "load_gguf_model", broken)
    run = build_recipe.lora_run(tmp_path, models("llama"))
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(out), "--format", "gguf"]) == 0
    assert (out / "model-q8_0.gguf").is_file()
    assert "quality" not in json.loads((out / "homelab_ft_export.json").read_text())["gguf"]
    said = [line for line in capsys.readouterr().err.splitlines() if "quality report" in line]
    assert said == ["warning: the q8_0 GGUF's quality report could not be measured (RuntimeError: no memory left "
                    "for the second model); the file passed its read-back check and is kept"]


def test_a_mistral_window_shorter_than_the_checks_prompts_is_refused_in_one_line(tmp_path, capsys):
    """llama.cpp runs Mistral as `llama`, with no sliding window: an 8-token window then differs on
    the check's own prompts. Refused before anything is written (it ended in the check's traceback),
    the safetensors asked beside it still delivered."""
    from families import save_tiny

    run = build_recipe.lora_run(tmp_path, save_tiny(tmp_path / "mistral", "mistral"))  # sliding_window 8
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(out), "--format", "safetensors,gguf"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "sliding_window = 8 is shorter than the export check's prompts" in errors[0], errors[0]
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.gguf"))


def test_a_gemma3_pattern_older_llama_cpp_fixes_otherwise_is_exported_with_the_build_it_needs(tmp_path, capsys):
    """A Gemma 3 whose sliding pattern is not every 6th layer full (once refused) is exported; the
    export warns and RUNNING.md says which llama.cpp build runs it as trained."""
    from families import save_tiny

    run = build_recipe.lora_run(tmp_path, save_tiny(tmp_path / "gemma3", "gemma3_text", query_pre_attn_scalar=16))
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out), "--format", "gguf", "--gguf-type", "f32"]) == 0
    running = (out / "RUNNING.md").read_text()
    assert "llama.cpp b11739 or newer" in running and unknown_llama_cpp_flags(running) == []
    assert "b11739 or newer" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- adapter


@pytest.mark.parametrize("family", ["llama", "qwen2-tied", "smollm3"])
def test_adapter_gguf_in_llama_cpp_layout_reproduces_the_merged_weights(models, tmp_path, capsys, family):
    """Base GGUF + alpha / r * B @ A from the adapter GGUF (llama.cpp's LoRA sum, done in numpy)
    equals the GGUF of the merged model, q/k rows permuted alike (SmolLM3 too: llama.cpp's graph
    for it is Llama's)."""
    from families import save_tiny
    from gguf import GGUFReader

    model_dir = save_tiny(tmp_path / family, family, num_hidden_layers=2, no_rope_layers=[1, 1],
                          layer_types=["full_attention"] * 2) \
        if family == "smollm3" else models(family)
    run = build_recipe.lora_run(tmp_path, model_dir)
    out = tmp_path / "adapter"
    assert main(["export", str(run), "--out", str(out), "--adapter-only", "--format", "gguf"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["RUNNING.md", "adapter.gguf", "homelab_ft_export.json"]
    running = (out / "RUNNING.md").read_text()
    assert "--lora" in running and "adapter GGUF check" in capsys.readouterr().out
    assert unknown_llama_cpp_flags(running) == [] and f"convert_hf_to_gguf.py {model_dir}" in running

    reader = GGUFReader(out / "adapter.gguf")
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["adapter.type"].contents() == "lora"
    alpha = reader.fields["adapter.lora.alpha"].contents()
    assert alpha == 8.0
    lora = {t.name: np.array(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    adapted = {f"blk.{i}.attn_{p}.weight" for i in range(2) for p in "qkv"}
    assert set(lora) == {f"{n}.lora_{ab}" for n in adapted for ab in "ab"}
    assert [int(d) for d in next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight.lora_a").shape] == [64, 4]
    assert [int(d) for d in next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight.lora_b").shape] == [4, 32]

    merged = tmp_path / "merged"
    assert main(["export", str(run), "--out", str(merged), "--format", "gguf", "--gguf-type", "f32"]) == 0
    base_gguf = write(model_dir, tmp_path / "base", "f32")
    base = {t.name: np.array(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in GGUFReader(base_gguf).tensors}
    want = {t.name: np.array(t.data).reshape([int(d) for d in reversed(t.shape)])
            for t in GGUFReader(merged / "model-f32.gguf").tensors}
    for name in want:
        got = base[name] + (alpha / 4 * lora[f"{name}.lora_b"] @ lora[f"{name}.lora_a"] if name in adapted else 0)
        np.testing.assert_allclose(got, want[name], rtol=0, atol=1e-6, err_msg=name)
    assert any(not np.array_equal(base[n], want[n]) for n in adapted)


def test_adapter_gguf_refuses_dora(tmp_path):
    from homelab_ft.errors import UserError
    from homelab_ft.export.gguf.adapter import adapter_alpha

    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True}))
    with pytest.raises(UserError, match="DoRA"):
        adapter_alpha(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": True}))
    assert adapter_alpha(tmp_path) == 16.0  # alpha * sqrt(r): llama.cpp's alpha / r is then rsLoRA's alpha / sqrt(r)


def test_a_failed_check_leaves_nothing(models, tmp_path, monkeypatch):
    from dataclasses import replace

    run = build_recipe.lora_run(tmp_path, models("llama"))
    monkeypatch.setitem(gguf_arch.LAYOUTS, "llama", replace(gguf_arch.LAYOUTS["llama"], permute_qk=False))
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="GGUF check failed"):
        main(["export", str(run), "--out", str(out), "--format", "safetensors,gguf"])
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
