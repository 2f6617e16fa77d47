from draftfleet.cli import main

raise SystemExit(main())
