"""After the run: lm-evaluation-harness on a run (its adapters applied in memory) or a model folder.

    tasks    the tasks shipped with homelab-ft (the demos' held-out rows as lm-eval task configs) and
             the refusal of a task whose data is not on this machine
    run      `evaluate`: lm-eval's `simple_evaluate` with its `hf` model over a loaded model, the
             scores per task, written to the run's `eval/<task>.json`

`homelab-ft eval` (cli/evaluate.py) loads the model and calls `run.evaluate`; lm-eval is imported
only there (the `eval` extra: `pip install 'homelab-ft[eval]'`).
"""
