"""`python -m app` is the `strata` command line (app.cli)."""

from app.cli import main

raise SystemExit(main())
