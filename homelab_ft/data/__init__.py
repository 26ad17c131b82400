"""Data: sources -> formats -> chat template -> tokens + loss mask -> truncate/drop -> pack -> batches.

The front door: a caller asks `prepare_for(recipe, tokenizer)` for the rows a recipe trains on and
batches them with `collate` (SFT samples) or `collate_pairs` (preference pairs). Inside, one
module per step:

    sources    where the data lives, reading rows, the eval hold-out, weights and mixing
    formats    a row -> the canonical sample (chat, alpaca, sharegpt, prompt_completion, text, preference, unpaired)
    templates  chat templates and the loss mask (which characters are trained)
    rows       the one cached tokenising map, the fit to max_length, the kept rows, padding
    sft        the SFT pipeline (`prepare_data`)       pairs    preference pairs, KTO unpaired rows
    prompts    GRPO's prompts and reward columns (`prepare_prompts`)
    packing    several samples per row                 sampling the trainer's micro-batches
    report     what was kept, cut and left out         prepare  `prepare_for`: the objective's pipeline
    fingerprint  what a run's data was, recorded in each checkpoint so `--resume` knows when it changed
    lengths    the training rows' token lengths, kept for `plan` to price a step at (its input, not its I/O)
    images     image content parts (a file or a data: URI), reading and resizing an image (`data.images`)
    image_rows image rows through the model's processor: image tokens masked and never cut, pixel batches

The front door imports no torch (`collate` does when called), so reading or inspecting data
does not pay for it; the trainer's `sampling.MicroBatchSampler` is torch and imported from there.
"""

from homelab_ft.data.pairs import collate_pairs, prepare_pairs
from homelab_ft.data.prepare import prepare_for
from homelab_ft.data.prompts import prepare_prompts
from homelab_ft.data.report import DataReport, PreparedData, SourceReport
from homelab_ft.data.rows import collate
from homelab_ft.data.sft import prepare_data
from homelab_ft.labels import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "DataReport",
    "PreparedData",
    "SourceReport",
    "collate",
    "collate_pairs",
    "prepare_data",
    "prepare_for",
    "prepare_pairs",
    "prepare_prompts",
]
