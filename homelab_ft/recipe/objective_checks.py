"""What each `objective` needs of the rest of the recipe beyond every field's own type: pairs or
unpaired rows for preference tuning (in the format its `dpo.loss` reads), no preference rows for SFT,
rewards for GRPO. Called by `config.recipe_from_dict` once the sections validate, with the `config.Recipe` (and its
`GrpoConfig`), which it does not import: config imports this module. Torch-free."""

from __future__ import annotations

from homelab_ft.errors import UserError

_PREFERENCE_FORMATS = {
    "preference": ("objective=dpo trains on preference pairs", "use format: preference (rows with prompt or messages, "
                   "chosen, rejected), or dpo.loss=kto for unpaired rows"),
    "unpaired": ("dpo.loss=kto trains on unpaired rows", "use format: unpaired (rows with prompt or messages, "
                 "completion, a boolean label), or another dpo.loss for pairs"),
}
"""What each preference format's losses read, and the fix, said when a source's format is another."""


def check_objective(recipe, *, source: str = "recipe") -> None:
    """What `objective` needs from the data section: pairs for DPO, no pairs for SFT.

    Preference pairs are trained unpacked (a pair's two answers must each be scored whole against
    the same prompt) and only on the answers (the prompt is shared by both, so its log-probability
    cancels in the DPO margin and training on it would only add an SFT term no one asked for).
    """
    sources = [(f"data.sources[{i}]", s) for i, s in enumerate(recipe.data.sources)]
    sources += [(f"data.eval_sources[{i}]", s) for i, s in enumerate(recipe.data.eval_sources)]
    if recipe.objective == "dpo":
        wanted = recipe.dpo.data_format
        for where, src in sources:
            if src.format not in ("auto", wanted):
                what, fix = _PREFERENCE_FORMATS[wanted]
                raise UserError(f"{source}: {what}, but {where}.format={src.format} has none; {fix}")
        if recipe.data.packing:
            raise UserError(f"{source}: objective=dpo scores each answer of a pair whole and does not pack; "
                            "set data.packing=false")
        if recipe.data.train_on_inputs:
            raise UserError(f"{source}: objective=dpo compares the answers of a pair, not the prompt they share; "
                            "set data.train_on_inputs=false (dpo.sft_weight adds a loss on the chosen answer)")
        if recipe.dpo.loss == "orpo" and recipe.dpo.label_smoothing:
            raise UserError(f"{source}: dpo.label_smoothing is conservative DPO's; ORPO's loss has no flipped-label "
                            "term (Hong et al. 2024): set dpo.label_smoothing=0 or another dpo.loss")
        if recipe.dpo.unpaired and (recipe.dpo.label_smoothing or recipe.dpo.sft_weight):
            key = "label_smoothing" if recipe.dpo.label_smoothing else "sft_weight"
            raise UserError(f"{source}: dpo.{key} is a paired loss's term; KTO's rows have no pair to flip or chosen "
                            f"answer (Ethayarajh et al. 2024): set dpo.{key}=0 or another dpo.loss")
    if recipe.data.images:
        check_images(recipe, source=source)
    if recipe.objective != "dpo":
        if recipe.objective == "grpo":
            check_grpo(recipe.grpo, source=source)
        for where, src in sources:
            if src.format in _PREFERENCE_FORMATS:
                raise UserError(f"{source}: {where}.format={src.format} holds rows for preference tuning; "
                                "set objective: dpo, or use an SFT format")


def check_images(recipe, *, source: str = "recipe") -> None:
    """Image rows train with SFT, one sample per row: the pair and prompt pipelines read text, and a
    packed row would hand the vision tower several samples' images whose tokens attention must keep
    apart (not built). Resize bounds must be ordered."""
    if recipe.objective != "sft":
        raise UserError(f"{source}: data.images trains with objective: sft; objective={recipe.objective} reads text "
                        "rows only: set objective: sft, or data.images=false")
    if recipe.data.packing:
        raise UserError(f"{source}: data.images rows are not packed (each row's images stay with its tokens); "
                        "set data.packing=false")
    if recipe.train.sample_every:
        raise UserError(f"{source}: train.sample_every samples replies to text prompts; with data.images set "
                        "train.sample_every=0 (`homelab-ft chat RUN --image PATH` shows the model's replies)")
    low, high = recipe.data.image_min_pixels, recipe.data.image_max_pixels
    if low is not None and high is not None and low > high:
        raise UserError(f"{source}: data.image_min_pixels={low} is above data.image_max_pixels={high}; "
                        "lower the first or raise the second")


def check_grpo(grpo, *, source: str = "recipe") -> None:
    """What `objective: grpo` needs of its section beyond each field's type: a reward to learn from,
    and one weight per reward function. Whether each function imports is preflight's check
    (train/rewards.py), which knows the recipe's folder."""
    if not grpo.reward_funcs:
        raise UserError(f"{source}: objective=grpo learns from rewards; name at least one in grpo.reward_funcs "
                        "(e.g. [exact_answer], or rewards.py:my_reward for a function in a file beside the recipe)")
    if grpo.reward_weights is not None and len(grpo.reward_weights) != len(grpo.reward_funcs):
        raise UserError(f"{source}: grpo.reward_weights has {len(grpo.reward_weights)} weights for "
                        f"{len(grpo.reward_funcs)} grpo.reward_funcs; give one per function, or none for 1.0 each")
    if grpo.max_staleness and grpo.rollout == "colocated":
        raise UserError(f"{source}: grpo.max_staleness={grpo.max_staleness} overlaps a rollout node's generation with "
                        "training; grpo.rollout=colocated generates in the training process, always fresh: drop "
                        "grpo.max_staleness, or use grpo.rollout: node (or auto)")
