"""The objectives' own sections: `dpo` (preference tuning: DPO, IPO, ORPO, SimPO, KTO) and `grpo`
(learning from rewards), each a frozen pydantic dataclass with every default once, as in config.py,
whose `Recipe` holds them. What an objective needs of the *other* sections is objective_checks.py's.
Torch-free.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from homelab_ft.recipe.bounds import MAX_INT64, STRICT, NonNegative, NonNegInt, Positive, PositiveInt
from homelab_ft.recipe.io import attach_field_docs

PREFERENCE_LOSSES = ("sigmoid", "ipo", "orpo", "simpo", "kto")
REFERENCE_FREE_LOSSES = ("orpo", "simpo")
UNPAIRED_LOSSES = ("kto",)
"""Losses that learn from unpaired rows (format `unpaired`: a completion and a boolean label)."""
KTO_MIN_STEP_ROWS = 4
"""KTO's reference point z0 is the mean policy/reference log-ratio over the step's mismatched
(prompt, completion) pairs (Ethayarajh et al. 2024, eq. 8 and section 4.1); fewer than 4 rows per
step make that estimate one or two numbers, and TRL warns below the same size."""


@dataclass(frozen=True, config=STRICT)
class DpoConfig:
    beta: Positive = 0.1
    """Strength of the pull towards the reference model (the KL weight in the DPO paper, Rafailov
    et al. 2023); 0.1 is the paper's and TRL's default."""
    loss: Literal[PREFERENCE_LOSSES] = "sigmoid"
    """`sigmoid`: the DPO paper's -log sigmoid(beta * margin); `ipo`: (margin - 1/(2 beta))^2 from
    Azar et al. 2023, which cannot drive the margin to infinity on deterministic preferences;
    `orpo` (Hong et al. 2024): the chosen answer's NLL plus beta (the paper's lambda, TRL's 0.1)
    times the odds-ratio loss, no reference model; `simpo` (Meng et al. 2024): -log sigmoid of beta
    times the length-normalised log-probability margin minus `simpo_gamma`, no reference model (the
    paper's setting: beta 2.0 to 2.5 with simpo_gamma / beta about 0.5; TRL's CPO defaults beta 0.1);
    `kto` (Ethayarajh et al. 2024): unpaired rows (format `unpaired`), each completion's
    policy/reference log-ratio against the batch's KL estimate, weighted by `desirable_weight` or
    `undesirable_weight` by its label (TRL's KTOTrainer defaults: beta 0.1, both weights 1.0)."""
    label_smoothing: Annotated[float, Field(ge=0.0, lt=0.5)] = 0.0
    """Probability that a pair's label is wrong (conservative DPO): the loss mixes in the flipped pair."""
    sft_weight: NonNegative = 0.0
    """Weight of a negative log-likelihood term on the chosen answer, per token (RPO, Pang et al. 2024)."""
    simpo_gamma: NonNegative = 0.5
    """SimPO's target reward margin gamma (`loss: simpo`; TRL's CPOConfig name and default)."""
    desirable_weight: Positive = 1.0
    """KTO's lambda_D, the weight of a desirable (label true) row's loss (`loss: kto`; TRL's name and
    default). The paper advises lambda_D n_D / (lambda_U n_U) in [1, 4/3] (Ethayarajh et al. 2024)."""
    undesirable_weight: Positive = 1.0
    """KTO's lambda_U, the weight of an undesirable (label false) row's loss (`loss: kto`; TRL's default)."""

    @property
    def needs_reference(self) -> bool:
        """DPO, IPO and KTO compare with a reference model; ORPO and SimPO need none (no reference forward,
        no cached pre-pass)."""
        return self.loss not in REFERENCE_FREE_LOSSES

    @property
    def unpaired(self) -> bool:
        """KTO learns from unpaired rows (format `unpaired`), the other losses from pairs (`preference`)."""
        return self.loss in UNPAIRED_LOSSES

    @property
    def data_format(self) -> str:
        """The source format this loss reads: `unpaired` for KTO, `preference` for the others."""
        return "unpaired" if self.unpaired else "preference"


ROLLOUT_ENGINES = ("auto", "colocated", "node")
"""grpo.rollout: the planner's choice, generation in the training process, or on a rollout rank
(train/rollout_node.py)."""
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
"""train/grpo_loss.py's aggregations of the per-token loss, TRL 1.16's names (its cispo, sapo,
luspo and vespo are not built)."""
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IS_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""How a stale rollout's importance weights are bounded (TRL's vllm_importance_sampling_mode values)."""
RewardEntry = str | dict[str, dict[str, Any]]
"""A built-in's name, `file.py:function`, `module:function`, or `{built-in: {parameters}}` (train/rewards.py)."""


@dataclass(frozen=True, config=STRICT)
class GrpoConfig:
    """`objective: grpo` (issue 33): sample `num_generations` completions per prompt, score them with
    the reward functions, and push up those better than their group. Names and defaults are TRL
    1.16's GRPOConfig, so a TRL recipe's values mean the same here (train/grpo_loss.py cites the papers)."""

    num_generations: Annotated[int, Field(ge=2, le=MAX_INT64)] = 8
    """Completions sampled per prompt: the group whose mean reward is each one's baseline (2 at least:
    one completion has nothing to be compared with)."""
    max_completion_length: PositiveInt = 512
    """Tokens generated per completion at most; also Dr. GRPO's constant (`loss_type: dr_grpo`).
    512 is TRL 1.16's default (trl/trainer/grpo_config.py; earlier TRL releases had 256)."""
    temperature: Annotated[float, Field(gt=0.0, le=100.0)] = 1.0
    """Sampling temperature, in (0, 100]; the log-probs of the loss are taken at the same temperature."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p; 1.0 samples from all."""
    beta: NonNegative = 0.0
    """Weight of the per-token KL to the reference model (k3 estimator); 0 (TRL's default since Dr. GRPO
    and DAPO found it unneeded) loads no reference."""
    epsilon: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.2
    """Lower clip bound of the ratio, 1 - epsilon (PPO's clip range), in (0, 1): 0 would pin every ratio to 1."""
    epsilon_high: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    """Upper clip bound, 1 + epsilon_high, in (0, 10] (DAPO's clip-higher uses 0.28); default: `epsilon`."""
    scale_rewards: Literal[SCALE_REWARDS] = "group"
    """What the advantage (reward minus its group's mean) is divided by: the group's reward std
    (`group`, GRPO), the batch's (`batch`), or nothing (`none`, Dr. GRPO)."""
    num_iterations: PositiveInt = 1
    """Optimizer steps on each sampled batch (GRPO's mu); above 1 the ratios to the sampling policy
    move away from 1 and the clipping starts to act."""
    mask_truncated_completions: bool = False
    """Leave completions cut at `max_completion_length` (no end-of-sequence token) out of the loss
    (DAPO's overlong filtering)."""
    loss_type: Literal[GRPO_LOSS_TYPES] = "dapo"
    """How per-token losses are averaged: `grpo` (per completion, then over completions), `dr_grpo`
    (sum / (completions x max_completion_length)), `dapo` (sum / completion tokens of the whole step,
    TRL's default), `bnpo` (sum / completion tokens of the micro-batch)."""
    importance_sampling_level: Literal[IMPORTANCE_SAMPLING_LEVELS] = "token"
    """`token`: one ratio per token (GRPO); `sequence`: one per completion, the exp of its mean
    log-ratio (GSPO)."""
    reward_funcs: tuple[RewardEntry, ...] = ()
    """The reward functions (train/rewards.py): `exact_answer`, `regex_match: {pattern: ...}`,
    `rewards.py:my_reward` (a file beside the recipe), `my_package.rewards:my_reward`; TRL's signature
    `f(prompts, completions, completion_ids, **columns) -> list[float | None]`."""
    reward_weights: tuple[float, ...] | None = None
    """One weight per reward function; default 1.0 each."""
    log_completions_every: NonNegInt = 10
    """Write the first prompt's group of completions, with their rewards, to metrics.jsonl (a `samples`
    row) every this many steps and at the last; 0: never."""
    rollout: Literal[ROLLOUT_ENGINES] = "auto"
    """Where the completions are generated: `colocated` (transformers' `generate` in the training
    process), or `node` (a rollout rank: the job's last process, on a second machine, holds the same
    base and adapters and generates; rank 0 trains as one process and sends it only the adapters when
    they changed, then the prompts; train/rollout_node.py). `node` needs a job of exactly 2 processes
    and LoRA or QLoRA; `max_staleness` says whether the trainer waits for it. `auto`: the planner prices both where
    the job can run a node and takes the fastest that fits: colocated when it fits (both ranks train),
    the node when only it does (its GPU holds the base and adapters, not training's memory)."""
    max_staleness: Annotated[int, Field(ge=0, le=1)] = 0
    """Optimizer steps the rollout node's adapters may lag the trainer's (grpo.rollout: node): 0
    waits for each batch (exactly the colocated run's completions); 1 overlaps: the next step's batch
    is generated with the adapters of this step's sampling while this step trains, and the loss is
    corrected by truncated importance sampling (`vllm_importance_sampling_*`). A batch due right after
    a checkpoint is always generated fresh, so a resume draws what the uninterrupted run drew."""
    vllm_importance_sampling_correction: bool = True
    """With max_staleness 1, weigh each token by its importance ratio between the trainer's policy and
    the (one step older) policy that sampled it (TIS: Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training"); TRL's key and default (there for vLLM's mismatch)."""
    vllm_importance_sampling_mode: Literal[IS_CORRECTION_MODES] = "token_truncate"
    """`token_truncate`: each token's ratio capped at `vllm_importance_sampling_cap` (the TIS paper's);
    `token_mask`: tokens above the cap weigh 0; `sequence_*`: one ratio per completion (the exp of its
    summed log-ratio), capped or masked."""
    vllm_importance_sampling_cap: Annotated[float, Field(gt=0.0, le=1e6)] = 3.0
    """The cap C on the importance ratio (TRL's default)."""

    @property
    def epsilon_upper(self) -> float:
        """The upper clip bound's epsilon: `epsilon_high`, or `epsilon` when unset."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


attach_field_docs(globals())  # help(GrpoConfig) lists every field with its docstring
