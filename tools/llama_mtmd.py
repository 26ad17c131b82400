"""Run a GGUF + mmproj pair in llama.cpp's own multimodal library (libmtmd) and print what it sees.

Runs in a Python that has `llama_cpp_py_sync` (CFFI bindings with libllama and libmtmd of llama.cpp
b11739 built in; see tools/llama_mtmd_env.py), never in the project's venv: it imports neither torch
nor homelab_ft. Reads one JSON argument and prints one JSON line:

    in:  {"model": text GGUF, "mmproj": mmproj GGUF, "image": PNG, "prompt": text with "<image>" where
          the image goes, "max_new_tokens": n, optional "lora": a LoRA GGUF applied at scale 1,
          optional "image_tokens": [min, max] tokens an image is sized into (--image-min/max-tokens)}
    out: {"llama_cpp": tag, "chunks": [{"type": "text", "tokens": [...]} | {"type": "image", "n": tokens,
          "embeddings": [[...], ...]}], "greedy": [token ids]}

The prompt is tokenized by mtmd (`mtmd_tokenize`: the text by the GGUF's vocabulary, the image by
the projector's own wrapping and tiling), evaluated chunk by chunk (`mtmd_helper_eval_chunk_single`,
as llama-mtmd-cli does), and continued greedily (argmax of the last logits, llama.cpp's greedy
sampler) for `max_new_tokens` tokens or until an end-of-generation token.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import llama_cpp_py_sync as llama_cpp
    from llama_cpp_py_sync import MultimodalContext
    from llama_cpp_py_sync.multimodal import MultimodalPrompt

    args = json.loads(argv[1])
    llm = load(args["model"], lora=args.get("lora"))
    low, high = args.get("image_tokens") or (-1, -1)
    mm = MultimodalContext(llm, args["mmproj"], use_gpu=False, n_threads=1, warmup=False, image_min_tokens=low,
                           image_max_tokens=high)
    ffi, lib = mm._ffi, mm._lib
    bitmap = mm.load_image_file(args["image"])
    chunks = lib.mtmd_input_chunks_init()
    text = args["prompt"].replace("<image>", mm.marker).encode()
    buffer = ffi.new("char[]", text)
    prompt_text = ffi.new("mtmd_input_text *")
    prompt_text.text, prompt_text.text_len = buffer, len(text)
    prompt_text.add_special, prompt_text.parse_special = False, True
    if lib.mtmd_tokenize(mm._ctx, chunks, prompt_text, ffi.new("const mtmd_bitmap *[]", [bitmap]), 1) != 0:
        raise SystemExit("mtmd_tokenize failed")
    out = {"llama_cpp": llama_cpp.__llama_cpp_tag__, "chunks": []}
    with MultimodalPrompt(mm, chunks, [bitmap]) as prompt:
        for chunk in prompt:
            if chunk.type == "image":
                out["chunks"].append({"type": "image", "n": chunk.n_tokens, "embeddings": [list(e) for e in chunk.embeddings]})
            else:
                out["chunks"].append({"type": chunk.type, "tokens": list(chunk.text_tokens)})
        n_past = mm.evaluate_prompt(prompt)
    out["greedy"] = greedy(llm, n_past, args["max_new_tokens"])
    print(json.dumps(out))
    return 0


def load(model: str, *, lora: str | None = None, kv_type: str | None = None):
    """The GGUF `model` in libllama on one CPU thread (512 tokens of context, one batch), with the
    LoRA GGUF `lora` applied at scale 1 as llama-cli --lora applies it (llama_adapter_lora_init,
    then set on the context); the KV cache in `kv_type` (llama.cpp's default f16 where None)."""
    from llama_cpp_py_sync import Llama

    llm = Llama(model, n_ctx=512, n_batch=512, n_threads=1, seed=0, type_k=kv_type, type_v=kv_type)
    if lora:
        adapter = llm._lib.llama_adapter_lora_init(llm._model, lora.encode())
        if adapter == llm._ffi.NULL:
            raise SystemExit(f"llama_adapter_lora_init failed for {lora}")
        scales = llm._ffi.new("float[]", [1.0])
        if llm._lib.llama_set_adapters_lora(llm._ctx, llm._ffi.new("struct llama_adapter_lora *[]", [adapter]), 1, scales):
            raise SystemExit("llama_set_adapters_lora failed")
    return llm


def greedy(llm, n_past: int, max_new_tokens: int, *, stop: bool = True) -> list[int]:
    """Up to `max_new_tokens` argmax tokens after the `n_past` evaluated (llama.cpp's greedy
    sampler), with `stop` ending after an end-of-generation token."""
    lib, vocab = llm._lib, llm._vocab
    n_vocab = llm.n_vocab
    tokens = []
    for _ in range(max_new_tokens):
        logits = lib.llama_get_logits_ith(llm._ctx, -1)
        token = max(range(n_vocab), key=lambda i: logits[i])
        tokens.append(token)
        if stop and lib.llama_vocab_is_eog(vocab, token):
            break
        n_past = llm._eval_tokens([token], n_past)
    return tokens


if __name__ == "__main__":
    sys.exit(main(sys.argv))
