from moefx.cli import main

raise SystemExit(main())
