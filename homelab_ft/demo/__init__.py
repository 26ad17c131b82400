"""The `make demo` tasks: the SFT task (sft.py: its data, scorer and measured run), the DPO pairs
made from it (dpo.py), GRPO's small sums and their held-out reward (grpo.py), the image task
(shapes.py: generated pictures of shapes, their questions and scorer; shapes_model.py: the tiny
SmolVLM it trains), and the runs that score, train, export and score again (run.py: `run_demo`
and `run_shapes_demo`, what `homelab-ft demo [--task shapes]` calls).

`python -m homelab_ft.demo.sft --write-dataset` and `python -m homelab_ft.demo.dpo --write-dataset`
(and `demo.grpo`) regenerate the shipped data; `python -m homelab_ft.demo.dpo --score DIR` (and
`demo.grpo`) scores a model folder; `python -m homelab_ft.demo.shapes --write-dataset DIR` writes
the image task's pictures (`--score MODEL --data JSONL` scores), `python -m
homelab_ft.demo.shapes_model DIR` its model.
Nothing is imported here, so that running sft.py or dpo.py as `__main__` finds them unimported.
"""
