"""`homelab-ft doctor`: check a cluster through the launcher a run uses, and measure its links.

    check    before launch, torch-free: interface, rendezvous port, ssh; then the same torchrun commands
    rank     under torchrun on every rank: facts per node, collectives timed on the real backend
    p2p      a pipelined recipe's point-to-point bandwidth between neighbouring stages
    facts    what the nodes report (pure)
    report   the verdicts and the table, pure functions over the facts

Nothing is imported here: check.py stays torch-free when the CLI imports it.
"""
