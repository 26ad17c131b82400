"""Run a text GGUF (and a LoRA GGUF on it) in llama.cpp's own library (libllama) and print its
logits, for the tests and the bench that compare an export with the model it came from.

Runs in a Python that has `llama_cpp_py_sync` (llama.cpp b11739's libllama; tools/llama_mtmd_env.py
makes one), never in the project's venv: it imports neither torch nor homelab_ft. The model is
loaded as tools/llama_mtmd.py loads it (`load`). Reads one JSON argument and prints one JSON line:

    in:  {"model": GGUF, "prompts": [text, ...], "max_new_tokens": n, optional "lora": a LoRA GGUF
          applied at scale 1, optional "kv_type": the KV cache's type (llama.cpp's default f16)}
    out: {"llama_cpp": tag, "prompts": [{"tokens": [...], "logits": [[...] per token], "greedy": [...]}]}

Each prompt is tokenized by the GGUF's own vocabulary (`llama_tokenize`, special tokens parsed, none
added: the texts are rendered chat turns), evaluated from an empty memory in one batch with logits
at every position, and continued greedily (argmax, llama.cpp's greedy sampler) for
`max_new_tokens` tokens, past any end-of-generation token, so the two sides' continuations are
compared token for token.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import llama_cpp_py_sync as llama_cpp
    from llama_mtmd import greedy, load

    args = json.loads(argv[1])
    llm = load(args["model"], lora=args.get("lora"), kv_type=args.get("kv_type"))
    out = {"llama_cpp": llama_cpp.__llama_cpp_tag__, "prompts": []}
    for text in args["prompts"]:
        tokens = llm.tokenize(text, add_special=False, parse_special=True)
        logits = _prompt_logits(llm, tokens)
        out["prompts"].append({"tokens": tokens, "logits": logits,
                               "greedy": greedy(llm, len(tokens), args["max_new_tokens"], stop=False)})
    print(json.dumps(out))
    return 0


def _prompt_logits(llm, tokens: list[int]) -> list[list[float]]:
    """The logits at every position of `tokens`, evaluated as one batch (one sequence, positions
    0..n-1) from an empty memory (llama_memory_clear: the KV cache and a recurrent state alike)."""
    lib, ffi = llm._lib, llm._ffi
    lib.llama_memory_clear(lib.llama_get_memory(llm._ctx), True)
    batch = lib.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
            batch.seq_id[i][0] = 0
        if lib.llama_decode(llm._ctx, batch):
            raise SystemExit("llama_decode failed")
    finally:
        lib.llama_batch_free(batch)
    n_vocab = llm.n_vocab
    return [list(ffi.unpack(lib.llama_get_logits_ith(llm._ctx, i), n_vocab)) for i in range(len(tokens))]


if __name__ == "__main__":
    sys.exit(main(sys.argv))
