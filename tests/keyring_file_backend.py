"""A plaintext file keyring, for tests only (selected with PYTHON_KEYRING_BACKEND)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from keyring.backend import KeyringBackend


class FileKeyring(KeyringBackend):
    priority = 1  # type: ignore[assignment]

    def _path(self) -> Path:
        return Path(os.environ["BASTION_TEST_KEYRING"])

    def _load(self) -> dict[str, str]:
        p = self._path()
        return json.loads(p.read_text()) if p.exists() else {}

    def get_password(self, service: str, username: str) -> str | None:
        return self._load().get(f"{service}\0{username}")

    def set_password(self, service: str, username: str, password: str) -> None:
        data = self._load()
        data[f"{service}\0{username}"] = password
        self._path().write_text(json.dumps(data))

    def delete_password(self, service: str, username: str) -> None:
        data = self._load()
        data.pop(f"{service}\0{username}", None)
        self._path().write_text(json.dumps(data))
