"""The run: the model for a rung, the one loop, and what it computes.

    trainer         `train(recipe, plan=..., rung=..., inputs=...)`: setup -> steps -> checkpoints -> cleanup
    session         `setup`: what the loop works with (data, run directory and trackers, model, optimizer, resume)
    build           `build_for`: the model for a rung by three builders (whole load; meta then fill; pipeline stage)
    preflight       every input checked before anything is created (`check_inputs`)
    steps           shared arithmetic: trained tokens, the loss normalised once over them
    loss            the chunked LM-head loss and completion log-probs (no full-vocabulary logits)
    optim, optim_backward   the optimizer and LR schedule; the optimizer step inside backward
    evaluate        held-out loss (SFT) and pair metrics (DPO)
    preference, reference_cache   DPO/IPO arithmetic; a full fine-tune's reference cached on disk
    grpo_loss       GRPO advantages and the clipped policy loss (grpo, dr_grpo, dapo, bnpo; GSPO ratios; k3 KL)
    rewards, reward_builtins   GRPO's reward functions (TRL's signature) resolved from the recipe and checked; the built-ins
    grpo, rollout   GRPO's side of a step (sample, score, advantages, metrics, held-out reward); the colocated rollout engine
    rollout_node    grpo.rollout=node: the trainer's `Remote` engine and the rollout rank's `serve` loop
    offload, stopping, metrics    activations in host RAM; SIGTERM/SIGINT; metrics.jsonl, the trackers, plot
    trackers        `output.report_to`: TensorBoard, trackio, MLflow, W&B, local by default, one run id kept across resume
    divergence      the non-finite guard: a NaN/inf step never applied, the run stopped in one line (exit 3)
    host_embedding  `train.embedding_offload`: the frozen input embedding table in host RAM, looked up there
    samples         greedy replies every `train.sample_every` steps (on every rank; rank 0 logs)
"""
