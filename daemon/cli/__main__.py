"""`python -m mlxcel.daemon.cli`: what the service units and the tests run."""

from mlxcel.daemon.cli import main

raise SystemExit(main())
