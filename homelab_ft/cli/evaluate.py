"""`homelab-ft eval TARGET`: lm-evaluation-harness on a run (newest checkpoint, adapters applied in
memory as `chat` does) or on a model folder / export, offline; the scores printed, a run's written
to RUN/eval/<task>.json, and with --baseline the base model scored too, before -> after."""

from __future__ import annotations

from pathlib import Path

from homelab_ft.cli.args import positive_int
from homelab_ft.errors import UserError

DEFAULT_TASKS = ("homelab_demo_json",)


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="lm-evaluation-harness on a run (adapters applied, no merge) or a model folder")
    p.add_argument("target", help="a run directory, a model folder (an export) or a model.path spec (smollm2)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help="comma-separated: shipped (homelab_demo_json, homelab_demo_sums) or lm-eval tasks whose data "
                        f"is cached (default: {','.join(DEFAULT_TASKS)})")
    p.add_argument("--limit", type=positive_int(), default=None, help="at most N examples per task")
    p.add_argument("--batch-size", type=positive_int(), default=8, help="examples per forward (default 8)")
    p.add_argument("--baseline", action="store_true",
                   help="a run only: also score its base model and print before -> after")
    p.add_argument("--out", type=Path, default=None,
                   help="write <task>.json here (default: a run's eval/ folder; a model folder's scores are only printed)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not names:
        raise UserError("--tasks names no task; e.g. --tasks homelab_demo_json")
    return score(Path(args.target), names, limit=args.limit, batch_size=args.batch_size, baseline=args.baseline,
                 out=args.out, trust_remote_code=args.trust_remote_code)


def after_training(recipe) -> None:
    """The recipe's `eval` section, scored on the finished run (what `homelab-ft eval RUN` does)."""
    if recipe.eval.tasks:
        score(recipe.run_dir, list(recipe.eval.tasks), limit=recipe.eval.limit, batch_size=8,
              baseline=recipe.eval.baseline, out=None, trust_remote_code=recipe.model.trust_remote_code)


def score(target: Path, names: list[str], *, limit: int | None, batch_size: int, baseline: bool, out: Path | None,
          trust_remote_code: bool, manager=None) -> int:
    """Score `names` on a run or a model folder, print the table, write a run's (or `out`'s) files."""
    from homelab_ft.harness import run
    from homelab_ft.store.layout import RunDir

    layout = RunDir(target)
    is_run = layout.info_file.is_file()
    if baseline and not is_run:
        raise UserError(f"--baseline scores a run's base model beside the run; {target} is not a run directory")
    manager = manager or run.check_tasks(names)
    model, tokenizer, device, base_dir = _load(target, is_run=is_run, trust_remote_code=trust_remote_code)
    kwargs = dict(manager=manager, limit=limit, batch_size=batch_size)
    scores = run.evaluate(model, tokenizer, names, device=device, **kwargs)
    before = None
    if baseline:
        del model
        base, base_tok, device, _ = _load(base_dir, is_run=False, trust_remote_code=trust_remote_code)
        before = run.evaluate(base, base_tok, names, device=device, **kwargs)
    for line in run.table(scores, before):
        print(line)
    out = out or (layout.eval_dir if is_run else None)
    if out is not None:
        about = {"target": str(target), "limit": limit, **({"baseline": before} if before else {})}
        for path in run.write(scores, out, about=about):
            print(f"wrote {path}")
    return 0


def _load(target: Path, *, is_run: bool, trust_remote_code: bool):
    """(model, tokenizer, device, the base model folder) of a run's newest checkpoint or a model folder."""
    import torch

    from homelab_ft.model import loading
    from homelab_ft.recipe.config import ModelConfig

    if is_run:
        from homelab_ft.cli.chat import open_run
        from homelab_ft.cli.generate import Decoding

        talker = open_run(target, system=None, trust_remote_code=trust_remote_code, decoding=Decoding())
        return talker.model, talker.tokenizer, talker.device, talker.model_dir
    spec = str(target)
    model_dir = loading.resolve_model_dir(spec)
    cfg = ModelConfig(path=spec, trust_remote_code=trust_remote_code)
    tokenizer = loading.load_tokenizer(cfg, model_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = loading.load_model(cfg, model_dir, dtype=loading.resolve_dtype("auto", device), device=device)
    return model, tokenizer, device, model_dir
