from homelab_ft.cli import main

raise SystemExit(main())
