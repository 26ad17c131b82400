"""After training: a run becomes a model that `transformers`, llama.cpp, Ollama and LM Studio load.

    run             `export_run(run_dir, out_dir, ...)`: the front door; branches on the run's `Rung`
    target          where it is written: --out refusals, lock, staging, signals, full or read-only disks
    merged          an adapter run's merged model: written, reloaded, its logits compared; the adapter alone
    merge           LoRA merged into the base one safetensors file at a time, and read back
    expert_adapters the adapters on MoE experts, loaded onto base + adapter and merged into the base's layout
    gguf_quality    what a lossy GGUF costs: greedy agreement and eval loss against the merged model
    consolidate     a sharded (DCP) full fine-tune -> Hugging Face safetensors
    gguf_export     a Hugging Face folder -> one GGUF (`write_gguf`), streamed per tensor
    gguf_arch       which llama.cpp architecture a model is (from transformers and gguf-py) and its layouts
    gguf_hparams, gguf_vocab   the hyperparameter keys and the tokenizer in GGUF
    gguf_check      the GGUF read back (gguf_readback: gguf-py; and transformers' loader) and compared
    gguf_adapter    a PEFT adapter -> llama.cpp's LoRA-adapter GGUF
    local_runtimes  the Ollama Modelfile and RUNNING.md beside a GGUF

Every export is checked by reloading it and comparing logits before it is reported done.
"""
