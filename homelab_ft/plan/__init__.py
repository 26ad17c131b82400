"""The planner: which rung (QLoRA -> LoRA -> full fine-tuning, with a sharding strategy and CPU
offload) a recipe trains with on a cluster, and why. Torch-free throughout, so `homelab-ft plan`
answers on a machine without torch or a GPU (tests/unit/plan/test_planner.py checks that planning
imports no torch), and pure: dataclasses and arithmetic over a model's shape. The exception is the
first plan of a config: shape/derive.py builds the model on the meta device with torch and transformers
to read its shape, once, and shape/cache.py keeps it as JSON so that every later plan of it imports
neither. The I/O is at the edges: hardware's probe, plan_for_recipe reading config.json and the
shape cache, diskspace's free-space check.

The modules, in the order a plan is made:
  inputs       the request (PlanRequest: the recipe's own sections) and the cluster (Cluster, with its links)
  hardware     the cluster as detected on this machine, or as the recipe, flags or a cluster file say
  gpus         the GPU table (vendors' dense bf16 TFLOPS, bandwidth) and the throughput a step is priced with
  shape/       what the model is: `shapes.model_shape` from the cache (`cache`) or derived from the meta
               model (`derive`, `saved`, an image-text model's vision side per image: `vision`); `types`
               holds it, and its `facts` (model_facts.ModelFacts)
  price/       what one option costs: `params`, `activations`, `memory` (`estimate`), `host_ram`,
               `network` (seconds per step), `images` (an image-text model's vision tower), `rollout`
               (GRPO's generation), `pipeline` (per-stage memory, p2p, bubble), `diskspace`
  ladder       every option priced and judged against the headroom, what the trainer refuses left out
               with its reason (rules/refusals.py), and the rule that picks one
  planner      the plan: the choice, what would fit when nothing does, the warnings
  afford       the largest micro-batch and longest sequence that fit, chosen option and next rung
  report       the plan as the table `homelab-ft plan` prints

Entry points: `planner.plan_for_recipe(recipe) -> Plan`, `report.format_plan(plan) -> str` and,
for one rung, `price.memory.estimate(shape, rung=..., request=..., cluster=...) -> Estimate`. Nothing is
re-exported here: import each name from its module.
"""
