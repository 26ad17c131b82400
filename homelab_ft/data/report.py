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
    prompts: bool = False
    """Prompts (objective: grpo, prompts.py): samples are prompts, their tokens the prompts' (no loss yet)."""

    @property
    def unit(self) -> str:
        """What one training row is: a sample (sft), a pair (dpo) or a prompt (grpo)."""
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
