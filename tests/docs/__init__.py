"""The code blocks of the guides run as written."""
