"""After training: a run becomes a model that `transformers`, llama.cpp, Ollama and LM Studio load.

    run             `export_run(run_dir, out_dir, ...)`: the front door; branches on the run's `Rung`
    target          where it is written: --out refusals, lock, staging, signals, full or read-only disks
    merged          an adapter run's merged model: written, reloaded, its logits compared; the adapter alone
    merge           LoRA merged into the base one safetensors file at a time, and read back
    expert_adapters the adapters on MoE experts, loaded onto base + adapter and merged into the base's layout
    gguf/           GGUF for llama.cpp, Ollama and LM Studio: `gguf.export.write_gguf`, streamed per tensor,
                    read back and compared (check, readback), its cost measured (quality), adapters
    consolidate     a sharded (DCP) full fine-tune -> Hugging Face safetensors
    local_runtimes  the Ollama Modelfile and RUNNING.md beside a GGUF

Every export is checked by reloading it and comparing logits before it is reported done.
"""
