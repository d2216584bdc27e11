"""Launchers, the emulated multi-node cluster, Slurm scripts and layout sweeps."""
