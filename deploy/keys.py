"""The compose stack's keys (docs/security.md), made by its `keys` service in the trainguard image
before anything else starts, into one named volume per reader:

    ROOT/worker/command.key    the worker's secret (`key_id:secret`), only the worker mounts it
    ROOT/handout/trainer.env   the exports trainers need: the command public keys (Ed25519) and a
                               trainer key for one run (--run ID) or a prefix (--prefix nlp-;
                               --prefix '' is every run)
    ROOT/handout/node.env      the node agents' key, for the same runs
    ROOT/node/node.env         the same, for the stack's own node agent
    ROOT/handout/operator.env  the operator key (`trainguard command`, `silence`, `ack`, `resolve`)
    ROOT/ui/ui.token           the run page's token, unless TRAINGUARD_UI_TOKEN chooses one
    ROOT/sinks/                the sinks' data folder (outboxes, reports), handed to the image's user

The secret and the token are made once and kept; the handouts are derived from the secret every
time (the same secret gives the same keys), so a new scope takes effect on the next start.

    python keys.py init [--root /keys] (--run RUN_ID | --prefix PREFIX) [--owner 65534]
    python keys.py show trainer|node [--run RUN_ID | --prefix PREFIX] | operator | ui
                                      # print one handout (a login URL for ui)
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


def init(root: Path, scope: signing.Scope, owner: int = NOBODY) -> None:
    key_file = _folder(root / "worker", owner) / "command.key"
    if not key_file.exists() or not key_file.read_text().strip():
        _write_private(key_file, signing.new_key_line(KEY_ID) + "\n", owner)
        print(f"keys: made the worker's secret in {key_file}")
    secret = master(root)
    handout = _folder(root / "handout", owner)
    for side in (signing.TRAINER, signing.NODE):
        _write_private(handout / f"{side}.env", "\n".join(signing.exports(secret, side, scope)) + "\n", owner)
    node_env = "\n".join(signing.exports(secret, signing.NODE, scope)) + "\n"
    _write_private(_folder(root / "node", owner) / "node.env", node_env, owner)
    _write_private(handout / "operator.env", "\n".join(signing.exports(secret, "operator")) + "\n", owner)
    token = _folder(root / "ui", owner) / "ui.token"
    if not token.exists() or not token.read_text().strip():
        _write_private(token, secrets.token_urlsafe(24), owner)
    _folder(root / "sinks", owner)
    print(f"keys: trainers and node agents (scope {str(scope)!r}) and operators get theirs with "
          f"`docker compose run --rm --no-deps keys show trainer|node|operator`")


def show(root: Path, what: str, scope: signing.Scope | None) -> str:
    if what == "ui":
        host = os.environ.get("KAFKA_ADVERTISED_HOST") or "localhost"
        token = value("TRAINGUARD_UI_TOKEN") or (root / "ui" / "ui.token").read_text().strip()
        return f"http://{host}:8321/?token={token}"
    if what in (signing.TRAINER, signing.NODE) and scope is not None:  # another scope: derived, nothing stored
        return "\n".join(signing.exports(master(root), what, scope))
    return (root / "handout" / f"{what}.env").read_text().rstrip("\n")


def _scope_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    scope = parser.add_mutually_exclusive_group(required=required)
    scope.add_argument("--run", metavar="RUN_ID", help="one run, by its exact id")
    scope.add_argument("--prefix", metavar="PREFIX",
                       help="every run whose id starts with PREFIX (a team's: nlp-); '' is every run")
    scope.add_argument("--scope", help=argparse.SUPPRESS)  # the untyped form of before: refused, with the way out


def _scope(args: argparse.Namespace) -> signing.Scope | None:
    if args.scope is not None:
        raise SystemExit(f"keys: --scope {args.scope!r} does not say whether it is a run id or a prefix: use --run "
                         f"RUN_ID or --prefix PREFIX (--prefix '' for every run; 'nlp-*' is now --prefix nlp-)")
    if args.run is None and args.prefix is None:
        return None
    try:
        return signing.scope_from_args(args.run, args.prefix)
    except ValueError as exc:
        raise SystemExit(f"keys: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keys.py", description="the compose stack's keys (docs/security.md)")
    parser.add_argument("--root", type=Path, default=Path("/keys"), help="where the volumes are mounted")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("init", help="make what is missing, derive the handouts")
    _scope_arguments(p, required=True)
    p.add_argument("--owner", type=int, default=NOBODY,
                   help="the uid that owns the files (the group is left as it is: only the owner may read)")
    p = sub.add_parser("show", help="print one handout")
    p.add_argument("what", choices=("trainer", "node", "operator", "ui"))
    _scope_arguments(p, required=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scope = _scope(args)
    if args.action == "init":
        assert scope is not None  # the group is required
        init(args.root, scope, args.owner)
    else:
        print(show(args.root, args.what, scope))
    return 0


if __name__ == "__main__":
    sys.exit(main())
