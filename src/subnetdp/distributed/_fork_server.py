"""Imported by the fork server alone (``launch``'s forkserver preload), first: the server
dies with the launcher that started it ([Note: workers die with their launcher])."""

from subnetdp.distributed.lifeline import tie_server

tie_server()
