"""The dashboard's links to a Run and its actions, with the ids percent-encoded.

An id is any printable text, so it may hold ``%``, ``?``, ``#``, ``/`` or spaces: put into a
path as it is, the server decodes ``r%31`` to ``r1`` (another Run), ``?`` and ``#`` end the
path, and ``/`` splits it. Each id is quoted with nothing safe, so the server's one decode of
the path gives it back exactly. The result is still escaped where it goes into HTML.
"""

from __future__ import annotations

from urllib.parse import quote

# A browser resolves a path segment "." or ".." (also written %2E) before it sends the
# request, so such an id cannot be a segment; the lookup by query reaches it instead.
_DOT_SEGMENTS = (".", "..")


def segment(value: str) -> str:
    """``value`` as one path segment the server decodes back to exactly ``value``."""
    return quote(value, safe="")


def run_href(run_id: str) -> str:
    """The path of the Run's page."""
    if run_id in _DOT_SEGMENTS:
        return "/runs?id=" + segment(run_id)
    return "/runs/" + segment(run_id)


__all__ = ["run_href", "segment"]
