"""GRPO's rollouts: `num_generations` completions sampled for each prompt, in the layout the loss reads.

`Colocated` is the engine that runs in the training process itself (one machine, the default):
transformers' `generate` with its KV cache, batched over a micro-batch's prompts x their
generations, the adapters live (PEFT's forward: no merge, so a 4-bit base is never merged into and
dequantised for the generator; the merge is what makes peers' QLoRA generators lossy). An engine is
one method, `sample(model, rows, seed) -> Rollout`, so another (a rollout rank on a second machine)
can take its place without the step changing.

Sampling is seeded per step, micro-batch and rank (`seed_for`) inside a forked RNG: a resumed run
draws the very completions the uninterrupted one drew (given the same weights), and sampling never
moves the RNG the training uses. `top_k` is off and no repetition penalty applies: the loss's
log-probabilities are those of the plain tempered distribution, so the sampler must draw from it
(top_p, when below 1, is the one truncation TRL applies too).

Under FSDP2 every rank generates with `synced_gpus` (ranks that finished early keep running dummy
forwards until all have, since each forward gathers parameters with every rank) and the root unit
gathered (samples.root_gathered says why); under DDP the wrapped module generates on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from homelab_ft.data.prompts import decoded
from homelab_ft.distributed import parallelize
from homelab_ft.recipe.objectives import GrpoConfig
from homelab_ft.train.samples import preserved, root_gathered


@dataclass(frozen=True)
class Rollout:
    """One micro-batch's completions: its prompts' rows x `num_generations`, a group's rows consecutive."""

    input_ids: torch.Tensor
    """[N, P + C]: prompts left-padded to P, completions right-padded to C (TRL's layout)."""
    attention_mask: torch.Tensor
    """[N, P + C]: 1 on prompt tokens and on completion tokens up to and including the end of sequence."""
    completion_mask: torch.Tensor
    """[N, C]: 1 on the completion tokens the loss reads (`loss.completion_logprobs`)."""
    truncated: torch.Tensor
    """[N] bool: no end-of-sequence token within `grpo.max_completion_length`."""
    completion_ids: list[list[int]]
    """Each completion's tokens, its end-of-sequence token included, padding excluded (TRL's)."""
    completions: list
    """Each completion decoded: text, or `[{"role": "assistant", "content": text}]` after a chat prompt (TRL's)."""
    prompts: list
    """Each row's prompt (text or messages) as the data set had it, repeated per generation."""
    columns: dict[str, list]
    """The data set's other columns, one value per completion, for the reward functions."""
    sampling_logps: torch.Tensor | None = None
    """[N, C]: the completions' log-probs under the weights that sampled them, when those may be older
    than the trainer's (a rollout node with grpo.max_staleness > 0: truncated importance sampling)."""

    @property
    def batch(self) -> dict:
        """What `loss.completion_logprobs` reads (`logprob_batch`)."""
        return logprob_batch(self.input_ids, self.attention_mask, self.completion_mask)

    @property
    def num_completions(self) -> int:
        return self.input_ids.size(0)


def logprob_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor) -> dict:
    """What `loss.completion_logprobs` reads. The positions count only real tokens, as `generate`
    counted them: a left-padded prompt's first token is at position 0 whatever the padding, so a
    row's log-probs do not depend on the rows it was batched with (nor on the ranks of the job)."""
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "completion_mask": completion_mask}


def completion_layout(out: torch.Tensor, *, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      ends: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`generate`'s output ([N, P + c]: the left-padded prompts, then c <= C tokens) as the loss reads
    it: input ids, attention mask, completion mask (1 up to and including the first end token) and
    which rows were cut (no end token). The trainer and a rollout rank lay out the same ids alike."""
    completion = out[:, prompt_ids.size(1):]  # at least one token: max_completion_length >= 1
    is_end = torch.isin(completion, torch.tensor(ends, device=completion.device))
    has_end = is_end.any(dim=1)
    first_end = torch.where(has_end, is_end.int().argmax(dim=1), torch.full_like(has_end, completion.size(1), dtype=torch.long))
    positions = torch.arange(completion.size(1), device=completion.device).unsqueeze(0)
    completion_mask = (positions <= first_end.unsqueeze(1)).long()
    # generate stops when every row has ended or the length ran out: a row without an end token was cut.
    return (torch.cat([prompt_ids, completion], dim=1), torch.cat([prompt_mask, completion_mask], dim=1),
            completion_mask, ~has_end)


def seed_for(seed: int, *, step: int, micro_batch: int, rank: int) -> int:
    """The sampling seed of one micro-batch's rollout: distinct per step, micro-batch and rank, and
    the same after a resume (a 63-bit mix of the four, so neighbouring steps do not share streams)."""
    value = (seed * 1_000_003 + step) * 1_000_033 + micro_batch
    return (value * 1_000_037 + rank) % (2**63 - 1)


def end_token_ids(tokenizer, model) -> list[int]:
    """Every token that ends a completion: the tokenizer's end of sequence and the model's
    generation config's (a chat model's end-of-turn token is often only there)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = getattr(_generator(model), "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    ids |= set(extra if isinstance(extra, (list, tuple)) else [] if extra is None else [extra])
    return sorted(ids)


def left_padded(prompts: list[list[int]], *, pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one [N, P] batch padded on the left (the completion starts at
    the same column for every row), and its attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def _unrooted(model) -> bool:
    """A sharded model whose root has not run a forward yet (`_root_forward`)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) and not getattr(model, "_homelab_root_initialised", False)


def _root_forward(model, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """FSDP2 sets itself up on the first forward of a sharded unit and takes that unit as the root.
    PEFT's `generate` calls the inner model's forward, so a run whose first forward is a generation
    (GRPO's: before any training step) would root FSDP2 at the embeddings and then refuse the real
    root's forward ("already been lazily initialized"). One forward of the root on one token first,
    once per model, on every rank (each forward gathers with all of them)."""
    model(input_ids=ids, attention_mask=mask, use_cache=False)
    parallelize.reshard(model)
    model._homelab_root_initialised = True


def _generator(model):
    return getattr(model, "module", model)  # DDP's wrapper has no generate; its module does


@dataclass(frozen=True)
class Colocated:
    """Generation in the training process (module docstring)."""

    settings: GrpoConfig
    tokenizer: object
    device: torch.device
    distributed: bool
    """Several ranks: FSDP2 needs every rank to run the same forwards (`synced_gpus`)."""

    def sample(self, model, rows: list[dict], *, seed: int, greedy: bool = False,
               num_generations: int | None = None) -> Rollout:
        """The completions of `rows` (prepared prompt rows, data/prompts.py), `num_generations` each
        (default the recipe's), sampled at the recipe's temperature and top_p (`greedy`: the most likely
        completion instead, for the held-out reward)."""
        g = self.settings.num_generations if num_generations is None else num_generations
        ids, mask = self.prompts(rows, g=g)
        ends = end_token_ids(self.tokenizer, model)
        out = self.generate(model, ids, mask, ends=ends, seed=seed, greedy=greedy)
        return self.rollout(out, prompt_ids=ids, prompt_mask=mask, ends=ends, rows=rows, g=g)

    def sync_stats(self) -> dict[str, float]:
        """What the engine sent to generate since last asked: nothing here (rollout_node.Remote sends adapters)."""
        return {}

    def prompts(self, rows: list[dict], *, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's prompt `g` times, left-padded on this engine's device, and its attention mask."""
        return left_padded([list(r["prompt_ids"]) for r in rows for _ in range(g)], pad_token_id=self.tokenizer.pad_token_id,
                           device=self.device)

    def generate(self, model, ids: torch.Tensor, mask: torch.Tensor, *, ends: list[int], seed: int,
                 greedy: bool) -> torch.Tensor:
        """`generate`'s output for left-padded prompts: seeded inside a forked RNG (module docstring)."""
        target = _generator(model)
        sampling = {} if greedy else {"temperature": self.settings.temperature, "top_p": self.settings.top_p, "top_k": 0}
        devices = [self.device] if self.device.type == "cuda" else []
        if _unrooted(target):
            with torch.random.fork_rng(devices=devices), preserved(target, device=self.device), torch.no_grad():
                _root_forward(target, ids[:, :1], mask[:, :1])
        with torch.random.fork_rng(devices=devices), preserved(target, device=self.device), root_gathered(target), \
                torch.no_grad():
            torch.manual_seed(seed)
            return target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.settings.max_completion_length,
                                   min_new_tokens=0, do_sample=not greedy, repetition_penalty=1.0,
                                   pad_token_id=self.tokenizer.pad_token_id, eos_token_id=ends, use_cache=True,
                                   synced_gpus=self.distributed, **sampling)

    def rollout(self, out: torch.Tensor, *, prompt_ids, prompt_mask, ends: list[int], rows: list[dict],
                g: int) -> Rollout:
        """A Rollout from `generate`'s output ([N, P + c]: the left-padded prompts, then c <= C tokens)."""
        input_ids, attention_mask, completion_mask, truncated = completion_layout(
            out, prompt_ids=prompt_ids, prompt_mask=prompt_mask, ends=ends)
        completion = input_ids[:, prompt_ids.size(1):]
        completion_ids = [completion[i, : int(completion_mask[i].sum())].tolist() for i in range(completion.size(0))]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        parsed = [decoded(row) for row in rows]
        prompts = [prompt for prompt, _ in parsed for _ in range(g)]
        names = list(dict.fromkeys(key for _, cols in parsed for key in cols))  # a row without a column gives None
        columns = {key: [cols.get(key) for _, cols in parsed for _ in range(g)] for key in names}
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts,
                                                                                                          strict=True)]
        return Rollout(input_ids=input_ids.cpu(), attention_mask=attention_mask.cpu(),
                       completion_mask=completion_mask.cpu(), truncated=truncated.cpu(), completion_ids=completion_ids,
                       completions=completions, prompts=prompts, columns=columns)
