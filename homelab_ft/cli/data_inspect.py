"""`homelab-ft data inspect RECIPE`: what the model will learn from, before any training.

Counts per source, tokens, a length histogram, what was truncated or dropped, the packing
efficiency, and one rendered sample with the trained tokens highlighted.
"""

from __future__ import annotations

from pathlib import Path

from homelab_ft.data import IGNORE_INDEX, DataReport, PreparedData, packing, prepare_for
from homelab_ft.data.report import desirable_line
from homelab_ft.recipe.config import DataConfig, Recipe

HISTOGRAM_BINS = 8
BAR_WIDTH = 40
GREEN, RESET = "\033[1;32m", "\033[0m"


def inspect_recipe(recipe: Recipe, *, base_dir: Path | None, color: bool) -> str:
    """Load the recipe's tokenizer (and an image run's processor), prepare its data exactly as
    training would, describe it. Image rows whose cut would fall in an image are listed, not refused."""
    tokenizer = checked_tokenizer(recipe)
    processor = None
    if recipe.data.images:
        from homelab_ft.model import loading

        tokenizer, processor = loading.load_tokenizer_and_processor(
            recipe.model, loading.resolve_model_dir(recipe.model.path), images=True)
    prepared = prepare_for(recipe, tokenizer, base_dir=base_dir, processor=processor, refuse_cut=False)
    text = describe(prepared, tokenizer, recipe.data, color=color) + "\n\n" + length_line(recipe, len(prepared.train))
    if prepared.report.desirable is not None:
        text += "\n" + desirable_line(*prepared.report.desirable, desirable_weight=recipe.dpo.desirable_weight,
                                      undesirable_weight=recipe.dpo.undesirable_weight)
    return text if recipe.method == "full" else text + "\n" + lora_line(recipe)


def lora_line(recipe: Recipe) -> str:
    """What LoRA trains, in `plan`'s words (plan/report.lora_text over the planner's shape)."""
    from homelab_ft.plan.planner import recipe_shape, request_from_recipe
    from homelab_ft.plan.report import lora_text

    shape, _ = recipe_shape(recipe)
    return f"lora: {lora_text(shape, request_from_recipe(recipe))}"


def length_line(recipe: Recipe, num_rows: int) -> str:
    """The run's length in optimizer steps over these rows, counted as `train` counts them (the
    data order's micro-batches per epoch, train.steps.total_steps): `plan` cannot, it tokenises nothing."""
    from homelab_ft.data.sampling import MicroBatchSampler
    from homelab_ft.errors import UserError
    from homelab_ft.train import steps

    cfg = recipe.train
    try:
        sampler = MicroBatchSampler(num_rows, micro_batch_size=cfg.micro_batch_size, seed=cfg.seed, rank=0,
                                    world_size=recipe.world_size, shuffle=False)
    except UserError as err:
        return f"run length: {err}"
    total = steps.total_steps(cfg, batches_per_epoch=sampler.batches_per_epoch)
    epochs = total * cfg.grad_accum_steps / sampler.batches_per_epoch
    what = f"train.num_epochs {cfg.num_epochs:g}" if cfg.num_epochs is not None else f"train.max_steps {total}"
    return (f"run length: {what} = {total} optimizer steps = {epochs:.2f} epochs of {sampler.batches_per_epoch} "
            f"micro-batches ({cfg.micro_batch_size} rows x {recipe.world_size} processes, {cfg.grad_accum_steps} per step)")


def checked_tokenizer(recipe: Recipe):
    """The tokenizer training would use, after the model-folder checks `train` makes first, so a
    folder that is only a config.json gets the same one-line message here as there (not the first
    line of the error transformers raises on a folder without a vocabulary)."""
    from homelab_ft.locate import locate
    from homelab_ft.model import files, loading

    if recipe.model.tokenizer:
        files.check_tokenizer(recipe.model.tokenizer, None)
        return loading.load_tokenizer(recipe.model, None)
    where = locate(recipe.model.path)
    model_dir = loading.resolve_model_dir(where)
    files.check_model_files(model_dir, converted=where.is_gguf)
    files.check_tokenizer(None, model_dir)
    return loading.load_tokenizer(recipe.model, model_dir)


def describe(prepared: PreparedData, tokenizer, cfg: DataConfig, *, color: bool) -> str:
    r = prepared.report
    out = _source_lines(r)
    if r.prompts:
        return "\n".join(out + _prompt_lines(prepared, tokenizer))
    share = r.num_trained_tokens / max(r.num_train_tokens, 1)
    unit = f"{r.unit}s"
    rows_are = ("completion + mismatched completion" if r.desirable is not None else "chosen + rejected")
    out += [
        "",
        f"train: {r.num_train_samples} {unit} in {r.num_train_rows} rows{f' ({rows_are}: 2 token rows each)' if r.pairs else ''}, "
        f"{r.num_train_tokens} tokens, {r.num_trained_tokens} trained ({share:.1%})",
        f"eval: {r.num_eval_samples} {unit}",
        f"max_length {r.max_length}: {r.num_truncated} truncated, {r.num_dropped_overlong} dropped as too long, "
        f"{r.num_dropped_no_target} dropped with no answer left, {r.num_bad_template} not renderable",
        "",
        "tokens per answer row:" if r.pairs else "tokens per sample:",
        *histogram(r.sample_lengths, max_length=r.max_length),
        *image_lines(r),
        "",
        *([] if r.pairs else [packing_line(r)]),
        f"tokenised data: {'from the cache' if r.cache_hit else 'tokenised now (cached for the next run)'}",
        "",
        f"first training {r.unit}; trained tokens "
        + (f"{GREEN}in green{RESET}" if color else "between [[ and ]]") + ":",
        *render_first(prepared.train[0], tokenizer, color=color),
    ]
    return "\n".join(out)


def image_lines(r: DataReport) -> list[str]:
    """An image run's images: per sample, its image tokens (what the planner prices), and the rows
    whose image tokens cross max_length, which `train` refuses under overlong: truncate."""
    if not r.image_rows and not r.num_cut_images:
        return []
    tokens = [t for _, t in r.image_rows]
    with_images = sum(1 for n, _ in r.image_rows if n)
    out = ["", f"images: {sum(n for n, _ in r.image_rows)} in {with_images} of {len(r.image_rows)} samples; "
               f"image tokens per sample {min(tokens, default=0)}-{max(tokens, default=0)} "
               f"(mean {sum(tokens) / max(len(tokens), 1):.1f}), {r.num_bad_images} rows with an unreadable image",
           "image tokens per sample:", *histogram([max(t, 1) for t in tokens], max_length=r.max_length)]
    if r.num_cut_images:
        out.append(f"would not fit: {r.num_cut_images} row(s) whose image tokens cross max_length {r.max_length} "
                   f"(train refuses them; raise data.max_length, lower data.image_max_pixels, or data.overlong=drop): "
                   + ", ".join(r.cut_image_rows))
    return out


def _source_lines(r: DataReport) -> list[str]:
    out = [f"{'source':<40} {'format':<18} {'rows':>8} {'skipped':>8} {'samples':>8}"]
    for label, sources in (("train", r.sources), ("eval", r.eval_sources)):
        for s in sources:
            out.append(f"{label + ': ' + s.name:<40} {s.format:<18} {s.num_rows_read:>8} {s.num_rows_skipped:>8} {s.num_samples:>8}")
            if s.first_error:
                out.append(f"  first skipped row: {s.first_error}")
    return out


def _prompt_lines(prepared: PreparedData, tokenizer) -> list[str]:
    """objective: grpo: the prompts (nothing is trained until completions are sampled), their lengths,
    and the first prompt as the model will read it with the columns its rewards receive."""
    from homelab_ft.data.prompts import decoded

    r = prepared.report
    first = prepared.train[0]
    _, columns = decoded(first)
    return [
        "",
        f"train: {r.num_train_samples} prompts, {r.num_train_tokens} tokens (completions are sampled in training)",
        f"eval: {r.num_eval_samples} prompts (the held-out reward: one greedy completion each)",
        f"max_length {r.max_length} per prompt: {r.num_truncated} truncated (their first tokens), "
        f"{r.num_dropped_overlong} dropped as too long",
        "",
        "tokens per prompt:",
        *histogram(r.sample_lengths, max_length=r.max_length),
        "",
        "first training prompt, as the model reads it:",
        tokenizer.decode(first["prompt_ids"]),
        "its other columns, passed to every reward function: "
        + (", ".join(f"{k}={v!r}" for k, v in columns.items()) or "none"),
    ]


def histogram(lengths, *, max_length: int) -> list[str]:
    width = -(-max_length // HISTOGRAM_BINS)
    counts = [0] * HISTOGRAM_BINS
    for n in lengths:
        counts[min((n - 1) // width, HISTOGRAM_BINS - 1)] += 1
    peak = max(counts) or 1
    return [
        f"  {b * width + 1:>6}-{min((b + 1) * width, max_length):<6} {'#' * round(BAR_WIDTH * c / peak):<{BAR_WIDTH}} {c}"
        for b, c in enumerate(counts)
    ]


def packing_line(r: DataReport) -> str:
    if r.packed:
        return f"packing: on; non-pad fraction {r.non_pad_fraction:.3f} ({r.num_train_rows} rows of {r.max_length} tokens)"
    bins = packing.pack_bins(list(r.sample_lengths), max_length=r.max_length)
    packed = packing.non_pad_fraction(list(r.sample_lengths), num_rows=len(bins), max_length=r.max_length)
    return (f"packing: off; non-pad fraction {r.non_pad_fraction:.3f} if every row were padded to max_length; "
            f"data.packing=true would give {packed:.3f} in {len(bins)} rows")


def render_first(row: dict, tokenizer, *, color: bool) -> list[str]:
    """A sample, or a preference pair's two rows (only their answers carry loss), or an unpaired row's
    (its completion, with its label, and the mismatched completion KTO's KL estimate scores)."""
    if "answer_input_ids" in row:
        sides = (("answer", f"completion (label {str(row['label']).lower()})"), ("kl", "mismatched completion (KL estimate)"))
    elif "chosen_input_ids" in row:
        sides = (("chosen", "chosen"), ("rejected", "rejected"))
    else:
        return [render_sample(row, tokenizer, color=color)]
    return [f"{name}:\n" + render_sample({"input_ids": row[f"{side}_input_ids"], "labels": row[f"{side}_labels"]},
                                          tokenizer, color=color) for side, name in sides]


def render_sample(row: dict, tokenizer, *, color: bool) -> str:
    """Decode the first sample of a row, trained runs marked; packed rows hold several samples."""
    ids, labels = row["input_ids"], row["labels"]
    if "position_ids" in row:
        positions = row["position_ids"]
        end = next((i for i in range(1, len(positions)) if positions[i] == 0), len(positions))
        ids, labels = ids[:end], labels[:end]
    parts, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (labels[i] != IGNORE_INDEX) != (labels[start] != IGNORE_INDEX):
            text = tokenizer.decode(ids[start:i])
            if labels[start] != IGNORE_INDEX:
                text = f"{GREEN}{text}{RESET}" if color else f"[[{text}]]"
            parts.append(text)
            start = i
    return "".join(parts)
