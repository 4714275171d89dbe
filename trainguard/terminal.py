"""Text read from a topic, made safe for a terminal: the one place for it.

Anyone who can write to a topic chooses the strings `tail`, `runs` and `status` print. An
escape sequence among them would be run by the terminal: clear the screen, rewrite a line,
plant an OSC 8 link, set the window title. :func:`safe` removes ESC sequences whole and shows
every other control character (C0, DEL, C1, bidirectional overrides) as ``?``; a newline or
tab becomes a space, so one event stays one line and cannot forge another.
"""

from __future__ import annotations

import re

# ESC sequences: CSI (ESC [ ... final), OSC / DCS / SOS / PM / APC strings up to BEL or ST,
# two-character ones (ESC c, ESC 7 ...), and the 8-bit CSI and string introducers (0x9b, 0x90 ...).
_ESCAPE = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
                     r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                     r"|\x1b.?", re.S)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_SPACE = re.compile("[\t\n]")
_C1_RAW = re.compile("[\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def safe(text: str) -> str:
    """``text`` without ESC sequences, other control characters as ``?``, newlines and tabs as
    spaces.

    >>> safe("loss\\x1b]8;;http://evil\\x1b\\\\click\\x1b]8;;\\x1b\\\\ \\x1b[2Jnow\\nP0 FIRING")
    'lossclick now P0 FIRING'
    >>> safe("a\\x00b\\x9b31mc\\u202ed\\x85")
    'a?bc?d?'
    """
    if text.isprintable():  # the common case: nothing to do
        return text
    return _CONTROL.sub("?", _SPACE.sub(" ", _ESCAPE.sub("", text)))


def safe_event(value):
    """``value`` (an event, or any part of one) with :func:`safe` applied to every string in it,
    keys included."""
    if isinstance(value, str):
        return safe(value)
    if isinstance(value, dict):
        return {safe(k) if isinstance(k, str) else k: safe_event(v) for k, v in value.items()}
    if isinstance(value, list):
        return [safe_event(v) for v in value]
    return value


def safe_json(text: str) -> str:
    """JSON text for a terminal, its meaning unchanged: orjson already escapes C0 characters,
    so only DEL, C1 and the bidirectional overrides are left to write as ``\\uXXXX``."""
    return _C1_RAW.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
