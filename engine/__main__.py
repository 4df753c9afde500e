"""`python -m engine` is the `strata` command line."""

from engine.cli import main

raise SystemExit(main())
