"""Who may steer a run, and how each side proves it (``docs/security.md``).

- **Commands** (rollback, pause, stop ...) are signed with Ed25519 by the worker, and by an
  operator's ``trainguard command``. Trainers hold only public keys: they verify commands and
  cannot sign one.
- **Trainer events** (metrics, a checkpoint; started, finished, stopped, rolled_back) and **acks**
  carry an HMAC-SHA256 under the trainer's key, which is scoped to one run (``run:ppo-7b``) or to
  the runs whose id starts with a prefix (``prefix:nlp-``): a trainer host cannot speak for another
  team's runs. Only metrics under it can make the breaker act.
- **Node agents' metrics** carry an HMAC under a node key (another principal, the same scopes):
  they can join an incident, never steer alone.
- **Operator events** (silence, ack, resolve) are signed with the operator's Ed25519 key.

Everything derives from one secret, the worker's: ``TRAINGUARD_COMMAND_KEY`` (``key_id:secret``)
or ``TRAINGUARD_COMMAND_KEY_FILE`` (one such line per key, for rotation). Whoever holds it can do
all of the above, which is what local use wants (``trainguard broker``, the demo and
docker-compose make one). A cluster gives each side only its part, which
``python -m trainguard.schemas.signing`` prints from the secret: trainers get
``TRAINGUARD_COMMAND_PUBLIC_KEYS`` and ``TRAINGUARD_TRAINER_KEY``, node agents
``TRAINGUARD_NODE_KEY``, operators ``TRAINGUARD_OPERATOR_KEY``. The MACs and signatures cover a
document's canonical bytes (sorted keys, no ``signature`` field), so a changed action, target, run,
path, value or expiry breaks them.

Secure by default: a listener refuses unsigned commands, and a worker unsigned trainer and
operator events, unless ``TRAINGUARD_ALLOW_UNSIGNED=1`` (local use, no key anywhere).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from trainguard.core import settings as _settings
from trainguard.schemas import events as ev

log = logging.getLogger("trainguard.signing")

OPERATOR_SUFFIX = ".operator"  # the operator key derived from master ``local`` is ``local.operator``
TRAINER, NODE = "trainer", "node"  # the principals whose MACs the worker checks on events
UNAUTHENTICATED = "unauthenticated"  # what the worker calls metrics no key vouches for
RUN, PREFIX = "run", "prefix"      # what a key's scope names


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
        return _derived(self.secret, label)

    @cached_property
    def command_signer(self) -> Signer:
        return Signer(self.key_id, Ed25519PrivateKey.from_private_bytes(self.derive("command-signing")))

    @cached_property
    def operator_signer(self) -> Signer:
        return Signer(self.key_id + OPERATOR_SUFFIX,
                      Ed25519PrivateKey.from_private_bytes(self.derive("operator-signing")))

    def trainer_key(self, scope: "Scope | str", principal: str = TRAINER) -> "TrainerKey":
        """The key of ``principal`` (a trainer's, a node agent's) for ``scope``; a plain string is
        one run's id."""
        scope = scope if isinstance(scope, Scope) else Scope.run(scope)
        return TrainerKey(self.key_id, scope, self.derive(scope.label(principal)), principal)

    def command_id(self, stable: str) -> str:
        """A command id nobody without this key can predict, the same for the same ``stable`` id
        (a worker replaying events after a restart issues the same ids: at most once)."""
        return hmac.new(self.secret, b"trainguard/command-id:" + stable.encode(), hashlib.sha256).hexdigest()[:20]


@lru_cache(maxsize=4096)
def _derived(secret: bytes, label: str) -> bytes:
    """A key derived from a secret (cached: the worker checks a MAC on every metrics event)."""
    return hmac.new(secret, b"trainguard/" + label.encode(), hashlib.sha256).digest()


@dataclass(frozen=True)
class Scope:
    """The runs a key speaks for: one run (``run:ppo-7b``) or every run whose id starts with a
    prefix (``prefix:nlp-``; ``prefix:`` is every run). Run ids hold no ``*``, so no run id is a
    pattern.

    >>> Scope.parse("prefix:nlp-").covers("nlp-ppo-1"), Scope.parse("run:nlp-ppo").covers("nlp-ppo-1")
    (True, False)
    >>> Scope.parse("ppo-7b")  # a key from before scopes were typed: one run's, as it always was
    Scope(kind='run', value='ppo-7b')
    """
    kind: str
    value: str

    @classmethod
    def run(cls, run_id: str) -> "Scope":
        try:
            return cls(RUN, ev.check_run_id(run_id))
        except ev.SchemaError as exc:
            raise ValueError(f"a run scope names one run: {exc}") from None

    @classmethod
    def prefix(cls, prefix: str) -> "Scope":
        if prefix and not _PREFIX.fullmatch(prefix):
            raise ValueError(f"a prefix scope is the start of run ids (printable ASCII without spaces, '|' or "
                             f"'*'; empty: every run), got {prefix[:80]!r}")
        return cls(PREFIX, prefix)

    @classmethod
    def parse(cls, text: str) -> "Scope":
        """``run:ID`` or ``prefix:P``; an untyped scope from before (``ppo-7b``) is a run's, and one
        ending in ``*`` (``nlp-*``) is refused: it could have been a run id or a pattern."""
        kind, sep, value = text.partition(":")
        if sep and kind == RUN:
            return cls.run(value)
        if sep and kind == PREFIX:
            return cls.prefix(value)
        if "*" in text:
            raise ValueError(f"the scope {text[:80]!r} is untyped (made before scopes named a run or a prefix): "
                             f"issue a new key with `python -m trainguard.schemas.signing trainer --prefix "
                             f"{text.rstrip('*')[:80]}` (or --run RUN_ID)")
        return cls.run(text)

    def covers(self, run_id: str) -> bool:
        return run_id == self.value if self.kind == RUN else run_id.startswith(self.value)

    def label(self, principal: str = TRAINER) -> str:
        """What a key for this scope is derived under. A trainer's run key is derived as before
        scopes were typed (those keys keep working); every other label is new."""
        if principal == TRAINER:
            return f"trainer:{self.value}" if self.kind == RUN else f"trainer-prefix:{self.value}"
        return f"{principal}:{self.kind}:{self.value}"

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}"


_PREFIX = re.compile(r"[!-)+-{}~]{1,255}")  # the start of a run id (schemas.events.RUN_ID)


@dataclass(frozen=True)
class TrainerKey:
    """A trainer's (or a node agent's: ``principal``) HMAC key for a :class:`Scope`.
    ``TRAINGUARD_TRAINER_KEY`` and ``TRAINGUARD_NODE_KEY`` hold ``key_id|scope|secret``."""
    key_id: str
    scope: Scope
    secret: bytes
    principal: str = TRAINER

    def covers(self, run_id: str) -> bool:
        return self.scope.covers(run_id)

    def line(self) -> str:
        return f"{self.key_id}|{self.scope}|{_b64(self.secret)}"

    @cached_property
    def signature_parts(self) -> tuple[bytes, bytes]:
        """What ``signed_bytes`` writes around the MAC at the end of an event (the same every step)."""
        head, _, tail = orjson.dumps(_signature(self, "\0")).partition(b'"\\u0000"')
        return b',"signature":' + head + b'"', b'"' + tail + b"}"


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


def load_trainer_key(env: Mapping[str, str] | None = None, principal: str = TRAINER) -> TrainerKey | None:
    """``TRAINGUARD_TRAINER_KEY`` (or a node agent's ``TRAINGUARD_NODE_KEY``); ValueError naming the problem."""
    name = "TRAINGUARD_NODE_KEY" if principal == NODE else "TRAINGUARD_TRAINER_KEY"
    raw = _settings.value(name, env)
    if not raw:
        return None
    parts = raw.strip().split("|")
    if len(parts) != 3 or not parts[0] or not parts[2]:
        raise ValueError(f"{name} must be key_id|scope|secret "
                         f"(as `python -m trainguard.schemas.signing {principal} --run ID|--prefix P` prints it)")
    try:
        scope = Scope.parse(parts[1])
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return TrainerKey(parts[0], scope, _unb64(parts[2]), principal)


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
    """What signatures cover: the document as it travels (non-finite values as strings), sorted
    keys, without ``signature``."""
    body = {k: v for k, v in document.items() if k != "signature"} if "signature" in document else document
    return orjson.dumps(ev.wire_form(body), option=orjson.OPT_SORT_KEYS)


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


def _mac(key: bytes, event: dict) -> str:
    return _hex_mac(key, canonical_bytes(event))


@lru_cache(maxsize=1024)
def _keyed(key: bytes) -> tuple["hashlib._Hash", "hashlib._Hash"]:
    """HMAC-SHA256 (RFC 2104) split into its inner and outer hashes, already fed their padded
    key: a copy of each per message skips the key schedule, and two C-level hash copies cost
    about a third less than ``hmac.HMAC.copy()`` on a 2 KB event (``log()``, the worker)."""
    if len(key) > 64:  # SHA-256's block: longer keys are hashed first, as RFC 2104 says
        key = hashlib.sha256(key).digest()
    key = key.ljust(64, b"\0")
    return (hashlib.sha256(key.translate(_IPAD)), hashlib.sha256(key.translate(_OPAD)))


_IPAD = bytes(b ^ 0x36 for b in range(256))
_OPAD = bytes(b ^ 0x5C for b in range(256))


def _hex_mac(key: bytes, body: bytes) -> str:
    inner, outer = _keyed(key)
    inner = inner.copy()
    inner.update(body)
    outer = outer.copy()
    outer.update(inner.digest())
    return outer.hexdigest()


def _signature(key: TrainerKey, mac: str) -> dict:
    signature = {"key_id": key.key_id, "scope": str(key.scope), "mac": mac}
    if key.principal != TRAINER:  # a trainer's signature names no principal, as before principals
        signature["principal"] = key.principal
    return signature


def sign_trainer(event: dict, key: TrainerKey) -> dict:
    """The trainer's event or ack with its MAC (scope and key id named, so the worker can derive the key)."""
    return {**event, "signature": _signature(key, _mac(key.secret, event))}


def signed_bytes(event: dict, key: TrainerKey | None) -> bytes:
    """``event`` encoded for the wire, with its MAC when there is a key: the canonical bytes are
    encoded once and the signature appended to them (``log()`` pays one encoding and one HMAC)."""
    if key is None:
        return ev.encode(event)
    return signed_canonical(canonical_bytes(event), key)


def signed_canonical(body: bytes, key: TrainerKey) -> bytes:
    """An event's canonical bytes (``canonical_bytes``) as they go out, with the key's MAC."""
    head, tail = key.signature_parts
    return b"".join((memoryview(body)[:-1], head, _hex_mac(key.secret, body).encode(), tail))


def authenticate(event: dict, masters: Mapping[str, SigningKey]) -> tuple[str | None, str | None]:
    """``(principal, None)`` when the event carries a valid MAC of a trainer's or a node agent's
    key whose scope covers its run; ``(None, the reason)`` otherwise."""
    signature = event.get("signature")
    if not signature:
        return None, "unsigned"
    if type(signature) is not dict or not all(type(signature.get(f)) is str for f in ("key_id", "scope", "mac")):
        return None, "malformed signature"
    principal = signature.get("principal", TRAINER)
    if principal not in (TRAINER, NODE):
        return None, f"unknown principal {str(principal)[:40]!r}"
    master = masters.get(signature["key_id"])
    if master is None:
        return None, f"unknown {principal} key {signature['key_id'][:80]!r}"
    try:
        scope = Scope.parse(signature["scope"])
    except ValueError as exc:
        return None, str(exc)
    run_id = event.get("run_id", "")
    if not scope.covers(run_id):
        return None, f"signed for {signature['scope'][:80]!r}, not for run {run_id!r}"
    expected = _mac(master.trainer_key(scope, principal).secret, event)
    if not hmac.compare_digest(expected, signature["mac"]):
        return None, "bad signature (forged or altered)"
    return principal, None


def verify_trainer(event: dict, masters: Mapping[str, SigningKey]) -> str | None:
    """None when the event carries a valid MAC under a trainer key whose scope covers its run."""
    principal, problem = authenticate(event, masters)
    if problem is None and principal != TRAINER:
        return f"signed with a {principal}'s key, not a trainer's"
    return problem


def verify_own(event: dict, key: TrainerKey) -> str | None:
    """None when ``event`` carries a valid MAC under this trainer's own key (a listener checking
    the acks it reads: only its own trainer's count)."""
    signature = event.get("signature")
    if not signature:
        return "unsigned"
    if type(signature) is not dict or signature.get("key_id") != key.key_id \
            or signature.get("scope") != str(key.scope) or type(signature.get("mac")) is not str \
            or signature.get("principal", TRAINER) != key.principal:
        return "not signed with this trainer's key"
    return None if hmac.compare_digest(_mac(key.secret, event), signature["mac"]) else \
        "bad signature (forged or altered)"


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
                        "unsigned and a worker with keys refuses them (its metrics raise alerts, never a command)",
                        str(self.trainer.scope), run_id)
        if self.signer is not None:
            return self.signer.trainer_key(run_id)
        return None

    def node_key_for(self, run_id: str, env: Mapping[str, str] | None = None) -> TrainerKey | None:
        """The key a node agent signs ``run_id``'s metrics with: ``TRAINGUARD_NODE_KEY``, or one
        derived from the secret (local use); None when none covers the run (ValueError: malformed)."""
        node = load_trainer_key(env, NODE)
        if node is not None:
            return node if node.covers(run_id) else None
        if self.signer is not None:
            return self.signer.trainer_key(run_id, NODE)
        return None

    def operator_signer(self) -> Signer | None:
        return self.operator or (self.signer.operator_signer if self.signer is not None else None)


def operator_signed(document: dict, env: Mapping[str, str] | None = None) -> dict:
    """An operator's command or event signed with the operator key this process holds
    (``TRAINGUARD_OPERATOR_KEY``, or the one derived from a secret); as it is without one."""
    signer = Keyring.from_env(env).operator_signer()
    return sign(document, signer) if signer is not None else document


def exports(master: SigningKey, what: str, scope: Scope | None = None) -> list[str]:
    """Shell lines that give one side its part of ``master`` (``python -m trainguard.schemas.signing``)."""
    if what in (TRAINER, NODE):
        if not isinstance(scope, Scope):
            raise ValueError(f"a {what} key needs a scope: one run (--run RUN_ID) or the runs whose id starts "
                             f"with a prefix (--prefix nlp-; --prefix '' for every run)")
        key = master.trainer_key(scope, what).line()
        if what == NODE:
            return [f"export TRAINGUARD_NODE_KEY='{key}'"]
        publics = ",".join(f"{s.key_id}:{_b64(_raw_public(s.public))}"
                           for s in (master.command_signer, master.operator_signer))
        return [f"export TRAINGUARD_COMMAND_PUBLIC_KEYS='{publics}'",
                f"export TRAINGUARD_TRAINER_KEY='{key}'"]
    if what == "operator":
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        signer = master.operator_signer
        seed = signer.private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return [f"export TRAINGUARD_OPERATOR_KEY='{signer.key_id}:{_b64(seed)}'"]
    raise ValueError(f"what must be trainer, node or operator, not {what!r}")


def scope_from_args(run: str | None, prefix: str | None) -> Scope:
    """The scope a command line asked for: exactly one of ``--run`` and ``--prefix`` (ValueError
    saying so, or naming what is wrong with the one given)."""
    if (run is None) == (prefix is None):
        raise ValueError("say which runs the key covers: --run RUN_ID (one run) or --prefix PREFIX (every run whose "
                         "id starts with it; --prefix '' for every run)")
    return Scope.run(run) if run is not None else Scope.prefix(prefix or "")


def main(argv: list[str] | None = None) -> int:
    """``python -m trainguard.schemas.signing trainer|node --run RUN_ID|--prefix PREFIX | operator``:
    from the worker's secret (its environment), the exports one side needs and nothing more."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m trainguard.schemas.signing",
                                     description="print one side's keys, derived from the worker's secret")
    sub = parser.add_subparsers(dest="what", required=True)
    for what, whose in ((TRAINER, "a trainer host's"), (NODE, "a node agent's")):
        p = sub.add_parser(what, help=f"{whose} key (and, for a trainer, the command public keys)")
        runs = p.add_mutually_exclusive_group(required=True)
        runs.add_argument("--run", metavar="RUN_ID", help="one run, by its exact id")
        runs.add_argument("--prefix", metavar="PREFIX",
                          help="every run whose id starts with PREFIX (a team's: nlp-); '' is every run")
    sub.add_parser("operator", help="an operator's key (trainguard command, silence, ack, resolve)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        scope = scope_from_args(args.run, args.prefix) if args.what != "operator" else None
        master = signing_key_for_worker(load_keys())
    except ValueError as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return 2
    if master is None:
        print("trainguard: no secret (TRAINGUARD_COMMAND_KEY or _FILE) to derive keys from", file=sys.stderr)
        return 2
    print("\n".join(exports(master, args.what, scope)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
