"""What a run keeps on disk, and the rules that keep it whole.

    layout        `RunDir`: every file of a run directory named once; `RunInfo`: run.json read back typed
    rundir        refuse to mix runs or change a resumed run's optimisation; create the directory once checked
    checkpoint    DCP checkpoints (trainable tensors, optimizer) + trainer state: atomic, verified, keep-last-K
    manifest      size and SHA-256 of every checkpoint file, written last
    model_state   what of a model a checkpoint holds: trainable tensors, optimizer state, the PEFT adapter
    dcp_metadata  DCP's pickled index read with an unpickler that admits only DCP's types
    runlock       one writer per run directory (and the flocks staging and checkpoint readers use)
    staging       an export written beside --out and swapped in when complete; killed exports' leftovers swept

The store knows no process group: the trainer calls it on the ranks that should write.
"""
