from homelab_ft.cli.main import main

raise SystemExit(main())
