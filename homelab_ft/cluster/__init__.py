"""Several machines: starting the processes of a run, handing them the decision, checking the cluster.

    launch         torchrun on one machine (`run_workers`), per-node commands for several (`node_commands`), hostfiles
    handoff        `Handoff`: the rung, plan, checked model folder and resume point every worker receives
    supervise      torchrun's agent in-process: a killed rank or a missing node becomes one line
    doctor/        `homelab-ft doctor`: before launch (check, torch-free), under torchrun (rank, p2p),
                   the nodes' facts and the verdicts (facts, report, pure)
    clusterfile    the measured cluster file that `plan`/`train`/`launch` take with `--cluster`

Nothing is imported here: the torch-free modules stay torch-free when one of them is imported.
"""
