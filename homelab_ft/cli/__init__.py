"""The `homelab-ft` commands. Thin: parse, call one function below, print, exit code.

    main       the parser, the entry point (`homelab_ft.cli.main:main`), UserError -> one line, exit 2
    args       arguments several subcommands share (overrides, --cluster, -q/-v)
    plan       `plan`, `recipes`, `data inspect`          train    `train`, `demo`; `planned`: plan once
    cluster    `launch`, `doctor`                         export   `export`, `generate`
    generate, data_inspect   what those two commands print
    chat       `chat RUN`: talk to a run's newest checkpoint, no export (shares generate's reply)
    evaluate   `eval RUN|MODEL`: lm-evaluation-harness on a run (adapters in memory) or a model folder
    report     `report RUN`: RUN/report/report.html, the run's curves, memory against the plan, eval scores

Only this package prints. Each command module imports what it calls inside the command, so
`homelab-ft plan` never imports torch.
"""
