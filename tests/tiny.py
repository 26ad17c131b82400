"""Tiny random models and tokenizers saved to disk, so tests load them through the same
`from_pretrained` path that real users hit. Nothing here touches the network."""

from __future__ import annotations

from pathlib import Path

# SmolLM2's template (ChatML): it has no {% generation %} block, so transformers' assistant mask
# comes back empty for it; the data pipeline must find the assistant spans another way.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "answer: yes. answer: no. the capital of france is paris",
    "user assistant system hello world what is two plus two four",
    "0 1 2 3 4 5 6 7 8 9 10 ten twenty thirty forty fifty",
    "translate to french: cat -> chat, dog -> chien, bird -> oiseau",
    "Please respond in the format ANSWER: <value> with nothing else.",
]


def make_tokenizer(out_dir: Path, *, chat_template: str = CHATML_TEMPLATE, vocab_size: int = 320,
                   corpus: list[str] = CORPUS):
    """A byte-level BPE tokenizer trained on a few lines (`corpus`), with ChatML specials and a template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = chat_template
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def make_llama(
    out_dir: Path,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    with_tokenizer: bool = True,
) -> Path:
    """Save a tiny random Llama (+ tokenizer) to `out_dir` and return the directory."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tokenizer = make_tokenizer(out_dir) if with_tokenizer else None
    vocab = len(tokenizer) if tokenizer is not None else 320
    vocab = (vocab + 31) // 32 * 32
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id if tokenizer else 1,
        eos_token_id=tokenizer.eos_token_id if tokenizer else 2,
        pad_token_id=tokenizer.pad_token_id if tokenizer else 0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out_dir)
    return out_dir


def file_modes(folder: Path) -> dict[str, int]:
    """Every file under `folder`, relative name -> permission bits."""
    return {str(p.relative_to(folder)): p.stat().st_mode & 0o777 for p in sorted(folder.rglob("*")) if p.is_file()}
