"""RUNNING.md's llama.cpp commands: every flag checked against the flags of llama.cpp's tools
(homelab_ft/export/llama_cpp_flags.txt, read from llama.cpp's common/arg.cpp), the system-prompt
caveat where it applies, and the base GGUF an adapter runs on."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from homelab_ft import locate
from homelab_ft.export import local_runtimes
from homelab_ft.export.local_runtimes import SystemTurn, unknown_llama_cpp_flags

# RUNNING.md's GGUF section as export wrote it before issue 26: `-cnv` fails in current llama-cli.
OLD_RUNNING = (
    "llama.cpp (chat in the terminal, or an OpenAI-compatible server on port 8080):\n\n"
    "    llama-cli -m model/model-f32.gguf -cnv\n"
    "    llama-server -m model/model-f32.gguf --port 8080\n"
)
OLD_ADAPTER_RUNNING = "    llama-cli -m BASE.gguf --lora model/adapter.gguf -cnv\n"


def test_flags_file_names_its_llama_cpp_commit_and_parses_per_tool():
    header = local_runtimes.FLAGS_FILE.read_text()
    assert re.search(r"commit [0-9a-f]{40}", header) and "common/arg.cpp" in header
    flags = local_runtimes.llama_cpp_flags()
    assert set(flags) == {"llama-cli", "llama-server", "llama-completion", "llama-mtmd-cli"}
    for tool in ("llama-cli", "llama-server", "llama-completion"):
        assert {"-m", "--model", "--jinja", "--lora", "-ngl", "--temp"} <= flags[tool], tool
    # llama-mtmd-cli: only the flags RUNNING.md gives it, each read from common/arg.cpp
    assert flags["llama-mtmd-cli"] == {"-m", "--model", "-p", "--prompt", "-mm", "--mmproj", "--image", "--audio", "--lora",
                                       "--image-min-tokens", "--image-max-tokens"}
    assert "-cnv" not in flags["llama-cli"] and "-cnv" in flags["llama-completion"]
    assert "--port" in flags["llama-server"] and "--port" not in flags["llama-cli"]
    assert "-sys" in flags["llama-cli"] and "-sys" not in flags["llama-server"]
    assert "-p" not in flags["llama-server"]  # set_excludes({LLAMA_EXAMPLE_SERVER})


def test_the_flag_check_fails_on_the_old_text():
    assert unknown_llama_cpp_flags(OLD_RUNNING) == ["llama-cli: -cnv"]
    assert unknown_llama_cpp_flags(OLD_ADAPTER_RUNNING) == ["llama-cli: -cnv"]
    assert unknown_llama_cpp_flags("    llama-server -m x.gguf --bogus 1\n") == ["llama-server: --bogus"]
    assert unknown_llama_cpp_flags("llama.cpp: prose about llama-cli -cnv is not a command\n") == []


def commands(text: str) -> list[list[str]]:
    return [shlex.split(line) for line in text.splitlines() if line.strip().startswith(local_runtimes.LLAMA_CPP_TOOLS)]


def test_running_notes_commands_work_in_current_llama_cpp():
    for system in (None, SystemTurn("You are a helpful AI assistant.", from_recipe=False),
                   SystemTurn("Answer in JSON, don't explain.", from_recipe=True)):
        text = local_runtimes.running_notes("out", gguf_name="model-q8_0.gguf", k_quant_hint=None, system=system)
        assert unknown_llama_cpp_flags(text) == []
        tools = {words[0]: words for words in commands(text)}
        assert set(tools) == {"llama-cli", "llama-server", "llama-completion"}
        assert all("--jinja" in words and words[words.index("-m") + 1] == "out/model-q8_0.gguf" for words in tools.values())
        assert "-cnv" in tools["llama-completion"] and "-cnv" not in tools["llama-cli"]
        if system and system.from_recipe:
            assert tools["llama-cli"][-2:] == ["-sys", system.text] == tools["llama-completion"][-2:]
            assert 'role "system"' in text
        elif system:
            assert "built-in rendering drops it" in text and system.text in text
        else:
            assert "-sys" not in text and "drops it" not in text


def test_adapter_notes_name_the_shipped_gguf_for_the_embedded_base():
    text = local_runtimes.adapter_running_notes("adapter-out", base=locate.EMBEDDED)
    shipped = str(locate.embedded_gguf_path())
    assert unknown_llama_cpp_flags(text) == []
    assert all(words[words.index("-m") + 1] == shipped for words in commands(text))
    assert f"FROM {shipped}" in text and "convert_hf_to_gguf" not in text and "BASE.gguf" not in text


def test_adapter_notes_give_the_command_that_writes_a_folder_base(tmp_path):
    base = tmp_path / "my-base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    text = local_runtimes.adapter_running_notes("adapter-out", base=str(base))
    assert unknown_llama_cpp_flags(text) == []
    assert f"python convert_hf_to_gguf.py {base} --outfile my-base-f16.gguf --outtype f16" in text
    assert all(words[words.index("-m") + 1] == "my-base-f16.gguf" for words in commands(text))


def test_an_image_text_adapter_runs_on_the_bases_text_gguf_and_mmproj(tmp_path):
    """The converter run twice (the text GGUF, then --mmproj), both files and the adapter in every
    llama.cpp command, and no Ollama Modelfile (Ollama does not load a GGUF + mmproj pair)."""
    base = tmp_path / "qwen-vl"
    base.mkdir()
    (base / "config.json").write_text("{}")
    text = local_runtimes.adapter_running_notes("adapter-out", base=str(base), image_text=True)
    assert unknown_llama_cpp_flags(text) == []
    assert f"python convert_hf_to_gguf.py {base} --mmproj --outfile mmproj-qwen-vl-f16.gguf --outtype f16" in text
    for words in commands(text):
        assert words[words.index("-m") + 1] == "qwen-vl-f16.gguf"
        assert words[words.index("--mmproj") + 1] == "mmproj-qwen-vl-f16.gguf"
        assert words[words.index("--lora") + 1] == "adapter-out/adapter.gguf"
    assert "ADAPTER" not in text and local_runtimes.OLLAMA_SPLIT_VISION in text


def test_a_gguf_base_is_its_own_file(tmp_path):
    gguf = tmp_path / "base.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    text = local_runtimes.adapter_running_notes("a", base=str(gguf))
    assert all(Path(words[words.index("-m") + 1]) == gguf for words in commands(text))


def test_docs_export_commands_work_in_current_llama_cpp():
    docs = (Path(__file__).resolve().parents[3] / "docs" / "export.md").read_text()
    assert len(commands(docs)) >= 3 and unknown_llama_cpp_flags(docs) == []


def test_an_image_text_export_runs_with_its_mmproj_and_says_what_ollama_cannot_load():
    """Both files in every llama.cpp command (flags checked against llama.cpp's own), and no Ollama
    route from the GGUF pair: Ollama's own engine ignores a separate projector (its PR #12241)."""
    text = local_runtimes.image_text_running_notes(
        "tuned", gguf_name="model-q8_0.gguf", mmproj_name="mmproj-q8_0.gguf", k_quant_hint=None,
        system=SystemTurn("Name the shapes.", from_recipe=True))
    found = commands(text)
    assert [c[0] for c in found] == ["llama-mtmd-cli", "llama-cli", "llama-server"]
    for command in found:
        assert command[command.index("-m") + 1] == "tuned/model-q8_0.gguf"
        assert command[command.index("--mmproj") + 1] == "tuned/mmproj-q8_0.gguf"
    assert unknown_llama_cpp_flags(text) == []
    assert "-sys 'Name the shapes.'" in text
    assert "ollama create" in text and "pull request #12241" in text and "Modelfile" in text
    assert unknown_llama_cpp_flags("    llama-mtmd-cli -m a.gguf --mmproj b.gguf --jinja\n") == ["llama-mtmd-cli: --jinja"]
    assert "--image-min-tokens" not in text


def test_a_harmony_template_does_not_stop_at_the_end_of_a_message(tmp_path):
    """gpt-oss's chat format (harmony) ends every message with <|end|>, the reasoning (analysis
    channel) too, and a turn with <|return|> or <|call|>: a Modelfile stopping at <|end|> would cut
    the answer off after the reasoning. Phi-3's <|end|> ends its turn and stays a stop."""
    from tiny import make_tokenizer

    from homelab_ft.export.local_runtimes import modelfile

    harmony = ("{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}<|end|>"
               "{% endfor %}<|start|>assistant<|return|>")
    phi3 = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}<|assistant|>"
    for name, template, stops in (("harmony", harmony, False), ("phi3", phi3, True)):
        folder = tmp_path / name
        tokenizer = make_tokenizer(folder, chat_template=template)
        tokenizer.add_tokens(["<|end|>", "<|return|>"], special_tokens=True)
        tokenizer.save_pretrained(folder)
        assert ('PARAMETER stop "<|end|>"' in modelfile(folder, file_name="m.gguf", system_prompt=None)) is stops, name


def test_a_qwen_vl_export_sizes_images_into_the_tokens_of_training():
    """The image-token bounds of training (image_text.image_tokens) in every llama.cpp command."""
    text = local_runtimes.image_text_running_notes(
        "tuned", gguf_name="model-f16.gguf", mmproj_name="mmproj-f16.gguf", k_quant_hint=None, image_tokens=(8, 256))
    for command in commands(text):
        assert command[command.index("--image-min-tokens") + 1] == "8"
        assert command[command.index("--image-max-tokens") + 1] == "256"
    assert unknown_llama_cpp_flags(text) == []
