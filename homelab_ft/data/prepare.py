"""The data a recipe trains on, whichever its objective: the one call the trainer and
`homelab-ft data inspect` make, so both see exactly the same rows."""

from __future__ import annotations

from pathlib import Path

from homelab_ft.data.pairs import prepare_pairs
from homelab_ft.data.prompts import prepare_prompts
from homelab_ft.data.report import PreparedData
from homelab_ft.data.sft import prepare_data
from homelab_ft.recipe.config import Recipe


def prepare_for(recipe: Recipe, tokenizer, *, base_dir: Path | None = None) -> PreparedData:
    """Samples for SFT, preference pairs for DPO, prompts (and their reward columns) for GRPO."""
    if recipe.objective == "grpo":
        return prepare_prompts(recipe.data, tokenizer, seed=recipe.train.seed, base_dir=base_dir)
    if recipe.objective == "dpo":
        return prepare_pairs(recipe.data, tokenizer, seed=recipe.train.seed, base_dir=base_dir,
                             unpaired=recipe.dpo.unpaired)
    return prepare_data(recipe.data, tokenizer, seed=recipe.train.seed, base_dir=base_dir)
