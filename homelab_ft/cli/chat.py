"""`homelab-ft chat RUN`: talk to a run's newest complete checkpoint before exporting it.

The base is loaded from the model folder the run recorded (run.json), then the checkpoint goes on
top the way export reads it: a LoRA/QLoRA run's adapter applied in memory with PEFT over the
full-precision base (export.merged.load_base_with_adapter), a full fine-tune's weights read from its
sharded checkpoint by DCP (export.consolidate.load_weights). Nothing is written. The reply is the
one `generate` gives on the run's export (same template, same decoding: cli/generate.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from homelab_ft.cli.args import sampling as sampling_flags
from homelab_ft.errors import UserError

if TYPE_CHECKING:
    from homelab_ft.cli.generate import Decoding, Pictures

EXIT = "/exit"
"""The line that ends an interactive chat (as EOF, Ctrl-D, does)."""


def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="talk to a run's newest checkpoint (adapters applied in memory; no export)")
    p.add_argument("run_dir", type=Path)
    sampling_flags(p, prompt_required=False)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model's own Python code when the run's recipe asks for it")
    p.set_defaults(func=cmd_chat)


@dataclass(frozen=True)
class _Talker:
    model: object
    tokenizer: object
    device: object
    pictures: Pictures | None
    """An image run's `--image` files and processor (None without any)."""
    decoding: Decoding
    """The flags' decoding, with the run's own chat template when the recipe set one and no flag did."""
    system: str | None
    model_dir: Path
    """The base model folder the run trained (run.json)."""


def cmd_chat(args) -> int:
    from homelab_ft.cli.generate import Decoding, reply, turns

    decoding = Decoding.from_args(args)
    talker = open_run(args.run_dir, system=args.system, trust_remote_code=args.trust_remote_code, decoding=decoding,
                      images=tuple(args.image))

    def answer(prompt: str, history: tuple[dict, ...] = ()) -> str:
        return reply(talker.model, talker.tokenizer, turns(prompt, system=talker.system, history=history),
                     device=talker.device, decoding=talker.decoding, pictures=talker.pictures)

    if args.prompt is not None:
        print(answer(args.prompt))
        return 0
    if sys.stdin.isatty():
        print(f"chatting with {args.run_dir}; {EXIT} or Ctrl-D ends", file=sys.stderr)
    history: tuple[dict, ...] = ()
    for line in sys.stdin:
        prompt = line.strip()
        if prompt == EXIT:
            break
        if not prompt:
            continue
        text = answer(prompt, history)
        print(text, flush=True)
        history += ({"role": "user", "content": prompt}, {"role": "assistant", "content": text})
    return 0


def open_run(run_dir: Path, *, system: str | None, trust_remote_code: bool, decoding: Decoding,
             images: tuple[Path, ...] = ()) -> _Talker:
    """The run's model with its newest intact checkpoint on top, built as the run built it (an image
    run's image-text model, `images` read as its rows were); one-line refusals otherwise, all before
    the weights load."""
    import dataclasses

    import torch

    from homelab_ft.cli.generate import check_template, read_pictures
    from homelab_ft.data.templates import resolve_template
    from homelab_ft.model import loading
    from homelab_ft.store import checkpoint
    from homelab_ft.store.layout import RunDir

    layout = RunDir(run_dir)
    info = layout.read_info()  # refuses a folder that is not a run directory
    recipe = layout.read_recipe()
    if recipe.model.trust_remote_code and not trust_remote_code:
        raise UserError(f"{layout.recipe_file} sets model.trust_remote_code=true; chat runs the model's own Python "
                        "code only when you pass --trust-remote-code (check the model folder first)")
    ckpt = checkpoint.newest_intact(run_dir)
    if ckpt is None:
        raise UserError(f"{run_dir} has no complete checkpoint to talk to; train it first (or resume it)")
    model_dir = Path(info.model_dir)
    if not (model_dir / "config.json").is_file():
        raise UserError(f"the run's base model folder {model_dir} (run.json) is gone; put the model back there")
    if images and not info.rung.images:
        raise UserError(f"--image: {run_dir} trained on text rows (data.images: false), its checkpoint is for the "
                        "text model; chat without --image, or train with data.images=true on image rows")
    pictures = read_pictures(images, model=str(run_dir), model_dir=model_dir, model_cfg=recipe.model,
                             max_pixels=recipe.data.image_max_pixels, min_pixels=recipe.data.image_min_pixels)
    tokenizer = pictures.processor.tokenizer if pictures else loading.load_tokenizer(recipe.model, model_dir)
    # The recipe's own template only when it set one: otherwise the tokenizer's, as `generate` renders.
    if recipe.data.chat_template and not (decoding.chat_template or decoding.raw):
        template = resolve_template(tokenizer, recipe.data.chat_template, base_dir=layout.recipe_file.parent)
        decoding = dataclasses.replace(decoding, chat_template=template)
    check_template(tokenizer, decoding, model=str(run_dir))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = loading.resolve_dtype("auto", device)
    if info.rung.adapters_enabled:
        from homelab_ft.export.merged import load_base_with_adapter

        model = load_base_with_adapter(ckpt, model_dir, recipe, dtype=dtype, images=info.rung.images).to(device)
    else:
        from homelab_ft.export.consolidate import load_weights

        model = loading.load_model(recipe.model, model_dir, dtype=dtype, device=device, images=info.rung.images)
        load_weights(ckpt, model)
    return _Talker(model=model, tokenizer=tokenizer, device=device, decoding=decoding, pictures=pictures,
                   system=system if system is not None else recipe.data.system_prompt, model_dir=model_dir)
