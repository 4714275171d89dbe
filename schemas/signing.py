"""HMAC-SHA256 signatures for control commands.

The worker signs every command it issues; the trainer's listener verifies before it
applies anything. The MAC covers the command's canonical bytes (sorted keys, no
signature field), so a changed action, target, run or expiry breaks it. Keys never live
in code: ``TRAINGUARD_COMMAND_KEY`` holds ``key_id:secret`` (or just a secret, key id
``default``), or ``TRAINGUARD_COMMAND_KEY_FILE`` names a file with one such line per key.

Secure by default: a listener refuses unsigned commands unless the operator opted in with
``TRAINGUARD_ALLOW_UNSIGNED=1`` (local use); ``trainguard broker`` and ``trainguard demo`` set a
key up themselves.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import orjson


@dataclass(frozen=True)
class SigningKey:
    key_id: str
    secret: bytes


def _parse_key(line: str) -> SigningKey:
    line = line.strip()
    key_id, sep, secret = line.partition(":")
    if not sep:
        key_id, secret = "default", line
    if not secret:
        raise ValueError("a command key must not be empty")
    return SigningKey(key_id, secret.encode())


def load_keys(env: Mapping[str, str] | None = None) -> dict[str, SigningKey]:
    """Keys from the environment; empty when none is configured (commands go unsigned)."""
    env = os.environ if env is None else env
    keys: dict[str, SigningKey] = {}
    path = env.get("TRAINGUARD_COMMAND_KEY_FILE")
    if path:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip() and not line.lstrip().startswith("#"):
                    k = _parse_key(line)
                    keys[k.key_id] = k
    if env.get("TRAINGUARD_COMMAND_KEY"):
        k = _parse_key(env["TRAINGUARD_COMMAND_KEY"])
        keys[k.key_id] = k
    return keys


def unsigned_allowed(env: Mapping[str, str] | None = None) -> bool:
    """``TRAINGUARD_ALLOW_UNSIGNED=1``: the operator opted in to unsigned commands (local use).
    Without it a listener refuses every command that is not signed with a key it holds."""
    env = os.environ if env is None else env
    return env.get("TRAINGUARD_ALLOW_UNSIGNED", "").strip().lower() in ("1", "true", "yes", "on")


def signing_key_for_worker(keys: dict[str, SigningKey], env: Mapping[str, str] | None = None) -> SigningKey | None:
    """The key the worker signs with: the only one, or ``TRAINGUARD_COMMAND_KEY_ID`` among
    several; a ``ValueError`` saying so when several are configured and none is chosen."""
    env = os.environ if env is None else env
    chosen = env.get("TRAINGUARD_COMMAND_KEY_ID")
    if chosen:
        if chosen not in keys:
            raise ValueError(f"TRAINGUARD_COMMAND_KEY_ID={chosen!r} is none of the configured keys "
                             f"({', '.join(sorted(keys)) or 'none'})")
        return keys[chosen]
    if len(keys) > 1:
        raise ValueError(f"{len(keys)} command keys are configured ({', '.join(sorted(keys))}) and none is chosen "
                         f"to sign with: set TRAINGUARD_COMMAND_KEY_ID to one of them (listeners keep all of "
                         f"them to verify, so keys can be rotated)")
    return next(iter(keys.values()), None)


def ensure_key(key_id: str) -> None:
    """For a program that starts its own worker and listeners (the demo, an example, the bench):
    without a configured key, one for this process and its children, so commands are signed
    as in production."""
    if not load_keys():
        os.environ["TRAINGUARD_COMMAND_KEY"] = new_key_line(key_id)


def new_key_line(key_id: str = "local") -> str:
    """A fresh ``key_id:secret`` line (``trainguard broker`` and the demo make one)."""
    return f"{key_id}:{secrets.token_urlsafe(32)}"


def canonical_bytes(command: dict) -> bytes:
    body = {k: v for k, v in command.items() if k != "signature"}
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


def sign(command: dict, key: SigningKey) -> dict:
    """Return the command with a fresh nonce and its signature."""
    command = {**command, "nonce": secrets.token_hex(12)}
    mac = hmac.new(key.secret, canonical_bytes(command), hashlib.sha256).hexdigest()
    return {**command, "signature": {"key_id": key.key_id, "nonce": command["nonce"], "mac": mac}}


def verify(command: dict, keys: dict[str, SigningKey]) -> str | None:
    """None when the signature is valid; otherwise the reason it is not."""
    signature = command.get("signature")
    if not signature:
        return "unsigned command"
    key = keys.get(signature.get("key_id", ""))
    if key is None:
        return f"unknown signing key {signature.get('key_id')!r}"
    if signature.get("nonce") != command.get("nonce"):
        return "signature nonce does not match the command"
    expected = hmac.new(key.secret, canonical_bytes(command), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, str(signature.get("mac", ""))):
        return "bad signature (forged or altered command)"
    return None
