from ballast.cli.main import main

raise SystemExit(main())
