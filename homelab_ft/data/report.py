"""What data preparation hands the trainer: the final rows and the report of what was kept.

The SFT pipeline (sft.py) and the preference pairs' (pairs.py) give the same types, so the
trainer, `homelab-ft data inspect` and the training log read one report whichever it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets


@dataclass(frozen=True)
class SourceReport:
    name: str
    """The recipe's path for this source."""
    format: str
    num_rows_read: int
    """Rows in the source, malformed ones included."""
    num_rows_skipped: int
    """Malformed rows left out under `data.bad_rows: skip`."""
    num_samples: int
    """Samples this source contributes to its split, after limit, eval hold-out and weight."""
    first_error: str | None = None
    """The first skipped row's message, so a user sees what kind of rows were skipped."""


@dataclass(frozen=True)
class DataReport:
    sources: tuple[SourceReport, ...]
    eval_sources: tuple[SourceReport, ...]
    num_train_samples: int
    """Tokenised training samples kept (after truncation/dropping, before packing)."""
    num_eval_samples: int
    num_train_rows: int
    """Rows the trainer batches: packed rows when packing, else samples."""
    num_train_tokens: int
    num_trained_tokens: int
    """Training tokens that carry loss (label != -100)."""
    num_truncated: int
    num_dropped_overlong: int
    num_dropped_no_target: int
    """Samples with no trained token left (e.g. the prompt alone fills max_length)."""
    num_bad_template: int
    """Samples the chat template could not render into exact spans (skipped under bad_rows: skip)."""
    max_length: int
    packed: bool
    non_pad_fraction: float
    """Real tokens / (rows x max_length) of the training rows: the packing efficiency."""
    sample_lengths: tuple[int, ...]
    """Token count of every kept training sample (for the length histogram)."""
    cache_hit: bool
    """True when every tokenised split came from the cache instead of being tokenised again."""
    pairs: bool = False
    """Preference pairs (objective: dpo): samples are pairs, tokens and lengths count both answers' rows."""
    desirable: tuple[int, int] | None = None
    """Unpaired rows (dpo.loss: kto): the kept training rows labelled desirable and undesirable."""
    prompts: bool = False
    """Prompts (objective: grpo, prompts.py): samples are prompts, their tokens the prompts' (no loss yet)."""
    num_bad_images: int = 0
    """Image rows left out under `bad_rows: skip` because an image could not be decoded."""
    num_cut_images: int = 0
    """Image rows whose cut at max_length would fall in an image (image_rows.py: refused, or listed by inspect)."""
    cut_image_rows: tuple[str, ...] = ()
    """The first of those rows (file: row N), for `data inspect` to name."""
    image_rows: tuple[tuple[int, int], ...] = ()
    """(images, image tokens) of every kept training sample of an image run, in `sample_lengths`' order."""

    @property
    def unit(self) -> str:
        """What one training row is: a sample (sft), a pair (dpo), an unpaired row (kto) or a prompt (grpo)."""
        if self.desirable is not None:
            return "unpaired row"
        return "pair" if self.pairs else "prompt" if self.prompts else "sample"

    def summary(self) -> str:
        """One line for the training log: what was kept, cut and left out."""
        skipped = sum(s.num_rows_skipped for s in self.sources + self.eval_sources)
        if self.prompts:  # GRPO's rows carry no loss until their completions are sampled
            return (f"data: {self.num_train_samples} training prompts ({self.num_train_tokens:,} tokens), "
                    f"{self.num_eval_samples} eval; truncated {self.num_truncated} (their first tokens), dropped "
                    f"{self.num_dropped_overlong} too long, skipped {skipped} bad rows")
        packed = f"; packed into {self.num_train_rows} rows, {self.non_pad_fraction:.1%} non-pad" if self.packed else ""
        return (
            f"data: {self.num_train_samples} training {self.unit}s ({self.num_train_tokens:,} tokens, "
            f"{self.num_trained_tokens:,} with loss), {self.num_eval_samples} eval; truncated {self.num_truncated}, "
            f"dropped {self.num_dropped_overlong} too long and {self.num_dropped_no_target} with nothing to learn, "
            f"skipped {skipped} bad rows{packed}{' (tokenised data from the cache)' if self.cache_hit else ''}"
        )


@dataclass(frozen=True)
class PreparedData:
    train: datasets.Dataset
    """Rows with input_ids, labels (-100 = no loss) and, when packed, position_ids; or a pair's
    chosen_/rejected_ input_ids and labels."""
    eval: datasets.Dataset | None
    report: DataReport
    pixels: object | None = None
    """Image rows (data.images): the `image_rows.PixelBatcher` that adds a batch's pixel inputs
    (`rows.collate(..., pixels=)`); None for text rows."""


KTO_BAND = (1.0, 4 / 3)
"""The desirable:undesirable ratio (each side weighted by its dpo.*_weight) KTO's authors recommend:
lambda_D n_D / (lambda_U n_U) in [1, 4/3] (Ethayarajh et al. 2024)."""


def desirable_line(num_desirable: int, num_undesirable: int, *, desirable_weight: float,
                   undesirable_weight: float) -> str:
    """`data inspect`'s line on an unpaired set's labels, with a warning outside KTO_BAND."""
    total = max(num_desirable + num_undesirable, 1)
    line = (f"labels: {num_desirable} desirable : {num_undesirable} undesirable "
            f"({num_desirable / total:.0%} : {num_undesirable / total:.0%})")
    if not num_desirable or not num_undesirable:
        missing = "undesirable (label false)" if num_desirable else "desirable (label true)"
        return line + f"\nwarning: no {missing} rows; KTO learns from both kinds"
    weighted = desirable_weight * num_desirable / (undesirable_weight * num_undesirable)
    low, high = KTO_BAND
    if low <= weighted <= high:
        return line + f"; weighted ratio {weighted:.2f}, inside KTO's recommended 1 to 4/3"
    # the weight that brings the weighted ratio to the band's middle, 7/6
    fix = 7 / 6 * undesirable_weight * num_undesirable / num_desirable
    return (line + f"\nwarning: dpo.desirable_weight x desirable : dpo.undesirable_weight x undesirable is "
            f"{weighted:.2f}, outside the 1 to 4/3 KTO's authors recommend (Ethayarajh et al. 2024); "
            f"set dpo.desirable_weight={fix:.3g} (or balance the data)")
