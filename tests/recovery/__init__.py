"""Crash, restart, lease keeping and recovery, across real processes and both backends."""
