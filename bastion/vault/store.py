"""The encrypted key store: the only place private keys exist at rest.

The file's format and its locked, atomic writes are `file_format.py`; this is the vault in
memory, the handle the gateway and the CLI hold: unlocked, it keeps the derived key. The
persisted `epoch` rises on every unlock and lock and never goes back: approvals are bound
to it, so any change of vault state voids them. Besides SSH keys the vault seals small
secrets (an OpenBao token) and keeps the last certificate serial it handed out, so serials
never repeat across restarts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import replace
from pathlib import Path

import asyncssh
from cryptography.exceptions import InvalidTag

from bastion.vault.file_format import (
    GENERATE,
    IMPORTABLE,
    KDF_FIELDS,
    KDF_PROFILES,
    RESERVED_PREFIX,
    Kdf,
    KeyFilePassphraseNeeded,
    KeyInfo,
    Record,
    Secret,
    VaultError,
    VaultFile,
    VaultLocked,
    WrongPassphrase,
    check_key_type,
    check_label,
    load_private_key_file,
    now_stamp,
    wipe,
    write_lock,
)

log = logging.getLogger(__name__)

__all__ = [
    "GENERATE",
    "IMPORTABLE",
    "KDF_FIELDS",
    "KDF_PROFILES",
    "RESERVED_PREFIX",
    "KeyFilePassphraseNeeded",
    "KeyInfo",
    "Vault",
    "VaultError",
    "VaultLocked",
    "WrongPassphrase",
    "load_private_key_file",
]


class Vault:
    """A handle on the vault file; unlocked means it holds the derived key in memory."""

    def __init__(self, path: Path, epoch: int) -> None:
        self.path = path
        self._epoch = epoch
        self._key: bytearray | None = None
        self._cache: dict[tuple[str, str], asyncssh.SSHKey] = {}
        self._mutex = threading.RLock()  # the daemon may call us from worker threads

    def __repr__(self) -> str:
        return f"Vault(path={str(self.path)!r}, locked={self.locked}, epoch={self._epoch})"

    @classmethod
    def create(cls, path: Path, passphrase: bytes) -> Vault:
        path = Path(path)
        if not passphrase:
            raise VaultError("the vault passphrase must not be empty")
        kdf = Kdf.default()
        key = kdf.derive(passphrase)
        with write_lock(path):
            if path.exists():
                raise VaultError(f"a vault already exists at {path}; refusing to overwrite it")
            VaultFile.new(kdf, key).write(path)
        vault = cls(path, 1)
        vault._key = key
        return vault

    @classmethod
    def open(cls, path: Path) -> Vault:
        path = Path(path)
        return cls(path, VaultFile.read(path).epoch)

    def cached_keys(self) -> int:
        return len(self._cache)

    @property
    def locked(self) -> bool:
        return self._key is None

    @property
    def epoch(self) -> int:
        return self._epoch

    def _load(self) -> VaultFile:
        doc = VaultFile.read(self.path)
        with self._mutex:  # never step back, even if the file was rolled back
            self._epoch = max(self._epoch, doc.epoch)
        return doc

    def _bump(self, doc: VaultFile) -> int:
        """Write epoch+1 (above anything this handle saw) and adopt it."""
        new = max(doc.epoch, self._epoch) + 1
        replace(doc, epoch=new).write(self.path)
        self._epoch = new
        return new

    def _wipe(self) -> None:
        wipe(self._key)
        self._key = None
        self._cache.clear()

    def _unlocked_key(self, doc: VaultFile | None = None) -> bytearray:
        if self._key is None:
            raise VaultLocked(f"the vault {self.path} is locked; run `bastion unlock` first")
        if doc is not None and not doc.matches(self._key):
            raise VaultError(
                f"the vault {self.path} was re-created or re-keyed by another "
                "process; unlock it again"
            )
        return self._key

    def unlock(self, passphrase: bytes) -> int:
        """Verify the passphrase, bump the epoch once and, in that same write, upgrade a KDF
        weaker than the profile's. Derivations run outside the mutex and the flock."""
        for _ in range(3):  # again if another process re-keys the vault meanwhile
            doc, target, new_key = self._load(), Kdf.default(), None
            key = doc.kdf.derive(passphrase)
            try:
                if not doc.matches(key):
                    raise WrongPassphrase(f"wrong passphrase for the vault {self.path}")
                if doc.kdf.weaker_than(target):
                    with contextlib.suppress(VaultError):  # e.g. no memory: upgrade later
                        new_key = target.derive(passphrase)
                with self._mutex, write_lock(self.path):
                    if (cur := self._load()).kdf != doc.kdf or not cur.matches(key):
                        continue
                    if new_key and (rekeyed := cur.rekeyed(key, target, new_key)):
                        cur, key, new_key = rekeyed, new_key, key
                    new = self._bump(cur)  # the one write: new epoch (and KDF, if upgraded)
                    self._wipe()
                    self._key, key = key, None
                    return new
            finally:
                wipe(key, new_key)
        raise VaultError(f"the vault {self.path} kept changing during unlock; try again")

    def lock(self) -> int:
        """Always locks in memory; a failure to persist the epoch is logged, not raised,
        because a caller's follow-up (withdrawing cards, ending sessions) must still run.
        The derived key is zeroed in place and decrypted keys dropped: the handle keeps no
        secret. Python cannot wipe the immutable copies made on the way (KDF output, decrypted
        records, key objects, keys a caller holds): freed unwiped, they may linger in memory."""
        with self._mutex:
            if self._key is None:
                return self._epoch
            self._wipe()
            try:
                with write_lock(self.path):
                    return self._bump(self._load())
            except VaultError as e:
                self._epoch += 1
                log.warning("vault locked, but its epoch could not be saved: %s", e)
                return self._epoch

    def list_keys(self) -> list[KeyInfo]:
        """Every key's public metadata (named so no linter mistakes a vault for a dict)."""
        return [rec.info for rec in self._load().records]

    def key_info(self, label: str) -> KeyInfo:
        return self._record(self._load(), label).info

    def _record(self, doc: VaultFile, label: str) -> Record:
        check_label(label)
        rec = doc.find(label)
        if rec is None:
            raise VaultError(f"no key labelled {label!r} in the vault {self.path}")
        return rec

    def generate(self, label: str, algorithm: str = "ssh-ed25519") -> KeyInfo:
        check_label(label)
        if algorithm not in GENERATE:
            raise VaultError(
                f"cannot generate {algorithm!r} keys; choose one of " + ", ".join(GENERATE)
            )
        self._unlocked_key()
        if self._load().find(label) is not None:  # fail before a slow RSA generation
            raise VaultError(f"a key labelled {label!r} already exists in the vault {self.path}")
        return self._store(label, asyncssh.generate_private_key(algorithm, **GENERATE[algorithm]))

    def add(self, label: str, private_key: asyncssh.SSHKey) -> KeyInfo:
        check_label(label)
        check_key_type(private_key)
        return self._store(label, private_key)

    def _store(self, label: str, private_key: asyncssh.SSHKey) -> KeyInfo:
        key = asyncssh.import_private_key(private_key.export_private_key("openssh"))  # a copy
        key.set_comment(f"bastion:{label}")
        public = key.export_public_key("openssh").decode().strip()
        info = KeyInfo.of(label, public, now_stamp())
        with self._mutex, write_lock(self.path):
            doc = self._load()
            vault_key = self._unlocked_key(doc)
            if doc.find(label) is not None:
                raise VaultError(
                    f"a key labelled {label!r} already exists in the vault {self.path}"
                )
            rec = Record.seal(info, vault_key, key.export_private_key("openssh"))
            replace(doc, records=(*doc.records, rec)).write(self.path)
        return info

    def remove(self, label: str) -> None:
        """Needs the vault unlocked: destroying a key is the passphrase holder's decision."""
        with self._mutex, write_lock(self.path):
            doc = self._load()
            rec = self._record(doc, label)
            self._unlocked_key(doc)
            replace(doc, records=tuple(r for r in doc.records if r is not rec)).write(self.path)
            self._cache.pop((label, rec.info.public_key), None)

    def reserve_serials(self, count: int) -> range:
        """`count` certificate serials no earlier or later reservation gets: the file
        keeps the last one handed out, so a restart, a crash or a second gateway on
        the same vault never repeats one (a crash only skips the unused rest)."""
        with self._mutex, write_lock(self.path):
            doc = self._load()
            self._unlocked_key(doc)
            if doc.serial + count >= 2**64:
                raise VaultError(f"the vault {self.path} has no certificate serials left")
            replace(doc, serial=doc.serial + count).write(self.path)
        return range(doc.serial + 1, doc.serial + count + 1)

    def put_secret(self, label: str, secret: bytes) -> None:
        """Seal a secret under `label`, replacing one of the same label."""
        check_label(label)
        with self._mutex, write_lock(self.path):
            doc = self._load()
            sec = Secret.seal(label, self._unlocked_key(doc), bytes(secret))
            kept = tuple(s for s in doc.secrets if s.label != label)
            replace(doc, secrets=(*kept, sec)).write(self.path)

    def secret(self, label: str) -> bytes:
        """A sealed secret's bytes; VaultError naming the label if there is none."""
        with self._mutex:
            doc = self._load()
            key = self._unlocked_key(doc)
            sec = next((s for s in doc.secrets if s.label == label), None)
            if sec is None:
                raise VaultError(f"no secret labelled {label!r} in the vault {self.path}")
            try:
                return sec.open(key)
            except InvalidTag:
                raise VaultError(f"secret {label!r} in the vault {self.path}: tampered") from None

    def secret_labels(self) -> list[str]:
        return [s.label for s in self._load().secrets]

    def private_key(self, label: str) -> asyncssh.SSHKey:
        with self._mutex:
            self._unlocked_key()
            doc = self._load()
            rec = self._record(doc, label)
            cached = self._cache.get((label, rec.info.public_key))
            if cached is not None:
                return cached
            try:
                key = self._open_record(self._unlocked_key(), rec)
            except InvalidTag:
                self._unlocked_key(doc)  # a re-keyed vault is not tampering: say so
                raise VaultError(
                    f"key {label!r} in the vault {self.path}: record tampered "
                    "or corrupt (authentication failed)"
                ) from None
            self._cache[(label, rec.info.public_key)] = key
            return key

    def _open_record(self, key: bytearray, rec: Record) -> asyncssh.SSHKey:
        """Decrypt one record and check it against its public line (InvalidTag if
        the AEAD fails)."""
        private = asyncssh.import_private_key(rec.open(key))
        if private.export_public_key("openssh").decode().strip() != rec.info.public_key:
            raise VaultError(
                f"key {rec.info.label!r} in the vault {self.path}: record tampered "
                "(private key does not match its public key)"
            )
        return private

    def check_passphrase(self, passphrase: bytes) -> None:
        """WrongPassphrase unless `passphrase` opens this vault: what enrolling or removing
        an operator's credential asks for on top of an unlocked vault (`gateway/operators`)."""
        doc = self._load()
        key = doc.kdf.derive(passphrase)
        try:
            if not doc.matches(key):
                raise WrongPassphrase(f"wrong passphrase for the vault {self.path}")
        finally:
            wipe(key)

    def read_private_key(self, passphrase: bytes, label: str) -> asyncssh.SSHKey:
        """One key, for one offline read (e.g. `bastion audit activity` with no
        gateway running): no epoch change, nothing kept unlocked."""
        doc = self._load()
        rec = self._record(doc, label)
        key = doc.kdf.derive(passphrase)
        try:
            if not doc.matches(key):
                raise WrongPassphrase(f"wrong passphrase for the vault {self.path}")
            return self._open_record(key, rec)
        except InvalidTag:
            raise VaultError(f"key {label!r} in the vault {self.path}: record tampered") from None
        finally:
            wipe(key)
