"""After the run: `homelab-ft report RUN`, one HTML page of the run's curves and scores.

    page            `write_report(run_dir)`: RUN/report/report.html and its PNGs, written atomically
    plots           the figures: loss and lr, tokens/s and memory against the plan, DPO/GRPO metrics
"""
