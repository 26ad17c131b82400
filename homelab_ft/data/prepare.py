"""The data a recipe trains on, whichever its objective: the one call the trainer and
`homelab-ft data inspect` make, so both see exactly the same rows (and keep their lengths for
`plan`, data/lengths.py)."""

from __future__ import annotations

from pathlib import Path

from homelab_ft.data import lengths
from homelab_ft.data.pairs import prepare_pairs
from homelab_ft.data.prompts import prepare_prompts
from homelab_ft.data.report import PreparedData
from homelab_ft.data.sft import prepare_data
from homelab_ft.recipe.config import Recipe


def prepare_for(recipe: Recipe, tokenizer, *, base_dir: Path | None = None, processor=None,
                refuse_cut: bool = True) -> PreparedData:
    """Samples for SFT (image rows through `processor` with data.images), preference pairs for DPO,
    prompts (and their reward columns) for GRPO. `refuse_cut`: image_rows.refuse_cut (inspect: False)."""
    if recipe.objective == "grpo":
        prepared = prepare_prompts(recipe.data, tokenizer, seed=recipe.train.seed, base_dir=base_dir)
    elif recipe.objective == "dpo":
        prepared = prepare_pairs(recipe.data, tokenizer, seed=recipe.train.seed, base_dir=base_dir,
                                 unpaired=recipe.dpo.unpaired)
    else:
        prepared = prepare_data(recipe.data, tokenizer, seed=recipe.train.seed, base_dir=base_dir, processor=processor,
                                refuse_cut=refuse_cut)
    lengths.store(recipe, prepared.report, base_dir=base_dir)
    return prepared
