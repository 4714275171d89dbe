"""HMAC-SHA256 signatures for control commands.

The worker signs every command it issues; the trainer's listener verifies before it
applies anything. The MAC covers the command's canonical bytes (sorted keys, no
signature field), so a changed action, target, run or expiry breaks it. Keys never live
in code: ``TRAINGUARD_COMMAND_KEY`` holds ``key_id:secret`` (or just a secret, key id
``default``), or ``TRAINGUARD_COMMAND_KEY_FILE`` names a file with one such line per key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
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


def load_keys(env: dict | None = None) -> dict[str, SigningKey]:
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
