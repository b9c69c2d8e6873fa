"""Processes and process groups: starting local workers (or deferring to torchrun), the
collective timeouts that name a silent rank, and stopping cleanly on SIGTERM/SIGINT."""
