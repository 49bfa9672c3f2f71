"""Packages rewritten as an attacker or a broken disk would: `rewrite` changes members and signs the result again
(the manifest's sizes and sha256s made to match, as anyone who can write a package can do), so each test reaches
the check it means to reach."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path
from typing import Callable

from opfuse.runtime.package import MANIFEST, WEIGHTS


def rewrite(path: Path, out: Path, edit: Callable[[str, bytes], bytes] = lambda name, data: data,
            add: dict[str, bytes] | None = None, sign: bool = True) -> Path:
    """A copy of package `path` with member contents changed by edit(name, bytes) -> bytes and members `add`ed;
    with `sign`, the manifest lists every member with its new size and sha256."""
    with zipfile.ZipFile(path) as source:
        members = {info.filename: edit(info.filename, source.read(info.filename)) for info in source.infolist()}
    members.update(add or {})
    if sign:
        manifest = json.loads(members[MANIFEST])
        manifest["members"] = {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                               for name, data in members.items() if name != MANIFEST}
        members[MANIFEST] = json.dumps(manifest).encode()
    with zipfile.ZipFile(out, "w") as target:
        for name, data in members.items():
            target.writestr(name, data, zipfile.ZIP_STORED if name == WEIGHTS else zipfile.ZIP_DEFLATED)
    return out


def with_manifest(path: Path, out: Path, **changes) -> Path:
    def edit(name, data):
        return json.dumps(json.loads(data) | changes).encode() if name == MANIFEST else data
    return rewrite(path, out, edit)


def edit_profile(path: Path, out: Path, change: Callable[[dict], None]) -> Path:
    """A copy of package `path` whose first profile's JSON went through change(profile) (in place), signed."""
    def edit(name, data):
        if name != "profile-0.json":
            return data
        profile = json.loads(data)
        change(profile)
        return json.dumps(profile).encode()
    return rewrite(path, out, edit)
