"""The compose stack's keys (docs/security.md), made by its `keys` service in the trainguard image
before anything else starts, into one named volume per reader:

    ROOT/worker/command.key    the worker's secret (`key_id:secret`), only the worker mounts it
    ROOT/handout/trainer.env   the exports trainers need: the command public keys (Ed25519) and a
                               trainer key for SCOPE (`*`: every run; a team: `nlp-*`)
    ROOT/handout/operator.env  the operator key (`trainguard command`, `silence`, `ack`, `resolve`)
    ROOT/ui/ui.token           the run page's token, unless TRAINGUARD_UI_TOKEN chooses one
    ROOT/sinks/                the sinks' data folder (outboxes, reports), handed to the image's user

The secret and the token are made once and kept; the handouts are derived from the secret every
time (the same secret gives the same keys), so a new SCOPE takes effect on the next start.

    python keys.py init [--root /keys] [--scope '*'] [--owner 65534]
    python keys.py show trainer [SCOPE] | operator | ui   # print one handout (a login URL for ui)
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from trainguard.core.settings import value
from trainguard.schemas import signing

NOBODY = 65534  # the image's user (Dockerfile: USER nobody)
KEY_ID = "compose"


def _write_private(path: Path, text: str, owner: int) -> None:
    """``text`` in ``path``, readable by ``owner`` only; written aside and renamed, so a reader
    never sees half a key."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chown(tmp, owner, -1)
    os.chmod(tmp, 0o400)
    os.replace(tmp, path)


def _folder(path: Path, owner: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, owner, -1)
    os.chmod(path, 0o700)
    return path


def master(root: Path) -> signing.SigningKey:
    """The worker's secret, as the worker reads it (TRAINGUARD_COMMAND_KEY_FILE)."""
    keys = signing.load_keys({"TRAINGUARD_COMMAND_KEY_FILE": str(root / "worker" / "command.key")})
    found = signing.signing_key_for_worker(keys, {})
    if found is None:
        raise SystemExit(f"keys: {root / 'worker' / 'command.key'} holds no key")
    return found


def init(root: Path, scope: str, owner: int = NOBODY) -> None:
    if not scope:
        raise SystemExit("keys: the trainer key needs a scope: a run id, a team's prefix (nlp-*) or * (every run)")
    key_file = _folder(root / "worker", owner) / "command.key"
    if not key_file.exists() or not key_file.read_text().strip():
        _write_private(key_file, signing.new_key_line(KEY_ID) + "\n", owner)
        print(f"keys: made the worker's secret in {key_file}")
    secret = master(root)
    handout = _folder(root / "handout", owner)
    _write_private(handout / "trainer.env", "\n".join(signing.exports(secret, "trainer", scope)) + "\n", owner)
    _write_private(handout / "operator.env", "\n".join(signing.exports(secret, "operator")) + "\n", owner)
    token = _folder(root / "ui", owner) / "ui.token"
    if not token.exists() or not token.read_text().strip():
        _write_private(token, secrets.token_urlsafe(24), owner)
    _folder(root / "sinks", owner)
    print(f"keys: trainers (scope {scope!r}) and operators get theirs with "
          f"`docker compose run --rm --no-deps keys show trainer|operator`")


def show(root: Path, what: str, scope: str | None) -> str:
    if what == "ui":
        host = os.environ.get("KAFKA_ADVERTISED_HOST") or "localhost"
        token = value("TRAINGUARD_UI_TOKEN") or (root / "ui" / "ui.token").read_text().strip()
        return f"http://{host}:8321/?token={token}"
    if what == "trainer" and scope:  # another team's scope: derived on demand, nothing stored
        return "\n".join(signing.exports(master(root), "trainer", scope))
    return (root / "handout" / f"{what}.env").read_text().rstrip("\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keys.py", description="the compose stack's keys (docs/security.md)")
    parser.add_argument("--root", type=Path, default=Path("/keys"), help="where the volumes are mounted")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("init", help="make what is missing, derive the handouts")
    p.add_argument("--scope", default="*", help="the runs the trainers' key covers (default: every run)")
    p.add_argument("--owner", type=int, default=NOBODY,
                   help="the uid that owns the files (the group is left as it is: only the owner may read)")
    p = sub.add_parser("show", help="print one handout")
    p.add_argument("what", choices=("trainer", "operator", "ui"))
    p.add_argument("scope", nargs="?", help="trainer: a scope other than the stack's")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.action == "init":
        init(args.root, args.scope, args.owner)
    else:
        print(show(args.root, args.what, args.scope))
    return 0


if __name__ == "__main__":
    sys.exit(main())
