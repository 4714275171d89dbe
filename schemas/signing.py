"""Who may steer a run, and how each side proves it (``docs/security.md``).

- **Commands** (rollback, pause, stop ...) are signed with Ed25519 by the worker, and by an
  operator's ``trainguard command``. Trainers hold only public keys: they verify commands and
  cannot sign one.
- **Trainer events** that change what the breaker does (a checkpoint; started, finished, stopped,
  rolled_back) and **acks** carry an HMAC-SHA256 under the trainer's key, which is scoped to one
  run or to a team's runs (``nlp-*``): a trainer host cannot speak for another team's runs.
- **Operator events** (silence, ack, resolve) are signed with the operator's Ed25519 key.

Everything derives from one secret, the worker's: ``TRAINGUARD_COMMAND_KEY`` (``key_id:secret``)
or ``TRAINGUARD_COMMAND_KEY_FILE`` (one such line per key, for rotation). Whoever holds it can do
all of the above, which is what local use wants (``trainguard broker``, the demo and
docker-compose make one). A cluster gives each side only its part, which
``python -m trainguard.schemas.signing`` prints from the secret: trainers get
``TRAINGUARD_COMMAND_PUBLIC_KEYS`` and ``TRAINGUARD_TRAINER_KEY``, operators
``TRAINGUARD_OPERATOR_KEY``. The MACs and signatures cover a document's canonical bytes (sorted
keys, no ``signature`` field), so a changed action, target, run, path or expiry breaks them.

Secure by default: a listener refuses unsigned commands, and a worker unsigned trainer and
operator events, unless ``TRAINGUARD_ALLOW_UNSIGNED=1`` (local use, no key anywhere).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from trainguard.core import settings as _settings

log = logging.getLogger("trainguard.signing")

OPERATOR_SUFFIX = ".operator"  # the operator key derived from master ``local`` is ``local.operator``


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _raw_public(key: Ed25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


@dataclass(frozen=True)
class Signer:
    """An Ed25519 private key and the id its signatures name."""
    key_id: str
    private: Ed25519PrivateKey

    @cached_property
    def public(self) -> Ed25519PublicKey:
        return self.private.public_key()


@dataclass(frozen=True)
class SigningKey:
    """The worker's secret (``key_id:secret``); every other key is derived from it."""
    key_id: str
    secret: bytes

    def derive(self, label: str) -> bytes:
        return hmac.new(self.secret, b"trainguard/" + label.encode(), hashlib.sha256).digest()

    @cached_property
    def command_signer(self) -> Signer:
        return Signer(self.key_id, Ed25519PrivateKey.from_private_bytes(self.derive("command-signing")))

    @cached_property
    def operator_signer(self) -> Signer:
        return Signer(self.key_id + OPERATOR_SUFFIX,
                      Ed25519PrivateKey.from_private_bytes(self.derive("operator-signing")))

    def trainer_key(self, scope: str) -> "TrainerKey":
        return TrainerKey(self.key_id, scope, self.derive("trainer:" + scope))

    def command_id(self, stable: str) -> str:
        """A command id nobody without this key can predict, the same for the same ``stable`` id
        (a worker replaying events after a restart issues the same ids: at most once)."""
        return hmac.new(self.secret, b"trainguard/command-id:" + stable.encode(), hashlib.sha256).hexdigest()[:20]


@dataclass(frozen=True)
class TrainerKey:
    """A trainer's HMAC key for one run (``scope`` = the run id) or a team's (``nlp-*``: every run
    whose id starts with ``nlp-``). ``TRAINGUARD_TRAINER_KEY`` holds ``key_id|scope|secret``."""
    key_id: str
    scope: str
    secret: bytes

    def covers(self, run_id: str) -> bool:
        return scope_covers(self.scope, run_id)

    def line(self) -> str:
        return f"{self.key_id}|{self.scope}|{_b64(self.secret)}"


def scope_covers(scope: str, run_id: str) -> bool:
    return run_id.startswith(scope[:-1]) if scope.endswith("*") else run_id == scope


def _parse_key(line: str) -> SigningKey:
    line = line.strip()
    key_id, sep, secret = line.partition(":")
    if not sep:
        key_id, secret = "default", line
    if not secret:
        raise ValueError("a command key must not be empty")
    return SigningKey(key_id, secret.encode())


def load_keys(env: Mapping[str, str] | None = None) -> dict[str, SigningKey]:
    """The worker's secrets from the environment; empty when none is configured."""
    keys: dict[str, SigningKey] = {}
    path = _settings.value("TRAINGUARD_COMMAND_KEY_FILE", env)
    if path:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip() and not line.lstrip().startswith("#"):
                    k = _parse_key(line)
                    keys[k.key_id] = k
    one = _settings.value("TRAINGUARD_COMMAND_KEY", env)
    if one:
        k = _parse_key(one)
        keys[k.key_id] = k
    return keys


def load_public_keys(env: Mapping[str, str] | None = None) -> dict[str, Ed25519PublicKey]:
    """``TRAINGUARD_COMMAND_PUBLIC_KEYS``: ``key_id:base64,...``, the keys a trainer verifies
    commands with (the worker's and the operators'). ValueError naming a bad entry."""
    found: dict[str, Ed25519PublicKey] = {}
    for item in (_settings.value("TRAINGUARD_COMMAND_PUBLIC_KEYS", env) or "").split(","):
        if not item.strip():
            continue
        key_id, _, text = item.strip().rpartition(":")
        try:
            found[key_id] = Ed25519PublicKey.from_public_bytes(_unb64(text))
        except Exception:
            raise ValueError(f"TRAINGUARD_COMMAND_PUBLIC_KEYS: {item.strip()[:60]!r} is not key_id:public-key "
                             f"(as `python -m trainguard.schemas.signing` prints it)") from None
    return found


def load_trainer_key(env: Mapping[str, str] | None = None) -> TrainerKey | None:
    raw = _settings.value("TRAINGUARD_TRAINER_KEY", env)
    if not raw:
        return None
    parts = raw.strip().split("|")
    if len(parts) != 3 or not all(parts):
        raise ValueError("TRAINGUARD_TRAINER_KEY must be key_id|scope|secret "
                         "(as `python -m trainguard.schemas.signing trainer SCOPE` prints it)")
    return TrainerKey(parts[0], parts[1], _unb64(parts[2]))


def load_operator_key(env: Mapping[str, str] | None = None) -> Signer | None:
    raw = _settings.value("TRAINGUARD_OPERATOR_KEY", env)
    if not raw:
        return None
    key_id, _, text = raw.strip().rpartition(":")
    try:
        return Signer(key_id, Ed25519PrivateKey.from_private_bytes(_unb64(text)))
    except Exception:
        raise ValueError("TRAINGUARD_OPERATOR_KEY must be key_id:private-key "
                         "(as `python -m trainguard.schemas.signing operator` prints it)") from None


def unsigned_allowed(env: Mapping[str, str] | None = None) -> bool:
    """``TRAINGUARD_ALLOW_UNSIGNED=1``: the operator opted in to unsigned commands and events
    (local use). Without it a listener refuses every command it cannot verify, and a worker every
    checkpoint, lifecycle change, operator event and refusal ack it cannot verify."""
    raw = _settings.value("TRAINGUARD_ALLOW_UNSIGNED", env) or ""
    return raw.strip().lower() in ("1", "true", "yes", "on")


def signing_key_for_worker(keys: dict[str, SigningKey], env: Mapping[str, str] | None = None) -> SigningKey | None:
    """The key the worker signs with: the only one, or ``TRAINGUARD_COMMAND_KEY_ID`` among
    several; a ``ValueError`` saying so when several are configured and none is chosen."""
    chosen = _settings.value("TRAINGUARD_COMMAND_KEY_ID", env)
    if chosen:
        if chosen not in keys:
            raise ValueError(f"TRAINGUARD_COMMAND_KEY_ID={chosen!r} is none of the configured keys "
                             f"({', '.join(sorted(keys)) or 'none'})")
        return keys[chosen]
    if len(keys) > 1:
        raise ValueError(f"{len(keys)} command keys are configured ({', '.join(sorted(keys))}) and none is chosen "
                         f"to sign with: set TRAINGUARD_COMMAND_KEY_ID to one of them (the others still verify, "
                         f"so keys can be rotated)")
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


def canonical_bytes(document: dict) -> bytes:
    body = {k: v for k, v in document.items() if k != "signature"}
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


# --------------------------------------------------------------------------- Ed25519: commands, operators


def sign(document: dict, key: SigningKey | Signer) -> dict:
    """The document (a command, an operator event) with a fresh nonce and its Ed25519 signature.
    A :class:`SigningKey` signs as the worker; a :class:`Signer` as itself (an operator)."""
    signer = key.command_signer if isinstance(key, SigningKey) else key
    document = {**document, "nonce": secrets.token_hex(12)}
    sig = signer.private.sign(canonical_bytes(document))
    return {**document, "signature": {"alg": "ed25519", "key_id": signer.key_id, "nonce": document["nonce"],
                                      "mac": sig.hex()}}


def public_keys(keys: Mapping[str, SigningKey | Ed25519PublicKey], *, commands: bool = True,
                operators: bool = True) -> dict[str, Ed25519PublicKey]:
    """Key id -> public key: configured public keys as they are, and those derived from secrets
    (the worker's command key, the operator key)."""
    out: dict[str, Ed25519PublicKey] = {}
    for key_id, key in keys.items():
        if isinstance(key, SigningKey):
            if commands:
                out[key.command_signer.key_id] = key.command_signer.public
            if operators:
                out[key.operator_signer.key_id] = key.operator_signer.public
        elif commands or (operators and key_id.endswith(OPERATOR_SUFFIX)):
            out[key_id] = key
    return out


def verify(document: dict, keys: Mapping[str, SigningKey | Ed25519PublicKey] | Mapping[str, Ed25519PublicKey],
           *, operators_only: bool = False) -> str | None:
    """None when the Ed25519 signature is valid under one of ``keys``; otherwise the reason it is
    not. ``operators_only``: only operator keys count (an operator event)."""
    signature = document.get("signature")
    if not signature:
        return "unsigned command" if document.get("schema") == "command/1" else "unsigned"
    if type(signature) is not dict:
        return "malformed signature"
    known = public_keys(keys, commands=not operators_only)
    key_id = signature.get("key_id", "")
    public = known.get(key_id) if type(key_id) is str else None
    if public is None:
        return f"unknown signing key {key_id!r}"
    if signature.get("nonce") != document.get("nonce"):
        return "signature nonce does not match"
    try:
        public.verify(bytes.fromhex(str(signature.get("mac", ""))), canonical_bytes(document))
    except (InvalidSignature, ValueError):
        return "bad signature (forged or altered)"
    return None


# --------------------------------------------------------------------------- HMAC: trainer events and acks


def sign_trainer(event: dict, key: TrainerKey) -> dict:
    """The trainer's event or ack with its MAC (scope and key id named, so the worker can derive the key)."""
    mac = hmac.new(key.secret, canonical_bytes(event), hashlib.sha256).hexdigest()
    return {**event, "signature": {"key_id": key.key_id, "scope": key.scope, "mac": mac}}


def verify_trainer(event: dict, masters: Mapping[str, SigningKey]) -> str | None:
    """None when the event carries a valid MAC under a trainer key whose scope covers its run."""
    signature = event.get("signature")
    if not signature:
        return "unsigned"
    if type(signature) is not dict or not all(type(signature.get(f)) is str for f in ("key_id", "scope", "mac")):
        return "malformed signature"
    master = masters.get(signature["key_id"])
    if master is None:
        return f"unknown trainer key {signature['key_id']!r}"
    if not scope_covers(signature["scope"], event.get("run_id", "")):
        return f"signed for {signature['scope']!r}, not for run {event.get('run_id')!r}"
    expected = hmac.new(master.trainer_key(signature["scope"]).secret, canonical_bytes(event),
                        hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, signature["mac"]):
        return "bad signature (forged or altered)"
    return None


def verify_own(event: dict, key: TrainerKey) -> str | None:
    """None when ``event`` carries a valid MAC under this trainer's own key (a listener checking
    the acks it reads: only its own trainer's count)."""
    signature = event.get("signature")
    if not signature:
        return "unsigned"
    if type(signature) is not dict or signature.get("key_id") != key.key_id or signature.get("scope") != key.scope \
            or type(signature.get("mac")) is not str:
        return "not signed with this trainer's key"
    expected = hmac.new(key.secret, canonical_bytes(event), hashlib.sha256).hexdigest()
    return None if hmac.compare_digest(expected, signature["mac"]) else "bad signature (forged or altered)"


@dataclass(frozen=True)
class Keyring:
    """The keys this process holds, from the environment."""
    masters: dict[str, SigningKey]
    publics: dict[str, Ed25519PublicKey]
    trainer: TrainerKey | None
    operator: Signer | None
    signer: SigningKey | None       # the master that signs (several: TRAINGUARD_COMMAND_KEY_ID)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Keyring":
        masters = load_keys(env)
        try:
            signer = signing_key_for_worker(masters, env)
        except ValueError:
            signer = None  # only a worker must choose; the others verify with all of them
        return cls(masters, load_public_keys(env), load_trainer_key(env), load_operator_key(env), signer)

    def command_keys(self) -> dict:
        """What a listener verifies commands with."""
        return {**self.publics, **self.masters}

    def trainer_key_for(self, run_id: str) -> TrainerKey | None:
        """The key a trainer signs its events and acks for ``run_id`` with: the configured one, or
        one derived from the secret (local use); None (and a warning) when none covers the run."""
        if self.trainer is not None:
            if self.trainer.covers(run_id):
                return self.trainer
            log.warning("trainguard: TRAINGUARD_TRAINER_KEY covers %r, not run %s: its checkpoints and acks go "
                        "unsigned and a worker with keys refuses them", self.trainer.scope, run_id)
        if self.signer is not None:
            return self.signer.trainer_key(run_id)
        return None

    def operator_signer(self) -> Signer | None:
        return self.operator or (self.signer.operator_signer if self.signer is not None else None)


def operator_signed(document: dict, env: Mapping[str, str] | None = None) -> dict:
    """An operator's command or event signed with the operator key this process holds
    (``TRAINGUARD_OPERATOR_KEY``, or the one derived from a secret); as it is without one."""
    signer = Keyring.from_env(env).operator_signer()
    return sign(document, signer) if signer is not None else document


def exports(master: SigningKey, what: str, scope: str | None = None) -> list[str]:
    """Shell lines that give one side its part of ``master`` (``python -m trainguard.schemas.signing``)."""
    if what == "trainer":
        if not scope:
            raise ValueError("a trainer key needs a scope: a run id, or a prefix ending in * (nlp-*)")
        publics = ",".join(f"{s.key_id}:{_b64(_raw_public(s.public))}"
                           for s in (master.command_signer, master.operator_signer))
        return [f"export TRAINGUARD_COMMAND_PUBLIC_KEYS='{publics}'",
                f"export TRAINGUARD_TRAINER_KEY='{master.trainer_key(scope).line()}'"]
    if what == "operator":
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        signer = master.operator_signer
        seed = signer.private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return [f"export TRAINGUARD_OPERATOR_KEY='{signer.key_id}:{_b64(seed)}'"]
    raise ValueError(f"what must be trainer or operator, not {what!r}")


def main(argv: list[str] | None = None) -> int:
    """``python -m trainguard.schemas.signing trainer SCOPE | operator``: from the worker's secret
    (its environment), the exports one side needs and nothing more."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("trainer", "operator") or (argv[0] == "trainer" and len(argv) != 2):
        print("usage: python -m trainguard.schemas.signing trainer RUN_ID|PREFIX* | operator", file=sys.stderr)
        return 2
    try:
        master = signing_key_for_worker(load_keys())
    except ValueError as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return 2
    if master is None:
        print("trainguard: no secret (TRAINGUARD_COMMAND_KEY or _FILE) to derive keys from", file=sys.stderr)
        return 2
    print("\n".join(exports(master, argv[0], argv[1] if len(argv) > 1 else None)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
