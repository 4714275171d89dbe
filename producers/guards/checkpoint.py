"""A manifest beside each checkpoint, and a check before loading one that fails with an
explicit error, never a silent skip.

>>> write_manifest("/ckpt/step_500", parts={"parameters": "model.safetensors",   # doctest: +SKIP
...     "optimizer": "optimizer.pt", "rollout_cache": "rollout/"},
...     versions={"rollout_cache": "v2.1"},
...     meta={"step": 500, "scheduler_step": 500, "rng_seeds": {"torch": 1}, "dataset_offset": 64000})
>>> check_checkpoint("/ckpt/step_500", expect_versions={"rollout_cache": "v2.1"})   # doctest: +SKIP
CheckpointError: rollout cache version mismatch: expected v2.1, got v2.0

The manifest (``trainguard-manifest.json``) lists every file of every part (parameters,
optimizer state, rollout cache, others the trainer names) with its size and SHA-256, each
part's format version, the meta-state (step, scheduler step, RNG seeds, dataset offset) and
the manifest's own format version and checksum, so an edited or truncated manifest is refused
as well as a changed file. A file added later is refused too: inside a folder part always, and
anywhere in the checkpoint folder when the manifest listed all of it (``whole_folder``). Where the
trainer checked what it saved, the manifest carries the verdict (``health``: ``healthy`` and
``why``). :func:`load_verified` reads each file it loads once, checks those bytes and hands them
to the loader: what is loaded is what was verified, never a file opened again after the check.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.producers.guards._events import GuardEvents
from trainguard.producers.trainer import TrainerLogger

FORMAT = "trainguard-checkpoint/1"
MANIFEST = "trainguard-manifest.json"
REQUIRED_PARTS = ("parameters", "optimizer")
REQUIRED_META = ("step", "scheduler_step", "rng_seeds", "dataset_offset")
# How errors name the parts (any other part is named by its key).
PART_NAMES = {"parameters": "parameters", "optimizer": "optimizer state", "rollout_cache": "rollout cache",
              "scheduler": "scheduler state", "rng": "RNG state", "extra": "extra state"}
_CHUNK = 8 << 20
MAX_MANIFEST_BYTES = 64 << 20  # about 400,000 files listed; a bigger one is not read into memory
log = logging.getLogger("trainguard.guards")


class CheckpointError(RuntimeError):
    """The checkpoint must not be loaded; the message says what is wrong."""


@dataclass
class Manifest:
    path: Path
    data: dict
    loading: dict = field(default_factory=dict)  # file -> the loader load_verified reads it with
    loaded: dict = field(default_factory=dict)  # what those loaders made of the files

    @property
    def meta(self) -> dict:
        return self.data["meta"]

    @property
    def step(self) -> int:
        return self.data["meta"]["step"]

    @property
    def health(self) -> dict | None:
        """The trainer's verdict on what it saved (``{"healthy": bool, "why": str}``), None: not checked."""
        return self.data.get("health")


def step_of(name: str, prefix: str, suffix: str = "") -> int | None:
    """The step in a checkpoint's name (``checkpoint-500``, ``checkpoint-500.pt``), None when it
    is not one: ASCII digits only (``str.isdigit`` takes "²", which ``int`` refuses)."""
    digits = name[len(prefix):len(name) - len(suffix)] if name.startswith(prefix) and name.endswith(suffix) else ""
    return int(digits) if digits.isascii() and digits.isdigit() else None


def checkpoint_folders(root, prefix: str = "checkpoint-") -> list[tuple[int, Path]]:
    """The ``{prefix}{step}`` folders in ``root`` with their steps, newest first (none when ``root``
    is not a folder)."""
    root = Path(root)
    found = [(step, p) for p in (root.iterdir() if root.is_dir() else ())
             if p.is_dir() and (step := step_of(p.name, prefix)) is not None]
    return sorted(found, reverse=True)


def _part(name: str) -> str:
    return PART_NAMES.get(name, name)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path, rel: str | list[str]) -> list[str]:
    """Every file of a part: a file, a folder (all files under it), or a list of either."""
    if isinstance(rel, list):
        return [f for one in rel for f in _files(root, one)]
    target = root / rel
    if target.is_dir():
        return sorted(str(p.relative_to(root)) for p in target.rglob("*") if p.is_file())
    return [rel]


def _folder_files(root: Path) -> set[str]:
    """Every file under the checkpoint folder, but the manifest (and a manifest being written)."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.startswith(MANIFEST)}


def _checksum(data: dict) -> str:
    body = {k: v for k, v in data.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(checkpoint_dir, *, parts: Mapping[str, str | list[str]], meta: dict,
                   versions: dict[str, str] | None = None, events: TrainerLogger | None = None,
                   require: tuple[str, ...] = REQUIRED_PARTS, health: dict | None = None) -> Path:
    """Write the manifest of the checkpoint in ``checkpoint_dir`` (after its files are written).

    ``parts``: part name -> a file or folder relative to the checkpoint folder (or a list of
    them: a model's shards, every rank's RNG state). ``meta``: the
    meta-state, with at least ``step``, ``scheduler_step``, ``rng_seeds``, ``dataset_offset``.
    ``versions``: part name -> the format version of that part (checked on load). ``require``:
    the parts a checkpoint must have (a weights-only save has no optimizer state). ``health``:
    the trainer's verdict on what it saved (``{"healthy": bool, "why": str}``, :func:`verdict`)."""
    root = Path(checkpoint_dir)
    missing_meta = [k for k in REQUIRED_META if k not in meta]
    if missing_meta:
        raise CheckpointError(f"meta-state incomplete: {', '.join(missing_meta)} missing")
    if not _is_step(meta["step"]):
        raise CheckpointError(f"meta-state step is {meta['step']!r}, not a non-negative integer")
    for name in require:
        if name not in parts:
            raise CheckpointError(f"{_part(name)} missing: no {name!r} in parts")
    listed: dict[str, dict] = {}
    for name, rel in parts.items():
        for one in (rel if isinstance(rel, list) else [rel]):
            if not (root / one).exists():
                raise CheckpointError(f"{_part(name)} missing: {one} is not in {root}")
        outside = [f for f in [*(rel if isinstance(rel, list) else [rel]), *_files(root, rel)] if _outside(root, f)]
        if outside:
            raise CheckpointError(f"{_part(name)} names {outside[0]}, outside {root}")
        files = {f: {"bytes": (root / f).stat().st_size, "sha256": _sha256(root / f)} for f in _files(root, rel)}
        if not files:
            raise CheckpointError(f"{_part(name)} missing: {rel} in {root} holds no files")
        listed[name] = {"path": rel, "version": (versions or {}).get(name), "files": files}
    data = {"format": FORMAT, "written": time.time(), "meta": json.loads(json.dumps(meta)), "parts": listed}
    # every file in the folder is listed: a file added later is refused wherever it is
    data["whole_folder"] = _folder_files(root) <= {f for part in listed.values() for f in part["files"]}
    if health is not None:
        data["health"] = {"healthy": bool(health["healthy"]), "why": str(health.get("why", ""))}
    data["checksum"] = _checksum(data)
    path = root / MANIFEST
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)  # a crash mid-write leaves the old manifest or none, never half of one
    # a checkpoint written whole ends the alert of one refused before (refused 0)
    GuardEvents(events, "checkpoint").report({"guard/checkpoint/manifest_bytes": float(path.stat().st_size),
                                              "guard/checkpoint/refused": 0.0},
                                             step=meta["step"],
                                             decision="written", reason=str(root))
    return path


def check_checkpoint(checkpoint_dir, *, expect_versions: dict[str, str] | None = None,
                     require: tuple[str, ...] = REQUIRED_PARTS, hashes: bool = True,
                     events: TrainerLogger | None = None, step: int | None = None,
                     loaders: "Callable[[Manifest], Mapping[str, Callable[[bytes], Any]]] | None" = None) -> Manifest:
    """The checkpoint's manifest if every part is present, whole and of the expected version;
    else :class:`CheckpointError`. ``require``: parts that must be there (add
    ``"rollout_cache"`` when the run resumes from one). ``hashes=False`` compares sizes only
    (hashing reads every byte: about a second per GB). ``step``: the step the trainer is at,
    for the event (a refusal at start-up: None). ``loaders``: see :func:`load_verified`."""
    root = Path(checkpoint_dir)
    report = GuardEvents(events, "checkpoint")
    try:
        manifest = _check(root, expect_versions or {}, require, hashes, loading=loaders)
        if loaders is not None:
            manifest.loaded = {rel: load(_read_verified(root, manifest, rel))
                               for rel, load in manifest.loading.items()}
    except CheckpointError as exc:
        report.report({"guard/checkpoint/refused": 1.0}, step=step, decision="refused", reason=str(exc))
        raise
    report.report({"guard/checkpoint/refused": 0.0}, step=step, decision="verified", reason=str(root))
    return manifest


def load_verified(checkpoint_dir, loaders: "Callable[[Manifest], Mapping[str, Callable[[bytes], Any]]]",
                  **check) -> tuple[Manifest, dict]:
    """The checkpoint's manifest once it checks out, and what each loader made of its file.
    ``loaders(manifest)`` names them (a file of the checkpoint, relative to its folder -> a
    function of the file's bytes), from the manifest as checked: each
    file is read once, its bytes checked against the manifest's size and SHA-256, then handed to
    its loader, so nothing can change between the check and the load. Every file is checked
    before any loader's result is returned: a refused checkpoint changes nothing.
    :class:`CheckpointError` says why. ``check``: :func:`check_checkpoint`'s other arguments."""
    manifest = check_checkpoint(checkpoint_dir, loaders=loaders, **check)
    return manifest, manifest.loaded


def newest_verified(folders, *, events: TrainerLogger | None = None, **check) -> tuple[Path, Manifest]:
    """The first of ``folders`` (give them newest first) whose manifest checks out, with it; each
    refused one is logged with its error. None passes: :class:`CheckpointError` saying why each was
    refused. ``check``: :func:`check_checkpoint`'s other arguments."""
    refused = []
    for folder in folders:
        try:
            return Path(folder), check_checkpoint(folder, events=events, **check)
        except CheckpointError as exc:
            log.warning("trainguard: checkpoint %s refused: %s", folder, exc)
            refused.append(f"{folder}: {exc}")
    if not refused:
        raise CheckpointError("no checkpoint to verify")
    raise CheckpointError("no checkpoint passes its manifest check: " + "; ".join(refused))


def _read_verified(root: Path, manifest: "Manifest", rel: str) -> bytes:
    """The bytes of ``rel`` as read once, after checking them against the manifest."""
    for name, part in manifest.data["parts"].items():
        info = part["files"].get(rel)
        if info is None:
            continue
        with open(root / rel, "rb") as f:
            data = f.read(info["bytes"] + 1)
        if len(data) != info["bytes"]:
            raise CheckpointError(f"{_part(name)} corrupted: {rel} has {len(data)} bytes as read, "
                                  f"the manifest says {info['bytes']}")
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise CheckpointError(f"{_part(name)} corrupted: {rel} does not match its SHA-256 in the manifest")
        return data
    raise CheckpointError(f"{rel} is not listed in the manifest of {root}: not loaded")


def _check(root: Path, expect_versions: dict[str, str], require: tuple[str, ...], hashes: bool,
           loading=None) -> Manifest:
    path = root / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"checkpoint manifest missing: {path}")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"checkpoint manifest corrupted: {path} is {size} bytes, more than {MAX_MANIFEST_BYTES}")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint manifest corrupted: {path} is not JSON ({exc})") from None
    except RecursionError:
        raise CheckpointError(f"checkpoint manifest corrupted: {path} is nested too deeply") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint manifest corrupted: {path} is not a JSON object")
    if data.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint manifest format mismatch: expected {FORMAT}, got {data.get('format')}")
    if data.get("checksum") != _checksum(data):
        raise CheckpointError(f"checkpoint manifest corrupted: {path} does not match its checksum")
    meta, parts = data.get("meta"), data.get("parts")
    if not isinstance(meta, dict) or not isinstance(parts, dict):
        raise CheckpointError(f"checkpoint manifest corrupted: {path} lacks meta or parts")
    missing_meta = [k for k in REQUIRED_META if k not in meta]
    if missing_meta:
        raise CheckpointError(f"meta-state incomplete: {', '.join(missing_meta)} missing")
    problem = _malformed(root, data, meta, parts)
    if problem:
        raise CheckpointError(f"checkpoint manifest corrupted: {path}: {problem}")
    for name in require:
        if name not in parts:
            raise CheckpointError(f"{_part(name)} missing: the manifest lists no {name!r}")
    for name, want in expect_versions.items():
        if name not in parts:
            raise CheckpointError(f"{_part(name)} missing: the manifest lists no {name!r}")
        got = parts[name].get("version")
        if got != want:
            raise CheckpointError(f"{_part(name)} version mismatch: expected {want}, got {got}")
    _refuse_unlisted(root, data)
    for name, part in parts.items():
        for rel, info in part["files"].items():
            f = root / rel
            if not f.is_file():
                raise CheckpointError(f"{_part(name)} missing: {rel} is not in {root}")
            size = f.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(f"{_part(name)} corrupted: {rel} has {size} bytes, "
                                      f"the manifest says {info['bytes']}")
    # the files a loader reads are hashed as they are read (_read_verified), not twice
    manifest = Manifest(path, data)
    manifest.loading = dict(loading(manifest)) if loading is not None else {}
    for name, part in parts.items():
        for rel, info in part["files"].items():
            if hashes and rel not in manifest.loading and _sha256(root / rel) != info["sha256"]:
                raise CheckpointError(f"{_part(name)} corrupted: {rel} does not match its SHA-256 in the manifest")
    return manifest


def _refuse_unlisted(root: Path, data: dict) -> None:
    """A file the manifest does not list, in a folder part (or anywhere, when the manifest listed
    the whole folder), was added after it was written: the loader could read it unchecked."""
    listed = {f for part in data["parts"].values() for f in part["files"]}
    if data.get("whole_folder") is True:
        extra = sorted(_folder_files(root) - listed)
        where = str(root)
    else:
        folders = [r for part in data["parts"].values() for r in (part["path"] if isinstance(part["path"], list)
                                                                   else [part["path"]]) if (root / r).is_dir()]
        extra = sorted({str(p.relative_to(root)) for r in folders for p in (root / r).rglob("*") if p.is_file()}
                       - listed)
        where = f"a folder part of {root}"
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"checkpoint has a file its manifest does not list: {extra[0]}{more} in {where}, "
                              f"added after the manifest was written; remove it, or write the manifest again if "
                              f"it belongs to the checkpoint")


def _malformed(root: Path, data: dict, meta: dict, parts: dict) -> str | None:
    """What in a manifest is not of the shape :func:`write_manifest` writes (None: nothing). A
    matching checksum proves a manifest whole, not written by trainguard."""
    if not _is_step(meta["step"]):
        return f"its step is {meta['step']!r}, not a non-negative integer"
    health = data.get("health")
    if health is not None and not (isinstance(health, dict) and isinstance(health.get("healthy"), bool)
                                   and isinstance(health.get("why"), str)):
        return "its health is not {healthy: bool, why: str}"
    for name, part in parts.items():
        if not isinstance(part, dict):
            return f"part {name!r} is not an object"
        rel, files, version = part.get("path"), part.get("files"), part.get("version")
        if not (isinstance(rel, str) or isinstance(rel, list) and rel and all(isinstance(r, str) for r in rel)):
            return f"part {name!r} has no path"
        if version is not None and not isinstance(version, str):
            return f"part {name!r} has version {version!r}, not a string"
        if not isinstance(files, dict) or not files:
            return f"part {name!r} lists no files"
        for f, info in files.items():
            if not (isinstance(info, dict) and _is_step(info.get("bytes")) and isinstance(info.get("sha256"), str)):
                return f"file {f!r} of part {name!r} has no size and SHA-256"
        for f in [*(rel if isinstance(rel, list) else [rel]), *files]:
            if _outside(root, f):
                return f"part {name!r} names {f}, outside {root}"
    return None


def _outside(root: Path, rel: str) -> bool:
    """Whether ``rel`` leads out of the checkpoint folder (``..``, an absolute path, a symlink):
    the loader must read only what the folder holds."""
    return Path(rel).is_absolute() or ".." in Path(rel).parts \
        or not (root / rel).resolve().is_relative_to(root.resolve())


def _is_step(value) -> bool:
    return type(value) is int and value >= 0
