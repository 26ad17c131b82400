"""The planner: which rung (QLoRA -> LoRA -> full fine-tuning, with a sharding strategy and CPU
offload) a recipe trains with on a cluster, and why. Torch-free throughout, so `homelab-ft plan`
answers on a machine without torch or a GPU (tests/unit/test_planner.py checks that planning
imports no torch), and pure: dataclasses and arithmetic over a model's shape. The exception is the
first plan of a config: derive.py builds the model on the meta device with torch and transformers
to read its shape, once, and shape_cache.py keeps it as JSON so that every later plan of it imports
neither. The I/O is at the edges: hardware's probe, plan_for_recipe reading config.json and the
shape cache, diskspace's free-space check.

The modules, in the order a plan is made:
  inputs       the request (PlanRequest, from the recipe) and the cluster (Cluster, with its links)
  hardware     the cluster as detected on this machine, or as the recipe, flags or a cluster file say
  gpus         the GPU table (vendors' dense bf16 TFLOPS, bandwidth) and the throughput a step is priced with
  shapes       the model's shape (`model_shape`): from the cache, else derived
  shape_types  what a shape holds: parameters per block kind, nn.Linear layers, experts, saved activations;
               and its `facts` (model_facts.ModelFacts), the little of it the builder asks
  shape_cache  derived shapes as JSON per (config, attention, transformers version): plans without torch
  derive       the shape read from the model transformers builds on the meta device (imports torch)
  saved        the activation bytes a block keeps for backward, measured under saved_tensors_hooks
  params       what the parameters cost: weights (quantized or not), adapters, optimizer state
  activations  what one micro-batch costs: the activations kept for backward, the loss's logits
  network      seconds per step: compute, collectives over the links, offload copies, overlap
  memory       one option's peak bytes per device and host RAM per node (`estimate`)
  host_ram     host RAM per node: the processes, what they offload, what loading holds
  pipeline     a pipelined option: per-stage memory, p2p bytes and time, the bubble, the stage split
  ladder       every option priced and judged against the headroom, and the rule that picks one
  planner      the plan: the choice, what would fit when nothing does, the warnings
  afford       the largest micro-batch and longest sequence that fit, chosen option and next rung
  report       the plan as the table `homelab-ft plan` prints
  diskspace    one checkpoint's bytes on disk, and the warning when the disk is short

Entry points: `planner.plan_for_recipe(recipe) -> Plan`, `report.format_plan(plan) -> str` and,
for one rung, `memory.estimate(shape, rung=..., request=..., cluster=...) -> Estimate`. Nothing is
re-exported here: import each name from its module.
"""
