"""The demo command, end to end."""
