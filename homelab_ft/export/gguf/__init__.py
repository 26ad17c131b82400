"""GGUF for llama.cpp, Ollama and LM Studio, written with gguf-py and read back before it is done.

    export    a Hugging Face folder -> one GGUF file (`write_gguf`), streamed tensor by tensor
    arch      which llama.cpp architecture a model is written as (from transformers and gguf-py), its layouts
    layouts   what llama.cpp's graph expects of each architecture written (read from its converter and C++)
    reshape   the checkpoint tensors llama.cpp holds under other names, in another layout or as several
    rope      where llama.cpp's rotary angles differ from transformers' (YaRN's rounding), for RUNNING.md
    hparams   the hyperparameter keys of a GGUF file, from the model's config, as llama.cpp reads them
    vocab     the tokenizer in GGUF: tokens, types, scores, merges, the pre-tokenizer
    check     the written file read back (readback; and transformers' GGUF loader) and compared
    readback  every tensor read back with gguf-py's GGUFReader
    quality   what a lossy GGUF costs: greedy agreement and eval loss against the merged model
    adapter   a PEFT LoRA adapter -> llama.cpp's LoRA-adapter GGUF
    text_view the language model of an image-text checkpoint laid out as a causal-LM folder (its text GGUF)
    mmproj    the vision tower and projector of an image-text checkpoint -> llama.cpp's mmproj GGUF
    mmproj_families  how llama.cpp's converter writes each image-text family's mmproj (projector, splits, keys)
    mmproj_check  the mmproj read back with gguf-py and its image features compared with the model's
    image_text    an image-text model's GGUF + mmproj: what export checks, writes and reports
"""
