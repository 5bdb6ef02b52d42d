"""The vault room: the only place private keys exist at rest.

- `store`: the vault in memory, the handle the gateway and the CLI hold; this face
  names its public names.
- `file_format`: the vault's file: its format, its parser, its locked atomic writes.
"""

from bastion.vault.store import (
    KDF_PROFILES,
    RESERVED_PREFIX,
    KeyFilePassphraseNeeded,
    KeyInfo,
    Vault,
    VaultError,
    VaultLocked,
    WrongPassphrase,
    load_private_key_file,
)

__all__ = [
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
