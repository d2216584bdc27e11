"""Elastic training: the hang watchdog (watchdog, hang) and restarts on a changed world
(restart), on torchrun's elastic agent."""
