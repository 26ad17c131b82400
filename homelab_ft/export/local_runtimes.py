"""What a user of llama.cpp, Ollama or LM Studio needs beside a GGUF: an Ollama Modelfile and
the exact commands in RUNNING.md."""

from __future__ import annotations

import json
from pathlib import Path

_CHATML_TEMPLATE = (
    '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n'
)
"""Ollama's own ChatML template (Go text/template): Ollama cannot run the Jinja template itself."""


def modelfile(model_dir: Path, *, file_name: str, system_prompt: str | None) -> str:
    """An Ollama Modelfile for the GGUF: its stop tokens, and the recipe's system prompt if set.

    For a ChatML model (SmolLM2, Qwen) the template is written out, with the system turn the Jinja
    template inserts by default (SmolLM2: "You are a helpful AI assistant...") as SYSTEM, since
    the model was trained with it; for others Ollama picks the template matching the chat template
    stored in the GGUF (it knows Llama 3, Mistral, Gemma, Phi-3).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = list(dict.fromkeys(_stop_tokens(model_dir, tokenizer)))
    lines = [f"FROM ./{file_name}", ""]
    if "<|im_start|>" in (tokenizer.chat_template or ""):
        lines += [f'TEMPLATE """{_CHATML_TEMPLATE}"""', ""]
        system_prompt = system_prompt or _default_chatml_system(tokenizer)
    if system_prompt:
        lines += [f'SYSTEM """{system_prompt}"""', ""]
    lines += [f'PARAMETER stop "{token}"' for token in stops]
    return "\n".join(lines) + "\n"


def _default_chatml_system(tokenizer) -> str | None:
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
    for token in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        if token in (tokenizer.chat_template or "") and token in tokenizer.get_vocab():
            ids.append(tokenizer.convert_tokens_to_ids(token))
    return [tokenizer.convert_ids_to_tokens(i) for i in ids]


def running_notes(name: str, *, gguf_name: str, k_quant_hint: str | None) -> str:
    """The RUNNING.md section for the GGUF: exact llama.cpp, Ollama and LM Studio commands."""
    text = (
        f"GGUF ({gguf_name}) with the chat template and stop tokens in its metadata:\n\n"
        "llama.cpp (chat in the terminal, or an OpenAI-compatible server on port 8080):\n\n"
        f"    llama-cli -m {name}/{gguf_name} -cnv\n"
        f"    llama-server -m {name}/{gguf_name} --port 8080\n\n"
        "Ollama (the Modelfile in this folder sets the stop tokens and the system prompt):\n\n"
        f"    cd {name} && ollama create {_ollama_name(name)} -f Modelfile\n"
        f"    ollama run {_ollama_name(name)}\n\n"
        "LM Studio:\n\n"
        f"    lms import {name}/{gguf_name}\n"
        f"    lms load {Path(gguf_name).stem}\n\n"
    )
    if k_quant_hint:
        text += f"A k-quant needs llama.cpp's llama-quantize (gguf-py cannot write one):\n\n    {k_quant_hint}\n\n"
    return text


def adapter_running_notes(name: str, *, base: str) -> str:
    return (
        "# Running this adapter\n\n"
        f"adapter.gguf is a LoRA adapter in llama.cpp's format for the base model {base}; it needs that base\n"
        "as a GGUF (any type): write it with llama.cpp's convert_hf_to_gguf.py from the base's folder.\n\n"
        "llama.cpp:\n\n"
        f"    llama-cli -m BASE.gguf --lora {name}/adapter.gguf -cnv\n"
        f"    llama-server -m BASE.gguf --lora {name}/adapter.gguf --port 8080\n\n"
        "Ollama (a Modelfile next to BASE.gguf):\n\n"
        f"    FROM ./BASE.gguf\n    ADAPTER ./{name}/adapter.gguf\n"
    )


def _ollama_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name.lower()) or "model"
