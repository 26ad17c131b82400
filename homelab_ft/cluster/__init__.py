"""Several machines: starting the processes of a run, handing them the decision, checking the cluster.

    launch         torchrun on one machine (`run_workers`), per-node commands for several (`node_commands`), hostfiles
    handoff        `Handoff`: the rung, plan, checked model folder and resume point every worker receives
    supervise      torchrun's agent in-process: a killed rank or a missing node becomes one line
    doctor         `homelab-ft doctor` before launch (torch-free): interface, port, ssh
    doctor_rank    `homelab-ft doctor` under torchrun: facts per node, collectives timed on the real backend
    doctor_report, doctor_facts   the verdicts and table; what the nodes report (pure)
    clusterfile    the measured cluster file that `plan`/`train`/`launch` take with `--cluster`

Nothing is imported here: the torch-free modules stay torch-free when one of them is imported.
"""
