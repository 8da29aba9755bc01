"""The daemon process: the serving main (`daemon.py`: `Daemon`), detached start, stop and the
pid file (`lifecycle.py`), launchd and systemd units (`service_units.py`), the platform check
at start, and where serving options come from (`option_sources.py`: flag > env > config.toml)."""
