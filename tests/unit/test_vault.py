"""The vault's promises: keys sealed per label, wrong passphrases change nothing, the epoch
only rises, and no error or file ever shows key bytes."""

from __future__ import annotations

import base64
import importlib.util
import json
import shutil
import stat
import subprocess
import threading
import traceback
from pathlib import Path

import asyncssh
import pytest

from bastion import vault as vault_mod
from bastion.vault import (
    KeyFilePassphraseNeeded,
    Vault,
    VaultError,
    VaultLocked,
    WrongPassphrase,
    load_private_key_file,
)

PW = b"correct horse battery staple"
needs_keygen = pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="no ssh-keygen")


@pytest.fixture(autouse=True)
def cheap_scrypt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vault_mod, "SCRYPT_N", 2**10)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "vault.json"


@pytest.fixture
def v(path: Path) -> Vault:
    return Vault.create(path, PW)


def _doc(path: Path) -> dict:
    return json.loads(path.read_bytes())


def _put(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc))


def _assert_sealed(path: Path, private_pem: bytes) -> None:
    """No line of a private key file's body appears in the vault, apart from public parts."""
    text = path.read_text()
    for rec in _doc(path)["keys"]:
        text = text.replace(rec["public_key"].split()[1], "")
    body = [line for line in private_pem.decode().splitlines() if "-----" not in line]
    assert body and not [line for line in body if len(line) >= 16 and line in text]


def test_default_kdf_is_scrypt_2_15(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    monkeypatch.undo()
    Vault.create(path, PW)
    doc = _doc(path)
    assert doc["format"] == "bastion-vault-1"
    assert (doc["kdf"]["name"], doc["kdf"]["n"], doc["kdf"]["r"], doc["kdf"]["p"]) == (
        "scrypt",
        2**15,
        8,
        1,
    )
    assert len(base64.b64decode(doc["kdf"]["salt"])) == 16


def test_epoch_is_monotonic_across_lock_unlock_and_reopen(path: Path) -> None:
    v = Vault.create(path, PW)
    assert (v.locked, v.epoch) == (False, 1)
    assert v.lock() == 2 and v.locked
    assert v.lock() == 2  # locking a locked vault is a no-op
    again = Vault.open(path)
    assert (again.locked, again.epoch) == (True, 2)
    assert again.unlock(PW) == 3
    assert again.unlock(PW) == 4  # re-verifies and still bumps
    assert v.unlock(PW) == 5  # a stale handle still moves forward
    assert Vault.open(path).epoch == 5
    doc = _doc(path)
    doc["epoch"] = 1  # a rolled-back file cannot make this handle step back
    _put(path, doc)
    assert v.lock() == 6
    assert _doc(path)["epoch"] == 6


def test_create_refuses_existing_and_open_explains_missing_or_corrupt(path: Path) -> None:
    with pytest.raises(VaultError, match="bastion init"):
        Vault.open(path)
    Vault.create(path, PW)
    before = path.read_bytes()
    with pytest.raises(VaultError, match="already exists"):
        Vault.create(path, b"other")
    assert path.read_bytes() == before
    for bad in (
        b"not json",
        b"[]",
        b'{"format": "other"}',
        before.replace(b'"n": 1024', b'"n": 3'),
    ):
        path.write_bytes(bad)
        with pytest.raises(VaultError, match=r"corrupt.*bastion init"):
            Vault.open(path)


def test_wrong_passphrase_changes_nothing(v: Vault, path: Path) -> None:
    v.lock()
    before = path.read_bytes()
    h = Vault.open(path)
    with pytest.raises(WrongPassphrase) as exc:
        h.unlock(b"wrong horse")
    assert "wrong horse" not in str(exc.value)
    assert path.read_bytes() == before
    assert (h.locked, h.epoch) == (True, 2)
    assert path.read_bytes() == before and h.epoch == 2
    h.unlock(PW)
    with pytest.raises(WrongPassphrase):
        h.unlock(b"wrong")
    assert not h.locked and h.epoch == 3


def test_repr_and_lock_wipe_key(v: Vault) -> None:
    key = v._key
    assert key is not None and any(key)
    assert bytes(key).hex() not in repr(v) and "bytearray" not in repr(v)
    assert repr(v) == f"Vault(path={str(v.path)!r}, locked=False, epoch=1)"
    v.generate("a")
    v.private_key("a")
    v.lock()
    assert not any(key) and v._cache == {}
    with pytest.raises(VaultLocked):
        v.private_key("a")
    with pytest.raises(VaultLocked):
        v.generate("b")
    with pytest.raises(VaultLocked):
        v.add("b", asyncssh.generate_private_key("ssh-ed25519"))
    with pytest.raises(VaultLocked):
        v.remove("a")
    infos = v.list_keys()  # listing works locked
    assert [k.label for k in infos] == ["a"]
    assert v.key_info("a").public_key.endswith(" bastion:a")


@pytest.mark.parametrize(
    ("alg", "bits"), [("ssh-ed25519", None), ("ecdsa-sha2-nistp256", None), ("ssh-rsa", 3072)]
)
def test_generate_round_trips(v: Vault, path: Path, alg: str, bits: int | None) -> None:
    info = v.generate("k1", alg)
    assert info.algorithm == alg and info.public_key.startswith(alg + " ")
    assert info.public_key.endswith(" bastion:k1") and info.created_at.endswith("Z")
    key = Vault.open(path)
    key.unlock(PW)
    priv = key.private_key("k1")
    assert priv.export_public_key().decode().strip() == info.public_key
    assert priv.get_fingerprint("sha256") == info.fingerprint.strip()
    assert key.key_info("k1") == info
    if bits:
        from cryptography.hazmat.primitives.serialization import load_ssh_public_key

        assert load_ssh_public_key(info.public_key.encode()).key_size == bits
    _assert_sealed(path, priv.export_private_key("openssh"))
    _assert_sealed(path, priv.export_private_key("pkcs8-pem"))
    raw = priv.export_private_key("pkcs8-der")
    assert (
        base64.b64encode(raw).decode() not in path.read_text() and raw.hex() not in path.read_text()
    )


def test_fingerprint_matches_ssh_keygen(v: Vault, tmp_path: Path) -> None:
    if shutil.which("ssh-keygen") is None:
        pytest.skip("no ssh-keygen")
    info = v.generate("fp")
    pub = tmp_path / "fp.pub"
    pub.write_text(info.public_key + "\n")
    out = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, check=True)
    assert out.stdout.decode().split()[1] == info.fingerprint


def test_duplicate_and_unknown_labels(v: Vault, path: Path) -> None:
    v.generate("dup")
    before = path.read_bytes()
    with pytest.raises(VaultError, match="a key labelled 'dup' already exists"):
        v.generate("dup")
    with pytest.raises(VaultError, match="already exists"):
        v.add("dup", asyncssh.generate_private_key("ssh-ed25519"))
    assert path.read_bytes() == before
    with pytest.raises(VaultError, match="no key labelled 'nope'"):
        v.key_info("nope")
    with pytest.raises(VaultError, match="cannot generate"):
        v.generate("x", "ssh-dss")
    v.remove("dup")
    with pytest.raises(VaultError, match="no key labelled 'dup'"):
        v.private_key("dup")


@pytest.mark.parametrize("label", ["", "-x", ".x", "a b", "a/b", "x" * 65, "ü", "a\n"])
def test_bad_label(v: Vault, label: str) -> None:
    with pytest.raises(VaultError, match="invalid key label"):
        v.generate(label)
    with pytest.raises(VaultError, match="invalid key label"):
        v.key_info(label)


def test_good_labels(v: Vault) -> None:
    for label in ("a", "A.b_c-d", "9" * 64):
        assert v.generate(label).label == label


def test_file_mode_and_no_temp_leftovers(v: Vault, path: Path) -> None:
    v.generate("m")
    v.lock()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lock = path.with_name(path.name + ".lock")
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, lock.name]


def test_tampering_is_detected(v: Vault, path: Path) -> None:
    v.generate("one")
    v.generate("two")
    v.generate("three", "ecdsa-sha2-nistp256")
    good = _doc(path)
    h = Vault.open(path)
    h.unlock(PW)

    def expect_tampered(mutate: object, label: str) -> None:
        doc = json.loads(json.dumps(good))
        mutate(doc["keys"])  # type: ignore[operator]
        _put(path, doc)
        with pytest.raises(VaultError, match=f"{label}.*tampered"):
            h.private_key(label)

    def swap(keys: list) -> None:
        for f in ("nonce", "ciphertext"):
            keys[0][f], keys[1][f] = keys[1][f], keys[0][f]

    def pub_swap(keys: list) -> None:
        keys[0]["public_key"] = keys[1]["public_key"].replace("bastion:two", "bastion:one")

    def rename(keys: list) -> None:
        keys[0]["label"] = "renamed"
        keys[0]["public_key"] = keys[0]["public_key"].replace("bastion:one", "bastion:renamed")

    def bitflip(keys: list) -> None:
        ct = bytearray(base64.b64decode(keys[2]["ciphertext"]))
        ct[10] ^= 1
        keys[2]["ciphertext"] = base64.b64encode(ct).decode()

    expect_tampered(swap, "one")
    expect_tampered(pub_swap, "one")
    expect_tampered(rename, "renamed")
    expect_tampered(bitflip, "three")
    _put(path, good)
    assert (
        h.private_key("two").export_public_key().decode().strip() == good["keys"][1]["public_key"]
    )
    doc = json.loads(json.dumps(good))
    doc["verifier"]["ciphertext"] = doc["keys"][0]["ciphertext"][:64]
    _put(path, doc)
    with pytest.raises(WrongPassphrase):
        Vault.open(path).unlock(PW)


def test_other_process_changes_are_seen(v: Vault, path: Path) -> None:
    other = Vault.open(path)
    other.unlock(PW)
    info = other.generate("from-cli")
    assert v.private_key("from-cli").export_public_key().decode().strip() == info.public_key
    other.remove("from-cli")
    with pytest.raises(VaultError, match="no key labelled"):
        v.private_key("from-cli")
    other.generate("from-cli")  # same label, new key: the cache must not serve the old one
    assert v.key_info("from-cli").public_key != info.public_key
    assert v.private_key("from-cli").export_public_key().decode().strip() != info.public_key


def test_recreated_vault_is_not_written_with_a_stale_key(v: Vault, path: Path) -> None:
    path.unlink()
    Vault.create(path, b"another passphrase").generate("new")
    before = path.read_bytes()
    with pytest.raises(VaultError, match="unlock it again"):
        v.generate("mine")
    with pytest.raises(VaultError, match="unlock it again"):
        v.private_key("new")
    assert path.read_bytes() == before


def test_concurrent_writers_lose_nothing(v: Vault, path: Path) -> None:
    handles = [Vault.open(path) for _ in range(3)]
    for h in handles:
        h.unlock(PW)

    def work(i: int, h: Vault) -> None:
        for j in range(5):
            h.generate(f"k{i}-{j}")

    threads = [threading.Thread(target=work, args=(i, h)) for i, h in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(v.list_keys()) == 15


def test_add_rejects_weak_or_unsupported_keys(v: Vault) -> None:
    with pytest.raises(VaultError, match="too weak"):
        v.add("rsa1024", asyncssh.generate_private_key("ssh-rsa", key_size=1024))
    with pytest.raises(VaultError, match="unsupported key type ssh-dss"):
        v.add("dsa", asyncssh.generate_private_key("ssh-dss"))
    src = asyncssh.generate_private_key("ssh-ed25519", comment="laptop")
    info = v.add("ok", src)
    assert info.public_key.endswith(" bastion:ok") and src.get_comment() == "laptop"


def _keygen(tmp_path: Path, name: str, *args: str, pw: str = "") -> Path:
    out = tmp_path / name
    subprocess.run(
        ["ssh-keygen", "-q", "-N", pw, "-C", "test", "-f", str(out), *args],
        check=True,
        capture_output=True,
    )
    return out


KEYGEN_CASES = [
    ("ed25519-openssh", ["-t", "ed25519"]),
    ("ecdsa-pem", ["-t", "ecdsa", "-m", "PEM"]),
    ("rsa-pem", ["-t", "rsa", "-b", "2048", "-m", "PEM"]),
    ("ecdsa-pkcs8", ["-t", "ecdsa", "-b", "384", "-m", "PKCS8"]),
    ("rsa-pkcs8", ["-t", "rsa", "-b", "2048", "-m", "PKCS8"]),
]


@needs_keygen
@pytest.mark.parametrize(("name", "args"), KEYGEN_CASES)
def test_import_key_files(v: Vault, tmp_path: Path, path: Path, name: str, args: list[str]) -> None:
    plain = _keygen(tmp_path, name, *args)
    secret = _keygen(tmp_path, name + "-enc", *args, pw="key pass")
    expected = plain.with_suffix(".pub").read_text().split()[:2]
    key = load_private_key_file(plain.read_bytes(), None)
    assert key.export_public_key().decode().split()[:2] == expected
    info = v.add(name, key)
    assert info.public_key.split()[:2] == expected
    assert v.private_key(name).export_public_key().decode().split()[:2] == expected
    _assert_sealed(path, plain.read_bytes())

    data = secret.read_bytes()
    with pytest.raises(KeyFilePassphraseNeeded):
        load_private_key_file(data, None)
    if b"OPENSSH" in data and importlib.util.find_spec("bcrypt") is None:
        with pytest.raises(VaultError, match="bcrypt is not installed"):
            load_private_key_file(data, b"key pass")
        return
    with pytest.raises(VaultError, match=r"^wrong passphrase for key file$"):
        load_private_key_file(data, b"bad pass")
    enc_key = load_private_key_file(data, b"key pass")
    assert (
        enc_key.export_public_key().decode().split()[:2]
        == secret.with_suffix(".pub").read_text().split()[:2]
    )


MARKER = b"Zq8SECRETMATERIALx7Y"


@pytest.mark.parametrize(
    "data",
    [
        MARKER * 10,
        b"-----BEGIN OPENSSH PRIVATE KEY-----\n" + base64.b64encode(MARKER * 8) + b"\n"
        b"-----END OPENSSH PRIVATE KEY-----\n",
        b"-----BEGIN " + MARKER + b" PRIVATE KEY-----\n" + base64.b64encode(MARKER) + b"\n"
        b"-----END " + MARKER + b" PRIVATE KEY-----\n",
        b"-----BEGIN RSA PRIVATE KEY-----\n" + base64.b64encode(b"\x30\x03" + MARKER) + b"\n"
        b"-----END RSA PRIVATE KEY-----\n",
        b"ssh-ed25519 " + base64.b64encode(MARKER) + b" " + MARKER,
        b"\x00" * 5000 + MARKER,
    ],
)
def test_malformed_key_file_never_echoes_bytes(data: bytes) -> None:
    with pytest.raises(VaultError, match=r"^not a private key: ") as exc:
        load_private_key_file(data, None)
    rendered = "".join(traceback.format_exception(exc.value))
    for needle in (MARKER.decode(), base64.b64encode(MARKER).decode()[:16]):
        assert needle not in rendered


def test_unsupported_key_file_type() -> None:
    data = asyncssh.generate_private_key("ssh-dss").export_private_key("openssh")
    with pytest.raises(VaultError, match="unsupported key type"):
        load_private_key_file(data, None)


def test_read_private_key_is_a_one_shot_offline_read(v: Vault, path: Path) -> None:
    info = v.generate("audit")
    v.lock()
    before, epoch = path.read_bytes(), Vault.open(path).epoch
    h = Vault.open(path)
    key = h.read_private_key(PW, "audit")
    assert key.export_public_key().decode().split()[:2] == info.public_key.split()[:2]
    assert h.locked and h.epoch == epoch and path.read_bytes() == before
    with pytest.raises(WrongPassphrase):
        h.read_private_key(b"nope", "audit")
    with pytest.raises(VaultError):
        h.read_private_key(PW, "missing")
