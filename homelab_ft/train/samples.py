"""Sample generations during training (`train.sample_every`): what the model says, not only its loss.

Every `sample_every` optimizer steps the loop asks `Samples.run` for greedy replies to a few prompts:
the recipe's `train.sample_prompts` (rendered with the chat template the data is trained with,
`data.system_prompt` as the system turn, as `homelab-ft generate` renders a prompt), or else the
prompts of the first `NUM_EVAL_PROMPTS` held-out rows (their tokens up to the first trained one,
already in the training template). The replies go to metrics.jsonl as a row with `samples` (the
loss plot and the resume truncation read only `step`, `loss` and `eval_loss`), to TensorBoard as
text, and to the progress output.

Sampling must not change the training: greedy decoding draws no random numbers, but the RNG
states are saved and restored anyway (a model's generate may draw), and so is the train/eval mode.
Under FSDP2 every rank runs the same forwards (the parameters are all-gathered inside each
unit's forward), so every rank generates with `synced_gpus` (transformers keeps ranks that finished
early running dummy forwards until all have); rank 0 logs. Under DDP the wrapped module generates
on its own: DDP's forward only syncs buffers, which a no-grad reply need not do.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from homelab_ft.data.templates import render, resolve_template
from homelab_ft.distributed import parallelize
from homelab_ft.errors import UserError
from homelab_ft.labels import IGNORE_INDEX
from homelab_ft.recipe.config import Recipe

log = logging.getLogger(__name__)

NUM_EVAL_PROMPTS = 3
"""Held-out rows sampled when `train.sample_prompts` is empty: a few replies read in a glance."""


@dataclass(frozen=True)
class Prompt:
    text: str
    """What the log shows: the recipe's prompt, or the decoded held-out prompt."""
    ids: tuple[int, ...]
    """The rendered prompt's tokens, ending where the reply starts."""


@dataclass(frozen=True)
class Samples:
    """The prompts of one run and how to turn them into replies; `every == 0` is off."""

    prompts: tuple[Prompt, ...]
    tokenizer: object
    every: int
    max_new_tokens: int

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def run(self, model, *, step: int, env, logger, progress) -> list[dict]:
        """Greedy replies on every rank (see the module docstring); rank 0's logger writes them."""
        replies = [{"prompt": p.text, "completion": self._reply(model, p, env=env)} for p in self.prompts]
        logger.log_samples(step, replies)
        for reply in replies:
            progress.write(f"step {step}: sample {reply['prompt']!r} -> {reply['completion']!r}")
        return replies

    def _reply(self, model, prompt: Prompt, *, env) -> str:
        target = getattr(model, "module", model)  # DDP's wrapper has no generate; its module does
        ids = torch.tensor([prompt.ids], device=env.device)
        with preserved(target, device=env.device), root_gathered(target), torch.no_grad():
            out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens,
                                  do_sample=False, use_cache=True, pad_token_id=self.tokenizer.pad_token_id,
                                  synced_gpus=env.distributed)
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


@contextlib.contextmanager
def root_gathered(model):
    """The FSDP2 root unit's parameters gathered for a generate, and every unit sharded again after.

    The root unit (the final norm; a tied embedding) is gathered by a hook on the root's forward, but
    PEFT's `generate` calls the wrapped model's forward, not the PeftModel's: without this its norm
    weight stays a shard ("mixed torch.Tensor and DTensor"). The blocks, the embeddings and the head
    are units of their own, gathered by their own forwards. After the reply, nothing would reshard
    the root (it keeps its parameters from forward to backward, and no backward follows), and the
    optimizer and the checkpoint know only the sharded parameters, so every unit is resharded.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.unshard()
    try:
        yield
    finally:
        parallelize.reshard(model)


@contextlib.contextmanager
def preserved(model, *, device):
    """Eval mode and no-grad inside; the mode and the RNG states (CPU and the device's) as they were after."""
    training = model.training
    cpu_state = torch.random.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    model.eval()
    try:
        yield
    finally:
        model.train(training)
        torch.random.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)


def for_run(recipe: Recipe, tokenizer, data, *, base_dir=None) -> Samples:
    """The run's prompts, refused in one line before the run directory is touched when there are none."""
    cfg = recipe.train
    if not cfg.sample_every:
        return Samples(prompts=(), tokenizer=tokenizer, every=0, max_new_tokens=cfg.sample_max_new_tokens)
    if cfg.sample_prompts:
        template = resolve_template(tokenizer, recipe.data.chat_template, base_dir=base_dir)
        prompts = tuple(_rendered(text, tokenizer, template, system=recipe.data.system_prompt)
                        for text in cfg.sample_prompts)
    else:
        prompts = held_out_prompts(data.eval, tokenizer)
    if not prompts:
        raise UserError(f"train.sample_every={cfg.sample_every} needs prompts: set train.sample_prompts "
                        f"(e.g. [\"What is the capital of France?\"]); {_why_no_eval(recipe, data)}")
    return Samples(prompts=prompts, tokenizer=tokenizer, every=cfg.sample_every, max_new_tokens=cfg.sample_max_new_tokens)


def _why_no_eval(recipe: Recipe, data) -> str:
    if data.eval is None:
        return "the run has no held-out rows to take them from (data.eval_sources / data.eval_fraction)"
    return ("its held-out rows have no untrained prompt to take (data.train_on_inputs=true trains every token)"
            if recipe.data.train_on_inputs else "its held-out rows have no untrained prompt to take")


def _rendered(text: str, tokenizer, template: str | None, *, system: str | None) -> Prompt:
    """One user turn (after `system`, as training inserts it), rendered up to the reply; plain text without a template."""
    if template is None:
        return Prompt(text=text, ids=tuple(tokenizer(text)["input_ids"]))
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    rendered = render(tokenizer, template, messages, add_generation_prompt=True)
    return Prompt(text=text, ids=tuple(tokenizer(rendered, add_special_tokens=False)["input_ids"]))


def held_out_prompts(rows, tokenizer, *, limit: int = NUM_EVAL_PROMPTS) -> tuple[Prompt, ...]:
    """Up to `limit` held-out prompts: each row's tokens before its first trained one (the chosen side of a
    preference pair; the first sample of a packed row). Rows whose every token is trained give none."""
    if rows is None:
        return ()
    if "prompt_ids" in rows.column_names:  # GRPO's prompt rows (data/prompts.py): the prompt is the row
        return tuple(Prompt(text=tokenizer.decode(ids, skip_special_tokens=True).strip(), ids=tuple(ids))
                     for ids in rows[:limit]["prompt_ids"])
    side = "" if "input_ids" in rows.column_names else "chosen_"
    prompts = []
    for i in range(len(rows)):
        row = rows[i]
        labels = row[f"{side}labels"]
        first = next((j for j, label in enumerate(labels) if label != IGNORE_INDEX), 0)
        if first:
            ids = tuple(row[f"{side}input_ids"][:first])
            prompts.append(Prompt(text=tokenizer.decode(ids, skip_special_tokens=True).strip(), ids=ids))
        if len(prompts) == limit:
            break
    return tuple(prompts)
